"""The flags commands share, declared once: the model, the weights, compilation, the policy (from the
policies' declared options), results files and Ray; and the parser whose usage errors are one line."""

from __future__ import annotations

import argparse

from .. import models, paths, weights
from ..cluster import INSTALL, LOCAL
from ..compiled import MODES
from ..contract import REFERENCE
from ..errors import InfinikvError
from ..grid import append_row as append_row  # the results files of every command
from ..policies import all_options, policy_names
from ..serve.store import KV_FORMATS

GRID_JSON = "print a JSON list, one object per (policy, budget)"


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and still exit code 2)."""

    def error(self, message: str):  # type: ignore[override]
        raise InfinikvError(f"{self.prog}: {message}")


def add_policy_arguments(
    parser: argparse.ArgumentParser, grid: bool = False, every_policy: bool = False, default: str | None = None
) -> None:
    """``--policy`` (or ``--policies``/``--budgets`` for a grid), ``--budget``/``--capacity`` and
    every policy option the policies declare, except any that collide with the command's own flags."""
    group = parser.add_argument_group("KV policy")
    names = ", ".join(policy_names())
    if grid:
        fallback = ",".join(policy_names()) if every_policy else default or REFERENCE
        group.add_argument(
            "--policy",
            "--policies",
            dest="policies",
            default=fallback,
            help=f"comma-separated policies ({names}), each optionally NAME[option=value,...]; "
            f"default {'all' if every_policy else fallback}",
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
            "--policy",
            default=None,
            help=f"one of {names}, optionally NAME[option=value,...] (default: the model's own, else full)",
        )
        group.add_argument("--budget", type=float, default=None, help="tokens kept, as a fraction of the tokens seen")
    group.add_argument("--capacity", type=int, default=None, help="tokens kept per layer (instead of --budget)")
    taken, registered = set(parser._option_string_actions), []
    for option in all_options().values():
        if option.flag in taken:
            continue
        registered.append(option.name)
        if option.type is bool:
            group.add_argument(
                option.flag, dest=option.name, action="store_const", const=True, default=None, help=option.help
            )
        else:
            group.add_argument(
                option.flag, dest=option.name, default=None, help=f"{option.help} (default {option.default})"
            )
    parser.set_defaults(policy_options=registered)


def add_model_argument(parser: argparse.ArgumentParser, several_weights: bool = False) -> None:
    """``--model`` and ``--weights`` (one format, or with ``several_weights`` a comma-separated list)."""
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="bundled name, HF folder or .gguf file")
    formats = "|".join((weights.AUTO, *weights.FORMATS))
    parser.add_argument(
        "--weights",
        default=weights.AUTO,
        metavar="FORMAT[,FORMAT...]" if several_weights else formats,
        help=("weight formats to compare, comma-separated: " if several_weights else "")
        + "how the Linear weights are stored and multiplied; K/V stays fp32 (default auto: on a CPU the "
        "precision the model ships in, int4 for the bundled GGUFs, else int8; fp32 for exactness work)",
    )


def add_compile_argument(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    parser.add_argument(
        "--compile",
        choices=MODES,
        nargs="?",
        const="on",
        default=default,
        help="run the decode steps compiled: auto where the policy allows it and its compiled step is built "
        "(`infinikv prepare --compile`: once per machine, kept under $INFINIKV_HOME), on (build it now if "
        f"needed; a bare --compile), off (default {default})",
    )


def add_run_arguments(parser: argparse.ArgumentParser, json_help: str, results: bool = True) -> None:
    """The arguments every evaluation shares: model, JSON output, results file, progress bar."""
    add_model_argument(parser)
    parser.add_argument("--json", action="store_true", help=json_help)
    if results:
        add_results_arguments(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def add_results_arguments(parser: argparse.ArgumentParser) -> None:
    """The results file a grid appends to, and the time after which it starts no new cell."""
    parser.add_argument("--out", help="JSON-lines file that receives each result as it finishes")
    parser.add_argument(
        "--limit-minutes",
        type=minutes,
        help="start no new cell after this many minutes; the rows so far are kept and --out resumes the rest",
    )


def minutes(text: str) -> float:
    """A positive number of minutes (argparse's type: a bad one is a usage error, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of minutes, got {text!r}")
    return value


def add_ray_flag(parser: argparse.ArgumentParser, what: str) -> argparse._ArgumentGroup:
    """``--ray [ADDRESS]`` in a group of its own (returned, for the command's other Ray flags)."""
    group = parser.add_argument_group(f"Ray ({INSTALL})")
    group.add_argument(
        "--ray",
        nargs="?",
        const=LOCAL,
        default=None,
        metavar="ADDRESS",
        help=f"{what}: auto, HOST:PORT, or no value for a local cluster of this machine",
    )
    return group


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """``--ray [ADDRESS]`` and the shape of its workers, for commands that run a grid of cells."""
    group = add_ray_flag(parser, "run the cells on a Ray cluster")
    group.add_argument(
        "--workers",
        type=int,
        default=None,
        help="Ray workers, each loads the model once (default: the cluster's CPUs / --worker-cpus)",
    )
    group.add_argument("--worker-cpus", type=float, default=1, help="CPUs per worker (default 1)")
    group.add_argument(
        "--worker-gpus", type=float, default=None, help="GPUs per worker (default 1 if the cluster has any)"
    )


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    """The conversation store's flags (``serve`` and ``bench serve``)."""
    p.add_argument(
        "--store",
        nargs="?",
        const=str(paths.home() / "conversations"),
        default=None,
        metavar="DIR",
        help="write conversations that leave RAM to DIR (default $INFINIKV_HOME/conversations) and restore "
        "them on their next turn, also after a restart (default: no store)",
    )
    p.add_argument("--store-size", default="8GiB", help="most disk the store uses, LRU out first (default 8GiB)")
    p.add_argument(
        "--store-kv",
        choices=KV_FORMATS,
        default=KV_FORMATS[0],
        help=f"how stored K/V is kept: int8 (a quarter of the bytes, lossy) or fp32 (default {KV_FORMATS[0]})",
    )
