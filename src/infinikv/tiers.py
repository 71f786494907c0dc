"""Two KV tiers and the transfers between them.

The slow tier holds every token's K/V: pinned host memory when the model runs on CUDA, a
separate CPU pool otherwise. The fast tier, on the compute device, holds what one decode step
attends to. ``TieredLayer`` is the shared base of the policies that fetch from the slow tier
(``offload`` fetches everything, ``infinigen`` a speculated few); every fetch goes through
``start_transfer``, which overlaps it with the previous layer's compute (a side CUDA stream, or
a worker thread on CPU) unless overlap is off, and is recorded in the layer's ledger.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from typing import Any

import torch

from .policies.base import Budget, KVLayer


@cache
def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinikv-fetch")


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


class TieredLayer(KVLayer):
    """A layer whose K/V live in the slow tier; each decode step attends to rows fetched into
    the fast tier (chosen by ``choose_rows``) plus the new tokens. Prefill is dense."""

    def __init__(self, overlap: bool = True, budget: Budget | None = None) -> None:
        super().__init__(budget=budget)
        self.overlap = overlap
        self.fast_keys: torch.Tensor | None = None
        self.fast_values: torch.Tensor | None = None
        self.fetched: torch.Tensor | None = None  # (b, h, k) slots fetched for this step
        self.fetched_mask: torch.Tensor | None = None  # (b, h, k) False: padding of a shorter row
        self.transfer: Transfer | None = None
        self.transfers: list[tuple[int, int, int]] = []  # per decode step: (tokens seen, fetched, bytes)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if self.device.type == "cuda":  # the slow tier lives in pinned host memory
            self.keys = self.keys.cpu().pin_memory()
            self.values = self.values.cpu().pin_memory()
        b, h, _, d = key_states.shape
        self.fast_keys = key_states.new_zeros(b, h, 16, d)
        self.fast_values = value_states.new_zeros(b, h, 16, value_states.shape[-1])

    def _grow(self, new_size: int) -> None:
        super()._grow(new_size)
        if self.device.type == "cuda" and not self.keys.is_pinned():
            self.keys, self.values = self.keys.pin_memory(), self.values.pin_memory()

    def choose_rows(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The slots layer i will need and which of them count ``(b, h, k)`` each, or None for all."""
        raise NotImplementedError

    def speculate(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Called as the previous layer's attention starts: choose rows and start fetching them."""
        self.fetched = self.fetched_mask = self.transfer = None
        if x.shape[1] != 1 or self.used == 0:
            return  # prefill (and the first step) is dense
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        started = time.perf_counter()
        self.fetch(self.choose_rows(x, cos, sin), self.overlap)
        self.clock["speculate"] += time.perf_counter() - started

    def fetch(self, chosen: tuple[torch.Tensor, torch.Tensor] | None, overlap: bool) -> None:
        """Copy the chosen slow-tier slots (None: all) into the fast tier, and log it."""
        if chosen is None:
            rows, mask = torch.arange(self.used, device=self.device).expand(*self.keys.shape[:2], -1), None
        else:
            rows, mask = chosen
        k = rows.shape[-1]
        self._reserve_fast(k + 1)
        slow_rows = rows.to(self.keys.device)

        def copy() -> None:
            index = slow_rows[..., None].expand(-1, -1, -1, self.keys.shape[-1])
            self.fast_keys[:, :, :k].copy_(self.keys.gather(2, index), non_blocking=True)
            self.fast_values[:, :, :k].copy_(self.values.gather(2, index), non_blocking=True)

        self.transfer = start_transfer(copy, overlap, self.device)
        self.fetched, self.fetched_mask = rows, mask
        per_row = k if mask is None else float(mask.sum(-1).float().mean())  # tokens per sequence and head
        self.transfers.append((self.used, per_row, round(per_row * self.bytes_per_slot())))

    def _reserve_fast(self, slots: int) -> None:
        if slots > self.fast_keys.shape[2]:
            size = max(slots, 2 * self.fast_keys.shape[2])
            self.fast_keys = self.fast_keys.new_zeros(*self.fast_keys.shape[:2], size, self.fast_keys.shape[-1])
            self.fast_values = self.fast_values.new_zeros(*self.fast_values.shape[:2], size, self.fast_values.shape[-1])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.fetched is None and key_states.shape[2] == 1 and self.used > 0:
            self.fetch(None, overlap=False)  # nothing ran ahead of this layer (e.g. layer 0): fetch all now
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.store_extra(key_states)
        if self.fetched is None:  # dense: everything stored (on the compute device)
            return keys.to(self.device, non_blocking=True), values.to(self.device, non_blocking=True)
        started = time.perf_counter()
        self.transfer.wait()
        self.clock["fetch"] += time.perf_counter() - started  # what the overlap did not hide
        k, q = self.fetched.shape[-1], key_states.shape[2]
        self.fast_keys[:, :, k : k + q] = key_states  # the current token always attends to itself
        self.fast_values[:, :, k : k + q] = value_states
        return self.fast_keys[:, :, : k + q], self.fast_values[:, :, : k + q]

    def store_extra(self, key_states: torch.Tensor) -> None:
        """Keep whatever else the fast tier holds per token (e.g. partial keys)."""

    def visibility(self) -> torch.Tensor | None:
        if self.fetched is None:
            return super().visibility()
        valid = self.meta["valid"].gather(2, self.fetched)
        if self.fetched_mask is not None:
            valid &= self.fetched_mask
        if bool(valid.all()):
            return None
        return torch.cat([valid, torch.ones_like(valid[..., :1]).expand(-1, -1, self.pending)], -1)[:, :, None]

    def commit(self, attended: float) -> None:
        super().commit(attended)
        self.fetched = self.fetched_mask = self.transfer = None

    def reset(self) -> None:
        super().reset()
        self.transfers.clear()
        self.fetched = self.fetched_mask = self.transfer = None
