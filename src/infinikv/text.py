"""Incremental detokenization: the text of each new token at a cost independent of how long the
output already is (decoding the whole output at every step is quadratic in its length)."""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"  # what a tokenizer prints for an incomplete UTF-8 sequence


class Detokenizer:
    """Turns tokens into text pieces as they arrive.

    Decodes a short window only: the tokens since the last emitted piece plus the piece before it
    (tokenizers that drop a leading space at the start of a decode need the context). A piece is
    held back while it ends in an incomplete character. The pieces add up to the whole decode.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # tokens already turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token: int) -> str:
        """The new text that ``token`` completes ("" while a character is incomplete)."""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back, at the end of the output."""
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :] if len(now) > len(before) else ""
