"""InfiniGen's selection: which slow-tier rows a decode step attends to, rehearsed with a partial query
and the partial keys it stores (the tensor work is ``kv.speculation``'s); ``infinigen`` composes it
(and ``recall``, through its pool)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..cache import Selection
from ..kv.layout import put
from ..kv.slots import Slots, StateSpec
from ..kv.speculation import partial_query, select_by_mass, select_tokens, speculative_scores


class Speculation(Selection):
    """Guesses the rows each KV head of this layer will attend to: an attention input times this
    layer's partial query weights, against the partial keys (the kept columns of every stored
    key, a per-slot state on the fast tier). The tokens are chosen by the mass rule (``mass``:
    the fewest tokens whose speculated softmax mass reaches it, per KV head, plus the ``keep``
    resident tokens; a mass of 1 takes the ``max_fetch`` share: ``--select top``) or the paper's
    threshold (``alpha``: logits within alpha of the maximum). ``ahead``: from the previous
    layer's input, as it starts; else (layer 0, which no layer precedes, ``--ahead 0`` and the
    oracle) at the layer itself, from its own input.
    ``frequencies`` (h, c): the layer's own RoPE frequencies at the kept columns, when the layer it
    speculates from has another RoPE (Gemma 3's local and global bases), else None (its RoPE serves);
    ``norm``: the QK-norm estimate (``query_norm``) or None; ``in_order``: slot i holds token i
    while nothing was evicted (False for a pool filled in any order)."""

    def __init__(
        self,
        columns: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rotary: bool,
        rule: dict[str, float],
        scaling: float,
        overlap: bool,
        pooled: bool,
        ahead: bool = True,
        frequencies: torch.Tensor | None = None,
        norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
        in_order: bool = True,
    ) -> None:
        super().__init__(overlap)
        self.in_order = in_order and not pooled
        self.columns, self.weight, self.bias, self.rotary = columns, weight, bias, rotary
        self.rule, self.scaling, self.pooled, self.ahead = rule, scaling, pooled, ahead
        self.frequencies, self.norm = frequencies, norm
        self.specs = {"partial": StateSpec(weight.dtype, (columns.shape[-1],), with_kv=False, slot_last=True)}
        if pooled:  # what the bounded pool's eviction rules read
            history = StateSpec(torch.float32, with_kv=False)  # read with the speculation, on the fast tier
            self.specs |= {"fetches": history, "last_fetch": history}
        self.steps = 0

    def store(self, slots: Slots, where: torch.Tensor | slice, key_states: torch.Tensor) -> None:
        b, _, q, _ = key_states.shape
        put(slots.state["partial"], where, key_states.gather(-1, self.columns[None, :, None, :].expand(b, -1, q, -1)))
        if self.pooled:
            put(slots.state["last_fetch"], where, float(self.steps))

    def choose(
        self, slots: Slots, x: torch.Tensor, rope: Any, positions: torch.Tensor, stored: int, held: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rule = self.rule
        pq = self.query(x, rope, positions)
        partial = slots.state["partial"][:, :, :stored]
        scores = speculative_scores(pq, partial, self.scaling)[:, :, :, -1]
        valid = slots.state["valid"][:, :, :stored]
        every_slot = all(h == stored for h in held)
        if not every_slot:  # padding or evicted slots must not be fetched
            scores = scores.masked_fill(~valid[:, :, None], -math.inf)
        ordered = every_slot and self.in_order  # slot i holds token i
        cap = [max(1, math.ceil(rule["max_fetch"] * h)) for h in held]
        if "alpha" in rule:
            rows, fetch = select_tokens(scores, rule["alpha"], torch.tensor(cap, device=scores.device))
        else:
            resident = self.resident(slots, valid, ordered)
            rows, fetch = select_by_mass(scores, rule["mass"], cap, resident, masked=not every_slot)
        if self.pooled:  # the bounded pool's eviction needs the fetch history
            self.steps += 1
            fetched = torch.ones_like(rows, dtype=torch.bool) if fetch is None else fetch
            slots.state["fetches"].scatter_add_(2, rows, fetched.float())
            slots.state["last_fetch"].scatter_reduce_(2, rows, torch.where(fetched, float(self.steps), 0.0), "amax")
        return rows, fetch

    def query(self, x: torch.Tensor, rope: Any, positions: torch.Tensor) -> torch.Tensor:
        """This layer's partial query (b, h, g, q, c) for the attention input x (b, q, D), given the
        RoPE ``(cos, sin)`` of the layer x fed (or None) and the positions (b, q)."""
        cos = sin = None
        if self.frequencies is not None:
            angles = positions[:, :, None, None].float() * self.frequencies  # (b, q, h, c)
            cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        elif self.rotary:
            cos, sin = rope[0][:, :, self.columns], rope[1][:, :, self.columns]  # (b, q, h, c)
        return partial_query(x, self.weight, self.bias, cos, sin, self.norm)

    def resident(self, slots: Slots, valid: torch.Tensor, ordered: bool) -> torch.Tensor | tuple[int, int] | None:
        """The first ``keep_first`` and the newest ``keep_recent`` tokens held, among the slots
        ``valid`` (b, h, n) covers: ``(first, recent)``, the first and last slots, when the slots
        hold every token in order (``ordered``), else (b, h, n) from their positions. Nearly
        every step attends to them, so they are always fetched."""
        first, recent = int(self.rule.get("keep_first", 0)), int(self.rule.get("keep_recent", 0))
        if not first and not recent:
            return None
        if ordered:
            return first, recent
        position = slots.state["position"][:, :, : valid.shape[-1]]
        newest = position.masked_fill(~valid, -1).amax(-1, keepdim=True)
        return valid & ((position < first) | (position > newest - recent))
