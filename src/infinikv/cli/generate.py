"""``infinikv generate``: text under a KV policy, streamed, or one JSON result."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import memory, models
from ..errors import InfinikvError
from ..policies import parse_spec
from ..weights import weights_format
from .arguments import add_compile_argument, add_model_argument, add_policy_arguments
from .common import load, mib, prepare, single_policy

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def read_prompts(args: argparse.Namespace) -> list[str] | str:
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


def run(args: argparse.Namespace) -> int:
    from ..core import Sampling
    from ..engine import generate

    spec = single_policy(args)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    prompts = read_prompts(args)
    if any(not p.strip() for p in ([prompts] if isinstance(prompts, str) else prompts)):
        raise InfinikvError("the prompt is empty")
    model, tokenizer = load(args)
    policy = parse_spec(spec or models.default_policy_spec(model))
    prepare([policy], model, tokenizer)
    loaded = memory.mark_peak()  # what the prompt and the generation cost comes on top of this
    stream = not args.json and isinstance(prompts, str)

    def show(_row: int, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = generate(
        model,
        tokenizer,
        prompts,
        policy,
        sampling,
        chat=args.chat,
        on_text=show if stream else None,
        compile=args.compile,
    )
    above = memory.peak() - loaded
    if args.json:
        memory_use = {"loaded_rss_bytes": loaded, "peak_rss_above_loaded_bytes": above}
        print(json.dumps({**result.to_json(), **memory_use}, indent=2))
        return 0
    if stream:
        print()
    else:
        for i, text in enumerate(result.texts):
            print(f"--- [{i}] {text}")
    how = f"compiled, ready in {result.compile_seconds:.1f} s" if result.compiled else "eager"
    print(
        f"[{policy.label()}, {weights_format(model)} weights] {result.new_tokens} tokens in {result.seconds:.2f} s "
        f"({result.tokens_per_second:.1f} tok/s decode, {how}), KV held {mib(result.kv_bytes)}, "
        f"attended {100 * result.attended_fraction:.1f}% of tokens, peak RSS {mib(above)} above the loaded model",
        file=sys.stderr,
    )
    if args.compile == "auto" and not result.compiled and policy.compilable:
        print(f"infinikv: {compile_hint(args)}", file=sys.stderr)
    return 0


def compile_hint(args: argparse.Namespace) -> str:
    """How to get the compiled step that ``--compile auto`` did not find."""
    flags = " ".join(
        f"{flag} {value}" for flag, value in (("--model", args.model), ("--weights", args.weights)) if value
    )
    return f"decoded eagerly: `infinikv prepare --compile {flags}` builds the compiled step once (about a minute)"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text under a KV policy, streaming it")
    add_model_argument(p)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="the prompt text (default: stdin if piped, else a demo prompt)")
    source.add_argument("--prompt-file", help="a file holding one prompt (newlines included)")
    source.add_argument("--prompts-file", help="a JSONL file, one JSON string per line, run as one batch")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    add_compile_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON result object instead of streaming")
    add_policy_arguments(p)
    p.set_defaults(func=run)
