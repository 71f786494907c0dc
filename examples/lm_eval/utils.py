"""Three small local lm-eval tasks, generated here (no download), one per kind of request that
infinikv's lm-eval model answers: ``generate_until`` (a pass key), ``loglikelihood`` (a word to
recall, four choices) and ``loglikelihood_rolling`` (perplexity of a few paragraphs)."""

import random

import datasets

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
WORDS = ["apple", "river", "candle", "violin", "garden", "rocket", "pebble", "lantern", "meadow", "harbor"]
PARAGRAPHS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters.",
    "The family of Dashwood had long been settled in Sussex. Their estate was large, and their residence was at "
    "Norland Park, in the centre of their property, where, for many generations, they had lived in so "
    "respectable a manner as to engage the general good opinion of their surrounding acquaintance.",
]


def _filler(rng: random.Random, key_sentence: str, repeats: int) -> str:
    at = rng.randint(0, repeats)
    return FILLER * at + key_sentence + " " + FILLER * (repeats - at)


def passkey(**kwargs) -> dict[str, datasets.Dataset]:
    """Twenty prompts of about 400 tokens, each hiding a 5-digit pass key at a random depth."""
    rng = random.Random(0)
    docs = []
    for _ in range(20):
        key = str(rng.randint(10000, 99999))
        context = _filler(rng, f"The pass key is {key}. Remember it. {key} is the pass key.", 16)
        docs.append(
            {
                "prompt": "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
                + context
                + "\n\nWhat is the pass key? The pass key is",
                "key": key,
            }
        )
    return {"test": datasets.Dataset.from_list(docs)}


def recall(**kwargs) -> dict[str, datasets.Dataset]:
    """Twenty prompts that name a word, bury it in filler, and ask for it back among four words."""
    rng = random.Random(1)
    docs = []
    for _ in range(20):
        choices = rng.sample(WORDS, 4)
        label = rng.randrange(4)
        context = _filler(rng, f"The word to remember is {choices[label]}.", 12)
        docs.append({"prompt": context + "\nThe word to remember is", "choices": choices, "label": label})
    return {"test": datasets.Dataset.from_list(docs)}


def paragraphs(**kwargs) -> dict[str, datasets.Dataset]:
    return {"test": datasets.Dataset.from_list([{"text": p} for p in PARAGRAPHS])}


def passkey_found(doc: dict, results: list[str]) -> dict[str, float]:
    return {"acc": float(doc["key"] in results[0])}
