"""Per-slot tensors (b, h, S, ...): the one write into them (``put``), and their layout (a state
may be stored slot-last, so that a product reads it row by row: ``StateSpec.slot_last``)."""

from __future__ import annotations

import torch


def put(store: torch.Tensor, where: torch.Tensor | slice, new: torch.Tensor | float) -> None:
    """Write ``new`` (b, h, q, ...) or one value into ``store`` (b, h, S, ...) at ``where``: a slice
    of slots (every row the same), or slot indices (b, h, q) (each row its own, scattered). Either
    may live on another device than ``store`` (a slow tier): they are moved to it."""
    if isinstance(new, torch.Tensor):
        new = new.to(store.device)
    if isinstance(where, slice):
        store[:, :, where] = new
    elif torch.compiler.is_compiling():  # an index_put, which inductor does in place: a scatter_
        b, h, _ = where.shape  # it does on a copy of the whole store (every step, every layer)
        rows = torch.arange(b, device=store.device)[:, None, None]
        heads = torch.arange(h, device=store.device)[None, :, None]
        store[rows, heads, where.to(store.device)] = new
    else:  # eagerly a scatter_ is the cheaper (4 against 12 us a write here)
        store.scatter_(2, expand_to(where.to(store.device), store), new)


def expand_to(index: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Slot indices (b, h, k) expanded over ``t``'s trailing dims, for gather/scatter on dim 2."""
    return index.view(*index.shape, *([1] * (t.dim() - 3))).expand(*index.shape, *t.shape[3:])


def pad_slots(t: torch.Tensor, size: int) -> torch.Tensor:
    if t.shape[2] >= size:
        return t
    out = zeros_like_slots(t, size)
    out[:, :, : t.shape[2]] = t
    return out


def is_slot_last(t: torch.Tensor) -> bool:
    """Whether per-slot state ``t`` (b, h, S, c) is stored slot-last (``StateSpec.slot_last``)."""
    return t.dim() == 4 and t.shape[3] > 1 and t.stride(2) == 1


def zeros_like_slots(t: torch.Tensor, size: int) -> torch.Tensor:
    """Zeros shaped like per-slot ``t`` (b, h, S, ...) with ``size`` slots, stored as t is."""
    if is_slot_last(t):
        return t.new_zeros(*t.shape[:2], t.shape[3], size).movedim(-1, 2)
    return t.new_zeros(*t.shape[:2], size, *t.shape[3:])


def in_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t``, stored as per-slot ``like`` is (a copy where joining or selecting rows lost the layout)."""
    if is_slot_last(like) and not is_slot_last(t):
        return t.movedim(2, -1).contiguous().movedim(-1, 2)
    return t
