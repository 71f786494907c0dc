"""Quantized slot storage: K/V kept as packed low-bit integers (FlexGen's asymmetric min-max
scheme, groups of 64 values along head_dim), dequantized for attention into one full-precision
buffer shared by every layer of a cache (the layers run one at a time)."""

from __future__ import annotations

import torch

from ..errors import InfinikvError
from .layout import put
from .slots import Slots, StateSpec, Write

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
    """The full-precision K/V one layer attends to, shared by all layers of a cache, so
    dequantizing never holds more than one layer's K/V in full precision."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def take(self, like: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``length`` slots shaped like ``like`` (b, h, *, d), grown geometrically."""
        b, h, _, d = like.shape
        if self.keys is None or self.keys.shape[2] < length or self.keys.shape[:2] != (b, h):
            size = max(length, 2 * (self.keys.shape[2] if self.keys is not None else 0), 16)
            self.keys, self.values = like.new_empty(b, h, size, d), like.new_empty(b, h, size, d)
        return self.keys[:, :, :length], self.values[:, :, :length]


class QuantSlots(Slots):
    """Slots whose ``keys``/``values`` hold packed integers (uint8), with each group's scale and
    minimum as per-slot state, so a slot's scales move with it like any other state."""

    exact = False

    def __init__(self, bits: int, head_dim: int, dtype: torch.dtype, scratch: Scratch) -> None:
        super().__init__()
        self.bits, self.scratch = bits, scratch
        self.group = group_size(head_dim)
        for name in SCALES:
            self.add_state(name, StateSpec(dtype, (head_dim // self.group,)))
        self._fresh: tuple | None = None  # the last write's tokens in full precision, and where

    def write(
        self,
        write: Write,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        position: torch.Tensor,
        real: torch.Tensor | None,
    ) -> torch.Tensor | slice:
        pk, k_scale, k_min = quantize(key_states, self.bits, self.group)
        pv, v_scale, v_min = quantize(value_states, self.bits, self.group)
        where = super().write(write, pk, pv, position, real)
        for name, t in zip(SCALES, (k_scale, k_min, v_scale, v_min), strict=True):
            put(self.state[name], where, t)
        self._fresh = (where, key_states, value_states)
        return where

    def view(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot dequantized, the current forward's tokens in full precision (as in FlexGen)."""
        where, key_states, value_states = self._fresh
        keys, values = self.scratch.take(key_states, length)
        s = {name: self.state[name][:, :, :length] for name in SCALES}
        dequantize(self.keys[:, :, :length], s["k_scale"], s["k_min"], self.bits, out=keys)
        dequantize(self.values[:, :, :length], s["v_scale"], s["v_min"], self.bits, out=values)
        put(keys, where, key_states)
        put(values, where, value_states)
        return keys, values
