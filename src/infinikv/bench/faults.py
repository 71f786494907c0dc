"""``infinikv bench serve --turns T --kill-after N``: many conversations under a small budget, and
the server killed (SIGKILL) in the middle and restarted on the same store.

Every client holds a chat of ``turns`` turns that opens with a document; a 429 is waited out as its
``Retry-After`` says, and a turn cut by the kill is sent again once the server is back. After
``kill_after`` turns have been answered in all, the server is killed without warning and a new one
started on the same port and conversation store; the run then shows what survived: the
conversations the store held at the kill, how many of them the new server resumed, and whether any
entry failed to load (a failure is a fresh prefill, never an error).
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import asdict

from .server import free_port, rss_limit, server_numbers, start_server, stop_server
from .serving import RssSampler, model_bytes, percentile_ms
from .turns import ChatLoad, Chats, converse


def bench_faults(
    model: str,
    serve_args: list[str],
    kv_memory: int,
    load: ChatLoad,
    kill_after: int,
    store: str | None = None,
    memory: int | None = None,
) -> dict:
    """Run the conversations on a server with a store (``store``, else a temporary directory),
    kill it after ``kill_after`` answered turns, restart it, let the conversations finish."""
    with tempfile.TemporaryDirectory(prefix="infinikv-store-") as scratch:
        return asyncio.run(_run(model, serve_args, store or scratch, kv_memory, load, kill_after, memory))


async def _run(
    model: str, serve_args: list[str], store: str, kv_memory: int, load: ChatLoad, kill_after: int, memory: int | None
) -> dict:
    flags, port = [*serve_args, "--store", store], free_port()
    base, server = await asyncio.to_thread(start_server, model, flags, port)
    samplers = [RssSampler(server.pid)]
    samplers[0].start()
    chats = Chats([[] for _ in range(load.turns)])
    talk = asyncio.create_task(converse(base, model, load, chats, survive=600))
    while chats.completed < kill_after and not talk.done():
        await asyncio.sleep(0.05)
    at_kill = await asyncio.to_thread(server_numbers, base)
    answered_at_kill = chats.completed
    server.kill()
    await asyncio.to_thread(server.wait)
    base, server = await asyncio.to_thread(start_server, model, flags, port)
    samplers.append(RssSampler(server.pid))
    samplers[1].start()
    await talk
    after = await asyncio.to_thread(server_numbers, base)
    await asyncio.to_thread(stop_server, server)
    for sampler in samplers:
        sampler.done.set()
        sampler.join()
    weights = model_bytes(model)
    limit = rss_limit(kv_memory, memory, weights)
    peak = max(s.peak for s in samplers)
    answers = [a for turn in chats.per_turn for a in turn]
    return {
        **asdict(load),
        "turns_answered": chats.completed,
        "turns_asked": load.clients * load.turns,
        "errors": len(chats.errors),
        "retried_429": chats.busy,
        "interrupted": chats.interrupted,
        "answered_at_kill": answered_at_kill,
        "stored_at_kill": int(after["store_inherited"]),  # what the killed server left, found at the restart
        "resumed_from_before_kill": int(after["store_resumed_total"]),
        "restored_by_new_server": int(after["store_restores_total"]),
        "evicted_by_new_server": int(after["store_evicted_total"]),
        "store_failures_after_kill": int(after["store_failures_total"]),
        "most_decoding_at_once": int(max(at_kill["batch_size_max"], after["batch_size_max"])),
        "ttft_p50_ms": percentile_ms([a["ttft"] for a in answers], 50),
        "ttft_p99_ms": percentile_ms([a["ttft"] for a in answers], 99),
        "cached_tokens": sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers),
        "prompt_tokens": sum(a["usage"]["prompt_tokens"] for a in answers),
        "peak_rss_bytes": peak,
        "memory_bytes_base": [int(n["memory_bytes_base"]) for n in (at_kill, after)],  # each server's (--memory)
        "memory_bytes_rest": [int(n["memory_bytes_rest"]) for n in (at_kill, after)],
        "kv_memory_bytes": kv_memory,
        "model_bytes": weights,
        **limit,
        "rss_within_budget": peak < limit["rss_limit_bytes"],
        "error_messages": chats.errors[:5],
    }


def faults_table(r: dict) -> str:
    """What the run delivered and what survived the kill."""
    return "\n".join(
        [
            f"{r['clients']} conversations of {r['turns']} turns, each opening with a {r['document_tokens']}-token "
            f"document: {r['turns_answered']}/{r['turns_asked']} turns answered whole, {r['errors']} errors, "
            f"{r['retried_429']} 429s waited out, {r['interrupted']} turns sent again after the kill",
            f"killed (SIGKILL) after {r['answered_at_kill']} answered turns with {r['stored_at_kill']} conversations "
            f"in the store, {r['resumed_from_before_kill']} of them resumed by the new server (which restored "
            f"{r['restored_by_new_server']} in all, evicted {r['evicted_by_new_server']}); "
            f"{r['store_failures_after_kill']} entries failed to load",
            f"most decoding at once {r['most_decoding_at_once']}; time to first token p50 {r['ttft_p50_ms']} ms, "
            f"p99 {r['ttft_p99_ms']} ms; {r['cached_tokens']:,} of {r['prompt_tokens']:,} prompt tokens continued",
            f"peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB (limit {r['rss_limit_bytes'] / 2**20:,.0f}: "
            f"{r['rss_limit']})",
        ]
    )
