"""Slot storage for one layer's K/V: what a token's keys and values live in, knowing no policy.

K/V are kept per sequence (row) and per KV head in *slots* ``(b, h, S, d)``, each with per-slot
state ``(b, h, S, ...)``: ``valid`` (holds a real token) and ``position`` (the token's position),
plus whatever a policy adds (scores, partial keys, quantization scales). The order of slots
carries no meaning: attention masks come from ``valid`` and ``position``, so an evicted slot is
simply marked invalid and the next token is written into it (a decode step never compacts or
concatenates; only a prefill chunk that evicts many tokens compacts, in ``settle``).

What can be known without reading the device is kept on the host: ``n``, the slots that may
hold a token, and ``held``, the valid slots of each row. A write is *planned* on the host from
these counts (``plan``) and then *done* with tensor ops only (``write``), so a decode step never
waits for the device to say where a token goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .layout import expand_to, in_layout, pad_slots, put, zeros_like_slots


@dataclass(frozen=True)
class Write:
    """Where the ``q`` new tokens of a forward go: ``[start, start + q)`` of every row when
    ``contiguous``, else the first free slots of each row; attention then reads ``length`` slots
    (None: every slot of storage allocated once, so that slicing by it never names the storage's
    size, and a compiled step serves any capacity)."""

    q: int
    length: int | None
    contiguous: bool
    start: int = 0


@dataclass(frozen=True)
class StateSpec:
    """A per-slot state a policy adds: its dtype, trailing shape, the value a new token's slot gets,
    whether it lives with the K/V (``True``) or on the compute device (a fast tier), and whether
    it is stored ``slot_last``: a (b, h, c, S) tensor seen as (b, h, S, c), so that a product with
    every slot (one query against all partial keys) reads it row by row."""

    dtype: torch.dtype
    shape: tuple[int, ...] = ()
    initial: float = 0.0
    with_kv: bool = True
    slot_last: bool = False


class Slots:
    """K/V in slots, allocated lazily at the first write.

    ``size``: allocate this many slots once and never grow (a chunk that does not fit is staged in
    temporary tensors and its survivors are written back by ``settle``); ``None`` grows
    geometrically. ``static``: attention always reads all ``size`` slots, so every tensor shape is
    fixed from step to step, which is what a compiled decode step needs.
    """

    exact: ClassVar[bool] = True  # attention reads back the K/V written, bit for bit
    per_token: int = 1  # slots one token of one row takes (``PooledSlots``: one per KV head)

    def __init__(self, size: int | None = None, static: bool = False, home: torch.device | str | None = None) -> None:
        if static and size is None:
            raise ValueError("static slots need a size")
        self.size, self.static = size, static
        self.home = torch.device(home) if home is not None else None  # where K/V live, if not with the queries
        self.specs: dict[str, StateSpec] = {}
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.n = 0  # slots that may hold a token (the same bound for every row)
        self.held: list[int] = []  # valid slots of each row
        self._staged: tuple | None = None  # the fixed tensors while a large chunk is staged

    # -- set-up ------------------------------------------------------------------------------
    def add_state(self, name: str, spec: StateSpec) -> None:
        """Declare a per-slot state before the first write."""
        self.specs[name] = spec

    def clear(self) -> None:
        """Forget everything; the next write allocates afresh."""
        self.keys = self.values = self._staged = None
        self.state, self.n, self.held = {}, 0, []

    @property
    def ready(self) -> bool:
        return self.keys is not None

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, size: int) -> None:
        """Storage of ``size`` slots shaped like the first K/V (b, h, q, d)."""
        b, h, _, dk = key_states.shape
        device = self.home or key_states.device
        self.keys = key_states.new_zeros(b, h, size, dk, device=device)
        self.values = value_states.new_zeros(b, h, size, value_states.shape[-1], device=device)
        self.state = {
            "valid": torch.zeros(b, h, size, dtype=torch.bool, device=key_states.device),
            "position": torch.zeros(b, h, size, dtype=torch.long, device=key_states.device),
        }
        for name, spec in self.specs.items():
            where = device if spec.with_kv else key_states.device
            shape = (b, h, *spec.shape, size) if spec.slot_last else (b, h, size, *spec.shape)
            state = torch.full(shape, spec.initial, dtype=spec.dtype, device=where)
            self.state[name] = state.movedim(-1, 2) if spec.slot_last else state
        if self.home is not None and self.home.type == "cpu" and key_states.device.type == "cuda":
            self.keys, self.values = self.keys.pin_memory(), self.values.pin_memory()
        if not self.held:
            self.held = [0] * b

    @property
    def allocated(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, *self.state.values()]

    # -- the host side of a write ------------------------------------------------------------
    def plan(self, q: int, real: list[int]) -> Write:
        """Plan a forward's write of ``q`` tokens per row, of which ``real[r]`` are real (not
        padding), and count them as held."""
        if not self.held:
            self.held = [0] * len(real)
        most_free = max(self.n - h for h in self.held)
        least_free = min(self.n - h for h in self.held)
        reach = self.n + max(0, q - least_free)  # every row finds q free slots below this
        if most_free == 0 and not self.static:  # no row has a hole: append
            write = Write(q, self.n + q, contiguous=True, start=self.n)
        else:  # fill each row's holes first, then fresh slots
            every = self.static and reach <= self.size
            write = Write(q, None if every else max(reach, self.size) if self.static else reach, contiguous=False)
        self.n = reach
        self.held = [h + r for h, r in zip(self.held, real, strict=True)]
        return write

    def _make_room(self, length: int) -> None:
        """Grow geometrically, or, for fixed storage, stage the chunk (``settle`` writes it back)."""
        if self.size is not None:  # fixed: stage the chunk, settle() writes the survivors back
            self._staged = (self.keys, self.values, self.state)
            self._resize(length)
        else:
            self._resize(max(length, 2 * self.allocated, 16))

    def _resize(self, size: int) -> None:
        keep = min(size, self.allocated)

        def resized(t: torch.Tensor) -> torch.Tensor:
            out = zeros_like_slots(t, size)
            if t.is_pinned():  # a slow tier stays pinned, so copies to the GPU stay asynchronous
                out = out.pin_memory()
            out[:, :, :keep] = t[:, :, :keep]
            return out

        self.keys, self.values = resized(self.keys), resized(self.values)
        self.state = {name: resized(t) for name, t in self.state.items()}

    def tokens(self) -> list[int]:
        """The tokens each row holds (``held`` counts slots)."""
        return [h // self.per_token for h in self.held]

    def heads_of(self, length: int) -> torch.Tensor:
        """The KV head each of the first ``length`` slots holds a token's K/V of, (b, h, length) long."""
        b, h = self.state["valid"].shape[:2]
        return torch.arange(h, device=self.state["valid"].device).view(1, h, 1).expand(b, h, length)

    def forget(self, excess: list[int]) -> None:
        """Count ``excess[r]`` tokens of each row as gone (the device drops them in ``drop``)."""
        self.held = [h - e for h, e in zip(self.held, excess, strict=True)]

    # -- the device side ---------------------------------------------------------------------
    def write(
        self,
        write: Write,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        position: torch.Tensor,
        real: torch.Tensor | None,
    ) -> torch.Tensor | slice:
        """Store the new tokens as planned; return where they went: a slice, or ``(b, h, q)`` slots.

        key/value (b, h, q, d); position (b, q) long; real (b, q) bool or None (all real).
        """
        if not self.ready:
            self.allocate(key_states, value_states, self.size or max(write.length, 16))
        if write.length is not None and write.length > self.allocated:
            self._make_room(write.length)
        b, h, q, _ = key_states.shape
        valid = True if real is None else real[:, None, :].expand(b, h, q)
        position = position[:, None, :].expand(b, h, q)
        where = slice(write.start, write.start + q) if write.contiguous else self.free_slots(write)
        put(self.keys, where, key_states)
        put(self.values, where, value_states)
        put(self.state["valid"], where, valid)
        put(self.state["position"], where, position)
        for name, spec in self.specs.items():
            put(self.state[name], where, spec.initial)
        return where

    def free_slots(self, write: Write) -> torch.Tensor:
        """The first ``q`` free slots of each row among the first ``length`` ``(b, h, q)``: one
        argmin for a single token, a top-k for a chunk, never a sort."""
        valid = self.state["valid"][:, :, : write.length]
        if write.q == 1:
            return valid.to(torch.int32).argmin(-1, keepdim=True)  # (inductor mis-reduces uint8)
        length = valid.shape[-1]
        order = valid.long() * length + torch.arange(length, device=valid.device)
        return order.topk(write.q, dim=-1, largest=False).indices

    def view(self, length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` slots' K/V for attention."""
        return self.keys[:, :, :length], self.values[:, :, :length]

    def drop(self, victims: torch.Tensor, take: torch.Tensor | None = None) -> None:
        """Mark ``victims`` (b, h, k) invalid (where ``take`` (b, h, k) is true, when given)."""
        valid = self.state["valid"]
        if take is None:
            valid.scatter_(2, victims, False)
        else:
            valid.scatter_(2, victims, valid.gather(2, victims) & ~take)

    def settle(self, compact: bool = False) -> None:
        """After an eviction: a staged chunk's valid slots go back into the fixed storage; with
        ``compact`` (after a chunk evicted many), the valid slots of growing storage move to the
        front, so attention stops reading the holes."""
        if self._staged is None and not (compact and self.n > max(self.held)):
            return
        order = (~self.state["valid"][:, :, : self.n]).to(torch.uint8).argsort(dim=-1, stable=True)
        if self._staged is None:
            keys, values, state = self.keys, self.values, self.state
            order = order[..., : max(self.held)]
        else:
            keys, values, state = self._staged
            order = order[..., : keys.shape[2]]
        length = order.shape[-1]
        for dst, src in ((keys, self.keys), (values, self.values), *((state[k], self.state[k]) for k in state)):
            dst[:, :, :length] = src[:, :, : self.n].gather(2, expand_to(order, src).to(src.device))
        if self._staged is None:  # compacted in place: what lay past the kept slots is free now
            state["valid"][:, :, length : self.n] = False
        self.keys, self.values, self.state, self._staged = keys, values, state, None
        self.n = max(self.held)

    # -- rows (the server's continuous batching) ----------------------------------------------
    def append_rows(self, other: Slots) -> None:
        """Add ``other``'s rows after this storage's rows (padding slot counts to the larger)."""
        if not self.ready:
            self.keys, self.values, self.state = other.keys, other.values, dict(other.state)
            self.n, self.held = other.n, list(other.held)
            return
        size = max(self.allocated, other.allocated)
        if self.size is not None:
            size = max(size, self.size)
        mine = [pad_slots(t, size) for t in self.tensors()]
        theirs = [pad_slots(t, size) for t in other.tensors()]
        joined = [in_layout(torch.cat([a, b]), a) for a, b in zip(mine, theirs, strict=True)]
        self.keys, self.values = joined[0], joined[1]
        self.state = dict(zip(self.state, joined[2:], strict=True))
        self.n, self.held = max(self.n, other.n), self.held + other.held
        if self.static:  # every step of the joined batch reads the same slots
            self.size = size

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.state["valid"].device)
        self.keys = self.keys.index_select(0, index.to(self.keys.device))
        self.values = self.values.index_select(0, index.to(self.values.device))
        self.state = {k: in_layout(t.index_select(0, index.to(t.device)), t) for k, t in self.state.items()}
        self.held = [self.held[r] for r in rows]

    # -- bytes -------------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """K/V bytes of one token of one row (all KV heads), plus per-token state stored with them."""
        if not self.ready:
            return 0
        h = self.keys.shape[1] * self.per_token
        kv = h * (self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size())
        extra = sum(
            h * self.state[name][0, 0, 0].numel() * self.state[name].element_size()
            for name, spec in self.specs.items()
            if spec.with_kv and spec.shape
        )
        return kv + extra

    def held_bytes(self) -> int:
        return sum(self.held) * self.bytes_per_token() // self.per_token

    def allocated_bytes(self) -> int:
        return 0 if not self.ready else self.keys.shape[0] * self.allocated * self.bytes_per_token() // self.per_token
