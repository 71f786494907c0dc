"""``infinikv report`` (the Markdown report; the docs' measured tables from their rows) and
``infinikv plan`` (the offloading cost model): the commands that read results, not run models."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .. import models
from ..errors import InfinikvError
from ..grid import PROTOCOLS
from ..paths import home


def cmd_plan(args: argparse.Namespace) -> int:
    from ..bench import plan as planner

    gpu = planner.preset(planner.GPU_PRESETS, args.gpu, "GPU")
    if args.model:
        folder = models.bundled_folder(args.model) if args.model in models.BUNDLED else Path(args.model)
        shape = planner.shape_from_config(folder)
    else:
        shape = planner.preset(planner.MODEL_PRESETS, args.model_preset, "model")
    for flag, value in (("--fetch-fraction", args.fetch_fraction), ("--h2o-budget", args.h2o_budget)):
        if value is not None and not 0 < value <= 1:
            raise InfinikvError(f"{flag} must be in (0, 1], got {value}")
    measured = planner.fractions_from_bench(planner.read_rows(args.from_json), args.context) if args.from_json else {}
    fractions = {}
    flags = {"fetch": args.fetch_fraction, "keep": args.h2o_budget}  # by what the share is
    for name, (kind, default) in planner.FRACTIONS.items():
        given = flags[kind]
        fractions[name] = (given, "given") if given is not None else measured.get(name, (default, "default"))
    rows = planner.plan(
        shape,
        gpu,
        args.host_memory,
        args.batch,
        args.context,
        fractions={name: value for name, (value, _) in fractions.items()},
        kv_on_host=args.kv_on_host,
    )
    if args.replicas < 1:
        raise InfinikvError("--replicas must be at least 1")
    for r in rows:  # replicas do not share a GPU, host memory or link: N times one replica's rate
        r["aggregate_tokens_per_second"] = r["tokens_per_second"] * args.replicas if r["fits"] else None
    if args.json:
        result = {
            "projection": True,
            "replicas": args.replicas,
            "model": shape.name,
            "gpu": args.gpu,
            "host_gb": args.host_memory,
            "batch": args.batch,
            "context": args.context,
            "fractions": {k: {"fraction": v, "source": src} for k, (v, src) in fractions.items()},
            "policies": rows,
        }
        print(json.dumps(result, indent=2))
        return 0
    kv = args.batch * args.context * shape.kv_bytes_per_token()
    print(
        f"PROJECTION (a cost model, not a measurement): {shape.name} ({shape.params() / 1e9:.2f} B params, "
        f"{shape.params() * planner.DTYPE_BYTES / 1e9:.1f} GB fp16) on {gpu.name}, host {args.host_memory:g} GB, "
        f"batch {args.batch}, context {args.context}"
    )
    print(
        f"K/V fp16: {kv / 1e9:.1f} GB ({shape.kv_bytes_per_token() / 1e3:.1f} KB per token); "
        + ", ".join(f"{k} {planner.FRACTIONS[k][0]} {v:.3f} ({src})" for k, (v, src) in fractions.items())
    )
    many = args.replicas > 1
    if many:
        print(
            f"{args.replicas} replicas, each on its own {gpu.name} and {args.host_memory:g} GB host: "
            f"aggregate = {args.replicas} x one replica's tok/s (a projection: nothing shared is modelled)"
        )
    print(
        f"{'policy':<10} {'tok/s':>8} {'bound by':<11} {'K/V on':<6} {'GPU GB':>7} {'host GB':>8} {'PCIe GB/step':>13}"
        + (f" {'aggregate tok/s':>16}" if many else "")
    )
    for r in rows:
        speed = f"{r['tokens_per_second']:.2f}" if r["fits"] else "no fit"
        total = f" {r['aggregate_tokens_per_second']:>16.2f}" if many and r["fits"] else f" {'-':>16}" if many else ""
        print(
            f"{r['policy']:<10} {speed:>8} {r['bound']:<11} {'GPU' if r['kv_on_gpu'] else 'host':<6} "
            f"{r['gpu_bytes'] / 1e9:>7.1f} {r['host_bytes'] / 1e9:>8.1f} {r['link_bytes_per_step'] / 1e9:>13.2f}"
            + total
        )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from ..bench.plan import read_rows
    from ..bench.report import latest, write_report

    if args.docs:
        return refresh_docs(args)
    if args.board:
        return print_board(args)
    results = home() / "results"
    speed = Path(args.speed) if args.speed else latest(results, "speed")
    quality = Path(args.quality) if args.quality else latest(results, "quality")
    ruler = Path(args.ruler) if args.ruler else latest(results, "ruler")
    if speed is None and quality is None and ruler is None:
        raise InfinikvError(
            f"no bench results in {results}: run infinikv bench speed / bench quality / eval ruler, "
            "or give --speed/--quality/--ruler"
        )
    sources = [p for p in (speed, quality, ruler) if p is not None]
    out_dir = Path(args.out_dir) / time.strftime("%Y%m%d-%H%M%S")
    report = write_report(
        read_rows(speed) if speed else [],
        read_rows(quality) if quality else [],
        out_dir,
        sources,
        ruler_rows(ruler) if ruler else [],
    )
    print(report)
    return 0


def ruler_rows(path: Path) -> list[dict]:
    from ..bench.plan import read_rows

    rows = read_rows(path)
    if not rows or any(not all(k in r for k in ("model", "spec", *PROTOCOLS["RULER"], "accuracy")) for r in rows):
        raise InfinikvError(f"{path} holds no infinikv eval ruler rows")
    return rows


def print_board(args: argparse.Namespace) -> int:
    """``--board ROWS...``: the leaderboard of the rows, one Markdown table per model, or its rows (``--json``)."""
    from ..bench.board import board_rows, board_table
    from ..bench.plan import read_rows

    rows = [row for path in args.board for row in read_rows(Path(path))]
    board = board_rows(rows)
    if not board:
        raise InfinikvError("no RULER, follow-up or P-ctx rows in " + ", ".join(args.board))
    if args.json:
        print("\n".join(json.dumps(r) for r in board))
        return 0
    for model in dict.fromkeys(r["model"] for r in board):
        print("\n".join([f"## {model}", "", *board_table(rows, model), ""]))
    return 0


def refresh_docs(args: argparse.Namespace) -> int:
    """``--docs ROOT``: keep new rows if given, then rewrite the marked tables of ROOT's pages."""
    from ..bench import pages
    from ..bench.plan import read_rows

    root = Path(args.docs)
    if not (root / "docs").is_dir():
        raise InfinikvError(f"--docs {root}: no docs/ folder there (give the repository's root)")
    if args.keep:
        if not args.name or not args.command:
            raise InfinikvError("--keep needs --as NAME (the results file) and --command (how the rows were measured)")
        pages.keep(read_rows(Path(args.keep)), root / "docs" / "results" / f"{args.name}.json", args.command, args.at)
    for page in pages.refresh(root):
        print(f"rewrote {page}")
    return 0


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="one Markdown report with plots from the latest speed, quality and RULER results")
    p.add_argument("--speed", help="bench speed results (default: the latest in $INFINIKV_HOME/results)")
    p.add_argument("--quality", help="bench quality results (default: the latest in $INFINIKV_HOME/results)")
    p.add_argument("--ruler", help="eval ruler results (default: the latest in $INFINIKV_HOME/results)")
    p.add_argument("--out-dir", default="reports", help="reports go to OUT_DIR/<time>/ (default reports, git-ignored)")
    p.add_argument(
        "--docs",
        nargs="?",
        const=".",
        metavar="ROOT",
        help="instead: rewrite the measured tables of ROOT's README and docs/ from docs/results/ (default ROOT .)",
    )
    p.add_argument(
        "--board",
        nargs="+",
        metavar="ROWS",
        help="instead: the leaderboard of these rows (eval ruler, followup, ppl; docs/results files too), per model",
    )
    p.add_argument("--json", action="store_true", help="with --board: print the board as JSON rows")
    p.add_argument("--keep", metavar="ROWS", help="with --docs: first save these result rows as docs/results/NAME.json")
    p.add_argument("--as", dest="name", metavar="NAME", help="with --keep: the results file's name")
    p.add_argument("--command", help="with --keep: the command that measured the rows")
    p.add_argument(
        "--at", metavar="COMMIT", help="with --keep: the commit that measured them (default: the checkout's)"
    )
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("plan", help="project decode tokens/s of offloading policies on a GPU (a cost model)")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--model-preset", default="opt-13b", help="opt-6.7b, opt-13b (default), opt-30b, llama-2-7b, llama-2-13b"
    )
    source.add_argument("--model", help="a config.json, a model folder or a bundled model name instead of a preset")
    p.add_argument("--gpu", default="a6000", help="a6000 (default; 48 GB, PCIe 3.0 x16), h100 or h200 (PCIe 5.0 x16)")
    p.add_argument("--host-memory", type=float, default=96, help="host memory in GB (default 96, the paper's)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=2048, help="tokens per sequence (prompt + generated)")
    p.add_argument("--from", dest="from_json", help="bench speed JSON: take InfiniGen's and H2O's fractions from it")
    p.add_argument("--fetch-fraction", type=float, help="InfiniGen's fetched share of the tokens (overrides --from)")
    p.add_argument("--h2o-budget", type=float, help="H2O's kept share of the tokens (overrides --from)")
    p.add_argument("--kv-on-host", action="store_true", help="keep every K/V on the host, as in the paper's runs")
    p.add_argument("--replicas", type=int, default=1, help="serving replicas, each on its own GPU: adds their total")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)
