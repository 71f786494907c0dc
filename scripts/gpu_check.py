"""The CUDA path of infinikv, checked and timed on whatever device is given (cuda or cpu).

Writes gpu_check.json (and prints it) under $OUT when set, else the current folder:
- exactness: infinigen fetching everything (mass 1, cap 1) against full (max |logit diff|), and a compiled bct
  decode step (CUDA graphs on a GPU) against the eager one;
- bench speed's rows (transformers' DynamicCache, full, bct, offload and infinigen, overlap on
  and off, compiled bct next to eager) per context;
- the peer: transformers' DynamicCache with and without offloading=True (its own prefetch).
Usage: python scripts/gpu_check.py [--device cuda] [--contexts 4096,16384,32768] [--steps 16]
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

from infinikv import Batch, load_model, make_policy
from infinikv.bench.baseline import DynamicBaseline
from infinikv.bench.speed import bench_speed
from infinikv.data import load_text
from infinikv.preparation import ensure_prepared


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peer_ms(model, ids, context: int, steps: int, offloading: bool) -> float:
    """Median ms per decode step of transformers' own DynamicCache (``offloading``: its prefetch)."""
    run = DynamicBaseline(model, offloading=offloading)
    run.prefill([ids[0, :context].tolist()], pad_id=0, chunk=1024)
    times = []
    for step in range(steps):
        sync(run.device)
        begin = time.perf_counter()
        run.step(ids[:, context + step])
        sync(run.device)
        times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2] * 1000


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    model, tokenizer = load_model(device=args.device)
    device = next(model.parameters()).device
    length = max(max(contexts) + args.steps + 8, 600)  # 600: the exactness checks below
    ids = tokenizer(load_text("austen:all")[: length * 8], return_tensors="pt").input_ids[:, :length].to(device)
    report = {"device": str(device), "name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}

    exact = make_policy("infinigen", mass=1.0, max_fetch=1.0)
    ensure_prepared(exact, model, tokenizer)
    pairs = {
        "infinigen_fetch_all_vs_full": (Batch(model, make_policy("full")), Batch(model, exact)),
        "compiled_vs_eager_bct": (
            Batch(model, make_policy("bct", capacity=256)),
            Batch(model, make_policy("bct", capacity=256), compile=True),
        ),
    }
    for name, (a, b) in pairs.items():
        a.feed(ids[:, :512])
        b.feed(ids[:, :512])
        report[name] = max(float((a.step(ids[:, i]) - b.step(ids[:, i])).abs().max()) for i in range(512, 600))
    report["compile_seconds"] = pairs["compiled_vs_eager_bct"][1].compile_seconds

    policies = [make_policy("full"), make_policy("bct", capacity=1024), make_policy("offload")]
    policies += [
        make_policy("offload", no_overlap=True),
        make_policy("infinigen"),
        make_policy("infinigen", no_overlap=True),
    ]
    for policy in policies:
        ensure_prepared(policy, model, tokenizer)
    report["speed"] = list(bench_speed(model, ids, policies, contexts, steps=args.steps, progress=False, compile=True))
    report["transformers_offloading_peer"] = []  # DynamicCache(offloading=True): whole layers, one ahead
    for context in contexts[:2]:
        row = {"context": context}
        for name, offloading in (("dynamic_ms", False), ("dynamic_offloading_ms", True)):
            try:
                row[name] = peer_ms(model, ids, context, args.steps, offloading)
            except Exception as error:  # a peer's limitation is a result, not a crash of the check
                row[name] = f"failed: {type(error).__name__}: {error}"
        report["transformers_offloading_peer"].append(row)
    out = Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    assert report["infinigen_fetch_all_vs_full"] < 1e-3, "fetching everything must reproduce full attention"
    assert report["compiled_vs_eager_bct"] < 1e-3, "a compiled step must compute what the eager one does"


if __name__ == "__main__":
    main()
