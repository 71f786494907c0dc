"""One builder per task family (niah, vt, cwe, fwe): its needles, haystack and answers, seeded."""

from __future__ import annotations

import itertools
import math
import random
import string
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...errors import InfinikvError

if TYPE_CHECKING:
    pass
from .parts import Memo, Parts
from .tasks import (
    CWE_ANSWER_PREFIX,
    CWE_TEMPLATE,
    FWE_ANSWER_PREFIX,
    FWE_TEMPLATE,
    NEEDLE,
    NIAH_ANSWER_PREFIX,
    NIAH_ANSWER_PREFIX_ONE,
    NIAH_TEMPLATE,
    NIAH_TEMPLATE_ONE,
    NOISE,
    VT_ANSWER_PREFIX,
    VT_TEMPLATE,
    Task,
)
from .words import ADJECTIVES, NOUNS, WORDS

ZETA_2 = math.pi**2 / 6  # sum of 1/k**2: normalizes fwe's Zipf law (alpha 2)


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _random(rng: random.Random, kind: str) -> str:
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        return _word_key(rng)
    return str(rng.randint(1_000_000, 9_999_999))


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def split_template(template: str, sep: str, **fields: str) -> tuple[str, str]:
    """A template's text before and after ``{context}``; the context's units carry their own
    leading separator, so the head drops one it would duplicate."""
    head, tail = template.split("{context}")
    head = head.format(**fields)
    return (head[: -len(sep)] if head.endswith(sep) else head), tail.format(**fields)


def niah_keys(task: Task, rng: random.Random, count: int) -> tuple[list[str], list[list[str]]]:
    """``count`` distinct keys of the task's kind, and ``task.values`` values for each."""
    keys: list[str] = []
    while len(keys) < count:
        key = _random(rng, task.key)
        if key not in keys:
            keys.append(key)
    return keys, [[_random(rng, task.value) for _ in range(task.values)] for _ in keys]


def niah(task: Task, ids: Memo, rng: random.Random, depth: float, text_units: list[list[int]]) -> Parts:
    count = max(task.keys, task.queries)
    keys, values = niah_keys(task, rng, count)
    asked = rng.sample(range(count), task.queries)
    answers = [v for i in asked for v in values[i]]
    one = len(answers) == 1
    kind = task.value[:-1] if one else task.value
    query = _join([keys[i] for i in asked])
    template, prefix = (NIAH_TEMPLATE_ONE, NIAH_ANSWER_PREFIX_ONE) if one else (NIAH_TEMPLATE, NIAH_ANSWER_PREFIX)
    prefix = prefix.format(kind=kind, query=query)
    sep = " " if task.haystack == "text" else "\n"
    head, tail = split_template(template, sep, kind=kind, query=query)
    order = [(i, v) for i in asked for v in values[i]] + [
        (i, v) for i in range(count) if i not in asked for v in values[i]
    ]
    needles = [
        (depth if n == 0 else rng.random(), sep + NEEDLE.format(kind=task.value, key=keys[i], value=v))
        for n, (i, v) in enumerate(order)
    ]
    if task.haystack == "text":
        units = _fixed(text_units)  # a text too short for the length was caught when tokenizing it
    elif task.haystack == "noise":
        units = _noise(ids)
    else:

        def units(fill: int) -> list[list[int]]:
            out: list[list[int]] = []
            while sum(map(len, out)) < fill:
                batch = []
                while len(batch) < 32:
                    key = _random(rng, task.key)
                    if key not in keys:
                        batch.append(sep + NEEDLE.format(kind=task.value, key=key, value=_random(rng, task.value)))
                out += ids(batch)
            return out

    return Parts(head, tail + prefix, prefix, answers, units, needles, reported=len(answers))


def _fixed(units: list[list[int]]) -> Callable[[int], list[list[int]]]:
    return lambda fill: units


def _noise(ids: Memo) -> Callable[[int], list[list[int]]]:
    line = ids(["\n" + NOISE])[0]
    return lambda fill: [line] * (fill // len(line) + 1)


def _variables(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    return names


def _chain(names: list[str], value: int) -> list[str]:
    return [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:], strict=False)]


def vt(ids: Memo, rng: random.Random) -> Parts:
    """One chain of 4 hops (RULER's default), after a one-shot example of the same task."""
    names = _variables(rng, 10)
    shown, asked = names[:5], names[5:]
    shown_value, value = rng.sample(range(10000, 100000), 2)
    lines = [NOISE] * 3
    at = sorted(rng.randint(0, len(lines)) for _ in shown)
    for j, statement in enumerate(_chain(shown, shown_value)):
        lines.insert(at[j] + j, statement)
    example = (
        VT_TEMPLATE.format(context="\n".join(lines), query=shown_value)
        + VT_ANSWER_PREFIX.format(count=5, query=shown_value)
        + " "
        + " ".join(shown)
    )
    head, tail = split_template(VT_TEMPLATE, "\n", query=str(value))
    prefix = VT_ANSWER_PREFIX.format(count=5, query=value)
    depths = sorted(rng.random() for _ in asked)
    needles = [(d, "\n" + s) for d, s in zip(depths, _chain(asked, value), strict=True)]
    return Parts(example + "\n\n" + head, tail + prefix, prefix, asked, _noise(ids), needles, len(needles))


def cwe(ids: Memo, rng: random.Random, length: int) -> Parts:
    """RULER's word counts: common words 30x and the others 3x from 4096 tokens on, 6x and 1x
    below; a one-shot example (40 words 10x/3x, or 20 words 3x/1x) comes first."""
    common_repeats, other_repeats, shown_words, shown_common, shown_other = (
        (30, 3, 40, 10, 3) if length >= 4096 else (6, 1, 20, 3, 1)
    )
    words = rng.sample(WORDS, len(WORDS))
    shown, common, others = words[:shown_words], words[shown_words : shown_words + 10], words[shown_words + 10 :]
    shown_list = shown[:10] * shown_common + shown[10:] * shown_other
    rng.shuffle(shown_list)
    example = (
        CWE_TEMPLATE.format(context=_numbered(shown_list)) + CWE_ANSWER_PREFIX + " " + _numbered(shown[:10]) + "\n\n"
    )
    head, tail = split_template(CWE_TEMPLATE, " ")

    def units(fill: int) -> list[list[int]]:
        numbers = ids(["1."] + [f" {i}." for i in range(2, fill // 2 + 2)])
        word_ids = dict(zip(common + others, ids([" " + w for w in common + others]), strict=True))
        for scale in itertools.count(1):  # past the word list's reach, repeat every word more often
            repeats = [common_repeats * scale] * 10 + [other_repeats * scale] * len(others)
            chosen, entries, total = 0, 0, 0
            for word, r in zip(common + others, repeats, strict=True):
                more = sum(map(len, numbers[entries : entries + r])) + r * len(word_ids[word])
                if total + more > fill:
                    break
                chosen, entries, total = chosen + 1, entries + r, total + more
            if chosen < 10:
                raise InfinikvError(
                    f"cwe does not fit in {length} tokens: its 10 common words do not; use a longer length"
                )
            if chosen < len(repeats):
                break
        bag = [w for w, r in zip(common + others, repeats[:chosen], strict=False) for _ in range(r)]
        extra = itertools.cycle(others[: chosen - 10] or common)  # one more of a few, still far below the common
        while total < fill:
            word = next(extra)
            total += len(numbers[len(bag)]) + len(word_ids[word])
            bag.append(word)
        rng.shuffle(bag)
        return [numbers[i] + word_ids[w] for i, w in enumerate(bag)]

    return Parts(example + head, tail + CWE_ANSWER_PREFIX, CWE_ANSWER_PREFIX, common, units)


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))


def fwe(ids: Memo, rng: random.Random, length: int) -> Parts:
    """RULER's coded words: ``length // 50`` random 6-letter words, the k-th repeated
    ``int(n / (k**2 * zeta(2)))`` times for the largest ``n`` that fits; the first is ``...``, noise.
    At least 5 words, so that the top 3 have a runner-up to beat."""
    head, tail = split_template(FWE_TEMPLATE, " ")
    size = max(length // 50, 5)
    vocab = ["..."]
    while len(vocab) < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        if word not in vocab:
            vocab.append(word)

    def units(fill: int) -> list[list[int]]:
        word_ids = ids([" " + w for w in vocab])

        def counts(n: int) -> list[int]:
            return [int(n / (k * k * ZETA_2)) for k in range(1, size + 1)]

        def tokens(n: int) -> int:
            return sum(c * len(word) for c, word in zip(counts(n), word_ids, strict=True))

        low, high = 0, 2 * fill + 2  # the largest n whose words fit (``...`` alone is 0.6 n of them)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if tokens(mid) <= fill else (low, mid - 1)
        top = counts(low)
        if not top[1] > top[2] > top[3] > top[4]:
            raise InfinikvError(
                f"fwe does not fit in {length} tokens: too few words to rank the top 3; use a longer length"
            )
        dots = -(-(fill - tokens(low)) // len(word_ids[0]))  # pad with the noise word
        bag = [k for k, c in enumerate(top) for _ in range(c)] + [0] * dots
        rng.shuffle(bag)
        last = max(i for i, k in enumerate(bag) if k == 0)  # the cut, if any, falls on a noise word
        bag[last], bag[-1] = bag[-1], bag[last]
        return [word_ids[k] for k in bag]

    return Parts(head, tail + FWE_ANSWER_PREFIX, FWE_ANSWER_PREFIX, vocab[1:4], units)
