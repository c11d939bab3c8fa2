"""What ``mpk.LLM`` returns: ``RequestOutput`` per request, ``CompletionOutput`` per generated
sequence (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """A generated sequence: its ``text`` (stop string excluded), ``token_ids``,
    ``finish_reason`` ("stop": EOS, a stop token or string; "length": max_tokens or
    max_model_len; "error": the request failed; "abort": ``LLM.abort`` dropped it; None:
    still running) and, if asked for, ``logprobs``: per generated token a {token id:
    log-probability} of the most likely ones and the chosen one. From ``LLM.stream``: the text and tokens new since the last output."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it


@dataclass
class RequestOutput:
    """One request's result: the ``prompt`` (text, or None when given as token ids), its
    ``prompt_token_ids``, ``outputs`` (one ``CompletionOutput``), ``finished`` and ``error``
    (why the request failed, None if it did not)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
