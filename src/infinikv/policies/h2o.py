"""``h2o``: Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models", NeurIPS 2023). Keeps the most recent tokens
plus the tokens that have received the most attention so far (accumulated over every query
of the KV head's group), per sequence and per KV head."""

import math

import torch

from ..kv.slots import Slots, StateSpec
from . import register, register_rule
from .base import Evicting, Option, Rule, Scoring


@register_rule
class HeavyHitter(Rule):
    """Evicts the token with the least accumulated attention, outside a recent window."""

    name = "heavy-hitter"
    options = (
        Option(
            "recent_ratio", float, 0.5, "share of the budget kept for recent tokens, in [0, 1]", lambda r: 0 <= r <= 1
        ),
    )
    observes = True
    state = {"score": StateSpec(torch.float32)}

    def observe(self, slots: Slots, mass: torch.Tensor, last: torch.Tensor) -> None:
        slots.state["score"][:, :, : mass.shape[-1]] += mass

    def scores(self, slots: Slots, at: Scoring) -> torch.Tensor:
        recent = torch.ceil(at.capacity * self.params["recent_ratio"])
        position = slots.state["position"][:, :, : at.length]
        return torch.where(position > at.newest - recent, math.inf, slots.state["score"][:, :, : at.length])


@register
class HeavyHitters(Evicting):
    """Heavy hitters + recent window, scored by accumulated attention."""

    name = "h2o"
    rule = HeavyHitter
