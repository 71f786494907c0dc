"""RULER's tasks as data: the prompt templates, each task's haystack, what it hides and how
many tokens its answer gets."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import InfinikvError

if TYPE_CHECKING:
    pass


NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\n"
    "What are all the special magic {kind} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
NIAH_TEMPLATE_ONE = (
    "A special magic {kind} is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\n"
    "What is the special magic {kind} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX_ONE = " The special magic {kind} for {query} mentioned in the provided text is"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{count} variables are assigned the value {query}, they are:"
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
    "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

# A sentence ends at . ! or ? (maybe closed by a quote or bracket) followed by space, but not "Mr." etc.
SENTENCE_END = re.compile(r"(?<!\bMr\.)(?<!\bMrs\.)(?<!\bDr\.)(?<!\bSt\.)(?<=[.!?])\s+|(?<=[.!?][\"')])\s+")
METRIC_ALL, METRIC_PART = "string_match_all", "string_match_part"


@dataclass(frozen=True)
class Task:
    """One RULER task: its family (``niah``, ``vt``, ``cwe``, ``fwe``) and how it is configured."""

    name: str
    family: str
    max_new_tokens: int
    haystack: str = "none"  # "noise" (NOISE lines), "text" (the haystack text), "needles" (distractors), "none"
    key: str = "words"  # niah: "words" (adjective-noun) or "uuids"
    value: str = "numbers"  # niah: "numbers" (7 digits) or "uuids"
    keys: int = 1  # niah: needles with distinct keys (the rest are distractors)
    values: int = 1  # niah: values (needles) per key
    queries: int = 1  # niah: keys asked
    metric: str = METRIC_ALL


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task("niah_single_1", "niah", 16, haystack="noise"),
        Task("niah_single_2", "niah", 16, haystack="text"),
        Task("niah_single_3", "niah", 48, haystack="text", value="uuids"),
        Task("niah_multikey_1", "niah", 16, haystack="text", keys=4),
        Task("niah_multikey_2", "niah", 16, haystack="needles"),
        Task("niah_multikey_3", "niah", 48, haystack="needles", key="uuids", value="uuids"),
        Task("niah_multivalue", "niah", 48, haystack="text", values=4),
        Task("niah_multiquery", "niah", 48, haystack="text", queries=4),
        Task("vt", "vt", 32, haystack="noise"),
        Task("cwe", "cwe", 64),
        Task("fwe", "fwe", 32),
    ]
}


@dataclass
class Sample:
    """One prompt of exactly ``length`` tokens, what a correct answer contains, and how to score it."""

    task: str
    length: int
    index: int
    prompt_ids: list[int]
    answers: list[str]
    depths: list[float]  # of the answer-bearing needles (niah) or assignments (vt); empty for cwe/fwe
    spans: list[tuple[int, int]]  # [start, end) in prompt_ids of those needles, in prompt order
    answer_prefix: str  # already the end of prompt_ids
    max_new_tokens: int
    metric: str


def task_names(spec: str) -> list[str]:
    """``"all"`` or a comma list (e.g. ``"niah_single_1,vt"``) as task names, in order, once each."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise InfinikvError(f"no RULER task given; choose from {', '.join(TASKS)} or all")
    out: list[str] = []
    for name in names:
        if name == "all":
            out.extend(TASKS)
        elif name in TASKS:
            out.append(name)
        else:
            raise InfinikvError(f"unknown RULER task {name!r}; choose from {', '.join(TASKS)} or all")
    return list(dict.fromkeys(out))
