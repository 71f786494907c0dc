"""The cache of a sliding-window layer (Gemma 3's local layers, Mistral's layers).

The model itself bounds such a layer: a query sees only the newest ``window`` tokens (itself
included), so the layer needs only those, whatever the policy. Every policy therefore keeps
exactly its window there, in the fast tier at full precision (``Policy.make_cache``), and applies
its budget, eviction, fetching or quantization only to the layers the model does not bound. A
policy acting inside the window could only lose accuracy, for K/V the window already bounds (on
Gemma 3 270M, 511 tokens per local layer against the whole context per global one).
"""

from __future__ import annotations

from ..cache import Evictor, KVLayer
from ..contract import Budget
from ..kv.slots import Slots
from .rules import SinkRecent


def window_layer(window: int, static: bool) -> KVLayer:
    """A layer that keeps the ``window - 1`` newest tokens between forwards (the next query is the
    window's last token; sink's rule without sinks) and masks what lies outside a query's window
    inside a chunk. Its storage is allocated once, ``window`` slots (``static``: attention reads
    them all, for a compiled step)."""
    evictor = Evictor(SinkRecent(sinks=0), Budget(tokens=window - 1), fixed=True)
    return KVLayer(Slots(size=window, static=static), evictor, window=window)
