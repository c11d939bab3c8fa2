"""The FastAPI application of ``mpk serve``: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health`` and ``/metrics``; errors in OpenAI's format; ``--api-key``."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST

from mpk.engine.outputs import RequestOutput
from mpk.errors import MpkError
from mpk.serve.engine import AsyncEngine, EngineStoppedError, QueueFullError
from mpk.serve.metrics import Metrics
from mpk.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    ModelCard,
    ModelList,
    error_body,
    field_names,
)
from mpk.serve.responses import Rendering

FIELDS = field_names()


class ApiError(Exception):
    """An HTTP error answered in OpenAI's format."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


class _CountStatus:
    """ASGI middleware counting /v1 responses by status (pure ASGI: it must not buffer streams
    nor hide a client's disconnect, as Starlette's BaseHTTPMiddleware would)."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, counted)


def _validation_error(exc: RequestValidationError) -> ApiError:
    """The first pydantic error as a 400 naming its field."""
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                        code="json_invalid")
    if not loc:
        return ApiError(400, f"the body: {err['msg']}; expected a JSON object of the request's fields")
    # loc: fields and list indices, and for a union the member tried (not part of the name)
    param = loc[0]
    for x in loc[1:]:
        if x.isdigit():
            param += f"[{x}]"
        elif x in FIELDS:
            param += f".{x}"
        else:
            break
    got = f" (got {err['input']!r})" if err.get("type") != "missing" and "input" in err else ""
    return ApiError(400, f"{param}: {err['msg']}{got}", param=param)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              aliases: tuple[str, ...] = ()) -> FastAPI:
    """The application serving ``engine`` as ``model_name`` (requests may also name it by an
    alias, e.g. the path given to --model). ``engine`` must be started (its tokenizer and
    limits are read here); the app stops it when it shuts down."""
    if engine.info is None:
        raise MpkError("build_app needs a started engine (AsyncEngine.start)")
    info, metrics = engine.info, engine.metrics
    names = {model_name, *aliases}
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.stop()

    app = FastAPI(title="mpk serve", lifespan=lifespan)
    app.add_middleware(_CountStatus, metrics=metrics)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.param, exc.code, exc.kind), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, _validation_error(exc))

    def authorized(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if api_key is not None and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "missing or wrong API key; send the header `Authorization: Bearer <key>` with "
                           "the key given to --api-key", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @app.get("/health")
    async def health() -> Response:
        why = engine.failure or "shut down"
        return JSONResponse({"status": "ok" if engine.alive else f"engine stopped: {why}"},
                            status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models() -> dict:
        card = ModelCard(id=model_name, created=created, max_model_len=info.max_model_len)
        return ModelList(data=[card]).model_dump()

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: a batch of {len(prompt)} prompts; mpk serve takes one prompt per "
                               "request (send several requests)", param="prompt")
            prompt = prompt[0]
        ids = info.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        return await _generate(request, body, ids, "prompt", body.logprobs, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check(body)
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        conversation = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):  # content parts: text only
                if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
                    raise ApiError(400, f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": "
                                   "...}) are supported", param=f"messages[{i}].content")
                content = "".join(p["text"] for p in content)
            conversation.append({"role": m.role, "content": content})
        try:
            _, ids = info.chat_prompt(conversation)
        except (TemplateError, ValueError, TypeError, MpkError) as e:  # e.g. a template refusing the roles' order
            raise ApiError(400, f"messages: the chat template does not apply ({type(e).__name__}: {e})",
                           param="messages") from None
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await _generate(request, body, ids, "messages", top, chat=True,
                               max_tokens=body.max_completion_tokens)

    def check(body: GenerationRequest) -> None:
        """The model is this one, and no field asks for what mpk does not implement."""
        if body.model not in names:
            raise ApiError(400, f"model {body.model!r} is not served here; expected {model_name!r} (GET /v1/models)",
                           param="model", code="model_not_found")
        unsupported = body.unsupported()
        if unsupported:
            raise ApiError(400, unsupported[1], param=unsupported[0])

    async def _generate(request: Request, body: GenerationRequest, ids: list[int], prompt_field: str,
                        top: int | None, chat: bool, max_tokens: int | None = None) -> Response:
        """Run a checked request: 400 for a prompt that does not fit, 429 when the server is
        full, then the whole response or (``stream``) server-sent events."""
        max_tokens = max_tokens or body.max_tokens
        room = info.max_model_len - len(ids)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = f" and max_tokens={max_tokens}" if max_tokens is not None else ""
            raise ApiError(400, f"{prompt_field}: {len(ids)} prompt tokens{asked} exceed the model's context "
                           f"length, max_model_len={info.max_model_len} (shorten the prompt or lower max_tokens)",
                           param=prompt_field if room < 1 else "max_tokens", code="context_length_exceeded")
        params = body.sampling_params(max_tokens or room, top)
        try:
            params.validate(info.vocab)
        except MpkError as e:
            raise ApiError(400, str(e)) from None
        outputs = engine.generate(ids, params)
        try:
            admitted = await anext(outputs)
        except QueueFullError as e:
            raise ApiError(429, str(e), code="queue_full", kind="rate_limit_error") from None
        except EngineStoppedError as e:
            raise ApiError(503, str(e), kind="server_error") from None
        if admitted.error:
            await outputs.aclose()
            if engine.failure is not None:  # refused because the engine stopped, not for its content
                raise ApiError(503, admitted.error, kind="server_error")
            raise ApiError(400, f"{prompt_field}: {admitted.error}", param=prompt_field)
        render = Rendering(info.tokenizer, chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                           int(time.time()), body.model, len(ids), top)
        if body.stream:
            return StreamingResponse(_sse(outputs, render, body.include_usage), media_type="text/event-stream")
        final = await _collect(outputs, request)
        if final is None:  # the client left; the request was aborted
            return Response(status_code=499)
        out = final[-1]
        if out.error:
            raise ApiError(500, out.error, kind="server_error")
        pieces = [o.outputs[0] for o in final]
        logprobs = [lp for c in pieces for lp in (c.logprobs or [])] if top is not None else None
        return JSONResponse(render.response("".join(c.text for c in pieces),
                                            [t for c in pieces for t in c.token_ids], logprobs,
                                            out.outputs[0].finish_reason))

    app.include_router(v1)
    return app


async def _collect(outputs: AsyncIterator[RequestOutput], request: Request) -> list[RequestOutput] | None:
    """Every output of a request, or None (the request aborted) if the client disconnects
    first: Starlette does not cancel a handler whose client left, so watch for it."""
    async def drain() -> list[RequestOutput]:
        async with aclosing(outputs):
            return [out async for out in outputs]

    task = asyncio.ensure_future(drain())
    while not (await asyncio.wait({task}, timeout=0.5))[0]:
        if await request.is_disconnected():
            task.cancel()  # closes the generator: the engine aborts the request
            return None
    return task.result()


async def _sse(outputs: AsyncIterator[RequestOutput], render: Rendering, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``. A client that
    disconnects cancels this generator, which closes ``outputs``: the request is aborted."""
    def event(doc: dict) -> str:
        return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"

    async with aclosing(outputs):
        if render.chat:
            yield event(render.chunk("", [], None, None, role=True))
        async for out in outputs:
            c = out.outputs[0]
            if out.error:
                yield event(error_body(out.error, kind="server_error"))
                break
            if c.text or c.token_ids or out.finished:
                yield event(render.chunk(c.text, c.token_ids, c.logprobs, c.finish_reason if out.finished else None))
        else:
            if include_usage:
                yield event(render.usage_chunk())
    yield "data: [DONE]\n\n"
