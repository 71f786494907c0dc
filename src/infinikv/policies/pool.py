"""The eviction rules of InfiniGen's bounded pool (``infinigen --pool-capacity``, the paper's
Table 2): which stored token goes when the slow tier is full, from its fetch history."""

from __future__ import annotations

import math

import torch

from ..contract import Rule, Scoring
from ..kv.slots import Slots


class PoolRule(Rule):
    """The bounded pool's eviction (InfiniGen's Table 2): the entry ranked lowest goes, but never
    one of the newest tenth of the pool, so a token is not dropped before it could be fetched."""

    def ranking(self, slots: Slots, at: Scoring) -> torch.Tensor:
        raise NotImplementedError

    def scores(self, slots: Slots, at: Scoring) -> torch.Tensor:
        position = slots.state["position"][:, :, : at.length]
        protected = position > at.newest - torch.ceil(at.capacity * 0.1)
        return torch.where(protected, math.inf, self.ranking(slots, at))


class Counter(PoolRule):
    name = "counter"

    def ranking(self, slots: Slots, at: Scoring) -> torch.Tensor:
        return slots.state["fetches"][:, :, : at.length]  # the fewest fetches so far


class LeastRecent(PoolRule):
    name = "lru"

    def ranking(self, slots: Slots, at: Scoring) -> torch.Tensor:
        return slots.state["last_fetch"][:, :, : at.length]  # the least recently fetched


class Oldest(PoolRule):
    name = "fifo"

    def ranking(self, slots: Slots, at: Scoring) -> torch.Tensor:
        return slots.state["position"][:, :, : at.length].float()


POOL_RULES = {rule.name: rule for rule in (Counter, LeastRecent, Oldest)}
