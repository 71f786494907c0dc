"""The policy contract: options, budgets, eviction rules, and the ``Policy`` that composes them.

A policy is declared once and built from parts with one job each (see ``layer.KVLayer``):
slot storage (growing, or allocated once), an eviction ``Rule`` (scores per slot; the layer
drops the lowest), an optional fetcher (two tiers) and an optional re-positioner. What the CLI
and the server need from a policy they ask through its declared capabilities (``options``,
``worst_case_bytes``, ``needs_preparation``/``prepare``, ``compilable``, ``describe``/``label``),
never through its name.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import InfinikvError
from ..kv.slots import Slots, StateSpec

if TYPE_CHECKING:
    from .layer import KVCache, KVLayer

TRUE, FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


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

    def capacity(self, seen: int) -> int:
        """Tokens a sequence that has seen ``seen`` real tokens may keep."""
        if self.tokens is not None:
            return self.tokens
        return max(1, math.ceil(seen * self.fraction))

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
    """

    name: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    observes: ClassVar[bool] = False
    state: ClassVar[dict[str, StateSpec]] = {}

    def __init__(self, **params: Any) -> None:
        self.params = params

    def observe(self, slots: Slots, mass: torch.Tensor, last: torch.Tensor) -> None:
        """Attention each slot received ``(b, h, L)``: ``mass`` summed over this forward's queries and
        the KV head's query heads; ``last`` from the newest query only."""
        return None

    @abstractmethod
    def scores(self, slots: Slots, at: Scoring) -> torch.Tensor:
        """Keep-scores of the first ``at.length`` slots ``(b, h, L)``; ``inf`` means never evict."""

    def logit_bias(self, slots: Slots, length: int) -> torch.Tensor | None:
        """An additive attention-logit bias per slot ``(b, h, L)``, or None."""
        return None

    def evict(self, slots: Slots, victims: torch.Tensor, take: torch.Tensor | None, length: int) -> None:
        """Remove ``victims`` (b, h, k) (where ``take``, when given)."""
        slots.drop(victims, take)


RULES: dict[str, type[Rule]] = {}


def register_rule(cls: type[Rule]) -> type[Rule]:
    """Class decorator: make an eviction rule available by its ``name`` (to ``bct --update-rule``)."""
    RULES[cls.name] = cls
    return cls


def rule_options() -> dict[str, Option]:
    """Every registered rule's options by name (rules sharing a name share its meaning)."""
    return {o.name: o for cls in RULES.values() for o in cls.options}


def model_shape(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a transformers config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, n_kv, head_dim


def sliding_window(config: Any, index: int) -> int | None:
    """The tokens a query of layer ``index`` sees (itself included) when the model bounds that
    layer's attention to a sliding window (Gemma 3's local layers, Mistral), else None."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and types[index] != "sliding_attention"):
        return None
    return window


def windows(config: Any) -> list[int | None]:
    """``sliding_window`` of every layer."""
    return [sliding_window(config, i) for i in range(config.num_hidden_layers)]


def bytes_per_token(config: Any, dtype: torch.dtype = torch.float32) -> int:
    """K and V bytes one token takes in one layer of a model with ``config``."""
    _, n_kv, head_dim = model_shape(config)
    return 2 * n_kv * head_dim * torch.empty((), dtype=dtype).element_size()


class Policy(ABC):
    """A KV policy: its name, budget and options, the parts of each layer, and its capabilities.

    Subclasses set ``name``, a docstring saying what they keep and why (with the paper), their
    ``options`` and implement ``layer``. ``takes_budget = False`` marks policies without a budget.
    """

    name: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    takes_budget: ClassVar[bool] = True
    needs_preparation: ClassVar[bool] = False  # a calibration must run (``prepare``) before caches are built
    compilable: ClassVar[bool] = False  # its decode step can have static shapes (``static_size``)

    def __init__(self, budget: float | None = None, capacity: int | None = None, **params: Any) -> None:
        known = {o.name: o for o in self.all_options()}
        unknown = set(params) - set(known)
        if unknown:
            raise InfinikvError(f"policy {self.name!r} has no parameter {sorted(unknown)[0]!r}")
        self.given = {name: known[name].parse(value) for name, value in params.items()}
        self.params = {name: self.given.get(name, o.default) for name, o in known.items()}
        self.budget = self.make_budget(budget, capacity)

    def make_budget(self, budget: float | None, capacity: int | None) -> Budget | None:
        """The budget from ``--budget``/``--capacity``; policies without one ignore both."""
        if not self.takes_budget:
            return None
        if budget is None and capacity is None:
            raise InfinikvError(f"policy {self.name!r} needs --budget FRACTION or --capacity TOKENS")
        return Budget(budget, capacity)

    @classmethod
    def all_options(cls) -> tuple[Option, ...]:
        """The options this policy takes (``options``, plus any a policy gathers from its parts)."""
        return cls.options

    # -- building ----------------------------------------------------------------------------
    @abstractmethod
    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        """Layer ``index``'s cache layer; ``static``: slots for a compiled step (see ``make_cache``)."""

    def make_cache(self, model: torch.nn.Module, max_length: int | None = None, static: bool = False) -> KVCache:
        """A fresh cache for one batch with ``model``. ``static`` fixes every shape of the decode
        step for ``torch.compile`` (``compilable`` policies); ``max_length``, the tokens a sequence
        will see, sizes the static storage of a policy that keeps every token (``full``)."""
        from .layer import KVCache
        from .window import window_layer

        size = self.static_size(model, max_length) if static else None
        layers = [
            self.layer(i, model, size) if window is None else window_layer(window, static)
            for i, window in enumerate(windows(model.config))
        ]
        return KVCache(layers, self.describe(), self.label())

    def static_size(self, model: torch.nn.Module, max_length: int | None) -> int:
        """Slots per layer of a compiled decode step."""
        raise InfinikvError(f"policy {self.label()!r} cannot be compiled (its cache shapes change as it runs)")

    # -- capabilities ------------------------------------------------------------------------
    def worst_case_tokens(self, config: Any, prompt_tokens: int, max_new_tokens: int) -> int:
        """The most tokens a layer holds for one request: every prompt token until the prefill's
        eviction, then its capacity plus the one token a decode step adds before evicting."""
        total = prompt_tokens + max_new_tokens
        if self.budget is None:
            return total
        return min(total, max(prompt_tokens, self.budget.capacity(total) + 1))

    def token_bytes(self, config: Any) -> int:
        """K/V bytes one token takes in one of the layers this policy manages."""
        return bytes_per_token(config)

    def worst_case_bytes(self, config: Any, prompt_tokens: int, max_new_tokens: int) -> int:
        """K/V bytes a request can hold at most (what a server's admission reserves): the policy's
        layers, plus each sliding-window layer's window (see ``window``)."""
        total, spans = prompt_tokens + max_new_tokens, windows(config)
        managed = sum(w is None for w in spans) * self.token_bytes(config)
        bounded = sum(min(total, max(prompt_tokens, w)) for w in spans if w is not None) * bytes_per_token(config)
        return self.worst_case_tokens(config, prompt_tokens, max_new_tokens) * managed + bounded

    def prepare(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        progress: bool = False,
        calibration: str | None = None,
        tokens: int | None = None,
        force: bool = False,
    ) -> str | None:
        """Load the policy's saved preparation for ``model``, or run it (on ``calibration``, a text
        name, ``tokens`` long; again with ``force``) and save it; says what it did, None if nothing."""
        return None

    def prepared_on(self) -> str | None:
        """The text the loaded preparation was calibrated on (an evaluation should not use it)."""
        return None

    def describe(self) -> dict[str, Any]:
        """The policy as a result row: name, budget, capacity and the options it uses."""
        budget = self.budget
        return {
            "policy": self.name,
            "label": self.label(),
            "budget": budget.fraction if budget else None,
            "capacity": budget.tokens if budget else None,
            **self.params,
        }

    def label(self) -> str:
        """A short name that tells this policy's cells apart in tables (e.g. ``bct:merge``,
        ``infinigen alpha=8.0``); the budget is shown apart."""
        return self.named(self.name)

    def named(self, head: str, shown: tuple[str, ...] = ()) -> str:
        """``head`` followed by the options given by hand, but those ``head`` already shows."""
        return " ".join([head, *(f"{k}={v}" for k, v in self.given.items() if k not in shown)])

    def spec(self) -> dict[str, Any]:
        """The JSON form that ``policies.parse_spec`` turns back into this policy."""
        budget = self.budget
        out: dict[str, Any] = {"policy": self.name}
        if budget is not None:
            out["budget" if budget.fraction is not None else "capacity"] = budget.fraction or budget.tokens
        return {**out, **self.given}

    def __repr__(self) -> str:
        parts = ([f"budget={self.budget}"] if self.budget else []) + [f"{k}={v}" for k, v in self.given.items()]
        return f"{self.label()}({', '.join(parts)})" if parts else self.label()


class Evicting(Policy):
    """A policy that keeps a budget of tokens per layer by one eviction ``rule``: its storage grows
    with a ``--budget`` fraction, and is allocated once (capacity + 1 slots) when compiled."""

    rule: ClassVar[type[Rule]]

    @property
    def compilable(self) -> bool:  # a --budget fraction makes the storage grow
        return self.budget is not None and self.budget.tokens is not None

    @classmethod
    def all_options(cls) -> tuple[Option, ...]:
        return cls.options + cls.rule.options

    def make_rule(self, rule: type[Rule] | None = None) -> Rule:
        rule = rule or self.rule
        return rule(**{o.name: self.params[o.name] for o in rule.options})

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        from .layer import KVLayer

        slots = Slots(size=static, static=static is not None)
        return KVLayer(slots, self.make_rule(), self.budget, fixed=static is not None)

    def static_size(self, model: torch.nn.Module, max_length: int | None) -> int:
        if self.budget.tokens is None:
            raise InfinikvError(f"compiling {self.label()} needs --capacity (a --budget fraction makes its cache grow)")
        return self.budget.tokens + 1
