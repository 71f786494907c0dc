"""``bct``: Bounded-Cache Transformer (after Yi et al., "A Method for Building Large Language
Models with Predefined KV Cache Capacity", arXiv 2411.15785). The KV capacity is fixed when the
cache is built and its storage is allocated once; every new token is admitted and an update rule
(any rule of ``policies.rules``: ``sink-recent``, ``heavy-hitter``, ``tova``, ``merge``)
decides which slot it displaces, in place, so memory stays constant for any length. Past the
trained context, kept RoPE keys are renumbered by rank (``--positions auto``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache import Evictor, KVLayer
from ..contract import Budget, Option
from ..errors import InfinikvError
from ..kv.rope import Renumbering, rotary_inv_freq
from ..kv.slots import Slots
from ..sizes import bytes_per_token, parse_bytes, windows
from .base import Evicting
from .rules import RULES, rule_options

DEFAULT_RULE = "heavy-hitter"
POSITIONS = ("auto", "rank", "original")


class BoundedCache(Evicting):
    """Fixed KV capacity, allocated once, updated in place by a pluggable rule.

    The capacity comes from ``--capacity`` (tokens per layer), from ``--kv-memory`` (total bytes,
    turned into tokens for the model's shapes and dtype), or from ``--budget`` (a fraction of the
    prompt: of its first chunk when the cache is fed without ``expect``).
    """

    name = "bct"
    past_trained_context = True
    options = (
        Option("update_rule", str, DEFAULT_RULE, "an eviction rule (see the README)", lambda r: r in RULES),
        Option("kv_memory", str, "", "total K/V bytes for all layers, e.g. 64MiB (sets the capacity)"),
        Option(
            "positions",
            str,
            "auto",
            "rank: kept keys renumbered by rank so distances never outgrow the capacity (RoPE models); "
            "original: each key keeps the position it was seen at; auto: original up to the trained "
            "context, rank past it",
            lambda p: p in POSITIONS,
        ),
    )

    @classmethod
    def part_options(cls) -> tuple[Option, ...]:
        return cls.options + tuple(rule_options().values())

    def kept(self, model: torch.nn.Module) -> Budget | None:
        return self.resolve(model.config)

    def make_budget(self, budget: float | None, capacity: int | None) -> Budget | None:
        self.kv_bytes = parse_bytes(self.params["kv_memory"]) if self.params["kv_memory"] else None
        self.resolved: Budget | None = None
        if self.kv_bytes is not None and budget is not None:
            raise InfinikvError("give --kv-memory or --budget for bct, not both")
        if self.kv_bytes is not None and capacity is None:
            return None  # settled per model by resolve()
        return super().make_budget(budget, capacity)

    @property
    def compilable(self) -> bool:
        return self.kv_bytes is not None or super().compilable

    @property
    def rule_class(self):
        return RULES[self.params["update_rule"]]

    def resolve(self, config: Any) -> Budget:
        """The per-layer token capacity for a model, checked against ``--kv-memory`` (of which each
        sliding-window layer takes its window first)."""
        if self.kv_bytes is None:
            return self.budget
        spans = windows(config)
        per_token = max(1, sum(w is None for w in spans)) * bytes_per_token(config)
        bounded = sum(w for w in spans if w is not None) * bytes_per_token(config)
        fits = (self.kv_bytes - bounded) // per_token - 1  # the storage holds capacity + 1 slots
        if fits < 1:
            windowed = f" beside the sliding windows' {bounded} bytes" if bounded else ""
            raise InfinikvError(
                f"--kv-memory {self.params['kv_memory']} holds no token{windowed}: one takes {per_token} bytes"
            )
        if self.budget is None:
            return Budget(tokens=fits)
        if self.budget.tokens > fits:
            need = (self.budget.tokens + 1) * per_token / 2**20
            raise InfinikvError(
                f"--capacity {self.budget.tokens} needs {need:.1f} MiB of K/V, more than "
                f"--kv-memory {self.params['kv_memory']} allows ({fits} tokens)"
            )
        return self.budget

    def make_cache(self, model: torch.nn.Module, max_length: int | None = None, static: bool = False):
        self.setup(model)
        return super().make_cache(model, max_length, static)

    def setup(self, model: torch.nn.Module) -> None:
        """What building the layers for ``model`` needs: the capacity and how keys are numbered."""
        self.resolved = self.resolve(model.config)
        managed = [i for i, w in enumerate(windows(model.config)) if w is None]
        inv_freq = rotary_inv_freq(model, managed[0]) if managed and self.params["positions"] != "original" else None
        if inv_freq is None and self.params["positions"] == "rank":
            raise InfinikvError("bct --positions rank renumbers RoPE keys, and this model has no RoPE")
        self.resolved_positions = "original" if inv_freq is None else self.params["positions"]
        trained = getattr(model.config, "max_position_embeddings", None) or 0
        self.threshold = None if inv_freq is None else trained if self.params["positions"] == "auto" else 0

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        slots = Slots(size=static, static=static is not None)
        renumbering = None if self.threshold is None else Renumbering(rotary_inv_freq(model, index), self.threshold)
        return KVLayer(slots, Evictor(self.make_rule(self.rule_class), self.resolved, True, renumbering))

    def static_size(self, model: torch.nn.Module, max_length: int | None) -> int:
        budget = self.resolve(model.config)
        if budget.tokens is None:
            raise InfinikvError("compiling bct needs --capacity or --kv-memory (a --budget fraction is settled late)")
        return budget.tokens + 1

    def longest(self, model: torch.nn.Module) -> int | None:
        """No limit where kept keys are renumbered (``--positions auto`` or ``rank`` on a RoPE model):
        the distances a query sees never outgrow the capacity."""
        self.setup(model)
        return None if self.threshold is not None else super().longest(model)

    def worst_case_tokens(self, config: Any, prompt_tokens: int, max_new_tokens: int, chunk: int | None = None) -> int:
        total = prompt_tokens + max_new_tokens
        return self.resolve(config).worst_case(prompt_tokens, total, fixed=True, chunk=chunk)

    def label(self) -> str:
        return self.named(f"{self.name}:{self.params['update_rule']}", ("update_rule",))

    def describe(self) -> dict[str, Any]:
        budget = self.resolved or self.budget
        rule = self.rule_class
        return {
            "policy": self.name,
            "label": self.label(),
            "budget": budget.fraction if budget else None,
            "capacity": budget.tokens if budget else None,
            "update_rule": self.params["update_rule"],
            "kv_memory": self.params["kv_memory"] or None,
            "positions": getattr(self, "resolved_positions", self.params["positions"]),
            **{o.name: self.params[o.name] for o in rule.options},
        }
