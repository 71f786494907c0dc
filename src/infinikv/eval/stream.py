"""P-stream (long generation): feed a long text through the model in small chunks, past its
trained context, and report perplexity per window of tokens plus memory over time."""

from __future__ import annotations

import math
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from ..core import Batch
from ..errors import InfinikvError
from ..policies import Policy


def stream_tokens(tokenizer, text: str, tokens: int) -> torch.Tensor:
    """The first ``tokens`` tokens of ``text`` (1, tokens); errors if it is shorter."""
    ids = tokenizer(text[: tokens * 8], return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        raise InfinikvError(f"the text has {ids.shape[1]} tokens, fewer than --tokens {tokens}")
    return ids


@torch.inference_mode()
def stream(
    model, ids: torch.Tensor, policy: Policy, chunk: int = 32, window: int = 1024, progress: bool = True
) -> dict:
    """Run P-stream on ``ids`` (1, T) and return one result object with per-window rows.

    Every token but the first is predicted once, by the forward of the chunk that holds the
    token before it; each window's row has its perplexity, the process RSS at its end, the KV
    bytes the cache held then and its peak so far (a chunk being read included).
    """
    batch = Batch(model, policy)
    ids = ids.to(batch.device)
    total = ids.shape[1]
    cache = batch.cache
    process = psutil.Process()
    nll = torch.zeros(total - 1, dtype=torch.float64)
    rows, start = [], time.perf_counter()
    bar = tqdm(total=total, desc=policy.label(), unit="tok", disable=not progress, leave=False)
    for begin in range(0, total - 1, chunk):
        end = min(begin + chunk, total - 1)
        logits = batch.feed(ids[:, begin:end], keep_all=True)[0]
        nll[begin:end] = torch.nn.functional.cross_entropy(
            logits.double(), ids[0, begin + 1 : end + 1], reduction="none"
        )
        bar.update(end - begin)
        if end // window > begin // window or end == total - 1:  # a window just closed
            first = (end - 1) // window * window
            rows.append(
                {
                    "start": first,
                    "end": end,
                    "perplexity": math.exp(float(nll[first:end].mean())),
                    "rss_bytes": process.memory_info().rss,
                    "kv_bytes": cache.held_bytes(),
                    "peak_kv_bytes": cache.peak_bytes(),  # so far, the chunk being read included
                    "kv_tiers": cache.tier_bytes(),
                }
            )
    bar.close()
    perplexities = sorted(r["perplexity"] for r in rows)
    return {
        **policy.describe(),
        "tokens": total,
        "chunk": chunk,
        "window": window,
        "perplexity": math.exp(float(nll.mean())),
        "median_window_perplexity": perplexities[len(perplexities) // 2],
        "worst_window_perplexity": perplexities[-1],
        "peak_rss_bytes": max(r["rss_bytes"] for r in rows),
        "kv_bytes": cache.peak_bytes(),
        "seconds": round(time.perf_counter() - start, 2),
        "windows": rows,
    }


def plot(results: list[dict], out: Path, trained_context: int | None = None) -> Path:
    """Perplexity per window and RSS over the stream, one line per policy, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for result in results:
        label = f"{result['policy']}" + (f" (capacity {result['capacity']})" if result.get("capacity") else "")
        x = [r["end"] for r in result["windows"]]
        top.plot(x, [r["perplexity"] for r in result["windows"]], marker=".", label=label)
        bottom.plot(x, [r["rss_bytes"] / 2**20 for r in result["windows"]], marker=".", label=label)
    if trained_context:
        for axis in (top, bottom):
            axis.axvline(trained_context, color="grey", linestyle="--", linewidth=1)
        top.text(trained_context, top.get_ylim()[1], " trained context", va="top", color="grey")
    top.set_ylabel(f"perplexity per {results[0]['window']}-token window")
    top.set_yscale("log")
    bottom.set_ylabel("process RSS (MiB)")
    bottom.set_xlabel("tokens streamed")
    top.legend()
    top.grid(alpha=0.3)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
