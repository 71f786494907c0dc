"""What the commands share as they run: policy specs and grids from the flags (declared in
``arguments``), preparation, results files, Ray's checks, the model's loading and tables."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

from .. import models
from ..contract import Preparing
from ..errors import InfinikvError
from ..grid import METRICS, Cell, LocalPool, Worker, run_grid
from ..grid import append_row as append_row  # the results files of every command
from ..paths import home
from ..policies import Policy, parse_spec, policy_class
from ..preparation import ensure_prepared
from ..results import budget_text, reference


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The policy options set on the command line (as strings; the policy parses them)."""
    return {name: getattr(args, name) for name in args.policy_options if getattr(args, name, None) is not None}


def split_policies(text: str) -> list[tuple[str, dict[str, str]]]:
    """``"full,bct[positions=original,update_rule=tova]"`` -> names with their own options."""
    out, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            item = text[start:i].strip()
            start = i + 1
            if not item:
                continue
            name, _, rest = item.partition("[")
            if rest and not rest.endswith("]"):
                raise InfinikvError(f"--policies: {item!r} is not NAME or NAME[option=value,...]")
            options = {}
            for pair in filter(None, (p.strip() for p in rest[:-1].split(","))):
                key, eq, value = pair.partition("=")
                if not eq:
                    raise InfinikvError(f"--policies: {pair!r} in {item!r} is not option=value")
                options[key.strip().replace("-", "_")] = value.strip()
            out.append((name.strip(), options))
    return out


def specs(
    args: argparse.Namespace, names: list[str | tuple[str, dict[str, str]]], budgets: list[float | None]
) -> list[dict[str, Any]]:
    """One spec per (policy, budget) cell asked for; policies without a budget once. A name may
    come with options of its own (``split_policies``), which win over the flags."""
    given = given_options(args)
    cells = [(n, {}) if isinstance(n, str) else n for n in names]
    classes = [(policy_class(name), own) for name, own in cells]
    for option in given:
        if not any(option in {o.name for o in cls.all_options()} for cls, _ in classes):
            raise InfinikvError(
                f"--{option.replace('_', '-')} does not apply to policy {', '.join(c for c, _ in cells)}"
            )
    out = []
    for cls, own in classes:
        options = {**{k: v for k, v in given.items() if k in {o.name for o in cls.all_options()}}, **own}
        if not cls.takes_budget:
            out.append({"policy": cls.name, **options})
            continue
        for budget in budgets if args.capacity is None else [None]:
            out.append({"policy": cls.name, "budget": budget, "capacity": args.capacity, **options})
    return out


def floats(text: str | None, flag: str) -> list[float | None]:
    if text is None:
        return [None]
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InfinikvError(f"{flag} expects comma-separated numbers, got {text!r}") from None


def counts(text: str, flag: str) -> list[int]:
    """Comma-separated positive whole numbers (token counts), e.g. ``--lengths 2048,4096``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InfinikvError(f"{flag} expects comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise InfinikvError(f"{flag} expects positive token counts, got {text!r}")
    return values


def grid(args: argparse.Namespace) -> list[Policy]:
    check_ray_flags(args)
    names = split_policies(args.policies)
    return [parse_spec(spec) for spec in specs(args, names, floats(args.budgets, "--budgets"))]


def single_policy(args: argparse.Namespace) -> dict[str, Any] | None:
    """The spec of ``--policy`` and its flags, or None without ``--policy`` (the model's own)."""
    given = given_options(args)
    if args.policy is None:
        if given or args.budget is not None or args.capacity is not None:
            first = [f"--{k.replace('_', '-')}" for k in given] or ["--budget/--capacity"]
            raise InfinikvError(f"{first[0]} needs --policy")
        return None
    asked = split_policies(args.policy)
    if len(asked) != 1:
        raise InfinikvError(f"--policy takes one policy (NAME or NAME[option=value,...]), got {args.policy!r}")
    spec = specs(args, asked, [args.budget])[0]
    parse_spec(spec)  # refuse a bad policy before loading anything
    return {k: v for k, v in spec.items() if v is not None}


def prepare(policies: Iterable[Policy], model, tokenizer, text: str | None = None, progress: bool = True) -> None:
    """Run the preparation of the policies that need one (explicitly, before any cache is built),
    and warn when one was calibrated on the text about to be evaluated."""
    for policy in policies:
        note = ensure_prepared(policy, model, tokenizer, Preparing(progress=progress))
        if note:
            print(note, file=sys.stderr)
        if text is not None and policy.prepared_on() == text:
            print(
                f"infinikv: warning: {policy.label()} was calibrated on {text}, the text being evaluated",
                file=sys.stderr,
            )


def results_file(args: argparse.Namespace, kind: str) -> Path:
    out = Path(args.out) if args.out else home() / "results" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def check_ray_flags(args: argparse.Namespace, unit: str = "worker", serve: bool = False) -> None:
    """Refuse bad Ray flags (``--{unit}s``, ``--{unit}-cpus``, ``--{unit}-gpus`` without ``--ray``
    or out of range), and ``--ray`` without Ray installed, before anything loads."""
    if not hasattr(args, "ray"):
        return
    count, cpus, gpus = getattr(args, f"{unit}s"), getattr(args, f"{unit}_cpus"), getattr(args, f"{unit}_gpus")
    if args.ray is None:
        given = [flag for flag, value in ((f"--{unit}s", count), (f"--{unit}-gpus", gpus)) if value is not None]
        if given:
            raise InfinikvError(f"{given[0]} needs --ray")
        return
    if (count is not None and count < 1) or cpus <= 0 or (gpus or 0) < 0:
        raise InfinikvError(f"--{unit}s must be at least 1, --{unit}-cpus positive, --{unit}-gpus >= 0")
    from ..cluster import import_ray

    import_ray(args.ray, serve)


def run_cells(args: argparse.Namespace, cells: list[Cell], out: Path, model, tokenizer) -> list[dict]:
    """The grid's rows: here on the loaded model, or with ``--ray`` on a Ray cluster's workers."""

    def describe(row: dict) -> str:
        where = f"{row['task']} at {row['length']}: " if row["protocol"] == "RULER" else ""
        metric = METRICS[row["protocol"]]
        value = row[metric]
        shown = " ".join(f"{v:.4g}" for v in value) if isinstance(value, list) else f"{value:.4g}"
        return f"{where}{row['label']} budget={budget_text(row)} {metric}={shown}"

    if args.ray is None:
        worker = Worker(args.model, progress=not args.quiet, loaded=(model, tokenizer), weights=args.weights)
        return run_grid(cells, out, lambda: LocalPool(worker), describe, not args.quiet, args.limit_minutes)
    from ..cluster import RayPool, connect

    leave = connect(args.ray)
    try:
        pool = partial(RayPool, args.model, args.workers, args.worker_cpus, args.worker_gpus, args.weights)
        return run_grid(cells, out, pool, describe, not args.quiet, args.limit_minutes)
    finally:
        leave()


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def ppl_table(rows: list[dict]) -> str:
    full = reference(rows, "perplexity")
    lines = [f"{'policy':<18} {'budget':>8} {'ppl':>8} {'vs full':>8} {'attended':>9} {'KV held':>11} {'seconds':>8}"]
    for r in rows:
        delta = f"{100 * (r['perplexity'] / full - 1):+.1f}%" if full else "-"
        lines.append(
            f"{r['label']:<18} {budget_text(r):>8} {r['perplexity']:>8.3f} {delta:>8} "
            f"{100 * r['attended_fraction']:>8.1f}% {mib(r['kv_bytes']):>11} {r['seconds']:>8.1f}"
        )
    return "\n".join(lines)


def needle_table(rows: list[dict]) -> str:
    lines = [f"{'policy':<18} {'budget':>8} {'accuracy':>9}  depths hit"]
    for r in rows:
        hits = " ".join(f"{c['depth']:.2f}" if c["hit"] else "  -  " for c in r["cases"])
        lines.append(f"{r['label']:<18} {budget_text(r):>8} {r['accuracy']:>9.2f}  {hits}")
    return "\n".join(lines)


def policy_cells(
    args: argparse.Namespace, protocol: str, policies: list[Policy], params: dict, options: dict | None = None
) -> list[Cell]:
    """One cell of ``protocol`` per policy on ``--model`` stored as ``--weights``."""
    return [Cell(protocol, args.model, p.spec(), params, options or {}, weights=args.weights) for p in policies]


def load(args: argparse.Namespace, device: str = "cpu"):
    """``(model, tokenizer)`` of ``--model`` stored as ``--weights``; ``auto`` is resolved in
    ``args``, so result rows and cells name the format that ran."""
    args.weights = models.resolve_weights(args.model, args.weights, device)
    return models.load_model(args.model, device=device, weights=args.weights)


def store_options(args: argparse.Namespace) -> dict | None:
    """``--store``, ``--store-size`` and ``--store-kv`` as ``create_app``'s ``store``, or None."""
    from ..sizes import parse_bytes

    size = parse_bytes(args.store_size, "--store-size")
    if args.store is None:
        return None
    try:
        Path(args.store).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InfinikvError(f"--store {args.store}: {exc.strerror}") from None
    return {"directory": Path(args.store), "max_bytes": size, "kv": args.store_kv}


def api_keys(args: argparse.Namespace) -> dict[str, str] | None:
    """``--api-key`` or ``--api-keys FILE`` as key -> owner, or None."""
    from ..serve.keys import read_keys

    if args.api_key is not None:
        return {args.api_key: "default"}
    return None if args.api_keys is None else read_keys(Path(args.api_keys))
