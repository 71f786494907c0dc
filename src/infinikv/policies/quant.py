"""``quant``: KV-cache quantization as in FlexGen (Sheng et al., ICML 2023), the baseline InfiniGen
compares against at 8/4/2 bits. Keeps every token, but stores each K/V vector as ``--bits``-bit
integers, asymmetric min-max per group of 64 values along head_dim, packed into bytes (two 4-bit
or four 2-bit values per byte) with one scale and one minimum per group in the K/V dtype, so the
bytes held really shrink (4 bits of fp32: 1/8 plus 1/32 for the scales). Attention reads the
past dequantized; the tokens of the current forward attend in full precision, as in FlexGen.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..errors import InfinikvError
from . import register
from .base import KVCache, KVLayer, Option, Policy

GROUP = 64  # values per scale/minimum along head_dim (FlexGen's group size)
SCALES = ("k_scale", "k_min", "v_scale", "v_min")


def group_size(head_dim: int) -> int:
    """The quantization group along ``head_dim``: 64, or the whole head when it is smaller."""
    group = min(GROUP, head_dim)
    if head_dim % group:
        raise InfinikvError(f"quant needs a head_dim divisible by {GROUP} (or smaller than it), got {head_dim}")
    return group


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization of ``x`` (..., d) in groups of ``group`` along d.

    Returns the packed integers (..., d * bits / 8) uint8 and the scale and minimum of each
    group (..., d / group) in x's dtype; every value is within scale / 2 of its dequantization.
    """
    levels = 2**bits - 1
    g = x.unflatten(-1, (-1, group))
    low, high = g.amin(-1), g.amax(-1)
    scale = (high - low) / levels
    step = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group is all zeros
    q = ((g - low[..., None]) / step[..., None]).round_().clamp_(0, levels).to(torch.uint8)
    return pack(q.flatten(-2), bits), scale, low


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bits: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of ``quantize``: packed (..., d * bits / 8), scale/low (..., G) -> (..., d), into ``out``."""
    q = unpack(packed, bits).to(scale.dtype).unflatten(-1, (scale.shape[-1], -1))
    if out is None:
        return torch.addcmul(low[..., None], q, scale[..., None]).flatten(-2)
    torch.addcmul(low[..., None], q, scale[..., None], out=out.unflatten(-1, q.shape[-2:]))
    return out


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., d) integers below 2**bits -> (..., d * bits / 8) uint8, value i of a byte at bit i * bits."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=q.device)
    return (q.unflatten(-1, (-1, shifts.numel())).to(torch.int32) << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) uint8 -> (..., n * 8 / bits) int32, the inverse of ``pack``."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    return ((packed[..., None].to(torch.int32) >> shifts) & (2**bits - 1)).flatten(-2)


class Scratch:
    """The full-precision K/V one layer attends to, shared by all layers of a cache (they run one
    at a time), so dequantizing never holds more than one layer's K/V in full precision."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def take(self, like: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``length`` slots shaped like ``like`` (b, h, *, d), grown geometrically."""
        b, h, _, d = like.shape
        if (
            self.keys is None
            or self.keys.shape[2] < length
            or self.keys.shape[:2] != (b, h)
            or self.keys.dtype != like.dtype
        ):
            size = max(length, 2 * (self.keys.shape[2] if self.keys is not None else 0), 16)
            self.keys, self.values = like.new_empty(b, h, size, d), like.new_empty(b, h, size, d)
        return self.keys[:, :, :length], self.values[:, :, :length]


class QuantLayer(KVLayer):
    """Stores packed integers in ``keys``/``values`` (uint8) and each group's scale and minimum
    as per-slot state (b, h, S, G), so slots move with their scales like any other state."""

    def __init__(self, bits: int, scratch: Scratch) -> None:
        super().__init__(budget=None)
        self.bits, self.scratch = bits, scratch

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        started = time.perf_counter()
        group = group_size(key_states.shape[-1])
        pk, k_scale, k_min = quantize(key_states, self.bits, group)
        pv, v_scale, v_min = quantize(value_states, self.bits, group)
        if not self.is_initialized:
            self.lazy_initialization(pk, pv)
            for name in SCALES:
                self.meta[name] = k_scale.new_zeros(*k_scale.shape[:2], 0, k_scale.shape[-1])
        past, q = self.used, key_states.shape[2]
        super().update(pk, pv, *args, **kwargs)
        for name, t in zip(SCALES, (k_scale, k_min, v_scale, v_min), strict=True):
            self.meta[name][:, :, past : past + q] = t
        keys, values = self.scratch.take(key_states, past + q)
        if past:
            meta = {name: t[:, :, :past] for name, t in self.meta.items() if name in SCALES}
            dequantize(self.keys[:, :, :past], meta["k_scale"], meta["k_min"], self.bits, out=keys[:, :, :past])
            dequantize(self.values[:, :, :past], meta["v_scale"], meta["v_min"], self.bits, out=values[:, :, :past])
        keys[:, :, past:] = key_states  # the current forward's tokens attend in full precision
        values[:, :, past:] = value_states
        self.clock["quantize"] += time.perf_counter() - started  # (de)quantizing, for bench speed
        return keys, values

    def bytes_per_slot(self) -> int:
        """Packed K and V plus their scales and minimums, per slot over the batch and heads."""
        if not self.is_initialized:
            return 0
        b, h, _, groups = self.meta["k_scale"].shape
        scales = len(SCALES) * b * h * groups * self.meta["k_scale"].element_size()
        return super().bytes_per_slot() + scales


@register
class Quant(Policy):
    """Every token, quantized to ``--bits`` (group 64 along head_dim, asymmetric min-max)."""

    name = "quant"
    bounded = False
    options = (Option("bits", int, 4, "bits per K/V value: 8, 4 or 2", lambda b: b in (8, 4, 2)),)

    def make_layer(self, layer_idx: int) -> KVLayer:
        return QuantLayer(self.params["bits"], Scratch())

    def make_cache(self, model: torch.nn.Module) -> KVCache:
        scratch = Scratch()
        layers = [QuantLayer(self.params["bits"], scratch) for _ in range(model.config.num_hidden_layers)]
        return KVCache(layers, self)
