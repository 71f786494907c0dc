"""Admission control and continuous batching for the server.

A request is admitted only when the worst-case K/V bytes of its policy fit in what is left of
the server's ``--kv-memory``; otherwise it waits in a bounded FIFO queue (429 when that is
full, 400 when it could never fit). One scheduler thread owns the model: between two decode
steps it prefills the sequences that were just admitted (one at a time, each into its own
cache), drops the finished and cancelled ones (freeing their K/V and admitting waiters), then
runs one decode step over every active sequence at once (``batching.decode_step``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import Sampling, end_of_sequence_ids, next_tokens
from ..errors import InfinikvError
from ..policies import KVCache, Policy
from ..policies.bct import bytes_per_token
from .batching import decode_step, enable

Event = tuple[str, Any]  # ("text", piece) | ("done", finish_reason) | ("error", message)


class ServeError(Exception):
    """A request the server refuses, as an HTTP status and an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code=None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def worst_case_bytes(policy: Policy, config: Any, prompt_tokens: int, max_new_tokens: int) -> int:
    """The most K/V bytes a request can hold under ``policy``: what admission reserves.

    A layer holds every prompt token until the prefill's eviction, then at most its capacity
    plus the one token a decode step adds before evicting; an unbounded policy (``full``, the
    slow tier of ``offload``/``infinigen``) holds every token. BCT's capacity is its storage.
    """
    total = prompt_tokens + max_new_tokens
    budget = policy.resolve(config) if hasattr(policy, "resolve") else policy.budget
    if budget is None:
        tokens = total
    elif budget.tokens is not None:
        tokens = min(total, max(prompt_tokens, budget.tokens + 1))
    else:
        tokens = min(total, max(prompt_tokens, math.ceil(budget.fraction * total) + 1))
    return tokens * config.num_hidden_layers * bytes_per_token(config)


@dataclass
class Sequence:
    """One request's generation: its prompt, policy and sampling, and the state it moves through."""

    prompt_ids: list[int]
    policy: Policy
    sampling: Sampling
    stop: list[str]
    emit: Callable[[Event], None]  # thread-safe: called from the scheduler thread
    reserved: int = 0  # K/V bytes admission set aside for it
    tokens: list[int] = field(default_factory=list)
    cache: KVCache | None = None
    generator: torch.Generator | None = None
    cancelled: bool = False
    finish_reason: str | None = None
    sent: int = 0  # characters of text already emitted
    kv_bytes: int = 0  # peak K/V bytes its cache held
    fetched_fraction: float | None = None  # for two-tier policies

    @property
    def position(self) -> int:
        """The position of the next token fed to the model."""
        return len(self.prompt_ids) + len(self.tokens) - 1


class Scheduler:
    """Admits requests under the K/V budget and runs them, batched, on one thread."""

    def __init__(self, model: torch.nn.Module, tokenizer, kv_memory: int, max_queue: int) -> None:
        self.model, self.tokenizer = enable(model), tokenizer
        self.kv_memory, self.max_queue = kv_memory, max_queue
        self.eos = end_of_sequence_ids(model, tokenizer)
        self.cond = threading.Condition()
        self.waiting: deque[Sequence] = deque()  # not admitted yet
        self.joining: list[Sequence] = []  # admitted, not prefilled yet
        self.active: list[Sequence] = []  # decoding; only the scheduler thread touches it
        self.reserved = 0
        self.held = 0  # K/V bytes held by live caches, as of the last step
        self.counts: dict[str, int] = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.tokens_generated = 0
        self.steps = 0
        self.max_batch = 0
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last steps
        self.fetched: dict[str, list[float]] = {}  # per two-tier policy: each request's fetched fraction
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="infinikv-scheduler", daemon=True)
        self.thread.start()

    # -- called from the web server's event loop -------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Admit ``seq`` now or queue it; raise ServeError 400 (never fits) or 429 (queue full)."""
        try:
            seq.reserved = worst_case_bytes(
                seq.policy, self.model.config, len(seq.prompt_ids), seq.sampling.max_new_tokens
            )
        except InfinikvError as exc:  # e.g. a bct kv_memory that holds no token of this model
            raise ServeError(400, f"kv: {exc}", param="kv") from None
        if seq.reserved > self.kv_memory:
            with self.cond:
                self.counts["rejected"] += 1
            raise ServeError(
                400,
                f"this request needs up to {seq.reserved / 2**20:.1f} MiB of K/V under {seq.policy!r} "
                f"({len(seq.prompt_ids)} prompt + {seq.sampling.max_new_tokens} new tokens), more than the "
                f"server's --kv-memory of {self.kv_memory / 2**20:.1f} MiB; lower max_tokens or pick a bounded kv "
                "policy",
                param="max_tokens",
                code="kv_budget_exceeded",
            )
        with self.cond:
            if not self.waiting and self.reserved + seq.reserved <= self.kv_memory:
                self._admit(seq)
            elif len(self.waiting) < self.max_queue:
                self.waiting.append(seq)
            else:
                self.counts["rejected"] += 1
                raise ServeError(
                    429,
                    f"the server's K/V budget is in use and its queue is full ({self.max_queue} waiting); retry later",
                    kind="rate_limit_error",
                    code="queue_full",
                )

    def cancel(self, seq: Sequence) -> None:
        """Drop ``seq`` (its client went away): at once if waiting, else before the next step."""
        with self.cond:
            if seq.finish_reason is not None:
                return
            seq.cancelled = True
            if seq in self.waiting:
                self.waiting.remove(seq)
                seq.finish_reason = "cancelled"
                self.counts["cancelled"] += 1
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=30)

    def snapshot(self) -> dict[str, Any]:
        """Numbers for /metrics."""
        now = time.monotonic()
        with self.cond:
            recent = [(t, n) for t, n in self.recent if now - t <= 10]
            return {
                **{f"requests_{k}": v for k, v in self.counts.items()},
                "tokens_generated": self.tokens_generated,
                "tokens_per_second": sum(n for _, n in recent) / 10,
                "kv_bytes_in_use": self.held,
                "kv_bytes_reserved": self.reserved,
                "kv_bytes_budget": self.kv_memory,
                "queue_length": len(self.waiting),
                "active_sequences": len(self.active) + len(self.joining),
                "decode_steps": self.steps,
                "max_batch": self.max_batch,
                "fetch_fraction": {name: sum(f) / len(f) for name, f in self.fetched.items()},
            }

    # -- the scheduler thread --------------------------------------------------------------
    def _admit(self, seq: Sequence) -> None:
        self.reserved += seq.reserved
        self.joining.append(seq)
        self.cond.notify()

    def run(self) -> None:
        while True:
            with self.cond:
                while not (self.joining or self.active or self.stopping):
                    self.cond.wait()
                if self.stopping:
                    return
                joining, self.joining = self.joining, []
            for seq in joining:
                self.active.append(seq)
                if not seq.cancelled:
                    try:
                        self._prefill(seq)
                    except Exception as exc:  # a bug must not take the server down: fail this one
                        self._fail([seq], exc)
            self._retire()
            if self.active:
                try:
                    self._step()
                except Exception as exc:  # ... or every sequence of the failed step
                    self._fail(self.active, exc)
                self._retire()

    def _fail(self, seqs: list[Sequence], exc: Exception) -> None:
        for seq in seqs:
            seq.finish_reason = "error"
            seq.emit(("error", f"generation failed: {type(exc).__name__}: {exc}"))

    @torch.inference_mode()
    def _prefill(self, seq: Sequence) -> None:
        device = next(self.model.parameters()).device
        ids = torch.tensor([seq.prompt_ids], dtype=torch.long, device=device)
        seq.cache = seq.policy.make_cache(self.model)
        if seq.sampling.seed is not None:
            seq.generator = torch.Generator(device=device).manual_seed(seq.sampling.seed)
        out = self.model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(ids.shape[1], device=device)[None],
            cache=seq.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        with self.cond:
            self.held += seq.cache.held_bytes()
        self._advance(seq, out.logits[:, -1])

    def _step(self) -> None:
        batch = self.active
        logits = decode_step(
            self.model, [s.tokens[-1] for s in batch], [s.position for s in batch], [s.cache for s in batch]
        )
        for i, seq in enumerate(batch):
            self._advance(seq, logits[i : i + 1])
        with self.cond:
            self.steps += 1
            self.max_batch = max(self.max_batch, len(batch))
            self.recent.append((time.monotonic(), len(batch)))
            while len(self.recent) > 1 and time.monotonic() - self.recent[0][0] > 10:
                self.recent.popleft()
            self.held = sum(s.cache.held_bytes() for s in self.active)

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Pick ``seq``'s next token from ``logits`` (1, V), emit its text, decide if it is done."""
        token = int(next_tokens(logits, seq.sampling, seq.generator))
        with self.cond:
            self.tokens_generated += 1
        if token in self.eos:
            seq.finish_reason = "stop"
        else:
            seq.tokens.append(token)
            if len(seq.tokens) >= seq.sampling.max_new_tokens:
                seq.finish_reason = "length"
        text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        end = len(text) if seq.finish_reason else _safe_end(text, seq.stop)
        hits = [at for stop in seq.stop if (at := text.find(stop, max(0, seq.sent - len(stop)))) >= 0]
        if hits:
            end, seq.finish_reason = min(hits), "stop"
        if end > seq.sent:
            seq.emit(("text", text[seq.sent : end]))
            seq.sent = end

    def _retire(self) -> None:
        """Free the K/V of finished and cancelled sequences, tell their clients, admit waiters."""
        done = [s for s in self.active if s.finish_reason is not None or s.cancelled]
        if not done:
            return
        self.active = [s for s in self.active if s not in done]
        with self.cond:
            for seq in done:
                if seq.cache is not None:
                    seq.kv_bytes = seq.cache.peak_bytes()
                    summary = seq.cache.transfer_summary()
                    if summary:
                        seq.fetched_fraction = summary["fetched_fraction"]
                        self.fetched.setdefault(seq.policy.name, []).append(summary["fetched_fraction"])
                    seq.cache = None
                self.reserved -= seq.reserved
                outcome = "cancelled" if seq.cancelled else "failed" if seq.finish_reason == "error" else "completed"
                self.counts[outcome] += 1
                if seq.finish_reason is None:
                    seq.finish_reason = "cancelled"
                elif outcome == "completed":
                    seq.emit(("done", seq.finish_reason))
            while self.waiting and self.reserved + self.waiting[0].reserved <= self.kv_memory:
                self._admit(self.waiting.popleft())
            self.held = sum(s.cache.held_bytes() for s in self.active if s.cache is not None)


def _safe_end(text: str, stops: list[str]) -> int:
    """How much of ``text`` can be sent: not a half-decoded character, nor a stop string's start."""
    end = len(text) - 1 if text.endswith("\ufffd") else len(text)
    held = 0
    for stop in stops:
        held = max([held] + [k for k in range(1, min(len(stop), end + 1)) if text[:end].endswith(stop[:k])])
    return end - held
