"""Ray: joining or starting a cluster, and a pool of workers (one Ray actor each) for grids.

Ray is an optional extra; nothing here imports it until ``connect`` is called, and without it
``connect`` is a one-line error naming the install command.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
from collections.abc import Callable, Iterator

from .errors import InfinikvError
from .grid import Cell, Worker

INSTALL = "pip install 'infinikv[ray]'"
LOCAL = "local"  # ``--ray`` without an address: a cluster of this machine alone, on loopback


def _loopback(address: str) -> bool:
    host = address.rpartition(":")[0] if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def import_ray(address: str, serve: bool = False):
    """``ray`` (and Ray Serve), set up for ``address``; a one-line error when not installed."""
    if address == LOCAL or _loopback(address):
        # Read when Ray is first imported: without it Ray binds (and looks for its raylet) on the
        # address other machines reach, and a driver of a loopback cluster waits forever.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        import ray

        if serve:
            import ray.serve  # noqa: F401
    except ImportError:
        raise InfinikvError(f"--ray needs Ray{' Serve' if serve else ''}, which is not installed: {INSTALL}") from None
    return ray


def connect(address: str) -> Callable[[], None]:
    """Join the cluster at ``address`` (``auto`` or HOST:PORT) or, for ``LOCAL``, start one on this
    machine bound to loopback; returns the call that leaves it (and stops a local one)."""
    ray = import_ray(address)
    quiet = {"log_to_driver": False, "logging_level": logging.ERROR}
    try:
        if address == LOCAL:
            ray.init(include_dashboard=False, **quiet)
        else:
            ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = "start a local Ray cluster" if address == LOCAL else f"reach the Ray cluster at {address}"
        raise InfinikvError(f"cannot {where}: {error_line(exc)}") from None
    # Ray's handler dumps a stack trace on SIGTERM and exits; stop as on Ctrl-C instead, so that
    # the driver leaves the cluster (and stops a local one) on its way out.
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)

    def leave() -> None:
        ray.shutdown()
        if before is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGTERM, before)

    return leave


def error_line(exc: BaseException) -> str:
    """The last non-empty line of an exception's text: the error itself, under the traceback that
    Ray's exceptions carry."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def gpus_each(given: float | None, total: dict[str, float]) -> float:
    """GPUs for one worker or replica: as given, else 1 on a cluster (``total``) with GPUs, else 0."""
    return (1 if total.get("GPU", 0) else 0) if given is None else given


class RayPool:
    """``workers`` Ray actors, each a ``grid.Worker`` holding the model with ``cpus`` CPUs and
    ``gpus`` GPUs; each is given one cell at a time, the next as soon as it is free."""

    def __init__(self, model: str, workers: int | None, cpus: float, gpus: float | None, weights: str = "fp32") -> None:
        import ray

        total = ray.cluster_resources()
        gpus = gpus_each(gpus, total)
        if workers is None:
            workers = max(1, int(total.get("CPU", 1) // max(cpus, 1e-9)))
        if cpus > total.get("CPU", 0) or gpus > total.get("GPU", 0):
            raise InfinikvError(
                f"a worker asks for {cpus:g} CPUs and {gpus:g} GPUs; the cluster has "
                f"{total.get('CPU', 0):g} and {total.get('GPU', 0):g}"
            )
        actor = ray.remote(Worker).options(num_cpus=cpus, num_gpus=gpus, max_restarts=1, max_task_retries=1)
        device = "cuda" if gpus else "cpu"
        self.actors = [actor.remote(model, device, max(1, int(cpus)), weights=weights) for _ in range(workers)]

    def run(self, cells: list[Cell]) -> Iterator[tuple[Cell, dict]]:
        import ray

        queue, idle, pending = list(cells), list(self.actors), {}
        try:
            while queue or pending:
                while idle and queue:
                    actor, cell = idle.pop(), queue.pop(0)
                    pending[actor.run.remote(cell)] = (actor, cell)
                (ready,), _ = ray.wait(list(pending), num_returns=1)
                actor, cell = pending.pop(ready)
                idle.append(actor)
                try:
                    row = ray.get(ready)
                except ray.exceptions.RayTaskError as exc:
                    if isinstance(exc.cause, InfinikvError):
                        raise InfinikvError(str(exc.cause)) from None
                    raise InfinikvError(f"a Ray worker failed on a {cell.protocol} cell: {error_line(exc)}") from None
                except ray.exceptions.RayError as exc:
                    raise InfinikvError(f"a Ray worker was lost: {error_line(exc)}") from None
                yield cell, row
        finally:
            for actor in self.actors:
                ray.kill(actor)
