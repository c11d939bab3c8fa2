"""Incremental detokenization: the text of each new token, held back while it ends in a partial
UTF-8 character (a byte-level token that completes in the next one)."""

from __future__ import annotations

from typing import Any, Sequence


class IncrementalDetokenizer:
    """Text of a growing list of token ids, a piece per call (special tokens skipped).

    A fast tokenizer (a Rust ``tokenizers`` backend) decodes each new token once through its
    ``DecodeStream``, which keeps its own window: about a microsecond a token, however long the
    output. Another tokenizer decodes a short window (from ``prefix`` to the end) twice a call,
    and emits text only when the window's decoding has grown past the already emitted part and
    does not end in U+FFFD (a character whose bytes have not all arrived yet)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.prefix = self.read = 0  # window start; tokens up to read are emitted (or streamed)
        self.emitted = 0  # characters returned so far
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=True)
        else:
            self._backend = self._stream = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def step(self, ids: Sequence[int]) -> str:
        """The new text of ``ids`` (the whole output so far) since the last call."""
        if self._stream is not None:
            pieces = [self._stream.step(self._backend, t) for t in ids[self.read:]]
            self.read = len(ids)
            text = "".join(p for p in pieces if p)
        else:
            before = self._decode(ids[self.prefix:self.read])
            now = self._decode(ids[self.prefix:])
            text = ""
            if len(now) > len(before) and not now.endswith("\ufffd"):
                self.prefix, self.read = self.read, len(ids)
                text = now[len(before):]
        self.emitted += len(text)
        return text

    def flush(self, ids: Sequence[int]) -> str:
        """The text held back at the end of the output (the sequence finished)."""
        if self._stream is not None:
            self.step(ids)
            # what the stream still holds (an incomplete character): the full decoding's tail,
            # one decode of the output per sequence
            full = self._decode(ids)
            tail, self.emitted = full[self.emitted:], len(full)
            self.prefix = self.read = len(ids)
            return tail
        before = self._decode(ids[self.prefix:self.read])
        now = self._decode(ids[self.prefix:])
        self.prefix = self.read = len(ids)
        return now[len(before):] if now.startswith(before) else ""
