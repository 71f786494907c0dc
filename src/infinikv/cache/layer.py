"""The transformers-facing cache layer: a thin adapter over the stages a policy composes.

A ``KVLayer`` holds ``Slots`` (storage), and optionally an ``Evictor`` (a rule within a budget,
``cache.evict``) and a ``TwoTier`` fetch stage (``cache.fetch``); it counts what it did in
``Stats``. Each forward of a layer goes through three calls:

1. ``begin`` (host only): plan the write, the eviction and the mask from counts kept on the
   host; the decode core calls it for every layer before the forward (``KVCache.begin``),
   otherwise the attention module's pre-hook does, from the mask transformers built;
2. ``update`` (called by the model): write the new tokens into free slots and return what
   attention reads (the slots, or the rows fetched to the fast tier);
3. ``attend`` (called by infinikv's attention function): attention, observation, eviction.

For storage alone and the evicting stages, ``update`` and ``attend`` are tensor operations with
no host synchronisation and no Python state that changes from one decode step to the next, so
a steady decode step can run under ``torch.compile``; a fetch stage reads no device either, but
the size of its copy changes as tokens arrive (see ``cache.fetch``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from ..errors import InfinikvError
from ..kv import attend as attention
from ..kv.slots import Slots, Write
from .evict import NOTHING, Eviction, Evictor
from .fetch import TwoTier
from .stats import Clock, Stats

NOT_ATTACHED = (
    "this model's attention does not run through infinikv: call infinikv.attach(model) "
    "(infinikv.load_model does it) before using an infinikv cache"
)


@dataclass(frozen=True)
class Plan:
    """What one forward of a layer does, decided on the host before it runs."""

    write: Write
    masked: bool  # some slot attention reads is empty, or some new token is padding
    fresh: bool  # the first chunk, no padding: plain causal attention
    eviction: Eviction
    fetch: bool  # attends to rows fetched from the slow tier


class KVLayer(CacheLayerMixin):
    """One layer's cache: ``slots``, an optional ``evictor`` and ``tiers`` (see the module
    docstring). ``window``: the model's own sliding window for this layer (a query sees the
    newest ``window`` positions, itself included), masked inside a chunk."""

    is_croppable = False  # eviction makes "drop the last n tokens" meaningless
    pools: tuple[Slots, ...] = ()  # more slots whose rows follow the layer's (a recall layer's pool)
    spill: Callable[[Slots, torch.Tensor], None] | None = None  # gets what the evictor drops (recall's pool)

    def __init__(
        self, slots: Slots, evictor: Evictor | None = None, tiers: TwoTier | None = None, window: int | None = None
    ) -> None:
        super().__init__()
        self.slots, self.evictor, self.tiers, self.window = slots, evictor, tiers, window
        for part in (evictor, tiers):
            for name, spec in (part.specs if part else {}).items():
                slots.add_state(name, spec)
        self.cumulative_length = 0  # tokens seen, padding included (drives generate's slicing)
        self.seen: list[int] = []  # real tokens seen per row
        self.stats = Stats()
        self.clock = Clock()
        self.plan: Plan | None = None
        self.pending = False  # begun and not attended yet
        self.stored = 0  # slots that may have held a token before this forward
        self.held_before: list[int] = []  # ... and the tokens held per row then
        self.positions: torch.Tensor | None = None  # (b, q) of the current forward
        self.new_real: torch.Tensor | None = None  # (b, q) bool, None: all real
        self.where: torch.Tensor | slice | None = None  # the slots of the current chunk's tokens
        self.uniform = True  # every KV head holds the same tokens (nothing evicted yet): one mask serves all
        self.observer: Any = None  # called with each forward's query, scaling and attended positions (eval)

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return self.slots.static

    @property
    def is_sliding(self) -> bool:  # type: ignore[override]
        return self.window is not None

    # -- the host side -----------------------------------------------------------------------
    def expect(self, tokens: list[int]) -> None:
        """Say how many real tokens each row's prompt has, before its first chunk."""
        if self.evictor:
            self.evictor.expect(tokens, self.slots)

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
        fetch = self.fetches(q)
        write = slots.plan(q, real)
        held = slots.held  # with the new tokens, before any eviction: the most this forward holds
        if q == 1 and self.stored > 0 and not fetch:  # a decode step attends to every token held
            self.stats.attend(slots.tokens(), self.seen)
        self.stats.hold(slots.tokens())
        eviction = self.evictor.plan(slots, self.seen, before, positions.device) if self.evictor else NOTHING
        self.uniform = self.uniform and eviction.uniform
        self.positions, self.new_real = positions, new_real
        self.plan = Plan(
            write=write,
            masked=slots.static or new_real is not None or any(h < write.length for h in held),
            fresh=self.stored == 0 and new_real is None and write.contiguous and q <= (self.window or q),
            eviction=eviction,
            fetch=fetch,
        )
        self.pending = True

    def signature(self) -> tuple:
        """The planned values this layer's forward branches on (``KVCache.signature``)."""
        plan, eviction = self.plan, self.plan.eviction
        planned = (eviction.count, eviction.on_device, eviction.ranked, eviction.uniform)  # not the host's counts
        return (plan.write.length, plan.write.contiguous, plan.masked, plan.fresh, plan.fetch, planned, self.uniform)

    def fetches(self, q: int) -> bool:
        """A forward of ``q`` tokens per row attends to rows fetched from the slow tier: a decode
        step of two tiers, once something is stored."""
        return self.tiers is not None and q == 1 and self.stored > 0

    # -- the transformers contract -----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the slots allocate at their first write."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.pending:
            raise InfinikvError(NOT_ATTACHED)
        plan = self.plan
        self.is_initialized = True
        if plan.fetch:
            if not self.tiers.started:  # nothing ran ahead of this layer: fetch everything now
                self.stats.fetch(
                    self.tiers.start(self.slots, None, None, self.held_before, self.stored, False), *self.counts()
                )
            self.tiers.wait(self.clock)
        where = self.slots.write(plan.write, key_states, value_states, self.positions, self.new_real)
        if key_states.shape[2] > 1:
            self.where = where
        if self.tiers:
            self.tiers.store(self.slots, where, key_states)
        if plan.fetch:
            return self.tiers.with_new(key_states, value_states)
        return self.slots.view(plan.write.length)

    @property
    def reads_as_full(self) -> bool:
        """A prompt's K/V here are ``full``'s: it attends to every token it stored, exactly, and
        drops none, so K/V another such layer computed for the same prompt can be ``take``n."""
        return self.evictor is None and self.slots.exact

    def take(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store this forward's K/V (b, h, q, d) as computed by a layer that ``reads_as_full``,
        without attending: the model need not run again for a prompt read once. A rule that scores
        without attention (``Rule.rereads``) evicts as the forward would have."""
        self.update(key_states, value_states)
        self.cut()
        self.finish()

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
        plan = self.plan
        started = self.clock.start()
        evictor = None if plan.fetch else self.evictor  # a pool's eviction sees no attention
        observes = evictor is not None and evictor.observes
        if plan.fresh and not observes:
            out = attention.causal(query, key, value, scaling)
        else:
            bias = evictor.bias(self.slots, key.shape[2]) if evictor else None
            causal = observes and plan.fresh and key.shape[2] == query.shape[2]  # a prompt's first chunk
            visible = None if causal else self.visibility(query.shape[2], key.shape[2])
            if observes:
                out, mass, last = attention.weighted(query, key, value, visible, bias, scaling, causal, evictor.watched)
                evictor.observe(self.slots, mass, last, query.shape[2])
            else:
                out = attention.masked(query, key, value, visible, bias, scaling)
        if self.observer is not None:
            self.observer(query, scaling, *self.attended_positions(key.shape[2]))
        self.cut()
        self.clock.stop("attend", started)
        self.finish()
        return out

    def cut(self) -> None:
        """The planned eviction, after this forward's K/V are stored."""
        plan = self.plan
        if plan.eviction.count:
            self.evictor.evict(self.slots, self.positions[:, -1], plan.eviction, plan.write.length, self.spill)
        self.slots.settle(compact=plan.eviction.count > self.slots.per_token)  # more than a token's slots

    def finish(self) -> None:
        """This forward's tokens are stored (and attended): its copies from the slow tier are done."""
        if self.tiers:
            self.tiers.done()
        self.pending = False

    def attended_positions(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions of the keys this forward's last query attends to, and which count:
        (b, h, K) long and bool."""
        if self.plan.fetch:
            return self.tiers.attended_positions(self.slots, self.positions[:, -1])
        state = self.slots.state
        return state["position"][:, :, :length], state["valid"][:, :, :length]

    def visibility(self, q: int, length: int) -> torch.Tensor | None:
        """Which of the ``length`` keys each query sees ``(b, h or 1, q or 1, L)``, or None for all."""
        if self.plan.fetch:
            return self.tiers.visibility()
        return self.own_visibility(q, length)

    def own_visibility(self, q: int, length: int) -> torch.Tensor | None:
        """``visibility`` of this layer's own slots, whatever was fetched beside them."""
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

    # -- two tiers ---------------------------------------------------------------------------
    def counts(self) -> tuple[list[int], list[int]]:
        """Tokens held per row before the current step's token, and seen with it."""
        if self.pending:
            return self.held_before, self.seen
        return self.slots.held, [s + 1 for s in self.seen]

    def speculate(self, x: torch.Tensor, rope: Any, positions: torch.Tensor) -> None:
        """Called as the attention it chooses from starts, with its input x (b, q, D), RoPE and
        positions (b, q): a decode step of a layer with two tiers chooses its rows and starts
        copying them now."""
        stored = self.stored if self.pending else self.slots.n
        if x.shape[1] != 1 or stored == 0:
            return
        held, seen = self.counts()
        self.stats.fetch(self.tiers.speculate(self.slots, x, rope, positions, stored, held, self.clock), held, seen)

    # -- bytes, reset ------------------------------------------------------------------------
    def held_bytes(self) -> int:
        return self.slots.held_bytes()

    def tier_bytes(self) -> dict[str, int]:
        """K/V held now, by where it is held (one store here; a layer with a pool says more)."""
        return {"held": self.held_bytes()}

    def allocated_bytes(self) -> int:
        return self.slots.allocated_bytes()

    def peak_bytes(self) -> int:
        return sum(self.stats.peak) * self.slots.bytes_per_token()

    def reset(self) -> None:
        """Forget every token (the storage is allocated again at the next write)."""
        self.slots.clear()
        self.cumulative_length, self.seen, self.stats = 0, [], Stats()
        if self.evictor:
            self.evictor.reset()
        if not self.slots.static:
            self.slots.size = None
        self.plan, self.pending, self.uniform = None, False, True
        if self.tiers:
            self.tiers.done()
