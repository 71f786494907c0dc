"""What a cache layer did, counted without reading the device: the statistics stage."""

from __future__ import annotations

import time

import torch

COUNTS = ("steps", "keys", "fraction", "peak", "fetch_steps")  # per row, on the host
TOTALS = ("fetched", "fetched_fraction", "attended", "attended_fraction")  # per row, summed over fetching steps


class Clock:
    """Seconds per phase (speculate, fetch, attend) summed over a cache's layers, when enabled
    (``bench speed``'s profile; off otherwise, and always off in a compiled step)."""

    def __init__(self) -> None:
        self.enabled = False
        self.seconds: dict[str, float] = {}

    def start(self) -> float | None:
        return time.perf_counter() if self.enabled else None

    def stop(self, name: str, started: float | None) -> None:
        if started is not None:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


class Stats:
    """Per row: decode steps, keys attended, the most tokens held at once (``peak``: before an
    eviction, so a prompt held whole until the prefill evicts and a decode step's extra token
    count), and for two tiers the tokens fetched (``TOTALS``), summed over steps: on the host when
    a step's count is known there, else on the device (read only when asked for)."""

    def __init__(self) -> None:
        self.steps: list[int] = []  # decode steps per row
        self.keys: list[float] = []  # keys attended, summed over decode steps
        self.fraction: list[float] = []  # keys attended / tokens seen, summed over decode steps
        self.peak: list[int] = []  # most slots held at once
        self.fetch_steps: list[int] = []  # decode steps per row that fetched from the slow tier
        # TOTALS per row: tokens fetched per KV head, that over the tokens stored, fetched plus the
        # rows read beside them (the current token), and that over the tokens seen
        self.host_totals: list[list[float]] = [[] for _ in TOTALS]  # (4, b)
        self.device_totals: torch.Tensor | None = None  # (4, b)

    def rows(self, b: int) -> None:
        if not self.steps:
            for name in COUNTS:
                setattr(self, name, [0] * b)
            self.host_totals = [[0.0] * b for _ in TOTALS]

    def hold(self, held: list[int]) -> None:
        """The rows hold ``held`` tokens now."""
        self.peak = [max(p, h) for p, h in zip(self.peak, held, strict=True)]

    def attend(self, held: list[int], seen: list[int]) -> None:
        """A decode step attends to every token held."""
        for r, (h, s) in enumerate(zip(held, seen, strict=True)):
            self.steps[r] += 1
            self.keys[r] += h
            self.fraction[r] += h / max(s, 1)

    def fetch(
        self, per_row: torch.Tensor | list[float], held: list[int], seen: list[int], beside: list[int] | None = None
    ) -> None:
        """A decode step fetched ``per_row`` (b,) tokens per KV head (a tensor, or known on the host)
        of the ``held`` stored, having seen ``seen`` (the current token included), and attended to
        ``beside`` more per row (None: the current token alone)."""
        b = len(held)
        beside = beside or [1] * b
        self.fetch_steps = [n + 1 for n in self.fetch_steps]
        if isinstance(per_row, list):
            for r, (f, h, s, o) in enumerate(zip(per_row, held, seen, beside, strict=True)):
                for total, value in zip(self.host_totals, (f, f / max(h, 1), f + o, (f + o) / s), strict=True):
                    total[r] += value
            return
        scale = [[1.0] * b, [1 / max(h, 1) for h in held], [1.0] * b, [1 / s for s in seen]]
        offset = [[0.0] * b, [0.0] * b, [float(o) for o in beside], [o / s for o, s in zip(beside, seen, strict=True)]]
        scale_offset = torch.tensor([scale, offset], dtype=torch.float32, device=per_row.device)  # one copy
        value = torch.addcmul(scale_offset[1], per_row.float(), scale_offset[0])
        self.device_totals = value if self.device_totals is None else self.device_totals.add_(value)

    def totals(self) -> dict[str, list[float]]:
        """``TOTALS`` per row, summed over the fetching steps."""
        device = self.device_totals.tolist() if self.device_totals is not None else None
        return {
            name: [h + (device[i][r] if device else 0.0) for r, h in enumerate(self.host_totals[i])]
            for i, name in enumerate(TOTALS)
        }

    # -- rows --------------------------------------------------------------------------------
    def select(self, rows: list[int]) -> None:
        for name in COUNTS:
            setattr(self, name, [getattr(self, name)[r] for r in rows])
        self.host_totals = [[total[r] for r in rows] for total in self.host_totals]
        if self.device_totals is not None:
            self.device_totals = self.device_totals[:, rows]

    def extend(self, other: Stats) -> None:
        mine, theirs = self.device_totals, other.device_totals
        if mine is not None or theirs is not None:
            like = mine if mine is not None else theirs
            mine = mine if mine is not None else like.new_zeros(len(TOTALS), len(self.steps))
            theirs = theirs if theirs is not None else like.new_zeros(len(TOTALS), len(other.steps))
            self.device_totals = torch.cat([mine, theirs], 1)
        self.host_totals = [a + b for a, b in zip(self.host_totals, other.host_totals, strict=True)]
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
