"""What a reply holds: OpenAI completion and chat bodies, streamed chunks as server-sent events,
errors."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response

from .scheduler import Scheduler
from .schemas import StreamOptions
from .sequence import Sequence, ServeError


def error_response(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None) -> Response:
    return JSONResponse(ServeError(status, message, kind, param, code).body(), status_code=status)


async def stream(
    scheduler: Scheduler, seq: Sequence, events: asyncio.Queue, reply: Reply, options: StreamOptions
) -> AsyncIterator[str]:
    """Server-sent events, one per piece of text, then the finish reason, usage and [DONE]."""
    try:
        if reply.chat:
            yield sse(reply.chunk({"role": "assistant", "content": ""}))
        while True:
            kind, value = await events.get()
            if kind == "text":
                chunk = reply.chunk(value.text)
                if options.continuous_usage_stats:
                    chunk["usage"] = reply.usage(value.tokens)
                yield sse(chunk)
            elif kind == "done":
                yield sse(reply.chunk(None, seq.finish_reason))
                if options.include_usage:
                    yield sse({**reply.chunk(None), "choices": [], "usage": reply.usage(), "kv": reply.kv()})
                yield "data: [DONE]\n\n"
                return
            else:
                yield sse(ServeError(500, value, "server_error").body())
                return
    finally:
        scheduler.cancel(seq)  # a no-op once finished; frees the K/V when the client left


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Reply:
    """The OpenAI JSON shapes of one request's answer, whole or in chunks."""

    def __init__(self, seq: Sequence, model_name: str, chat: bool) -> None:
        self.seq, self.model, self.chat = seq, model_name, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def usage(self, completion: int | None = None) -> dict:
        """Token counts: of the whole answer, or as of a chunk (``completion`` tokens generated)."""
        prompt = len(self.seq.prompt_ids)
        completion = len(self.seq.tokens) if completion is None else completion
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.seq.reused},  # continued from its conversation
        }

    def kv(self) -> dict:
        extra = {} if self.seq.fetched_fraction is None else {"fetched_fraction": self.seq.fetched_fraction}
        return {
            **self.seq.policy.describe(),
            "kv_bytes": self.seq.kv_bytes,
            "reserved_bytes": self.seq.reserved,
            **extra,
        }

    def whole(self, text: str) -> dict:
        reason = self.seq.finish_reason
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
            "kv": self.kv(),
        }

    def chunk(self, piece: str | dict | None, finish_reason: str | None = None) -> dict:
        if self.chat:
            delta = piece if isinstance(piece, dict) else ({} if piece is None else {"content": piece})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish_reason}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}
