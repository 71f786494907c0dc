"""The cache a model runs with: a thin transformers adapter (``KVLayer``) over stages that each
do one job (storage in ``kv.slots``, ``evict.Evictor``, ``fetch.TwoTier``, ``stats.Stats``), the
cache that carries them across layers (``KVCache``), row operations (``rows``), and a layer that
composes an evicting fast tier with a two-tier pool (``recall``). It knows
the contract's rules and budgets, never a policy."""

from .cache import KVCache
from .evict import Evictor
from .fetch import Selection, TwoTier
from .layer import KVLayer
from .pooled import PooledLayer
from .recall import RecallLayer
from .rows import GroupedCache, join, keep, row_slices

__all__ = [
    "Evictor",
    "GroupedCache",
    "KVCache",
    "KVLayer",
    "PooledLayer",
    "RecallLayer",
    "Selection",
    "TwoTier",
    "join",
    "keep",
    "row_slices",
]
