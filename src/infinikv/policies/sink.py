"""``sink``: StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention
Sinks", ICLR 2024). Keeps the first few tokens, which soak up attention mass whatever their
content, plus the most recent ones; forgets the middle."""

import math

import torch

from ..kv.slots import Slots
from . import register, register_rule
from .base import Evicting, Option, Rule, Scoring


@register_rule
class SinkRecent(Rule):
    """Evicts the oldest token after the first ``sinks``."""

    name = "sink-recent"
    options = (Option("sinks", int, 4, "sink tokens kept at the start, >= 0 (StreamingLLM uses 4)", lambda n: n >= 0),)

    def scores(self, slots: Slots, at: Scoring) -> torch.Tensor:
        position = slots.state["position"][:, :, : at.length]
        return torch.where(position < self.params["sinks"], math.inf, position.float())


@register
class Sink(Evicting):
    """Attention sinks + recent window."""

    name = "sink"
    rule = SinkRecent
