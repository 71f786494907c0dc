"""The policies a server runs: one object per distinct spec, prepared before the port opens.

A policy that needs a preparation (InfiniGen's calibration: tens of seconds) is prepared when the
server starts, never on the scheduler thread, where it would stall every stream; a request that
names one the server did not prepare is refused with the flag that would have prepared it. Each
policy is built once per spec, so a request does not re-read a calibration file, and the catalog
knows how long a request each may run (``Policy.longest``), so the server asks the policy
instead of refusing everything past the model's trained context.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from ..errors import InfinikvError
from ..policies import REGISTRY, Policy, parse_spec
from ..preparation import ensure_prepared
from .sequence import ServeError


def spec_key(policy: Policy) -> str:
    return json.dumps(policy.spec(), sort_keys=True)


class PolicyCatalog:
    """The server's policies by spec, each with the most tokens a request may run to under it."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.policies: dict[str, tuple[Policy, int | None]] = {}

    def prepare(self, spec: dict[str, Any], say: Callable[[str], None] = lambda _: None) -> Policy:
        """Build the policy of ``spec`` and run or load its preparation (at start: a bad spec raises
        ``InfinikvError``)."""
        policy = parse_spec(spec)
        key = spec_key(policy)
        if key not in self.policies:
            if policy.needs_preparation:
                say(f"preparing {policy!r} (once, before the port opens)")
                done = ensure_prepared(policy, self.model, self.tokenizer)
                say(done or f"{policy!r} is ready")
            self.policies[key] = (policy, policy.longest(self.model))
        return self.policies[key][0]

    def get(self, spec: dict[str, Any]) -> tuple[Policy, int | None]:
        """The policy of a request's ``kv`` and its longest request, built once per spec; 400 for a
        bad spec or one that needs a preparation the server did not run."""
        try:
            policy = parse_spec(spec)
        except (InfinikvError, TypeError) as exc:
            raise ServeError(400, f"kv: {exc}", param="kv") from None
        key = spec_key(policy)
        if key not in self.policies:
            if policy.needs_preparation:
                flag = ",".join(f"{k}={v}" for k, v in policy.spec().items() if k != "policy")
                raise ServeError(
                    400,
                    f"kv: {policy!r} needs a preparation the server did not run (it would stall every stream); "
                    f"start the server with --prepare '{policy.name}{f'[{flag}]' if flag else ''}'",
                    param="kv",
                    code="policy_not_prepared",
                )
            try:
                self.policies[key] = (policy, policy.longest(self.model))
            except InfinikvError as exc:
                raise ServeError(400, f"kv: {exc}", param="kv") from None
        return self.policies[key]

    def listing(self, default: Policy) -> list[dict[str, Any]]:
        """What a client may pick (the chat page, ``GET /v1/policies``): every registered policy with
        the spec to send (the default's, or the one prepared at start), whether it takes a budget,
        whether the server can run it now, and the first sentence of its docstring."""
        chosen = {p.name: p.spec() for p, _ in self.policies.values() if p.needs_preparation}
        chosen[default.name] = default.spec()
        return [
            {
                "name": name,
                "spec": chosen.get(name, {"policy": name}),
                "takes_budget": cls.takes_budget,
                "ready": name in chosen or not cls.needs_preparation,
                "summary": first_sentence(cls.__doc__ or ""),
            }
            for name, cls in sorted(REGISTRY.items())
        ]

    def past_context(self) -> list[str]:
        """The policies that may run past the model's trained context with some option."""
        return [name for name, cls in sorted(REGISTRY.items()) if cls.past_trained_context]


def first_sentence(doc: str) -> str:
    """A docstring's first sentence on one line: a policy's summary for a client."""
    return " ".join(doc.strip().split("\n\n")[0].split()).split(". ")[0].rstrip(".") + "."
