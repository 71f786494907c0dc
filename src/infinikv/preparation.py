"""The one way a policy's preparation runs (InfiniGen's calibration): ``ensure_prepared``.

A policy declares ``needs_preparation`` and loads or runs its own preparation; what it runs on
is read here, from the texts ``data`` knows, so no policy reads a text."""

from __future__ import annotations

from typing import Any

import torch

from .contract import Preparing
from .data import load_text
from .policies import Policy
from .sizes import model_device


def text_reader(model: torch.nn.Module, tokenizer: Any):
    """``read(name, tokens)``: the first ``tokens`` token ids (1, n) of a text (from its first
    chapter), on the model's device."""

    def read(name: str, tokens: int) -> torch.Tensor:
        ids = tokenizer(load_text(name, from_chapter_one=True)[: tokens * 8], return_tensors="pt").input_ids
        return ids[:, :tokens].to(model_device(model))

    return read


def ensure_prepared(
    policy: Policy,
    model: torch.nn.Module,
    tokenizer: Any,
    how: Preparing | None = None,
) -> str | None:
    """Load or run ``policy``'s preparation for ``model`` if it needs one, as ``how`` says (default:
    the policy's text and tokens, loaded when saved); says what it did, None if nothing."""
    if not policy.needs_preparation:
        return None
    return policy.prepare(model, text_reader(model, tokenizer), how or Preparing())
