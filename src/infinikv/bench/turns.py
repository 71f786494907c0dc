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
from dataclasses import asdict, dataclass, field

import httpx
import psutil

from ..data import load_text
from .server import rss_limit, running_server
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


@dataclass(frozen=True)
class ChatLoad:
    """What the clients do: ``clients`` chats of ``turns`` turns, each turn a new user message of
    about ``turn_tokens`` tokens (the first, with ``document_tokens``, a document of that many) and
    an answer of up to ``max_tokens``."""

    clients: int
    turns: int
    turn_tokens: int
    max_tokens: int
    document_tokens: int = 0


@dataclass
class Chats:
    """What the clients saw, as it happens (a fault injector watches ``completed``)."""

    per_turn: list[list[dict]]  # per turn, each client's answer: text, ttft, usage, kv
    errors: list[str] = field(default_factory=list)
    busy: int = 0  # 429s waited out as their Retry-After said
    interrupted: int = 0  # turns cut by a lost connection, sent again
    completed: int = 0  # turns answered whole


async def ask(client: httpx.AsyncClient, url: str, body: dict, chats: Chats, survive: float) -> dict:
    """One turn answered whole: 429s waited out as told, and while the server is down (connections
    fail) the turn sent again every half second for up to ``survive`` seconds. The window opens at
    the first failure, not when the turn was first sent: a turn may wait out 429s for longer than
    ``survive`` before a kill."""
    down_since = None
    while True:
        try:
            return await one_turn(client, url, body)
        except Busy as wait:  # documented back-pressure, not an error; the server is up
            chats.busy += 1
            down_since = None
            await asyncio.sleep(wait.seconds)
        except httpx.TransportError:
            down_since = down_since or time.monotonic()
            if time.monotonic() - down_since >= survive:
                raise
            chats.interrupted += 1
            await asyncio.sleep(0.5)


async def converse(base: str, model: str, load: ChatLoad, chats: Chats | None = None, survive: float = 0) -> Chats:
    """Every client's conversation, concurrently, into ``chats``; ``survive``: how long a turn is sent
    again while its connection fails (``ask``)."""
    text = load_text("austen:emma", from_chapter_one=True)
    chats = chats or Chats([[] for _ in range(load.turns)])
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=load.clients + 1)) as client:

        async def conversation(index: int) -> None:
            messages: list[dict] = []
            for turn in range(load.turns):
                size = load.document_tokens if turn == 0 and load.document_tokens else load.turn_tokens
                messages.append({"role": "user", "content": user_message(text, index, turn, load.turns, size)})
                body = {"model": model, "messages": messages, "max_tokens": load.max_tokens, "temperature": 0}
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                try:
                    answer = await ask(client, f"{base}/v1/chat/completions", body, chats, survive)
                except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
                    chats.errors.append(f"client {index} turn {turn + 1}: {type(exc).__name__}: {exc}"[:200])
                    return
                chats.per_turn[turn].append(answer)
                chats.completed += 1
                messages.append({"role": "assistant", "content": answer["text"]})

        await asyncio.gather(*(conversation(i) for i in range(load.clients)))
    return chats


def bench_turns(
    model: str,
    serve_args: list[str],
    kv_memory: int,
    load: ChatLoad,
    memory: int | None = None,
) -> dict:
    """The conversations with continued caches and without, each on a fresh server; per turn the
    time to first token (p50 over clients), the prompt and cached tokens, the K/V held; per
    server its peak RSS (against ``rss_limit``)."""
    runs, peak_rss, idle_rss = {}, {}, {}
    for name, keep in (("continued", max(16, load.clients)), ("fresh", 0)):
        with running_server(model, [*serve_args, "--keep-conversations", str(keep)]) as (base, server):
            idle_rss[name] = psutil.Process(server.pid).memory_info().rss  # the model loaded, no request yet
            sampler = RssSampler(server.pid)
            sampler.start()
            runs[name] = asyncio.run(converse(base, model, load))
            sampler.done.set()
            sampler.join()
            peak_rss[name] = sampler.peak
    rows = []
    for turn in range(load.turns):
        row = {"turn": turn + 1}
        for name, run in runs.items():
            answers = run.per_turn[turn]
            row[f"{name}_ttft_p50_ms"] = percentile_ms([a["ttft"] for a in answers], 50)
            row[f"{name}_kv_bytes"] = max((a["kv"]["kv_bytes"] for a in answers), default=None)
            row[f"{name}_cached_tokens"] = min(
                (a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers), default=None
            )
        row["prompt_tokens"] = max((a["usage"]["prompt_tokens"] for a in runs["fresh"].per_turn[turn]), default=None)
        rows.append(row)
    return {
        **asdict(load),
        "turns_table": rows,
        "errors": sum(len(r.errors) for r in runs.values()),
        "peak_rss_bytes": peak_rss,
        "idle_rss_bytes": idle_rss,
        "kv_memory_bytes": kv_memory,
        "model_bytes": (weights := model_bytes(model)),
        **(limit := rss_limit(kv_memory, memory, weights)),
        "rss_within_budget": all(peak < limit["rss_limit_bytes"] for peak in peak_rss.values()),
        "retried_429": {name: run.busy for name, run in runs.items()},
        "error_messages": [m for r in runs.values() for m in r.errors][:5],
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
    lines.append(
        f"peak RSS: continued {rss['continued'] / 2**20:,.0f} MiB, fresh {rss['fresh'] / 2**20:,.0f} MiB "
        f"(limit {result['rss_limit_bytes'] / 2**20:,.0f}: {result['rss_limit']}; idle before the first request "
        f"{idle['continued'] / 2**20:,.0f} / {idle['fresh'] / 2**20:,.0f})"
    )
    return "\n".join(lines)
