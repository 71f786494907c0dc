"""The two-tier stage: every token stays in the slow tier (the layer's slots); a decode step
attends to the rows a ``Selection`` chooses, copied to the fast tier (``kv.tiers``).

A selection runs as the previous layer's attention starts (``ahead``, so the copy can overlap
that layer on a GPU) or as its own layer's starts. Choosing the rows does not read the device
under the default rules: a copy between tiers has a size known on the host (a rule that wants
fewer rows masks the rest; see ``kv.speculation.select_by_mass``). ``--select alpha`` is the
exception: its row count is the most any sequence wants (``kv.speculation.select_tokens``), one
read of the device per layer and step.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kv.slots import Slots, StateSpec
from ..kv.tiers import FastTier, Transfer
from .stats import Clock


class Selection:
    """Chooses the slow-tier rows a decode step attends to; this base fetches every one.

    ``specs``: per-slot state it keeps (e.g. partial keys); ``ahead``: it chooses from the
    previous layer's attention input (False: from its own layer's, no overlap); ``overlap``: the
    copy may run on a side stream (CUDA)."""

    specs: dict[str, StateSpec] = {}
    ahead = True

    def __init__(self, overlap: bool = True) -> None:
        self.overlap = overlap

    def choose(
        self, slots: Slots, x: torch.Tensor, rope: Any, positions: torch.Tensor, stored: int, held: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Rows ``(b, h, k)`` and which of them count (or None: all), from an attention input x
        (b, 1, D), the RoPE ``(cos, sin)`` that layer got (or None) and the positions (b, 1) of the
        step, among the first ``stored`` slots (``held[r]`` valid in row r); None: all of them."""
        return None

    def store(self, slots: Slots, where: torch.Tensor | slice, key_states: torch.Tensor) -> None:
        """Keep what choosing needs of the new tokens (e.g. partial keys), at ``where``."""


class TwoTier:
    """A ``selection`` and the transfers it starts: the rows fetched for the current step, and
    ``room`` for the rows attention reads beside them (the step's new token, or a fast tier)."""

    def __init__(self, selection: Selection) -> None:
        self.selection = selection
        self.room = 1
        self.fast = FastTier()
        self.transfer: Transfer | None = None
        self.fetched: tuple[torch.Tensor | None, torch.Tensor | None, int] | None = None  # rows, visible, count

    @property
    def specs(self) -> dict[str, StateSpec]:
        return self.selection.specs

    @property
    def ahead(self) -> bool:
        return self.selection.ahead

    def store(self, slots: Slots, where: torch.Tensor | slice, key_states: torch.Tensor) -> None:
        """Keep what the selection needs of the new tokens (see ``Selection.store``)."""
        self.selection.store(slots, where, key_states)

    def speculate(
        self,
        slots: Slots,
        x: torch.Tensor,
        rope: Any,
        positions: torch.Tensor,
        stored: int,
        held: list[int],
        clock: Clock,
    ) -> torch.Tensor:
        """Choose this step's rows and start copying them; returns the tokens fetched per row (b,)."""
        started = clock.start()
        chosen = self.selection.choose(slots, x, rope, positions, stored, held)
        clock.stop("speculate", started)
        started = clock.start()  # the copy, when it is not overlapped, counts as fetching
        rows, fetch = chosen if chosen is not None else (None, None)
        per_row = self.start(slots, rows, fetch, held, stored, self.selection.overlap)
        clock.stop("fetch", started)
        return per_row

    def start(
        self,
        slots: Slots,
        rows: torch.Tensor | None,
        fetch: torch.Tensor | None,
        held: list[int],
        stored: int,
        overlap: bool,
    ) -> torch.Tensor | list[float]:
        """Copy ``rows`` (b, h, k) (None: the first ``stored`` slots) to the fast tier, where
        ``fetch`` (b, h, k) (None: all) says which of them count; returns the tokens fetched per
        row (b,), on the host when every fetched row holds a token (``held[r]`` of the ``stored``
        slots do). Which fetched rows are valid is read now, before this step's token is written
        (it may land in an empty slot that is being copied)."""
        valid = slots.state["valid"]
        every_slot = all(h == stored for h in held)
        if rows is None:
            count, visible = stored, None if every_slot else valid[:, :, :stored].clone()
            per_row = [float(h) for h in held]
        else:
            count, visible = rows.shape[-1], None
            if not every_slot:
                visible = valid.gather(2, rows)
            if fetch is not None:
                visible = fetch if visible is None else visible & fetch
            per_row = [float(count)] * len(held) if visible is None else visible.sum(-1).float().mean(-1)
        self.transfer = self.fast.fetch(slots, rows, count, overlap, valid.device, self.room)
        self.fetched = (rows, visible, count)
        return per_row

    @property
    def started(self) -> bool:
        return self.transfer is not None

    def wait(self, clock: Clock) -> None:
        started = clock.start()
        self.transfer.wait()
        clock.stop("fetch", started)  # what an overlap did not hide

    def with_new(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads: the fetched rows, then the new tokens (or the ``room`` rows read
        beside them) (b, h, k + q, d)."""
        return self.fast.with_new(self.fetched[2], key_states, value_states)

    def visibility(self, beside: torch.Tensor | None = None) -> torch.Tensor | None:
        """Which fetched rows, and the rows beside them (``beside`` (b, h, q) bool; None: the new
        token), the step sees (b, h, 1, k + q), or None for all."""
        visible = self.fetched[1]
        if visible is None and beside is None:
            return None
        if visible is None:
            visible = torch.ones(*beside.shape[:2], self.fetched[2], dtype=torch.bool, device=beside.device)
        beside = torch.ones_like(visible[..., :1]) if beside is None else beside
        return torch.cat([visible, beside], -1)[:, :, None]

    def visibility_beside(self, beside: torch.Tensor) -> torch.Tensor:
        """Which fetched rows, and the rows beside them (``beside`` (b, h or 1, q, L) bool: each
        query's own), each of ``q`` queries sees (b, h, q, k + L); every fetched row that counts
        precedes them all."""
        visible = self.fetched[1]
        b, _, q, _ = beside.shape
        if visible is None:
            visible = torch.ones(b, 1, self.fetched[2], dtype=torch.bool, device=beside.device)
        heads = max(visible.shape[1], beside.shape[1])
        fetched = visible[:, :, None].expand(b, heads, q, -1)
        return torch.cat([fetched, beside.expand(b, heads, q, -1)], -1)

    def fetched_positions(self, slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions of the fetched rows (b, h, k), and which count."""
        rows, visible, count = self.fetched
        state = slots.state
        position = state["position"][:, :, :count] if rows is None else state["position"].gather(2, rows)
        return position, torch.ones_like(position, dtype=torch.bool) if visible is None else visible

    def attended_positions(self, slots: Slots, current: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions of the fetched rows and the current token ``current`` (b,), and which count."""
        position, visible = self.fetched_positions(slots)
        current = current.view(-1, 1, 1).expand(-1, position.shape[1], 1)
        return torch.cat([position, current], -1), torch.cat([visible, torch.ones_like(visible[..., :1])], -1)

    def done(self) -> None:
        self.transfer = self.fetched = None
