"""Two KV tiers and the copies between them, knowing no policy.

The slow tier is a layer's ``Slots`` (pinned host memory when the model runs on CUDA, a separate
CPU pool otherwise); the fast tier (``FastTier``) holds, on the compute device, the rows one
decode step attends to plus the step's new tokens. A fetch overlaps the previous layer's compute:
a side CUDA stream with an event on GPU, a worker thread on CPU, or runs at once when overlap is off.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache

import torch

from .slots import Slots, expand_to


@cache
def _worker() -> ThreadPoolExecutor:
    """The CPU fetch thread. It copies with one thread: its own OpenMP team would spin on the
    cores the decode step is using (measured: every step of every policy in the process ~1.6x
    slower while a fetching policy ran beside them)."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="infinikv-fetch", initializer=torch.set_num_threads, initargs=(1,)
    )


@cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class Transfer:
    """A fetch in flight; ``wait`` makes its result visible to the compute stream."""

    def __init__(self, future: Future | None = None, event: torch.cuda.Event | None = None) -> None:
        self.future, self.event = future, event

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


def start_transfer(copy: Callable[[], None], overlap: bool, device: torch.device) -> Transfer:
    """Run ``copy`` now (no overlap), on a side CUDA stream, or on the CPU worker thread."""
    if not overlap:
        copy()
        return Transfer()
    if device.type == "cuda":
        stream = _side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the rows it reads are written
        with torch.cuda.stream(stream):
            copy()
            event = torch.cuda.Event()
            event.record(stream)
        return Transfer(event=event)
    inference = torch.is_inference_mode_enabled()  # a thread-local mode: carry it to the worker

    def run() -> None:
        with torch.inference_mode(inference), torch.no_grad():
            copy()

    return Transfer(future=_worker().submit(run))


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
        self, slots: Slots, rows: torch.Tensor | None, count: int, overlap: bool, device: torch.device
    ) -> Transfer:
        """Copy the slow-tier ``rows`` (b, h, count) into the fast tier (None: the first ``count``
        slots), leaving room for one more token; returns the transfer in flight."""
        self._reserve(slots, count + 1, device)
        keys, values = slots.keys, slots.values
        slow_rows = None if rows is None else rows.to(keys.device)

        def copy() -> None:
            if slow_rows is None:
                self.keys[:, :, :count].copy_(keys[:, :, :count], non_blocking=True)
                self.values[:, :, :count].copy_(values[:, :, :count], non_blocking=True)
            else:
                self.keys[:, :, :count].copy_(keys.gather(2, expand_to(slow_rows, keys)), non_blocking=True)
                self.values[:, :, :count].copy_(values.gather(2, expand_to(slow_rows, values)), non_blocking=True)

        return start_transfer(copy, overlap, device)

    def with_new(
        self, count: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fetched rows followed by the new tokens: (b, h, count + q, d) each."""
        q = key_states.shape[2]
        self.keys[:, :, count : count + q] = key_states
        self.values[:, :, count : count + q] = value_states
        return self.keys[:, :, : count + q], self.values[:, :, : count + q]
