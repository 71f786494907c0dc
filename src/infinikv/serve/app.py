"""The OpenAI-compatible HTTP API: routes, request validation, streaming, errors, metrics.

Every refusal is an OpenAI-style error body ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status, so the official ``openai`` client raises its usual exceptions. The work is
done by the ``Scheduler``; this module turns requests into ``Sequence`` objects and the
scheduler's events back into JSON or server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal, Protocol

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from ..core import Sampling
from ..errors import InfinikvError
from .catalog import PolicyCatalog
from .scheduler import Event, Scheduler, Sequence, ServeError

Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(strict=True)]
Bool = Annotated[bool, Field(strict=True)]
# Features of the OpenAI API that infinikv does not implement, with the value that means "off".
UNSUPPORTED = {
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "echo": (None, False),
    "suffix": (None,),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "functions": (None, []),
}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # as OpenAI's completions endpoint
CHAT_DEFAULT_MAX_TOKENS = 256


class StreamOptions(BaseModel):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM's extension: usage in every chunk, as of that chunk


class Common(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's clients send extras."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0, le=2)
    top_p: Float = Field(1.0, gt=0, le=1)
    seed: Int | None = None
    stop: str | list[str] | None = None
    n: Int = Field(1, ge=1)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    kv: dict[str, Any] | None = None
    ignore_eos: Bool = False  # vLLM's extension: generate max_tokens whatever the model says


class CompletionRequest(Common):
    prompt: str | list[str]


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)


def error_response(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None) -> Response:
    return JSONResponse(ServeError(status, message, kind, param, code).body(), status_code=status)


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


def create_app(
    model: torch.nn.Module,
    tokenizer,
    model_name: str,
    default_kv: dict[str, Any],
    kv_memory: int,
    max_queue: int,
    api_key: str | None = None,
    prefill_chunk: int = 512,
    compile: bool | str = "auto",
    peers: Peers | None = None,
    prepare: Iterable[dict[str, Any]] = (),
    keep_conversations: int = 16,
    say: Callable[[str], None] = lambda _: None,
) -> FastAPI:
    """The server's app; ``default_kv`` is the policy spec a request without ``kv`` gets. It and
    the specs in ``prepare`` are built and prepared here, before the port opens (``say`` tells
    the progress); a bad one, or a ``kv_memory`` that cannot hold one default request, raises
    ``InfinikvError``. With ``peers`` the app is one replica of several and its /metrics labels
    each replica's numbers."""
    catalog = PolicyCatalog(model, tokenizer)
    default = catalog.prepare(default_kv, say)
    for spec in prepare:
        catalog.prepare(spec, say)
    smallest = default.worst_case_bytes(model.config, 1, CHAT_DEFAULT_MAX_TOKENS)
    if smallest > kv_memory:
        raise InfinikvError(
            f"--kv-memory of {kv_memory / 2**20:.2f} MiB cannot hold one request of the default kv {default!r}: "
            f"a 1-token prompt with the default max_tokens {CHAT_DEFAULT_MAX_TOKENS} needs up to "
            f"{smallest / 2**20:.2f} MiB"
        )
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        scheduler = Scheduler(model, tokenizer, kv_memory, max_queue, prefill_chunk, compile, keep_conversations)
        state["scheduler"] = scheduler
        state["started"] = time.time()
        stop = threading.Event()
        if peers:
            threading.Thread(target=publish, args=(peers, scheduler, stop), daemon=True).start()
        yield
        stop.set()
        scheduler.close()

    app = FastAPI(title="infinikv", lifespan=lifespan)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(
                    401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key"
                )
        return await call_next(request)

    @app.exception_handler(ServeError)
    async def refused(_request: Request, exc: ServeError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0]
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
        param = ".".join(where) or None
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict:
        entry = {"id": model_name, "object": "model", "created": int(state["started"]), "owned_by": "infinikv"}
        return {"object": "list", "data": [entry]}

    @app.get("/metrics")
    async def metrics() -> Response:
        numbers = state["scheduler"].snapshot()
        replicas = await asyncio.to_thread(peers.gather, numbers) if peers else {"": numbers}
        return PlainTextResponse(prometheus(replicas), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt = body.prompt if isinstance(body.prompt, str) else _single(body.prompt)
        if not prompt.strip():
            raise ServeError(400, "the prompt is empty", param="prompt")
        ids = tokenizer(prompt).input_ids
        return await run(body, ids, body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
        if not any(m["content"].strip() for m in messages):
            raise ServeError(400, "the messages are empty", param="messages")
        if tokenizer.chat_template is None:
            raise ServeError(400, f"model {model_name} has no chat template; use /v1/completions")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        max_tokens = body.max_completion_tokens or body.max_tokens or CHAT_DEFAULT_MAX_TOKENS
        return await run(body, ids, max_tokens, request, chat=True)

    async def run(body: Common, ids: list[int], max_tokens: int, request: Request, chat: bool) -> Response:
        check_request(body, model_name)
        policy, longest = catalog.get(body.kv or default_kv)
        if longest is not None and len(ids) + max_tokens > longest:
            raise ServeError(
                400,
                f"{len(ids)} prompt tokens + max_tokens {max_tokens} exceed the model's trained context of {longest} "
                f"tokens under {policy!r}; a policy that renumbers positions can go past it: "
                f'{", ".join(catalog.past_context())} (e.g. kv {{"policy": "bct", "capacity": 1024}})',
                param="max_tokens",
            )
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ServeError(400, "stop takes up to 4 non-empty strings", param="stop")
        sampling = Sampling(max_tokens, body.temperature, body.top_p, body.seed)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emit(event: Event) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(events.put_nowait, event)

        seq = Sequence(ids, policy, sampling, stops, emit, ignore_eos=body.ignore_eos)
        scheduler: Scheduler = state["scheduler"]
        scheduler.submit(seq)  # 400 or 429 before anything is sent
        reply = Reply(seq, model_name, chat)
        if body.stream:
            options = body.stream_options or StreamOptions()
            return StreamingResponse(stream(scheduler, seq, events, reply, options), media_type="text/event-stream")
        text = []
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(events.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                if kind == "text":
                    text.append(value.text)
                elif kind == "done":
                    return JSONResponse(reply.whole("".join(text)))
                else:
                    return error_response(500, value, kind="server_error")
        finally:
            scheduler.cancel(seq)

    return app


def publish(peers: Peers, scheduler: Scheduler, stop: threading.Event) -> None:
    """Share this replica's numbers with its peers every ``PUBLISH_SECONDS`` until ``stop``."""
    while not stop.wait(PUBLISH_SECONDS):
        try:
            peers.publish(scheduler.snapshot())
        except Exception:  # a board that is gone (the driver left) must not stop the replica
            pass


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


def check_request(body: Common, model_name: str) -> None:
    """Refuse what infinikv does not serve: another model, n > 1, unsupported OpenAI features."""
    if body.model != model_name:
        raise ServeError(
            404,
            f"model {body.model!r} is not served here; this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )
    if body.n != 1:
        raise ServeError(400, "only n=1 is supported", param="n")
    for name, off in UNSUPPORTED.items():
        if (body.model_extra or {}).get(name) not in off:
            raise ServeError(400, f"{name} is not supported by infinikv", param=name)


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
    ]
    for name, kind, help_text, key in metrics:
        lines += [f"# HELP infinikv_{name} {help_text}", f"# TYPE infinikv_{name} {kind}"]
        lines += [f"infinikv_{name}{labels(replica)} {_number(numbers[key])}" for replica, numbers in replicas.items()]
    lines += [
        "# HELP infinikv_fetch_fraction Mean share of the tokens seen fetched per decode step, by two-tier policy.",
        "# TYPE infinikv_fetch_fraction gauge",
    ]
    for replica, numbers in replicas.items():
        for policy, fraction in sorted(numbers["fetch_fraction"].items()):
            lines.append(f"infinikv_fetch_fraction{labels(replica, policy=policy)} {_number(fraction)}")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _single(prompts: list[str]) -> str:
    if len(prompts) != 1:
        raise ServeError(400, "send one prompt per request (a list of one string at most)", param="prompt")
    return prompts[0]


def _text(content: str | list[dict[str, Any]]) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
        raise ServeError(400, "only text content parts are supported", param="messages")
    return "".join(part["text"] for part in content)
