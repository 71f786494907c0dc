"""The contract every part of a KV policy is written against, importing nothing of infinikv's
but its error type: options, budgets, how a preparation runs, eviction rules and the cost a
policy declares to the offload planner. The cache stages, the policies and the planner import
this module; storage (``kv``) imports neither it nor them, and it imports none of them (only,
for annotations, the slots' types).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .errors import InfinikvError

if TYPE_CHECKING:
    from .kv.slots import Slots, StateSpec

TRUE, FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
REFERENCE = "full"  # the policy every other one is measured against: it keeps every token


@dataclass(frozen=True)
class Option:
    """A policy parameter: ``--NAME`` on the command line, ``"name"`` in a JSON ``kv`` spec."""

    name: str
    type: type
    default: Any
    help: str
    check: Callable[[Any], bool] | None = None  # a value is accepted when check(value) is true

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, value: Any) -> Any:
        """A value from a flag (a string) or from JSON (typed), converted and checked."""
        try:
            if self.type is bool and not isinstance(value, bool):
                text = str(value).lower()
                if text not in TRUE | FALSE:
                    raise ValueError
                parsed: Any = text in TRUE
            elif self.type is int and isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                parsed = int(value)
            elif self.type in (int, float) and isinstance(value, bool):
                raise ValueError
            else:
                parsed = self.type(value)
        except (TypeError, ValueError):
            raise InfinikvError(f"{self.flag} expects {self.type.__name__}, got {value!r}") from None
        if self.check is not None and not self.check(parsed):
            raise InfinikvError(f"{self.flag} {parsed} is out of range ({self.help})")
        return parsed


@dataclass(frozen=True)
class Preparing:
    """How a policy's preparation (InfiniGen's calibration) runs: on which text and how many of its
    tokens (None: the policy's defaults), again even when one is saved (``force``), with a
    progress bar or not."""

    calibration: str | None = None
    tokens: int | None = None
    force: bool = False
    progress: bool = False


@dataclass(frozen=True)
class Budget:
    """How many tokens a layer may keep: a fraction of the tokens seen, or a fixed count."""

    fraction: float | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.tokens is None):
            raise InfinikvError("give exactly one of --budget FRACTION or --capacity TOKENS")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise InfinikvError(f"--budget must be in (0, 1], got {self.fraction}")
        if self.tokens is not None and self.tokens < 1:
            raise InfinikvError(f"--capacity must be at least 1 token, got {self.tokens}")

    def capacity(self, seen: int, part: float = 1.0) -> int:
        """Tokens a sequence that has seen ``seen`` real tokens may keep in a layer given ``part``
        of an even share (a rule may spread the budget over the layers, ``Rule.spread``: rounded
        down, so the layers together never keep more than even shares would)."""
        even = self.tokens if self.tokens is not None else max(1, math.ceil(seen * self.fraction))
        return max(1, math.floor(even * part))

    def worst_case(self, prompt_tokens: int, total: int, fixed: bool = False, chunk: int | None = None) -> int:
        """The most tokens a layer under this budget holds for a request of ``total`` tokens: the
        prompt until the prefill evicts (prefilled ``chunk`` tokens a forward: at most capacity +
        chunk), then its capacity plus the one token a decode step adds before evicting. ``fixed``:
        the capacity is settled by the prompt and allocated once, capacity plus one slots, however
        few tokens the request has."""
        capacity = self.capacity(prompt_tokens if fixed else total)
        prefill = prompt_tokens if chunk is None else min(prompt_tokens, capacity + chunk)
        most = max(prefill, capacity + 1)
        return most if fixed else min(total, most)

    def __str__(self) -> str:
        return f"{self.fraction:g}" if self.fraction is not None else f"{self.tokens} tokens"


@dataclass(frozen=True)
class Scoring:
    """What a rule may use to score slots: the slots' length, each row's capacity and the
    position of its newest token, as ``(b, 1, 1)`` tensors."""

    length: int
    capacity: torch.Tensor
    newest: torch.Tensor


class Rule(ABC):
    """An eviction rule: scores each slot, higher kept; when a row is over its capacity the layer
    drops its lowest-scored valid slots (one ``argmin`` per decode step). A rule that needs the
    attention probabilities sets ``observes``; per-slot state it keeps is declared in ``state``
    and moves with its slot. ``evict`` may do more than drop (``merge`` folds a victim first).
    A rule that scores a prompt by a second reading of it sets ``rereads``: the decode core reads
    the prompt twice first and hands it the scores (``given``); it must need no attention, as its
    cache may store the first reading's K/V without a forward (``KVLayer.take``).
    """

    name: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    observes: ClassVar[bool] = False
    rereads: ClassVar[bool] = False
    state: ClassVar[dict[str, StateSpec]] = {}

    def __init__(self, **params: Any) -> None:
        self.params = params

    def observe(self, slots: Slots, mass: torch.Tensor, last: torch.Tensor, queries: int) -> None:
        """Attention each slot received ``(b, h, L)`` from a forward of ``queries`` queries: ``mass``
        summed over them and the KV head's query heads; ``last`` from the newest ``watched()`` only."""
        return None

    def watched(self) -> int:
        """How many of a forward's newest queries ``observe``'s ``last`` sums (1: the newest)."""
        return 1

    @abstractmethod
    def scores(self, slots: Slots, at: Scoring) -> torch.Tensor:
        """Keep-scores of the first ``at.length`` slots ``(b, h, L)``; ``inf`` means never evict."""

    def given(self, slots: Slots, table: torch.Tensor | None, lengths: torch.Tensor | None) -> None:
        """A ``rereads`` rule's prompt scores ``(b, h, T)`` by position, for each row's first
        ``lengths`` ``(b, 1, 1)`` positions (the prompt's), before the prompt is fed into ``slots``;
        None once it is all in."""
        return None

    def spread(self, tables: list[torch.Tensor], lengths: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
        """A ``rereads`` rule's parts of an even share of the budget ``(L, b)``, one per layer of
        ``tables`` (each ``(b, h, T)``, as ``given`` takes them) and row, averaging 1 over the
        layers; ``keep`` ``(b,)``: the share of each row's prompt the budget keeps. None: even."""
        return None

    def logit_bias(self, slots: Slots, length: int) -> torch.Tensor | None:
        """An additive attention-logit bias per slot ``(b, h, L)``, or None."""
        return None

    def evict(self, slots: Slots, victims: torch.Tensor, take: torch.Tensor | None, length: int) -> None:
        """Remove ``victims`` (b, h, k) (where ``take``, when given)."""
        slots.drop(victims, take)


@dataclass(frozen=True)
class Cost:
    """What the offload planner (``bench plan``) models of a policy, as shares of the full fp16
    K/V: what it ``stores`` and what a decode step ``reads`` (and attends to), each a function of
    the policy's modelled ``share`` (``(kind, default)``: ``"fetch"``, the share InfiniGen fetches,
    or ``"keep"``, the share an evicting policy keeps; measured by ``bench speed`` when given) and
    of the share of layers the planner treats as dense; ``partial``: it keeps InfiniGen's partial
    keys and query weights on the GPU. ``name`` labels the planner's row."""

    name: str
    stores: Callable[[float, float], float]
    reads: Callable[[float, float], float]
    share: tuple[str, float] | None = None
    partial: bool = False
