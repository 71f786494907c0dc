"""``kvzip``: query-agnostic eviction after KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache
Compression with Context Reconstruction", 2025). The prompt is scored once, by the attention the
model pays it while reading it a second time (``rules.Reread``), and cut to the budget: no
question is in sight when the score is taken, so what is kept serves any later one (a document
loaded once and asked about several times), where ``snapkv`` keeps what its first question looked
at. The memory held is the budget. The extra cost is the prompt fed again over its first reading
(in chunks of ``reread_chunk`` tokens, as KVzip does), about one more prefill of it: the cache
stores the first reading's K/V, so the prompt itself is read once.

As KVzip does, each KV head keeps as many tokens as its scores earn (``heads=own``): a layer's
K/V of all its heads share one pool of slots, one per token and head, and the lowest go. The
heads that copy a document while rereading it keep most of it, the others little: on
SmolLM2-135M (3 KV heads a layer), holding 20% of a 2,048-token document, the same count per
head (``heads=even``) answered 0 to 10% of the follow-up questions ``full`` answers 40 to 60% of,
the pool 40 to 80% (docs/evaluation.md)."""

import torch

from ..cache import Evictor, KVLayer, PooledLayer
from ..contract import Cost, Option
from ..kv.pooled import PooledSlots
from ..sizes import model_shape
from .base import Evicting
from .rules import Reread


class KVzip(Evicting):
    """The budget's best prompt tokens for a second reading of the prompt; later tokens are kept
    and the prompt's lowest-scored tokens give way to them.

    Its prompt is read in one forward unless ``--prefill-chunk`` says otherwise, as KVzip
    compresses a context read whole: read in chunks, each chunk's K/V would be computed over what
    the chunks before it kept (the reading already held the whole prompt: the peak is twice it)."""

    name = "kvzip"
    rule = Reread
    options = (
        Option(
            "heads",
            str,
            "own",
            "kvzip: each KV head keeps its own count of tokens (own, KVzip's) or a layer's heads keep as many (even)",
            lambda s: s in ("own", "even"),
        ),
    )

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        """With ``heads=own`` the layer's K/V of every KV head share one pool (``PooledSlots``),
        so the heads that score the prompt high keep more of it; a compiled step's fixed storage
        keeps an even count per head, and a model of one KV head has nothing to pool."""
        heads = model_shape(model.config)[1]
        if self.params["heads"] == "even" or static is not None or heads == 1:
            return super().layer(index, model, static)
        return PooledLayer(PooledSlots(heads), Evictor(self.make_rule(), self.budget))

    def prefill_chunk(self, model: torch.nn.Module, prompt_tokens: int | None) -> int | None:
        if self.params["prefill_chunk"] or prompt_tokens is None:
            return self.params["prefill_chunk"]
        return max(1, prompt_tokens)

    cost = Cost("kvzip", stores=lambda keep, dense: keep, reads=lambda keep, dense: keep, share=("keep", 0.2))
