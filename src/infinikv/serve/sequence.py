"""One request's generation, as the scheduler moves it: the ``Sequence`` and its output (the next
token picked on the device, text decoded incrementally, stop strings held back until they are
known not to match), and the refusals a request can get (``ServeError``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..core import Batch, Sampling, next_tokens
from ..policies import Policy
from ..text import Detokenizer
from .conversations import Conversation, Entry

Event = tuple[str, Any]  # ("text", Piece) | ("done", finish_reason) | ("error", message)


class Piece(NamedTuple):
    """New text of a stream, and the tokens generated up to it."""

    text: str
    tokens: int


class ServeError(Exception):
    """A request the server refuses, as an HTTP status and an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code=None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """A full queue frees up as requests finish: a client may retry after a second."""
        return {"Retry-After": "1"} if self.status == 429 else {}


@dataclass
class Sequence:
    """One request's generation: its prompt, policy and sampling, and the state it moves through."""

    prompt_ids: list[int]
    policy: Policy
    sampling: Sampling
    stop: list[str]
    emit: Callable[[Event], None]  # thread-safe: called from the scheduler thread
    ignore_eos: bool = False  # an end-of-sequence token is a token like any other
    reserved: int = 0  # K/V bytes admission set aside for it
    chunk: int = 0  # most prompt tokens a prefill forward takes (its policy's chunk), set by admission
    tokens: list[int] = field(default_factory=list)
    batch: Batch | None = None  # its own batch while its prompt is prefilled, chunk by chunk
    prefilled: int = 0  # prompt tokens fed so far
    generator: torch.Generator | None = None
    cancelled: bool = False
    finish_reason: str | None = None
    text: str = ""  # the text so far (pieces from an incremental detokenizer)
    sent: int = 0  # characters of text already emitted
    detokenizer: Detokenizer | None = None
    kv_bytes: int = 0  # peak K/V bytes its cache held
    fetched_fraction: float | None = None  # for two-tier policies
    owner: str = ""  # who sent it (its API key's owner): caches are never shared across owners
    key: str = ""  # requests with equal keys may continue each other's caches (``conversation_key``)
    fed: int = 0  # generated tokens its cache has seen (the last one picked is not fed)
    resumed: Conversation | None = None  # the idle conversation it continues, until its prefill starts
    stored: Entry | None = None  # the stored conversation it continues, until its prefill starts
    reused: int = 0  # prompt tokens it did not prefill, continuing a conversation

    def add(self, token: int, eos: set[int]) -> None:
        """Take the next token, emit the text it completes, decide if the sequence is done."""
        if token in eos and not self.ignore_eos:
            self.finish_reason = "stop"
            self.text += self.detokenizer.flush()
        else:
            self.tokens.append(token)
            self.text += self.detokenizer.push(token)
            if len(self.tokens) >= self.sampling.max_new_tokens:
                self.finish_reason = "length"
                self.text += self.detokenizer.flush()
        text = self.text
        end = len(text) if self.finish_reason else safe_end(text, self.stop)
        hits = [at for stop in self.stop if (at := text.find(stop, max(0, self.sent - len(stop)))) >= 0]
        if hits:
            end, self.finish_reason = min(hits), "stop"
        if end > self.sent:
            self.emit(("text", Piece(text[self.sent : end], len(self.tokens))))
            self.sent = end


@dataclass
class Group:
    """Running sequences with the same policy spec: the rows of one batch, decoded together."""

    batch: Batch
    seqs: list[Sequence]


def pick(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The next token of each row of ``logits`` (b, V), by its sequence's own sampling, on the
    device (b,): greedy rows in one ``argmax``, sampled rows with their own generators."""
    tokens = logits.argmax(-1)
    for i, seq in enumerate(seqs):
        if seq.sampling.temperature:
            tokens[i : i + 1] = next_tokens(logits[i : i + 1], seq.sampling, seq.generator)
    return tokens


def safe_end(text: str, stops: list[str]) -> int:
    """How much of ``text`` can be sent: not a half-decoded character, nor a stop string's start."""
    end = len(text) - 1 if text.endswith("\ufffd") else len(text)
    held = 0
    for stop in stops:
        held = max([held] + [k for k in range(1, min(len(stop), end + 1)) if text[:end].endswith(stop[:k])])
    return end - held
