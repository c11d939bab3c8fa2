"""The engine's outputs in OpenAI's response shapes: whole responses, stream chunks, usage and
log-probabilities (completions': token strings and offsets; chat's: token, logprob, bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpk.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
)


def _top(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely (token id, logprob) of a step (the engine's dict also holds the
    chosen token, which may rank below them)."""
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:k]


@dataclass
class Rendering:
    """Renders one request's outputs: ``chat`` or completions, ``model`` name, ``top``: the
    alternatives asked for per token (None: no logprobs). Tracks the text so far (completion
    logprobs' ``text_offset``) and the tokens generated (usage)."""

    tokenizer: Any
    chat: bool
    request_id: str
    created: int
    model: str
    prompt_tokens: int
    top: int | None
    text: str = ""
    completion_tokens: int = 0
    _pieces: dict[int, str] = field(default_factory=dict)

    def _piece(self, token: int) -> str:
        if token not in self._pieces:
            self._pieces[token] = self.tokenizer.decode([token])
        return self._pieces[token]

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens)

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                  offset: int) -> CompletionLogprobs | ChatLogprobs | None:
        if self.top is None or logprobs is None:
            return None
        if self.chat:
            def entry(t: int, lp: float) -> TopLogprob:
                return TopLogprob(token=self._piece(t), logprob=lp, bytes=list(self._piece(t).encode()))
            return ChatLogprobs(content=[
                TokenLogprob(**entry(t, lps[t]).model_dump(), top_logprobs=[entry(i, v) for i, v in _top(lps, self.top)])
                for t, lps in zip(token_ids, logprobs)])
        out = CompletionLogprobs()
        for t, lps in zip(token_ids, logprobs):
            out.tokens.append(self._piece(t))
            out.token_logprobs.append(lps[t])
            top: dict[str, float] = {}
            for i, v in _top(lps, self.top):  # tokens of one text (partial UTF-8 bytes): the likeliest's
                top.setdefault(self._piece(i), v)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(self._piece(t))
        return out

    def chunk(self, text: str, token_ids: list[int], logprobs: list[dict[int, float]] | None,
              finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        """A stream chunk of new text (``role``: chat's first chunk, announcing the assistant)."""
        lp = self._logprobs(token_ids, logprobs, len(self.text))
        self.text += text
        self.completion_tokens += len(token_ids)
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text} if text else {}
            choice = ChatChunkChoice(delta=delta, logprobs=lp, finish_reason=finish_reason)
            return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                       choices=[choice]).model_dump(mode="json")
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[
            CompletionChoice(text=text, logprobs=lp, finish_reason=finish_reason)]).model_dump(mode="json")

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        cls = ChatCompletionChunk if self.chat else CompletionResponse
        return cls(id=self.request_id, created=self.created, model=self.model, choices=[],
                   usage=self.usage()).model_dump(mode="json")

    def response(self, text: str, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                 finish_reason: str | None) -> dict[str, Any]:
        """The whole (not streamed) response."""
        lp = self._logprobs(token_ids, logprobs, 0)
        self.text, self.completion_tokens = text, len(token_ids)
        if self.chat:
            choice = ChatChoice(message={"role": "assistant", "content": text}, logprobs=lp,
                                finish_reason=finish_reason)
            return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                          choices=[choice], usage=self.usage()).model_dump(mode="json")
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=[CompletionChoice(text=text, logprobs=lp, finish_reason=finish_reason)],
                                  usage=self.usage()).model_dump(mode="json")
