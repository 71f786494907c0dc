"""Running the RULER tasks under KV policies: one cell (its leaderboard table is ``results``'s).

A cell is one (model, policy, budget, task, length): its samples (``ruler.generate``) decoded
greedily under the policy, a batch of prompts at a time (every prompt of a cell is exactly
``length`` tokens, so a batch needs no padding), and scored with the task's metric. Grids of
cells, their results file and resuming are ``infinikv.grid``'s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from tqdm import tqdm

from ..core import Batch, Sampling, sample
from ..policies import Policy
from .prompt_reads import Reads, prefill_shared
from .ruler import Sample, score
from .trace import NeedleTrace


def run_cell(
    model,
    tokenizer,
    samples: Sequence[Sample],
    policy: Policy,
    stop_ids: Sequence[int],
    batch_size: int = 4,
    bar: tqdm | None = None,
    reads: Reads | None = None,
) -> dict:
    """Greedy answers to ``samples`` (one task and length) under ``policy``, ``batch_size`` prompts
    per batch; the row has the accuracy (mean score in [0, 1]), every sample's output, and where
    the samples hide needles, the share of them each layer attended (``trace.NeedleTrace``).
    ``reads``: prompts read by an earlier cell, shared (``prompt_reads``); the row counts
    in ``prompts_taken`` the batches that took theirs there, whose reading its ``seconds`` omit."""
    reads = Reads() if reads is None else reads
    taken = 0
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    outputs: list[str] = []
    attended: list[float] = []
    trace = NeedleTrace()
    for first in range(0, len(samples), batch_size):
        group = samples[first : first + batch_size]
        new_tokens = group[0].max_new_tokens
        batch = Batch(model, policy, max_length=group[0].length + new_tokens)
        if group[0].spans:
            trace.watch(batch.cache, [s.spans for s in group], group[0].length + new_tokens, batch.device)
        logits, took = prefill_shared(batch, [s.prompt_ids for s in group], pad_id, reads)
        taken += took
        tokens = sample(batch, logits, Sampling(max_new_tokens=new_tokens), stop_ids, pad_id)
        trace.detach()
        outputs += [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
        _, fractions = batch.cache.attended()
        attended.append(sum(fractions) / len(fractions))
        if bar is not None:
            bar.update(len(group))
    return {
        **policy.describe(),
        "spec": policy.spec(),
        "task": samples[0].task,
        "length": samples[0].length,
        "accuracy": score(samples, outputs),
        "samples": len(samples),
        "attended_fraction": statistics.fmean(attended),
        "seconds": round(time.perf_counter() - start, 2),
        "prompts_taken": taken,
        **trace.result(),
        "outputs": [
            {"index": s.index, "depths": s.depths, "answers": s.answers, "output": o, "score": score([s], [o])}
            for s, o in zip(samples, outputs, strict=True)
        ],
    }
