"""The server's K/V budget: what admitted requests reserved, who waits, and which idle
conversations give way."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch

from ..errors import InfinikvError
from .budget import ProcessBudget
from .conversations import Conversations, Store, conversation_key
from .sequence import Sequence, ServeError

REJECTED = ("kv_budget_exceeded", "queue_full")  # the codes of refusals counted as rejected requests


class Admission:
    """A request is admitted only when the worst case of its policy's K/V (``worst_case_bytes``)
    fits in what is left of ``kv_memory``; otherwise it waits in a FIFO queue of ``max_queue``.
    Idle conversations (``keep_conversations`` at most) count against the budget and give way,
    least recently used first, when a newcomer needs their room (to ``store``, if there is one,
    where a request may find its conversation too). With a process ``budget`` (``serve --memory``)
    the reserved K/V must also fit in what the model, the runtime and the measured rest leave;
    a request alone is admitted on its K/V (it has nobody to wait for). Not locked itself: the
    scheduler calls it under its lock, except ``price``."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_memory: int,
        max_queue: int,
        keep_conversations: int,
        store: Store | None,
        budget: ProcessBudget | None = None,
    ) -> None:
        self.model, self.kv_memory, self.max_queue, self.budget = model, kv_memory, max_queue, budget
        self.conversations = Conversations(keep_conversations, store)
        self.waiting: deque[Sequence] = deque()
        self.reserved = 0

    def price(self, seq: Sequence) -> None:
        """Set ``seq``'s prefill chunk (its policy's), reservation and conversation key; ServeError
        400 if it could never fit."""
        prompt = len(seq.prompt_ids)
        try:
            chunk = seq.policy.prefill_chunk(self.model, prompt)
            seq.reserved = seq.policy.worst_case_bytes(self.model.config, prompt, seq.sampling.max_new_tokens, chunk)
            seq.chunk = chunk or prompt
        except InfinikvError as exc:  # e.g. a kv_memory that holds no token of this model
            raise ServeError(400, f"kv: {exc}", param="kv") from None
        seq.key = conversation_key(seq.policy, seq.sampling, seq.owner)
        most = self.kv_memory if self.budget is None else min(self.kv_memory, self.budget.room(0, alone=True))
        if seq.reserved > most:
            raise ServeError(
                400,
                f"this request needs up to {seq.reserved / 2**20:.1f} MiB of K/V under {seq.policy!r} "
                f"({len(seq.prompt_ids)} prompt + {seq.sampling.max_new_tokens} new tokens), more than the "
                f"server's K/V budget of {most / 2**20:.1f} MiB (--kv-memory, or what --memory leaves beside the "
                "model); lower max_tokens or pick a bounded kv policy",
                param="max_tokens",
                code="kv_budget_exceeded",
            )

    def offer(self, seq: Sequence) -> bool:
        """Admit ``seq`` (True) or queue it (False); ServeError 429 when the queue is full."""
        if not self.waiting and self.fits(seq):
            self.admit(seq)
            return True
        if len(self.waiting) < self.max_queue:
            self.waiting.append(seq)
            return False
        raise ServeError(
            429,
            f"the server's K/V budget is in use and its queue is full ({self.max_queue} waiting); retry later",
            kind="rate_limit_error",
            code="queue_full",
        )

    def fits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s reservation fits beside the running ones'; idle conversations make
        room, least recently used first (not the one ``seq`` continues, whose K/V it takes over)."""
        room = self.kv_memory - self.reserved - seq.reserved
        if self.budget is not None:
            room = min(room, self.budget.room(self.reserved + seq.reserved, alone=not self.reserved))
        if room < 0:
            return False
        self.conversations.make_room(room, self.conversations.match(seq.key, seq.prompt_ids))
        return True

    def admit(self, seq: Sequence) -> None:
        index = self.conversations.match(seq.key, seq.prompt_ids)
        if index is not None:
            seq.resumed = self.conversations.take(index)
            seq.reused = len(seq.resumed.tokens)
        elif self.conversations.store is not None:
            seq.stored = self.conversations.store.match(seq.key, seq.prompt_ids)
            seq.reused = seq.stored.tokens if seq.stored else 0
        self.reserved += seq.reserved

    def resume(self, seq: Sequence) -> None:
        """Give ``seq`` the cache it continues: the idle one admission took, or the stored one read
        back (none if it cannot be: then it is prefilled whole). The scheduler's thread, unlocked."""
        if seq.resumed is not None:
            seq.batch, seq.prefilled, seq.resumed = seq.resumed.batch, seq.reused, None
        elif seq.stored is not None:
            seq.batch = self.conversations.store.restore(seq.stored, seq.policy)
            seq.prefilled = seq.reused = seq.stored.tokens if seq.batch is not None else 0
            seq.stored = None

    def release(self, seq: Sequence) -> None:
        self.reserved -= seq.reserved

    def admit_waiting(self) -> Iterator[Sequence]:
        """The waiting requests that now fit, in order, admitted."""
        while self.waiting and self.fits(self.waiting[0]):
            seq = self.waiting.popleft()
            self.admit(seq)
            yield seq
