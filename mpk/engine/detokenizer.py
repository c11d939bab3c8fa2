"""Incremental detokenization: the text of each new token, held back while it ends in a partial
UTF-8 character (a byte-level token that completes in the next one)."""

from __future__ import annotations

from typing import Any, Sequence


class IncrementalDetokenizer:
    """Text of a growing list of token ids, a piece per call (special tokens skipped).

    Decodes a short window (from ``prefix`` to the end) rather than everything, and emits text
    only when the window's decoding has grown past the already emitted part and does not end
    in U+FFFD (a character whose bytes have not all arrived yet)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.prefix = self.read = 0  # window start; tokens up to read are emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def step(self, ids: Sequence[int]) -> str:
        """The new text of ``ids`` (the whole output so far) since the last call."""
        before = self._decode(ids[self.prefix:self.read])
        now = self._decode(ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(ids)
            return now[len(before):]
        return ""

    def flush(self, ids: Sequence[int]) -> str:
        """The text held back at the end of the output (the sequence finished)."""
        before = self._decode(ids[self.prefix:self.read])
        now = self._decode(ids[self.prefix:])
        self.prefix = self.read = len(ids)
        return now[len(before):] if now.startswith(before) else ""
