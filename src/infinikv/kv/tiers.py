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

from .slots import Slots


def slow_tier(model: torch.nn.Module) -> torch.device | None:
    """Where the slow tier lives: host memory when the model runs on a GPU, else the same RAM."""
    device = next(model.parameters()).device
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


def take_rows(store: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``store`` (b, h, S, d) at slot indices ``rows`` (b, h, k): (b, h, k, d).

    One ``index_select`` of whole d-wide rows of the flattened store: a copy per row, where a
    ``gather`` over an index expanded to (b, h, k, d) reads an index per element (8x slower here:
    417 against 52 us for 1,639 rows of 3 heads at 16k, 2 cores)."""
    b, h, size, d = store.shape
    heads = torch.arange(b * h, device=rows.device).view(b, h, 1) * size
    return store.reshape(b * h * size, d).index_select(0, (rows + heads).view(-1)).view(b, h, -1, d)


class FastTier:
    """The fast-tier buffers of one layer: the fetched rows, then room for the new tokens."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def _reserve(self, slots: Slots, size: int, device: torch.device) -> None:
        if self.keys is None or self.keys.shape[2] < size or self.keys.shape[0] != slots.keys.shape[0]:
            b, h, _, d = slots.keys.shape
            size = max(size, 2 * (0 if self.keys is None else self.keys.shape[2]), 16)
            self.keys = slots.keys.new_zeros(b, h, size, d, device=device)
            self.values = slots.values.new_zeros(b, h, size, slots.values.shape[-1], device=device)

    def fetch(
        self, slots: Slots, rows: torch.Tensor | None, count: int, overlap: bool, device: torch.device, room: int = 1
    ) -> Transfer:
        """Copy the slow-tier ``rows`` (b, h, count) into the fast tier (None: the first ``count``
        slots), leaving room for ``room`` more tokens; returns the transfer in flight."""
        self._reserve(slots, count + room, device)
        keys, values = slots.keys, slots.values
        slow_rows = None if rows is None else rows.to(keys.device)

        def copy() -> None:
            if slow_rows is None:
                self.keys[:, :, :count].copy_(keys[:, :, :count], non_blocking=True)
                self.values[:, :, :count].copy_(values[:, :, :count], non_blocking=True)
            else:
                self.keys[:, :, :count].copy_(take_rows(keys, slow_rows), non_blocking=True)
                self.values[:, :, :count].copy_(take_rows(values, slow_rows), non_blocking=True)

        return start_transfer(copy, overlap, device)

    def with_new(
        self, count: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fetched rows followed by the new tokens (or any other q rows): (b, h, count + q, d) each."""
        q = key_states.shape[2]
        self.keys[:, :, count : count + q] = key_states
        self.values[:, :, count : count + q] = value_states
        return self.keys[:, :, : count + q], self.values[:, :, : count + q]
