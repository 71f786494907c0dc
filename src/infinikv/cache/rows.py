"""Row operations (the server's continuous batching): joining caches, keeping some of their
rows, and running several caches (groups of rows, possibly of different policies) in one forward."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .cache import KVCache
from .layer import KVLayer


def join(cache: KVCache, other: KVCache) -> None:
    """Take ``other``'s sequences as rows after ``cache``'s (both built by the same policy)."""
    for mine, theirs in zip(cache.layers, other.layers, strict=True):
        for slots, their_slots in zip((mine.slots, *mine.pools), (theirs.slots, *theirs.pools), strict=True):
            slots.append_rows(their_slots)
        if not mine.seen:
            mine.stats = theirs.stats
        else:
            mine.stats.extend(theirs.stats)
        if mine.evictor:
            mine.evictor.append_rows(theirs.evictor, len(mine.seen), len(theirs.seen))
            if theirs.evictor.capacities is not None:  # fixed storage: room for the largest capacity
                mine.slots.size = max(mine.slots.size or 0, theirs.slots.size or 0) or None
        mine.seen = mine.seen + theirs.seen
        mine.cumulative_length = max(mine.cumulative_length, theirs.cumulative_length)
        mine.uniform = mine.uniform and theirs.uniform


def keep(cache: KVCache, rows: list[int]) -> None:
    """Keep only the sequences ``rows`` of ``cache`` (in that order)."""
    for layer in cache.layers:
        keep_layer(layer, rows)


def keep_layer(layer: KVLayer, rows: list[int]) -> None:
    """Keep only the sequences ``rows`` of one layer (new tensors: the old ones are not written)."""
    for slots in (layer.slots, *layer.pools):
        slots.keep_rows(rows)
    layer.seen = [layer.seen[r] for r in rows]
    layer.stats.select(rows)
    if layer.evictor:
        layer.evictor.keep_rows(rows)


def copy_row(cache: KVCache, row: int, shared: dict[int, Any]) -> KVCache:
    """Row ``row`` of ``cache`` as a cache of its own; ``cache`` is left as it is.

    Copied a layer at a time, each copy cut to the row before the next layer is copied, so the
    copy never holds more than one layer's other rows. ``shared`` maps ``id(obj)`` to objects
    the copy shares (the model's parameters and buffers)."""
    memo = dict(shared)
    for layer in cache.layers:
        keep_layer(copy.deepcopy(layer, memo), [row])
        for key in [k for k, v in memo.items() if isinstance(v, torch.Tensor) and k not in shared]:
            del memo[key]  # the whole layer's copies, replaced by the row's
    return copy.deepcopy(cache, memo)  # the layers come from the memo


class GroupLayer(CacheLayerMixin):
    """Layer ``i`` of several caches whose rows share one forward: each group of rows (a
    contiguous slice of the batch) goes to its own cache layer, attention included."""

    is_compileable = False

    def __init__(self, layers: list[KVLayer], slices: list[slice]) -> None:
        super().__init__()
        self.layers, self.slices = layers, slices
        self.is_sliding = layers[0].is_sliding
        self.stored: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the groups own their storage."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.stored = [
            layer.update(key_states[rows], value_states[rows])
            for layer, rows in zip(self.layers, self.slices, strict=True)
        ]
        return key_states, value_states

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        outputs = [
            layer.attend(query[rows], k, v, scaling)
            for layer, rows, (k, v) in zip(self.layers, self.slices, self.stored, strict=True)
        ]
        self.stored = []
        return torch.cat(outputs)

    def get_seq_length(self) -> int:
        return max(layer.get_seq_length() for layer in self.layers)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.get_seq_length()

    def get_max_length(self) -> int:
        return -1


class GroupedCache(Cache):
    """Several ``KVCache`` objects (each a group of rows, possibly of different policies) run in
    one forward of the model: the dense parts over every row at once, attention per group."""

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches
        self.slices = row_slices([cache.rows for cache in caches])
        layers = [GroupLayer([c.layers[i] for c in caches], self.slices) for i in range(len(caches[0].layers))]
        super().__init__(layers=layers)

    def before_attention(
        self, layer_idx: int, x: torch.Tensor, rope: Any, attention_mask: Any, position_ids: Any
    ) -> None:
        for cache, rows in zip(self.caches, self.slices, strict=True):
            own = None if rope is None else tuple(t[rows] for t in rope)
            cache.before_attention(layer_idx, x[rows], own, None, None)


def row_slices(counts: list[int]) -> list[slice]:
    """Consecutive slices of a batch holding ``counts[i]`` rows each."""
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    return [slice(a, b) for a, b in zip(starts, starts[1:], strict=False)]
