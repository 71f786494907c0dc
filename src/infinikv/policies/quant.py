"""``quant``: KV-cache quantization as in FlexGen (Sheng et al., ICML 2023), the baseline InfiniGen
compares against at 8/4/2 bits. Keeps every token, but stores each K/V vector as ``--bits``-bit
integers, asymmetric min-max per group of 64 values along head_dim, packed into bytes (two 4-bit
or four 2-bit values per byte) with one scale and one minimum per group in the K/V dtype, so the
bytes held really shrink (4 bits of fp32: 1/8 plus 1/32 for the scales). Attention reads the
past dequantized; the tokens of the current forward attend in full precision, as in FlexGen.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kv.quant import QuantSlots, Scratch
from . import register
from .base import Option, Policy, model_shape
from .layer import KVCache, KVLayer


@register
class Quant(Policy):
    """Every token, quantized to ``--bits`` (group 64 along head_dim, asymmetric min-max)."""

    name = "quant"
    takes_budget = False
    options = (Option("bits", int, 4, "bits per K/V value: 8, 4 or 2", lambda b: b in (8, 4, 2)),)

    def make_cache(self, model: torch.nn.Module, max_length: int | None = None, static: bool = False) -> KVCache:
        self.scratch = Scratch()  # one full-precision buffer for all the layers of this cache
        return super().make_cache(model, max_length, static)

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        _, _, head_dim = model_shape(model.config)
        return KVLayer(QuantSlots(self.params["bits"], head_dim, model.dtype, self.scratch))

    def token_bytes(self, config: Any) -> int:
        """Packed K/V plus one scale and one minimum per group of 64, at the model's precision."""
        _, n_kv, head_dim = model_shape(config)
        full = 4  # bytes per value of an fp32 cache (the size admission plans for)
        return 2 * n_kv * (head_dim * self.params["bits"] // 8 + 2 * max(1, head_dim // 64) * full)

    def label(self) -> str:
        return self.named(f"{self.name}:{self.params['bits']}bit", ("bits",))
