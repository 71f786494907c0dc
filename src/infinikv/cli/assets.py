"""``infinikv models``, ``infinikv data`` and ``infinikv prepare``: what runs offline, set up once."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import data, models
from ..contract import Preparing
from ..errors import InfinikvError
from ..policies import REGISTRY, make_policy, parse_spec, policy_class
from ..preparation import ensure_prepared
from .arguments import add_model_argument, add_policy_arguments
from .common import load, single_policy, split_policies


def cmd_models(args: argparse.Namespace) -> int:
    if args.action == "fetch":
        print(models.fetch(args.name, force=args.force))
        return 0
    rows = models.list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            state = "ready" if row["fetched"] else f"not fetched (infinikv models fetch {row['name']})"
            print(f"{row['name']:<20} {state:<48} {row['path']}")
    return 0


def cmd_models_build(args: argparse.Namespace) -> int:
    spec = single_policy(args)
    if spec is None:
        raise InfinikvError("models build needs --policy (and its budget), e.g. --policy bct --capacity 1024")
    model, tokenizer = models.load_model(args.name, weights="fp32")  # saved as loaded, not packed
    models.set_default_policy(model, parse_spec(spec))
    out = models.save_model(model, tokenizer, Path(args.out))
    print(f"{out}: generate() uses {models.own_policy_spec(model)}")
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


def cmd_prepare(args: argparse.Namespace) -> int:
    asked = split_policies(args.policy) if args.policy else []
    if len(asked) > 1:
        raise InfinikvError("--policy takes one policy, e.g. infinigen or 'infinigen[partial_ratio=0.3]'")
    if args.compile:
        return prepare_compiled(args, asked)
    cells = asked or [(n, {}) for n, cls in sorted(REGISTRY.items()) if cls.needs_preparation]
    # built before the model loads, so a bad option is refused at once
    policies = {name: None if policy_class(name).takes_budget else make_policy(name, **own) for name, own in cells}
    model, tokenizer = load(args)
    for name, policy in policies.items():
        if policy is None or not policy.needs_preparation:
            print(f"{name}: nothing to prepare")
            continue
        note = ensure_prepared(policy, model, tokenizer, Preparing(args.calibration, args.tokens, True, not args.quiet))
        print(note)
    return 0


def prepare_compiled(args: argparse.Namespace, asked: list[tuple[str, dict]]) -> int:
    """Build (or find) the compiled decode step of ``--policy`` (default: the model's default
    policy) for one row, so that every later run with ``--compile auto`` loads it."""
    import torch

    from ..compiled import built
    from ..core import Batch

    policy = parse_spec({"policy": asked[0][0], **asked[0][1]}) if asked else None
    if policy is not None and not policy.compilable:
        raise InfinikvError(f"{policy.label()} cannot be compiled (its cache shapes change as it runs)")
    model, tokenizer = load(args)
    policy = policy or parse_spec(models.default_policy_spec(model))
    ensure_prepared(policy, model, tokenizer, Preparing(progress=not args.quiet))
    if built(model, policy):
        print(f"{policy.label()}: compiled step already built")
        return 0
    ids = tokenizer("The compiled step is traced on a short prompt.").input_ids
    with torch.inference_mode():
        batch = Batch(model, policy, compile=True, max_length=len(ids) + 2)
        batch.prefill([ids], tokenizer.pad_token_id)
        batch.step(torch.tensor([ids[-1]]))
    print(f"{policy.label()}: compiled step built in {batch.compile_seconds:.1f} s")
    return 0


def add(sub: argparse._SubParsersAction, parser_class: type) -> None:
    p = sub.add_parser(
        "prepare", help="run the calibration of the policies that need one, or (--compile) build a compiled step"
    )
    add_model_argument(p)
    p.add_argument(
        "--policy",
        default=None,
        help="prepare this policy only, with its options as in --policies, e.g. 'infinigen[partial_ratio=0.3]' "
        "(default: every policy that needs it, with its defaults)",
    )
    p.add_argument("--calibration", default=None, help="calibration text (not an evaluation text; default per policy)")
    p.add_argument("--tokens", type=int, default=None, help="calibration tokens (default per policy)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="build the compiled decode step of --policy (default: the model's default policy) instead, once "
        "per machine: later runs with --compile auto load it in seconds",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_prepare)

    for name, fn, fetch_help in [
        ("models", cmd_models, "install and convert a bundled model"),
        ("data", cmd_data, "download the Austen novels and the Jargon File"),
    ]:
        group = sub.add_parser(name, help=f"{name} available offline").add_subparsers(
            dest="action", required=True, parser_class=parser_class
        )
        f = group.add_parser("fetch", help=fetch_help)
        f.add_argument("--force", action="store_true", help="fetch again even if present")
        if name == "models":
            f.add_argument("name", nargs="?", default=models.DEFAULT_MODEL)
            b = group.add_parser("build", help="save a model whose generate() uses a KV policy (e.g. bct)")
            b.add_argument("name", help="bundled name, HF folder or .gguf file")
            b.add_argument("--out", required=True, help="folder to write")
            add_policy_arguments(b)
            b.set_defaults(func=cmd_models_build)
        lst = group.add_parser("list", help=f"list {name}")
        lst.add_argument("--json", action="store_true")
        for q in (f, lst):
            q.set_defaults(func=fn)
