"""``infinikv bench``: quality, speed and generation."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import data, models
from ..bench.speed import COMPILE_MODES
from ..contract import REFERENCE
from ..errors import InfinikvError
from ..policies import parse_spec
from ..results import run_label
from ..weights import check_format
from .arguments import (
    add_compile_argument,
    add_model_argument,
    add_policy_arguments,
    add_ray_arguments,
    add_results_arguments,
)
from .common import (
    append_row,
    counts,
    grid,
    load,
    needle_table,
    policy_cells,
    ppl_table,
    prepare,
    results_file,
    run_cells,
    single_policy,
)


def cmd_quality(args: argparse.Namespace) -> int:
    from ..bench.plots import needle_heatmap, perplexity_plot
    from ..eval.needle import needle_cases
    from ..eval.ppl import context_tokens

    policies = grid(args)
    if args.needles < 0:
        raise InfinikvError("--needles must be at least 0 (0 skips P-needle)")
    model, tokenizer = load(args)
    context_tokens(tokenizer, data.load_text(args.text, from_chapter_one=True), args.context, args.continuation)
    if args.needles:  # both texts are long enough before any cell runs
        haystack = data.load_text(args.needle_text, from_chapter_one=True)
        needle_cases(tokenizer, haystack, args.needle_context, args.needles, args.seed)
    prepare(policies, model, tokenizer, args.text, not args.quiet)
    out = results_file(args, "quality")
    print(f"quality: P-ctx on {args.text}, P-needle on {args.needle_text}; results -> {out}", file=sys.stderr)
    ctx = {"text": args.text, "context": args.context, "continuation": args.continuation}
    needle = {"text": args.needle_text, "context": args.needle_context, "needles": args.needles, "seed": args.seed}
    cells = policy_cells(args, "P-ctx", policies, ctx)
    cells += policy_cells(args, "P-needle", policies, needle) if args.needles else []
    every = run_cells(args, cells, out, model, tokenizer)
    rows = [r for r in every if r["protocol"] == "P-ctx"]
    needles = [r for r in every if r["protocol"] == "P-needle"]
    if args.json:
        Path(args.json).write_text(json.dumps(rows + needles, indent=2))
    if args.plot_dir:
        plots = [perplexity_plot(rows, Path(args.plot_dir) / "quality-ppl.png")]
        if needles:
            plots.append(needle_heatmap(needles, Path(args.plot_dir) / "quality-needle.png"))
        print(f"plots -> {', '.join(map(str, plots))}", file=sys.stderr)
    print(ppl_table(rows))
    if needles:
        print()
        print(needle_table(needles))
    return 0


def cmd_speed(args: argparse.Namespace) -> int:
    from ..bench.speed import bench_speed, compare_with_peer, peer_rows

    policies = grid(args)
    peers = []
    if args.peer:
        try:
            peers = peer_rows(Path(args.peer).read_text().splitlines(), args.peer)
        except OSError as exc:
            raise InfinikvError(f"cannot read --peer {args.peer}: {exc.strerror}") from None
    contexts = counts(args.contexts, "--contexts")
    if args.steps < 1:
        raise InfinikvError("--steps must be at least 1")
    if args.device.startswith("cuda") and not cuda_available():
        raise InfinikvError("--device cuda asked for, but torch sees no CUDA device")
    if args.compile in ("on", "both") and not any(p.compilable for p in policies):
        raise InfinikvError(f"--compile {args.compile}: none of these policies can be compiled")
    asked = [f.strip() for f in args.weights.split(",") if f.strip()]
    formats = list(dict.fromkeys(models.resolve_weights(args.model, f, args.device) for f in asked))
    for fmt in formats:  # every format runnable before any loads
        check_format(fmt, args.device)
    text = data.load_text(args.text)
    variants = {}
    for fmt in formats:
        variants[fmt], tokenizer = models.load_model(args.model, device=args.device, weights=fmt)
    model = next(iter(variants.values()))
    need = max(contexts) + args.steps + 3
    ids = tokenizer(text[: need * 8], return_tensors="pt").input_ids[:, :need]
    if ids.shape[1] < need:
        raise InfinikvError(f"{args.text} has fewer than the {need} tokens the longest context needs")
    prepare(policies, model, tokenizer, progress=not args.quiet)
    out = results_file(args, "speed")
    print(f"speed: contexts {contexts}, {args.steps} steps; results -> {out}", file=sys.stderr)
    rows = []
    cells = bench_speed(
        variants,
        ids,
        policies,
        contexts,
        args.steps,
        progress=not args.quiet,
        compile=args.compile,
    )
    for row in cells:  # a context's cells finish together (they are interleaved): save each as it lands
        row["text"] = args.text
        compare_with_peer([row], peers)
        rows.append(row)
        append_row(out, row)
        if args.json:
            Path(args.json).write_text(json.dumps(peers + rows, indent=2))
    if args.plot:
        from ..bench.plots import speed_plot

        print(f"plot -> {speed_plot(peers + rows, Path(args.plot))}", file=sys.stderr)
    print(speed_table(peers + rows))
    print(
        "\nwhere a decode step goes (mean ms): speculate / fetch (not overlapped) / attend / rest, speculate %, "
        "and the weights' byte floor (what the rest compares with)"
    )
    for r in rows:
        p = r.get("profile_ms")
        if p:
            print(
                f"{r['context']:>8} {run_label(r):<40} {p.get('speculate', 0):>9.2f} {p.get('fetch', 0):>9.2f} "
                f"{p.get('attend', 0):>9.2f} {p['rest']:>9.2f} {p.get('speculate', 0) / sum(p.values()):>7.1%} "
                f"{r['weights_floor_ms']:>9.2f}"
            )
    for context in sorted({r["context"] for r in rows}):
        bandwidth = next(r["bandwidth_bytes_per_second"] for r in rows if r["context"] == context)
        print(f"triad bandwidth at {context}: {bandwidth / 1e9:.1f} GB/s (median of passes between the steps)")
    compiled = [r for r in rows if r.get("compile_seconds")]
    for r in compiled:
        print(
            f"compile: {run_label(r)} at {r['context']}: {r['compile_seconds']:.1f} s for the first step",
            file=sys.stderr,
        )
    return 0


def speed_table(rows: list[dict]) -> str:
    """ms per decode step and prompt tokens/s, each run beside its floor, ``full`` and the peer."""
    columns = [("ms/step", 9), ("tok/s", 8), ("x full", 7), ("x peer", 7), ("x fp32", 7), ("floor ms", 9)]
    columns += [("eff.", 6), ("prompt/s", 9), ("KV MiB", 8), ("RSS MiB", 8)]
    lines = [f"{'context':>8} {'policy':<40} " + " ".join(f"{n:>{w}}" for n, w in columns)]

    def number(row: dict, key: str, spec: str, scale: float = 1.0) -> str:
        return format(row[key] / scale, spec) if row.get(key) is not None else "-"

    for r in rows:
        cells = [
            number(r, "ms_per_step", ".1f"),
            number(r, "tokens_per_second", ".1f"),
            number(r, "ratio_to_full", ".2f"),
            number(r, "ratio_to_peer", ".2f"),
            number(r, "ratio_to_fp32", ".2f"),
            number(r, "floor_ms_per_step", ".1f"),
            number(r, "efficiency", ".2f"),
            number(r, "prompt_tokens_per_second", ".0f"),
            number(r, "kv_bytes", ".1f", 2**20),
            number(r, "peak_rss_bytes", ".0f", 2**20),
        ]
        lines.append(
            f"{r['context']:>8} {run_label(r):<40} "
            + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, columns, strict=True))
        )
    return "\n".join(lines)


def cmd_generation(args: argparse.Namespace) -> int:
    from ..bench.generation import long_generation

    if args.window < 2 or args.tokens < args.window:
        raise InfinikvError("--window must be at least 2, and --tokens at least --window")
    spec = single_policy(args) or {"policy": REFERENCE}
    policy = parse_spec(spec)
    model, tokenizer = load(args)
    prepare([policy], model, tokenizer, progress=not args.quiet)
    out = results_file(args, "generation")
    row = long_generation(
        model, tokenizer, policy, args.prompt, args.tokens, args.window, args.compile, args.seed, not args.quiet
    )
    append_row(out, row)
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    print(f"{'tokens':>9} {'tok/s':>8} {'RSS MiB':>8} {'KV MiB':>8} {'peak KV':>8}")
    for w in row["windows"]:
        print(
            f"{w['end']:>9,} {w['tokens_per_second']:>8.2f} {w['rss_bytes'] / 2**20:>8.0f} "
            f"{w['kv_bytes'] / 2**20:>8.1f} {w['peak_kv_bytes'] / 2**20:>8.1f}"
        )
    print(
        f"{policy.label()}: last window {row['last_over_first_rate']:.3f}x the first's rate, peak RSS "
        f"{100 * row['peak_rss_growth']:+.1f}% over the first window's; results -> {out}"
    )
    return 0


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def add(sub: argparse._SubParsersAction, parser_class: type) -> argparse._SubParsersAction:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench", required=True, parser_class=parser_class
    )
    p = bench.add_parser("quality", help="P-ctx perplexity vs budget and the P-needle grid, every policy")
    add_model_argument(p)
    p.add_argument("--text", default="austen:emma", help="P-ctx text (default austen:emma)")
    p.add_argument("--context", type=int, default=4096, help="P-ctx context tokens")
    p.add_argument("--continuation", type=int, default=512, help="P-ctx tokens scored")
    p.add_argument("--needle-text", default="austen:prideprejudice", help="P-needle haystack")
    p.add_argument("--needle-context", type=int, default=4096)
    p.add_argument("--needles", type=int, default=12, help="pass keys at depths 10..90%% (0 skips P-needle)")
    p.add_argument("--seed", type=int, default=0, help="seed of the pass keys")
    p.add_argument("--json", help="write every result (P-ctx and P-needle rows) to this JSON file")
    add_results_arguments(p)
    p.add_argument("--plot-dir", help="write quality-ppl.png (curves) and quality-needle.png (heatmap) here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_policy_arguments(p, grid=True, every_policy=True)
    add_ray_arguments(p)
    p.set_defaults(func=cmd_quality, budgets="0.05,0.1,0.2,0.5")

    p = bench.add_parser("speed", help="median ms per decode step by context, policies interleaved")
    add_model_argument(p, several_weights=True)
    p.add_argument("--text", default="austen:all")
    p.add_argument("--contexts", default="1024,4096", help="comma-separated context lengths")
    p.add_argument("--steps", type=int, default=24, help="timed decode steps per cell")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        nargs="?",
        const="both",
        default="auto",
        help="auto (default): each policy as generate runs it (compiled where its step is built); on: compile "
        "every policy that can be; off; both (a bare --compile): eager and compiled side by side",
    )
    p.add_argument("--json", help="write the results to this JSON file (updated as cells finish)")
    p.add_argument("--out", help="JSON-lines file that receives each result as it finishes")
    p.add_argument("--plot", help="write a PNG of ms per step (and its floor) and the ratio to full by context")
    p.add_argument(
        "--peer",
        help="JSON lines of another engine's speed on the same model and text (../shared/peers/llamacpp/speed.py): "
        "its rows join the table, the JSON and the plot, and each of ours gets its ratio to the peer's",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_policy_arguments(p, grid=True)
    p.set_defaults(func=cmd_speed)

    p = bench.add_parser("generation", help="tokens/s and memory per window of one very long generation")
    add_model_argument(p)
    p.add_argument("--prompt", default="Once upon a time, in a small village by the sea,", help="the prompt")
    p.add_argument("--tokens", type=int, default=100_000, help="tokens to generate (default 100,000)")
    p.add_argument("--window", type=int, default=10_000, help="tokens per reported window (default 10,000)")
    p.add_argument("--seed", type=int, default=0)
    add_compile_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="JSON-lines file that receives the result")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_policy_arguments(p)
    p.set_defaults(func=cmd_generation)

    return bench
