"""How the next token is picked from a step's logits: greedy, or sampled with temperature and
top-p (the decode core's ``sample`` loop calls it once per step for every row at once)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import InfinikvError


@dataclass
class Sampling:
    """How the next token is picked. ``temperature == 0`` is greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InfinikvError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InfinikvError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InfinikvError(f"--top-p must be in (0, 1], got {self.top_p}")

    def generator(self, device: torch.device) -> torch.Generator | None:
        return None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row of ``logits`` (b, V) -> (b,)."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = (logits.float() / sampling.temperature).softmax(-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > sampling.top_p  # keeps the top token always
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def until_stop(tokens: list[int], stop_ids: Sequence[int]) -> list[int]:
    """``tokens`` up to, not including, the first stop id."""
    stops = set(stop_ids)
    return next((tokens[:i] for i, t in enumerate(tokens) if t in stops), tokens)
