"""``h2o``: Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models", NeurIPS 2023). Keeps the most recent tokens
plus the tokens that have received the most attention so far (accumulated over every query
of the KV head's group), per sequence and per KV head."""

import math

import torch

from . import register
from .base import KVLayer, Option, Policy


class HeavyHitterLayer(KVLayer):
    observes_attention = True

    def __init__(self, budget, recent_ratio: float, **kwargs) -> None:
        super().__init__(budget, **kwargs)
        self.recent_ratio = recent_ratio

    def extra_meta(self) -> dict[str, torch.dtype]:
        return {"score": torch.float32}

    def observe(self, mass: torch.Tensor, last: torch.Tensor) -> None:
        self.meta["score"][:, :, : mass.shape[-1]] += mass

    def priority(self, length: int, capacity: torch.Tensor) -> torch.Tensor:
        recent = torch.ceil(capacity * self.recent_ratio).long()  # (b,)
        newest = self.real_seen - 1
        position = self.meta["position"][:, :, :length]
        is_recent = position > (newest - recent)[:, None, None]
        return torch.where(is_recent, math.inf, self.meta["score"][:, :, :length])


@register
class HeavyHitters(Policy):
    """Heavy hitters + recent window, scored by accumulated attention."""

    name = "h2o"
    options = (
        Option(
            "recent_ratio", float, 0.5, "share of the budget kept for recent tokens, in [0, 1]", lambda r: 0 <= r <= 1
        ),
    )

    def make_layer(self, layer_idx: int) -> KVLayer:
        return HeavyHitterLayer(self.budget, self.params["recent_ratio"])
