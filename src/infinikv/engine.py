"""Generation under a KV policy: left-padded batches, greedy or nucleus sampling, streaming.

Runs on the decode core (``infinikv.core``), so it can stream, stop each sequence on its own EOS
and report what the cache did; the caches work in ``model.generate`` as well.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import compiled
from .contract import REFERENCE
from .core import Batch, Sampling, sample
from .errors import InfinikvError
from .policies import Policy, make_policy
from .preparation import ensure_prepared
from .text import Detokenizer

__all__ = ["Generation", "Sampling", "encode_prompts", "end_of_sequence_ids", "generate"]


@dataclass
class Generation:
    """What ``generate`` returns: one text per prompt plus what it cost."""

    texts: list[str]
    token_ids: list[list[int]]
    prompt_tokens: list[int]
    new_tokens: int
    seconds: float
    prefill_seconds: float
    kv_bytes: int  # peak KV bytes held by the cache
    attended_fraction: float  # mean over decode steps and layers of keys attended / tokens seen
    policy: dict = field(default_factory=dict)
    transfers: dict = field(default_factory=dict)  # slow->fast traffic, for two-tier policies
    compile_seconds: float | None = None  # what the first compiled step cost: loading it, or building it
    compiled: bool = False  # the decode steps ran compiled

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: new tokens over the decode time, less the one-off cost of loading (or
        building) the compiled step, which ``compile_seconds`` reports apart."""
        decode = self.seconds - self.prefill_seconds - (self.compile_seconds or 0.0)
        return self.new_tokens / decode if decode > 0 else 0.0

    def to_json(self) -> dict:
        return {
            **self.policy,
            "texts": self.texts,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "kv_bytes": self.kv_bytes,
            "attended_fraction": self.attended_fraction,
            "compiled": self.compiled,
            **({"compile_seconds": round(self.compile_seconds, 2)} if self.compile_seconds is not None else {}),
            **self.transfers,
        }


def end_of_sequence_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    """The tokenizer's EOS plus any the model's generation config names (an int or a list)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return {t for t in [tokenizer.eos_token_id, *configured] if t is not None}


def encode_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    if not prompts or any(not p.strip() for p in prompts):
        raise InfinikvError("the prompt is empty")
    if chat:
        if tokenizer.chat_template is None:
            raise InfinikvError("this model has no chat template; drop --chat")
        return [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for p in prompts
        ]
    return [tokenizer(p).input_ids for p in prompts]


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    tokenizer,
    prompts: str | list[str],
    policy: Policy | str = REFERENCE,
    sampling: Sampling | None = None,
    chat: bool = False,
    on_text: Callable[[int, str], None] | None = None,
    compile: bool | str = "auto",
    **policy_options,
) -> Generation:
    """Generate a continuation of each prompt under ``policy``.

    ``prompts`` may be one string or a list (run as one left-padded batch). ``on_text(i, piece)``
    is called with each new piece of text of sequence ``i`` as it is produced. ``compile`` (auto,
    on, off; see ``compiled.resolve``) runs the decode steps compiled: ``auto`` where the policy's
    step is already built (``infinikv prepare --compile``).
    """
    sampling = sampling or Sampling()
    if isinstance(policy, str):
        policy = make_policy(policy, **policy_options)
    single = isinstance(prompts, str)
    encoded = encode_prompts(tokenizer, [prompts] if single else list(prompts), chat)
    ensure_prepared(policy, model, tokenizer)
    length = max(map(len, encoded)) + sampling.max_new_tokens
    compile = compiled.resolve(compile, model, policy, len(encoded), length)
    batch = Batch(model, policy, compile=compile, max_length=length)
    start = time.perf_counter()
    logits = batch.prefill(encoded, tokenizer.pad_token_id)
    prefill_seconds = time.perf_counter() - start
    streams = [Detokenizer(tokenizer) for _ in encoded]

    def show(tokens: list[int], alive: list[bool]) -> None:
        for row, (token, live) in enumerate(zip(tokens, alive, strict=True)):
            if live:
                piece = streams[row].push(token)
                if piece:
                    on_text(row, piece)

    token_ids = sample(
        batch,
        logits,
        sampling,
        end_of_sequence_ids(model, tokenizer),
        tokenizer.pad_token_id,
        show if on_text else None,
    )
    if on_text is not None:
        for row, stream in enumerate(streams):
            if rest := stream.flush():
                on_text(row, rest)
    seconds = time.perf_counter() - start
    cache = batch.cache
    _, fractions = cache.attended()
    new_tokens = sum(len(t) for t in token_ids)
    return Generation(
        texts=[tokenizer.decode(t, skip_special_tokens=True) for t in token_ids],
        token_ids=token_ids,
        prompt_tokens=[len(e) for e in encoded],
        new_tokens=new_tokens,
        seconds=seconds,
        prefill_seconds=prefill_seconds,
        kv_bytes=cache.peak_bytes(),
        attended_fraction=sum(fractions) / len(fractions),
        policy=policy.describe(),
        transfers=cache.transfer_summary() or {},
        compile_seconds=batch.compile_seconds,
        compiled=compile,
    )
