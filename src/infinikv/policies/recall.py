"""``recall``: both seeds in one cache. A bounded fast tier managed as ``bct`` manages its cache
(capacity allocated once, any update rule) whose evicted tokens are not lost: they move to a pool
kept as ``infinigen`` keeps its slow tier, and every decode step attends, beside the fast tier, to
the few pooled tokens InfiniGen's speculation picks for it. The fast tier's K/V are constant for
any length; the pool (and its partial keys, reported apart) grows with what was evicted. Built
from the two policies' stages (``cache.recall``), options of both.
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache import KVLayer, RecallLayer, TwoTier
from ..contract import Budget, Option, Preparing
from ..errors import InfinikvError
from ..kv.slots import Slots
from ..kv.tiers import slow_tier
from .base import Policy, Reader
from .bct import BoundedCache
from .infinigen import InfiniGen

UNBOUNDED_POOL = ("pool_capacity", "eviction")  # the pool keeps every token it is given
NUMBERED_AS_SEEN = "positions"  # a pooled key keeps the position its partial key was stored with


class Recall(Policy):
    """A bounded fast tier over InfiniGen's pool of everything it evicted."""

    name = "recall"
    needs_preparation = True

    def __init__(self, budget: float | None = None, capacity: int | None = None, **params: Any) -> None:
        super().__init__(budget, capacity, **params)
        fast = {o.name for o in BoundedCache.all_options()}
        given = {k: v for k, v in self.given.items() if k in fast}
        self.fast = BoundedCache(budget, capacity, **given, **{NUMBERED_AS_SEEN: "original"})
        self.seeker = InfiniGen(**{k: v for k, v in self.given.items() if k not in fast})

    @classmethod
    def part_options(cls) -> tuple[Option, ...]:
        fast = tuple(o for o in BoundedCache.part_options() if o.name != NUMBERED_AS_SEEN)
        return fast + tuple(o for o in InfiniGen.options if o.name not in UNBOUNDED_POOL)

    def prefill_chunk(self, model: torch.nn.Module, prompt_tokens: int | None) -> int | None:
        return self.fast.prefill_chunk(model, prompt_tokens)  # no more than its fast tier keeps

    def make_budget(self, budget: float | None, capacity: int | None) -> Budget | None:
        if budget is None and capacity is None and not self.params["kv_memory"]:
            raise InfinikvError(
                "recall needs the fast tier's size: --budget FRACTION, --capacity TOKENS or --kv-memory"
            )
        return None if budget is None and capacity is None else Budget(budget, capacity)

    def prepare(self, model: torch.nn.Module, read: Reader, how: Preparing) -> str | None:
        return self.seeker.prepare(model, read, how)

    def prepared_on(self) -> str | None:
        return self.seeker.prepared_on()

    @property
    def prep(self) -> dict[str, Any] | None:
        """The calibration speculation reads (InfiniGen's, see ``InfiniGen.prepare``)."""
        return self.seeker.prep

    @prep.setter
    def prep(self, prep: dict[str, Any] | None) -> None:
        self.seeker.prep = prep

    def make_cache(self, model: torch.nn.Module, max_length: int | None = None, static: bool = False):
        if static:
            raise InfinikvError("recall cannot be compiled (its pool grows)")
        self.fast.setup(model)
        self.seeker.setup(model)
        self.budget = self.fast.resolved
        return super().make_cache(model, max_length, static)

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        fast = self.fast.layer(index, model, None)
        if index < self.params["dense_layers"]:
            return fast
        pool = Slots(home=slow_tier(model))
        return RecallLayer(fast.slots, fast.evictor, pool, TwoTier(self.seeker.speculation(index, model, False)))

    def worst_case_tokens(self, config: Any, prompt_tokens: int, max_new_tokens: int, chunk: int | None = None) -> int:
        # the fast tier and the pool hold every token between them; the fast tier is allocated whole
        fast = self.fast.worst_case_tokens(config, prompt_tokens, max_new_tokens, chunk)
        return max(prompt_tokens + max_new_tokens, fast)

    def label(self) -> str:
        return self.named(f"{self.name}:{self.params['update_rule']}", ("update_rule",))

    def describe(self) -> dict[str, Any]:
        fast, seeker = self.fast.describe(), self.seeker.describe()
        return {**seeker, **fast, "policy": self.name, "label": self.label()}
