"""A prompt read twice: the scores of a rule that keeps what a second reading of it looks at.

KVzip (Kim et al., 2025) scores each token of a context by the attention the model pays it while
reconstructing the context; here the reconstruction is the prompt fed again right after itself,
over a ``full`` cache (the second copy is predicted by copying from the first). Each row is read
alone, in the full policy's chunks; the reading's cache is dropped once its scores are taken.
Its cost is a prefill of twice the prompt, paid once per prompt, before the prompt is read into
the bounded cache. The reading runs on the decode core (``Batch.expect``); here are its parts: the
observer that takes a layer's peaks, the tables the cache is given, and each layer's part of the
budget by one threshold over them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .kv.attend import peak_attention


def score_tables(
    rows: dict[int, list[torch.Tensor]], prompts: Sequence[Sequence[int]], device: torch.device
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Each rereading layer's peaks, a (1, h, len(prompt)) tensor per row, as one (b, h, longest)
    table padded with zeros, and the rows' prompt lengths (b, 1, 1): what ``KVCache.give_prompt_scores``
    takes."""
    longest = max(len(p) for p in prompts)
    pad = torch.nn.functional.pad
    tables = {i: torch.cat([pad(r, (0, longest - r.shape[-1])) for r in peaks]) for i, peaks in rows.items()}
    return tables, torch.tensor([len(p) for p in prompts], device=device).view(-1, 1, 1)


def observer(peaks: dict[int, torch.Tensor], index: int, layer, length: int):
    """Layer ``index``'s observer: keeps in ``peaks[index]`` (1, h, length) the most attention a
    query of the second reading (positions ``length`` on) paid each token of the first."""

    def observe(query: torch.Tensor, scaling: float, positions: torch.Tensor, valid: torch.Tensor) -> None:
        seen = positions.shape[-1]
        second = query[:, :, max(0, length - (seen - query.shape[2])) :]  # the newest: the second reading's
        if second.shape[2] == 0:
            return
        peak = peak_attention(second, layer.slots.keys[:, :, :seen], scaling, length)
        peaks[index] = torch.maximum(peaks[index], peak) if index in peaks else peak

    return observe


def layer_parts(tables: list[torch.Tensor], lengths: torch.Tensor, keep: torch.Tensor, floor: float) -> torch.Tensor:
    """Each layer's part of an even share of the budget, ``(L, b)`` float64, averaging 1 over the
    layers: KVzip's one threshold over every layer and KV head. Of each row's scores in all
    ``tables`` (``L`` tensors ``(b, h, T)``, the row's first ``lengths`` ``(b, 1, 1)`` positions
    real), the top ``keep`` ``(b,)`` share sets a threshold; a layer's part is the tokens its heads
    hold above it over the layers' mean, counted in integers, so a row's parts never depend on its
    batch. A layer below ``floor`` is raised to it, the others giving way in proportion, so a layer
    whose heads look at few tokens still keeps some."""
    scores = torch.stack(tables)  # (L, b, h, T)
    layers, rows, heads, width = scores.shape
    real = torch.arange(width, device=scores.device) < lengths.view(1, rows, 1, 1)
    scores = scores.masked_fill(~real, -math.inf)
    ranked = scores.transpose(0, 1).reshape(rows, -1).sort(dim=-1, descending=True).values  # (b, L h T)
    top = (keep * lengths.view(rows) * layers * heads).ceil().long().clamp(min=1)
    threshold = ranked.gather(1, (top - 1).view(rows, 1)).view(1, rows, 1, 1)
    above = ((scores >= threshold) & real).sum((-1, -2)).double()  # (L, b), integers: exact, as alone
    low = above * layers < floor * above.sum(0)
    rest = (layers - floor * low.sum(0)) / above.masked_fill(low, 0).sum(0)
    return torch.where(low, floor, above * rest)
