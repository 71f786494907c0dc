"""``kvzip``: query-agnostic eviction after KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache
Compression with Context Reconstruction", 2025). The prompt is scored once, by the attention the
model pays it while reading it a second time (``rules.Reread``), and cut to the budget: no
question is in sight when the score is taken, so what is kept serves any later one (a document
loaded once and asked about several times), where ``snapkv`` keeps what its first question looked
at. The memory held is the budget; the extra cost is a prefill of twice the prompt."""

from ..contract import Cost
from .base import Evicting
from .rules import Reread


class KVzip(Evicting):
    """The budget's best prompt tokens for a second reading of the prompt; later tokens are kept
    and the prompt's lowest-scored tokens give way to them. The prompt is read in the usual
    chunks (its scores are known before it is read)."""

    name = "kvzip"
    rule = Reread
    cost = Cost("kvzip", stores=lambda keep, dense: keep, reads=lambda keep, dense: keep, share=("keep", 0.2))
