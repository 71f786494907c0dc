"""``/metrics``: what each replica publishes, gathered across replicas, in Prometheus's text format."""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from .. import memory
from .budget import ProcessBudget
from .scheduler import Scheduler
from .store import ConversationStore


class Peers(Protocol):
    """The other replicas of one deployment (``serve.replicas``): /metrics shows every replica.
    Both calls block (a thread of their own calls them, not the event loop)."""

    def publish(self, numbers: dict[str, Any]) -> None:
        """Share this replica's numbers (called every ``PUBLISH_SECONDS``)."""
        ...

    def gather(self, numbers: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Every live replica's numbers by replica name, this one's (``numbers``) fresh."""
        ...


PUBLISH_SECONDS = 1.0
BUDGET_NUMBERS = ("memory_bytes_budget", "memory_bytes_base", "memory_bytes_rest")
STORE_NUMBERS = (
    "store_conversations",
    "store_bytes",
    "store_writes",
    "store_restores",
    "store_failures",
    "store_evicted",
    "store_bytes_written",
    "store_bytes_restored",
    "store_inherited",
    "store_resumed",
)


def snapshot(scheduler: Scheduler) -> dict[str, Any]:
    """What a replica publishes for /metrics: requests, tokens, K/V held and reserved, the queue,
    batching, fetches, kept conversations and the process's resident memory (what ``--kv-memory``
    does not count: weights, temporaries, the allocator's growth)."""
    now = time.monotonic()
    with scheduler.cond:
        recent = [(t, n) for t, n in scheduler.recent if now - t <= 10]
        return {
            **{f"requests_{k}": v for k, v in scheduler.counts.items()},
            "tokens_generated": scheduler.tokens_generated,
            "tokens_per_second": sum(n for _, n in recent) / 10,
            "kv_bytes_in_use": scheduler.held,
            "kv_bytes_reserved": scheduler.admission.reserved,
            "kv_bytes_budget": scheduler.admission.kv_memory,
            "queue_length": len(scheduler.admission.waiting),
            "active_sequences": scheduler.active_count,
            "decode_steps": scheduler.steps,
            "max_batch": scheduler.max_batch,
            "fetch_fraction": {name: sum(f) / len(f) for name, f in scheduler.fetched.items()},
            "conversations_kept": len(scheduler.admission.conversations.idle),
            "kv_bytes_kept": scheduler.admission.conversations.bytes,
            "reuse_hits": scheduler.admission.conversations.hits,
            "reuse_tokens_saved": scheduler.admission.conversations.tokens_saved,
            "conversations_dropped": scheduler.admission.conversations.dropped,
            "resident_bytes": memory.rss(),
            "resident_bytes_peak": memory.highest(),
            **store_numbers(scheduler.admission.conversations.store),
            **budget_numbers(scheduler.admission.budget),
        }


def store_numbers(store: ConversationStore | None) -> dict[str, int]:
    """The conversation store's entries, bytes and what it did (zeros without a store)."""
    if store is None:
        return dict.fromkeys(STORE_NUMBERS, 0)
    entries, size = store.size()
    counts = (store.writes, store.restores, store.failures, store.evicted, store.bytes_written, store.bytes_restored)
    counts += (len(store.inherited), store.resumed)
    return dict(zip(STORE_NUMBERS, (entries, size, *counts), strict=True))


def budget_numbers(budget: ProcessBudget | None) -> dict[str, int]:
    """``serve --memory``: the budget, the resident base and the measured rest (zeros without)."""
    return dict.fromkeys(BUDGET_NUMBERS, 0) if budget is None else budget.numbers()


def publish(peers: Peers, scheduler: Scheduler, stop: threading.Event) -> None:
    """Share this replica's numbers with its peers every ``PUBLISH_SECONDS`` until ``stop``."""
    while not stop.wait(PUBLISH_SECONDS):
        try:
            peers.publish(snapshot(scheduler))
        except Exception:  # a board that is gone (the driver left) must not stop the replica
            pass


def prometheus(replicas: dict[str, dict[str, Any]]) -> str:
    """The schedulers' numbers in Prometheus' text format, one sample per replica (labelled
    ``replica`` unless the server is one process, whose name is "")."""

    def labels(replica: str, **more: str) -> str:
        pairs = {**more, **({"replica": replica} if replica else {})}
        return "{" + ",".join(f'{k}="{v}"' for k, v in pairs.items()) + "}" if pairs else ""

    lines = [
        "# HELP infinikv_requests_total Requests by outcome (rejected: 400 never fits or 429 queue full).",
        "# TYPE infinikv_requests_total counter",
    ]
    for outcome in ("completed", "cancelled", "failed", "rejected"):
        for replica, numbers in replicas.items():
            lines.append(f"infinikv_requests_total{labels(replica, outcome=outcome)} {numbers[f'requests_{outcome}']}")
    metrics = [
        ("tokens_generated_total", "counter", "Tokens generated.", "tokens_generated"),
        ("tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.", "tokens_per_second"),
        ("kv_bytes_in_use", "gauge", "K/V bytes held by the caches of running sequences.", "kv_bytes_in_use"),
        ("kv_bytes_reserved", "gauge", "K/V bytes admission reserved (worst case per request).", "kv_bytes_reserved"),
        ("kv_bytes_budget", "gauge", "The server's K/V budget (--kv-memory).", "kv_bytes_budget"),
        ("queue_length", "gauge", "Requests waiting for K/V budget.", "queue_length"),
        ("active_sequences", "gauge", "Sequences admitted and generating.", "active_sequences"),
        ("decode_steps_total", "counter", "Batched decode steps run.", "decode_steps"),
        ("batch_size_max", "gauge", "The most sequences one decode step has run.", "max_batch"),
        ("conversations_kept", "gauge", "Idle conversations whose caches are kept.", "conversations_kept"),
        ("kv_bytes_kept", "gauge", "K/V bytes the idle conversations hold.", "kv_bytes_kept"),
        ("reuse_hits_total", "counter", "Requests that continued a kept conversation.", "reuse_hits"),
        ("reuse_tokens_saved_total", "counter", "Prompt tokens not prefilled, continued.", "reuse_tokens_saved"),
        ("conversations_dropped_total", "counter", "Idle conversations dropped (LRU).", "conversations_dropped"),
        ("resident_bytes", "gauge", "The process's resident memory: weights, caches and the rest.", "resident_bytes"),
        ("resident_bytes_peak", "gauge", "The most the process has held resident.", "resident_bytes_peak"),
        ("memory_bytes_budget", "gauge", "The process's budget (--memory; 0: none).", "memory_bytes_budget"),
        ("memory_bytes_base", "gauge", "Resident before any request: the model, the runtime.", "memory_bytes_base"),
        ("memory_bytes_rest", "gauge", "Most measured beyond the base and the K/V held.", "memory_bytes_rest"),
        ("store_conversations", "gauge", "Conversations in the store on disk (--store).", "store_conversations"),
        ("store_bytes", "gauge", "Bytes the store's entries take on disk.", "store_bytes"),
        ("store_writes_total", "counter", "Conversations written to the store.", "store_writes"),
        ("store_restores_total", "counter", "Conversations restored from the store.", "store_restores"),
        ("store_failures_total", "counter", "Entries not written or not restored (prefilled).", "store_failures"),
        ("store_evicted_total", "counter", "Entries deleted to keep --store-size (LRU).", "store_evicted"),
        ("store_bytes_written_total", "counter", "Bytes written to the store.", "store_bytes_written"),
        ("store_bytes_restored_total", "counter", "Bytes read back from the store.", "store_bytes_restored"),
        ("store_inherited", "gauge", "Entries the store held when this process started.", "store_inherited"),
        ("store_resumed_total", "counter", "Entries from before this process restored.", "store_resumed"),
    ]
    for name, kind, help_text, key in metrics:
        lines += [f"# HELP infinikv_{name} {help_text}", f"# TYPE infinikv_{name} {kind}"]
        lines += [f"infinikv_{name}{labels(replica)} {number(numbers[key])}" for replica, numbers in replicas.items()]
    lines += [
        "# HELP infinikv_fetch_fraction Mean share of the tokens seen fetched per decode step, by two-tier policy.",
        "# TYPE infinikv_fetch_fraction gauge",
    ]
    for replica, numbers in replicas.items():
        for policy, fraction in sorted(numbers["fetch_fraction"].items()):
            lines.append(f"infinikv_fetch_fraction{labels(replica, policy=policy)} {number(fraction)}")
    return "\n".join(lines) + "\n"


def number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"
