"""``Sequence``: a request's state in the engine (its tokens, how many the cache holds, its
pages) and its stop conditions."""

from __future__ import annotations

from typing import Any

from mpk.engine.block_manager import BlockTable
from mpk.engine.detokenizer import IncrementalDetokenizer
from mpk.engine.sampling import SamplingParams


class Sequence:
    """A request being generated. ``token_ids``: prompt then output; ``num_computed``: the
    tokens whose k/v the cache holds (a preempted sequence restarts from 0, its output kept as
    prompt to recompute); ``seed``: its sampling seed; ``order``: admission order (the largest
    is the youngest, preempted first)."""

    def __init__(self, request_id: int, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, tokenizer: Any | None):
        self.request_id, self.prompt, self.params, self.seed = request_id, prompt, params, seed
        self.prompt_token_ids = prompt_token_ids
        self.token_ids = list(prompt_token_ids)
        self.num_computed = 0
        self.block = BlockTable()
        self.order = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.text = ""
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stops = params.stop_strings
        self._hold = max((len(s) for s in self._stops), default=1) - 1  # chars that may start a stop string
        self._shown = (0, 0)  # characters and tokens handed out by take_delta

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def to_compute(self) -> int:
        """Tokens not yet in the cache: the prompt's rest, or 1 (the last sampled) in decode."""
        return len(self.token_ids) - self.num_computed

    def fail(self, message: str) -> None:
        self.error, self.finish_reason = message, "error"

    def append(self, token: int, eos_ids: frozenset[int], max_model_len: int,
               logprobs: dict[int, float] | None = None) -> None:
        """Add a generated token, its text, and finish the sequence if a stop condition holds:
        a stop token id or EOS (unless ignore_eos) → "stop"; a stop string in the text → "stop",
        the text cut before it; max_tokens or max_model_len tokens in all → "length"."""
        p = self.params
        self.token_ids.append(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if self.detokenizer is not None:
            before = len(self.text)
            self.text += self.detokenizer.step(self.output_token_ids)
            if self._stops:
                window = max(0, before - self._hold)  # a stop string may straddle the new text
                hits = [(i, s) for s in self._stops if (i := self.text.find(s, window)) >= 0]
                if hits:
                    i, s = min(hits)
                    self.text = self.text[:i]
                    self.finish_reason, self.stop_reason = "stop", s
                    return
        if token in p.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif not p.ignore_eos and token in eos_ids:
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= p.max_tokens or len(self.token_ids) >= max_model_len:
            self.finish_reason = "length"
        if self.finished and self.detokenizer is not None:
            self.text += self.detokenizer.flush(self.output_token_ids)

    def streamable_text(self) -> str:
        """The text safe to show now: all of it once finished, else without the last characters
        that could still begin a stop string."""
        if self.finished or not self._hold:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]

    def take_delta(self) -> tuple[str, list[int], list[dict[int, float]] | None]:
        """(text, token ids, logprobs) new since the last call: the streamable text only (see
        ``streamable_text``), every new token."""
        chars, toks = self._shown
        text = self.streamable_text()
        self._shown = (max(chars, len(text)), len(self.output_token_ids))
        logprobs = self.logprobs[toks:] if self.logprobs is not None else None
        return text[chars:], self.output_token_ids[toks:], logprobs
