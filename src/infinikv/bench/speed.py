"""Decode speed: median ms per decode step at given contexts, policies interleaved step by step
in one process so that their ratios to ``full`` hold on a noisy machine."""

from __future__ import annotations

import statistics
import time

import psutil
import torch
from tqdm import tqdm

from ..policies import Policy


@torch.inference_mode()
def prefill(model, ids: torch.Tensor, policy: Policy, chunk: int = 1024):
    """A cache holding ``ids`` (1, n), filled in chunks so that long contexts fit in memory."""
    cache = policy.make_cache(model)
    for begin in range(0, ids.shape[1], chunk):
        model(input_ids=ids[:, begin : begin + chunk], cache=cache, use_cache=True, logits_to_keep=1)
    return cache


@torch.inference_mode()
def bench_speed(
    model,
    ids: torch.Tensor,
    policies: list[Policy],
    contexts: list[int],
    steps: int = 24,
    warmup: int = 3,
    progress: bool = True,
):
    """Yield one result per (context, policy): median ms per decode step, ratio to ``full``, memory."""
    process = psutil.Process()
    device = next(model.parameters()).device
    ids = ids.to(device)

    def sync() -> None:  # CUDA runs asynchronously: time finished work only
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for context in contexts:
        caches = {}
        for policy in tqdm(policies, desc=f"prefill {context}", disable=not progress, leave=False):
            caches[str(policy)] = prefill(model, ids[:, :context], policy)
        times: dict[str, list[float]] = {str(p): [] for p in policies}
        tokens = ids[:, context : context + warmup + steps]
        for step in tqdm(range(warmup + steps), desc=f"decode {context}", disable=not progress, leave=False):
            for policy in policies:  # interleaved: every policy sees the same machine state
                sync()
                begin = time.perf_counter()
                model(input_ids=tokens[:, step : step + 1], cache=caches[str(policy)], use_cache=True)
                sync()
                if step >= warmup:
                    times[str(policy)].append(time.perf_counter() - begin)
                elif step == warmup - 1:
                    caches[str(policy)].reset_clock()
        medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
        reference = next((medians[str(p)] for p in policies if p.name == "full"), None)
        rss = process.memory_info().rss
        for policy in policies:
            ms = medians[str(policy)]
            mean_ms = statistics.mean(times[str(policy)]) * 1000
            profile = {phase: round(s * 1000 / steps, 3) for phase, s in caches[str(policy)].clock().items()}
            profile["rest"] = round(mean_ms - sum(profile.values()), 3)
            yield {
                **policy.describe(),
                "context": context,
                "ms_per_step": round(ms, 3),
                "tokens_per_second": round(1000 / ms, 2),
                "ratio_to_full": round(reference / ms, 3) if reference else None,
                "kv_bytes": caches[str(policy)].held_bytes(),
                "bytes_moved_per_step": (caches[str(policy)].transfer_summary() or {}).get("bytes_moved_per_step", 0),
                "rss_bytes": rss,
                "profile_ms": profile,  # mean ms per step: speculate / fetch (not hidden) / attend / rest
            }
        del caches
