"""Ray: grids on a real cluster (local, or joined by address) equal a local run and resume; the
server as Ray Serve replicas labels its metrics per replica, passes a full replica's 429 through,
and loses only a killed replica's requests; no Ray process outlives its cluster."""

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from infinikv.bench.server import free_port
from infinikv.cli import main

GRID = ["--context", "128", "--continuation", "12", "--policies", "full,sink,h2o", "--budgets", "0.5", "--quiet"]
TIMING = {"seconds"}  # the only fields of a row that differ between two runs of the same cell


def ray_processes() -> dict[int, str]:
    """Every Ray process on the machine: its daemons and its workers (``ray::...``)."""
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if line.startswith("ray::") or "/site-packages/ray/" in line:
            found[p.pid] = line[:120]
    return found


def gone(pids, timeout: float = 20) -> dict[int, str]:
    """Those of ``pids`` still running after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = {pid: line for pid, line in ray_processes().items() if pid in pids}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def without_timing(rows: list[dict]) -> list[dict]:
    """The rows in cell order (the file has them in the order they finished), less their timing."""
    ordered = sorted(rows, key=lambda r: (r["protocol"], json.dumps(r["spec"], sort_keys=True)))
    return [{k: v for k, v in r.items() if k not in TIMING} for r in ordered]


def rows_of(path: Path) -> list[dict]:
    """The rows of a results file, less a line cut short."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def run_here(argv: list[str]) -> None:
    """The command in this process with one torch thread, as each Ray worker of one CPU has: the
    same kernels in the same order give the same bits (two threads change the 8th digit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cluster():
    """A real Ray cluster of 2 CPUs bound to loopback (token authentication on), started with
    ``ray start`` and stopped at the end; its address. Teardown fails if any process it started
    (or any worker of its raylet) is still alive."""
    temp = Path(tempfile.mkdtemp(prefix="ikr", dir="/tmp"))  # short: Ray's socket paths are limited
    port = free_port()
    auth = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in auth.items():
            patch.setenv(key, value)
        ray = str(Path(sys.executable).parent / "ray")
        started = subprocess.run(
            [ray, "start", "--head", "--num-cpus", "2", "--port", str(port), "--temp-dir", str(temp)]
            + ["--include-dashboard", "false", "--disable-usage-stats"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert started.returncode == 0, started.stderr[-2000:]
        try:
            yield f"127.0.0.1:{port}"
        finally:
            ours = {p.pid for p in psutil.process_iter(["cmdline"]) if str(temp) in " ".join(p.info["cmdline"] or [])}
            for pid in list(ours):
                try:
                    ours |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
                except psutil.Error:
                    continue
            for pid in ours:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
            for pid in gone(ours, timeout=3):  # what SIGTERM did not stop in 3 s
                os.kill(pid, signal.SIGKILL)
            left = gone(ours, timeout=10)
    assert ours and not left, f"Ray processes left after the cluster stopped: {left}"


def test_without_ray_the_flag_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` does when Ray is not installed
    for argv in (["eval", "ppl", "--ray"], ["serve", "--ray", "auto", "--replicas", "2"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "pip install 'infinikv[ray]'" in err, err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["eval", "ppl", "--workers", "2"], "--workers needs --ray"),
        (["eval", "needle", "--ray", "--workers", "0"], "--workers must be at least 1"),
        (["serve", "--replicas", "2"], "--replicas needs --ray"),
        (["serve", "--ray", "--replicas", "0"], "--replicas must be at least 1"),
    ],
)
def test_ray_flag_errors(argv, says, capsys):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


@pytest.mark.slow
def test_grid_on_a_local_cluster_equals_local_and_leaves_nothing(tmp_path):
    """``--ray`` with no address: a cluster of this machine, started and stopped by the command
    (a process of its own, as a user runs it: Ray keeps one cluster's token per process), on the
    real model."""
    before = set(ray_processes())
    grid = [*GRID, "--policies", "full,h2o"]
    run_here(["eval", "ppl", *grid, "--out", str(tmp_path / "here.jsonl")])
    command = [sys.executable, "-m", "infinikv.cli", "eval", "ppl", *grid, "--out", str(tmp_path / "ray.jsonl")]
    run = subprocess.run([*command, "--ray", "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    here, there = rows_of(tmp_path / "here.jsonl"), rows_of(tmp_path / "ray.jsonl")
    assert len(here) == 2 and without_timing(here) == without_timing(there)
    left = gone(set(ray_processes()) - before)
    assert not left, f"the local cluster left {left}"


@pytest.mark.slow
def test_grid_on_a_cluster_resumes_and_equals_local(cluster, tiny_folder, tmp_path, capsys):
    """Joined by address: P-ctx and P-needle cells of `bench quality` on two workers (a tiny
    random model, saved to a folder every worker reads)."""
    grid = [*GRID, "--model", str(tiny_folder), "--needle-context", "160", "--needles", "2"]
    run_here(["bench", "quality", *grid, "--out", str(tmp_path / "here.jsonl")])
    here = rows_of(tmp_path / "here.jsonl")
    assert [r["protocol"] for r in here] == ["P-ctx"] * 3 + ["P-needle"] * 3
    out = tmp_path / "ray.jsonl"
    out.write_text(json.dumps(here[0]) + "\n" + json.dumps(here[1])[:40])  # one row, then a write cut short
    capsys.readouterr()
    assert main(["bench", "quality", *grid, "--out", str(out), "--ray", cluster, "--workers", "2"]) == 0
    assert "1 of 6 cells already" in capsys.readouterr().err
    assert without_timing(rows_of(out)) == without_timing(here)
    assert main(["bench", "quality", *grid, "--out", str(out), "--ray", cluster]) == 0  # nothing left to run
    assert "6 of 6 cells already" in capsys.readouterr().err


def replica_pids() -> set[int]:
    return {pid for pid, line in ray_processes().items() if line.startswith("ray::ServeReplica")}


def healthy(base: str) -> bool:
    """/health answers 200 within 5 s. Serve's proxy holds a request while the replicas are still
    loading their model, so a timeout there means "not yet", not "broken"."""
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.TimeoutException:
        return False


async def stream(
    client: httpx.AsyncClient, base: str, model: str, max_tokens: int, started: asyncio.Event, retries: int = 0
) -> str:
    """One streaming completion: "done", "HTTP <status> <body>", or the error that ended it. A 429
    is retried ``retries`` times, 0.2 s apart, as the ``openai`` client does."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        for attempt in range(retries + 1):
            async with client.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                if r.status_code == 429 and attempt < retries:
                    await asyncio.sleep(0.2)
                    continue
                if r.status_code != 200:
                    return f"HTTP {r.status_code} {(await r.aread()).decode()[:300]}"
                async for line in r.aiter_lines():
                    started.set()
                    if line == "data: [DONE]":
                        return "done"
                return "cut"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def completed_by_replica(base: str) -> dict[str, int]:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    prefix = 'infinikv_requests_total{outcome="completed",replica="'
    return {
        line[len(prefix) :].split('"')[0]: int(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


@pytest.mark.slow
def test_serve_replicas_metrics_429_and_a_killed_replica(cluster, tiny_folder):
    port = free_port()
    base, model = f"http://127.0.0.1:{port}", str(tiny_folder)
    # K/V for one 300-token request per replica (1 KiB a token) and no queue: a third stream
    # finds both replicas full.
    argv = ["serve", "--model", model, "--port", str(port), "--ray", cluster, "--replicas", "2"]
    argv += ["--kv-memory", "450KiB", "--max-queue", "0"]
    server = subprocess.Popen([sys.executable, "-m", "infinikv.cli", *argv], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while len(replica_pids()) < 2 or not healthy(base):
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()[-2000:]
            time.sleep(1)
        while httpx.get(f"{base}/metrics", timeout=5).text.count("infinikv_decode_steps_total{replica=") < 2:
            assert time.monotonic() < deadline, "/metrics never showed both replicas"
            time.sleep(0.5)

        async def fill_both_then_one_more() -> tuple[list[str], str]:
            async with httpx.AsyncClient() as client:
                started = [asyncio.Event(), asyncio.Event()]
                runs = [asyncio.create_task(stream(client, base, model, 300, e, retries=50)) for e in started]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                extra = await stream(client, base, model, 300, asyncio.Event())  # both replicas are full now
                return await asyncio.gather(*runs), extra

        before = completed_by_replica(base)
        outcomes, extra = asyncio.run(fill_both_then_one_more())
        assert outcomes == ["done", "done"], outcomes
        assert extra.startswith("HTTP 429") and "queue_full" in extra, extra
        for _ in range(60):  # another replica's numbers are up to a second old
            after = completed_by_replica(base)
            if sum(after.values()) == sum(before.values()) + 2:
                break
            time.sleep(0.5)
        assert len(after) == 2 and all(after[r] == before.get(r, 0) + 1 for r in after), (before, after)  # one each

        victims = replica_pids()

        async def kill_one_mid_run() -> list[str]:
            async with httpx.AsyncClient() as client:
                started = asyncio.Event()
                runs = [asyncio.create_task(stream(client, base, model, 300, started)) for _ in range(2)]
                await asyncio.wait_for(started.wait(), 60)
                os.kill(min(victims), signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*runs), 90)  # no request hangs

        outcomes = asyncio.run(kill_one_mid_run())
        ended = ("done", "cut", "RemoteProtocolError", "ReadError")  # finished, or cut off with its replica
        assert all(o in ended or o.startswith(("HTTP 5", "HTTP 429")) for o in outcomes), outcomes
        while len(replica_pids() - victims) < 1:  # Serve starts a replacement
            assert time.monotonic() < deadline + 60, "the killed replica was not replaced"
            time.sleep(0.5)
        body = {"model": model, "prompt": "Hello", "max_tokens": 4}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    assert server.returncode in (0, 130)
