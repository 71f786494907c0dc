"""The cache layer every policy is built from, and the cache that carries it across layers.

A ``KVLayer`` is a transformers cache layer composed of parts: ``Slots`` (storage), an optional
eviction ``Rule`` with its ``Budget``, an optional ``Fetcher`` (two tiers) and an optional
``Renumbering`` (RoPE positions by rank). Each forward of a layer goes through three calls:

1. ``begin`` (host only): plan the write, the eviction count and the mask from counts kept on
   the host; the decode core calls it for every layer before the forward (``KVCache.begin``),
   otherwise the attention module's pre-hook does, from the mask transformers built;
2. ``update`` (called by the model): write the new tokens into free slots and return what
   attention reads;
3. ``attend`` (called by infinikv's attention function): attention, observation, eviction.

``update`` and ``attend`` are tensor operations only, with no host synchronisation and no
Python state that changes from one decode step to the next, so a steady decode step can run
under ``torch.compile``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import InfinikvError
from ..kv import attend as attention
from ..kv.rope import Renumbering
from ..kv.slots import Slots, StateSpec, Write
from ..kv.tiers import FastTier, Transfer
from .base import Budget, Rule, Scoring

NOT_ATTACHED = (
    "this model's attention does not run through infinikv: call infinikv.attach(model) "
    "(infinikv.load_model does it) before using an infinikv cache"
)
FLOAT_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Plan:
    """What one forward of a layer does, decided on the host before it runs."""

    write: Write
    masked: bool  # some slot attention reads is empty, or some new token is padding
    fresh: bool  # the first chunk, no padding: plain causal attention
    evict: int  # victims per row
    on_device: bool  # a compiled step's single victim, dropped only where the device finds the row over
    ranked: bool | None  # rows renumbered by rank: all (True), none (False), some (None)
    fetch: bool  # attends to rows fetched from the slow tier


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


class Fetcher:
    """Chooses the slow-tier rows a decode step attends to; the layer moves them to the fast tier."""

    specs: dict[str, StateSpec] = {}
    ahead = True  # chooses from the previous layer's input (False: from the layer's own, no overlap)

    def __init__(self, overlap: bool = True) -> None:
        self.overlap = overlap

    def choose(
        self, layer: KVLayer, x: torch.Tensor, rope: Any, positions: torch.Tensor, stored: int
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Rows ``(b, h, k)`` and which of them count (or None: all), from the previous layer's
        attention input x (b, 1, D), the RoPE ``(cos, sin)`` that layer got (or None) and the
        positions (b, 1) of the step; None fetches every one of the ``stored`` slots."""
        return None

    def store(self, slots: Slots, where: torch.Tensor | slice, key_states: torch.Tensor) -> None:
        """Keep what the fast tier needs of the new tokens (e.g. partial keys)."""


class Stats:
    """What a layer did, per row, accumulated without reading the device."""

    def __init__(self) -> None:
        self.steps: list[int] = []  # decode steps per row
        self.keys: list[float] = []  # keys attended, summed over decode steps
        self.fraction: list[float] = []  # keys attended / tokens seen, summed over decode steps
        self.peak: list[int] = []  # most slots held at once
        self.fetch_steps: list[int] = []  # decode steps per row that fetched from the slow tier
        self.fetched: torch.Tensor | None = None  # (b,) tokens fetched per KV head, summed over steps
        self.fetched_fraction: torch.Tensor | None = None  # (b,) the same over the tokens stored
        self.attended_fraction: torch.Tensor | None = None  # (b,) fetched + the current token, over tokens seen

    def rows(self, b: int) -> None:
        if not self.steps:
            self.steps, self.keys, self.fraction, self.peak = [0] * b, [0.0] * b, [0.0] * b, [0] * b
            self.fetch_steps = [0] * b

    def select(self, rows: list[int]) -> None:
        for name in ("steps", "keys", "fraction", "peak", "fetch_steps"):
            setattr(self, name, [getattr(self, name)[r] for r in rows])
        for name in ("fetched", "fetched_fraction", "attended_fraction"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[rows])

    def extend(self, other: Stats) -> None:
        for name in ("fetched", "fetched_fraction", "attended_fraction"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None or theirs is not None:
                like = mine if mine is not None else theirs
                mine = mine if mine is not None else like.new_zeros(len(self.steps))
                theirs = theirs if theirs is not None else like.new_zeros(len(other.steps))
                setattr(self, name, torch.cat([mine, theirs]))
        for name in ("steps", "keys", "fraction", "peak", "fetch_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


class KVLayer(CacheLayerMixin):
    """One layer's cache, composed of parts (see the module docstring).

    ``fixed``: the storage is allocated once, for the capacity settled before the first chunk
    (``--capacity``, or ``--budget`` times the prompt's real tokens, see ``expect``), plus one
    spare slot so a decode step can attend to its new token before the rule picks its victim.
    ``window``: the model's own sliding window for this layer (a query sees the newest ``window``
    positions, itself included), masked inside a chunk (see ``window.window_layer``).
    """

    is_croppable = False  # eviction makes "drop the last n tokens" meaningless

    def __init__(
        self,
        slots: Slots,
        rule: Rule | None = None,
        budget: Budget | None = None,
        fetcher: Fetcher | None = None,
        renumbering: Renumbering | None = None,
        fixed: bool = False,
        window: int | None = None,
    ) -> None:
        super().__init__()
        if (rule is None) != (budget is None):
            raise ValueError("a rule needs a budget and a budget a rule")
        self.slots, self.rule, self.budget, self.fetcher, self.renumbering = slots, rule, budget, fetcher, renumbering
        self.fixed, self.window = fixed, window
        for name, spec in {**(rule.state if rule else {}), **(fetcher.specs if fetcher else {})}.items():
            slots.add_state(name, spec)
        if renumbering is not None:
            slots.add_state(Renumbering.STATE, StateSpec(torch.int32))
        self.cumulative_length = 0  # tokens seen, padding included (drives generate's slicing)
        self.seen: list[int] = []  # real tokens seen per row
        self.capacities: list[int] | None = None  # a fixed layer's capacity per row
        self.stats = Stats()
        self.clock = Clock()
        self.plan: Plan | None = None
        self.pending = False  # begun and not attended yet
        self.stored = 0  # slots that may have held a token before this forward
        self.held_before: list[int] = []  # ... and the tokens held per row then
        # the tensors of the current forward (set by ``begin``)
        self.positions: torch.Tensor | None = None  # (b, q)
        self.new_real: torch.Tensor | None = None  # (b, q) bool, None: all real
        self.take: torch.Tensor | None = None  # (b, 1, k) bool: the victims each row drops
        self.capacity: torch.Tensor | None = None  # (b, 1, 1)
        self.ranked_rows: torch.Tensor | None = None  # (b,) bool
        self._capacity_key: tuple | None = None
        self.where: torch.Tensor | slice | None = None  # the slots of the current chunk's tokens
        self.uniform = True  # every KV head holds the same tokens (nothing evicted yet): one mask serves all
        self.observer: Any = None  # called with the positions each decode step attends to (eval recall)
        self.fast = FastTier() if fetcher is not None else None
        self.transfer: Transfer | None = None
        self.fetched: tuple[torch.Tensor | None, torch.Tensor | None, int] | None = None  # rows, visible, count

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return self.slots.static

    @property
    def is_sliding(self) -> bool:  # type: ignore[override]
        return self.window is not None

    # -- the host side -----------------------------------------------------------------------
    def expect(self, tokens: list[int]) -> None:
        """Settle a fixed capacity on the ``tokens`` each row's prompt has, before its first chunk
        (a ``--budget`` fraction is of the whole prompt, however it is cut into chunks)."""
        if self.fixed and self.budget is not None and self.capacities is None:
            self.capacities = [self.budget.capacity(t) for t in tokens]
            self.slots.size = self.slots.size or max(self.capacities) + 1

    def begin(self, q: int, positions: torch.Tensor, new_real: torch.Tensor | None, real: list[int]) -> None:
        """Plan this forward of ``q`` tokens per row, ``real[r]`` of which are real (the others,
        ``new_real`` False, are left padding); ``positions`` (b, q) long on the device."""
        slots, b = self.slots, len(real)
        if not self.seen:
            self.seen = [0] * b
            self.stats.rows(b)
        before = self.seen
        self.seen = [s + r for s, r in zip(before, real, strict=True)]
        self.cumulative_length += q
        self.stored, self.held_before = slots.n, list(slots.held or [0] * b)
        capacities = None
        if self.budget is not None:
            if self.fixed:
                if self.capacities is None:  # settled once: by the prompt (``expect``), else the first chunk
                    self.expect(self.seen)
                capacities = self.capacities
            else:
                capacities = [self.budget.capacity(s) for s in self.seen]
        fetch = self.fetcher is not None and q == 1 and self.stored > 0
        write = slots.plan(q, real)
        held = slots.held
        if q == 1 and self.stored > 0 and not fetch:  # a decode step attends to every token held
            for r, (h, s) in enumerate(zip(held, self.seen, strict=True)):
                self.stats.steps[r] += 1
                self.stats.keys[r] += h
                self.stats.fraction[r] += h / max(s, 1)
        evict, even, static = 0, True, False
        if capacities is not None:
            excess = [max(0, h - c) for h, c in zip(held, capacities, strict=True)]
            slots.forget(excess)
            evict, even = max(excess), len(set(excess)) == 1
            self.uniform = self.uniform and evict == 0 and not slots.static
            static = slots.static and evict <= 1
            if static:  # one victim at most, decided on the device: the same plan every step
                evict, even = 1, True
            self.take = None
            if evict and not even:
                self.take = torch.arange(evict, device=positions.device) < torch.tensor(
                    excess, device=positions.device
                ).view(b, 1, 1)
            key = tuple(capacities)
            if key != self._capacity_key:
                self.capacity = torch.tensor(capacities, device=positions.device).view(b, 1, 1)
                self._capacity_key = key
        self.stats.peak = [max(p, h) for p, h in zip(self.stats.peak, slots.held, strict=True)]
        ranked: bool | None = False
        if self.renumbering is not None:
            threshold = self.renumbering.threshold
            flags = [s > threshold for s in self.seen]
            crossing = [s > threshold and was <= threshold for s, was in zip(self.seen, before, strict=True)]
            if any(crossing) and slots.ready:
                rows = torch.tensor(crossing, device=positions.device)
                state = slots.state
                self.renumbering.catch_up(slots.keys, state[Renumbering.STATE], state["valid"], rows)
            ranked = True if all(flags) else False if not any(flags) else None
            self.ranked_rows = None if ranked is not None else torch.tensor(flags, device=positions.device)
        self.positions, self.new_real = positions, new_real
        self.plan = Plan(
            write=write,
            masked=slots.static or new_real is not None or any(h < write.length for h in held),
            fresh=self.stored == 0 and new_real is None and write.contiguous and q <= (self.window or q),
            evict=evict,
            on_device=static,
            ranked=ranked,
            fetch=fetch,
        )
        self.pending = True

    def begin_from_mask(
        self,
        b: int,
        q: int,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        device: torch.device,
    ) -> None:
        """``begin`` for a forward the decode core did not plan (e.g. ``model.generate``): which new
        tokens are real comes from the mask transformers built (this reads the device)."""
        new_real = None
        if attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.dim() == 4:
            # a token sees itself unless it is padding (the last row would miss the tokens a
            # sliding window hides from it)
            row = attention_mask[:, 0, -q:, -q:].diagonal(dim1=-2, dim2=-1)
            new_real = None if bool(row.all()) else row
        if position_ids is None:
            position_ids = torch.arange(self.cumulative_length, self.cumulative_length + q, device=device)[None]
        positions = position_ids.expand(b, q)
        real = [q] * b if new_real is None else new_real.sum(-1).tolist()
        self.begin(q, positions, new_real, real)

    # -- the transformers contract -----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the slots allocate at their first write."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.pending:
            raise InfinikvError(NOT_ATTACHED)
        plan = self.plan
        self.is_initialized = True
        if plan.fetch:
            if self.transfer is None:  # nothing ran ahead of this layer: fetch everything now
                self.start_fetch(None, self.stored, overlap=False)
            started = self.clock.start()
            self.transfer.wait()
            self.clock.stop("fetch", started)  # what an overlap did not hide
        where = self.slots.write(plan.write, key_states, value_states, self.positions, self.new_real)
        if key_states.shape[2] > 1:
            self.where = where
        if self.fetcher is not None:
            self.fetcher.store(self.slots, where, key_states)
        if plan.fetch:
            return self.fast.with_new(self.fetched[2], key_states, value_states)
        return self.slots.view(plan.write.length)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # transformers' mask then covers exactly the new tokens: their padding and causality
        return query_length, self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    # -- attention ---------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of this forward's queries (b, H, q, d) over what ``update`` returned, then the
        rule's observation and eviction. Returns (b, H, q, d)."""
        plan, rule = self.plan, self.rule
        started = self.clock.start()
        if plan.fresh and (rule is None or not rule.observes):
            out = attention.causal(query, key, value, scaling)
        else:
            bias = rule.logit_bias(self.slots, key.shape[2]) if rule is not None and not plan.fetch else None
            if rule is not None and rule.observes and not plan.fetch:
                causal = plan.fresh and key.shape[2] == query.shape[2]  # a prompt's first chunk: no mask needed
                visible = None if causal else self.visibility(query.shape[2], key.shape[2])
                out, mass, last = attention.weighted(query, key, value, visible, bias, scaling, causal)
                rule.observe(self.slots, mass, last)
            else:
                out = attention.masked(query, key, value, self.visibility(query.shape[2], key.shape[2]), bias, scaling)
        if self.observer is not None:
            self.observer(*self.attended_positions(key.shape[2]))
        if plan.evict:
            self.evict()
        self.slots.settle(compact=plan.evict > 1)
        self.clock.stop("attend", started)
        self.transfer = self.fetched = None
        self.pending = False
        return out

    def attended_positions(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions of the keys this forward's last query attends to, and which count:
        (b, h, K) long and bool."""
        state = self.slots.state
        if not self.plan.fetch:
            return state["position"][:, :, :length], state["valid"][:, :, :length]
        rows, visible, count = self.fetched
        position = state["position"][:, :, :count] if rows is None else state["position"].gather(2, rows)
        visible = torch.ones_like(position, dtype=torch.bool) if visible is None else visible
        current = self.positions[:, -1].view(-1, 1, 1).expand(-1, position.shape[1], 1)
        return torch.cat([position, current], -1), torch.cat([visible, torch.ones_like(visible[..., :1])], -1)

    def visibility(self, q: int, length: int) -> torch.Tensor | None:
        """Which of the ``length`` keys each query sees ``(b, h or 1, q or 1, L)``, or None for all."""
        if self.plan.fetch:
            visible = self.fetched[1]
            if visible is None:
                return None
            return torch.cat([visible, torch.ones_like(visible[..., :1])], -1)[:, :, None]
        heads = slice(0, 1) if self.uniform else slice(None)  # (b, 1, ...) broadcasts over the heads
        valid = self.slots.state["valid"][:, heads, :length]
        if q == 1:
            return valid[:, :, None] if self.plan.masked else None
        position = self.slots.state["position"][:, heads, :length]
        distance = self.positions[:, None, :, None] - position[:, :, None, :]  # (b, h, q, L)
        visible = valid[:, :, None, :] & (distance >= 0)
        if self.window is not None:
            visible &= distance < self.window
        own = self.where  # a new token always sees itself (a padding query must see something)
        if isinstance(own, slice):
            visible[:, :, :, own] |= torch.eye(q, dtype=torch.bool, device=visible.device)
        else:
            visible.scatter_(3, own[:, heads, :, None], True)
        return visible

    def evict(self) -> None:
        """Drop each row's lowest-scored valid slots, the newest first among equal scores (so the
        choice never depends on where tokens sit in the slots): O(capacity) for a decode step."""
        plan, slots = self.plan, self.slots
        length = plan.write.length
        valid = slots.state["valid"][:, :, :length]
        newest = self.positions[:, -1].view(-1, 1, 1)
        scores = self.rule.scores(slots, Scoring(length, self.capacity, newest))
        scores = scores.clamp(max=FLOAT_MAX).masked_fill(~valid, math.inf)  # never pick an empty slot
        position = slots.state["position"][:, :, :length]
        if plan.evict == 1:  # the lowest score; among equal scores, the newest token
            lowest = scores == scores.amin(-1, keepdim=True)
            victims = position.masked_fill(~lowest, -1).argmax(-1, keepdim=True)
        else:  # a chunk: the same order, by two stable sorts
            by_age = position.argsort(dim=-1, descending=True, stable=True)
            order = scores.gather(-1, by_age).argsort(dim=-1, stable=True)[..., : plan.evict]
            victims = by_age.gather(-1, order)
        take = self.take
        if plan.on_device:  # the plan always has one victim: drop it only where the row is over
            take = valid.sum(-1, keepdim=True) > self.capacity
        if self.renumbering is not None:
            ranked = plan.ranked if plan.ranked is not None else self.ranked_rows
            state = slots.state
            self.renumbering.evict(
                slots.keys[:, :, :length],
                state[Renumbering.STATE][:, :, :length],
                state["position"][:, :, :length],
                valid,
                victims,
                take,
                ranked,
            )
        self.rule.evict(slots, victims, take, length)

    # -- two tiers ---------------------------------------------------------------------------
    def speculate(self, x: torch.Tensor, rope: Any, positions: torch.Tensor) -> None:
        """Called as the previous layer's attention starts with its input x (b, q, D), RoPE and
        positions (b, q): a layer that fetches chooses its rows and starts copying them now."""
        stored = self.slots.n if not self.pending else self.stored
        if self.fetcher is None or x.shape[1] != 1 or stored == 0:
            return
        started = self.clock.start()
        chosen = self.fetcher.choose(self, x, rope, positions, stored)
        self.clock.stop("speculate", started)
        started = self.clock.start()  # the copy, when it is not overlapped, counts as fetching
        if chosen is None:
            self.start_fetch(None, stored, self.fetcher.overlap)
        else:
            self.start_fetch(*chosen, overlap=self.fetcher.overlap)
        self.clock.stop("fetch", started)

    def start_fetch(self, rows: torch.Tensor | None, take: torch.Tensor | int | None, overlap: bool) -> None:
        """Copy ``rows`` (b, h, k) (None: the first ``take`` slots) to the fast tier and log it.

        Which fetched rows are valid is read now, before this step's token is written (it may
        land in an empty slot that is being copied)."""
        slots = self.slots
        device = slots.state["valid"].device
        held = self.held_before if self.pending else slots.held
        if rows is None:
            count = take
            full = all(h == count for h in held)
            visible = None if full else slots.state["valid"][:, :, :count].clone()
            per_row = torch.tensor(held, dtype=torch.float32, device=device)
        else:
            count = rows.shape[-1]
            visible = slots.state["valid"].gather(2, rows)
            if take is not None:
                visible &= take
            per_row = visible.sum(-1).float().mean(-1)
        self.transfer = self.fast.fetch(slots, rows, count, overlap, device)
        self.fetched = (rows, visible, count)
        seen = self.seen if self.pending else [s + 1 for s in self.seen]  # the current token included
        stored = torch.tensor(held, dtype=torch.float32, device=device).clamp(min=1)
        seen = torch.tensor(seen, dtype=torch.float32, device=device)
        stats = self.stats
        stats.fetch_steps = [n + 1 for n in stats.fetch_steps]
        for name, value in (("fetched", per_row), ("fetched_fraction", per_row / stored)):
            total = getattr(stats, name)
            setattr(stats, name, value if total is None else total + value)
        attended = (per_row + 1) / seen
        stats.attended_fraction = attended if stats.attended_fraction is None else stats.attended_fraction + attended

    # -- rows, bytes -------------------------------------------------------------------------
    def held_bytes(self) -> int:
        return self.slots.held_bytes()

    def allocated_bytes(self) -> int:
        return self.slots.allocated_bytes()

    def peak_bytes(self) -> int:
        return sum(self.stats.peak) * self.slots.bytes_per_token()

    def reset(self) -> None:
        """Forget every token (the storage is allocated again at the next write)."""
        self.slots.clear()
        self.cumulative_length, self.seen, self.stats = 0, [], Stats()
        self.capacities = None  # settled again by the next first chunk, and the storage with them
        if not self.slots.static:
            self.slots.size = None
        self.plan, self.pending, self._capacity_key, self.uniform = None, False, None, True
        self.take = self.transfer = self.fetched = None


class KVCache(Cache):
    """The one object that carries KV state across layers: a ``Cache`` of ``KVLayer`` objects."""

    def __init__(self, layers: list[KVLayer], description: dict[str, Any], label: str) -> None:
        super().__init__(layers=layers)
        self.description, self.label = description, label
        self.stepping = False  # the decode core planned the current forward
        self.clock = Clock()
        for layer in layers:
            layer.clock = self.clock

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return all(layer.is_compileable for layer in self.layers)

    @property
    def rows(self) -> int:
        return len(self.layers[0].seen)

    def expect(self, tokens: list[int]) -> None:
        """Say how many tokens each row's prompt has, before it is fed in chunks."""
        for layer in self.layers:
            layer.expect(tokens)

    def begin(self, q: int, positions: torch.Tensor, new_real: torch.Tensor | None, real: list[int]) -> None:
        """Plan the next forward of every layer (see ``KVLayer.begin``)."""
        for layer in self.layers:
            layer.begin(q, positions, new_real, real)
        self.stepping = True

    def end(self) -> None:
        self.stepping = False

    def before_attention(
        self,
        layer_idx: int,
        x: torch.Tensor,
        rope: Any,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> None:
        """Layer ``layer_idx``'s attention is about to run on ``x``: plan it if the core did not,
        and let the layer that speculates from this input (the next one, or this one when it has
        no layer ahead of it) choose and fetch its rows."""
        layer = self.layers[layer_idx]
        if not self.stepping:
            layer.begin_from_mask(x.shape[0], x.shape[1], attention_mask, position_ids, x.device)
        if layer.fetcher is not None and not layer.fetcher.ahead:
            layer.speculate(x, rope, layer.positions)
        following = self.layers[layer_idx + 1] if layer_idx + 1 < len(self.layers) else None
        if following is not None and following.fetcher is not None and following.fetcher.ahead:
            following.speculate(x, rope, layer.positions)

    # -- what it did -------------------------------------------------------------------------
    def held_bytes(self) -> int:
        return sum(layer.held_bytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)

    def peak_bytes(self) -> int:
        return sum(layer.peak_bytes() for layer in self.layers)

    def row_peak_bytes(self, row: int) -> int:
        return sum(layer.stats.peak[row] * layer.slots.bytes_per_token() for layer in self.layers)

    def attended(self, rows: list[int] | None = None) -> tuple[list[float], list[float]]:
        """Mean keys attended per decode step, and that over the tokens seen, per layer (mean over
        ``rows``, default all); a fetching layer's decode steps attend to its fetched rows + 1."""
        counts, fractions = [], []
        for layer in self.layers:
            s = layer.stats
            picked = rows if rows is not None else range(len(s.steps))
            if any(s.fetch_steps):
                fetched, fraction, n = s.fetched.tolist(), s.attended_fraction.tolist(), s.fetch_steps
                counts.append(sum(fetched[r] / max(n[r], 1) + 1 for r in picked) / len(picked))
                fractions.append(sum(fraction[r] / max(n[r], 1) for r in picked) / len(picked))
                continue
            steps = [s.steps[r] for r in picked if s.steps[r]]
            if not steps:
                counts.append(0.0)
                fractions.append(1.0)
                continue
            counts.append(sum(s.keys[r] / s.steps[r] for r in picked if s.steps[r]) / len(steps))
            fractions.append(sum(s.fraction[r] / s.steps[r] for r in picked if s.steps[r]) / len(steps))
        return counts, fractions

    def transfer_summary(self, rows: list[int] | None = None) -> dict[str, float] | None:
        """Slow->fast traffic per decode step, for two-tier caches (else None)."""
        layers = [layer for layer in self.layers if any(layer.stats.fetch_steps)]
        if not layers:
            return None
        tokens, fractions, moved = [], [], 0.0
        for layer in layers:
            s = layer.stats
            steps = torch.tensor(s.fetch_steps, device=s.fetched.device).clamp(min=1)
            per_row = (s.fetched / steps).tolist()
            ratio = (s.fetched_fraction / steps).tolist()
            picked = rows if rows is not None else range(len(per_row))
            tokens.append(sum(per_row[r] for r in picked) / len(picked))
            fractions.append(sum(ratio[r] for r in picked) / len(picked))
            moved += sum(per_row[r] for r in picked) * layer.slots.bytes_per_token()
        return {
            "fetched_fraction": sum(fractions) / len(fractions),
            "tokens_fetched_per_step": sum(tokens),
            "bytes_moved_per_step": moved,
        }

    # -- rows (the server's continuous batching) ----------------------------------------------
    def append_rows(self, other: KVCache) -> None:
        """Take ``other``'s sequences as rows after this cache's (both built by the same policy)."""
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.slots.append_rows(theirs.slots)
            if not mine.seen:
                mine.stats = theirs.stats
            else:
                mine.stats.extend(theirs.stats)
            mine.seen = mine.seen + theirs.seen
            if theirs.capacities is not None:
                mine.capacities = (mine.capacities or []) + theirs.capacities
                mine.slots.size = max(mine.slots.size or 0, theirs.slots.size or 0) or None
            mine.cumulative_length = max(mine.cumulative_length, theirs.cumulative_length)
            mine.uniform = mine.uniform and theirs.uniform
            mine._capacity_key = None

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the sequences ``rows`` (in that order)."""
        for layer in self.layers:
            layer.slots.keep_rows(rows)
            layer.seen = [layer.seen[r] for r in rows]
            layer.stats.select(rows)
            if layer.capacities is not None:
                layer.capacities = [layer.capacities[r] for r in rows]
            layer._capacity_key = None


class GroupLayer(CacheLayerMixin):
    """Layer ``i`` of several caches whose rows share one forward: each group of rows (a
    contiguous slice of the batch) goes to its own cache layer, attention included."""

    is_compileable = False

    def __init__(self, layers: list[KVLayer], slices: list[slice]) -> None:
        super().__init__()
        self.layers, self.slices = layers, slices
        self.is_sliding = layers[0].is_sliding
        self.stored: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the groups own their storage."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.stored = [
            layer.update(key_states[rows], value_states[rows])
            for layer, rows in zip(self.layers, self.slices, strict=True)
        ]
        return key_states, value_states

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        outputs = [
            layer.attend(query[rows], k, v, scaling)
            for layer, rows, (k, v) in zip(self.layers, self.slices, self.stored, strict=True)
        ]
        self.stored = []
        return torch.cat(outputs)

    def get_seq_length(self) -> int:
        return max(layer.get_seq_length() for layer in self.layers)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.get_seq_length()

    def get_max_length(self) -> int:
        return -1


class GroupedCache(Cache):
    """Several ``KVCache`` objects (each a group of rows, possibly of different policies) run in
    one forward of the model: the dense parts over every row at once, attention per group."""

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches
        self.slices = row_slices([cache.rows for cache in caches])
        layers = [GroupLayer([c.layers[i] for c in caches], self.slices) for i in range(len(caches[0].layers))]
        super().__init__(layers=layers)

    def before_attention(
        self, layer_idx: int, x: torch.Tensor, rope: Any, attention_mask: Any, position_ids: Any
    ) -> None:
        for cache, rows in zip(self.caches, self.slices, strict=True):
            own = None if rope is None else tuple(t[rows] for t in rope)
            cache.before_attention(layer_idx, x[rows], own, None, None)


def row_slices(counts: list[int]) -> list[slice]:
    """Consecutive slices of a batch holding ``counts[i]`` rows each."""
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    return [slice(a, b) for a, b in zip(starts, starts[1:], strict=False)]
