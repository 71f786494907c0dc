"""Generation under a KV policy: left-padded batches, greedy or nucleus sampling, streaming.

The loop is ours (not ``model.generate``) so that it can stream, stop each sequence on its own
EOS and report what the cache did; the caches work in ``model.generate`` as well.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .errors import InfinikvError
from .policies import Policy, make_policy
from .policies.base import KVCache


@dataclass
class Sampling:
    """How the next token is picked. ``temperature == 0`` is greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InfinikvError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InfinikvError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InfinikvError(f"--top-p must be in (0, 1], got {self.top_p}")


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

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds - self.prefill_seconds
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
            **self.transfers,
        }


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row of ``logits`` (b, V) -> (b,)."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = (logits.float() / sampling.temperature).softmax(-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > sampling.top_p  # keeps the top token always
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


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


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both (b, n), padded on the left."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids, mask


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    tokenizer,
    prompts: str | list[str],
    policy: Policy | str = "full",
    sampling: Sampling | None = None,
    chat: bool = False,
    on_text: Callable[[int, str], None] | None = None,
    **policy_options,
) -> Generation:
    """Generate a continuation of each prompt under ``policy``.

    ``prompts`` may be one string or a list (run as one left-padded batch). ``on_text(i, piece)``
    is called with each new piece of text of sequence ``i`` as it is produced.
    """
    sampling = sampling or Sampling()
    if isinstance(policy, str):
        policy = make_policy(policy, **policy_options)
    single = isinstance(prompts, str)
    encoded = encode_prompts(tokenizer, [prompts] if single else list(prompts), chat)
    device = next(model.parameters()).device
    ids, mask = left_pad(encoded, tokenizer.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    batch, width = ids.shape
    # One preallocated mask for the whole run: generated tokens are always real.
    full_mask = torch.cat([mask, torch.ones(batch, sampling.max_new_tokens, dtype=mask.dtype, device=device)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    cache: KVCache = policy.make_cache(model)
    eos = end_of_sequence_ids(model, tokenizer)
    eos_ids = torch.tensor(sorted(eos), device=device)

    start = time.perf_counter()
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
    )
    prefill_seconds = time.perf_counter() - start
    generated = torch.zeros(batch, sampling.max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch, dtype=torch.long)
    printed = [""] * batch
    next_position = positions[:, -1:] + 1
    steps = 0
    for step in range(sampling.max_new_tokens):
        token = next_tokens(out.logits[:, -1], sampling, generator)
        token = torch.where(finished, tokenizer.pad_token_id, token)
        generated[:, step] = token
        lengths += (~finished).long().cpu()
        finished |= torch.isin(token, eos_ids)
        steps = step + 1
        if on_text is not None:
            for row in range(batch):
                text = tokenizer.decode(generated[row, : lengths[row]], skip_special_tokens=True)
                if len(text) > len(printed[row]) and not text.endswith("\ufffd"):
                    on_text(row, text[len(printed[row]) :])
                    printed[row] = text
        if bool(finished.all()) or step + 1 == sampling.max_new_tokens:
            break
        out = model(
            input_ids=token[:, None],
            attention_mask=full_mask[:, : width + step + 1],
            position_ids=next_position,
            cache=cache,
            use_cache=True,
        )
        next_position = next_position + 1
    seconds = time.perf_counter() - start
    token_ids = []
    for row in range(batch):
        row_ids = generated[row, : lengths[row]].tolist()
        while row_ids and row_ids[-1] in eos:
            row_ids.pop()
        token_ids.append(row_ids)
    _, fractions = cache.attended()
    return Generation(
        texts=[tokenizer.decode(t, skip_special_tokens=True) for t in token_ids],
        token_ids=token_ids,
        prompt_tokens=[len(e) for e in encoded],
        new_tokens=int(lengths.sum()),
        seconds=seconds,
        prefill_seconds=prefill_seconds,
        kv_bytes=cache.peak_bytes(),
        attended_fraction=sum(fractions) / len(fractions) if steps > 1 else 1.0,
        policy=policy.describe(),
        transfers=cache.transfer_summary() or {},
    )
