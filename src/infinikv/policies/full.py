"""``full``: keep every token (the reference every other policy is measured against)."""

from . import register
from .base import KVLayer, Policy


@register
class Full(Policy):
    """Keeps the whole KV cache; takes no budget."""

    name = "full"
    bounded = False

    def __init__(self, budget: float | None = None, capacity: int | None = None, **params) -> None:
        super().__init__(**params)  # a budget means nothing here: everything is kept

    def make_layer(self, layer_idx: int) -> KVLayer:
        return KVLayer(budget=None)
