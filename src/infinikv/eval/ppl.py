"""P-ctx (context compression): prefill ``context`` tokens of a text under a policy, then
decode the next ``continuation`` tokens one at a time, teacher-forced, under the same policy;
report the perplexity of those tokens and how much of the cache each step attended to."""

from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from ..core import Batch
from ..errors import InfinikvError
from ..policies import Policy
from ..sizes import model_device


def context_tokens(tokenizer, text: str, context: int, continuation: int) -> torch.Tensor:
    """The first ``context + continuation + 1`` tokens of ``text`` (1, n); errors if too short."""
    if context < 1 or continuation < 1:
        raise InfinikvError("--context and --continuation must be at least 1")
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : context + continuation + 1]
    if ids.shape[1] < context + continuation + 1:
        raise InfinikvError(
            f"the text has {ids.shape[1]} tokens, fewer than --context {context} + --continuation {continuation} + 1"
        )
    return ids


@torch.inference_mode()
def perplexity(
    model, ids: torch.Tensor, policy: Policy, context: int, progress: bool = True, compile: bool = False
) -> dict:
    """Run P-ctx on ``ids`` (1, context + continuation + 1) and return one result object."""
    device = model_device(model)
    ids = ids.to(device)
    continuation = ids.shape[1] - context - 1
    batch = Batch(model, policy, compile=compile, max_length=ids.shape[1])
    start = time.perf_counter()
    batch.extend(ids[:, :context])
    nll = torch.zeros((), dtype=torch.float64, device=device)
    steps = tqdm(range(continuation), desc=policy.label(), unit="tok", disable=not progress, leave=False)
    for i in steps:
        logits = batch.step(ids[:, context + i])
        nll += torch.nn.functional.cross_entropy(logits[0].double(), ids[0, context + i + 1])
    cache = batch.cache
    counts, fractions = cache.attended()
    return {
        **policy.describe(),
        "perplexity": math.exp(float(nll) / continuation),
        "attended_fraction": sum(fractions) / len(fractions),
        "attended_tokens": sum(counts) / len(counts),
        "attended_tokens_per_layer": [round(c, 2) for c in counts],
        "kv_bytes": cache.peak_bytes(),
        **(cache.transfer_summary() or {}),
        "context": context,
        "continuation": continuation,
        "seconds": round(time.perf_counter() - start, 3),
        **({"compile_seconds": round(batch.compile_seconds, 2)} if batch.compile_seconds else {}),
    }
