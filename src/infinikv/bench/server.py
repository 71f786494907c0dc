"""A real ``infinikv serve`` process for the serving benchmarks and tests: on a free loopback port,
waited for until it answers ``/health``, stopped on exit; its ``/metrics`` read back, and the RSS
limit a run checks it against."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from ..errors import InfinikvError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(model: str, serve_args: list[str]) -> Iterator[tuple[str, subprocess.Popen]]:
    """``infinikv serve`` on a free loopback port, once it answers /health: (base URL, process)."""
    base, server = start_server(model, serve_args, free_port())
    try:
        yield base, server
    finally:
        stop_server(server)


def start_server(model: str, serve_args: list[str], port: int) -> tuple[str, subprocess.Popen]:
    """``infinikv serve`` on loopback ``port``, once it answers /health: (base URL, process)."""
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "infinikv.cli", "serve", "--model", model, "--port", str(port), *serve_args]
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        _wait_healthy(server, base, log, timeout=300)
    except BaseException:
        stop_server(server)
        raise
    return base, server


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM (a clean stop: the store gets the idle conversations), SIGKILL after 30 s."""
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def server_numbers(base: str) -> dict[str, float]:
    """The server's /metrics samples by name, without the ``infinikv_`` prefix and the labels (the
    largest, of a metric with several samples: replicas, outcomes)."""
    numbers: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("infinikv_"):
            name = name.removeprefix("infinikv_").partition("{")[0]
            numbers[name] = max(numbers.get(name, float(value)), float(value))
    return numbers


def rss_limit(kv_memory: int, memory: int | None, weights: int) -> dict:
    """What a server's peak RSS is checked against: ``--memory`` when given (the whole process),
    else ``--kv-memory`` plus the model's size."""
    if memory:
        return {"rss_limit_bytes": memory, "rss_limit": "--memory"}
    return {"rss_limit_bytes": kv_memory + weights, "rss_limit": "--kv-memory + the model"}


def _wait_healthy(server: subprocess.Popen, base: str, log, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            last = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()][-1:]
            raise InfinikvError(f"the server exited with {server.returncode}: {' '.join(last) or 'no output'}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise InfinikvError(f"the server did not answer /health within {timeout:.0f} s")
