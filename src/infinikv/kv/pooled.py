"""Slots whose KV heads keep different counts of tokens: a pool of (token, head) slots."""

from __future__ import annotations

import torch

from .layout import put
from .slots import Slots, StateSpec, Write


class PooledSlots(Slots):
    """A row's K/V of every KV head in one pool ``(b, 1, S, d)``: a slot holds one token's K/V of
    one head (state ``head``), so an evictor that drops the lowest slots lets each head keep its
    own count of tokens, and the slots held are exactly the budget (KVzip's per-head eviction;
    ``Slots`` keep the same count per head). A token takes ``heads`` slots; ``held`` counts slots.
    The pool grows (a fixed size would need a spare slot per head for a decode step's token)."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.per_token = heads
        self.add_state("head", StateSpec(torch.long))

    def plan(self, q: int, real: list[int]) -> Write:
        return super().plan(q * self.per_token, [r * self.per_token for r in real])

    def write(
        self,
        write: Write,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        position: torch.Tensor,
        real: torch.Tensor | None,
    ) -> torch.Tensor | slice:
        """``Slots.write`` of each head's tokens in turn: head 0's q tokens, then head 1's, ...
        key/value (b, h, q, d); position (b, q); real (b, q) or None. Returns (b, 1, h q) or a slice."""
        b, h, q, _ = key_states.shape
        pooled = [t.reshape(b, 1, h * q, t.shape[-1]) for t in (key_states, value_states)]
        where = super().write(write, *pooled, position.repeat(1, h), None if real is None else real.repeat(1, h))
        heads = torch.arange(h, device=position.device).repeat_interleave(q)
        put(self.state["head"], where, heads.view(1, 1, h * q).expand(b, 1, h * q))
        return where

    def heads_of(self, length: int) -> torch.Tensor:
        return self.state["head"][:, :, :length]
