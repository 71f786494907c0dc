"""``full``: keep every token (the reference every other policy is measured against)."""

import torch

from ..cache import KVLayer
from ..contract import REFERENCE
from ..errors import InfinikvError
from ..kv.slots import Slots
from .base import Policy


class Full(Policy):
    """Keeps the whole KV cache; takes no budget. Compiled, it needs the longest sequence it will
    see (``max_length``), for which its storage is allocated once."""

    name = REFERENCE
    takes_budget = False
    compilable = True

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        return KVLayer(Slots(size=static, static=static is not None))

    def static_size(self, model: torch.nn.Module, max_length: int | None) -> int:
        if max_length is None:
            raise InfinikvError("compiling full needs the longest sequence it will hold (--max-length)")
        return max_length
