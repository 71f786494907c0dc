"""Every KV policy by name, and the one parser of policy specs.

Each policy is one module of this package; the registry below lists them explicitly, so what is
registered never depends on which module happened to be imported first. Eviction rules are
listed the same way in ``rules``. A *spec* is the JSON form of a policy, ``{"policy": "sink",
"budget": 0.2, "sinks": 4}``: command-line flags, a request's ``kv`` body and a model's saved
config all go through ``parse_spec``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..cache import KVCache, KVLayer
from ..contract import REFERENCE, Budget, Option, Rule
from ..errors import InfinikvError
from .base import Policy
from .bct import BoundedCache
from .full import Full
from .h2o import HeavyHitters
from .infinigen import InfiniGen
from .kvzip import KVzip
from .offload import Offload
from .quant import Quant
from .recall import Recall
from .rules import RULES
from .sink import Sink
from .snapkv import SnapKV

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Full, Offload, Quant, Sink, HeavyHitters, SnapKV, KVzip, BoundedCache, InfiniGen, Recall)
}


def policy_names() -> list[str]:
    return sorted(REGISTRY)


def policy_class(name: str) -> type[Policy]:
    if name not in REGISTRY:
        raise InfinikvError(f"unknown policy {name!r}; choose from {', '.join(policy_names())}")
    return REGISTRY[name]


def make_policy(name: str, budget: float | None = None, capacity: int | None = None, **params: Any) -> Policy:
    """Build a policy by name, e.g. ``make_policy("sink", budget=0.2, sinks=4)``."""
    return policy_class(name)(budget=budget, capacity=capacity, **params)


def reference() -> Policy:
    """The policy every other one is measured against (``full``: every token)."""
    return make_policy(REFERENCE)


BUDGET_KEYS = {"budget": float, "capacity": int}


def parse_spec(spec: Mapping[str, Any]) -> Policy:
    """A policy from its spec (values typed, as in JSON, or strings, as on a command line)."""
    if not isinstance(spec, Mapping):
        raise InfinikvError('a policy spec is an object like {"policy": "sink", "budget": 0.2}')
    spec = {k: v for k, v in spec.items() if v is not None}
    name = spec.pop("policy", None)
    if not isinstance(name, str):
        raise InfinikvError('a policy spec needs a "policy" name, e.g. {"policy": "sink", "budget": 0.2}')
    cls = policy_class(name)
    budget = {
        key: Option(key, kind, None, key).parse(spec.pop(key)) for key, kind in BUDGET_KEYS.items() if key in spec
    }
    return cls(**budget, **spec)


def all_options() -> dict[str, Option]:
    """Every option of every policy by name (policies sharing a name share its meaning)."""
    return {o.name: o for cls in REGISTRY.values() for o in cls.all_options()}


__all__ = [
    "REFERENCE",
    "REGISTRY",
    "RULES",
    "Budget",
    "KVCache",
    "KVLayer",
    "Option",
    "Policy",
    "Rule",
    "all_options",
    "make_policy",
    "parse_spec",
    "policy_class",
    "policy_names",
    "reference",
]
