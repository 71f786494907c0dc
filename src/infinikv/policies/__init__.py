"""Every KV policy, by name. A policy is one module of this package; it registers itself."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from ..errors import InfinikvError
from .base import Budget, KVCache, KVLayer, Option, Policy

REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its ``name``."""
    REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(REGISTRY)


def make_policy(name: str, budget: float | None = None, capacity: int | None = None, **params: Any) -> Policy:
    """Build a policy by name, e.g. ``make_policy("sink", budget=0.2, sinks=4)``."""
    if name not in REGISTRY:
        raise InfinikvError(f"unknown policy {name!r}; choose from {', '.join(policy_names())}")
    return REGISTRY[name](budget=budget, capacity=capacity, **params)


def policy_from_spec(spec: dict[str, Any]) -> Policy:
    """A policy from its JSON form, as saved in a model's config: ``{"policy": "bct", ...}``."""
    spec = dict(spec)
    return make_policy(spec.pop("policy"), **spec)


for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "Budget",
    "KVCache",
    "KVLayer",
    "Option",
    "Policy",
    "REGISTRY",
    "make_policy",
    "policy_from_spec",
    "policy_names",
    "register",
]
