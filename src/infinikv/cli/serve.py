"""``infinikv serve``: the OpenAI-compatible server (``bench_serve`` measures it)."""

from __future__ import annotations

import argparse
import json
import sys

from .. import models
from ..errors import InfinikvError
from ..policies import parse_spec
from .arguments import add_compile_argument, add_model_argument, add_policy_arguments, add_ray_flag, add_store_arguments
from .common import api_keys, check_ray_flags, load, single_policy, split_policies, store_options


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

    spec = single_policy(args)
    kv_memory, memory = (parse_bytes(x) if x else None for x in (args.kv_memory, args.memory))
    prepare, store = check(args), store_options(args)
    if not 0 < args.port < 65536:
        raise InfinikvError("--port must be in 1..65535")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds (past TIME_WAIT)
        try:
            probe.bind((args.host, args.port))
        except OSError as exc:
            raise InfinikvError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    options = {"kv_memory": kv_memory, "max_queue": args.max_queue, "api_keys": api_keys(args)}
    options |= {"prefill_chunk": args.prefill_chunk, "compile": args.compile, "prepare": prepare}
    options |= {"keep_conversations": args.keep_conversations, "store": store, "memory": memory}
    if args.ray is not None:
        return serve_on_ray(args, spec, options)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = load(args)
    spec = spec or models.default_policy_spec(model, serving=True)
    app = create_app(model, tokenizer, args.model, spec, say=say, **options)
    print(
        f"infinikv: serving {args.model} on http://{args.host}:{args.port}/v1 (default kv {json.dumps(spec)})",
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


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument(
        "--kv-memory",
        default=None,
        help="K/V bytes all running requests and idle conversations may hold (default 1GiB, or with --memory "
        "what it leaves beside the model)",
    )
    p.add_argument(
        "--memory",
        default=None,
        help="the whole process's budget: the model, the runtime, the K/V and what forwards and copies take "
        "beyond it (measured as it runs); admission keeps the process under it (default: no limit but --kv-memory)",
    )
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


def add(sub: argparse._SubParsersAction) -> None:
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
