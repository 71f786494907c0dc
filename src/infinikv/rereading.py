"""A prompt read twice: the scores of a rule that keeps what a second reading of it looks at.

KVzip (Kim et al., 2025) scores each token of a context by the attention the model pays it while
reconstructing the context; here the reconstruction is the prompt fed again right after itself,
over a ``full`` cache (the second copy is predicted by copying from the first). Each row is read
alone, in the full policy's chunks; the reading's cache is dropped once its scores are taken.
Its cost is a prefill of twice the prompt, paid once per prompt, before the prompt is read into
the bounded cache. The reading runs on the decode core (``Batch.expect``); here are its parts: the
observer that takes a layer's peaks and the tables the cache is given.
"""

from __future__ import annotations

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
