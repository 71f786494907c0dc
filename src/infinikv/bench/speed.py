"""Decode speed: median ms per decode step at given contexts, policies interleaved step by step
in one process so that their ratios to ``full`` hold on a noisy machine, each next to its
physical floor: the bytes a decode step must read divided by this machine's memory bandwidth."""

from __future__ import annotations

import resource
import statistics
import time

import psutil
import torch
from tqdm import tqdm

from ..policies import Policy


@torch.inference_mode()
def triad_bandwidth(device: torch.device | str = "cpu", mib: int = 64, repeats: int = 8) -> float:
    """Memory bandwidth in bytes/s by a STREAM triad ``a = b + s * c`` on ``mib``-MiB arrays.

    Runs with torch's current thread count (the one the bench decodes with); like STREAM it
    counts 3 arrays moved per pass (two read, one written) and reports the best pass.
    """
    device = torch.device(device)
    n = mib * 2**20 // 4
    a, b, c = (torch.rand(n, device=device) for _ in range(3))
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - begin)
    return 3 * n * 4 / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each shared tensor once (tied embeddings and LM head)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


@torch.inference_mode()
def host_to_device_bandwidth(device: torch.device, mib: int = 256, repeats: int = 4) -> float:
    """Bytes/s of a pinned host -> ``device`` copy (PCIe on a GPU), best of ``repeats``."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=device)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        begin = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - begin)
    return src.numel() / best


def floor_ms(weights: int, attended: float, moved: float, bandwidth: float, link: float | None) -> float:
    """The least time a decode step can take, in ms, when memory traffic is all that costs.

    ``weights`` and the ``attended`` K/V bytes are read at ``bandwidth``. The ``moved`` bytes
    copied from the slow tier cross ``link`` (PCIe, overlapped with compute, so the slower of
    the two bounds the step) or, with ``link=None`` (CPU: both tiers in the same RAM), are read
    and written once more through the same memory.
    """
    if link is None:
        return (weights + attended + 2 * moved) / bandwidth * 1000
    return max((weights + attended) / bandwidth, moved / link) * 1000


def kv_bytes_attended(cache) -> float:
    """K/V bytes one decode step's attention reads: the keys each layer attended (mean over the
    decode steps) at that layer's bytes per token (packed, for ``quant``)."""
    counts, _ = cache.attended()
    return sum(n * layer.bytes_per_slot() for n, layer in zip(counts, cache.layers, strict=True))


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
    bandwidth: float | None = None,
    chunk: int = 1024,
):
    """Yield one result per (context, policy): median ms per decode step, ratio to ``full``,
    memory, and the floor ``(weights + K/V touched per step) / bandwidth`` (bytes/s; measured
    by ``triad_bandwidth`` when not given) with the efficiency floor / measured."""
    process = psutil.Process()
    device = next(model.parameters()).device
    ids = ids.to(device)
    bandwidth = bandwidth or triad_bandwidth(device)
    link = host_to_device_bandwidth(device) if device.type == "cuda" else None
    weights = weight_bytes(model)

    def sync() -> None:  # CUDA runs asynchronously: time finished work only
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for context in contexts:
        caches = {}
        for policy in tqdm(policies, desc=f"prefill {context}", disable=not progress, leave=False):
            caches[str(policy)] = prefill(model, ids[:, :context], policy, chunk)
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
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        for policy in policies:
            cache = caches[str(policy)]
            ms = medians[str(policy)]
            mean_ms = statistics.mean(times[str(policy)]) * 1000
            profile = {phase: round(s * 1000 / steps, 3) for phase, s in cache.clock().items()}
            profile["rest"] = round(mean_ms - sum(profile.values()), 3)
            transfer = cache.transfer_summary() or {}
            attended, moved = kv_bytes_attended(cache), transfer.get("bytes_moved_per_step", 0)
            floor = floor_ms(weights, attended, moved, bandwidth, link)
            yield {
                **policy.describe(),
                "context": context,
                "ms_per_step": round(ms, 3),
                "tokens_per_second": round(1000 / ms, 2),
                "ratio_to_full": round(reference / ms, 3) if reference else None,
                "kv_bytes": cache.held_bytes(),
                "bytes_moved_per_step": moved,
                **({"fetched_fraction": transfer["fetched_fraction"]} if transfer else {}),
                "kv_bytes_attended_per_step": round(attended),
                "weights_bytes": weights,
                "bandwidth_bytes_per_second": round(bandwidth),
                **({"link_bytes_per_second": round(link)} if link else {}),
                "threads": torch.get_num_threads(),
                "floor_ms_per_step": round(floor, 3),
                "efficiency": round(floor / ms, 3),
                "rss_bytes": rss,
                "peak_rss_bytes": peak_rss,  # the process's peak so far: every cache of this context alive
                "profile_ms": profile,  # mean ms per step: speculate / fetch (not hidden) / attend / rest
            }
        del caches
