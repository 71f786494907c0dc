"""The CUDA path of infinikv, checked and timed on whatever device is given (cuda or cpu).

Writes gpu_check.json (and prints it) under $OUT when set, else the current folder:
- exactness: infinigen with alpha = inf against full (max |logit diff|);
- decode tokens/s for full (KV on the device), offload and infinigen, per context;
- prefetch overlap: decode ms/step of infinigen and offload with and without overlap;
- the peer: transformers' DynamicCache with and without offloading=True (its own prefetch).
Usage: python scripts/gpu_check.py [--device cuda] [--contexts 4096,16384,32768] [--steps 16]
"""

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from infinikv import load_model, make_policy
from infinikv.bench.speed import bench_speed, prefill
from infinikv.data import load_text


def decode_ms(model, ids, policy, context: int, steps: int, device, cache=None) -> float:
    """Median ms per decode step after a ``context`` prefill, under ``policy`` or in ``cache``."""
    if cache is None:
        cache = prefill(model, ids[:, :context], policy)
    else:
        for begin in range(0, context, 1024):
            model(input_ids=ids[:, begin : min(begin + 1024, context)], cache=cache, use_cache=True, logits_to_keep=1)
    times = []
    for step in range(steps):
        torch.cuda.synchronize() if device.type == "cuda" else None
        begin = time.perf_counter()
        model(input_ids=ids[:, context + step : context + step + 1], cache=cache, use_cache=True)
        torch.cuda.synchronize() if device.type == "cuda" else None
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
    length = max(max(contexts) + args.steps + 8, 600)  # 600: the exactness check below
    ids = tokenizer(load_text("austen:all")[: length * 8], return_tensors="pt").input_ids[:, :length].to(device)
    report = {"device": str(device), "name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}

    short = ids[:, :600]
    caches = [
        make_policy("full").make_cache(model),
        make_policy("infinigen", alpha=math.inf, max_fetch=1.0).make_cache(model),
    ]
    diffs = []
    for cache in caches:
        model(input_ids=short[:, :512], cache=cache, use_cache=True)
    for i in range(512, 600):
        a, b = (model(input_ids=short[:, i : i + 1], cache=c, use_cache=True).logits for c in caches)
        diffs.append(float((a - b).abs().max()))
    report["exactness_max_abs_logit_diff"] = max(diffs)

    policies = [make_policy("full"), make_policy("offload"), make_policy("infinigen")]
    report["speed"] = list(bench_speed(model, ids, policies, contexts, steps=args.steps, progress=False))
    report["overlap"] = [
        {
            "policy": name,
            "context": context,
            "overlap_ms": decode_ms(model, ids, make_policy(name), context, args.steps, device),
            "no_overlap_ms": decode_ms(model, ids, make_policy(name, no_overlap=True), context, args.steps, device),
        }
        for name in ("offload", "infinigen")
        for context in contexts[:2]
    ]
    report["transformers_offloading_peer"] = []  # DynamicCache(offloading=True): whole layers, one ahead
    for context in contexts[:2]:
        row = {"context": context}
        for name, offloading in (("dynamic_ms", False), ("dynamic_offloading_ms", True)):
            try:
                cache = DynamicCache(config=model.config, offloading=offloading)
                row[name] = decode_ms(model, ids, None, context, args.steps, device, cache=cache)
            except Exception as error:  # a peer's limitation is a result, not a crash of the check
                row[name] = f"failed: {type(error).__name__}: {error}"
        report["transformers_offloading_peer"].append(row)
    out = Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    assert report["exactness_max_abs_logit_diff"] < 1e-3, "alpha = inf must reproduce full attention"


if __name__ == "__main__":
    main()
