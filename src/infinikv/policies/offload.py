"""``offload``: FlexGen-style offloading (Sheng et al., "FlexGen: High-Throughput Generative
Inference of Large Language Models with a Single GPU", ICML 2023). The whole KV cache lives in
the slow tier and each decode step fetches all of a layer's K/V into the fast tier, overlapped
with the previous layer's compute. Exact; the transfer baseline InfiniGen is measured against."""

import torch

from ..cache import KVLayer, Selection, TwoTier
from ..contract import Cost, Option
from ..kv.slots import Slots
from ..kv.tiers import slow_tier
from .base import Policy


class Offload(Policy):
    """Keeps every token in the slow tier and fetches all of them every step."""

    name = "offload"
    takes_budget = False
    options = (Option("no_overlap", bool, False, "fetch synchronously instead of overlapping the previous layer"),)
    cost = Cost("offload", stores=lambda share, dense: 1.0, reads=lambda share, dense: 1.0)

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        return KVLayer(Slots(home=slow_tier(model)), tiers=TwoTier(Selection(overlap=not self.params["no_overlap"])))
