"""P-needle (passkey retrieval): a 5-digit pass key hidden at depths 10..90% of a haystack of
real text, then a question; exact-match accuracy of the greedy answer."""

from __future__ import annotations

import random

import torch
from tqdm import tqdm

from ..core import Batch, Sampling, sample
from ..errors import InfinikvError
from ..policies import Policy
from .trace import NeedleTrace

INTRO = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about it.\n\n"
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


def needle_cases(
    tokenizer, haystack: str, context: int, needles: int, seed: int = 0
) -> list[tuple[torch.Tensor, str, float, tuple[int, int]]]:
    """``needles`` prompts of ``context`` tokens: ``(ids (1, context), pass key, depth, span)``,
    the span [start, end) of the needle's tokens.

    Depths are evenly spaced from 10% to 90% of the haystack part.
    """
    if needles < 1:
        raise InfinikvError("--needles must be at least 1")
    rng = random.Random(seed)
    intro, question = tokenizer(INTRO).input_ids, tokenizer(QUESTION, add_special_tokens=False).input_ids
    hay = tokenizer(haystack).input_ids
    cases = []
    for i in range(needles):
        depth = 0.1 + 0.8 * i / max(needles - 1, 1)
        key = str(rng.randint(10000, 99999))
        needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False).input_ids
        fill = context - len(intro) - len(needle) - len(question)
        if fill < 1 or len(hay) < fill:
            raise InfinikvError(
                f"--context {context} does not fit the haystack text ({len(hay)} tokens) and the pass key"
            )
        at = int(depth * fill)
        ids = intro + hay[:at] + needle + hay[at:fill] + question
        start = len(intro) + at
        cases.append((torch.tensor([ids]), key, round(depth, 3), (start, start + len(needle))))
    return cases


def answer(
    model, ids: torch.Tensor, policy: Policy, new_tokens: int = 8, trace: NeedleTrace | None = None, span=None
) -> list[int]:
    """Greedy continuation of ``ids`` (1, n) under ``policy`` (``new_tokens`` tokens, no early stop),
    observed by ``trace`` with the needle at ``span`` if given."""
    batch = Batch(model, policy, max_length=ids.shape[1] + new_tokens)
    if trace is not None:
        trace.watch(batch.cache, [[span]], ids.shape[1] + new_tokens, batch.device)
    logits = batch.extend(ids)
    return sample(batch, logits, Sampling(max_new_tokens=new_tokens), stop_ids=[], pad_id=0)[0]


def needle_accuracy(model, tokenizer, cases, policy: Policy, progress: bool = True) -> dict:
    """Exact-match accuracy of ``policy`` over ``cases``, with each case's answer and the share of
    the needle's tokens each layer attended (``trace.NeedleTrace``)."""
    rows, trace = [], NeedleTrace()
    for ids, key, depth, span in tqdm(cases, desc=policy.label(), disable=not progress, leave=False):
        text = tokenizer.decode(answer(model, ids, policy, trace=trace, span=span), skip_special_tokens=True)
        trace.detach()
        rows.append({"depth": depth, "key": key, "answer": text.strip(), "hit": key in text})
    return {
        **policy.describe(),
        "accuracy": sum(r["hit"] for r in rows) / len(rows),
        "context": int(cases[0][0].shape[1]),
        "needles": len(rows),
        "cases": rows,
        **trace.result(),
    }
