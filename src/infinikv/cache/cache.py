"""The one object that carries KV state across layers: a transformers ``Cache`` of ``KVLayer``."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from .layer import KVLayer
from .stats import Clock


class KVCache(Cache):
    """The layers of one policy's cache for one batch, with what they did summed over layers."""

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

    def rereading(self) -> list[int]:
        """The layers whose rule scores a prompt by a second reading of it (``Rule.rereads``)."""
        return [i for i, layer in enumerate(self.layers) if layer.evictor and layer.evictor.rule.rereads]

    def reread_chunk(self) -> int:
        """Tokens of a prompt fed again per forward of its second reading (the rule's ``reread_chunk``)."""
        return self.layers[self.rereading()[0]].evictor.rule.params["reread_chunk"]

    def give_prompt_scores(self, tables: dict[int, torch.Tensor] | None, lengths: torch.Tensor | None) -> None:
        """Hand each rereading layer its prompt scores ``(b, h, T)`` (None: the prompt is read), and
        its part of the budget where the rule spreads it over the layers (``Rule.spread``)."""
        rereading = self.rereading()
        for i in rereading:
            layer = self.layers[i]
            layer.evictor.rule.given(layer.slots, None if tables is None else tables[i], lengths)
        if tables is None or not rereading:
            return
        first = self.layers[rereading[0]].evictor
        kept = [min(1.0, first.budget.capacity(n) / n) for n in lengths.view(-1).tolist()]
        parts = first.rule.spread([tables[i] for i in rereading], lengths, torch.tensor(kept, device=lengths.device))
        if parts is not None:
            for i, row_parts in zip(rereading, parts.tolist(), strict=True):
                self.layers[i].evictor.spread(row_parts)

    @property
    def reads_as_full(self) -> bool:
        """Every layer holds a prompt's K/V as ``full`` computes them (``KVLayer.reads_as_full``)."""
        return all(layer.reads_as_full for layer in self.layers)

    def prompt_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K/V of the tokens read so far, copied, (b, h, n, d) in the order they came
        (nothing was dropped: ``reads_as_full``): what ``take`` gives another such cache."""
        return [tuple(t.clone() for t in layer.slots.view(layer.slots.n)) for layer in self.layers]

    def take(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The planned forward's K/V, one (keys, values) per layer, computed elsewhere (``prompt_kv``)."""
        for layer, (keys, values) in zip(self.layers, kv, strict=True):
            layer.take(keys, values)

    def begin(self, q: int, positions: torch.Tensor, new_real: torch.Tensor | None, real: list[int]) -> None:
        """Plan the next forward of every layer (see ``KVLayer.begin``)."""
        for layer in self.layers:
            layer.begin(q, positions, new_real, real)
        self.stepping = True

    def end(self) -> None:
        self.stepping = False

    def signature(self) -> tuple:
        """What the host planned for the coming forward, in the values the layers' code branches
        on: a compiled step traced for one signature is not valid for another."""
        return tuple(layer.signature() for layer in self.layers)

    def before_attention(
        self,
        layer_idx: int,
        x: torch.Tensor,
        rope: Any,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> None:
        """Layer ``layer_idx``'s attention is about to run on ``x``: plan it if the core did not,
        and let the layer whose selection reads this input (the next one, or this one when it
        chooses from its own input) choose and fetch its rows."""
        layer = self.layers[layer_idx]
        if not self.stepping:
            _begin_from_mask(layer, x, attention_mask, position_ids)
        following = self.layers[layer_idx + 1] if layer_idx + 1 < len(self.layers) else None
        for reader, ahead in ((layer, False), (following, True)):
            if reader is not None and reader.tiers and reader.tiers.ahead == ahead:
                reader.speculate(x, rope, layer.positions)

    # -- what it did -------------------------------------------------------------------------
    def held_bytes(self) -> int:
        return sum(layer.held_bytes() for layer in self.layers)

    def kv_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every layer's K/V storage (slots and pools), each ``(b, h, S, d)`` with the slots that
        may hold a token (the first ``n``): what a compact or lossy copy needs to keep."""
        stores = [s for layer in self.layers for s in (layer.slots, *layer.pools)]
        return [(t, s.n) for s in stores for t in (s.keys, s.values) if t is not None]

    def tier_bytes(self) -> dict[str, int]:
        """K/V held now by tier (``KVLayer.tier_bytes``), summed over layers."""
        tiers: dict[str, int] = {}
        for layer in self.layers:
            for tier, size in layer.tier_bytes().items():
                tiers[tier] = tiers.get(tier, 0) + size
        return tiers

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)

    def peak_bytes(self) -> int:
        return sum(layer.peak_bytes() for layer in self.layers)

    def row_peak_bytes(self, row: int) -> int:
        return sum(layer.stats.peak[row] * layer.slots.bytes_per_token() for layer in self.layers)

    def attended(self, rows: list[int] | None = None) -> tuple[list[float], list[float]]:
        """Mean keys attended per decode step, and that over the tokens seen, per layer (mean over
        ``rows``, default all); a fetching layer's decode steps attend to its fetched rows and what
        it reads beside them (the current token, or a fast tier)."""
        counts, fractions = [], []
        for layer in self.layers:
            s = layer.stats
            picked = rows if rows is not None else range(len(s.steps))
            if any(s.fetch_steps):
                totals, n = s.totals(), s.fetch_steps
                keys, fraction = totals["attended"], totals["attended_fraction"]
                counts.append(sum(keys[r] / max(n[r], 1) for r in picked) / len(picked))
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
            totals, steps = s.totals(), [max(n, 1) for n in s.fetch_steps]
            per_row = [f / n for f, n in zip(totals["fetched"], steps, strict=True)]
            ratio = [f / n for f, n in zip(totals["fetched_fraction"], steps, strict=True)]
            picked = rows if rows is not None else range(len(per_row))
            tokens.append(sum(per_row[r] for r in picked) / len(picked))
            fractions.append(sum(ratio[r] for r in picked) / len(picked))
            moved += sum(per_row[r] for r in picked) * layer.slots.bytes_per_token()
        return {
            "fetched_fraction": sum(fractions) / len(fractions),
            "tokens_fetched_per_step": sum(tokens),
            "bytes_moved_per_step": moved,
        }


def _begin_from_mask(
    layer: KVLayer, x: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
) -> None:
    """``layer.begin`` for a forward of ``x`` (b, q, D) the decode core did not plan (e.g.
    ``model.generate``): which new tokens are real comes from the mask transformers built (this
    reads the device)."""
    b, q = x.shape[:2]
    new_real = None
    if attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.dim() == 4:
        # a token sees itself unless it is padding (the last row would miss the tokens a
        # sliding window hides from it)
        row = attention_mask[:, 0, -q:, -q:].diagonal(dim1=-2, dim2=-1)
        new_real = None if bool(row.all()) else row
    if position_ids is None:
        position_ids = torch.arange(layer.cumulative_length, layer.cumulative_length + q, device=x.device)[None]
    real = [q] * b if new_real is None else new_real.sum(-1).tolist()
    layer.begin(q, position_ids.expand(b, q), new_real, real)
