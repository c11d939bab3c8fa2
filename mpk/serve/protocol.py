"""Request and response bodies of the OpenAI API that ``mpk serve`` speaks (completions, chat
completions, models, errors), as pydantic models. Requests are strict: a wrong type or an
unknown field is a 400 naming the field, as OpenAI answers. ``top_k``, ``min_p`` and
``ignore_eos`` are vLLM's extensions (the openai client sends them through ``extra_body``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mpk.engine.sampling import SamplingParams

# fields OpenAI defines that mpk does not implement: accepted only at these (neutral) values
UNSUPPORTED_DEFAULTS: dict[str, Any] = {"n": 1, "best_of": 1, "echo": False, "suffix": None, "presence_penalty": 0,
                                        "frequency_penalty": 0, "logit_bias": None, "tools": None,
                                        "tool_choice": None, "response_format": None}


StopString = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """The fields completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2 ** 64)
    stop: StopString | list[StopString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    n: int = 1
    presence_penalty: float = 0
    frequency_penalty: float = 0
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for the first field set to what mpk does not implement, or None."""
        for name, neutral in UNSUPPORTED_DEFAULTS.items():
            value = getattr(self, name, neutral)
            if value not in (None, neutral, {}, []):
                hint = "; send one request per completion" if name in ("n", "best_of") else ""
                return name, f"{name}={value!r} is not supported by mpk serve (only {neutral!r}){hint}"
        return None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              max_tokens=max_tokens, stop=self.stop, ignore_eos=self.ignore_eos, seed=self.seed,
                              logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is a string or token ids (or a list of one of
    them); ``logprobs``: that many most likely tokens per position."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``: ``logprobs`` (bool) asks for the chosen tokens'
    log-probabilities, ``top_logprobs`` for that many alternatives each;
    ``max_completion_tokens`` is OpenAI's newer name of ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A completion, or (``object`` "text_completion" as OpenAI streams it too) one chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int = 0
    message: dict[str, str]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mpk"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def field_names() -> set[str]:
    """Every field name of the request models (to tell a field from a union member in a
    validation error's location)."""
    models = (CompletionRequest, ChatCompletionRequest, ChatMessage, StreamOptions)
    return {name for m in models for name in m.model_fields}


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
