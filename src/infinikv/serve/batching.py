"""One decode step for many sequences, each with its own ``KVCache`` (and so its own policy).

The dense parts of the model (embeddings, projections, MLP, LM head) run once over the batch,
which is where a CPU decode step spends its time reading weights. Attention cannot: every
sequence keeps different tokens under a different policy. ``RowsCache`` wraps the sequences'
caches for one step, and ``rows_attention`` (registered with transformers'
``AttentionInterface``) hands each row to infinikv's own attention with that row's cache layer.
A row therefore computes exactly what it would alone; only the batched matrix products differ,
in the order of their float sums.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..attention import infinikv_attention
from ..policies.base import KVCache, KVLayer

NAME = "infinikv_rows"


class RowsLayer(CacheLayerMixin):
    """Layer ``i`` of every sequence in the step: splits the batch into rows for them."""

    is_sliding = False
    is_compileable = False

    def __init__(self, rows: list[KVLayer]) -> None:
        super().__init__()
        self.rows = rows
        self.stored: list[tuple[torch.Tensor, torch.Tensor]] = []  # per row, what its update returned
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the rows own their storage."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Give each row its new token; attention reads the rows' K/V from ``stored``."""
        positions = (kwargs.get("kwargs") or {}).get("position_ids")
        self.stored = [
            row.update(
                key_states[i : i + 1],
                value_states[i : i + 1],
                kwargs={"position_ids": None if positions is None else positions[i : i + 1]},
            )
            for i, row in enumerate(self.rows)
        ]
        return key_states, value_states

    def speculate(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        for i, row in enumerate(self.rows):
            own = None if position_embeddings is None else tuple(t[i : i + 1] for t in position_embeddings)
            row.speculate(x[i : i + 1], own)

    def get_seq_length(self) -> int:
        return max(row.get_seq_length() for row in self.rows)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(row.used for row in self.rows) + query_length, 0

    def get_max_length(self) -> int:
        return -1


class RowsCache(KVCache):
    """The caches of the sequences in one decode step, one row each (batch size 1 apiece)."""

    def __init__(self, caches: list[KVCache]) -> None:
        layers = [RowsLayer([cache.layers[i] for cache in caches]) for i in range(len(caches[0].layers))]
        super().__init__(layers, caches[0].policy)


def rows_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kv_layer: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """infinikv's attention, row by row for a ``RowsLayer``; unchanged for anything else."""
    if not isinstance(kv_layer, RowsLayer):
        return infinikv_attention(module, query, key, value, attention_mask, scaling, dropout, kv_layer, **kwargs)
    outputs = [
        infinikv_attention(module, query[i : i + 1], k, v, None, scaling, dropout, row, **kwargs)[0]
        for i, (row, (k, v)) in enumerate(zip(kv_layer.rows, kv_layer.stored, strict=True))
    ]
    kv_layer.stored = []
    return torch.cat(outputs), None


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Route an ``attach``-ed model's attention through ``rows_attention`` (idempotent)."""
    AttentionInterface.register(NAME, rows_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return model


@torch.inference_mode()
def decode_step(model: torch.nn.Module, tokens: list[int], positions: list[int], caches: list[KVCache]) -> torch.Tensor:
    """One decode step: token ``tokens[i]`` at ``positions[i]`` for the sequence of ``caches[i]``.

    Returns the next-token logits (b, V).
    """
    device = next(model.parameters()).device
    ids = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
    pos = torch.tensor(positions, dtype=torch.long, device=device)[:, None]
    out = model(input_ids=ids, position_ids=pos, cache=RowsCache(caches), use_cache=True)
    return out.logits[:, -1]
