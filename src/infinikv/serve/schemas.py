"""What a request may hold: the OpenAI request bodies, validated strictly, and the checks that refuse
what infinikv does not implement."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .sequence import ServeError

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


def single_prompt(prompts: list[str]) -> str:
    if len(prompts) != 1:
        raise ServeError(400, "send one prompt per request (a list of one string at most)", param="prompt")
    return prompts[0]


def message_text(content: str | list[dict[str, Any]]) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
        raise ServeError(400, "only text content parts are supported", param="messages")
    return "".join(part["text"] for part in content)
