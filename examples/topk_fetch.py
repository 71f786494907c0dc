"""A fetch policy composed from infinikv's parts, with no edit to the cache layer: ``topk`` keeps
every token in the slow tier and, each decode step, fetches the first and last ``resident``
tokens plus the ``k`` others that each KV head's current query scores highest (exact scores over
every key: an upper bound for what a cheaper selection could reach).

    from infinikv import Batch, load_model
    from topk_fetch import TopKFetch
    model, tokenizer = load_model()
    batch = Batch(model, TopKFetch(resident=16, k=64))
"""

import torch

from infinikv.cache import KVLayer, Selection, TwoTier
from infinikv.contract import Option
from infinikv.kv.slots import Slots
from infinikv.modules import attention_modules, project
from infinikv.policies import Policy


class TopK(Selection):
    """The rows: the pinned first and last ``resident`` tokens, then the top ``k`` by exact logit."""

    ahead = False  # chooses from its own layer's input, so it has the exact query

    def __init__(self, module: torch.nn.Module, resident: int, k: int) -> None:
        super().__init__(overlap=False)
        self.module, self.resident, self.k = module, resident, k

    def choose(self, slots, x, rope, positions, stored, held):
        keys = slots.keys[:, :, :stored]  # (b, h, n, d)
        b, h, n, d = keys.shape
        query = project(self.module, x, rope)[0].reshape(b, h, -1, d)  # (b, h, g, d)
        scores = (query @ keys.transpose(-1, -2)).amax(2)  # (b, h, n): the best of the group's heads
        position, valid = slots.state["position"][:, :, :stored], slots.state["valid"][:, :, :stored]
        newest = position.masked_fill(~valid, -1).amax(-1, keepdim=True)
        pinned = (position < self.resident) | (position > newest - self.resident)
        scores = scores.masked_fill(pinned, torch.inf).masked_fill(~valid, -torch.inf)
        rows = scores.topk(min(2 * self.resident + self.k, n), dim=-1).indices.sort(-1).values
        return rows, None  # the fast tier masks the rows that hold no token


class TopKFetch(Policy):
    """Every token in the slow tier; each step attends to the pinned and the top-``k`` tokens."""

    name = "topk"
    takes_budget = False
    options = (
        Option("resident", int, 16, "first and last tokens always fetched, >= 0", lambda n: n >= 0),
        Option("k", int, 64, "other tokens fetched per KV head, >= 1", lambda n: n >= 1),
    )

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        selection = TopK(attention_modules(model)[index], self.params["resident"], self.params["k"])
        return KVLayer(Slots(), tiers=TwoTier(selection))
