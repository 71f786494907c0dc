"""``infinikv eval``: P-ctx perplexity, P-needle pass keys, RULER, follow-up questions, P-stream windows,
attention recall."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import data
from ..errors import InfinikvError
from ..eval.ruler import TASKS as RULER_TASKS
from ..grid import Cell
from ..results import budget_text, needle_found, summary
from .arguments import GRID_JSON, add_compile_argument, add_policy_arguments, add_ray_arguments, add_run_arguments
from .common import counts, grid, load, needle_table, policy_cells, ppl_table, prepare, results_file, run_cells


def cmd_ppl(args: argparse.Namespace) -> int:
    from ..eval.ppl import context_tokens

    policies = grid(args)
    text = data.load_text(args.text, from_chapter_one=True)
    model, tokenizer = load(args)
    context_tokens(tokenizer, text, args.context, args.continuation)  # a text too short fails before any cell
    prepare(policies, model, tokenizer, args.text, not args.quiet)
    out = results_file(args, "ppl")
    what = f"{args.context} + {args.continuation} tokens, {args.weights} weights"
    print(f"P-ctx on {args.text}: {what}; results -> {out}", file=sys.stderr)
    params = {"text": args.text, "context": args.context, "continuation": args.continuation}
    cells = policy_cells(args, "P-ctx", policies, params, {"compile": args.compile})
    rows = run_cells(args, cells, out, model, tokenizer)
    print(json.dumps(rows, indent=2) if args.json else ppl_table(rows))
    return 0


def cmd_needle(args: argparse.Namespace) -> int:
    from ..eval.needle import needle_cases

    policies = grid(args)
    text = data.load_text(args.text, from_chapter_one=True)
    model, tokenizer = load(args)
    needle_cases(tokenizer, text, args.context, args.needles, args.seed)  # fits, before any cell
    prepare(policies, model, tokenizer, args.text, not args.quiet)
    out = results_file(args, "needle")
    print(
        f"P-needle: {args.needles} pass keys in {args.context} tokens of {args.text}; results -> {out}", file=sys.stderr
    )
    params = {"text": args.text, "context": args.context, "needles": args.needles, "seed": args.seed}
    rows = run_cells(args, policy_cells(args, "P-needle", policies, params), out, model, tokenizer)
    print(json.dumps(rows, indent=2) if args.json else f"{needle_table(rows)}\n\n{needle_found(rows)}".rstrip())
    return 0


def cmd_ruler(args: argparse.Namespace) -> int:
    from ..bench.plots import ruler_heatmap
    from ..eval import ruler

    policies = grid(args)
    tasks = ruler.task_names(args.tasks)
    lengths = sorted(set(counts(args.lengths, "--lengths")))
    if args.samples < 1 or args.batch_size < 1:
        raise InfinikvError("--samples and --batch-size must be at least 1")
    needs_text = any(ruler.TASKS[t].haystack == "text" for t in tasks)
    text = data.load_text(args.text, from_chapter_one=True) if needs_text else None
    model, tokenizer = load(args)
    trained = getattr(model.config, "max_position_embeddings", None)
    for task in tasks:  # every task must fit every length before any cell runs
        for length in lengths:
            ruler.generate(task, tokenizer, text, length, 1, args.seed, max_context=trained)
    prepare(policies, model, tokenizer, args.text if needs_text else None, not args.quiet)
    out = results_file(args, "ruler")
    print(
        f"RULER: {len(tasks)} tasks x {len(lengths)} lengths x {len(policies)} policies, {args.samples} samples "
        f"per cell; results -> {out}",
        file=sys.stderr,
    )
    cells = [
        Cell(
            "RULER",
            args.model,
            policy.spec(),
            {"task": task, "length": length, "samples": args.samples, "seed": args.seed, "text": args.text},
            {"batch_size": args.batch_size},
            weights=args.weights,
        )
        for length in lengths
        for task in tasks
        for policy in policies
    ]
    rows = run_cells(args, cells, out, model, tokenizer)
    if args.heatmap:
        print(f"heatmap -> {ruler_heatmap(rows, Path(args.heatmap))}", file=sys.stderr)
    print(json.dumps(rows, indent=2) if args.json else f"{summary(rows)}\n\n{needle_found(rows)}".rstrip())
    return 0


def cmd_followup(args: argparse.Namespace) -> int:
    from ..eval.followup import conversations, question_rows

    policies = grid(args)
    lengths = sorted(set(counts(args.lengths, "--lengths")))
    if args.samples < 1 or args.batch_size < 1 or args.questions < 1:
        raise InfinikvError("--questions, --samples and --batch-size must be at least 1")
    text = data.load_text(args.text, from_chapter_one=True)
    model, tokenizer = load(args)
    for length in lengths:  # every length must hold its needles before any cell runs
        conversations(tokenizer, text, length, args.questions, 1, args.seed)
    prepare(policies, model, tokenizer, args.text, not args.quiet)
    out = results_file(args, "followup")
    print(
        f"follow-up: {args.questions} questions per document, {len(lengths)} lengths x {len(policies)} policies, "
        f"{args.samples} documents per cell; results -> {out}",
        file=sys.stderr,
    )
    params = {"questions": args.questions, "samples": args.samples, "seed": args.seed, "text": args.text}
    cells = [
        Cell("followup", args.model, p.spec(), {"length": n, **params}, {"batch_size": args.batch_size}, args.weights)
        for n in lengths
        for p in policies
    ]
    rows = [q for row in run_cells(args, cells, out, model, tokenizer) for q in question_rows(row)]
    print(json.dumps(rows, indent=2) if args.json else followup_table(rows))
    return 0


def followup_table(rows: list[dict]) -> str:
    """Accuracy x100 per question index, K/V held after the last answer, attended share."""
    questions = max(r["question"] for r in rows)
    lines = [
        f"{'length':>7} {'policy':<28} {'budget':>7} "
        + " ".join(f"{'q' + str(q):>6}" for q in range(1, questions + 1))
        + f" {'held MiB':>9} {'attended':>9}"
    ]
    cells: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        cells.setdefault((r["length"], r["label"], budget_text(r)), {})[r["question"]] = r
    for (length, label, budget), by_question in cells.items():
        last = by_question[max(by_question)]
        lines.append(
            f"{length:>7} {label:<28} {budget:>7} "
            + " ".join(f"{100 * by_question[q]['accuracy']:>6.1f}" for q in sorted(by_question))
            + f" {last['held_bytes'] / 2**20:>9.1f} {last['attended_fraction']:>9.1%}"
        )
    return "\n".join(lines)


def cmd_stream(args: argparse.Namespace) -> int:
    from ..eval.stream import plot, stream_tokens

    policies = grid(args)
    if args.tokens < 2 or args.chunk < 1 or args.window < 1:
        raise InfinikvError("--tokens must be at least 2, --chunk and --window at least 1")
    text = data.load_text(args.text)
    model, tokenizer = load(args)
    stream_tokens(tokenizer, text, args.tokens)  # long enough, before any cell
    prepare(policies, model, tokenizer, args.text, not args.quiet)
    out = results_file(args, "stream")
    print(f"P-stream: {args.tokens} tokens of {args.text} in chunks of {args.chunk}; results -> {out}", file=sys.stderr)
    params = {"text": args.text, "tokens": args.tokens, "chunk": args.chunk, "window": args.window}
    rows = run_cells(args, policy_cells(args, "P-stream", policies, params), out, model, tokenizer)
    if args.plot:
        trained = getattr(model.config, "max_position_embeddings", None)
        print(f"plot -> {plot(rows, Path(args.plot), trained)}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'window':>13} " + " ".join(f"{r['label'] + ' ' + budget_text(r):>24}" for r in rows))
    print(" " * 14 + " ".join(f"{'ppl':>9} {'RSS MiB':>8} {'peak KV MiB':>11}" for _ in rows))
    for i, window in enumerate(rows[0]["windows"]):
        cells = []
        for r in rows:
            w = r["windows"][i]
            cells.append(f"{w['perplexity']:>9.2f} {w['rss_bytes'] / 2**20:>8.0f} {w['peak_kv_bytes'] / 2**20:>11.1f}")
        print(f"{window['start']:>6}-{window['end']:<6} " + " ".join(cells))
    for r in rows:
        print(
            f"{r['label']}: ppl {r['perplexity']:.2f}, median window {r['median_window_perplexity']:.2f}, "
            f"worst {r['worst_window_perplexity']:.2f}, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB"
        )
    return 0


def cmd_recall(args: argparse.Namespace) -> int:
    from ..eval.ppl import context_tokens

    policies = grid(args)
    text = data.load_text(args.text, from_chapter_one=True)
    model, tokenizer = load(args)
    prepare(policies, model, tokenizer, args.text, not args.quiet)
    context_tokens(tokenizer, text, args.context, args.steps)  # long enough, before any cell
    out = results_file(args, "recall")
    print(f"recall on {args.text} at {args.context} tokens, {args.steps} decode steps -> {out}", file=sys.stderr)
    params = {"text": args.text, "context": args.context, "steps": args.steps}
    rows = run_cells(args, policy_cells(args, "recall", policies, params), out, model, tokenizer)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'policy':<18} {'budget':>8} {'recall':>7} {'oracle':>7} {'attended':>9}")
    for r in rows:
        print(
            f"{r['label']:<18} {budget_text(r):>8} {r['recall']:>7.3f} {r['oracle_recall']:>7.3f} "
            f"{100 * r['attended_fraction']:>8.1f}%"
        )
    return 0


def add(sub: argparse._SubParsersAction, parser_class: type) -> None:
    ev = sub.add_parser("eval", help="quality evaluations").add_subparsers(
        dest="eval", required=True, parser_class=parser_class
    )
    p = ev.add_parser("ppl", help="P-ctx: perplexity of a continuation after a compressed context")
    add_run_arguments(p, GRID_JSON)
    p.add_argument("--text", default="austen:emma", help="text name or .txt path (default austen:emma)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--continuation", type=int, default=512)
    add_compile_argument(p, default="off")
    add_policy_arguments(p, grid=True)
    add_ray_arguments(p)
    p.set_defaults(func=cmd_ppl)

    p = ev.add_parser("needle", help="P-needle: pass-key retrieval at depths 10..90%%")
    add_run_arguments(p, GRID_JSON)
    p.add_argument("--text", default="austen:prideprejudice", help="haystack text (default austen:prideprejudice)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--needles", type=int, default=12)
    p.add_argument("--seed", type=int, default=0, help="seed of the pass keys")
    add_policy_arguments(p, grid=True)
    add_ray_arguments(p)
    p.set_defaults(func=cmd_needle)

    p = ev.add_parser("ruler", help="RULER's synthetic long-context tasks (needles, variable tracking, word counts)")
    add_run_arguments(p, GRID_JSON)
    p.add_argument("--lengths", default="4096", help="comma-separated prompt lengths in tokens (default 4096)")
    p.add_argument("--tasks", default="all", help=f"comma-separated tasks or all ({', '.join(RULER_TASKS)})")
    p.add_argument("--samples", type=int, default=20, help="samples per task and length (default 20)")
    p.add_argument("--text", default="austen:emma", help="haystack text of the niah tasks that hide needles in text")
    p.add_argument("--seed", type=int, default=0, help="seed of the keys, values and word lists")
    p.add_argument("--batch-size", type=int, default=4, help="prompts decoded together (default 4)")
    p.add_argument("--heatmap", help="write a PNG of accuracy by task and policy, one panel per length")
    add_policy_arguments(p, grid=True)
    add_ray_arguments(p)
    p.set_defaults(func=cmd_ruler)

    p = ev.add_parser("followup", help="several questions about one document, asked in turn through one cache")
    add_run_arguments(p, GRID_JSON)
    p.add_argument("--lengths", default="2048", help="comma-separated document lengths in tokens (default 2048)")
    p.add_argument("--questions", type=int, default=3, help="questions per document, each about its own needle")
    p.add_argument("--samples", type=int, default=10, help="documents per length and policy (default 10)")
    p.add_argument("--text", default="austen:emma", help="the text the needles are hidden in")
    p.add_argument("--seed", type=int, default=0, help="seed of the keys, values and depths")
    p.add_argument("--batch-size", type=int, default=4, help="conversations decoded together (default 4)")
    add_policy_arguments(p, grid=True)
    add_ray_arguments(p)
    p.set_defaults(func=cmd_followup)

    p = ev.add_parser("stream", help="P-stream: perplexity per window over a long stream, memory over time")
    add_run_arguments(p, GRID_JSON)
    p.add_argument("--text", default="austen:all")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=32, help="tokens fed per forward (default 32)")
    p.add_argument("--window", type=int, default=1024, help="tokens per perplexity window")
    p.add_argument("--plot", help="write a PNG of perplexity and RSS over the stream")
    add_policy_arguments(p, grid=True)
    add_ray_arguments(p)
    p.set_defaults(func=cmd_stream)

    p = ev.add_parser("recall", help="share of the true attention the tokens a policy attends to capture")
    add_run_arguments(p, GRID_JSON)
    p.add_argument("--text", default="austen:emma")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=32, help="decode steps measured")
    add_policy_arguments(p, grid=True)
    add_ray_arguments(p)
    p.set_defaults(func=cmd_recall)
