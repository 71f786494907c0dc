"""``snapkv``: SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
2024). Like ``h2o`` it keeps a budget of tokens per layer and KV head, but the prompt is scored
by its own last queries (where a question sits), so what is kept for decoding is what the
question looks at, not what the text before it happened to attend to (see ``rules.Question``)."""

import torch

from ..contract import Cost
from .base import Evicting
from .rules import Question


class SnapKV(Evicting):
    """The budget's best prompt tokens for the prompt's last queries, then H2O-style updates.

    Its prompt is read in one forward unless ``--prefill-chunk`` says otherwise: the question at
    its end must score every prompt token, so the prefill's peak is the whole prompt (read in
    chunks, each chunk would be scored and evicted by its own last queries, before the question)."""

    name = "snapkv"
    rule = Question

    def prefill_chunk(self, model: torch.nn.Module, prompt_tokens: int | None) -> int | None:
        if self.params["prefill_chunk"] or prompt_tokens is None:
            return self.params["prefill_chunk"]  # the question's window must see the whole prompt
        return max(1, prompt_tokens)

    cost = Cost("snapkv", stores=lambda keep, dense: keep, reads=lambda keep, dense: keep, share=("keep", 0.2))
