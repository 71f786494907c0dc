"""A cache layer over ``PooledSlots``: each KV head attends to its own slots of one pool."""

from __future__ import annotations

from typing import Any

import torch

from .layer import KVLayer


class PooledLayer(KVLayer):
    """A layer over ``PooledSlots``: its KV heads keep different tokens, as many as each earns.

    Attention gives each KV head's queries the pool's slots of that head (``own_visibility``);
    the native decode kernel skips the hidden slots without reading them, other paths read the
    whole pool once per KV head. A prompt's first chunk attends to its own K/V as ``full`` does,
    and the pool is cut to the budget after it."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        keys, values = super().update(key_states, value_states)
        if self.stored == 0:  # a first chunk attends to itself, its K/V as computed
            return key_states, value_states
        b, h, _, d = key_states.shape
        return keys.expand(b, h, -1, d), values.expand(b, h, -1, value_states.shape[-1])

    def own_visibility(self, q: int, length: int) -> torch.Tensor:
        """Which keys each query sees ``(b, h, q or 1, L)``: those of its own KV head that it may
        see; in a first chunk, ``(b, 1, q, q)`` over the chunk itself."""
        if self.stored == 0:
            position, real = self.positions[:, None, :], self.new_real
            valid = torch.ones_like(position, dtype=torch.bool) if real is None else real[:, None, :]
        else:
            slots = self.slots
            valid = slots.state["valid"][:, :, :length] & (slots.heads_of(length) == self.head_index())
            position = slots.state["position"][:, :, :length].expand_as(valid)
            if q == 1:
                return valid[:, :, None]
        distance = self.positions[:, None, :, None] - position[:, :, None, :]  # (b, h, q, L)
        visible = valid[:, :, None, :] & (distance >= 0)
        if self.window is not None:
            visible &= distance < self.window
        own = self.where  # a new token always sees itself (a padding query must see something)
        if self.stored == 0:
            visible |= torch.eye(q, dtype=torch.bool, device=visible.device)
        elif isinstance(own, slice):
            written = torch.arange(own.start, own.stop, device=visible.device).view(1, -1, q, 1)
            visible.scatter_(3, written.expand(visible.shape[0], -1, -1, -1), True)
        else:
            visible.scatter_(3, own.view(visible.shape[0], -1, q, 1), True)
        return visible

    def head_index(self) -> torch.Tensor:
        """(1, h, 1): each KV head's index, against the pool's ``head`` state."""
        return torch.arange(self.slots.per_token, device=self.positions.device).view(1, -1, 1)

    def attended_positions(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.slots.n  # the pool, whatever the forward read (a first chunk reads itself)
        state = self.slots.state
        counted = state["valid"][:, :, :n] & (self.slots.heads_of(n) == self.head_index())
        return state["position"][:, :, :n].expand_as(counted), counted
