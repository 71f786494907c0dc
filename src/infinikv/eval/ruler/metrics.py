"""RULER's metrics: the fraction of a sample's answers found in its output."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass
from .tasks import METRIC_ALL, METRIC_PART, Sample


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
