"""Decode speed: median ms per decode step at given contexts, policies interleaved step by step
in one process so that their ratios to ``full`` hold on a noisy machine, each next to its
physical floor: the bytes a decode step must read divided by this machine's memory bandwidth."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping

import torch
from tqdm import tqdm

from .. import memory
from ..compiled import resolve
from ..contract import REFERENCE
from ..core import Batch
from ..errors import InfinikvError
from ..policies import Policy
from ..results import PEER
from ..sizes import model_device
from ..weights import stored_bytes, weights_format
from .baseline import DynamicBaseline


class Triad:
    """Memory bandwidth in bytes/s by a STREAM triad ``a = b + s * c`` on ``mib``-MiB arrays.

    Runs with torch's current thread count (the one the bench decodes with); like STREAM it
    counts 3 arrays moved per pass (two read, one written). ``measure`` times one pass; the bench
    runs one between its rounds of decode steps, because the bandwidth a shared machine gives
    changes from minute to minute (seen here: 16 to 28 GB/s), and a floor must be taken in the
    same conditions as the steps it is compared with.
    """

    def __init__(self, device: torch.device | str = "cpu", mib: int = 64) -> None:
        self.device = torch.device(device)
        n = mib * 2**20 // 4
        self.arrays = [torch.rand(n, device=self.device) for _ in range(3)]
        self.passes: list[float] = []

    @torch.inference_mode()
    def measure(self) -> float:
        a, b, c = self.arrays
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        begin = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.passes.append(3 * a.numel() * 4 / (time.perf_counter() - begin))
        return self.passes[-1]

    def median(self) -> float:
        return statistics.median(self.passes)


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
    return sum(n * layer.slots.bytes_per_token() for n, layer in zip(counts, cache.layers, strict=True))


DYNAMIC = "hf-dynamic"  # transformers' own DynamicCache and SDPA attention, the row to beat


def peer_rows(lines: list[str], source: str) -> list[dict]:
    """A peer's rows from the JSON lines its speed script printed (``../shared/peers/llamacpp/
    speed.py``: ``peer``, ``context``, ``ms_per_step``, ``prefill_s``), shaped as ours."""
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            given = json.loads(line)
            row = {
                "policy": PEER,
                "label": f"{given['peer']} (peer)",
                "budget": None,
                "capacity": None,
                "context": int(given["context"]),
                "ms_per_step": float(given["ms_per_step"]),
            }
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise InfinikvError(
                f"{source}:{number}: not a peer row (a JSON object with peer, context, ms_per_step)"
            ) from None
        row["tokens_per_second"] = round(1000 / row["ms_per_step"], 2)
        if "prefill_s" in given:
            row["prefill_seconds"] = float(given["prefill_s"])
            row["prompt_tokens_per_second"] = round(row["context"] / row["prefill_seconds"], 1)
        rows.append({**row, "source": {k: v for k, v in given.items() if k not in row}})
    return rows


def compare_with_peer(rows: list[dict], peers: list[dict]) -> None:
    """Set each of our rows' ``ratio_to_peer``: the peer's ms per step at the same context over
    ours (above 1: ours is faster), and ``ratio_to_peer_at_<first context>``."""
    at = {r["context"]: r["ms_per_step"] for r in peers}
    first = min(at) if at else None
    for row in rows:
        if row.get("policy") == PEER:
            continue
        if row["context"] in at:
            row["ratio_to_peer"] = round(at[row["context"]] / row["ms_per_step"], 3)
        if first is not None:
            row[f"ratio_to_peer_at_{first}"] = round(at[first] / row["ms_per_step"], 3)


COMPILE_MODES = ("auto", "on", "off", "both")


def compile_runs(mode: str, model: torch.nn.Module, policy: Policy, length: int) -> list[bool]:
    """Which runs of ``policy`` to time: eager (False), compiled (True), or both (``COMPILE_MODES``)."""
    if mode == "both":
        return [False, True] if policy.compilable else [False]
    if mode == "on":
        return [policy.compilable]
    return [resolve(mode, model, policy, 1, length)]


@torch.inference_mode()
def bench_speed(
    model: torch.nn.Module | Mapping[str, torch.nn.Module],
    ids: torch.Tensor,
    policies: list[Policy],
    contexts: list[int],
    steps: int = 24,
    warmup: int = 3,
    progress: bool = True,
    bandwidth: float | None = None,
    compile: str = "auto",
    reference: bool = True,
):
    """Yield one result per (context, weights, run): median ms per decode step, ratio to ``full``
    (under the same weights; its compiled run where there is one) and to the same run under fp32
    weights, memory, and the floor
    ``(weights as stored + K/V touched per step) / bandwidth`` with the efficiency floor / measured.
    The bandwidth is the median of triad passes run between the rounds of steps (or
    ``bandwidth``, bytes/s, when given).

    ``model`` is one model or ``{weight format: model}`` (the same model stored in several formats:
    ``infinikv.weights``). Every run decodes the same tokens, interleaved step by step.
    ``reference`` adds transformers' own ``DynamicCache`` (``hf-dynamic``) for each format.
    ``compile``: ``auto`` runs each policy as ``generate`` would (compiled where its step is
    built), ``on`` compiles every policy that can be (building its step if needed), ``off`` none,
    and ``both`` times each compilable policy eager and compiled side by side.
    """
    variants = dict(model) if isinstance(model, Mapping) else {weights_format(model): model}
    device = model_device(next(iter(variants.values())))
    ids = ids.to(device)
    triad = Triad(device)
    link = host_to_device_bandwidth(device) if device.type == "cuda" else None
    stored = {fmt: stored_bytes(m) for fmt, m in variants.items()}

    def sync() -> None:  # CUDA runs asynchronously: time finished work only
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for context in contexts:
        length = context + warmup + steps
        runs: dict[str, tuple[dict, Batch | DynamicBaseline]] = {}
        for fmt, lm in variants.items():
            if reference:
                reference_row = {
                    "policy": DYNAMIC,
                    "label": DYNAMIC,
                    "budget": None,
                    "capacity": None,
                    "compiled": False,
                    "weights": fmt,
                }
                runs[f"{DYNAMIC} {fmt}"] = (reference_row, DynamicBaseline(lm))
            for policy in policies:
                for compiled in compile_runs(compile, lm, policy, length):
                    key = f"{policy!r} {fmt}" + (" compiled" if compiled else "")
                    row = {**policy.describe(), "compiled": compiled, "weights": fmt}
                    runs[key] = (row, Batch(lm, policy, compiled, length))
        prefill_seconds = {}
        for key, (_, run) in tqdm(runs.items(), desc=f"prefill {context}", disable=not progress, leave=False):
            begin = time.perf_counter()
            run.prefill([ids[0, :context].tolist()], pad_id=0)
            sync()
            prefill_seconds[key] = time.perf_counter() - begin
        times: dict[str, list[float]] = {key: [] for key in runs}
        tokens = ids[:, context:length]
        for step in tqdm(range(warmup + steps), desc=f"decode {context}", disable=not progress, leave=False):
            triad.measure()
            for key, (_, run) in runs.items():  # interleaved: every run sees the same machine state
                sync()
                begin = time.perf_counter()
                run.step(tokens[:, step])
                sync()
                if step >= warmup:
                    times[key].append(time.perf_counter() - begin)
                elif step == warmup - 1 and isinstance(run, Batch) and not run.compile:
                    run.cache.clock.enabled = True  # profile the timed steps (eager runs only)
        medians = {key: statistics.median(t) * 1000 for key, t in times.items()}
        measured = bandwidth or triad.median()
        full = {}  # full as a user runs it: compiled where it was, else eager
        for k, (d, _) in sorted(runs.items(), key=lambda item: item[1][0]["compiled"]):
            if d["policy"] == REFERENCE:
                full[d["weights"]] = medians[k]
        rss, peak_rss = memory.rss(), memory.peak()
        for key, (description, run) in runs.items():
            ms = medians[key]
            if isinstance(run, Batch):
                cache = run.cache
                profile = {phase: round(s * 1000 / steps, 3) for phase, s in cache.clock.seconds.items()}
                transfer = cache.transfer_summary() or {}
                attended, held = kv_bytes_attended(cache), cache.held_bytes()
            else:  # the reference attends to what its layers hold (a sliding layer: its window)
                profile, transfer = {}, {}
                attended = held = sum(t.nbytes for layer in run.cache.layers for t in (layer.keys, layer.values))
            if profile:
                profile["rest"] = round(statistics.mean(times[key]) * 1000 - sum(profile.values()), 3)
            moved = transfer.get("bytes_moved_per_step", 0)
            weights = stored[description["weights"]]
            floor = floor_ms(weights, attended, moved, measured, link)
            in_fp32 = next((k for k, (d, _) in runs.items() if d == {**description, "weights": "fp32"}), None)
            yield {
                **description,
                "context": context,
                "ms_per_step": round(ms, 3),
                "prefill_seconds": round(prefill_seconds[key], 3),
                "prompt_tokens_per_second": round(context / prefill_seconds[key], 1),
                "tokens_per_second": round(1000 / ms, 2),
                "ratio_to_full": round(full[description["weights"]] / ms, 3)
                if description["weights"] in full
                else None,
                **({"ratio_to_fp32": round(medians[in_fp32] / ms, 3)} if in_fp32 and len(variants) > 1 else {}),
                "kv_bytes": round(held),
                "bytes_moved_per_step": moved,
                **({"fetched_fraction": transfer["fetched_fraction"]} if transfer else {}),
                "kv_bytes_attended_per_step": round(attended),
                "weights_bytes": weights,  # as stored: the floor's weight bytes
                "bandwidth_bytes_per_second": round(measured),
                **({"link_bytes_per_second": round(link)} if link else {}),
                "threads": torch.get_num_threads(),
                "floor_ms_per_step": round(floor, 3),
                "weights_floor_ms": round(weights / measured * 1000, 3),  # what the profile's "rest" compares with
                "efficiency": round(floor / ms, 3),
                "rss_bytes": rss,
                "peak_rss_bytes": peak_rss,  # the process's peak so far: every cache of this context alive
                "profile_ms": profile,  # mean ms per step: speculate / fetch (not hidden) / attend / rest
                **({"compile_seconds": round(run.compile_seconds, 2)} if getattr(run, "compile_seconds", None) else {}),
            }
        del runs
