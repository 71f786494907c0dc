"""Prompts read once for every policy of a grid that reads them as ``full`` does.

``full``, ``offload`` and ``infinigen`` at any setting store a prompt's K/V exactly and drop none
(``KVCache.reads_as_full``), so the K/V one of them computed serve the next one
(``Batch.prefill_from``) instead of the model reading the prompt again: at 16k tokens on two CPU
threads the reading is most of a cell (Qwen2.5-Coder-0.5B: ~8 minutes to read, ~20 s to decode).
A policy that reads its prompt twice (``kvzip`` at any budget) shares both readings likewise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..core import Batch
from ..rereading import Readings


@dataclass(frozen=True)
class PromptRead:
    """Prompts as a cache that ``reads_as_full`` read them, in ``chunk``-token forwards: each
    layer's K/V (b, h, n, d) and each row's next-token logits (b, V)."""

    chunk: int | None
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor


@dataclass
class Reads:
    """What the cells of one set of inputs share: the prompts read as ``full`` reads them, by the
    prompts of a batch, and each prompt's readings by a cache that reads it twice."""

    full: dict[tuple[tuple[int, ...], ...], PromptRead] = field(default_factory=dict)
    twice: Readings = field(default_factory=dict)


def prefill_shared(
    batch: Batch, prompts: Sequence[Sequence[int]], pad_id: int, reads: Reads
) -> tuple[torch.Tensor, bool]:
    """``batch.prefill(prompts, pad_id)``, sharing the reading through ``reads``: the first cache
    that ``reads_as_full`` to read ``prompts`` leaves its K/V there, the next takes them; a cache
    that reads them twice shares its readings with the next such; any other cache reads its own.
    Returns the logits and whether the prompts' reading was taken from ``reads``."""
    if batch.cache.rereading():
        before = len(reads.twice)
        batch.readings = reads.twice
        return batch.prefill(prompts, pad_id), len(reads.twice) == before
    if not batch.cache.reads_as_full:
        return batch.prefill(prompts, pad_id), False
    chunk = batch.policy.prefill_chunk(batch.model, max(len(p) for p in prompts))
    key = tuple(tuple(p) for p in prompts)
    read = reads.full.get(key)
    if read is None or read.chunk != chunk:  # read in other chunks, the K/V differ in rounding
        logits = batch.prefill(prompts, pad_id, chunk)
        reads.full[key] = PromptRead(chunk, batch.cache.prompt_kv(), logits)
        return logits, False
    batch.prefill_from(prompts, pad_id, read.kv)
    return read.logits.clone(), True
