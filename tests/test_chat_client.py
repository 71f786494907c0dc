"""The benchmark's chat client (``bench serve --turns``): a 429 is waited out as told, and a server
that went down is waited for ``survive`` seconds counted from the first failed connection."""

import asyncio
import json

import httpx
import pytest

from infinikv.bench.turns import Chats, ask


def server(replies: list[str]) -> httpx.MockTransport:
    """A transport that answers, in turn: ``busy`` a 429 (retry after 0.5 s), ``down`` a failed
    connection, ``ok`` a streamed answer "hello"."""
    pending = iter(replies)

    def reply(request: httpx.Request) -> httpx.Response:
        what = next(pending)
        if what == "busy":
            return httpx.Response(429, headers={"retry-after": "0.5"})
        if what == "down":
            raise httpx.ConnectError("All connection attempts failed", request=request)
        text = {"choices": [{"delta": {"content": "hello"}}]}
        chunks = [text, {"choices": [], "usage": {"prompt_tokens": 3}, "kv": {}}]
        return httpx.Response(200, text="".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")

    return httpx.MockTransport(reply)


def ask_once(replies: list[str], survive: float) -> tuple[dict, Chats]:
    chats = Chats([[]])

    async def run() -> dict:
        async with httpx.AsyncClient(transport=server(replies)) as client:
            return await ask(client, "http://server/v1/chat/completions", {}, chats, survive)

    return asyncio.run(run()), chats


def test_a_turn_that_waited_out_429s_longer_than_survive_still_outlives_a_restart():
    # 1.5 s of 429s, then the server is down for two tries (0.5 s apart): within 1.2 s of the first failure
    answer, chats = ask_once(["busy", "busy", "busy", "down", "down", "ok"], survive=1.2)
    assert answer["text"] == "hello"
    assert (chats.busy, chats.interrupted) == (3, 2)


def test_a_server_down_for_longer_than_survive_fails_the_turn():
    with pytest.raises(httpx.ConnectError):
        ask_once(["down"] * 4, survive=0.9)  # tries at 0, 0.5 and 1.0 s: the third is past the window
