"""Follow-up questions: one document, several questions asked in turn through one cache.

A user loads a document once and asks about it several times, as a chat would: each answer is
appended to the cache before the next question. A policy that evicted what the first question
looked at (``snapkv``, a question-aware score) may have lost what the second needs; one that keeps
every token and selects per step (``infinigen``, ``recall``) should not. This protocol measures
that, accuracy per question index.

A sample is RULER's ``niah`` document (``ruler.tasks``: the text haystack, word keys, 7-digit
values) holding ``questions`` needles, one key each at its own random depth; question ``i`` asks
for key ``i``'s number, in RULER's one-answer template. The first prompt (instruction, document,
first question and its answer prefix) is exactly ``length`` tokens; each later turn feeds the
previous answer as generated, then ``"\\n"``, the next question and its answer prefix.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from ..core import Batch, Sampling, left_pad, sample
from ..errors import InfinikvError
from ..policies import Policy
from .prompt_reads import Reads, prefill_shared
from .ruler.builders import niah_keys, split_template
from .ruler.generators import assemble, sentences
from .ruler.metrics import string_match_all
from .ruler.parts import Memo, Parts
from .ruler.tasks import NEEDLE, NIAH_ANSWER_PREFIX_ONE, NIAH_TEMPLATE, NIAH_TEMPLATE_ONE, TASKS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ANSWER_TOKENS = TASKS["niah_single_2"].max_new_tokens  # a 7-digit number, as RULER's niah tasks allow


@dataclass(frozen=True)
class Conversation:
    """One document and its questions: ``turns[0]`` is the first prompt (exactly the length),
    ``turns[i]`` the tokens that ask question ``i + 1`` after the previous answer."""

    index: int
    turns: list[list[int]]
    answers: list[str]  # question i's value
    spans: list[tuple[int, int]]  # [start, end) of the needles in turns[0], in prompt order


def conversations(
    tokenizer: PreTrainedTokenizerBase, text: str, length: int, questions: int, samples: int, seed: int = 0
) -> list[Conversation]:
    """``samples`` documents of ``length`` tokens with ``questions`` needles each (deterministic)."""
    if questions < 1 or samples < 1:
        raise InfinikvError("--questions and --samples must be at least 1")
    units = sentences(tokenizer, text, length)
    ids = Memo(tokenizer)
    task = TASKS["niah_single_2"]
    out = []
    for index in range(samples):
        rng = random.Random(f"followup/{length}/{questions}/{seed}/{index}")
        keys, values = niah_keys(task, rng, questions)
        head, _ = split_template(NIAH_TEMPLATE, " ", kind="numbers", query="")
        asks = [_question(key) for key in keys]
        needles = [
            (rng.random(), " " + NEEDLE.format(kind="numbers", key=k, value=v[0]))
            for k, v in zip(keys, values, strict=True)
        ]
        parts = Parts(head, asks[0], "", [v[0] for v in values], lambda fill: units, needles, reported=questions)
        first, _, spans = assemble(task, tokenizer, ids, length, parts)
        out.append(Conversation(index, [first, *ids(asks[1:])], parts.answers, spans))
    return out


def _question(key: str) -> str:
    """RULER's one-answer question for ``key`` (it starts with ``"\\n"``), then its answer prefix."""
    _, tail = split_template(NIAH_TEMPLATE_ONE, " ", kind="number", query=key)
    return tail + NIAH_ANSWER_PREFIX_ONE.format(kind="number", query=key)


def run_followup(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    chats: Sequence[Conversation],
    policy: Policy,
    stop_ids: Sequence[int],
    batch_size: int = 4,
    bar: tqdm | None = None,
    reads: Reads | None = None,
) -> dict:
    """Greedy answers to every question of ``chats`` under ``policy``, ``batch_size`` conversations
    per batch, each answer fed back before the next question. The row has, per question index,
    the accuracy (``string_match_all``, in [0, 1]), the K/V held per conversation after the answer
    (bytes) and the share of the tokens seen that its decode steps attended (mean over steps).
    ``reads``: first prompts read by an earlier cell, shared as ``ruler_run.run_cell`` shares them."""
    reads = Reads() if reads is None else reads
    taken = 0
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    turns = len(chats[0].turns)
    outputs: list[list[str]] = [[] for _ in range(turns)]
    held: list[list[float]] = [[] for _ in range(turns)]
    attended: list[list[float]] = [[] for _ in range(turns)]
    longest = len(chats[0].turns[0]) + sum(len(t) + ANSWER_TOKENS for t in chats[0].turns[1:]) + ANSWER_TOKENS
    for first in range(0, len(chats), batch_size):
        group = chats[first : first + batch_size]
        batch = Batch(model, policy, max_length=longest + 8)
        logits, took = prefill_shared(batch, [c.turns[0] for c in group], pad_id, reads)
        taken += took
        for turn in range(turns):
            answers = sample(batch, logits, Sampling(max_new_tokens=ANSWER_TOKENS), stop_ids, pad_id)
            outputs[turn] += [tokenizer.decode(a, skip_special_tokens=True) for a in answers]
            held[turn].append(batch.cache.held_bytes() / len(group))
            attended[turn].append(statistics.fmean(batch.cache.attended()[1]))
            if turn + 1 < turns:
                logits = _ask(batch, [a + c.turns[turn + 1] for a, c in zip(answers, group, strict=True)], pad_id)
        if bar is not None:
            bar.update(len(group))
    return {
        **policy.describe(),
        "spec": policy.spec(),
        "samples": len(chats),
        "accuracy": [string_match_all(outputs[t], [[c.answers[t]] for c in chats]) for t in range(turns)],
        "held_bytes": [statistics.fmean(h) for h in held],
        "attended_fraction": [statistics.fmean(a) for a in attended],
        "seconds": round(time.perf_counter() - start, 2),
        "prompts_taken": taken,
        "outputs": [
            {"index": c.index, "answers": c.answers, "outputs": [o[i] for o in outputs]} for i, c in enumerate(chats)
        ],
    }


def _ask(batch: Batch, pieces: list[list[int]], pad_id: int) -> torch.Tensor:
    """Feed each row its answer and next question (left-padded to one forward); the next-token logits."""
    ids, real = left_pad(pieces, pad_id)
    return batch.feed(ids.to(batch.device), real)


def question_rows(row: dict) -> list[dict]:
    """A follow-up cell's row as one row per question (1-based ``question``), for tables and JSON."""
    per_question = ("accuracy", "held_bytes", "attended_fraction")
    common = {k: v for k, v in row.items() if k not in per_question and k != "outputs"}
    return [{**common, "question": i + 1, **{k: row[k][i] for k in per_question}} for i in range(len(row["accuracy"]))]
