"""Both seeds in one layer: a bounded fast tier whose evicted tokens move to a two-tier pool.

The fast tier is BCT's: ``slots`` allocated once for a capacity, kept within it by an
``Evictor`` with any rule. What its rule evicts is not dropped but *spilled* into the pool (slots
on the slow tier, as InfiniGen keeps them), and each decode step attends to the whole fast tier
plus the few pooled rows a ``Selection`` (InfiniGen's speculation) picks for it. A prompt is read
densely, as InfiniGen reads it: each prefill chunk attends to the whole pool beside the fast tier,
so what the prompt's tokens compute (the question's, the needle's context) is ``full``'s, not a
window's. The fast tier's K/V never grow; the pool keeps every token it was given. Keys keep the
positions they were seen at (no renumbering: a pooled key must match the position its partial key
was stored with).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InfinikvError
from ..kv import attend as attention
from ..kv.layout import expand_to, put
from ..kv.slots import Slots, Write
from .evict import Evictor
from .fetch import TwoTier
from .layer import NOT_ATTACHED, KVLayer


class RecallLayer(KVLayer):
    """A fast tier (``slots`` + ``evictor``) over a ``pool`` read through ``tiers``."""

    def __init__(self, slots: Slots, evictor: Evictor, pool: Slots, tiers: TwoTier) -> None:
        super().__init__(slots, evictor)
        for name, spec in tiers.specs.items():
            pool.add_state(name, spec)
        self.pool, self.tiers = pool, tiers
        self.pools = (pool,)
        self.pool_stored = 0  # pool slots that may hold a token before this forward's spill
        self.pool_held: list[int] = []  # ... and its tokens per row then
        self.spilled: tuple[Write, list[int]] | None = None  # the pool's write of this forward's victims
        self.fast_attended: list[int] = []  # fast-tier tokens per row this forward attends to

    def begin(self, q: int, positions: torch.Tensor, new_real: torch.Tensor | None, real: list[int]) -> None:
        self.pool_stored, self.pool_held = self.pool.n, list(self.pool.held or [0] * len(real))
        super().begin(q, positions, new_real, real)
        eviction = self.plan.eviction
        excess = list(eviction.excess)
        self.spilled = (self.pool.plan(eviction.count, excess), excess) if eviction.count else None
        self.fast_attended = [h + e for h, e in zip(self.slots.held, excess, strict=True)]  # before it evicts
        self.tiers.room = self.plan.write.length

    def fetches(self, q: int) -> bool:
        return self.pool_stored > 0  # a prefill chunk reads the whole pool

    def speculate(self, x: torch.Tensor, rope: Any, positions: torch.Tensor) -> None:
        if x.shape[1] != 1 or not self.pending or self.pool_stored == 0:
            return
        per_row = self.tiers.speculate(self.pool, x, rope, positions, self.pool_stored, self.pool_held, self.clock)
        self.stats.fetch(per_row, self.pool_held, self.seen, self.fast_attended)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.pending:
            raise InfinikvError(NOT_ATTACHED)
        plan = self.plan
        self.is_initialized = True
        if plan.fetch:
            if not self.tiers.started:  # a prefill chunk, or nothing ran ahead: fetch the whole pool
                per_row = self.tiers.start(self.pool, None, None, self.pool_held, self.pool_stored, False)
                if key_states.shape[2] == 1:  # a decode step's share attended (a prefill's is all)
                    self.stats.fetch(per_row, self.pool_held, self.seen, self.fast_attended)
            self.tiers.wait(self.clock)
        where = self.slots.write(plan.write, key_states, value_states, self.positions, self.new_real)
        if key_states.shape[2] > 1:
            self.where = where
        keys, values = self.slots.view(plan.write.length)
        return self.tiers.with_new(keys, values) if plan.fetch else (keys, values)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        if not self.plan.fetch:  # the fast tier alone (a prefill, or nothing pooled yet)
            return super().attend(query, key, value, scaling)
        plan, evictor = self.plan, self.evictor
        started = self.clock.start()
        fetched = self.tiers.fetched[2]
        length, q = plan.write.length, query.shape[2]
        bias = evictor.bias(self.slots, length)
        if q > 1 and evictor.observes and attention.fuses_beside(query):
            # a prefill chunk: the pool read in one fused attention, only the fast tier's weights made
            own, pooled = self.own_visibility(q, length), self.tiers.fetched[1]
            out, mass, last = attention.weighted_beside(
                query, key, value, fetched, pooled, own, bias, scaling, evictor.watched
            )
            evictor.observe(self.slots, mass, last, q)  # the fast tier's rule sees what its own slots got
        else:
            if q == 1:
                visible = self.tiers.visibility(self.slots.state["valid"][:, :, :length])
            else:
                visible = self.tiers.visibility_beside(self.own_visibility(q, length))
            if bias is not None:
                bias = torch.nn.functional.pad(bias, (fetched, 0))
            if evictor.observes:
                out, mass, last = attention.weighted(query, key, value, visible, bias, scaling, False, evictor.watched)
                evictor.observe(self.slots, mass[..., fetched:], last[..., fetched:], q)
            else:
                out = attention.masked(query, key, value, visible, bias, scaling)
        if self.observer is not None:
            self.observer(query, scaling, *self.attended_positions(key.shape[2]))
        if plan.eviction.count:
            evictor.evict(self.slots, self.positions[:, -1], plan.eviction, length, self.spill)
        self.slots.settle(compact=plan.eviction.count > 1)
        self.clock.stop("attend", started)
        self.finish()
        return out

    def attended_positions(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        fast = self.plan.write.length
        state = self.slots.state
        if not self.plan.fetch:
            return state["position"][:, :, :fast], state["valid"][:, :, :fast]
        position, visible = self.tiers.fetched_positions(self.pool)
        return (
            torch.cat([position, state["position"][:, :, :fast]], -1),
            torch.cat([visible, state["valid"][:, :, :fast]], -1),
        )

    def spill(self, slots: Slots, victims: torch.Tensor) -> None:
        """Move the fast tier's ``victims`` (b, h, k) into the pool, with their positions and what
        the selection keeps of them (partial keys); the first ``excess[r]`` of row r are real."""
        write, excess = self.spilled
        keys = slots.keys.gather(2, expand_to(victims, slots.keys))
        values = slots.values.gather(2, expand_to(victims, slots.values))
        position = slots.state["position"].gather(2, victims)
        k = victims.shape[-1]
        real = torch.arange(k, device=victims.device) < torch.tensor(excess, device=victims.device)[:, None]
        where = self.pool.write(write, keys, values, position[:, 0], real)
        put(self.pool.state["position"], where, position)  # each KV head spills its own tokens
        self.tiers.store(self.pool, where, keys)

    # -- bytes, reset ------------------------------------------------------------------------
    def tier_bytes(self) -> dict[str, int]:
        """K/V held now: the fast tier's (``fast``, constant once full) and the pool's (``pool``,
        its K/V; ``partial``, what the selection keeps per pooled token, e.g. partial keys)."""
        pool = self.pool
        partial = sum(
            pool.state[name][0, 0, 0].numel() * pool.state[name].element_size() * pool.state[name].shape[1]
            for name in self.tiers.specs
            if pool.ready and self.tiers.specs[name].shape
        )
        return {
            "fast": self.slots.held_bytes(),
            "pool": pool.held_bytes(),
            "partial": sum(pool.held) * partial,
        }

    def held_bytes(self) -> int:
        return self.slots.held_bytes() + self.pool.held_bytes()

    def allocated_bytes(self) -> int:
        return self.slots.allocated_bytes() + self.pool.allocated_bytes()

    def peak_bytes(self) -> int:
        return super().peak_bytes() + self.pool.held_bytes()  # the pool never shrinks

    def reset(self) -> None:
        super().reset()
        self.pool.clear()
        self.pool.size = None
        self.spilled = None
