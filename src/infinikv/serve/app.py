"""The OpenAI-compatible HTTP API: its routes (request bodies in ``schemas``, replies in ``replies``,
``/metrics`` in ``metrics``).

Every refusal is an OpenAI-style error body ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status, so the official ``openai`` client raises its usual exceptions. The work is
done by the ``Scheduler``; this module turns requests into ``Sequence`` objects and the
scheduler's events back into JSON or server-sent events.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from ..core import Sampling
from ..errors import InfinikvError
from .budget import ProcessBudget
from .catalog import PolicyCatalog
from .keys import key_owner
from .metrics import Peers, prometheus, publish, snapshot
from .replies import Reply, error_response, stream
from .scheduler import Scheduler
from .schemas import (
    CHAT_DEFAULT_MAX_TOKENS,
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatRequest,
    Common,
    CompletionRequest,
    StreamOptions,
    check_request,
    message_text,
    single_prompt,
)
from .sequence import Event, Sequence, ServeError
from .store import ConversationStore

DEFAULT_KV_MEMORY = 2**30  # without --kv-memory or --memory
PAGE = Path(__file__).parent / "page"  # the chat page's static files, served at / and /page/
OPEN_PATHS = ("/health", "/")  # answered without an API key (with /page/: the page asks for the key)


def create_app(
    model: torch.nn.Module,
    tokenizer,
    model_name: str,
    default_kv: dict[str, Any],
    kv_memory: int | None,
    max_queue: int,
    api_keys: dict[str, str] | None = None,
    prefill_chunk: int = 512,
    compile: bool | str = "auto",
    peers: Peers | None = None,
    prepare: Iterable[dict[str, Any]] = (),
    keep_conversations: int = 16,
    store: dict[str, Any] | None = None,
    memory: int | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> FastAPI:
    """The server's app; ``default_kv`` is the policy spec a request without ``kv`` gets. It and
    the specs in ``prepare`` are built and prepared here, before the port opens (``say`` tells
    the progress); a bad one, or a ``kv_memory`` (None: what ``memory`` leaves beside the model,
    else ``DEFAULT_KV_MEMORY``) that cannot hold one default request, raises ``InfinikvError``.
    With ``peers`` the app is one replica of several and its /metrics labels each replica's
    numbers. ``api_keys`` (key -> owner): every call but /health needs one, and a request
    continues or reuses only caches its owner made (``conversations``). ``store``: the
    ``ConversationStore`` arguments (directory, max_bytes, kv) where conversations that leave RAM go.
    ``memory``: the process's budget (``budget.ProcessBudget``), measured from here: the model and
    the runtime are what is resident now."""
    catalog = PolicyCatalog(model, tokenizer)
    default = catalog.prepare(default_kv, say)
    for spec in prepare:
        catalog.prepare(spec, say)
    smallest = default.worst_case_bytes(model.config, 1, CHAT_DEFAULT_MAX_TOKENS)
    budget = ProcessBudget(memory) if memory else None
    if kv_memory is None:
        kv_memory = budget.room(0, alone=True) if budget else DEFAULT_KV_MEMORY
    limits = []
    if budget:
        resident = f"{budget.base / 2**20:.0f} MiB resident with the model loaded"
        limits.append((budget.room(0, alone=True), f"--memory of {memory / 2**20:.2f} MiB ({resident})"))
    limits.append((kv_memory, f"--kv-memory of {kv_memory / 2**20:.2f} MiB"))
    for room, flag in limits:
        if smallest > room:
            raise InfinikvError(
                f"{flag} cannot hold one request of the default kv {default!r}: a 1-token prompt with the "
                f"default max_tokens {CHAT_DEFAULT_MAX_TOKENS} needs up to {smallest / 2**20:.2f} MiB of K/V"
            )
    if budget:
        budget.probe(model, default, min(prefill_chunk, default.prefill_chunk(model, prefill_chunk) or prefill_chunk))
    say("budgets: " + ", ".join(flag for _, flag in limits))
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        stored = ConversationStore(model=model, **store) if store else None
        scheduler = Scheduler(
            model, tokenizer, kv_memory, max_queue, prefill_chunk, compile, keep_conversations, stored, budget
        )
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
        request.state.owner = ""
        path = request.url.path
        if api_keys and path not in OPEN_PATHS and not path.startswith("/page/"):
            owner = key_owner(api_keys, request.headers.get("authorization", ""))
            if owner is None:
                return error_response(
                    401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key"
                )
            request.state.owner = owner
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

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(PAGE / "index.html")

    app.mount("/page", StaticFiles(directory=PAGE), name="page")

    @app.get("/v1/policies")
    async def list_policies() -> dict:
        """infinikv's own: the policies a request's ``kv`` may name, for the chat page."""
        return {"object": "list", "default": default.spec(), "data": catalog.listing(default)}

    @app.get("/v1/models")
    async def list_models() -> dict:
        entry = {"id": model_name, "object": "model", "created": int(state["started"]), "owned_by": "infinikv"}
        return {"object": "list", "data": [entry]}

    @app.get("/metrics")
    async def metrics() -> Response:
        numbers = snapshot(state["scheduler"])
        replicas = await asyncio.to_thread(peers.gather, numbers) if peers else {"": numbers}
        return PlainTextResponse(prometheus(replicas), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt = body.prompt if isinstance(body.prompt, str) else single_prompt(body.prompt)
        if not prompt.strip():
            raise ServeError(400, "the prompt is empty", param="prompt")
        ids = tokenizer(prompt).input_ids
        return await run(body, ids, body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        messages = [{"role": m.role, "content": message_text(m.content)} for m in body.messages]
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

        seq = Sequence(ids, policy, sampling, stops, emit, ignore_eos=body.ignore_eos, owner=request.state.owner)
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
