"""What a task's builder returns (the prompt's pieces as token ids) and the memoised tokenizer
the builders share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...errors import InfinikvError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
from .tasks import (
    Task,
)


@dataclass
class Parts:
    """A prompt before assembly: the context is ``units`` (token lists) with ``needles`` inserted."""

    head: str  # instruction, up to the context
    tail: str  # question + answer prefix
    answer_prefix: str
    answers: list[str]
    units: Callable[[int], list[list[int]]]  # units covering at least n tokens; the last one is cut
    needles: list[tuple[float, str]] = field(default_factory=list)  # (depth wanted, text)
    reported: int = 0  # the first ``reported`` needles are the ones Sample.depths describes


def token_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


class Memo:
    """Token ids of pieces of text, each tokenized once per ``generate`` call (cwe's list numbers
    and words recur in every sample)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.known: dict[str, list[int]] = {}

    def __call__(self, texts: list[str]) -> list[list[int]]:
        new = [t for t in dict.fromkeys(texts) if t not in self.known]
        self.known.update(zip(new, token_ids(self.tokenizer, new), strict=True))
        return [self.known[t] for t in texts]


def too_short(task: Task, length: int, fixed: int) -> InfinikvError:
    return InfinikvError(
        f"{task.name} does not fit in {length} tokens: its template, answer prefix and needles alone take "
        f"{fixed}; use a longer length"
    )
