"""``quant``: KV-cache quantization as in FlexGen (Sheng et al., ICML 2023), the baseline InfiniGen
compares against at 8/4/2 bits. Keeps every token, but stores each K/V vector as ``--bits``-bit
integers, asymmetric min-max per group of 64 values along head_dim, packed into bytes (two 4-bit
or four 2-bit values per byte) with one scale and one minimum per group in the model's dtype, so
the bytes held really shrink (4 bits of fp32: 1/8 plus 1/32 for the scales). Attention reads the
past dequantized; the tokens of the current forward attend in full precision, as in FlexGen.
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache import KVCache, KVLayer
from ..contract import Cost, Option
from ..kv.quant import GROUP, QuantSlots, Scratch
from ..sizes import model_dtype, model_shape
from .base import Policy

PLANNED_BITS = 4  # the planner's quant row: 4-bit values, an fp16 scale and minimum per group
PLANNED_SHARE = PLANNED_BITS / 16 + 2 / GROUP  # of an fp16 K/V


class Quant(Policy):
    """Every token, quantized to ``--bits`` (group 64 along head_dim, asymmetric min-max)."""

    name = "quant"
    takes_budget = False
    options = (Option("bits", int, 4, "bits per K/V value: 8, 4 or 2", lambda b: b in (8, 4, 2)),)
    cost = Cost(f"quant-{PLANNED_BITS}", stores=lambda _, dense: PLANNED_SHARE, reads=lambda _, dense: PLANNED_SHARE)

    def make_cache(self, model: torch.nn.Module, max_length: int | None = None, static: bool = False) -> KVCache:
        self.scratch = Scratch()  # one full-precision buffer for all the layers of this cache
        return super().make_cache(model, max_length, static)

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        _, _, head_dim = model_shape(model.config)
        return KVLayer(QuantSlots(self.params["bits"], head_dim, model.dtype, self.scratch))

    def token_bytes(self, config: Any) -> int:
        """Packed K/V plus one scale and one minimum per group of 64, in the model's dtype."""
        _, n_kv, head_dim = model_shape(config)
        scale = torch.empty((), dtype=model_dtype(config)).element_size()
        return 2 * n_kv * (head_dim * self.params["bits"] // 8 + 2 * max(1, head_dim // GROUP) * scale)

    def label(self) -> str:
        return self.named(f"{self.name}:{self.params['bits']}bit", ("bits",))
