"""RULER's synthetic long-context tasks, offline: deterministic prompt generators and scoring.

RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", 2024) is what KV-cache papers and kvpress's leaderboard rank policies with. Its tasks
need no dataset: each prompt is a haystack (repeated noise sentences, a real text, or distractor
needles) with answers hidden in it, so they are rebuilt here from the packaged texts and a
built-in word list. Only the tokenizer is used; running a model is the caller's part.

Each prompt is the chat-free template followed by the task's answer prefix, and is exactly
``length`` tokens: ``prompt_ids`` is the concatenation of separately tokenized pieces
(instruction, haystack units, needles, question + answer prefix), and the haystack is cut to the
token to make the total exact, so the prompt *is* those ids (re-encoding the decoded text may
merge a token or two at piece boundaries). Needles go between haystack units (sentences, noise
lines, list entries) at the unit boundary nearest to their depth; ``Sample.depths`` are the
depths they actually got, as fractions of the haystack (0 = right after the instruction,
1 = right before the question). The answer-bearing needle of sample ``i`` of ``n`` goes at depth
``i / (n - 1)``; other needles go at random depths. Randomness comes only from
``random.Random`` seeded with (task, length, seed, sample index).

| task | haystack | hides | asks | new tokens |
|---|---|---|---|---|
| ``niah_single_1`` | noise lines | one word key -> 7-digit number | that number | 16 |
| ``niah_single_2`` | the text | one word key -> 7-digit number | that number | 16 |
| ``niah_single_3`` | the text | one word key -> UUID | that UUID | 48 |
| ``niah_multikey_1`` | the text | 4 word keys -> numbers | one key's number | 16 |
| ``niah_multikey_2`` | distractor needles | one word key -> number among needles with other keys | its number | 16 |
| ``niah_multikey_3`` | distractor needles | one UUID key -> UUID among needles with other keys | its UUID | 48 |
| ``niah_multivalue`` | the text | 4 numbers for one word key | all 4 | 48 |
| ``niah_multiquery`` | the text | 4 word keys -> numbers | all 4 keys' numbers | 48 |
| ``vt`` | noise lines | ``VAR A = 12345``, 4 hops ``VAR B = VAR A`` ... (+ an example) | all 5 names | 32 |
| ``cwe`` | none | a numbered word list, 10 words far more often (+ an example) | the 10 common words | 64 |
| ``fwe`` | none | coded words drawn from a Zipf law (alpha 2), ``...`` the commonest | the next 3 | 32 |

Every task is scored with ``string_match_all`` (the fraction of a sample's answers that appear
in its output, case-insensitive; RULER's metric for niah, vt, cwe and fwe); ``string_match_part``
(1 if any answer appears) is RULER's metric for its QA tasks, which need SQuAD/HotpotQA downloads
and are not generated here. Scores are in [0, 1]; RULER's tables are these x100.

``max_new_tokens`` (RULER: 128 niah, 30 vt, 120 cwe, 50 fwe) is cut to about twice the answer's
length with the SmolLM2 tokenizer (which splits digits: a 7-digit number is 9 tokens, a UUID 37,
five variable names about 20, ten numbered words about 50), since a small model that has the
answer gives it at once and every extra decode step costs.

Differences from RULER, all deliberate: the essay haystack is any text (the packaged Austen
novels by default) split into sentences by a regex instead of Paul Graham's essays and NLTK;
keys come from a built-in adjective-noun list instead of ``wonderwords``; in the noise and
distractor haystacks each noise block, needle and variable assignment is a line of its own; the
answer prefixes have no trailing space (so a BPE model's next token can carry its own); ``vt``'s
prefix says "assigned" where RULER's says "assgined"; cwe's words are drawn from a 719-word
list, so past the lengths it can fill, every word's repeat count is multiplied (common:uncommon
stays 10:1).

Templates (``{context}`` is the haystack; the answer prefix follows the question directly):

- niah, one answer: ``NIAH_TEMPLATE_ONE`` + ``NIAH_ANSWER_PREFIX_ONE``, more than one:
  ``NIAH_TEMPLATE`` + ``NIAH_ANSWER_PREFIX``; each needle is ``NEEDLE``.
- vt: ``VT_TEMPLATE`` + ``VT_ANSWER_PREFIX``; cwe: ``CWE_TEMPLATE`` + ``CWE_ANSWER_PREFIX``;
  fwe: ``FWE_TEMPLATE`` + ``FWE_ANSWER_PREFIX``.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import InfinikvError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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

ADJECTIVES = sorted(
    set(
        """
        able abrupt absent acidic active adorable afraid agile alert amber ancient angry anxious
        arctic ashamed awake awful bald bashful bitter bland blissful bold boring brave breezy brief
        bright brisk broad broken bumpy busy calm capable careful cheap cheerful chilly chubby
        classic clean clever cloudy clumsy coastal cold colossal cool cosmic cozy crazy creamy
        crisp crooked cruel curly curved cute damp dark dazzling deep delicate dense dizzy dry
        dusty eager early earthy elastic elegant empty endless equal exotic faint fair famous
        fancy fast fearless fierce filthy flat fluffy fragile frantic free fresh friendly frosty
        funny fuzzy gentle giant gifted glad gloomy glossy golden graceful grand greasy great
        grumpy handsome happy hard harsh hasty heavy hidden hollow honest huge humble hungry icy
        idle jolly juicy keen kind large lazy light little lively lonely loud lovely lucky
        magnetic massive meek mellow merry mighty misty modern moldy muddy narrow nasty neat
        nervous noble noisy odd old orange polite proud purple quaint quick quiet rapid rare raw
        ready rich rigid ripe rough round royal rusty sad salty scarlet shiny short shy silent
        silly silver simple sleepy slim slow small smooth soft solid sour spicy steady steep
        sticky stormy strange strong sturdy sunny super sweet swift tall tame tender thick thin
        tidy tiny tough tricky vast velvet violet vivid warm wary weak wet wicked wide wild windy
        wise witty wooden young zany zealous
        """.split()
    )
)
NOUNS = sorted(
    set(
        """
        acorn actor airport album anchor angle ankle apple apron arch arrow artist attic avenue
        badge bagel bakery balcony ball balloon banana band banjo barn basket beach beacon bean
        bear beard bed bee bell belt bench berry bicycle bird biscuit blanket blossom boat bone
        book boot bottle bowl box bracelet branch bread breeze brick bridge broom brush bucket
        bun bus butter button cabin cable cactus cake camel camera candle canoe canyon cap
        captain car carpet carrot castle cat cave cellar chair chalk cheese cherry chicken
        chimney circle city clock cloud clover coat coconut coin comet compass cookie copper
        coral corn cottage cotton cow crab crane crayon cricket crown cup curtain cushion daisy
        deer desert desk diamond dinner doctor dog dolphin donkey door dragon drawer dream drum
        duck eagle earth elbow engine envelope eraser fabric falcon farm feather fence fern
        ferry field finger fire fish flag flame flower flute fog forest fork fountain fox frog
        garden garlic gate giraffe glacier glass glove goat grape grass guitar hammer harbor
        harp hat hawk helmet hill hive honey horse hotel house island jacket jar jelly jewel
        kettle key kitten kite ladder lake lamp lantern lemon letter library lily lion lizard
        lobster lock magnet mango map marble market meadow melon mirror monkey moon mountain
        mouse muffin mushroom nail napkin needle nest net notebook oak ocean octopus olive onion
        orchard otter owl oyster paddle palace panda paper parrot peach peanut pear pebble
        pencil pepper piano pillow pine pirate planet plate plum pocket pond potato pumpkin
        puppy quilt rabbit radio rain raven ribbon river road robot rock rocket roof rose
        saddle sail salmon sandal saucer scarf school seal shadow shark sheep shell ship shoe
        shovel silk singer skate sled snail snake sock sofa spider spoon squirrel stable star
        statue stone storm stove stream street sugar sun swan sweater table tail teapot tent
        thunder tiger toast tomato tower tractor train tree trumpet tulip tunnel turtle
        umbrella valley vase violin wagon wallet walnut whale wheel whistle window wolf zebra
        """.split()
    )
)
VERBS = sorted(
    set(
        """
        accept admire allow answer arrive attach bake balance bathe battle beg behave belong
        blink boil borrow bounce breathe brush build bury calculate carry carve celebrate chase
        cheer chew clap climb collect comb compare complain cough count crawl cross dance decide
        deliver depend describe dig divide drift drown dust escape explain fetch fix float fold
        follow gather giggle glow grab grin guard guess hammer hang harvest hop hover hug hum
        hunt hurry imagine invent jog juggle jump kneel knit knock laugh launch lean lick lift
        listen march melt mend mix nod obey observe open paint pause peel plant play polish
        pour pray prepare pretend promise pull punch push race reach read relax remember repair
        rescue rest rhyme ride roar roll rush scatter scrub search settle sew shake shiver shout
        sing sip skip slide smile sneeze sniff spill spin splash squeeze stare stir stretch
        swim swing taste teach tease throw tickle travel trot tumble twist visit wander wash
        whisper wink wobble worry wrap write yawn yell zoom
        """.split()
    )
)
WORDS = sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS))
ZETA_2 = math.pi**2 / 6  # sum of 1/k**2: normalizes fwe's Zipf law (alpha 2)
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


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric for niah/vt/cwe/fwe: per sample, the fraction of its references found in its
    prediction (case-insensitive substring), averaged over samples; in [0, 1]."""
    _check(predictions, references)
    return sum(
        sum(r.lower() in p.lower() for r in refs) / len(refs) for p, refs in zip(predictions, references, strict=True)
    ) / len(predictions)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric for QA: per sample, 1 if any of its references is found in its prediction
    (case-insensitive substring), averaged over samples; in [0, 1]."""
    _check(predictions, references)
    return sum(
        any(r.lower() in p.lower() for r in refs) for p, refs in zip(predictions, references, strict=True)
    ) / len(predictions)


METRICS: dict[str, Callable[[Sequence[str], Sequence[Sequence[str]]], float]] = {
    METRIC_ALL: string_match_all,
    METRIC_PART: string_match_part,
}


def score(samples: Sequence[Sample], predictions: Sequence[str]) -> float:
    """Mean score in [0, 1] of ``predictions`` (the generated text after each prompt), each scored by
    its sample's metric, so a list may mix tasks."""
    _check(predictions, samples)
    return sum(METRICS[s.metric]([p], [s.answers]) for s, p in zip(samples, predictions, strict=True)) / len(samples)


def _check(predictions: Sequence[str], references: Sequence[object]) -> None:
    if not predictions or len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")


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
        text_units = _sentences(tokenizer, haystack_text, length)
    ids = _Memo(tokenizer)
    out = []
    for index in range(samples):
        rng = random.Random(f"{task.name}/{length}/{seed}/{index}")
        depth = index / (samples - 1) if samples > 1 else 0.5
        if task.family == "niah":
            parts = _niah(task, ids, rng, depth, text_units)
        elif task.family == "vt":
            parts = _vt(ids, rng)
        elif task.family == "cwe":
            parts = _cwe(ids, rng, length)
        else:
            parts = _fwe(ids, rng, length)
        prompt, depths, spans = _assemble(task, tokenizer, ids, length, parts)
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


@dataclass
class _Parts:
    """A prompt before assembly: the context is ``units`` (token lists) with ``needles`` inserted."""

    head: str  # instruction, up to the context
    tail: str  # question + answer prefix
    answer_prefix: str
    answers: list[str]
    units: Callable[[int], list[list[int]]]  # units covering at least n tokens; the last one is cut
    needles: list[tuple[float, str]] = field(default_factory=list)  # (depth wanted, text)
    reported: int = 0  # the first ``reported`` needles are the ones Sample.depths describes


def _ids(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


class _Memo:
    """Token ids of pieces of text, each tokenized once per ``generate`` call (cwe's list numbers
    and words recur in every sample)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.known: dict[str, list[int]] = {}

    def __call__(self, texts: list[str]) -> list[list[int]]:
        new = [t for t in dict.fromkeys(texts) if t not in self.known]
        self.known.update(zip(new, _ids(self.tokenizer, new), strict=True))
        return [self.known[t] for t in texts]


def _too_short(task: Task, length: int, fixed: int) -> InfinikvError:
    return InfinikvError(
        f"{task.name} does not fit in {length} tokens: its template, answer prefix and needles alone take "
        f"{fixed}; use a longer length"
    )


def _assemble(
    task: Task, tokenizer: PreTrainedTokenizerBase, ids: _Memo, length: int, parts: _Parts
) -> tuple[list[int], list[float], list[tuple[int, int]]]:
    """Cut the haystack so the prompt is exactly ``length`` tokens; put each needle at the unit
    boundary nearest its depth. Returns the prompt, and the depths and token spans of the needles
    the answer needs."""
    head = tokenizer(parts.head)["input_ids"]
    tail, *needles = ids([parts.tail] + [text for _, text in parts.needles])
    fixed = len(head) + len(tail) + sum(map(len, needles))
    fill = length - fixed
    if fill < 1:
        raise _too_short(task, length, fixed)
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


def _sentences(tokenizer: PreTrainedTokenizerBase, text: str, length: int) -> list[list[int]]:
    """The text's first sentences, each tokenized with a leading space, covering ``length`` tokens
    (tokenizing only as much of a long novel as the prompt needs)."""
    chars = 8 * length
    while True:
        sentences = SENTENCE_END.split(re.sub(r"\s+", " ", text[:chars]).strip())
        if chars < len(text):
            sentences.pop()  # may be cut mid-sentence
        units = _ids(tokenizer, [" " + s for s in sentences])
        have = sum(map(len, units))
        if have >= length:
            return units
        if chars >= len(text):
            raise InfinikvError(
                f"the haystack text has {have} tokens, fewer than a {length}-token prompt needs; "
                "give a longer text or a shorter length"
            )
        chars *= 2


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


def _split(template: str, sep: str, **fields: str) -> tuple[str, str]:
    """A template's text before and after ``{context}``; the context's units carry their own
    leading separator, so the head drops one it would duplicate."""
    head, tail = template.split("{context}")
    head = head.format(**fields)
    return (head[: -len(sep)] if head.endswith(sep) else head), tail.format(**fields)


def _niah(task: Task, ids: _Memo, rng: random.Random, depth: float, text_units: list[list[int]]) -> _Parts:
    count = max(task.keys, task.queries)
    keys: list[str] = []
    while len(keys) < count:
        key = _random(rng, task.key)
        if key not in keys:
            keys.append(key)
    values = [[_random(rng, task.value) for _ in range(task.values)] for _ in keys]
    asked = rng.sample(range(count), task.queries)
    answers = [v for i in asked for v in values[i]]
    one = len(answers) == 1
    kind = task.value[:-1] if one else task.value
    query = _join([keys[i] for i in asked])
    template, prefix = (NIAH_TEMPLATE_ONE, NIAH_ANSWER_PREFIX_ONE) if one else (NIAH_TEMPLATE, NIAH_ANSWER_PREFIX)
    prefix = prefix.format(kind=kind, query=query)
    sep = " " if task.haystack == "text" else "\n"
    head, tail = _split(template, sep, kind=kind, query=query)
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

    return _Parts(head, tail + prefix, prefix, answers, units, needles, reported=len(answers))


def _fixed(units: list[list[int]]) -> Callable[[int], list[list[int]]]:
    return lambda fill: units


def _noise(ids: _Memo) -> Callable[[int], list[list[int]]]:
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


def _vt(ids: _Memo, rng: random.Random) -> _Parts:
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
    head, tail = _split(VT_TEMPLATE, "\n", query=str(value))
    prefix = VT_ANSWER_PREFIX.format(count=5, query=value)
    depths = sorted(rng.random() for _ in asked)
    needles = [(d, "\n" + s) for d, s in zip(depths, _chain(asked, value), strict=True)]
    return _Parts(example + "\n\n" + head, tail + prefix, prefix, asked, _noise(ids), needles, len(needles))


def _cwe(ids: _Memo, rng: random.Random, length: int) -> _Parts:
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
    head, tail = _split(CWE_TEMPLATE, " ")

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

    return _Parts(example + head, tail + CWE_ANSWER_PREFIX, CWE_ANSWER_PREFIX, common, units)


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))


def _fwe(ids: _Memo, rng: random.Random, length: int) -> _Parts:
    """RULER's coded words: ``length // 50`` random 6-letter words, the k-th repeated
    ``int(n / (k**2 * zeta(2)))`` times for the largest ``n`` that fits; the first is ``...``, noise.
    At least 5 words, so that the top 3 have a runner-up to beat."""
    head, tail = _split(FWE_TEMPLATE, " ")
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

    return _Parts(head, tail + FWE_ANSWER_PREFIX, FWE_ANSWER_PREFIX, vocab[1:4], units)
