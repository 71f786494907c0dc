"""The ``infinikv`` command line. Usage errors exit with 2 and one line on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from . import data, models
from .errors import InfinikvError
from .paths import home
from .policies import REGISTRY, Policy, make_policy, policy_from_spec, policy_names

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and still exit code 2)."""

    def error(self, message: str):  # type: ignore[override]
        raise InfinikvError(f"{self.prog}: {message}")


def _policy_options() -> dict[str, Any]:
    options = {}
    for cls in REGISTRY.values():
        for option in cls.options:
            options.setdefault(option.name, option)
    return options


def add_policy_arguments(parser: argparse.ArgumentParser, grid: bool = False, every_policy: bool = False) -> None:
    group = parser.add_argument_group("KV policy")
    if grid:
        group.add_argument(
            "--policy",
            "--policies",
            dest="policies",
            default=",".join(policy_names()) if every_policy else "full",
            help=f"comma-separated policies ({', '.join(policy_names())}); default {'all' if every_policy else 'full'}",
        )
        group.add_argument(
            "--budget",
            "--budgets",
            dest="budgets",
            default=None,
            help="comma-separated budgets, fractions of the tokens seen in (0, 1]",
        )
    else:
        group.add_argument(
            "--policy", default=None, help=f"one of {', '.join(policy_names())} (default: the model's own, else full)"
        )
        group.add_argument("--budget", type=float, default=None, help="tokens kept, as a fraction of the tokens seen")
    group.add_argument("--capacity", type=int, default=None, help="tokens kept per layer (instead of --budget)")
    for option in _policy_options().values():
        if option.type is bool:
            group.add_argument(
                option.flag, dest=option.name, action="store_const", const=True, default=None, help=option.help
            )
            continue
        group.add_argument(
            option.flag, dest=option.name, default=None, help=f"{option.help} (default {option.default})"
        )


def build_policies(args: argparse.Namespace, names: list[str], budgets: list[float | None]) -> list[Policy]:
    """Every (policy, budget) cell asked for; unbounded policies run once."""
    given = {name: getattr(args, name) for name in _policy_options() if getattr(args, name, None) is not None}
    for name in given:
        if not any(name in {o.name for o in REGISTRY[p].options} for p in names if p in REGISTRY):
            raise InfinikvError(f"--{name.replace('_', '-')} does not apply to policy {', '.join(names)}")
    policies = []
    for name in names:
        if name not in REGISTRY:
            make_policy(name)  # raises the unknown-policy error
        own = {k: v for k, v in given.items() if k in {o.name for o in REGISTRY[name].options}}
        if not REGISTRY[name].bounded:
            policies.append(make_policy(name, **own))
            continue
        for budget in budgets if args.capacity is None else [None]:
            policies.append(make_policy(name, budget=budget, capacity=args.capacity, **own))
    return policies


def _floats(text: str | None, flag: str) -> list[float | None]:
    if text is None:
        return [None]
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InfinikvError(f"{flag} expects comma-separated numbers, got {text!r}") from None


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


# -- commands ------------------------------------------------------------------------------
def cmd_models(args: argparse.Namespace) -> int:
    if args.action == "fetch":
        print(models.fetch(args.name, force=args.force))
        return 0
    rows = models.list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            state = "ready" if row["fetched"] else "not fetched (infinikv models fetch)"
            print(f"{row['name']:<16} {state:<40} {row['path']}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    if args.action == "fetch":
        print(data.fetch(force=args.force))
        return 0
    tokenizer = None
    if models.is_hf_folder(models.bundled_folder(models.DEFAULT_MODEL)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(models.bundled_folder(models.DEFAULT_MODEL))
    rows = data.list_texts(tokenizer)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            size = (
                f"{row['tokens']:>9,} tokens"
                if row["tokens"]
                else (f"{row['chars']:>9,} chars" if row["chars"] else "not fetched (infinikv data fetch)")
            )
            print(f"{row['name']:<26} {size}")
    return 0


def _read_prompts(args: argparse.Namespace) -> list[str] | str:
    if args.prompts_file:
        try:
            lines = Path(args.prompts_file).read_text(encoding="utf-8").splitlines()
            prompts = [json.loads(line) for line in lines if line.strip()]
        except OSError as exc:
            raise InfinikvError(f"cannot read {args.prompts_file}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise InfinikvError(f"{args.prompts_file}: each line must be a JSON string ({exc.msg})") from None
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise InfinikvError(f"{args.prompts_file}: expected one JSON string per line")
        return prompts
    if args.prompt_file:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise InfinikvError(f"cannot read {args.prompt_file}: {exc.strerror}") from None
    if args.prompt is not None:
        return args.prompt
    try:
        piped = sys.stdin is not None and not sys.stdin.isatty()
        return sys.stdin.read() if piped else DEFAULT_PROMPT
    except (OSError, ValueError):  # no usable stdin (closed, or captured by a test runner)
        return DEFAULT_PROMPT


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import Sampling, generate

    given = [o.flag for o in _policy_options().values() if getattr(args, o.name) is not None]
    if args.policy is None and (given or args.budget is not None or args.capacity is not None):
        raise InfinikvError(f"{(given or ['--budget/--capacity'])[0]} needs --policy")
    policy = build_policies(args, [args.policy], [args.budget])[0] if args.policy else None
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    prompts = _read_prompts(args)
    if any(not p.strip() for p in ([prompts] if isinstance(prompts, str) else prompts)):
        raise InfinikvError("the prompt is empty")
    model, tokenizer = models.load_model(args.model)
    if policy is None:
        spec = models.default_policy_spec(model)
        policy = policy_from_spec(spec) if spec else make_policy("full")
    stream = not args.json and isinstance(prompts, str)

    def show(_row: int, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = generate(model, tokenizer, prompts, policy, sampling, chat=args.chat, on_text=show if stream else None)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    if stream:
        print()
    else:
        for i, text in enumerate(result.texts):
            print(f"--- [{i}] {text}")
    print(
        f"[{policy}] {result.new_tokens} tokens in {result.seconds:.2f} s "
        f"({result.tokens_per_second:.1f} tok/s decode), KV held {_mib(result.kv_bytes)}, "
        f"attended {100 * result.attended_fraction:.1f}% of tokens",
        file=sys.stderr,
    )
    return 0


def _table(rows: list[dict], reference: float | None) -> str:
    lines = [f"{'policy':<18} {'budget':>8} {'ppl':>8} {'vs full':>8} {'attended':>9} {'KV held':>11} {'seconds':>8}"]
    for r in rows:
        delta = f"{100 * (r['perplexity'] / reference - 1):+.1f}%" if reference else "-"
        lines.append(
            f"{_policy_label(r):<18} {_budget_label(r):>8} {r['perplexity']:>8.3f} {delta:>8} "
            f"{100 * r['attended_fraction']:>8.1f}% {_mib(r['kv_bytes']):>11} {r['seconds']:>8.1f}"
        )
    return "\n".join(lines)


def _grid(args: argparse.Namespace) -> list[Policy]:
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    return build_policies(args, names, _floats(args.budgets, "--budgets"))


def _results_file(args: argparse.Namespace, kind: str) -> Path:
    out = Path(args.out) if args.out else home() / "results" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _run_cells(policies: list[Policy], run, out: Path, label: str, extra: dict) -> list[dict]:
    """``run(policy)`` for each cell; each result is appended to ``out`` as soon as it lands."""
    rows = []
    for policy in policies:
        result = {**run(policy), **extra}
        rows.append(result)
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(
            f"  done: {_policy_label(result)} budget={_budget_label(result)} {label}={result[label]:.4g}",
            file=sys.stderr,
        )
    return rows


def _budget_label(row: dict) -> str:
    if row.get("budget"):
        return f"{row['budget']:g}"
    return f"{row['capacity']}t" if row.get("capacity") else "-"


def _policy_label(row: dict) -> str:
    return row["policy"] + (f":{row['update_rule']}" if row.get("update_rule") else "")


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from .eval.ppl import context_tokens, perplexity

    policies = _grid(args)
    text = data.load_text(args.text, from_chapter_one=True)
    model, tokenizer = models.load_model(args.model)
    ids = context_tokens(tokenizer, text, args.context, args.continuation)
    _check_calibration(policies, model, args.text)
    out = _results_file(args, "ppl")
    print(f"P-ctx on {args.text}: {args.context} + {args.continuation} tokens; results -> {out}", file=sys.stderr)
    rows = _run_cells(
        policies,
        lambda p: perplexity(model, ids, p, args.context, not args.quiet),
        out,
        "perplexity",
        {"text": args.text},
    )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_table(rows, next((r["perplexity"] for r in rows if r["policy"] == "full"), None)))
    return 0


def cmd_eval_needle(args: argparse.Namespace) -> int:
    from .eval.needle import needle_accuracy, needle_cases

    policies = _grid(args)
    text = data.load_text(args.text, from_chapter_one=True)
    model, tokenizer = models.load_model(args.model)
    cases = needle_cases(tokenizer, text, args.context, args.needles, args.seed)
    _check_calibration(policies, model, args.text)
    out = _results_file(args, "needle")
    print(
        f"P-needle: {args.needles} pass keys in {args.context} tokens of {args.text}; results -> {out}", file=sys.stderr
    )
    rows = _run_cells(
        policies,
        lambda p: needle_accuracy(model, tokenizer, cases, p, not args.quiet),
        out,
        "accuracy",
        {"text": args.text},
    )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(_needle_table(rows))
    return 0


def _needle_table(rows: list[dict]) -> str:
    lines = [f"{'policy':<18} {'budget':>8} {'accuracy':>9}  depths hit"]
    for r in rows:
        hits = " ".join(f"{c['depth']:.2f}" if c["hit"] else "  -  " for c in r["cases"])
        lines.append(f"{_policy_label(r):<18} {_budget_label(r):>8} {r['accuracy']:>9.2f}  {hits}")
    return "\n".join(lines)


def cmd_bench_quality(args: argparse.Namespace) -> int:
    from .bench.plots import needle_heatmap, perplexity_plot
    from .eval.needle import needle_accuracy, needle_cases
    from .eval.ppl import context_tokens, perplexity

    policies = _grid(args)
    if args.needles < 0:
        raise InfinikvError("--needles must be at least 0 (0 skips P-needle)")
    model, tokenizer = models.load_model(args.model)
    ids = context_tokens(tokenizer, data.load_text(args.text, from_chapter_one=True), args.context, args.continuation)
    haystack = data.load_text(args.needle_text, from_chapter_one=True) if args.needles else ""
    cases = needle_cases(tokenizer, haystack, args.needle_context, args.needles, args.seed) if args.needles else []
    _check_calibration(policies, model, args.text)
    out = _results_file(args, "quality")
    print(f"quality: P-ctx on {args.text}, P-needle on {args.needle_text}; results -> {out}", file=sys.stderr)
    rows = _run_cells(
        policies,
        lambda p: perplexity(model, ids, p, args.context, not args.quiet),
        out,
        "perplexity",
        {"protocol": "P-ctx", "text": args.text},
    )
    needles = _run_cells(
        policies if cases else [],
        lambda p: needle_accuracy(model, tokenizer, cases, p, not args.quiet),
        out,
        "accuracy",
        {"protocol": "P-needle", "text": args.needle_text},
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows + needles, indent=2))
    if args.plot_dir:
        plots = [perplexity_plot(rows, Path(args.plot_dir) / "quality-ppl.png")]
        if needles:
            plots.append(needle_heatmap(needles, Path(args.plot_dir) / "quality-needle.png"))
        print(f"plots -> {', '.join(map(str, plots))}", file=sys.stderr)
    print(_table(rows, next((r["perplexity"] for r in rows if r["policy"] == "full"), None)))
    if needles:
        print()
        print(_needle_table(needles))
    return 0


def cmd_eval_stream(args: argparse.Namespace) -> int:
    from .eval.stream import plot, stream

    policies = _grid(args)
    if args.tokens < 2 or args.chunk < 1 or args.window < 1:
        raise InfinikvError("--tokens must be at least 2, --chunk and --window at least 1")
    text = data.load_text(args.text)
    model, tokenizer = models.load_model(args.model)
    ids = tokenizer(text[: args.tokens * 8], return_tensors="pt").input_ids[:, : args.tokens]
    if ids.shape[1] < args.tokens:
        raise InfinikvError(f"the text has {ids.shape[1]} tokens, fewer than --tokens {args.tokens}")
    out = _results_file(args, "stream")
    print(f"P-stream: {args.tokens} tokens of {args.text} in chunks of {args.chunk}; results -> {out}", file=sys.stderr)
    rows = _run_cells(
        policies,
        lambda p: stream(model, ids, p, args.chunk, args.window, not args.quiet),
        out,
        "perplexity",
        {"text": args.text},
    )
    if args.plot:
        trained = getattr(model.config, "max_position_embeddings", None)
        print(f"plot -> {plot(rows, Path(args.plot), trained)}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'window':>13} " + " ".join(f"{_policy_label(r) + ' ' + _budget_label(r):>24}" for r in rows))
    print(" " * 14 + " ".join(f"{'ppl':>9} {'RSS MiB':>8} {'KV MiB':>6}" for _ in rows))
    for i, window in enumerate(rows[0]["windows"]):
        cells = []
        for r in rows:
            w = r["windows"][i]
            cells.append(f"{w['perplexity']:>9.2f} {w['rss_bytes'] / 2**20:>8.0f} {w['kv_bytes'] / 2**20:>6.1f}")
        print(f"{window['start']:>6}-{window['end']:<6} " + " ".join(cells))
    for r in rows:
        print(
            f"{_policy_label(r)}: ppl {r['perplexity']:.2f}, median window {r['median_window_perplexity']:.2f}, "
            f"worst {r['worst_window_perplexity']:.2f}, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB"
        )
    return 0


def cmd_bench_speed(args: argparse.Namespace) -> int:
    from .bench.speed import bench_speed, triad_bandwidth

    policies = _grid(args)
    contexts = [int(c) for c in _floats(args.contexts, "--contexts")]
    if not contexts or min(contexts) < 1 or args.steps < 1 or args.prefill_chunk < 1:
        raise InfinikvError("--contexts must be positive token counts, --steps and --prefill-chunk at least 1")
    if args.device.startswith("cuda") and not torch_cuda_available():
        raise InfinikvError("--device cuda asked for, but torch sees no CUDA device")
    text = data.load_text(args.text)
    model, tokenizer = models.load_model(args.model, device=args.device)
    need = max(contexts) + args.steps + 3
    ids = tokenizer(text[: need * 8], return_tensors="pt").input_ids[:, :need]
    if ids.shape[1] < need:
        raise InfinikvError(f"{args.text} has fewer than the {need} tokens the longest context needs")
    bandwidth = triad_bandwidth(args.device)
    out = _results_file(args, "speed")
    print(
        f"speed: contexts {contexts}, {args.steps} steps; triad bandwidth {bandwidth / 1e9:.1f} GB/s; results -> {out}",
        file=sys.stderr,
    )
    rows = []
    cells = bench_speed(
        model,
        ids,
        policies,
        contexts,
        args.steps,
        progress=not args.quiet,
        bandwidth=bandwidth,
        chunk=args.prefill_chunk,
    )
    for row in cells:  # a context's cells finish together (they are interleaved): save each as it lands
        row["text"] = args.text
        rows.append(row)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.plot:
        from .bench.plots import speed_plot

        print(f"plot -> {speed_plot(rows, Path(args.plot))}", file=sys.stderr)
    columns = ("ms/step", 9), ("tok/s", 8), ("x full", 7), ("floor ms", 9), ("eff.", 6), ("KV MiB", 8), ("RSS MiB", 8)
    print(f"{'context':>8} {'policy':<18} {'budget':>8} " + " ".join(f"{name:>{width}}" for name, width in columns))
    for r in rows:
        ratio = f"{r['ratio_to_full']:.2f}" if r["ratio_to_full"] else "-"
        print(
            f"{r['context']:>8} {_policy_label(r):<18} {_budget_label(r):>8} {r['ms_per_step']:>9.1f} "
            f"{r['tokens_per_second']:>8.1f} {ratio:>7} {r['floor_ms_per_step']:>9.1f} {r['efficiency']:>6.2f} "
            f"{r['kv_bytes'] / 2**20:>8.1f} {r['peak_rss_bytes'] / 2**20:>8.0f}"
        )
    print("\nwhere a decode step goes (mean ms): speculate / fetch not hidden by overlap / attend / rest")
    for r in rows:
        p = r["profile_ms"]
        print(
            f"{r['context']:>8} {_policy_label(r):<18} {p.get('speculate', 0):>9.2f} {p.get('fetch', 0):>9.2f} "
            f"{p.get('attend', 0):>9.2f} {p['rest']:>9.2f}"
        )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .bench import plan as planner

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
    for name, given, default in (
        ("infinigen", args.fetch_fraction, planner.DEFAULT_FETCH),
        ("h2o", args.h2o_budget, planner.DEFAULT_H2O),
    ):
        fractions[name] = (given, "given") if given is not None else measured.get(name, (default, "default"))
    rows = planner.plan(
        shape,
        gpu,
        args.host_memory,
        args.batch,
        args.context,
        fetch=fractions["infinigen"][0],
        h2o=fractions["h2o"][0],
        kv_on_host=args.kv_on_host,
    )
    if args.json:
        result = {
            "projection": True,
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
        + ", ".join(
            f"{k} {'fetch' if k == 'infinigen' else 'keep'} {v:.3f} ({src})" for k, (v, src) in fractions.items()
        )
    )
    print(
        f"{'policy':<10} {'tok/s':>8} {'bound by':<11} {'K/V on':<6} {'GPU GB':>7} {'host GB':>8} {'PCIe GB/step':>13}"
    )
    for r in rows:
        speed = f"{r['tokens_per_second']:.2f}" if r["fits"] else "no fit"
        print(
            f"{r['policy']:<10} {speed:>8} {r['bound']:<11} {'GPU' if r['kv_on_gpu'] else 'host':<6} "
            f"{r['gpu_bytes'] / 1e9:>7.1f} {r['host_bytes'] / 1e9:>8.1f} {r['link_bytes_per_step'] / 1e9:>13.2f}"
        )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .bench.plan import read_rows
    from .bench.report import latest, write_report

    results = home() / "results"
    speed = Path(args.speed) if args.speed else latest(results, "speed")
    quality = Path(args.quality) if args.quality else latest(results, "quality")
    if speed is None and quality is None:
        raise InfinikvError(
            f"no bench results in {results}: run infinikv bench speed / bench quality, or give --speed/--quality"
        )
    sources = [p for p in (speed, quality) if p is not None]
    out_dir = Path(args.out_dir) / time.strftime("%Y%m%d-%H%M%S")
    report = write_report(read_rows(speed) if speed else [], read_rows(quality) if quality else [], out_dir, sources)
    print(report)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from .policies.infinigen import prepare

    model, tokenizer = models.load_model(args.model)
    path = prepare(model, tokenizer, args.calibration, args.tokens, progress=not args.quiet)
    print(path)
    return 0


def cmd_eval_recall(args: argparse.Namespace) -> int:
    from .eval.ppl import context_tokens
    from .eval.recall import speculation_recall
    from .policies.infinigen import load_prep

    make_policy(
        "infinigen",
        alpha=args.alpha,
        partial_ratio=args.partial_ratio,
        max_fetch=args.max_fetch,
        dense_layers=args.dense_layers,
    )  # the same checks as the policy's
    text = data.load_text(args.text, from_chapter_one=True)
    model, tokenizer = models.load_model(args.model)
    prep = load_prep(model)
    _warn_same_text(prep, args.text)
    ids = context_tokens(tokenizer, text, args.context, args.steps)[:, : args.context + args.steps]
    result = speculation_recall(
        model,
        ids,
        prep,
        args.context,
        args.alpha,
        args.partial_ratio,
        args.max_fetch,
        args.dense_layers,
        progress=not args.quiet,
    )
    result["text"] = args.text
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"speculation recall, {args.text} at {args.context} tokens, {args.steps} decode steps "
        f"(alpha {args.alpha:g}, partial ratio {args.partial_ratio:g}, cap {args.max_fetch:g})"
    )
    print(f"{'method':<9} {'recall':>7} {'fetched':>8}")
    for name, m in result["methods"].items():
        print(f"{name:<9} {m['recall']:>7.3f} {100 * m['fetched_fraction']:>7.1f}%")
    return 0


def _check_calibration(policies: list[Policy], model, text: str) -> None:
    """Prepare infinigen up front (not mid-grid) and warn if it was calibrated on ``text``."""
    if any(p.name == "infinigen" for p in policies):
        from .policies.infinigen import load_prep

        _warn_same_text(load_prep(model), text)


def _warn_same_text(prep: dict, text: str) -> None:
    if prep.get("calibration") == text:
        print(f"infinikv: warning: infinigen was calibrated on {text}, the text being evaluated", file=sys.stderr)


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_models_build(args: argparse.Namespace) -> int:
    model, tokenizer = models.load_model(args.name, kv_capacity=args.capacity, update_rule=args.update_rule)
    out = models.save_model(model, tokenizer, Path(args.out))
    print(f"{out}: generate() uses {models.default_policy_spec(model)}")
    return 0


def _serve_policy(args: argparse.Namespace) -> dict[str, Any] | None:
    """The server's default ``kv`` spec from --policy, --budget/--capacity and policy options
    (None without --policy: the model's own policy then, else full)."""
    given = {o.name: getattr(args, o.name) for o in _serve_options() if getattr(args, o.name) is not None}
    if args.policy is None and (given or args.budget is not None or args.capacity is not None):
        raise InfinikvError(f"{(list(given) or ['--budget/--capacity'])[0]} needs --policy")
    if args.policy is None:
        return None
    spec = {"policy": args.policy, "budget": args.budget, "capacity": args.capacity, **given}
    policy_from_spec({k: v for k, v in spec.items() if v is not None})  # refuse a bad policy before loading
    return {k: v for k, v in spec.items() if v is not None}


def _serve_options() -> list:
    """Policy options for serve; bct's --kv-memory is the server's whole K/V budget there."""
    return [o for o in _policy_options().values() if o.name != "kv_memory"]


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=models.DEFAULT_MODEL, help="bundled name, HF folder or .gguf file")
    p.add_argument("--kv-memory", default="1GiB", help="K/V bytes all running requests may reserve (default 1GiB)")
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait for K/V budget (default 16)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    group = p.add_argument_group("default KV policy (a request's kv field overrides it)")
    group.add_argument("--policy", default=None, help=f"one of {', '.join(policy_names())} (default full)")
    group.add_argument("--budget", type=float, default=None, help="tokens kept, as a fraction of the tokens seen")
    group.add_argument("--capacity", type=int, default=None, help="tokens kept per layer (instead of --budget)")
    for option in _serve_options():
        if option.type is bool:
            group.add_argument(option.flag, dest=option.name, action="store_const", const=True, help=option.help)
        else:
            group.add_argument(option.flag, dest=option.name, help=f"{option.help} (default {option.default})")


def cmd_serve(args: argparse.Namespace) -> int:
    import socket

    import uvicorn

    from .policies.bct import parse_bytes
    from .serve.app import create_app

    kv_memory, spec = parse_bytes(args.kv_memory), _serve_policy(args)
    if args.max_queue < 0 or not 0 < args.port < 65536 or (args.threads is not None and args.threads < 1):
        raise InfinikvError("--max-queue must be >= 0, --port in 1..65535 and --threads at least 1")
    with socket.socket() as probe:
        try:
            probe.bind((args.host, args.port))
        except OSError as exc:
            raise InfinikvError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = models.load_model(args.model)
    spec = spec or models.default_policy_spec(model) or {"policy": "full"}
    app = create_app(model, tokenizer, args.model, spec, kv_memory, args.max_queue, args.api_key)
    print(
        f"infinikv: serving {args.model} on http://{args.host}:{args.port}/v1 (default kv {json.dumps(spec)}, "
        f"--kv-memory {_mib(kv_memory)})",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from .policies.bct import parse_bytes
    from .serve.bench import bench_serve

    kv_memory, spec = parse_bytes(args.kv_memory), _serve_policy(args)
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1 or args.duration <= 0:
        raise InfinikvError("--clients, --requests and --max-tokens must be at least 1, --duration positive")
    serve_args = ["--kv-memory", args.kv_memory, "--max-queue", str(args.max_queue)]
    serve_args += ["--threads", str(args.threads)] if args.threads else []
    for key, value in (spec or {}).items():
        serve_args += [f"--{key.replace('_', '-')}", str(value)]
    r = bench_serve(args.model, serve_args, kv_memory, args.clients, args.requests, args.max_tokens, args.duration)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(
            f"{r['clients']} clients, {r['completed']}/{r['requests']} requests completed in {r['seconds']} s "
            f"({r['errors']} errors, {r['unfinished']} unfinished)\n"
            f"requests/s {r['requests_per_second']}, tokens/s {r['tokens_per_second']}\n"
            f"time to first token p50 {r['ttft_p50_ms']} ms, p99 {r['ttft_p99_ms']} ms\n"
            f"inter-token latency p50 {r['itl_p50_ms']} ms, p99 {r['itl_p99_ms']} ms\n"
            f"peak server RSS {_mib(r['peak_rss_bytes'])} vs --kv-memory {_mib(kv_memory)} + model "
            f"{_mib(r['model_bytes'])}: {'ok' if r['rss_within_budget'] else 'OVER'}"
        )
        for message in r["error_messages"]:
            print(f"  error: {message}", file=sys.stderr)
    if not r["rss_within_budget"]:
        print("infinikv: the server's RSS went over --kv-memory + the model size", file=sys.stderr)
        return 1
    return 0 if r["errors"] == 0 else 1


def add_run_arguments(parser: argparse.ArgumentParser, json_help: str, results: bool = True) -> None:
    """The arguments every evaluation shares: model, JSON output, results file, progress bar."""
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="bundled name, HF folder or .gguf file")
    parser.add_argument("--json", action="store_true", help=json_help)
    if results:
        parser.add_argument("--out", help="JSON-lines file that receives each result as it finishes")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


GRID_JSON = "print a JSON list, one object per (policy, budget)"


def build_parser() -> Parser:
    parser = Parser(prog="infinikv", description="Long-text LLM generation under a fixed KV-cache budget.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("generate", help="generate text under a KV policy, streaming it")
    p.add_argument("--model", default=models.DEFAULT_MODEL, help="bundled name, HF folder or .gguf file")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="the prompt text (default: stdin if piped, else a demo prompt)")
    source.add_argument("--prompt-file", help="a file holding one prompt (newlines included)")
    source.add_argument("--prompts-file", help="a JSONL file, one JSON string per line, run as one batch")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON result object instead of streaming")
    add_policy_arguments(p)
    p.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="quality evaluations").add_subparsers(
        dest="eval", required=True, parser_class=Parser
    )
    p = ev.add_parser("ppl", help="P-ctx: perplexity of a continuation after a compressed context")
    add_run_arguments(p, GRID_JSON)
    p.add_argument("--text", default="austen:emma", help="text name or .txt path (default austen:emma)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--continuation", type=int, default=512)
    add_policy_arguments(p, grid=True)
    p.set_defaults(func=cmd_eval_ppl)

    p = ev.add_parser("needle", help="P-needle: pass-key retrieval at depths 10..90%")
    add_run_arguments(p, GRID_JSON)
    p.add_argument("--text", default="austen:prideprejudice", help="haystack text (default austen:prideprejudice)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--needles", type=int, default=12)
    p.add_argument("--seed", type=int, default=0, help="seed of the pass keys")
    add_policy_arguments(p, grid=True)
    p.set_defaults(func=cmd_eval_needle)

    p = ev.add_parser("stream", help="P-stream: perplexity per window over a long stream, memory over time")
    add_run_arguments(p, GRID_JSON)
    p.add_argument("--text", default="austen:all")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=32, help="tokens fed per forward (default 32)")
    p.add_argument("--window", type=int, default=1024, help="tokens per perplexity window")
    p.add_argument("--plot", help="write a PNG of perplexity and RSS over the stream")
    add_policy_arguments(p, grid=True)
    p.set_defaults(func=cmd_eval_stream)

    p = ev.add_parser("recall", help="InfiniGen speculation recall of the true attention, by method")
    add_run_arguments(p, "print one JSON object", results=False)
    p.add_argument("--text", default="austen:emma")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=32, help="decode steps measured")
    p.add_argument("--alpha", type=float, default=4.0)
    p.add_argument("--partial-ratio", type=float, default=0.3)
    p.add_argument("--max-fetch", type=float, default=0.2)
    p.add_argument("--dense-layers", type=int, default=2)
    p.set_defaults(func=cmd_eval_recall)

    p = sub.add_parser("prepare", help="calibrate InfiniGen's partial weights for a model (saved next to it)")
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--calibration", default="austen:persuasion", help="calibration text (not an evaluation text)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_prepare)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True, parser_class=Parser)
    p = bench.add_parser("quality", help="P-ctx perplexity vs budget and the P-needle grid, every policy")
    p.add_argument("--model", default=models.DEFAULT_MODEL, help="bundled name, HF folder or .gguf file")
    p.add_argument("--text", default="austen:emma", help="P-ctx text (default austen:emma)")
    p.add_argument("--context", type=int, default=4096, help="P-ctx context tokens")
    p.add_argument("--continuation", type=int, default=512, help="P-ctx tokens scored")
    p.add_argument("--needle-text", default="austen:prideprejudice", help="P-needle haystack")
    p.add_argument("--needle-context", type=int, default=4096)
    p.add_argument("--needles", type=int, default=12, help="pass keys at depths 10..90%% (0 skips P-needle)")
    p.add_argument("--seed", type=int, default=0, help="seed of the pass keys")
    p.add_argument("--json", help="write every result (P-ctx and P-needle rows) to this JSON file")
    p.add_argument("--out", help="JSON-lines file that receives each result as it finishes")
    p.add_argument("--plot-dir", help="write quality-ppl.png (curves) and quality-needle.png (heatmap) here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_policy_arguments(p, grid=True, every_policy=True)
    p.set_defaults(func=cmd_bench_quality, budgets="0.05,0.1,0.2,0.5")

    p = bench.add_parser("speed", help="median ms per decode step by context, policies interleaved")
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--text", default="austen:all")
    p.add_argument("--contexts", default="1024,4096", help="comma-separated context lengths")
    p.add_argument("--steps", type=int, default=24, help="timed decode steps per cell")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="tokens per prefill forward (memory at 32k)")
    p.add_argument("--json", help="write the results to this JSON file (updated as cells finish)")
    p.add_argument("--out", help="JSON-lines file that receives each result as it finishes")
    p.add_argument("--plot", help="write a PNG of ms per step (and its floor) and the ratio to full by context")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_policy_arguments(p, grid=True)
    p.set_defaults(func=cmd_bench_speed)

    p = sub.add_parser("report", help="one Markdown report with plots from the latest bench speed and quality JSON")
    p.add_argument("--speed", help="bench speed results (default: the latest in $INFINIKV_HOME/results)")
    p.add_argument("--quality", help="bench quality results (default: the latest in $INFINIKV_HOME/results)")
    p.add_argument("--out-dir", default="reports", help="reports go to OUT_DIR/<time>/ (default reports, git-ignored)")
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
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with per-request KV policies")
    _add_serve_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer API_KEY on every call")
    p.set_defaults(func=cmd_serve)

    p = bench.add_parser("serve", help="start a server and measure N concurrent streaming clients on loopback")
    _add_serve_arguments(p)
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
    p.add_argument("--requests", type=int, default=64, help="requests in all, then stop (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request (default 32)")
    p.add_argument("--duration", type=float, default=300, help="stop after this many seconds (default 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_serve)

    for name, fn, fetch_help in [
        ("models", cmd_models, "install and convert the bundled model"),
        ("data", cmd_data, "download the Austen novels and the Jargon File"),
    ]:
        group = sub.add_parser(name, help=f"{name} available offline").add_subparsers(
            dest="action", required=True, parser_class=Parser
        )
        f = group.add_parser("fetch", help=fetch_help)
        f.add_argument("--force", action="store_true", help="fetch again even if present")
        if name == "models":
            f.add_argument("name", nargs="?", default=models.DEFAULT_MODEL)
        if name == "models":
            b = group.add_parser("build", help="save a model built with a fixed KV capacity (bct by default)")
            b.add_argument("name", help="bundled name, HF folder or .gguf file")
            b.add_argument("--capacity", type=int, required=True, help="KV tokens per layer")
            b.add_argument("--update-rule", default=None, help="bct update rule (default heavy-hitter)")
            b.add_argument("--out", required=True, help="folder to write")
            b.set_defaults(func=cmd_models_build)
        lst = group.add_parser("list", help=f"list {name}")
        lst.add_argument("--json", action="store_true")
        for q in (f, lst):
            q.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except InfinikvError as exc:
        print(f"infinikv: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("infinikv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
