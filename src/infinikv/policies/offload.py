"""``offload``: FlexGen-style offloading (Sheng et al., "FlexGen: High-Throughput Generative
Inference of Large Language Models with a Single GPU", ICML 2023). The whole KV cache lives in
the slow tier and each decode step fetches all of a layer's K/V into the fast tier, overlapped
with the previous layer's compute. Exact; the transfer baseline InfiniGen is measured against."""

import torch

from ..tiers import TieredLayer
from . import register
from .base import KVLayer, Option, Policy


class OffloadLayer(TieredLayer):
    def choose_rows(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
        return None  # everything


@register
class Offload(Policy):
    """Keeps every token in the slow tier and fetches all of them every step."""

    name = "offload"
    bounded = False
    options = (Option("no_overlap", bool, False, "fetch synchronously instead of overlapping the previous layer"),)

    def make_layer(self, layer_idx: int) -> KVLayer:
        return OffloadLayer(overlap=not self.params["no_overlap"])
