"""``snapkv``: SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
2024). Like ``h2o`` it keeps a budget of tokens per layer and KV head, but the prompt is scored
by its own last queries (where a question sits), so what is kept for decoding is what the
question looks at, not what the text before it happened to attend to (see ``rules.Question``)."""

from ..contract import Cost
from .base import Evicting
from .rules import Question


class SnapKV(Evicting):
    """The budget's best prompt tokens for the prompt's last queries, then H2O-style updates."""

    name = "snapkv"
    rule = Question
    cost = Cost("snapkv", stores=lambda keep, dense: keep, reads=lambda keep, dense: keep, share=("keep", 0.2))
