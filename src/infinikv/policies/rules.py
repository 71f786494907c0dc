"""Every eviction rule, by name: what the evicting policies and ``bct --update-rule`` choose from.

A rule scores slots (``contract.Rule``); the eviction stage drops the lowest. Each rule names
the paper it follows.
"""

from __future__ import annotations

import math

import torch

from ..contract import Option, Rule, Scoring
from ..errors import InfinikvError
from ..kv.layout import expand_to
from ..kv.slots import Slots, StateSpec


class SinkRecent(Rule):
    """StreamingLLM's (Xiao et al., ICLR 2024): evicts the oldest token after the first ``sinks``."""

    name = "sink-recent"
    options = (Option("sinks", int, 4, "sink tokens kept at the start, >= 0 (StreamingLLM uses 4)", lambda n: n >= 0),)

    def scores(self, slots: Slots, at: Scoring) -> torch.Tensor:
        position = slots.state["position"][:, :, : at.length]
        return torch.where(position < self.params["sinks"], math.inf, position.float())


class HeavyHitter(Rule):
    """H2O's (Zhang et al., NeurIPS 2023): evicts the token with the least attention accumulated over
    every query of the KV head's group, outside a recent window."""

    name = "heavy-hitter"
    options = (
        Option(
            "recent_ratio", float, 0.5, "share of the budget kept for recent tokens, in [0, 1]", lambda r: 0 <= r <= 1
        ),
    )
    observes = True
    state = {"score": StateSpec(torch.float32)}

    def observe(self, slots: Slots, mass: torch.Tensor, last: torch.Tensor, queries: int) -> None:
        slots.state["score"][:, :, : mass.shape[-1]] += mass

    def scores(self, slots: Slots, at: Scoring) -> torch.Tensor:
        recent = torch.ceil(at.capacity * self.params["recent_ratio"])
        position = slots.state["position"][:, :, : at.length]
        return torch.where(position > at.newest - recent, math.inf, slots.state["score"][:, :, : at.length])


class Tova(Rule):
    """TOVA's (Oren et al., "Transformers are Multi-State RNNs", 2024): evicts the token the newest
    query attends to least."""

    name = "tova"
    observes = True
    state = {"last": StateSpec(torch.float32)}

    def observe(self, slots: Slots, mass: torch.Tensor, last: torch.Tensor, queries: int) -> None:
        slots.state["last"][:, :, : last.shape[-1]] = last

    def scores(self, slots: Slots, at: Scoring) -> torch.Tensor:
        return slots.state["last"][:, :, : at.length]


class Merge(HeavyHitter):
    """After CaM (Zhang et al. 2024) and D2O (Wan et al. 2024): heavy-hitter eviction, but each victim
    is folded into the kept slot with the most similar key as a weighted mean, and attention adds
    log(weight) to that slot's logit."""

    name = "merge"
    state = {**HeavyHitter.state, "weight": StateSpec(torch.float32, initial=1.0)}  # tokens folded into a slot

    def logit_bias(self, slots: Slots, length: int) -> torch.Tensor:
        return slots.state["weight"][:, :, :length].log()

    def evict(self, slots: Slots, victims: torch.Tensor, take: torch.Tensor | None, length: int) -> None:
        """Victims (b, h, k). A kept slot's K/V become the weighted mean of what it held and what joins
        it, and its weight the sum, so the total weight always equals the tokens seen."""
        keys, values = slots.view(length)
        weight, valid = slots.state["weight"][:, :, :length], slots.state["valid"][:, :, :length]
        joining = torch.ones_like(victims, dtype=torch.bool) if take is None else take
        keep = valid.scatter(2, victims, valid.gather(2, victims) & ~joining)
        moved = weight.gather(2, victims) * joining  # what each victim carries (nothing where not taken)
        unit = torch.nn.functional.normalize(keys.float(), dim=-1)
        similarity = unit.gather(2, expand_to(victims, unit)) @ unit.transpose(-1, -2)  # (b, h, k, L)
        target = similarity.masked_fill(~keep[:, :, None, :], -math.inf).argmax(-1)  # (b, h, k)
        new_weight = weight.scatter_add(-1, target, moved)
        for store in (keys, values):
            joined = store.gather(2, expand_to(victims, store)) * moved[..., None]
            summed = (store * weight[..., None]).scatter_add_(2, expand_to(target, store), joined)
            store.copy_(torch.where(keep[..., None], summed / new_weight[..., None], store))
        weight.copy_(torch.where(keep, new_weight, weight))
        slots.drop(victims, take)


class Question(Rule):
    """SnapKV's (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024):
    a prompt ends with what is asked of it, so its last ``observation_window`` queries score every
    prompt token. A slot scores the most of itself and the ``pooling - 1`` slots before it (SnapKV
    pools both ways, over 7): what a question looks at is a fact's key words, and the value it
    asks for follows them (a 7-digit number, a 30-token UUID), so the value is kept with its key.
    The prompt is held whole until its chunk is scored (one forward: the peak is the prompt).
    Later forwards add the attention they pay, as H2O does, and the newest ``observation_window``
    tokens are always kept."""

    name = "snapkv"
    options = (
        Option(
            "observation_window",
            int,
            32,
            "snapkv: a prompt's last queries that score it, and the newest tokens always kept, >= 1",
            lambda n: n >= 1,
        ),
        Option(
            "pooling",
            int,
            64,
            "snapkv: a slot scores the most of itself and the pooling - 1 slots before it, >= 1",
            lambda n: n >= 1,
        ),
    )
    observes = True
    state = {"score": StateSpec(torch.float32)}

    def watched(self) -> int:
        return self.params["observation_window"]

    def observe(self, slots: Slots, mass: torch.Tensor, last: torch.Tensor, queries: int) -> None:
        score = slots.state["score"][:, :, : mass.shape[-1]]
        if queries == 1:
            score += mass
            return
        width = self.params["pooling"]  # a chunk's slots are in position order until it evicts
        b, h, n = last.shape
        before = torch.nn.functional.pad(last.view(b * h, 1, n), (width - 1, 0), value=-math.inf)
        score += torch.nn.functional.max_pool1d(before, width, stride=1).view(b, h, n)

    def scores(self, slots: Slots, at: Scoring) -> torch.Tensor:
        position = slots.state["position"][:, :, : at.length]
        recent = position > at.newest - self.params["observation_window"]
        return torch.where(recent, math.inf, slots.state["score"][:, :, : at.length])


class Reread(Rule):
    """KVzip's (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction", 2025): a prompt token scores the most attention any query pays it while the
    model reads the prompt a second time, right after the first (the second copy is predicted by
    copying from the first, so what it needs is what reconstructing the context needs; read with
    no later question in sight, the score serves any question). The decode core runs that reading
    (``rereading``), ``reread_chunk`` tokens of the copy at a time, each over the first reading
    only. Tokens after the prompt (answers, a conversation's next questions) are kept while among
    the newest ``recent_tokens``, the prompt giving way to them lowest score first; older ones go
    before any prompt token, oldest first: what was read stays, as in a conversation about one
    document.

    The budget is spread over the layers as KVzip spreads it: one threshold over the scores of
    every layer and KV head keeps the budget's share of them, and each layer keeps, of its even
    share, the part its heads hold above that threshold (``layer_parts``; each layer at
    least a tenth of an even share, the others giving way), so the layers together keep the
    budget. Some layers' heads score most of a document high and some almost none of it: an even
    share per layer (``spread=layer``) kept pieces of a 7-digit value's digits and answered none of
    Qwen2.5-Coder-0.5B's follow-up questions, where the spread answers most (docs/evaluation.md).
    Within a layer, slots of every head in one pool (``kv.pooled.PooledSlots``) are scored by their
    own head's reading, so the lowest (token, head) pairs go and each head keeps its own count."""

    name = "kvzip"
    options = (
        Option(
            "recent_tokens",
            int,
            32,
            "kvzip: the newest tokens after the prompt always kept (older ones go first), >= 0",
            lambda n: n >= 0,
        ),
        Option(
            "spread",
            str,
            "model",
            "kvzip: one threshold over every layer's scores (model, KVzip's) or each layer its own top share (layer)",
            lambda s: s in ("model", "layer"),
        ),
        Option(
            "reread_chunk",
            int,
            2048,
            "kvzip: prompt tokens fed again per forward of its second reading, each over the first reading (>= 1)",
            lambda n: n >= 1,
        ),
    )
    floor = 0.1  # of an even share, kept by every layer
    rereads = True
    state = {"score": StateSpec(torch.float32, initial=-math.inf)}  # a token after the prompt: unscored

    def __init__(self, **params: object) -> None:
        super().__init__(**params)
        self.table: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.read = False  # a prompt's scores were given

    def given(self, slots: Slots, table: torch.Tensor | None, lengths: torch.Tensor | None) -> None:
        if table is None and self.table is not None and slots.ready:  # the whole prompt is in
            self.mark(slots, slots.n)
        self.table, self.lengths = table, lengths
        self.read = self.read or table is not None

    def mark(self, slots: Slots, length: int) -> None:
        """The prompt's tokens among the first ``length`` slots take their reading's score."""
        score = slots.state["score"][:, :, :length]
        position = slots.state["position"][:, :, :length].long()
        width = self.table.shape[-1]
        index = slots.heads_of(length) * width + position.clamp(max=width - 1)  # the slot's head and token
        read = self.table.flatten(1).gather(1, index.reshape(index.shape[0], -1)).view_as(index)
        score.copy_(torch.where(position < self.lengths, read, score))

    def spread(self, tables: list[torch.Tensor], lengths: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
        return layer_parts(tables, lengths, keep, self.floor) if self.params["spread"] == "model" else None

    def scores(self, slots: Slots, at: Scoring) -> torch.Tensor:
        if not self.read:
            raise InfinikvError(
                "kvzip scores a prompt by reading it twice, which infinikv's decode core does: "
                "give it a prompt through infinikv (Batch.prefill, generate, eval, serve), not a bare forward"
            )
        if self.table is not None:  # a chunk of the prompt: its tokens take their reading's score, in [0, 1]
            self.mark(slots, at.length)
        score = slots.state["score"][:, :, : at.length]
        position = slots.state["position"][:, :, : at.length].long()
        later = score == -math.inf  # after the prompt: the newest kept, older ones below any prompt token
        recent = position > at.newest - self.params["recent_tokens"]
        return torch.where(later, torch.where(recent, math.inf, -1 / (position + 1.0)), score)


def layer_parts(tables: list[torch.Tensor], lengths: torch.Tensor, keep: torch.Tensor, floor: float) -> torch.Tensor:
    """Each layer's part of an even share of the budget, ``(L, b)`` float64, averaging 1 over the
    layers: KVzip's one threshold over every layer and KV head. Of each row's scores in all
    ``tables`` (``L`` tensors ``(b, h, T)``, the row's first ``lengths`` ``(b, 1, 1)`` positions
    real), the top ``keep`` ``(b,)`` share sets a threshold; a layer's part is the tokens its heads
    hold above it over the layers' mean, counted in integers, so a row's parts never depend on its
    batch. A layer below ``floor`` is raised to it, the others giving way in proportion, so a layer
    whose heads look at few tokens still keeps some."""
    scores = torch.stack(tables)  # (L, b, h, T)
    layers, rows, heads, width = scores.shape
    real = torch.arange(width, device=scores.device) < lengths.view(1, rows, 1, 1)
    scores = scores.masked_fill(~real, -math.inf)
    ranked = scores.transpose(0, 1).reshape(rows, -1).sort(dim=-1, descending=True).values  # (b, L h T)
    top = (keep * lengths.view(rows) * layers * heads).ceil().long().clamp(min=1)
    threshold = ranked.gather(1, (top - 1).view(rows, 1)).view(1, rows, 1, 1)
    above = ((scores >= threshold) & real).sum((-1, -2)).double()  # (L, b), integers: exact, as alone
    low = above * layers < floor * above.sum(0)
    rest = (layers - floor * low.sum(0)) / above.masked_fill(low, 0).sum(0)
    return torch.where(low, floor, above * rest)


RULES: dict[str, type[Rule]] = {rule.name: rule for rule in (SinkRecent, HeavyHitter, Tova, Merge, Question, Reread)}


def rule_options() -> dict[str, Option]:
    """Every rule's options by name (rules sharing a name share its meaning)."""
    return {o.name: o for cls in RULES.values() for o in cls.options}
