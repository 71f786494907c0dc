"""Two KV tiers and the copies between them, knowing no policy.

The slow tier is a layer's ``Slots`` (pinned host memory when the model runs on CUDA, a separate
CPU pool otherwise); the fast tier (``FastTier``) holds, on the compute device, the rows one
decode step attends to plus the step's new tokens. On CUDA a fetch overlaps the previous layer's
compute (a side stream with an event); on a CPU it runs at once: the copy then reads and writes
the same RAM with the same cores as the compute it would overlap, and a copy on a worker thread
beside the decode step made both slower (measured, 2 cores: offload 172-180 ms per step at 8k
overlapped vs 131-140 synchronous; infinigen 248 vs 158 ms at 16k).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from ..sizes import model_device
from .slots import Slots


def slow_tier(model: torch.nn.Module) -> torch.device | None:
    """Where the slow tier lives: host memory when the model runs on a GPU, else the same RAM."""
    device = model_device(model)
    return torch.device("cpu") if device.type == "cuda" else None


@cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class Transfer:
    """A fetch in flight; ``wait`` makes its result visible to the compute stream."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


def start_transfer(copy: Callable[[], None], overlap: bool, device: torch.device) -> Transfer:
    """Run ``copy`` on a side CUDA stream (``overlap`` on CUDA), otherwise now."""
    if not overlap or device.type != "cuda":
        copy()
        return Transfer()
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the rows it reads are written
    with torch.cuda.stream(stream):
        copy()
        event = torch.cuda.Event()
        event.record(stream)
    return Transfer(event=event)


def row_index(rows: torch.Tensor, size: int, room: int) -> torch.Tensor:
    """Slot indices ``rows`` (b, h, k) of a store with ``size`` slots per head, as rows of the
    flattened store (b * h * (k + room),): each head's rows, then ``room`` copies of its first
    slot (placeholders that the new tokens overwrite in the fast tier)."""
    b, h, _ = rows.shape
    heads = torch.arange(0, b * h * size, size, device=rows.device).view(b, h, 1)
    return (F.pad(rows, (0, room)) + heads).view(-1)


class FastTier:
    """The fast-tier buffers of one layer: per KV head, the fetched rows then room for the new
    tokens, one contiguous block (b, h, count + room, d) that the copy writes into directly."""

    def __init__(self) -> None:
        self.flat: list[torch.Tensor] = []  # keys and values, (rows, d) each, grown geometrically
        self.keys: torch.Tensor | None = None  # views of them for the current step
        self.values: torch.Tensor | None = None

    def _reserve(self, slots: Slots, count: int, room: int, device: torch.device) -> None:
        b, h = slots.keys.shape[:2]
        rows = b * h * (count + room)
        stores = (slots.keys, slots.values)
        fits = self.flat and self.flat[0].shape[0] >= rows and self.flat[0].device == device
        if not fits or self.flat[0].dtype != slots.keys.dtype:
            size = max(rows, 2 * (self.flat[0].shape[0] if self.flat else 0), 16)
            self.flat = [t.new_zeros(size, t.shape[-1], device=device) for t in stores]
        self.keys, self.values = (f[:rows].view(b, h, count + room, -1) for f in self.flat)

    def fetch(
        self, slots: Slots, rows: torch.Tensor | None, count: int, overlap: bool, device: torch.device, room: int = 1
    ) -> Transfer:
        """Copy the slow-tier ``rows`` (b, h, count) into the fast tier (None: the first ``count``
        slots), leaving room for ``room`` more tokens; returns the transfer in flight. On one
        device the rows go straight into the fast tier (one ``index_select`` of whole d-wide rows
        each for K and V: a ``gather`` over an index expanded to every element was 8x slower
        here); from another device they are taken there and sent."""
        self._reserve(slots, count, room, device)
        stores, fast = (slots.keys, slots.values), (self.keys, self.values)
        size = slots.keys.shape[2]
        index = None if rows is None else row_index(rows.to(slots.keys.device), size, room)

        def copy() -> None:
            for store, into, flat in zip(stores, fast, self.flat, strict=True):
                if index is None:
                    into[:, :, :count].copy_(store[:, :, :count], non_blocking=True)
                elif store.device == into.device:
                    torch.index_select(store.reshape(-1, store.shape[-1]), 0, index, out=flat[: index.shape[0]])
                else:
                    taken = store.reshape(-1, store.shape[-1]).index_select(0, index).view(into.shape)
                    into.copy_(taken, non_blocking=True)

        return start_transfer(copy, overlap, device)

    def with_new(
        self, count: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fetched rows followed by the new tokens (or any other q rows): (b, h, count + q, d) each."""
        q = key_states.shape[2]
        self.keys[:, :, count : count + q] = key_states
        self.values[:, :, count : count + q] = value_states
        return self.keys[:, :, : count + q], self.values[:, :, : count + q]
