"""A prompt read twice: the scores of a rule that keeps what a second reading of it looks at.

KVzip (Kim et al., 2025) scores each token of a context by the attention the model pays it while
reconstructing the context; here the reconstruction is the prompt fed again right after itself,
over a ``full`` cache of it (the second copy is predicted by copying from the first). As KVzip
does, the copy comes in chunks, each over the first reading alone (its positions right after the
prompt, never past the prompt and one chunk), so the second reading costs a prefill of the prompt
over its K/V, not one of twice the prompt. Each row is read alone, in the full policy's chunks; the
first reading's K/V are what the bounded cache stores (``Batch.prefill``), so the prompt is read
once, then copied once (a model with sliding windows reads it twice over, as one prompt, and then
once more into the cache). The reading runs on the decode core (``Batch.expect``); here are its parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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


KV = list[tuple[torch.Tensor, torch.Tensor]]  # each layer's keys and values
FirstReading = tuple[KV, torch.Tensor]  # a row's prompt read over a full cache: K/V (1, h, n, d), logits (1, V)
# A prompt's readings by (chunk, layers, prompt), for batches of one model to share: its peaks, its first reading
Readings = dict[tuple[int, tuple[int, ...], tuple[int, ...]], tuple[dict[int, torch.Tensor], "FirstReading | None"]]


def second_readings(
    fresh: Callable[[], Any],
    prompts: Sequence[Sequence[int]],
    layers: list[int],
    chunk: int,
    device: torch.device,
    shared: Readings | None = None,
) -> tuple[dict[int, torch.Tensor], torch.Tensor, list[FirstReading]]:
    """Each row's ``second_reading``, or the one ``shared`` holds (a new one is left there): the
    tables and lengths ``KVCache.give_prompt_scores`` takes (``score_tables``), and each row's
    first reading (none where a model's windows drop tokens)."""
    shared = {} if shared is None else shared
    rows: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    firsts = []
    for prompt in prompts:
        key = (chunk, tuple(layers), tuple(prompt))
        if key not in shared:
            shared[key] = second_reading(fresh, list(prompt), layers, chunk)
        peaks, first = shared[key]
        for i in layers:
            rows[i].append(peaks[i])
        firsts.append(first)
    return *score_tables(rows, prompts, device), firsts if None not in firsts else []


def second_reading(
    fresh: Callable[[], Any], prompt: list[int], layers: list[int], chunk: int
) -> tuple[dict[int, torch.Tensor], FirstReading | None]:
    """``prompt`` read over a cache of ``fresh()`` (a ``Batch`` of ``full``), then fed again after
    itself ``chunk`` tokens at a time, each chunk over a copy of that first reading only. Returns
    each of ``layers``' peaks (1, h, n) over the chunks, and the first reading. A cache whose
    sliding windows drop tokens as it reads cannot be copied: there the copy comes whole, in one
    reading of the prompt twice over, and there is no first reading to give."""
    first, peaks = fresh(), {}
    if not first.cache.reads_as_full:
        watch(first, peaks, layers, len(prompt))
        first.prefill([prompt * 2], pad_id=0)  # one row alone: never padded
        return peaks, None
    logits = first.prefill([prompt], pad_id=0)
    kv = first.cache.prompt_kv()
    for start in range(0, len(prompt), chunk):
        reading = fresh()
        reading.prefill_from([prompt], 0, kv)
        watch(reading, peaks, layers, len(prompt))
        reading.extend(torch.tensor([prompt[start : start + chunk]]))
    return peaks, (kv, logits)


def watch(reading: Any, peaks: dict[int, torch.Tensor], layers: list[int], length: int) -> None:
    """Each of ``layers`` of ``reading`` (a ``Batch``) keeps its peaks over the first ``length`` tokens."""
    for i in layers:
        reading.cache.layers[i].observer = observer(peaks, i, reading.cache.layers[i], length)


def left_padded(firsts: list[FirstReading], n: int) -> tuple[KV, torch.Tensor]:
    """The rows' first readings as one batch's, left-padded to ``n`` tokens: each layer's K/V
    (b, h, n, d), padding zero, and the logits (b, V)."""
    pad = torch.nn.functional.pad
    kv = [
        tuple(
            torch.cat([pad(row_kv[layer][j], (0, 0, n - row_kv[layer][j].shape[2], 0)) for row_kv, _ in firsts])
            for j in (0, 1)
        )
        for layer in range(len(firsts[0][0]))
    ]
    return kv, torch.cat([logits for _, logits in firsts])
