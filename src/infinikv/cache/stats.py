"""What a cache layer did, counted without reading the device: the statistics stage."""

from __future__ import annotations

import time

import torch

COUNTS = ("steps", "keys", "fraction", "peak", "fetch_steps")  # per row, on the host
TOTALS = ("fetched", "fetched_fraction", "attended", "attended_fraction")  # per row, on the device


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
    count), and for two tiers the tokens fetched, summed over steps on the device."""

    def __init__(self) -> None:
        self.steps: list[int] = []  # decode steps per row
        self.keys: list[float] = []  # keys attended, summed over decode steps
        self.fraction: list[float] = []  # keys attended / tokens seen, summed over decode steps
        self.peak: list[int] = []  # most slots held at once
        self.fetch_steps: list[int] = []  # decode steps per row that fetched from the slow tier
        self.fetched: torch.Tensor | None = None  # (b,) tokens fetched per KV head, summed over steps
        self.fetched_fraction: torch.Tensor | None = None  # (b,) the same over the tokens stored
        self.attended: torch.Tensor | None = None  # (b,) fetched + the rows read beside them (the current token)
        self.attended_fraction: torch.Tensor | None = None  # (b,) the same over tokens seen

    def rows(self, b: int) -> None:
        if not self.steps:
            for name in COUNTS:
                setattr(self, name, [0] * b)

    def hold(self, held: list[int]) -> None:
        """The rows hold ``held`` tokens now."""
        self.peak = [max(p, h) for p, h in zip(self.peak, held, strict=True)]

    def attend(self, held: list[int], seen: list[int]) -> None:
        """A decode step attends to every token held."""
        for r, (h, s) in enumerate(zip(held, seen, strict=True)):
            self.steps[r] += 1
            self.keys[r] += h
            self.fraction[r] += h / max(s, 1)

    def fetch(self, per_row: torch.Tensor, held: list[int], seen: list[int], beside: list[int] | None = None) -> None:
        """A decode step fetched ``per_row`` (b,) tokens per KV head of the ``held`` stored, having
        seen ``seen`` (the current token included), and attended to ``beside`` more per row (None:
        the current token alone)."""
        device = per_row.device
        stored = torch.tensor(held, dtype=torch.float32, device=device).clamp(min=1)
        attended = per_row + (1 if beside is None else torch.tensor(beside, dtype=torch.float32, device=device))
        self.fetch_steps = [n + 1 for n in self.fetch_steps]
        for name, value in (
            ("fetched", per_row),
            ("fetched_fraction", per_row / stored),
            ("attended", attended),
            ("attended_fraction", attended / torch.tensor(seen, dtype=torch.float32, device=device)),
        ):
            total = getattr(self, name)
            setattr(self, name, value if total is None else total + value)

    # -- rows --------------------------------------------------------------------------------
    def select(self, rows: list[int]) -> None:
        for name in COUNTS:
            setattr(self, name, [getattr(self, name)[r] for r in rows])
        for name in TOTALS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[rows])

    def extend(self, other: Stats) -> None:
        for name in TOTALS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None or theirs is not None:
                like = mine if mine is not None else theirs
                mine = mine if mine is not None else like.new_zeros(len(self.steps))
                theirs = theirs if theirs is not None else like.new_zeros(len(other.steps))
                setattr(self, name, torch.cat([mine, theirs]))
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
