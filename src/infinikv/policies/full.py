"""``full``: keep every token (the reference every other policy is measured against)."""

from . import register
from .base import KVLayer, Policy


@register
class Full(Policy):
    """Keeps the whole KV cache; takes no budget."""

    name = "full"
    bounded = False

    def make_layer(self, layer_idx: int) -> KVLayer:
        return KVLayer(budget=None)
