"""The policy a model runs with when none is given: its own (kept in ``config.json``), else
infinikv's default."""

from __future__ import annotations

import torch


def set_default_policy(model: torch.nn.Module, policy) -> None:
    """Make ``policy`` the model's own (kept in ``config.json``): its ``generate()`` uses it
    whenever no cache is passed, prefilling in the policy's chunks, and ``infinikv`` commands
    default to it."""
    from ..attention import POLICY_CONFIG_KEY, chunk_generate_prefill

    policy.make_cache(model)  # refuse, now, a policy that cannot run on this model
    setattr(model.config, POLICY_CONFIG_KEY, policy.spec())
    chunk_generate_prefill(model, policy)


def own_policy_spec(model: torch.nn.Module) -> dict | None:
    """The policy a model was built with (``{"policy": "bct", ...}``), if any."""
    from ..attention import POLICY_CONFIG_KEY

    return getattr(model.config, POLICY_CONFIG_KEY, None)


DEFAULT_POLICY = {"policy": "bct", "capacity": 2048}
SERVING_POLICY = {"policy": "full"}


def default_policy_spec(model: torch.nn.Module, serving: bool = False) -> dict:
    """The policy used when none is given: the model's own, else ``DEFAULT_POLICY``, a bounded
    cache: exactly ``full`` for a request that fits its capacity (P-ctx at 4,096 + 512 on SmolLM2:
    +1.0% of ``full``), constant memory and speed past it. A server (``serving``) defaults to
    ``full``: its admission reserves each request's worst case, which for a bounded cache is its
    whole capacity, however short the request."""
    return own_policy_spec(model) or dict(SERVING_POLICY if serving else DEFAULT_POLICY)
