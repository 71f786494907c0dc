"""``tova`` eviction rule: TOVA (Oren et al., "Transformers are Multi-State RNNs", 2024). Drops
the token the current query attends to least; a ``bct`` update rule."""

import torch

from ..kv.slots import Slots, StateSpec
from . import register_rule
from .base import Rule, Scoring


@register_rule
class Tova(Rule):
    """Evicts the token the newest query attends to least."""

    name = "tova"
    observes = True
    state = {"last": StateSpec(torch.float32)}

    def observe(self, slots: Slots, mass: torch.Tensor, last: torch.Tensor) -> None:
        slots.state["last"][:, :, : last.shape[-1]] = last

    def scores(self, slots: Slots, at: Scoring) -> torch.Tensor:
        return slots.state["last"][:, :, : at.length]
