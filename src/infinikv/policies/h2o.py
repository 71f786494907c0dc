"""``h2o``: Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models", NeurIPS 2023). Keeps the most recent tokens
plus the tokens that have received the most attention so far (accumulated over every query
of the KV head's group), per sequence and per KV head."""

from ..contract import Cost
from .base import Evicting
from .rules import HeavyHitter


class HeavyHitters(Evicting):
    """Heavy hitters + recent window, scored by accumulated attention."""

    name = "h2o"
    rule = HeavyHitter
    cost = Cost("h2o", stores=lambda keep, dense: keep, reads=lambda keep, dense: keep, share=("keep", 0.2))
