"""The eviction stage: keeps each row of a layer within its budget, by a rule.

The host side (``plan``) counts what each row holds against its capacity, from counts kept on
the host; the device side (``evict``) scores the slots with the rule and drops the lowest, with
tensor operations only. An optional ``Renumbering`` moves the kept RoPE keys as tokens go.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import native
from ..contract import Budget, Rule, Scoring
from ..kv.rope import Renumbering
from ..kv.slots import Slots, StateSpec

FLOAT_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Eviction:
    """What a forward evicts, decided on the host: ``count`` victims per row; ``on_device``: a
    compiled step's single victim, dropped only where the device finds the row over; ``ranked``:
    rows renumbered by rank, all (True), none (False) or some (None); ``uniform``: every KV head
    still holds the same tokens (nothing evicted, storage that grows); ``excess``: the victims
    each row drops (the first of its ``count``)."""

    count: int = 0
    on_device: bool = False
    ranked: bool | None = False
    uniform: bool = True
    excess: tuple[int, ...] = ()


NOTHING = Eviction()


def lowest_slot(scores: torch.Tensor, valid: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row and KV head's next victim and its count of valid slots, (b, h, 1) each
    (``native.lowest_slot_reference``), by the native kernel where it runs."""
    if native.ready and scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.stride(-1) == 1:
        return torch.ops.infinikv.lowest_slot(scores, valid, position)
    return native.lowest_slot_reference(scores, valid, position)


class Evictor:
    """A ``rule`` and a ``budget``; ``fixed``: the capacity is settled once, by the prompt (see
    ``expect``), and the storage allocated for it plus one spare slot, so a decode step can
    attend to its new token before the rule picks its victim."""

    def __init__(self, rule: Rule, budget: Budget, fixed: bool = False, renumbering: Renumbering | None = None):
        self.rule, self.budget, self.fixed, self.renumbering = rule, budget, fixed, renumbering
        self.specs: dict[str, StateSpec] = dict(rule.state)
        if renumbering is not None:
            self.specs[Renumbering.STATE] = StateSpec(torch.int32)
        self.capacities: list[int] | None = None  # a fixed capacity per row
        self.parts: list[float] | None = None  # each row's part of an even share (``spread``); None: even
        self.capacity: torch.Tensor | None = None  # (b, 1, 1) on the device
        self._capacity_key: tuple | None = None
        self.take: torch.Tensor | None = None  # (b, 1, k) bool: the victims each row drops
        self.ranked_rows: torch.Tensor | None = None  # (b,) bool

    @property
    def observes(self) -> bool:
        """The rule needs the attention probabilities (``observe``)."""
        return self.rule.observes

    def observe(self, slots: Slots, mass: torch.Tensor, last: torch.Tensor, queries: int) -> None:
        self.rule.observe(slots, mass, last, queries)

    @property
    def watched(self) -> int:
        """How many newest queries the rule's ``last`` observation sums."""
        return self.rule.watched()

    def bias(self, slots: Slots, length: int) -> torch.Tensor | None:
        """The rule's attention-logit bias per slot (b, h, L), or None."""
        return self.rule.logit_bias(slots, length)

    def expect(self, tokens: list[int], slots: Slots) -> None:
        """Settle a fixed capacity on the ``tokens`` each row's prompt has, before its first chunk
        (a ``--budget`` fraction is of the whole prompt, however it is cut into chunks)."""
        if self.fixed and self.capacities is None:
            self.capacities = [self.budget.capacity(t) for t in tokens]
            slots.size = slots.size or max(self.capacities) + 1

    def spread(self, parts: list[float]) -> None:
        """This layer's part of an even share of the budget, per row (``Rule.spread``). A fixed
        capacity keeps its even share: its storage was allocated by it before the prompt was read."""
        self.parts = None if self.fixed else parts
        self._capacity_key = None

    def plan(self, slots: Slots, seen: list[int], before: list[int], device: torch.device) -> Eviction:
        """Count each row's excess over its capacity as gone (``slots.forget``) and plan the
        victims; rows that cross the renumbering threshold are caught up now."""
        if self.fixed:
            if self.capacities is None:  # settled once: by the prompt (``expect``), else the first chunk
                self.expect(seen, slots)
            capacities = self.capacities
        else:
            parts = self.parts or [1.0] * len(seen)
            capacities = [self.budget.capacity(s, part) * slots.per_token for s, part in zip(seen, parts, strict=True)]
        excess = [max(0, h - c) for h, c in zip(slots.held, capacities, strict=True)]
        slots.forget(excess)
        count, even = max(excess), len(set(excess)) == 1
        uniform = count == 0 and not slots.static
        on_device = slots.static and count <= 1
        if on_device:  # one victim at most, decided on the device: the same plan every step
            count, even = 1, True
        self.take = None
        if count and not even:
            self.take = torch.arange(count, device=device) < torch.tensor(excess, device=device).view(-1, 1, 1)
        key = tuple(capacities)
        if key != self._capacity_key:
            self.capacity = torch.tensor(capacities, device=device).view(-1, 1, 1)
            self._capacity_key = key
        ranked = False if self.renumbering is None else self.rank(slots, seen, before, device)
        return Eviction(count, on_device, ranked, uniform, tuple(excess))

    def rank(self, slots: Slots, seen: list[int], before: list[int], device: torch.device) -> bool | None:
        """Which rows are renumbered by rank (see ``Eviction.ranked``)."""
        threshold = self.renumbering.threshold
        flags = [s > threshold for s in seen]
        crossing = [s > threshold and was <= threshold for s, was in zip(seen, before, strict=True)]
        if any(crossing) and slots.ready:
            state = slots.state
            rows = torch.tensor(crossing, device=device)
            self.renumbering.catch_up(slots.keys, state[Renumbering.STATE], state["valid"], rows)
        ranked = True if all(flags) else False if not any(flags) else None
        self.ranked_rows = None if ranked is not None else torch.tensor(flags, device=device)
        return ranked

    def evict(
        self,
        slots: Slots,
        newest: torch.Tensor,
        eviction: Eviction,
        length: int,
        spill: Callable[[Slots, torch.Tensor], None] | None = None,
    ) -> None:
        """Drop each row's lowest-scored valid slots among the first ``length``, the newest first
        among equal scores (so the choice never depends on where tokens sit in the slots):
        O(capacity) for a decode step. ``newest`` (b,) the position of each row's newest token.
        ``spill``, if given, gets the slots and the victims (b, h, k) before they go. (It is an
        argument, not an attribute: a layer's method kept here would make a reference cycle, and
        a cache in a cycle is freed only by the garbage collector's rare full passes.)"""
        valid = slots.state["valid"][:, :, :length]
        scores = self.rule.scores(slots, Scoring(length, self.capacity, newest.view(-1, 1, 1)))
        position = slots.state["position"][:, :, :length]
        take = self.take
        if eviction.count == 1:  # the lowest score; among equal scores, the newest token
            victims, held = lowest_slot(scores, valid, position)
            if eviction.on_device:  # the plan always has one victim: drop it only where the row is over
                take = held > self.capacity
        else:  # a chunk: the same order, by two stable sorts
            scores = scores.clamp(max=FLOAT_MAX).masked_fill(~valid, math.inf)  # never pick an empty slot
            by_age = position.argsort(dim=-1, descending=True, stable=True)
            order = scores.gather(-1, by_age).argsort(dim=-1, stable=True)[..., : eviction.count]
            victims = by_age.gather(-1, order)
        if self.renumbering is not None:
            ranked = eviction.ranked if eviction.ranked is not None else self.ranked_rows
            after = slots.state[Renumbering.STATE][:, :, :length]
            self.renumbering.evict(slots.keys[:, :, :length], after, position, valid, victims, take, ranked)
        if spill is not None:
            spill(slots, victims)
        self.rule.evict(slots, victims, take, length)

    # -- rows --------------------------------------------------------------------------------
    def keep_rows(self, rows: list[int]) -> None:
        if self.capacities is not None:
            self.capacities = [self.capacities[r] for r in rows]
        if self.parts is not None:
            self.parts = [self.parts[r] for r in rows]
        self._capacity_key = None

    def append_rows(self, other: Evictor, rows: int, their_rows: int) -> None:
        """Take ``other``'s rows (``their_rows``) after this one's ``rows``."""
        if other.capacities is not None:
            self.capacities = (self.capacities or []) + other.capacities
        if self.parts is not None or other.parts is not None:
            self.parts = (self.parts or [1.0] * rows) + (other.parts or [1.0] * their_rows)
        self._capacity_key = None

    def reset(self) -> None:
        self.capacities = self.parts = None  # settled again by the next prompt, and the storage with them
        self._capacity_key = self.take = None
