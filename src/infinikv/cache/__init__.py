"""The cache a model runs with: a thin transformers adapter (``KVLayer``) over stages that each
do one job (storage in ``kv.slots``, ``evict.Evictor``, ``fetch.TwoTier``, ``stats.Stats``), the
cache that carries them across layers (``KVCache``), and row operations (``rows``). It knows
the contract's rules and budgets, never a policy."""

from .cache import KVCache
from .evict import Evictor
from .fetch import Selection, TwoTier
from .layer import KVLayer
from .rows import GroupedCache, join, keep, row_slices

__all__ = ["Evictor", "GroupedCache", "KVCache", "KVLayer", "Selection", "TwoTier", "join", "keep", "row_slices"]
