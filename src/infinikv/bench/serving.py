"""``infinikv bench serve``: start a server, run concurrent streaming clients on loopback, measure.

The run stops by itself after ``requests`` requests or ``duration`` seconds, whichever comes
first (requests still running then are counted as unfinished). It reports requests/s, time to
first token and inter-token latency (p50/p99), errors, the round trip of a one-token request to
the idle server, and the peak RSS of the server's largest process (the server, or its largest Ray
Serve replica), checked against the K/V budget plus the model's size (each replica has both).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import psutil

from ..errors import InfinikvError
from .server import rss_limit, running_server, server_numbers

PROMPTS = [  # openings the bundled model continues for at least 32 tokens under greedy decoding
    "Once upon a time, a lighthouse keeper",
    "The sky is blue because",
    "A paper clip can be used to",
    "On an autumn morning the forest",
    "A good cup of tea needs",
    "The first bicycles were built",
    "When you learn to cook, start by",
    "At night the sea",
    "The old city was quiet when",
    "My grandmother always said that",
]


def percentile_ms(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values`` in seconds, as ms; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))], 1)


@dataclass
class Tally:
    """What the clients saw."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    completed: int = 0
    errors: int = 0
    tokens: int = 0
    started: int = 0
    prompt_tokens: int = 0
    messages: list[str] = field(default_factory=list)


class RssSampler(threading.Thread):
    """Samples the RSS of a process and its descendants every 50 ms; keeps the peak of the largest
    one (the server, or its largest Ray Serve replica) and of them all together."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process, self.peak, self.peak_total, self.done = psutil.Process(pid), 0, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                tree = [self.process, *self.process.children(recursive=True)]
            except psutil.Error:
                return
            sizes = []
            for process in tree:
                try:
                    sizes.append(process.memory_info().rss)
                except psutil.Error:  # a child that just exited
                    continue
            self.peak, self.peak_total = max(self.peak, max(sizes, default=0)), max(self.peak_total, sum(sizes))
            self.done.wait(0.05)


async def sse_chunks(response: httpx.Response) -> AsyncIterator[dict | None]:
    """The JSON chunks of a streamed OpenAI-style response, then None at ``[DONE]`` (a stream that
    stops without it just ends); an error chunk is raised as RuntimeError."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            yield None
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        yield chunk


async def one_request(client: httpx.AsyncClient, url: str, body: dict, tally: Tally, deadline: float) -> None:
    started = time.perf_counter()
    last, done = None, False
    try:
        async with client.stream("POST", url, json=body, timeout=max(1.0, deadline - time.monotonic())) as r:
            if r.status_code != 200:
                tally.errors += 1
                tally.messages.append(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
                return
            async for chunk in sse_chunks(r):
                if chunk is None:
                    done = True
                    break
                if chunk.get("usage"):
                    tally.tokens += chunk["usage"]["completion_tokens"]
                    tally.prompt_tokens += chunk["usage"]["prompt_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if last is None:
                        tally.ttft.append(now - started)
                    else:
                        tally.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
        if isinstance(exc, httpx.TimeoutException) and time.monotonic() >= deadline:
            return  # still running when the run ended: counted as unfinished, not as an error
        tally.errors += 1
        tally.messages.append(f"{type(exc).__name__}: {exc}"[:200])
        return
    if done:
        tally.completed += 1
    else:
        tally.errors += 1
        tally.messages.append("the stream ended without [DONE]")


async def drive(
    base: str,
    model: str,
    clients: int,
    requests: int,
    max_tokens: int,
    duration: float,
    prompts: list[str] = PROMPTS,
    long_every: float = 0,
    long_text: str = "",
) -> tuple:
    """``clients`` concurrent loops of streaming completions of ``prompts`` in turn (each of exactly
    ``max_tokens`` tokens), and (with ``long_every``) a request with the long prompt ``long_text``
    every ``long_every`` seconds, measured apart; returns (tally, long tally, seconds, unfinished)."""
    tally, long_tally, deadline = Tally(), Tally(), time.monotonic() + duration
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(limits=limits) as client:

        async def worker() -> None:
            while tally.started < requests and time.monotonic() < deadline:
                body = {
                    "model": model,
                    "prompt": prompts[tally.started % len(prompts)],
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                tally.started += 1
                await one_request(client, f"{base}/v1/completions", body, tally, deadline)

        async def long_prompts() -> None:
            while True:
                await asyncio.sleep(long_every)
                body = {"model": model, "prompt": long_text, "max_tokens": 1, "temperature": 0, "stream": True}
                long_tally.started += 1
                await one_request(client, f"{base}/v1/completions", body, long_tally, deadline)

        start = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(clients)]
        extra = [asyncio.create_task(long_prompts())] if long_every else []
        _, pending = await asyncio.wait(tasks, timeout=duration + 5)
        for task in [*pending, *extra]:
            task.cancel()
        seconds = time.perf_counter() - start
    unfinished = tally.started - tally.completed - tally.errors
    return tally, long_tally, seconds, unfinished


def idle_latency(base: str, model: str, requests: int = 10) -> float | None:
    """Median round trip (ms) of ``requests`` one-token completions sent one after another to an
    idle server: what the path in front of the model costs a request."""
    times = []
    with httpx.Client(timeout=60) as client:
        for i in range(requests):
            started = time.perf_counter()
            body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 1, "temperature": 0}
            if client.post(f"{base}/v1/completions", json=body).status_code == 200:
                times.append(time.perf_counter() - started)
    return percentile_ms(times, 50)


def model_bytes(model: str) -> int:
    """Bytes of the model's weight files on disk (what loading it puts in memory, in fp32 here)."""
    from ..models import resolve

    folder, gguf = resolve(model)
    files = [folder / gguf] if gguf else [*folder.glob("*.safetensors"), *folder.glob("*.bin")]
    return sum(f.stat().st_size for f in files if f.is_file())


def documents(model: str, tokens: int, count: int) -> list[str]:
    """``count`` different prompts of ``tokens`` tokens each (by ``model``'s tokenizer): a passage
    of Austen's Emma, then a question about it."""
    from ..data import load_text
    from ..models import load_tokenizer

    tokenizer, text = load_tokenizer(model), load_text("austen:emma", from_chapter_one=True)
    question = "\n\nIn one paragraph, what happens in this passage?\n"
    ids = tokenizer(text).input_ids
    size = tokens - len(tokenizer(question).input_ids)
    if size < 1 or size * count > len(ids):
        raise InfinikvError(f"--prompt-tokens {tokens}: Emma holds {len(ids)} tokens, not {count} such documents")
    return [tokenizer.decode(ids[i * size : (i + 1) * size]) + question for i in range(count)]


def bench_serve(
    model: str,
    serve_args: list[str],
    kv_memory: int,
    clients: int,
    requests: int,
    max_tokens: int,
    duration: float,
    long_every: float = 0,
    long_prompt: int = 4096,
    prompt_tokens: int = 0,
    memory: int | None = None,
) -> dict:
    """Start ``infinikv serve`` on a free loopback port, drive it, stop it; return the numbers.

    Each request is one of ``PROMPTS`` or, with ``prompt_tokens``, a document of that many tokens
    (a different one for each of the first ``requests``). With ``long_every``, a request with a
    prompt of about ``long_prompt`` tokens (Austen's Emma, at ~4 characters a token) arrives every
    ``long_every`` seconds, to show what a long prefill does to the running streams' inter-token
    latency. The peak RSS is checked against ``rss_limit``."""
    long_text = ""
    if long_every:
        from ..data import load_text

        long_text = load_text("austen:emma", from_chapter_one=True)[: 4 * long_prompt]
    prompts = documents(model, prompt_tokens, requests) if prompt_tokens else PROMPTS
    with running_server(model, serve_args) as (base, server):
        idle = idle_latency(base, model)
        sampler = RssSampler(server.pid)
        sampler.start()
        tally, long_tally, seconds, unfinished = asyncio.run(
            drive(base, model, clients, requests, max_tokens, duration, prompts, long_every, long_text)
        )
        sampler.done.set()
        sampler.join()
        most_running = int(server_numbers(base)["batch_size_max"])
    weights = model_bytes(model)
    limit = rss_limit(kv_memory, memory, weights)
    return {
        "clients": clients,
        "requests": tally.started,
        "completed": tally.completed,
        "errors": tally.errors,
        "unfinished": unfinished,
        "seconds": round(seconds, 3),
        "prompt_tokens_mean": round(tally.prompt_tokens / tally.completed, 1) if tally.completed else None,
        "requests_per_second": round(tally.completed / seconds, 3),
        "aggregate_tokens_per_second": round(tally.tokens / seconds, 2),
        "most_decoding_at_once": most_running,
        "ttft_p50_ms": percentile_ms(tally.ttft, 50),
        "ttft_p99_ms": percentile_ms(tally.ttft, 99),
        "itl_p50_ms": percentile_ms(tally.itl, 50),
        "itl_p99_ms": percentile_ms(tally.itl, 99),
        "idle_latency_p50_ms": idle,
        "peak_rss_bytes": sampler.peak,
        "peak_tree_rss_bytes": sampler.peak_total,
        "kv_memory_bytes": kv_memory,
        "model_bytes": weights,
        **limit,
        "rss_within_budget": sampler.peak < limit["rss_limit_bytes"],
        "error_messages": sorted(set(tally.messages + long_tally.messages))[:5],
        "errors_long": long_tally.errors,
        **(
            {"long_prompts": long_tally.started, "long_ttft_p50_ms": percentile_ms(long_tally.ttft, 50)}
            if long_every
            else {}
        ),
    }
