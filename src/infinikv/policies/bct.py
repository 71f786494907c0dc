"""``bct``: Bounded-Cache Transformer (after Yi et al., "A Method for Building Large Language
Models with Predefined KV Cache Capacity", arXiv 2411.15785). The KV capacity is fixed when the
cache is built and its storage is allocated once; every new token is admitted and an update rule
decides which slot it displaces, in place, so memory stays constant for any length. The paper
leaves the update rule open; these are published ones, measured in the README:

- ``sink-recent``: attention sinks + recent window (StreamingLLM);
- ``heavy-hitter``: accumulated attention + recent window (H2O);
- ``tova``: drop the token the current query attends to least (TOVA, Oren et al., 2024);
- ``merge``: heavy-hitter eviction, but the evicted K/V is folded into its most similar kept slot
  as a weighted mean, and attention adds log(weight) to that slot's logit (after CaM and D2O).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from ..errors import InfinikvError
from ..rope import RotaryTable, rotary_inv_freq
from . import register
from .base import Budget, KVCache, KVLayer, Option, Policy
from .h2o import HeavyHitterLayer
from .sink import SinkLayer


class TovaLayer(KVLayer):
    observes_attention = True

    def extra_meta(self) -> dict[str, torch.dtype]:
        return {"last": torch.float32}

    def observe(self, mass: torch.Tensor, last: torch.Tensor) -> None:
        self.meta["last"][:, :, : last.shape[-1]] = last

    def priority(self, length: int, capacity: torch.Tensor) -> torch.Tensor:
        return self.meta["last"][:, :, :length]


class MergeLayer(HeavyHitterLayer):
    def extra_meta(self) -> dict[str, torch.dtype]:
        return {**super().extra_meta(), "weight": torch.float32}  # tokens folded into each slot

    def initial_meta(self, name: str) -> float:
        return 1.0 if name == "weight" else 0.0

    def logit_bias(self) -> torch.Tensor | None:
        return self.meta["weight"][:, :, : self.used + self.pending].log()

    def evict(self, keep: torch.Tensor) -> None:
        """Fold each evicted slot into the kept slot whose key is most similar, then compact.

        keep (b, h, L). The kept slot's K/V become the weighted mean of what it held and what
        joins it, and its weight the sum, so the total weight always equals the tokens seen.
        """
        length, dim = keep.shape[-1], self.keys.shape[-1]
        keys, values = self.keys[:, :, :length], self.values[:, :, :length]
        weight = self.meta["weight"][:, :, :length]
        victims = self.meta["valid"][:, :, :length] & ~keep
        most = int(victims.sum(-1).max())
        if most:
            order = victims.float().topk(most, dim=-1).indices  # (b, h, n): every victim, padded
            moved = torch.where(victims.gather(-1, order), weight.gather(-1, order), 0)  # padding moves nothing
            rows = order[..., None].expand(-1, -1, -1, dim)
            unit = torch.nn.functional.normalize(keys.float(), dim=-1)
            similarity = unit.gather(2, rows) @ unit.transpose(-1, -2)  # (b, h, n, L)
            target = similarity.masked_fill(~keep[:, :, None, :], -math.inf).argmax(-1)  # (b, h, n)
            new_weight = weight.scatter_add(-1, target, moved)
            into = target[..., None].expand(-1, -1, -1, dim)
            for store in (keys, values):
                summed = (store * weight[..., None]).scatter_add_(2, into, store.gather(2, rows) * moved[..., None])
                store.copy_(torch.where(keep[..., None], summed / new_weight[..., None], store))
            weight.copy_(torch.where(keep, new_weight, weight))
        self.compact(keep)


RULES: dict[str, type[KVLayer]] = {
    "sink-recent": SinkLayer,
    "heavy-hitter": HeavyHitterLayer,
    "tova": TovaLayer,
    "merge": MergeLayer,
}
DEFAULT_RULE = "heavy-hitter"
POSITIONS = ("auto", "rank", "original")

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"64MiB"`` -> 67108864; accepts B, KB/MB/GB (powers of 10) and KiB/MiB/GiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise InfinikvError(f"--kv-memory {text!r} is not a size like 64MiB, 2GiB or 500MB")
    size = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if size <= 0:
        raise InfinikvError(f"--kv-memory must be positive, got {text!r}")
    return size


def bytes_per_token(config: Any, dtype: torch.dtype = torch.float32) -> int:
    """K and V bytes one token takes in one layer of a model with ``config``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * n_kv * head_dim * torch.empty((), dtype=dtype).element_size()


# The options each rule uses (the others are not passed to its layer nor reported).
RULE_OPTIONS = {"sink-recent": ("sinks",), "heavy-hitter": ("recent_ratio",), "tova": (), "merge": ("recent_ratio",)}


@register
class BoundedCache(Policy):
    """Fixed KV capacity, allocated once, updated in place by a pluggable rule.

    The capacity comes from ``--capacity`` (tokens per layer), from ``--kv-memory`` (total bytes,
    turned into tokens for the model's shapes and dtype), or from ``--budget`` (a fraction of the
    first chunk, i.e. the prompt).
    """

    name = "bct"
    options = (
        Option("update_rule", str, DEFAULT_RULE, f"one of {', '.join(RULES)}", lambda r: r in RULES),
        Option("kv_memory", str, "", "total K/V bytes for all layers, e.g. 64MiB (sets the capacity)"),
        Option("sinks", int, 4, "sink tokens for the sink-recent rule, >= 0", lambda n: n >= 0),
        Option("recent_ratio", float, 0.5, "recent share for heavy-hitter/merge, in [0, 1]", lambda r: 0 <= r <= 1),
        Option(
            "positions",
            str,
            "auto",
            "rank: kept keys renumbered 0..capacity-1 so positions never outgrow the trained range "
            "(RoPE models); original: each key keeps the position it was seen at; auto: original "
            "up to the trained context, rank past it (RoPE models)",
            lambda p: p in POSITIONS,
        ),
    )

    def make_budget(self, budget: float | None, capacity: int | None) -> Budget | None:
        self.kv_bytes = parse_bytes(self.params["kv_memory"]) if self.params["kv_memory"] else None
        self.resolved: Budget | None = None
        if self.kv_bytes is not None and budget is not None:
            raise InfinikvError("give --kv-memory or --budget for bct, not both")
        if self.kv_bytes is not None and capacity is None:
            return None  # settled per model by resolve()
        return super().make_budget(budget, capacity)

    def resolve(self, config: Any) -> Budget:
        """The per-layer token capacity for a model, checked against ``--kv-memory``."""
        if self.kv_bytes is None:
            return self.budget
        per_token = config.num_hidden_layers * bytes_per_token(config)
        fits = self.kv_bytes // per_token - 1  # the storage holds capacity + 1 slots
        if fits < 1:
            raise InfinikvError(f"--kv-memory {self.params['kv_memory']} holds no token: one takes {per_token} bytes")
        if self.budget is None:
            return Budget(tokens=fits)
        if self.budget.tokens > fits:
            need = (self.budget.tokens + 1) * per_token / 2**20
            raise InfinikvError(
                f"--capacity {self.budget.tokens} needs {need:.1f} MiB of K/V, more than "
                f"--kv-memory {self.params['kv_memory']} allows ({fits} tokens)"
            )
        return self.budget

    def make_layer(self, layer_idx: int, budget: Budget | None = None) -> KVLayer:
        rule = self.params["update_rule"]
        extra = {name: self.params[name] for name in RULE_OPTIONS[rule]}
        return RULES[rule](budget or self.budget, fixed=True, **extra)

    def make_cache(self, model: torch.nn.Module) -> KVCache:
        self.resolved = self.resolve(model.config)
        layers = [self.make_layer(i, self.resolved) for i in range(model.config.num_hidden_layers)]
        inv_freq = rotary_inv_freq(model) if self.params["positions"] != "original" else None
        if inv_freq is None and self.params["positions"] == "rank":
            raise InfinikvError("bct --positions rank renumbers RoPE keys, and this model has no RoPE")
        self.resolved_positions = "original" if inv_freq is None else self.params["positions"]
        rotary = None if inv_freq is None else RotaryTable(inv_freq)
        trained = getattr(model.config, "max_position_embeddings", None) or 0
        for layer in layers:
            layer.rank_angles = rotary
            layer.rank_after = trained if self.params["positions"] == "auto" else 0
        return KVCache(layers, self)

    def describe(self) -> dict[str, Any]:
        budget = self.resolved or self.budget
        rule = self.params["update_rule"]
        return {
            "policy": self.name,
            "budget": budget.fraction if budget else None,
            "capacity": budget.tokens if budget else None,
            "update_rule": rule,
            "kv_memory": self.params["kv_memory"] or None,
            "positions": getattr(self, "resolved_positions", self.params["positions"]),
            **{name: self.params[name] for name in RULE_OPTIONS[rule]},
        }
