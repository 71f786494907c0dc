"""``generate``: a task's samples, each prompt cut to exactly ``length`` tokens with its needles at
their depths."""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING

from ...errors import InfinikvError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
from .builders import cwe, fwe, niah, vt
from .parts import Memo, Parts, token_ids, too_short
from .tasks import (
    SENTENCE_END,
    TASKS,
    Sample,
    Task,
)


def generate(
    task: str | Task,
    tokenizer: PreTrainedTokenizerBase,
    haystack_text: str | None,
    length: int,
    samples: int,
    seed: int = 0,
    max_context: int | None = None,
) -> list[Sample]:
    """``samples`` prompts of ``task``, each exactly ``length`` tokens with ``tokenizer``.

    ``haystack_text`` is the real text that ``niah_single_2/3``, ``niah_multikey_1``,
    ``niah_multivalue`` and ``niah_multiquery`` hide needles in (other tasks ignore it). The same
    arguments always give the same samples. ``max_context`` (the model's trained context) makes a
    ``length`` that leaves no room for the task's ``max_new_tokens`` an error.
    """
    if isinstance(task, str):
        if task not in TASKS:
            raise InfinikvError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
        task = TASKS[task]
    if samples < 1:
        raise InfinikvError(f"samples must be at least 1, not {samples}")
    if max_context is not None and length + task.max_new_tokens > max_context:
        raise InfinikvError(
            f"{task.name} at length {length} plus {task.max_new_tokens} new tokens is past the model's "
            f"trained context of {max_context} tokens; use a length of at most {max_context - task.max_new_tokens}"
        )
    text_units: list[list[int]] = []
    if task.haystack == "text":
        if not haystack_text or not haystack_text.strip():
            raise InfinikvError(f"{task.name} needs a haystack text; give one (e.g. austen:emma)")
        text_units = sentences(tokenizer, haystack_text, length)
    ids = Memo(tokenizer)
    out = []
    for index in range(samples):
        rng = random.Random(f"{task.name}/{length}/{seed}/{index}")
        depth = index / (samples - 1) if samples > 1 else 0.5
        if task.family == "niah":
            parts = niah(task, ids, rng, depth, text_units)
        elif task.family == "vt":
            parts = vt(ids, rng)
        elif task.family == "cwe":
            parts = cwe(ids, rng, length)
        else:
            parts = fwe(ids, rng, length)
        prompt, depths, spans = assemble(task, tokenizer, ids, length, parts)
        out.append(
            Sample(
                task=task.name,
                length=length,
                index=index,
                prompt_ids=prompt,
                answers=parts.answers,
                depths=depths,
                spans=spans,
                answer_prefix=parts.answer_prefix,
                max_new_tokens=task.max_new_tokens,
                metric=task.metric,
            )
        )
    return out


def assemble(
    task: Task, tokenizer: PreTrainedTokenizerBase, ids: Memo, length: int, parts: Parts
) -> tuple[list[int], list[float], list[tuple[int, int]]]:
    """Cut the haystack so the prompt is exactly ``length`` tokens; put each needle at the unit
    boundary nearest its depth. Returns the prompt, and the depths and token spans of the needles
    the answer needs."""
    head = tokenizer(parts.head)["input_ids"]
    tail, *needles = ids([parts.tail] + [text for _, text in parts.needles])
    fixed = len(head) + len(tail) + sum(map(len, needles))
    fill = length - fixed
    if fill < 1:
        raise too_short(task, length, fixed)
    hay: list[int] = []
    starts = []
    for unit in parts.units(fill):
        if len(hay) >= fill:
            break
        starts.append(len(hay))
        hay.extend(unit)
    del hay[fill:]
    starts.append(fill)
    at = [min(starts, key=lambda s, d=depth: abs(s - d * fill)) for depth, _ in parts.needles]
    prompt, done, spans = list(head), 0, []
    for i in sorted(range(len(needles)), key=lambda i: (at[i], i)):
        prompt += hay[done : at[i]]
        if i < parts.reported:
            spans.append((len(prompt), len(prompt) + len(needles[i])))
        prompt += needles[i]
        done = at[i]
    prompt += hay[done:] + tail
    return prompt, [round(a / fill, 4) for a in at[: parts.reported]], spans


def sentences(tokenizer: PreTrainedTokenizerBase, text: str, length: int) -> list[list[int]]:
    """The text's first sentences, each tokenized with a leading space, covering ``length`` tokens
    (tokenizing only as much of a long novel as the prompt needs)."""
    chars = 8 * length
    while True:
        sentences = SENTENCE_END.split(re.sub(r"\s+", " ", text[:chars]).strip())
        if chars < len(text):
            sentences.pop()  # may be cut mid-sentence
        units = token_ids(tokenizer, [" " + s for s in sentences])
        have = sum(map(len, units))
        if have >= length:
            return units
        if chars >= len(text):
            raise InfinikvError(
                f"the haystack text has {have} tokens, fewer than a {length}-token prompt needs; "
                "give a longer text or a shorter length"
            )
        chars *= 2
