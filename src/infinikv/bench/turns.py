"""``infinikv bench serve --turns T``: conversations that grow, with and without continued caches.

Each of ``clients`` clients holds one chat of ``turns`` turns, as a chat client does: every turn
it resends the whole conversation (its earlier messages and the answers it got) plus a new user
message of about ``turn_tokens`` tokens (a passage of Austen's Emma), streams the answer and
measures the time to its first token (a 429 is waited out as its ``Retry-After`` says, and
counted). The same conversations run twice on fresh servers, with
idle conversations kept (``--keep-conversations``) and with none kept, so one run shows what
continuing a cache saves per turn; each answer's ``kv`` says the K/V its conversation held, and
each server's peak RSS is checked against the K/V budget plus the model's size.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import psutil

from ..data import load_text
from .server import running_server
from .serving import RssSampler, model_bytes, percentile_ms, sse_chunks


def user_message(text: str, client: int, turn: int, turns: int, tokens: int) -> str:
    """A new passage for each (client, turn), about ``tokens`` tokens (~4 characters a token)."""
    size = 4 * tokens
    start = ((client * turns + turn) * size) % max(1, len(text) - size)
    return f"Here is more of the story:\n{text[start : start + size]}\nWhat happens in it, in one sentence?"


class Busy(Exception):
    """A 429: the server's K/V budget and queue are full; retry after ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"busy, retry after {seconds:g} s")
        self.seconds = seconds


async def one_turn(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """Stream one chat answer: its text, time to first token, usage and ``kv``."""
    started, first, text, final = time.perf_counter(), None, [], {}
    async with client.stream("POST", url, json=body, timeout=600) as r:
        if r.status_code == 429:
            raise Busy(float(r.headers.get("retry-after", 1)))
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for chunk in sse_chunks(r):
            if chunk is None:
                break
            final = chunk if chunk.get("usage") else final
            piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if piece:
                first = first or time.perf_counter()
                text.append(piece)
    if first is None or not final:
        raise RuntimeError("the stream ended without text or usage")
    return {"text": "".join(text), "ttft": first - started, "usage": final["usage"], "kv": final["kv"]}


async def converse(base: str, model: str, clients: int, turns: int, turn_tokens: int, max_tokens: int) -> dict:
    """Every client's conversation, concurrently: per turn, each client's measurements."""
    text = load_text("austen:emma", from_chapter_one=True)
    per_turn: list[list[dict]] = [[] for _ in range(turns)]
    errors: list[str] = []
    busy = [0]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 1)) as client:

        async def conversation(index: int) -> None:
            messages: list[dict] = []
            for turn in range(turns):
                messages.append({"role": "user", "content": user_message(text, index, turn, turns, turn_tokens)})
                body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                try:
                    answer = None
                    while answer is None:
                        try:
                            answer = await one_turn(client, f"{base}/v1/chat/completions", body)
                        except Busy as wait:  # documented back-pressure, not an error: wait as told
                            busy[0] += 1
                            await asyncio.sleep(wait.seconds)
                except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
                    errors.append(f"client {index} turn {turn + 1}: {type(exc).__name__}: {exc}"[:200])
                    return
                per_turn[turn].append(answer)
                messages.append({"role": "assistant", "content": answer["text"]})

        await asyncio.gather(*(conversation(i) for i in range(clients)))
    return {"per_turn": per_turn, "errors": errors, "busy": busy[0]}


def bench_turns(
    model: str, serve_args: list[str], kv_memory: int, clients: int, turns: int, turn_tokens: int, max_tokens: int
) -> dict:
    """The conversations with continued caches and without, each on a fresh server; per turn the
    time to first token (p50 over clients), the prompt and cached tokens, the K/V held; per
    server its peak RSS."""
    runs, peak_rss, idle_rss = {}, {}, {}
    for name, keep in (("continued", max(16, clients)), ("fresh", 0)):
        with running_server(model, [*serve_args, "--keep-conversations", str(keep)]) as (base, server):
            idle_rss[name] = psutil.Process(server.pid).memory_info().rss  # the model loaded, no request yet
            sampler = RssSampler(server.pid)
            sampler.start()
            runs[name] = asyncio.run(converse(base, model, clients, turns, turn_tokens, max_tokens))
            sampler.done.set()
            sampler.join()
            peak_rss[name] = sampler.peak
    rows = []
    for turn in range(turns):
        row = {"turn": turn + 1}
        for name, run in runs.items():
            answers = run["per_turn"][turn]
            row[f"{name}_ttft_p50_ms"] = percentile_ms([a["ttft"] for a in answers], 50)
            row[f"{name}_kv_bytes"] = max((a["kv"]["kv_bytes"] for a in answers), default=None)
            row[f"{name}_cached_tokens"] = min(
                (a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers), default=None
            )
        row["prompt_tokens"] = max((a["usage"]["prompt_tokens"] for a in runs["fresh"]["per_turn"][turn]), default=None)
        rows.append(row)
    return {
        "clients": clients,
        "turns": turns,
        "turn_tokens": turn_tokens,
        "max_tokens": max_tokens,
        "turns_table": rows,
        "errors": sum(len(r["errors"]) for r in runs.values()),
        "peak_rss_bytes": peak_rss,
        "idle_rss_bytes": idle_rss,
        "kv_memory_bytes": kv_memory,
        "model_bytes": (weights := model_bytes(model)),
        "rss_within_budget": all(peak < kv_memory + weights for peak in peak_rss.values()),
        "retried_429": {name: run["busy"] for name, run in runs.items()},
        "error_messages": [m for r in runs.values() for m in r["errors"]][:5],
    }


def turns_table(result: dict) -> str:
    """The per-turn table: time to first token and K/V per conversation, continued vs fresh."""
    lines = [
        f"{result['clients']} conversations of {result['turns']} turns (~{result['turn_tokens']} new user tokens and "
        f"up to {result['max_tokens']} generated per turn); continued: idle caches kept, fresh: none kept",
        f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT ms':>9} {'fresh':>9} {'ratio':>6} {'K/V MiB':>8} {'fresh':>8}",
    ]
    for row in result["turns_table"]:
        continued, fresh = row["continued_ttft_p50_ms"], row["fresh_ttft_p50_ms"]
        ratio = f"{continued / fresh:.2f}" if continued and fresh else "-"
        kv = [f"{row[k] / 2**20:.2f}" if row[k] is not None else "-" for k in ("continued_kv_bytes", "fresh_kv_bytes")]
        lines.append(
            f"{row['turn']:>4} {row['prompt_tokens'] or '-':>7} {row['continued_cached_tokens'] or 0:>7} "
            f"{continued or '-':>9} {fresh or '-':>9} {ratio:>6} {kv[0]:>8} {kv[1]:>8}"
        )
    retried = result["retried_429"]
    lines.append(
        f"429s retried after Retry-After: continued {retried['continued']}, fresh {retried['fresh']}; "
        f"errors {result['errors']}"
    )
    rss, idle = result["peak_rss_bytes"], result["idle_rss_bytes"]
    limit = (result["kv_memory_bytes"] + result["model_bytes"]) / 2**20
    lines.append(
        f"peak RSS: continued {rss['continued'] / 2**20:,.0f} MiB, fresh {rss['fresh'] / 2**20:,.0f} MiB "
        f"(limit {limit:,.0f}: --kv-memory + the model; idle before the first request "
        f"{idle['continued'] / 2**20:,.0f} / {idle['fresh'] / 2**20:,.0f})"
    )
    return "\n".join(lines)
