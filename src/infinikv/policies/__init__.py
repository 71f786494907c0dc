"""Every KV policy and eviction rule, by name, and the one parser of policy specs.

A policy or a rule is one module of this package that registers itself; importing the package
imports them all. A *spec* is the JSON form of a policy, ``{"policy": "sink", "budget": 0.2,
"sinks": 4}``: command-line flags, a request's ``kv`` body and a model's saved config all go
through ``parse_spec``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from ..errors import InfinikvError
from .base import RULES, Budget, Option, Policy, Rule, register_rule
from .layer import KVCache, KVLayer

REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its ``name``."""
    REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(REGISTRY)


def policy_class(name: str) -> type[Policy]:
    if name not in REGISTRY:
        raise InfinikvError(f"unknown policy {name!r}; choose from {', '.join(policy_names())}")
    return REGISTRY[name]


def make_policy(name: str, budget: float | None = None, capacity: int | None = None, **params: Any) -> Policy:
    """Build a policy by name, e.g. ``make_policy("sink", budget=0.2, sinks=4)``."""
    return policy_class(name)(budget=budget, capacity=capacity, **params)


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


for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("base", "layer"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "RULES",
    "REGISTRY",
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
    "register",
    "register_rule",
]
