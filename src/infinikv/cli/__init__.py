"""The ``infinikv`` command line, one module per command group. Usage errors exit with 2 and one
line on stderr; the commands ask policies what they need through their declared capabilities."""

from __future__ import annotations

import sys

from ..errors import InfinikvError
from . import assets, bench, bench_serve, evaluate, generate, report, serve
from .arguments import Parser


def build_parser() -> Parser:
    parser = Parser(prog="infinikv", description="Long-text LLM generation under a fixed KV-cache budget.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    generate.add(sub)
    evaluate.add(sub, Parser)
    benches = bench.add(sub, Parser)
    report.add(sub)
    serve.add(sub)
    bench_serve.add(benches)
    assets.add(sub, Parser)
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


__all__ = ["build_parser", "main"]
