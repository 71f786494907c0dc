"""``kvzip``: query-agnostic eviction after KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache
Compression with Context Reconstruction", 2025). The prompt is scored once, by the attention the
model pays it while reading it a second time (``rules.Reread``), and cut to the budget: no
question is in sight when the score is taken, so what is kept serves any later one (a document
loaded once and asked about several times), where ``snapkv`` keeps what its first question looked
at. The memory held is the budget; the extra cost is a prefill of twice the prompt."""

import torch

from ..contract import Cost
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

    def prefill_chunk(self, model: torch.nn.Module, prompt_tokens: int | None) -> int | None:
        if self.params["prefill_chunk"] or prompt_tokens is None:
            return self.params["prefill_chunk"]
        return max(1, prompt_tokens)

    cost = Cost("kvzip", stores=lambda keep, dense: keep, reads=lambda keep, dense: keep, share=("keep", 0.2))
