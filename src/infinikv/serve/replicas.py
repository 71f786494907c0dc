"""The OpenAI-compatible app as a Ray Serve deployment: ``infinikv serve --ray --replicas N``.

Each replica is the whole single-process server (``create_app``): its own model, scheduler and
``--kv-memory``, so a full replica answers 429 exactly as one process does and a client's retry
goes back through Serve's proxy, which picks the less busy of two replicas. Replicas publish
their scheduler's numbers to a small board actor owned by the driver; any replica's /metrics
shows every live replica, labelled ``replica``. Imported only once Ray is there
(``cluster.connect``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import ray
from ray import serve

from ..cluster import error_line, gpus_each
from ..errors import InfinikvError
from .app import create_app
from .metrics import PUBLISH_SECONDS

APP = "infinikv"
STALE_SECONDS = 5 * PUBLISH_SECONDS  # a replica silent this long is gone (killed, or being replaced)


def metrics_board():
    """A small actor holding the latest numbers of each replica and when they came. Defined here,
    not at module level, so that Ray ships the class by value: the board's process then imports
    neither torch nor infinikv (about 100 MB instead of 500)."""

    class MetricsBoard:
        def __init__(self) -> None:
            self.numbers: dict[str, tuple[float, dict[str, Any]]] = {}

        def put(self, replica: str, numbers: dict[str, Any]) -> None:
            self.numbers[replica] = (time.monotonic(), numbers)

        def live(self, stale_seconds: float) -> dict[str, dict[str, Any]]:
            now = time.monotonic()
            self.numbers = {r: (t, n) for r, (t, n) in self.numbers.items() if now - t <= stale_seconds}
            return {r: n for r, (_, n) in sorted(self.numbers.items())}

    return ray.remote(num_cpus=0)(MetricsBoard).remote()


class BoardPeers:
    """``app.Peers`` through a ``MetricsBoard``."""

    def __init__(self, board, name: str) -> None:
        self.board, self.name = board, name

    def publish(self, numbers: dict[str, Any]) -> None:
        ray.get(self.board.put.remote(self.name, numbers), timeout=10)

    def gather(self, numbers: dict[str, Any]) -> dict[str, dict[str, Any]]:
        self.publish(numbers)
        return ray.get(self.board.live.remote(STALE_SECONDS), timeout=10)


@serve.ingress()
class Replica:
    """One replica: loads the model and builds the app (``__serve_build_asgi_app__``)."""

    def __init__(
        self, model_name: str, board, device: str, threads: int | None, app_options: dict[str, Any], weights: str
    ) -> None:
        import torch

        from .. import models

        if threads:
            torch.set_num_threads(threads)
        model, tokenizer = models.load_model(model_name, device=device, weights=weights)
        name = serve.get_replica_context().replica_id.unique_id
        default_kv = app_options["default_kv"] or models.default_policy_spec(model, serving=True)
        options = {**app_options, "default_kv": default_kv}
        self.asgi = create_app(model, tokenizer, model_name, peers=BoardPeers(board, name), **options)

    def __serve_build_asgi_app__(self):
        return self.asgi


def serve_replicas(
    model_name: str,
    replicas: int,
    cpus: float,
    gpus: float | None,
    host: str,
    port: int,
    threads: int | None,
    app_options: dict[str, Any],
    weights: str = "fp32",
) -> None:
    """Deploy ``replicas`` replicas behind Serve's HTTP proxy on host:port and block until
    SIGINT or SIGTERM, then remove the deployment (a local cluster goes with the driver)."""
    total = ray.cluster_resources()
    gpus = gpus_each(gpus, total)
    if replicas * cpus > total.get("CPU", 0) or replicas * gpus > total.get("GPU", 0):
        raise InfinikvError(
            f"{replicas} replicas of {cpus:g} CPUs and {gpus:g} GPUs do not fit the cluster's "
            f"{total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs"
        )
    board = metrics_board()
    deployment = serve.deployment(
        name=APP,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
        # Serve queues what is over max_ongoing_requests in its router; set it well above what a
        # replica admits, so that the scheduler's own queue and 429 decide, as in one process.
        max_ongoing_requests=4 * (app_options["max_queue"] + 64),
        health_check_period_s=2,
        graceful_shutdown_timeout_s=5,
    )(Replica)
    serve.start(http_options={"host": host, "port": port})
    device = "cuda" if gpus else "cpu"
    try:
        serve.run(
            deployment.bind(model_name, board, device, threads or max(1, int(cpus)), app_options, weights), name=APP
        )
    except Exception as exc:  # a replica that cannot start (a missing model) fails the deployment
        why = error_line(exc)
        try:
            status = serve.status().applications[APP].deployments[APP].message
        except Exception:  # the deployment's status says why a replica failed; a must it is not
            status = ""
        if status.strip():
            why = error_line(RuntimeError(status))
        serve.delete(APP)
        raise InfinikvError(f"the replicas did not start: {why}") from None
    print(
        f"infinikv: {replicas} replicas of {model_name} on Ray Serve at http://{host}:{port}/v1 "
        f"(each: {cpus:g} CPUs, {gpus:g} GPUs, its own --kv-memory)",
        file=sys.stderr,
    )
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP)  # only ours: a shared cluster may serve other applications
