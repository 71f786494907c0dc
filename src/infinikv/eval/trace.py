"""Where the needle goes: in every layer and decode step, the share of a needle's tokens that the
step attended to (the slots a policy kept, or the rows a two-tier policy fetched).

A retrieval prompt hides the answer in a few tokens (the needle); under a budget the answer is
lost when the layers that copy it no longer attend to them. For a two-tier layer the same share
is also measured for the *oracle of the same count*: per KV head, the true top tokens of the
layer's own query over every stored token, as many as the policy attended. Both come from the
same decode, so the difference is the selection's alone, not a drift between two runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache import KVCache, KVLayer

Spans = Sequence[tuple[int, int]]  # [start, end) token positions of one prompt's needles


def needle_mask(spans: Sequence[Spans], length: int, device: torch.device) -> torch.Tensor:
    """(b, length) bool: True at the positions inside row r's spans."""
    mask = torch.zeros(len(spans), length, dtype=torch.bool, device=device)
    for row, row_spans in enumerate(spans):
        for start, end in row_spans:
            mask[row, start:end] = True
    return mask


def found_share(needle: torch.Tensor, positions: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """The share of each row's needle tokens among positions (b, h, K) where ``counted`` (b, h, K);
    needle (b, L) bool. Returns (b, h)."""
    b, h, k = positions.shape
    inside = needle.gather(1, positions.reshape(b, -1).clamp(0, needle.shape[1] - 1)).view(b, h, k)
    return (inside & counted).sum(-1) / needle.sum(-1, keepdim=True).clamp(min=1)


def oracle_positions(
    query: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    position: torch.Tensor,
    count: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, the ``count`` (b, h) stored tokens the query (b, H, 1, d) weighs most (softmax
    over valid keys (b, h, n, d), averaged over the head's group): their positions (b, h, k) and
    which count. ``position`` (b, h, n) the stored tokens' positions."""
    b, h, n, d = keys.shape
    q = query.view(b, h, -1, d)
    logits = torch.einsum("bhgd,bhnd->bhgn", q, keys) * scaling
    probs = logits.masked_fill(~valid[:, :, None], -torch.inf).softmax(-1).mean(2)
    top = probs.topk(min(int(count.max()), n), dim=-1).indices
    counted = torch.arange(top.shape[-1], device=top.device) < count[..., None]
    return position.gather(2, top), counted


def every_token(layer: KVLayer, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys (b, h, n, d), valid and position (b, h, n) of a layer's slots and pools together."""
    stores = [slots for slots in (layer.slots, *layer.pools) if slots.ready]
    keys = torch.cat([s.keys[:, :, : s.n].to(device) for s in stores], 2)
    valid = torch.cat([s.state["valid"][:, :, : s.n].to(device) for s in stores], 2)
    position = torch.cat([s.state["position"][:, :, : s.n].to(device) for s in stores], 2)
    return keys, valid, position


class NeedleTrace:
    """Observes the layers of the caches it ``watch``es while their batches decode.

    ``result()``: the share of needle tokens attended, averaged over decode steps, rows and KV
    heads, per layer and overall, and the oracle's for the two-tier layers."""

    def __init__(self) -> None:
        self.cache: KVCache | None = None
        self.needle: torch.Tensor | None = None  # (b, length) of the cache watched
        self.found: dict[int, torch.Tensor] = {}  # per layer, (h,) shares summed over rows and steps
        self.oracle: dict[int, torch.Tensor] = {}
        self.steps: dict[int, int] = {}  # rows x decode steps counted per layer
        self.fetched = False  # some layer fetched from two tiers: the oracle differs

    def watch(self, cache: KVCache, spans: Sequence[Spans], length: int, device: torch.device) -> None:
        """Observe ``cache`` from now on; ``spans[r]`` are row r's needles, ``length`` the most
        positions a row reaches (prompt and answer)."""
        self.cache = cache
        self.needle = needle_mask(spans, length, device)
        for index, layer in enumerate(cache.layers):
            layer.observer = lambda *seen, i=index: self.observe(i, *seen)

    def detach(self) -> None:
        for layer in self.cache.layers if self.cache else []:
            layer.observer = None

    def observe(
        self, index: int, query: torch.Tensor, scaling: float, positions: torch.Tensor, counted: torch.Tensor
    ) -> None:
        if query.shape[2] != 1:  # a prefill chunk: only answer steps count
            return
        layer = self.cache.layers[index]
        found = found_share(self.needle, positions, counted).sum(0)
        add(self.found, index, found)
        self.steps[index] = self.steps.get(index, 0) + positions.shape[0]
        if layer.tiers is None:  # it attends to all it holds: so would the oracle
            add(self.oracle, index, found)
        else:  # a decode step of two tiers: its slots and pools hold every token
            keys, valid, position = every_token(layer, query.device)
            top, top_counted = oracle_positions(query, keys, valid, position, counted.sum(-1), scaling)
            add(self.oracle, index, found_share(self.needle, top, top_counted).sum(0))
            self.fetched = True

    def result(self) -> dict:
        """``needle_attended`` (overall), ``..._per_layer`` and ``..._per_head`` (x100), and the
        oracle's ``oracle_needle_attended`` and per layer when some layer fetched (where none did,
        the oracle attends to what the layer holds, as the policy does)."""
        out: dict = {}
        for name, sums in (("needle_attended", self.found), ("oracle_needle_attended", self.oracle)):
            if name.startswith("oracle") and not self.fetched:
                continue
            layers = [(sums[i] / self.steps[i]).tolist() for i in sorted(sums)]
            if not layers:
                continue
            per_layer = [100 * sum(h) / len(h) for h in layers]
            out[name] = round(sum(per_layer) / len(per_layer), 2)
            out[f"{name}_per_layer"] = [round(v, 1) for v in per_layer]
            if name == "needle_attended":
                out[f"{name}_per_head"] = [[round(100 * v, 1) for v in h] for h in layers]
        return out


def add(sums: dict[int, torch.Tensor], index: int, value: torch.Tensor) -> None:
    sums[index] = sums[index] + value if index in sums else value
