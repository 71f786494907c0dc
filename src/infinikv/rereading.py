"""A prompt read twice: the scores of a rule that keeps what a second reading of it looks at.

KVzip (Kim et al., 2025) scores each token of a context by the attention the model pays it while
reconstructing the context; here the reconstruction is the prompt fed again right after itself,
over a ``full`` cache (the second copy is predicted by copying from the first). Each row is read
alone, in the full policy's chunks; the reading's cache is dropped once its scores are taken.
Its cost is a prefill of twice the prompt, paid once per prompt, before the prompt is read into
the bounded cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .kv.attend import peak_attention
from .policies import reference

if TYPE_CHECKING:
    from .core import Batch


def reread(batch: Batch, prompts: Sequence[Sequence[int]]) -> None:
    """Give ``batch``'s cache, for each rereading layer, the most attention the second reading of
    each row's prompt paid each of its tokens (``KVCache.give_prompt_scores``)."""
    layers = batch.cache.rereading()
    rows: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    for prompt in prompts:
        reading = type(batch)(batch.model, reference())
        peaks: dict[int, torch.Tensor] = {}
        for i in layers:
            reading.cache.layers[i].observer = observer(peaks, i, reading.cache.layers[i], len(prompt))
        reading.prefill([list(prompt) * 2], pad_id=0)  # one row alone: never padded
        for i in layers:
            rows[i].append(peaks[i])
    longest = max(len(p) for p in prompts)
    tables = {
        i: torch.cat([torch.nn.functional.pad(row, (0, longest - row.shape[-1])) for row in rows[i]]) for i in layers
    }
    lengths = torch.tensor([len(p) for p in prompts], device=batch.device).view(-1, 1, 1)
    batch.cache.give_prompt_scores(tables, lengths)


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
