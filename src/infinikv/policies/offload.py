"""``offload``: FlexGen-style offloading (Sheng et al., "FlexGen: High-Throughput Generative
Inference of Large Language Models with a Single GPU", ICML 2023). The whole KV cache lives in
the slow tier and each decode step fetches all of a layer's K/V into the fast tier, overlapped
with the previous layer's compute. Exact; the transfer baseline InfiniGen is measured against."""

import torch

from ..kv.slots import Slots
from . import register
from .base import Option, Policy
from .layer import Fetcher, KVLayer


def slow_tier(model: torch.nn.Module) -> torch.device | None:
    """Where the slow tier lives: host memory when the model runs on a GPU, else the same RAM."""
    device = next(model.parameters()).device
    return torch.device("cpu") if device.type == "cuda" else None


@register
class Offload(Policy):
    """Keeps every token in the slow tier and fetches all of them every step."""

    name = "offload"
    takes_budget = False
    options = (Option("no_overlap", bool, False, "fetch synchronously instead of overlapping the previous layer"),)

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        return KVLayer(Slots(home=slow_tier(model)), fetcher=Fetcher(overlap=not self.params["no_overlap"]))
