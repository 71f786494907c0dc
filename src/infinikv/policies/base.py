"""The policy contract's composing half: a ``Policy`` declares its options and budget, builds each
layer's cache from stages (``cache``: slots, an evictor, a two-tier fetcher), and answers what
the CLI, the server and the planner ask through its declared capabilities (``options``,
``worst_case_bytes``, ``longest``, ``needs_preparation``/``prepare``, ``compilable``, ``cost``,
``describe``/``label``), never through its name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..cache import Evictor, KVCache, KVLayer
from ..contract import Budget, Cost, Option, Preparing, Rule
from ..errors import InfinikvError
from ..kv.slots import Slots
from ..sizes import bytes_per_token, windows
from .window import window_layer

Reader = Callable[[str, int], torch.Tensor]  # a text's name and a token count -> its first tokens (1, n)

# Tokens per prefill forward on a CPU, measured through `infinikv generate` (SmolLM2 int4, an
# 8,000-token prompt; the table in docs/policies/index.md, "Prefill in chunks"). A policy that
# evicts reads PREFILL_CHUNK at a time, no more than it keeps (bct 1,024: 26 s and 277 MiB above the
# model, against 94 s and 2,030 MiB in one chunk). One that keeps every token holds the prompt's
# K/V anyway and reads up to KEEP_ALL_PREFILL_CHUNK at once: a first chunk runs the causal kernel
# (full: 28 s against 36 s in chunks of 512, and chunks of 1,024 to 4,096 were no faster), for
# temporaries of 880 MiB against 555 MiB.
PREFILL_CHUNK = 512
KEEP_ALL_PREFILL_CHUNK = 8192
PREFILL = Option("prefill_chunk", int, 0, "tokens per prefill forward; 0: the policy's own choice", lambda n: n >= 0)


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
    cost: ClassVar[Cost | None] = None  # what the offload planner models of it (None: not modelled)
    past_trained_context: ClassVar[bool] = False  # some setting of it runs past the trained context (``longest``)

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
        """The options this policy takes: its parts' (``part_options``) and ``--prefill-chunk``."""
        return cls.part_options() + (PREFILL,)

    @classmethod
    def part_options(cls) -> tuple[Option, ...]:
        """``options``, plus any a policy gathers from its parts."""
        return cls.options

    # -- building ----------------------------------------------------------------------------
    @abstractmethod
    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        """Layer ``index``'s cache layer; ``static``: slots for a compiled step (see ``make_cache``)."""

    def make_cache(self, model: torch.nn.Module, max_length: int | None = None, static: bool = False) -> KVCache:
        """A fresh cache for one batch with ``model``. ``static`` fixes every shape of the decode
        step for ``torch.compile`` (``compilable`` policies); ``max_length``, the tokens a sequence
        will see, sizes the static storage of a policy that keeps every token (``full``)."""
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
    def prefill_chunk(self, model: torch.nn.Module, prompt_tokens: int | None) -> int | None:
        """Tokens per prefill forward for a prompt of ``prompt_tokens`` (None: not known yet, as for
        transformers' ``generate``): ``--prefill-chunk``, else ``KEEP_ALL_PREFILL_CHUNK`` (a policy
        that evicts reads no more than it keeps). None: the whole prompt in one forward."""
        return self.params["prefill_chunk"] or KEEP_ALL_PREFILL_CHUNK

    def worst_case_tokens(self, config: Any, prompt_tokens: int, max_new_tokens: int, chunk: int | None = None) -> int:
        """The most tokens a layer holds for one request whose prompt is prefilled ``chunk`` tokens
        a forward (None: at once; see ``Budget.worst_case``)."""
        total = prompt_tokens + max_new_tokens
        return total if self.budget is None else self.budget.worst_case(prompt_tokens, total, chunk=chunk)

    def longest(self, model: torch.nn.Module) -> int | None:
        """The most tokens (prompt + generated) a request may run to under this policy on ``model``:
        the trained context, since keys keep the positions they were seen at; None: no limit."""
        return getattr(model.config, "max_position_embeddings", None)

    def token_bytes(self, config: Any) -> int:
        """K/V bytes one token takes in one of the layers this policy manages, in the model's dtype."""
        return bytes_per_token(config)

    def worst_case_bytes(self, config: Any, prompt_tokens: int, max_new_tokens: int, chunk: int | None = None) -> int:
        """K/V bytes a request can hold at most (what a server's admission reserves), its prompt
        prefilled ``chunk`` tokens a forward (None: at once): the policy's layers, plus each
        sliding-window layer's window (see ``window``)."""
        total, spans = prompt_tokens + max_new_tokens, windows(config)
        managed = sum(w is None for w in spans) * self.token_bytes(config)
        windowed = [Budget(tokens=w - 1) for w in spans if w is not None]
        bounded = sum(window.worst_case(prompt_tokens, total, fixed=True, chunk=chunk) for window in windowed)
        tokens = self.worst_case_tokens(config, prompt_tokens, max_new_tokens, chunk)
        return tokens * managed + bounded * bytes_per_token(config)

    def prepare(self, model: torch.nn.Module, read: Reader, how: Preparing) -> str | None:
        """Load the policy's saved preparation for ``model``, or run it (on ``read(how.calibration,
        how.tokens)``, the policy's defaults where None; again with ``how.force``) and save it; says
        what it did, None if nothing. Called through ``preparation.ensure_prepared``, which reads texts."""
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
    def part_options(cls) -> tuple[Option, ...]:
        return cls.options + cls.rule.options

    def prefill_chunk(self, model: torch.nn.Module, prompt_tokens: int | None) -> int | None:
        """``PREFILL_CHUNK``, no more than a fixed capacity, so the storage holds at most capacity +
        chunk tokens (a ``--budget`` fraction keeps ``PREFILL_CHUNK``: a prompt's chunks then never
        depend on its length, and a batch's rows are cut as each would be alone)."""
        budget = self.kept(model)
        if self.params["prefill_chunk"] or budget is None or budget.tokens is None:
            return self.params["prefill_chunk"] or PREFILL_CHUNK
        return min(PREFILL_CHUNK, budget.tokens)

    def kept(self, model: torch.nn.Module) -> Budget | None:
        """The budget of tokens each layer keeps on ``model``."""
        return self.budget

    def make_rule(self, rule: type[Rule] | None = None) -> Rule:
        rule = rule or self.rule
        return rule(**{o.name: self.params[o.name] for o in rule.options})

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        slots = Slots(size=static, static=static is not None)
        return KVLayer(slots, Evictor(self.make_rule(), self.budget, fixed=static is not None))

    def static_size(self, model: torch.nn.Module, max_length: int | None) -> int:
        if self.budget.tokens is None:
            raise InfinikvError(f"compiling {self.label()} needs --capacity (a --budget fraction makes its cache grow)")
        return self.budget.tokens + 1
