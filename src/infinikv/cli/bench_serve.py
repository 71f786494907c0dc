"""``infinikv bench serve``: start ``infinikv serve`` (one process, its Ray Serve replicas, or one
server per policy) and measure concurrent streaming clients against it."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..cluster import LOCAL
from ..errors import InfinikvError
from ..policies import parse_spec
from .common import mib, single_policy, specs, split_policies
from .serve import add_serve_arguments, check


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from ..serve.app import DEFAULT_KV_MEMORY
    from ..sizes import parse_bytes

    kv_memory = parse_bytes(args.kv_memory) if args.kv_memory else DEFAULT_KV_MEMORY
    cells = bench_policies(args)
    check(args)
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1 or args.duration <= 0:
        raise InfinikvError("--clients, --requests and --max-tokens must be at least 1, --duration positive")
    if args.long_every < 0 or args.long_prompt < 0 or args.prompt_tokens < 0:
        raise InfinikvError("--long-every, --long-prompt and --prompt-tokens must be >= 0")
    if args.turns < 0 or args.turn_tokens < 1 or args.kill_after < 0:
        raise InfinikvError("--turns and --kill-after must be >= 0 and --turn-tokens at least 1")
    if args.kill_after and not args.turns:
        raise InfinikvError("--kill-after counts answered turns of conversations: give --turns")
    if args.turns and (args.ray is not None or len(cells) > 1):
        raise InfinikvError("--turns runs one policy on one server process; drop --ray and --policies")
    if args.policies is not None and args.ray is not None:
        raise InfinikvError("--policies starts one server process per policy; drop --ray")
    if args.json not in (None, "-") and not os.access(Path(args.json).resolve().parent, os.W_OK):
        raise InfinikvError(f"--json {args.json}: cannot write there")  # said now, not after the run
    serve_args = ["--max-queue", str(args.max_queue), "--prepare", args.prepare]
    serve_args += ["--kv-memory", args.kv_memory] if args.kv_memory else []
    serve_args += ["--memory", args.memory] if args.memory else []
    serve_args += ["--keep-conversations", str(args.keep_conversations), "--weights", args.weights]
    serve_args += ["--threads", str(args.threads)] if args.threads else []
    serve_args += ["--prefill-chunk", str(args.prefill_chunk), "--compile", args.compile]
    if args.store or args.kill_after:  # --kill-after without --store: a store of its own
        serve_args += ["--store-size", args.store_size, "--store-kv", args.store_kv]
        serve_args += ["--store", args.store] if args.store else []
    if args.turns:
        return bench_conversations(args, serve_args + policy_flag(cells[0]), kv_memory)
    if args.policies is not None:
        return bench_each_policy(args, serve_args, cells, kv_memory)
    serve_args += policy_flag(cells[0])
    ray_args = []
    if args.ray is not None:
        ray_args = ["--ray"] + ([] if args.ray == LOCAL else [args.ray]) + ["--replicas", str(args.replicas or 1)]
        ray_args += ["--replica-cpus", str(args.replica_cpus)]
        ray_args += ["--replica-gpus", str(args.replica_gpus)] if args.replica_gpus is not None else []
    runs = {}
    for name, more in [("one process", [])] + ([("Ray Serve", ray_args)] if ray_args else []):
        if ray_args:
            print(f"infinikv: bench serve: {name} ...", file=sys.stderr)
        runs[name] = measure(args, serve_args + more, kv_memory)
    if ray_args:
        single, ray = runs.values()
        overhead = None
        if single["idle_latency_p50_ms"] is not None and ray["idle_latency_p50_ms"] is not None:
            overhead = round(ray["idle_latency_p50_ms"] - single["idle_latency_p50_ms"], 1)
        result = {
            "one_process": single,
            "ray_serve": ray,
            "replicas": args.replicas or 1,
            "serve_overhead_ms": overhead,
        }
    else:
        result = runs["one process"]
    write_json(args.json, result)
    if args.json != "-" and ray_args:
        print(compare_table(runs, args.replicas or 1, result["serve_overhead_ms"], kv_memory))
    elif args.json != "-":
        print(summary(result, args))
    return verdict(list(runs.values()))


def bench_policies(args: argparse.Namespace) -> list[dict | None]:
    """The policy specs to measure, each on its own server: ``--policies``, else ``--policy``
    (None: the model's own)."""
    if args.policies is None:
        return [single_policy(args)]
    if args.policy is not None:
        raise InfinikvError("give --policy or --policies, not both")
    cells = specs(args, split_policies(args.policies), [args.budget])
    for spec in cells:
        parse_spec(spec)
    if not cells:
        raise InfinikvError("--policies names no policy")
    return cells


def policy_flag(spec: dict | None) -> list[str]:
    """``serve``'s ``--policy NAME[option=value,...]`` for ``spec`` (nothing for the model's own)."""
    if spec is None:
        return []
    options = ",".join(f"{k}={v}" for k, v in spec.items() if k != "policy" and v is not None)
    return ["--policy", f"{spec['policy']}[{options}]" if options else spec["policy"]]


def bench_each_policy(args: argparse.Namespace, serve_args: list[str], cells: list[dict], kv_memory: int) -> int:
    """Each policy against its own fresh server, one after another, the same load for each: a row
    per policy (written to ``--json`` as each finishes, so a stopped run keeps what it measured)."""
    rows = []
    for spec in cells:
        label = policy_flag(spec)[1]
        print(f"infinikv: bench serve: {label} ...", file=sys.stderr)
        rows.append({"policy": label, **measure(args, serve_args + policy_flag(spec), kv_memory)})
        write_json(args.json, rows)
    if args.json != "-":
        print(policies_table(rows, kv_memory))
    return verdict(rows)


def measure(args: argparse.Namespace, serve_args: list[str], kv_memory: int) -> dict:
    """One server started with ``serve_args`` under the load the flags ask for: its numbers."""
    from ..bench.serving import bench_serve

    load = (args.clients, args.requests, args.max_tokens, args.duration)
    extra = {"long_every": args.long_every, "long_prompt": args.long_prompt, "prompt_tokens": args.prompt_tokens}
    return bench_serve(args.model, serve_args, kv_memory, *load, **extra, memory=process_memory(args))


def process_memory(args: argparse.Namespace) -> int | None:
    """``--memory`` in bytes, or None."""
    from ..sizes import parse_bytes

    return parse_bytes(args.memory) if args.memory else None


def write_json(where: str | None, result: dict | list) -> None:
    """``--json``: ``-`` prints it, a path is (re)written; None does nothing."""
    if where == "-":
        print(json.dumps(result, indent=2))
    elif where:
        Path(where).write_text(json.dumps(result, indent=2) + "\n")


def verdict(runs: list[dict]) -> int:
    """Exit 1 when a server went over its memory or a request failed (each said on stderr)."""
    for r in runs:
        for message in r["error_messages"]:
            print(f"  error: {message}", file=sys.stderr)
    if not all(r["rss_within_budget"] for r in runs):
        print(f"infinikv: a server process's RSS went over {runs[0]['rss_limit']}", file=sys.stderr)
        return 1
    return 0 if all(r["errors"] == 0 for r in runs) else 1


def bench_conversations(args: argparse.Namespace, serve_args: list[str], kv_memory: int) -> int:
    """``--turns``: continued against fresh caches, or with ``--kill-after`` the load and fault run."""
    from ..bench.faults import bench_faults, faults_table
    from ..bench.turns import ChatLoad, bench_turns, turns_table

    load = ChatLoad(args.clients, args.turns, args.turn_tokens, args.max_tokens, args.prompt_tokens)
    if args.kill_after:
        faults = (args.kill_after, args.store)
        result = bench_faults(args.model, serve_args, kv_memory, load, *faults, memory=process_memory(args))
        table = faults_table
    else:
        result = bench_turns(args.model, serve_args, kv_memory, load, memory=process_memory(args))
        table = turns_table
    write_json(args.json, result)
    if args.json != "-":
        print(table(result))
    return verdict([result])


def summary(r: dict, args: argparse.Namespace) -> str:
    lines = [
        f"{r['clients']} clients, {r['completed']}/{r['requests']} requests completed in {r['seconds']} s "
        f"({r['errors']} errors, {r['unfinished']} unfinished)",
        f"requests/s {r['requests_per_second']}, tokens/s {r['aggregate_tokens_per_second']}",
        f"time to first token p50 {r['ttft_p50_ms']} ms, p99 {r['ttft_p99_ms']} ms",
        f"inter-token latency p50 {r['itl_p50_ms']} ms, p99 {r['itl_p99_ms']} ms",
        f"one-token request to the idle server: {r['idle_latency_p50_ms']} ms (median of 10)",
        f"peak server RSS {mib(r['peak_rss_bytes'])} vs {r['rss_limit']} {mib(r['rss_limit_bytes'])}: "
        f"{'ok' if r['rss_within_budget'] else 'OVER'}",
    ]
    if r.get("long_prompts"):
        lines.append(f"long prompts sent: {r['long_prompts']} ({args.long_prompt} tokens every {args.long_every:g} s)")
    return "\n".join(lines)


def compare_table(runs: dict[str, dict], replicas: int, overhead: float | None, kv_memory: int) -> str:
    """The single-process server and the Ray Serve replicas, measured in the same run, side by side."""
    rows = [
        ("completed / requests", lambda r: f"{r['completed']}/{r['requests']}"),
        ("errors (unfinished)", lambda r: f"{r['errors']} ({r['unfinished']})"),
        ("requests/s", lambda r: r["requests_per_second"]),
        ("tokens/s", lambda r: r["aggregate_tokens_per_second"]),
        ("TTFT p50 / p99 ms", lambda r: f"{r['ttft_p50_ms']} / {r['ttft_p99_ms']}"),
        ("ITL p50 / p99 ms", lambda r: f"{r['itl_p50_ms']} / {r['itl_p99_ms']}"),
        ("idle 1-token request ms", lambda r: r["idle_latency_p50_ms"]),
        ("peak RSS, largest process", lambda r: mib(r["peak_rss_bytes"])),
        ("peak RSS, all processes", lambda r: mib(r["peak_tree_rss_bytes"])),
    ]
    names = [n if n != "Ray Serve" else f"Ray Serve x{replicas}" for n in runs]
    lines = [f"{'':<26} " + " ".join(f"{n:>20}" for n in names)]
    lines += [f"{label:<26} " + " ".join(f"{str(get(r)):>20}" for r in runs.values()) for label, get in rows]
    lines.append(f"Serve's overhead per request (idle, one token): {overhead} ms")
    lines.append(f"--kv-memory {mib(kv_memory)} per process (each replica has its own)")
    return "\n".join(lines)


def policies_table(rows: list[dict], kv_memory: int) -> str:
    """A line per policy, each measured on its own server under the same load and budget."""
    columns = [
        ("policy", lambda r: r["policy"], 24),
        ("done/sent", lambda r: f"{r['completed']}/{r['requests']}", 10),
        ("err", lambda r: r["errors"], 4),
        ("tok/s", lambda r: r["aggregate_tokens_per_second"], 8),
        ("req/s", lambda r: r["requests_per_second"], 7),
        ("most at once", lambda r: r["most_decoding_at_once"], 12),
        ("TTFT p50/p99 ms", lambda r: f"{r['ttft_p50_ms']}/{r['ttft_p99_ms']}", 18),
        ("ITL p50/p99 ms", lambda r: f"{r['itl_p50_ms']}/{r['itl_p99_ms']}", 15),
        ("peak RSS", lambda r: mib(r["peak_rss_bytes"]), 10),
    ]
    lines = [" ".join(f"{name:>{width}}" for name, _, width in columns)]
    lines += [" ".join(f"{str(get(r)):>{width}}" for _, get, width in columns) for r in rows]
    first = rows[0]
    lines.append(
        f"--kv-memory {mib(kv_memory)}, model {mib(first['model_bytes'])}, RSS limit {mib(first['rss_limit_bytes'])} "
        f"({first['rss_limit']}); {first['clients']} clients, "
        f"prompts of {first['prompt_tokens_mean']} tokens on average"
    )
    return "\n".join(lines)


def add(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("serve", help="start a server and measure N concurrent streaming clients on loopback")
    add_serve_arguments(p)
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
    p.add_argument("--requests", type=int, default=64, help="requests in all, then stop (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request (default 32)")
    p.add_argument("--duration", type=float, default=300, help="stop after this many seconds (default 300)")
    p.add_argument("--long-every", type=float, default=0, help="send a long prompt every this many seconds (0: never)")
    p.add_argument("--long-prompt", type=int, default=4096, help="tokens of each long prompt (default 4096)")
    p.add_argument(
        "--turns",
        type=int,
        default=0,
        help="each client holds a chat of this many turns, run with idle conversations kept and without "
        "(time to first token and K/V per turn); 0: independent requests (default)",
    )
    p.add_argument("--turn-tokens", type=int, default=100, help="new user tokens per turn with --turns (default 100)")
    p.add_argument(
        "--kill-after",
        type=int,
        default=0,
        metavar="TURNS",
        help="with --turns: one server with a conversation store (--store, else a temporary one), killed with "
        "SIGKILL once TURNS turns are answered and restarted on the same store; what survived (0: no kill)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="each request a different document of this many tokens (a passage of Emma and a question), with "
        "--turns the first message of each conversation; 0: short openings (default)",
    )
    p.add_argument(
        "--policies",
        default=None,
        help="comma-separated policies, each NAME[option=value,...], each measured on its own fresh server "
        "under the same load: a row per policy",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write the results as JSON to FILE (rewritten as each policy finishes), or print them without FILE",
    )
    p.set_defaults(func=cmd_bench_serve)
