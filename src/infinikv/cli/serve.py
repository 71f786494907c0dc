"""``infinikv serve`` (the OpenAI-compatible server) and ``infinikv bench serve``."""

from __future__ import annotations

import argparse
import json
import sys

from .. import models
from ..cluster import LOCAL
from ..errors import InfinikvError
from ..policies import parse_spec
from .arguments import add_compile_argument, add_model_argument, add_policy_arguments, add_ray_flag, add_store_arguments
from .common import api_keys, check_ray_flags, given_options, load, mib, single_policy, split_policies, store_options


def check(args: argparse.Namespace) -> list[dict]:
    """Refuse bad flags before anything loads; the specs of ``--prepare``."""
    threads = args.threads if args.threads is not None else 1
    if min(args.max_queue, args.keep_conversations) < 0 or threads < 1 or args.prefill_chunk < 1:
        raise InfinikvError(
            "--max-queue and --keep-conversations must be >= 0, --threads and --prefill-chunk at least 1"
        )
    check_ray_flags(args, "replica", serve=True)
    prepare = [{"policy": name, **options} for name, options in split_policies(args.prepare)]
    for spec in prepare:
        parse_spec(spec)
    return prepare


def cmd_serve(args: argparse.Namespace) -> int:
    import socket

    import uvicorn

    from ..serve.app import create_app
    from ..sizes import parse_bytes

    kv_memory, spec = parse_bytes(args.kv_memory), single_policy(args)
    prepare, store = check(args), store_options(args)
    if not 0 < args.port < 65536:
        raise InfinikvError("--port must be in 1..65535")
    with socket.socket() as probe:
        try:
            probe.bind((args.host, args.port))
        except OSError as exc:
            raise InfinikvError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    options = {"kv_memory": kv_memory, "max_queue": args.max_queue, "api_keys": api_keys(args)}
    options |= {"prefill_chunk": args.prefill_chunk, "compile": args.compile, "prepare": prepare}
    options |= {"keep_conversations": args.keep_conversations, "store": store}
    if args.ray is not None:
        return serve_on_ray(args, spec, options)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = load(args)
    spec = spec or models.default_policy_spec(model, serving=True)
    app = create_app(model, tokenizer, args.model, spec, say=say, **options)
    print(
        f"infinikv: serving {args.model} on http://{args.host}:{args.port}/v1 (default kv {json.dumps(spec)}, "
        f"--kv-memory {mib(kv_memory)})",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


def say(message: str) -> None:
    print(f"infinikv: {message}", file=sys.stderr)


def serve_on_ray(args: argparse.Namespace, spec: dict | None, options: dict) -> int:
    from ..cluster import connect

    models.resolve(args.model)  # a missing model fails here, not in every replica
    leave = connect(args.ray)
    try:
        from ..serve.replicas import serve_replicas

        options |= {"default_kv": spec}  # None: each replica takes its model's own policy
        serve_replicas(
            args.model,
            args.replicas or 1,
            args.replica_cpus,
            args.replica_gpus,
            args.host,
            args.port,
            args.threads,
            options,
            args.weights,
        )
    finally:
        leave()
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from ..bench.serving import bench_serve
    from ..sizes import parse_bytes

    kv_memory, spec = parse_bytes(args.kv_memory), single_policy(args)
    check(args)
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1 or args.duration <= 0:
        raise InfinikvError("--clients, --requests and --max-tokens must be at least 1, --duration positive")
    if args.long_every < 0 or args.long_prompt < 0:
        raise InfinikvError("--long-every and --long-prompt must be >= 0")
    if args.turns < 0 or args.turn_tokens < 1:
        raise InfinikvError("--turns must be >= 0 and --turn-tokens at least 1")
    if args.turns and args.ray is not None:
        raise InfinikvError("--turns runs on one server process; drop --ray")
    serve_args = ["--kv-memory", args.kv_memory, "--max-queue", str(args.max_queue), "--prepare", args.prepare]
    serve_args += ["--keep-conversations", str(args.keep_conversations), "--weights", args.weights]
    serve_args += ["--threads", str(args.threads)] if args.threads else []
    serve_args += ["--prefill-chunk", str(args.prefill_chunk), "--compile", args.compile]
    serve_args += (
        ["--store", args.store, "--store-size", args.store_size, "--store-kv", args.store_kv] if args.store else []
    )
    if spec:
        serve_args += ["--policy", spec["policy"]]
        for key in ("budget", "capacity"):
            if key in spec:
                serve_args += [f"--{key}", str(spec[key])]
        for key, value in given_options(args).items():
            serve_args += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    if args.turns:
        return bench_conversations(args, serve_args, kv_memory)
    ray_args = []
    if args.ray is not None:
        ray_args = ["--ray"] + ([] if args.ray == LOCAL else [args.ray]) + ["--replicas", str(args.replicas or 1)]
        ray_args += ["--replica-cpus", str(args.replica_cpus)]
        ray_args += ["--replica-gpus", str(args.replica_gpus)] if args.replica_gpus is not None else []
    load = (args.clients, args.requests, args.max_tokens, args.duration)
    runs = {}
    for name, extra in [("one process", [])] + ([("Ray Serve", ray_args)] if ray_args else []):
        if ray_args:
            print(f"infinikv: bench serve: {name} ...", file=sys.stderr)
        runs[name] = bench_serve(
            args.model, serve_args + extra, kv_memory, *load, long_every=args.long_every, long_prompt=args.long_prompt
        )
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
    if args.json:
        print(json.dumps(result, indent=2))
    elif ray_args:
        print(compare_table(runs, args.replicas or 1, result["serve_overhead_ms"], kv_memory))
    else:
        print(summary(result, args, kv_memory))
    for r in runs.values():
        for message in r["error_messages"]:
            print(f"  error: {message}", file=sys.stderr)
    if not all(r["rss_within_budget"] for r in runs.values()):
        print("infinikv: a server process's RSS went over --kv-memory + the model size", file=sys.stderr)
        return 1
    return 0 if all(r["errors"] == 0 for r in runs.values()) else 1


def bench_conversations(args: argparse.Namespace, serve_args: list[str], kv_memory: int) -> int:
    from ..bench.turns import bench_turns, turns_table

    load = (args.clients, args.turns, args.turn_tokens, args.max_tokens)
    result = bench_turns(args.model, serve_args, kv_memory, *load)
    print(json.dumps(result, indent=2) if args.json else turns_table(result))
    for message in result["error_messages"]:
        print(f"  error: {message}", file=sys.stderr)
    if not result["rss_within_budget"]:
        print("infinikv: a server's RSS went over --kv-memory + the model size", file=sys.stderr)
        return 1
    return 0 if result["errors"] == 0 else 1


def summary(r: dict, args: argparse.Namespace, kv_memory: int) -> str:
    lines = [
        f"{r['clients']} clients, {r['completed']}/{r['requests']} requests completed in {r['seconds']} s "
        f"({r['errors']} errors, {r['unfinished']} unfinished)",
        f"requests/s {r['requests_per_second']}, tokens/s {r['tokens_per_second']}",
        f"time to first token p50 {r['ttft_p50_ms']} ms, p99 {r['ttft_p99_ms']} ms",
        f"inter-token latency p50 {r['itl_p50_ms']} ms, p99 {r['itl_p99_ms']} ms",
        f"one-token request to the idle server: {r['idle_latency_p50_ms']} ms (median of 10)",
        f"peak server RSS {mib(r['peak_rss_bytes'])} vs --kv-memory {mib(kv_memory)} + model "
        f"{mib(r['model_bytes'])}: {'ok' if r['rss_within_budget'] else 'OVER'}",
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
        ("tokens/s", lambda r: r["tokens_per_second"]),
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


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument("--kv-memory", default="1GiB", help="K/V bytes all running requests may reserve (default 1GiB)")
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait for K/V budget (default 16)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="most prompt tokens prefilled between two decode steps (default 512; fewer while streams run)",
    )
    add_compile_argument(p)
    p.add_argument(
        "--prepare",
        default="",
        help="comma-separated policies, each NAME[option=value,...], built and prepared (InfiniGen's calibration) "
        "before the port opens, besides the default policy; a request naming another that needs a "
        "preparation is refused (400)",
    )
    p.add_argument(
        "--keep-conversations",
        type=int,
        default=16,
        help="finished requests whose caches are kept for their conversation's next turn, least recently used "
        "dropped first and whenever admission needs the room (default 16; 0: none)",
    )
    add_store_arguments(p)
    add_policy_arguments(p)
    group = add_ray_flag(p, "serve replicas on Ray Serve")
    group.add_argument("--replicas", type=int, default=None, help="replicas, each with its own model and K/V budget")
    group.add_argument("--replica-cpus", type=float, default=1, help="CPUs per replica (default 1)")
    group.add_argument(
        "--replica-gpus", type=float, default=None, help="GPUs per replica (default 1 if the cluster has any)"
    )


def add(sub: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with per-request KV policies")
    add_serve_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None, help="require Authorization: Bearer API_KEY on every call")
    keys.add_argument(
        "--api-keys",
        metavar="FILE",
        help="one key per line, optionally followed by a name; each key's conversations and cached "
        "prefixes are its own",
    )
    p.set_defaults(func=cmd_serve)

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
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_serve)
