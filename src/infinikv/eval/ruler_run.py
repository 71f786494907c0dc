"""Running the RULER tasks under KV policies: one cell, and the leaderboard table.

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

from ..bench.plots import budget_label
from ..core import Batch, Sampling, sample
from ..policies import Policy
from .ruler import Sample, score


def run_cell(
    model,
    tokenizer,
    samples: Sequence[Sample],
    policy: Policy,
    stop_ids: Sequence[int],
    batch_size: int = 4,
    bar: tqdm | None = None,
) -> dict:
    """Greedy answers to ``samples`` (one task and length) under ``policy``, ``batch_size`` prompts
    per batch; the row has the accuracy (mean score in [0, 1]) and every sample's output."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    outputs: list[str] = []
    attended: list[float] = []
    for first in range(0, len(samples), batch_size):
        group = samples[first : first + batch_size]
        new_tokens = group[0].max_new_tokens
        batch = Batch(model, policy, max_length=group[0].length + new_tokens)
        logits = batch.prefill([s.prompt_ids for s in group], pad_id)
        tokens = sample(batch, logits, Sampling(max_new_tokens=new_tokens), stop_ids, pad_id)
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
        "outputs": [
            {"index": s.index, "depths": s.depths, "answers": s.answers, "output": o, "score": score([s], [o])}
            for s, o in zip(samples, outputs, strict=True)
        ],
    }


def leaderboard(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The leaderboard's shape: a header and one line per policy and budget, its accuracy (x100)
    averaged over tasks at each length and over both, then per task (averaged over lengths)."""
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cells = {(budget_label(r), r["task"], r["length"]): 100 * r["accuracy"] for r in rows}

    def mean(values: list[float]) -> str:
        return f"{statistics.fmean(values):.1f}" if values else "-"

    lines = []
    for name in dict.fromkeys(budget_label(r) for r in rows):
        by_length = [[cells[name, t, n] for t in tasks if (name, t, n) in cells] for n in lengths]
        per_task = [[cells[name, t, n] for n in lengths if (name, t, n) in cells] for t in tasks]
        every = [v for values in by_length for v in values]
        lines.append([name, *map(mean, by_length), mean(every), *map(mean, per_task)])
    return ["policy", *(f"{n:,}" for n in lengths), "mean", *tasks], lines


def summary(rows: list[dict]) -> str:
    """``leaderboard`` as a text table."""
    header, lines = leaderboard(rows)
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]
    return "\n".join(
        " ".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}" for i, (v, w) in enumerate(zip(line, widths, strict=True)))
        for line in [header, *lines]
    )
