"""RULER generators and scoring, with the bundled tokenizer only (no model): exact lengths,
answers recoverable from the prompt, determinism by seed, depths, metrics and errors."""

import re
from collections import Counter
from functools import cache

import pytest
from transformers import AutoTokenizer

from infinikv.data import load_text
from infinikv.errors import InfinikvError
from infinikv.eval import ruler
from infinikv.models import DEFAULT_MODEL, bundled_folder

LENGTHS = (1024, 4096)  # cwe uses RULER's short-context word counts below 4096 tokens, its usual ones from there
SAMPLES = 5
NIAH = [name for name, task in ruler.TASKS.items() if task.family == "niah"]


@cache
def tokenizer():
    return AutoTokenizer.from_pretrained(bundled_folder(DEFAULT_MODEL))


@cache
def emma() -> str:
    return load_text("austen:emma", from_chapter_one=True)


@cache
def samples(task: str, length: int, seed: int = 0) -> list[ruler.Sample]:
    return ruler.generate(task, tokenizer(), emma(), length, SAMPLES, seed=seed)


def text_of(sample: ruler.Sample) -> str:
    return tokenizer().decode(sample.prompt_ids)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", ruler.TASKS)
def test_prompts_are_exactly_length_tokens_and_end_with_the_answer_prefix(task, length):
    for i, sample in enumerate(samples(task, length)):
        assert len(sample.prompt_ids) == length
        assert (sample.task, sample.length, sample.index) == (task, length, i)
        assert sample.max_new_tokens == ruler.TASKS[task].max_new_tokens
        assert sample.metric == "string_match_all"
        assert sample.answers and text_of(sample).endswith(sample.answer_prefix)


def needles_of(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for key, value in re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", text):
        found.setdefault(key, []).append(value)
    return found


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", NIAH)
def test_niah_answers_are_the_values_of_the_asked_keys(task, length):
    spec = ruler.TASKS[task]
    for sample in samples(task, length):
        text = text_of(sample)
        asked = re.fullmatch(
            r" The special magic \w+ for (.+) mentioned in the provided text (?:is|are)", sample.answer_prefix
        )[1]
        assert f"for {asked} mentioned in the provided text?" in text
        keys = re.split(r", and |, ", asked)
        needles = needles_of(text)
        assert len(keys) == spec.queries and len(needles) >= spec.keys
        n = spec.values  # each asked key's values (in any order); no distractor shares an asked key
        assert [sorted(needles[k]) for k in keys] == [
            sorted(sample.answers[i * n : i * n + n]) for i in range(len(keys))
        ]
        assert len(sample.answers) == spec.queries * spec.values
        assert len(sample.depths) == len(sample.answers)
        pattern = (
            r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
            if spec.value == "uuids"
            else r"\d{7}"
        )
        assert all(re.fullmatch(pattern, a) for a in sample.answers)
        spans = [tokenizer().decode(sample.prompt_ids[start:end]) for start, end in sample.spans]
        assert sorted(a for a in sample.answers if any(a in span for span in spans)) == sorted(sample.answers)
        assert len(spans) == len(sample.answers) and [s for s, _ in sample.spans] == sorted(s for s, _ in sample.spans)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", NIAH)
def test_niah_depths_spread_evenly_over_samples(task, length):
    first = [s.depths[0] for s in samples(task, length)]
    assert first == sorted(first) and first[0] < 0.1 and first[-1] > 0.9
    assert all(0 <= d <= 1 for s in samples(task, length) for d in s.depths)
    for want, got in zip([i / (SAMPLES - 1) for i in range(SAMPLES)], first, strict=True):
        assert abs(want - got) < 0.1  # needles go to the nearest sentence or line boundary


@pytest.mark.parametrize("length", LENGTHS)
def test_vt_answers_are_every_name_on_the_chain(length):
    for sample in samples("vt", length):
        text = text_of(sample)
        asked = text[text.rindex("Memorize and track") :]  # past the one-shot example
        value = re.search(r"assigned the value (\d{5}) in the text above", asked).group(1)
        holders = set(re.findall(rf"VAR ([A-Z]{{5}}) = {value}\b", asked))
        for target, source in re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})", asked):
            if source in holders:
                holders.add(target)
        assert holders == set(sample.answers) and len(sample.answers) == 5
        assert len(sample.depths) == 5 and sample.depths == sorted(sample.depths)


@pytest.mark.parametrize("length", LENGTHS)
def test_cwe_answers_are_the_ten_most_common_words(length):
    for sample in samples("cwe", length):
        text = text_of(sample)
        listed = text[text.rindex("appear most often.\n") : text.rindex("\nQuestion:")]
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", listed))
        assert {w for w, _ in counts.most_common(10)} == set(sample.answers)
        others = [c for w, c in counts.items() if w not in sample.answers]
        assert min(counts[w] for w in sample.answers) > 2 * max(others)
        assert sample.depths == []


@pytest.mark.parametrize("length", LENGTHS)
def test_fwe_answers_are_the_three_most_frequent_coded_words(length):
    for sample in samples("fwe", length):
        text = text_of(sample)
        coded = text[text.index("coded words. ") : text.rindex("\nQuestion:")].split()[2:]
        counts = Counter(w for w in coded if w.strip("."))
        ranked = counts.most_common(4)
        assert [w for w, _ in ranked[:3]] == sample.answers
        assert ranked[2][1] > ranked[3][1]
        assert Counter(coded)["..."] > ranked[0][1]  # the noise word is the commonest


@pytest.mark.parametrize("task", ruler.TASKS)
def test_same_seed_same_samples_other_seed_other_keys(task):
    again = ruler.generate(task, tokenizer(), emma(), 1024, SAMPLES, seed=0)
    assert again == samples(task, 1024)
    other = samples(task, 1024, seed=1)
    assert all(a.answers != b.answers for a, b in zip(other, again, strict=True))
    assert all(a.prompt_ids != b.prompt_ids for a, b in zip(other, again, strict=True))


def test_a_seed_gives_the_same_keys_on_any_machine():
    """Runs are comparable across machines and versions only if the samples do not move."""
    sample = ruler.generate("niah_single_1", tokenizer(), None, 1024, 1)[0]
    assert sample.answers == ["6575728"] and " for cruel-stable " in sample.answer_prefix


def test_scoring_on_hand_made_outputs():
    refs = [["1234567", "7654321"], ["ABCDE"], ["x"]]
    assert ruler.string_match_all([" 1234567 and 7654321.", "abcde", "x"], refs) == 1.0
    assert ruler.string_match_all(["1234567 only", "Abcde", "nothing"], refs) == pytest.approx((0.5 + 1 + 0) / 3)
    assert ruler.string_match_all(["none", "none", "none"], refs) == 0.0
    assert ruler.string_match_part(["1234567 only", "ABCDE", "no"], refs) == pytest.approx(2 / 3)
    assert ruler.string_match_part(["7654321", "abcDE", "X"], refs) == 1.0
    with pytest.raises(ValueError):
        ruler.string_match_all(["one"], refs)


def test_score_uses_each_samples_answers_and_metric():
    mixed = [samples("niah_multivalue", 1024)[0], samples("vt", 1024)[0]]
    perfect = [" ".join(s.answers) for s in mixed]
    assert ruler.score(mixed, perfect) == 1.0
    half = [" ".join(mixed[0].answers[:2]), "nothing"]
    assert ruler.score(mixed, half) == pytest.approx(0.25)


def test_task_names():
    assert ruler.task_names("all") == list(ruler.TASKS)
    assert ruler.task_names(" vt, cwe,vt ") == ["vt", "cwe"]
    assert ruler.task_names("fwe,all")[0] == "fwe" and len(ruler.task_names("fwe,all")) == len(ruler.TASKS)


def one_line_error(match: str):
    return pytest.raises(InfinikvError, match=match)


@pytest.mark.parametrize("spec", ["nope", "vt,nope", "", " , "])
def test_bad_task_names_are_one_line_errors(spec):
    with one_line_error("RULER task") as caught:
        ruler.task_names(spec)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "task, text, length, kwargs, match",
    [
        ("nope", None, 1024, {}, "unknown RULER task"),
        ("niah_single_1", None, 60, {}, "does not fit in 60 tokens"),
        ("vt", None, 300, {}, "does not fit in 300 tokens"),
        ("cwe", None, 512, {}, "does not fit in 512 tokens"),
        ("fwe", None, 100, {}, "does not fit in 100 tokens"),
        ("niah_single_1", None, 8192, {"max_context": 8192}, "trained context of 8192"),
        ("niah_single_2", None, 1024, {}, "needs a haystack text"),
        ("niah_single_2", "Too short. A text.", 1024, {}, "haystack text has"),
        ("vt", None, 1024, {"samples": 0}, "samples must be at least 1"),
    ],
)
def test_bad_requests_are_one_line_errors(task, text, length, kwargs, match):
    args = {"samples": 2} | kwargs
    with one_line_error(match) as caught:
        ruler.generate(task, tokenizer(), text, length, **args)
    assert "\n" not in str(caught.value)


def test_max_context_allows_room_for_the_answer():
    task = ruler.TASKS["niah_single_1"]
    ruler.generate(task, tokenizer(), None, 1024, 1, max_context=1024 + task.max_new_tokens)
