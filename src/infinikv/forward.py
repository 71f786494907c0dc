"""The model's one forward over a cache. The decode core (eager and compiled) and the transformers
baseline all call the model through it, so every caller runs the same call: one place to change
what the model is asked for."""

from __future__ import annotations

import torch
from transformers import Cache


def forward(
    model: torch.nn.Module,
    cache: Cache,
    ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None = None,
    keep_all: bool = False,
) -> torch.Tensor:
    """``ids`` (b, q) at ``positions`` (b, q) through ``model`` over ``cache`` (``mask``: a 4-D mask
    so that transformers builds none, or None to let it). Returns the next-token logits (b, V),
    or every position's (b, q, V) with ``keep_all``."""
    out = model(
        input_ids=ids,
        position_ids=positions,
        cache=cache,
        attention_mask=mask,
        use_cache=True,
        logits_to_keep=0 if keep_all else 1,
    )
    return out.logits if keep_all else out.logits[:, -1]
