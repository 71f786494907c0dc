"""``sink``: StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention
Sinks", ICLR 2024). Keeps the first few tokens, which soak up attention mass whatever their
content, plus the most recent ones; forgets the middle."""

from .base import Evicting
from .rules import SinkRecent


class Sink(Evicting):
    """Attention sinks + recent window."""

    name = "sink"
    rule = SinkRecent
