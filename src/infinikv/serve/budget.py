"""``serve --memory``: the whole process under one budget, not only its caches' K/V.

What the process holds is the model and the runtime (``base``: resident when the server starts),
the caches' K/V (running, idle), and the rest: a forward's temporaries, copies of finished rows,
the allocator's slack. That rest is not predicted from a formula: the scheduler measures it
(``observe``: the peak resident beyond the base and the K/V held, after each prefill chunk and
decode step) and admission keeps ``base + rest + reserved K/V`` under the budget, the largest rest
seen so far standing for what the next forward may need. Before the first request a probe (one
prefill chunk through the default policy) gives the rest a first measure, so a server that starts
under load, or again after a crash, does not admit as if forwards took nothing.
"""

from __future__ import annotations

import torch

from .. import memory
from ..core import Batch
from ..policies import Policy


class ProcessBudget:
    """``total`` bytes for the process; admission asks ``room`` before it reserves K/V."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.base = memory.rss()  # the model and the runtime, before any request
        self.rest = 0  # the most measured beyond the base and the K/V held
        memory.mark_peak()

    def room(self, reserved: int, alone: bool = False) -> int:
        """K/V bytes still free once ``reserved`` are (negative: over); ``alone``: for the only
        request, without the measured rest."""
        return self.total - self.base - (0 if alone else self.rest) - reserved

    def observe(self, kv_held: int) -> None:
        """Learn from the peak since the last call, when the caches held ``kv_held`` K/V bytes
        (running and idle); start a new peak."""
        self.rest = max(self.rest, memory.peak() - self.base - kv_held)
        memory.mark_peak()

    @torch.inference_mode()
    def probe(self, model: torch.nn.Module, policy: Policy, chunk: int) -> None:
        """Measure one prefill chunk of ``chunk`` tokens under ``policy`` (a throwaway cache)."""
        batch = Batch(model, policy, False, max_length=chunk + 1)
        batch.extend(torch.zeros(1, chunk, dtype=torch.long, device=batch.device), chunk=chunk)
        self.observe(batch.cache.held_bytes())
        del batch
        memory.give_back()

    def numbers(self) -> dict[str, int]:
        """For /metrics (``metrics.BUDGET_NUMBERS``)."""
        return {"memory_bytes_budget": self.total, "memory_bytes_base": self.base, "memory_bytes_rest": self.rest}
