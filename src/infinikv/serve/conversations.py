"""Conversations that continue their cache: a chat client resends the whole conversation every
turn, so the server keeps each finished request's cache, idle, and a request whose prompt begins
with what such a cache has seen continues it, prefilling only the new tokens.

For ``full`` this is prefix reuse: the same K/V as the whole conversation prefilled fresh. For a
bounded cache it is the cache the conversation built as it went, which is what constant memory
means: a fresh prefill of the whole conversation would evict differently (it sees every turn at
once, and a ``--budget`` fraction is of that prompt). Matching is by tokens and by a key of the
owner (the API key that sent it), the policy spec and the sampling, so requests that differ in
any never share a cache. The idle
caches count against the server's K/V budget and are dropped least recently used when admission
needs their room, or past ``keep`` of them (0: nothing is kept in RAM). With a store
(``serve --store``) a conversation leaving RAM is written to disk instead of dropped
(``store.ConversationStore``): by the scheduler's thread, in ``spill``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch

from ..cache.rows import copy_row
from ..core import Batch, Sampling
from ..policies import Policy


def conversation_key(policy: Policy, sampling: Sampling, owner: str) -> str:
    """What two requests must share to share a cache: the owner (one API key's requests never
    continue, nor time, another's cache), the policy spec and the sampling."""
    return json.dumps([owner, policy.spec(), sampling.temperature, sampling.top_p, sampling.seed], sort_keys=True)


@dataclass
class Conversation:
    """A finished request's cache, idle: ``tokens`` is what it has seen, in order."""

    key: str
    tokens: list[int]
    batch: Batch
    bytes: int


def detach(batch: Batch, row: int) -> Batch:
    """Row ``row`` of ``batch`` as a batch of its own (a copy: the other rows go on decoding)."""
    model = batch.model
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())} | {id(model): model}
    with torch.inference_mode():
        alone = Batch(model, batch.policy, batch.compile, cache=copy_row(batch.cache, row, shared))
        alone.next_position = batch.next_position[row : row + 1].clone()
    return alone


@dataclass
class Entry:
    """A stored conversation found for a prompt: its id and how many tokens it has seen."""

    id: str
    tokens: int


class Store(Protocol):
    """Where conversations that leave RAM go (``store.ConversationStore``)."""

    def put(self, conversation: Conversation) -> None: ...

    def match(self, key: str, prompt: list[int]) -> Entry | None: ...

    def restore(self, entry: Entry, policy: Policy) -> Batch | None: ...


class Conversations:
    """Idle conversations, least recently used first, with what reusing them saved."""

    def __init__(self, keep: int, store: Store | None = None) -> None:
        self.keep, self.store = keep, store
        self.idle: OrderedDict[int, Conversation] = OrderedDict()
        self.leaving: list[Conversation] = []  # out of RAM, for the store to write
        self.bytes = 0  # K/V the idle caches hold
        self.added = 0
        self.hits = self.tokens_saved = self.dropped = 0

    def put(self, conversation: Conversation) -> None:
        """Keep ``conversation`` (the newest); past ``keep`` of them the oldest goes."""
        self.idle[self.added] = conversation
        self.added += 1
        self.bytes += conversation.bytes
        while len(self.idle) > self.keep:
            self._drop(next(iter(self.idle)))

    def match(self, key: str, prompt: list[int]) -> int | None:
        """The idle conversation with ``key`` whose tokens are the longest proper prefix of ``prompt``."""
        best, longest = None, 0
        for index, c in self.idle.items():
            n = len(c.tokens)
            if c.key == key and longest < n < len(prompt) and prompt[:n] == c.tokens:
                best, longest = index, n
        return best

    def make_room(self, budget: int, keeping: int | None) -> None:
        """Drop idle conversations, least recently used first, until those left (but ``keeping``,
        which a request is about to continue) hold at most ``budget`` bytes."""
        spared = self.idle[keeping].bytes if keeping is not None else 0
        for index in list(self.idle):
            if self.bytes - spared <= budget:
                return
            if index != keeping:
                self._drop(index)

    def take(self, index: int) -> Conversation:
        conversation = self.idle.pop(index)
        self.bytes -= conversation.bytes
        self.hits += 1
        self.tokens_saved += len(conversation.tokens)
        return conversation

    def _drop(self, index: int) -> None:
        conversation = self.idle.pop(index)
        self.bytes -= conversation.bytes
        self.dropped += 1
        if self.store is not None:
            self.leaving.append(conversation)

    def drop_all(self) -> None:
        """Every idle conversation leaves RAM (the server is stopping: the store keeps them)."""
        for index in list(self.idle):
            self._drop(index)

    @property
    def keeps(self) -> bool:
        """Whether a finished request's cache is kept (in RAM or in the store)."""
        return bool(self.keep) or self.store is not None

    def spill(self, lock: threading.Condition) -> None:
        """Write the conversations that left RAM to the store (outside ``lock``: it takes a while)."""
        with lock:
            leaving, self.leaving = self.leaving, []
        for conversation in leaving:
            self.store.put(conversation)
