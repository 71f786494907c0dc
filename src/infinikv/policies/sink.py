"""``sink``: StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention
Sinks", ICLR 2024). Keeps the first few tokens, which soak up attention mass whatever their
content, plus the most recent ones; forgets the middle."""

import math

import torch

from . import register
from .base import KVLayer, Option, Policy


class SinkLayer(KVLayer):
    def __init__(self, budget, sinks: int, **kwargs) -> None:
        super().__init__(budget, **kwargs)
        self.sinks = sinks

    def priority(self, length: int, capacity: torch.Tensor) -> torch.Tensor:
        position = self.meta["position"][:, :, :length]
        return torch.where(position < self.sinks, math.inf, position.float())


@register
class Sink(Policy):
    """Attention sinks + recent window."""

    name = "sink"
    options = (Option("sinks", int, 4, "sink tokens kept at the start, >= 0 (StreamingLLM uses 4)", lambda n: n >= 0),)

    def make_layer(self, layer_idx: int) -> KVLayer:
        return SinkLayer(self.budget, self.params["sinks"])
