"""Admission control and continuous batching for the server, on the decode core.

A request is admitted only when the worst-case K/V bytes of its policy fit in what is left of
the server's ``--kv-memory`` (the policy says how many: ``worst_case_bytes``); otherwise it
waits in a bounded FIFO queue (429 when that is full, 400 when it could never fit). One
scheduler thread owns the model and alternates one prefill chunk with one decode step of every
running sequence (see ``Scheduler``); finished and cancelled sequences leave their batch before
the next step, freeing their K/V and admitting waiters. A completed request's cache may stay, idle,
for its conversation's next turn (``conversations``): idle caches count against the budget and
give way, least recently used first, when admission needs the room. Policies arrive built and
prepared (``catalog``): nothing here runs a calibration.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from .. import memory
from ..compiled import resolve
from ..core import Batch, step_together
from ..engine import end_of_sequence_ids
from ..text import Detokenizer
from .admission import REJECTED, Admission
from .budget import ProcessBudget
from .conversations import Conversation, Store, detach
from .sequence import Group, Sequence, ServeError, pick


class Scheduler:
    """Admits requests under the K/V budget and runs them on the decode core, on one thread.

    Each loop runs at most one prefill chunk (of the oldest request still being prefilled), then
    one decode step of every running sequence: a long prompt never stalls the running streams for
    more than a chunk. While sequences are decoding, a chunk is sized to take about as long as a
    decode step (from the rates measured so far, at most ``prefill_chunk`` tokens), so the gap
    between two tokens of a stream at most doubles; with nothing decoding it is ``prefill_chunk``.
    Sequences whose policies share a spec share a batch and a cache, so their attention runs
    batched; different specs share the forward's dense parts.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        kv_memory: int,
        max_queue: int,
        prefill_chunk: int = 512,
        compile: bool | str = "auto",
        keep_conversations: int = 16,
        store: Store | None = None,
        budget: ProcessBudget | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.admission = Admission(model, kv_memory, max_queue, keep_conversations, store, budget)
        self.prefill_chunk, self.compile = prefill_chunk, compile
        self.eos = end_of_sequence_ids(model, tokenizer)
        self.cond = threading.Condition()
        self.joining: list[Sequence] = []  # admitted, not started yet
        self.prefilling: list[Sequence] = []  # only the scheduler thread touches these two
        self.groups: dict[str, Group] = {}
        self.held = 0  # K/V bytes held by live caches, as of the last step
        self.counts: dict[str, int] = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.tokens_generated = 0
        self.steps = 0
        self.max_batch = 0
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last steps
        self.fetched: dict[str, list[float]] = {}  # per two-tier policy: each request's fetched fraction
        self.step_seconds = 0.0  # a decode step's duration, smoothed
        self.prefill_rate = 0.0  # prompt tokens prefilled per second, smoothed
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="infinikv-scheduler", daemon=True)
        self.thread.start()

    # -- called from the web server's event loop -------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Admit ``seq`` now or queue it; raise ServeError 400 (never fits) or 429 (queue full)."""
        try:
            self.admission.price(seq)
            with self.cond:
                if self.admission.offer(seq):
                    self.joining.append(seq)
                    self.cond.notify()
        except ServeError as exc:
            if exc.code in REJECTED:
                with self.cond:
                    self.counts["rejected"] += 1
            raise

    def cancel(self, seq: Sequence) -> None:
        """Drop ``seq`` (its client went away): at once if waiting, else before the next step."""
        with self.cond:
            if seq.finish_reason is not None:
                return
            seq.cancelled = True
            if seq in self.admission.waiting:
                self.admission.waiting.remove(seq)
                seq.finish_reason = "cancelled"
                self.counts["cancelled"] += 1
            self.cond.notify()

    def close(self) -> None:
        """Stop the loop; with a store, the idle conversations are written to it."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=30)
        with self.cond:
            self.admission.conversations.drop_all()
        self.admission.conversations.spill(self.cond)

    @property
    def active_count(self) -> int:
        return len(self.joining) + len(self.prefilling) + sum(len(g.seqs) for g in self.groups.values())

    # -- the scheduler thread --------------------------------------------------------------
    def run(self) -> None:
        while True:
            with self.cond:
                while not (self.joining or self.prefilling or self.groups or self.stopping):
                    self.cond.wait()
                if self.stopping:
                    return
                joining, self.joining = self.joining, []
            self.prefilling.extend(joining)
            self._guard(self.prefilling[:1], self._prefill_chunk)
            self._retire()
            if self.groups:
                self._guard([s for g in self.groups.values() for s in g.seqs], self._step)
                self._retire()
            self.admission.conversations.spill(self.cond)

    def _guard(self, seqs: list[Sequence], work: Callable[[], None]) -> None:
        """Run ``work``; a failure fails ``seqs`` (the requests it was for), never the server."""
        if not seqs:
            return
        try:
            work()
        except Exception as exc:
            for seq in seqs:
                seq.finish_reason = "error"
                seq.emit(("error", f"generation failed: {type(exc).__name__}: {exc}"))

    @torch.inference_mode()
    def _prefill_chunk(self) -> None:
        """Feed the next chunk of the oldest prompt still being prefilled."""
        seq = self.prefilling[0]
        if seq.cancelled:
            return
        if seq.batch is None:
            self.admission.resume(seq)  # a conversation's next turn: only its new tokens are fed
            if seq.batch is None:
                length = len(seq.prompt_ids) + seq.sampling.max_new_tokens
                compile = resolve(self.compile, self.model, seq.policy, 1, length) and seq.policy.compilable
                seq.batch = Batch(self.model, seq.policy, compile, max_length=length)
                seq.batch.expect([seq.prompt_ids])  # a --budget fraction is of the whole prompt
            seq.generator = seq.sampling.generator(seq.batch.device)
            seq.detokenizer = Detokenizer(self.tokenizer)
        end = seq.prefilled + min(self.chunk_size(), seq.chunk)
        ids = torch.tensor([seq.prompt_ids[seq.prefilled : end]], device=seq.batch.device)
        started = time.perf_counter()
        logits = seq.batch.feed(ids)
        self.prefill_rate = smooth(self.prefill_rate, ids.shape[1] / (time.perf_counter() - started))
        seq.prefilled = min(end, len(seq.prompt_ids))
        if seq.prefilled < len(seq.prompt_ids):
            return
        seq.batch.prompt_read()
        self._advance(seq, int(pick(logits, [seq])[0]))
        if seq.finish_reason is None:  # it joins the running sequences (else _retire reports it)
            self.prefilling.remove(seq)
            key = json.dumps(seq.policy.spec(), sort_keys=True)
            group = self.groups.get(key)
            if group is None:
                self.groups[key] = Group(seq.batch, [seq])
            else:
                group.batch.append(seq.batch)
                group.seqs.append(seq)
            seq.batch = None
        self._count_held()
        self._observe()

    def chunk_size(self) -> int:
        """Prompt tokens for the next prefill chunk: about one decode step's worth while streams run."""
        if not self.groups or not self.prefill_rate or not self.step_seconds:
            return self.prefill_chunk
        return min(self.prefill_chunk, max(16, round(self.prefill_rate * self.step_seconds)))

    def _step(self) -> None:
        groups = list(self.groups.values())
        tokens = [torch.tensor([s.tokens[-1] for s in g.seqs], device=g.batch.device) for g in groups]
        started = time.perf_counter()
        logits = step_together([g.batch for g in groups], tokens)
        self.step_seconds = smooth(self.step_seconds, time.perf_counter() - started)
        seqs = [seq for group in groups for seq in group.seqs]
        picked = torch.cat([pick(rows, group.seqs) for group, rows in zip(groups, logits, strict=True)])
        for seq, token in zip(seqs, picked.tolist(), strict=True):  # the step's one read of the device
            seq.fed += 1
            self._advance(seq, token)
        batch = len(seqs)
        with self.cond:
            self.steps += 1
            self.max_batch = max(self.max_batch, batch)
            self.recent.append((time.monotonic(), batch))
            while len(self.recent) > 1 and time.monotonic() - self.recent[0][0] > 10:
                self.recent.popleft()
        self._count_held()
        self._observe()

    def _observe(self) -> None:
        """Under ``serve --memory``: what the forward just run took beyond the K/V held."""
        if self.admission.budget is not None:
            self.admission.budget.observe(self.held + self.admission.conversations.bytes)

    def _count_held(self) -> None:
        held = sum(g.batch.cache.held_bytes() for g in self.groups.values())
        held += sum(s.batch.cache.held_bytes() for s in self.prefilling if s.batch is not None)
        with self.cond:
            self.held = held

    def _advance(self, seq: Sequence, token: int) -> None:
        with self.cond:
            self.tokens_generated += 1
        seq.add(token, self.eos)

    def _retire(self) -> None:
        """Free the K/V of finished and cancelled sequences, tell their clients, admit waiters."""
        done: list[Sequence] = []
        kept: list[Conversation] = []
        for seq in list(self.prefilling):
            if seq.finish_reason is not None or seq.cancelled:
                self.prefilling.remove(seq)
                if seq.batch is not None:
                    self._record(seq, seq.batch.cache, 0)
                    if self._keeps(seq):
                        kept.append(self._conversation(seq, seq.batch))
                done.append(seq)
        for key, group in list(self.groups.items()):
            keep = [i for i, s in enumerate(group.seqs) if s.finish_reason is None and not s.cancelled]
            if len(keep) == len(group.seqs):
                continue
            for i, seq in enumerate(group.seqs):
                if i not in keep:
                    self._record(seq, group.batch.cache, i)
                    if self._keeps(seq):  # its row alone: the batch itself when no other row is left
                        alone = group.batch if len(group.seqs) == 1 else detach(group.batch, i)
                        kept.append(self._conversation(seq, alone))
                    done.append(seq)
            if keep:
                group.batch.keep(keep)
                group.seqs = [group.seqs[i] for i in keep]
            else:
                del self.groups[key]
        if not done:
            return
        memory.give_back()  # their K/V and copies, freed to the C heap, back to the system
        with self.cond:
            for conversation in kept:
                self.admission.conversations.put(conversation)
            for seq in done:
                seq.batch = None
                self.admission.release(seq)
                outcome = "cancelled" if seq.cancelled else "failed" if seq.finish_reason == "error" else "completed"
                self.counts[outcome] += 1
                if seq.finish_reason is None:
                    seq.finish_reason = "cancelled"
                elif outcome == "completed":
                    seq.emit(("done", seq.finish_reason))
            self.joining.extend(self.admission.admit_waiting())
            self.cond.notify()
        self._count_held()

    def _keeps(self, seq: Sequence) -> bool:
        """Whether ``seq``'s cache is kept for its conversation's next turn: it completed, and
        conversations are kept (in RAM or in the store)."""
        return self.admission.conversations.keeps and not seq.cancelled and seq.finish_reason != "error"

    def _conversation(self, seq: Sequence, batch: Batch) -> Conversation:
        """``seq``'s cache (``batch``, its row alone) as an idle conversation."""
        tokens = seq.prompt_ids + seq.tokens[: seq.fed]
        return Conversation(seq.key, tokens, batch, batch.cache.held_bytes())

    def _record(self, seq: Sequence, cache, row: int) -> None:
        """What a finished request's K/V did, for its response and /metrics."""
        seq.kv_bytes = cache.row_peak_bytes(row)
        summary = cache.transfer_summary([row])
        if summary:
            seq.fetched_fraction = summary["fetched_fraction"]
            with self.cond:
                self.fetched.setdefault(seq.policy.name, []).append(summary["fetched_fraction"])


def smooth(average: float, value: float, weight: float = 0.2) -> float:
    """An exponential moving average (the first value as it is)."""
    return value if not average else (1 - weight) * average + weight * value
