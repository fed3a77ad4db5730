"""The OpenAI-compatible HTTP API over a `LiveRun` (FastAPI).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streamed as server-sent
events with `stream: true`), `GET /v1/models`, `GET /health`, `GET /metrics`. With an
API key, the `/v1` routes need `Authorization: Bearer KEY`.

Sampling fields: `max_tokens` (chat: or `max_completion_tokens`), `temperature`,
`top_p`, `stop` (a string or a list), `n` (1 only), `stream`,
`stream_options.include_usage`; extensions as vLLM's: `ignore_eos`, and
`return_token_ids` (each choice gets `token_ids`, its generated ids). Other fields
are accepted and ignored.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400
for bad JSON, a bad field (`param` names it), a prompt over the context or
`max_tokens` over what is left of it; 401 a wrong key; 404 another model's name;
429 when the server holds its most requests; 503 while it drains or after its last
row. A client that disconnects cancels its request (its pages are freed at once);
one stopped by a stop string or the end-of-sequence token ends early with
`finish_reason: "stop"`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Literal, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from orca_jax.serving.live import LiveRun, QueueFull, Submission, Unavailable
from orca_jax.serving.metrics import ServingMetrics
from orca_jax.serving.tokenizer import Detokenizer, Tokenizer


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Optional[Union[str, list[str]]] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    return_token_ids: bool = False


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str]]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error", code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, message, param, kind, code)

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.kind, "param": self.param,
            "code": self.code}})


def _validation_error(error: RequestValidationError) -> ApiError:
    """The first complaint of FastAPI's validation, naming the field (`messages.0.role`)."""
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}")
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    return ApiError(400, f"{param or 'body'}: {first.get('msg')}", param=param)


def create_app(live: LiveRun, tokenizer: Tokenizer, *, model_name: str, max_model_len: int,
               vocab_size: int, api_key: Optional[str] = None,
               metrics: Optional[ServingMetrics] = None,
               on_shutdown: Optional[Callable[[], None]] = None) -> FastAPI:
    """The API of `live` (started already), served as `model_name`.

    Args:
      vocab_size: the model's; a prompt of token ids must lie below it.
      on_shutdown: called when the server stops (after the last connection closed):
        drain the engine and write the results.
    """
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            await asyncio.get_running_loop().run_in_executor(None, on_shutdown)

    app = FastAPI(title="orca_jax", lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(error).response()

    @app.exception_handler(ApiError)
    async def _on_api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    def authorize(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        if live.error is not None:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.text() if metrics is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "orca_jax",
            "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        authorize(request)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: one prompt per request (a list of one string)",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
            if any(not 0 <= i < vocab_size for i in ids):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab_size})",
                               param="prompt")
        return await _serve(body, request, ids, chat=False, prompt_param="prompt",
                            max_tokens=body.max_tokens, default_max_tokens=16)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        authorize(request)
        text = tokenizer.chat_prompt([m.model_dump() for m in body.messages])
        return await _serve(body, request, tokenizer.encode(text), chat=True,
                            prompt_param="messages",
                            max_tokens=body.max_completion_tokens or body.max_tokens,
                            default_max_tokens=None)

    async def _serve(body: _Sampling, request: Request, ids: list[int], *, chat: bool,
                     prompt_param: str, max_tokens: Optional[int],
                     default_max_tokens: Optional[int]) -> Response:
        if body.model != model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves "
                           f"{model_name!r}", param="model", code="model_not_found")
        if body.n != 1:
            raise ApiError(400, f"n: only n=1 is served, got {body.n}", param="n")
        if not ids:
            raise ApiError(400, f"{prompt_param}: the prompt is empty", param=prompt_param)
        room = max_model_len - len(ids)
        if room < 1:
            raise ApiError(400, f"{prompt_param}: the prompt has {len(ids)} tokens; the "
                           f"model's context is {max_model_len}, and at least one token must "
                           "be left for the answer", param=prompt_param)
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        if max_tokens > room:
            param = ("max_completion_tokens"
                     if getattr(body, "max_completion_tokens", None) else "max_tokens")
            raise ApiError(400, f"{param}: {max_tokens} tokens asked for, but the prompt has "
                           f"{len(ids)} and the model's context is {max_model_len}: at most "
                           f"{room}", param=param)
        pages, refused = live.scheduler.capacity.refusals(
            np.asarray([len(ids) + max_tokens], np.int64))
        if int(pages[0]) in refused:
            raise ApiError(400, f"max_tokens: prompt and answer cannot fit the KV pool: "
                           f"{refused[int(pages[0])]}", param="max_tokens")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        submission = Submission(prompt_tokens=ids, max_tokens=max_tokens,
                                temperature=body.temperature, top_p=body.top_p,
                                on_event=lambda e: loop.call_soon_threadsafe(
                                    events.put_nowait, e))
        try:
            row = live.submit(submission)
        except QueueFull as e:
            raise ApiError(429, str(e), kind="rate_limit_error",
                           code="rate_limit_exceeded") from None
        except Unavailable as e:
            raise ApiError(503, str(e), kind="server_error", code="unavailable") from None
        answer = _Answer(live, row, tokenizer, stops,
                         eos=None if body.ignore_eos else tokenizer.eos_token_id)
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "created": int(time.time()), "model": model_name}
        usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": len(answer.ids),
                         "total_tokens": len(ids) + len(answer.ids)}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(answer, events, meta, chat, include_usage, body.return_token_ids, usage),
                media_type="text/event-stream")
        try:
            while not answer.finished:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError from None
                    continue
                answer.take(event)
        finally:
            if not answer.finished:
                live.cancel(row)
        if answer.error is not None:
            raise ApiError(503, answer.error, kind="server_error", code="rejected")
        choice: dict[str, Any] = {"index": 0, "finish_reason": answer.finish_reason,
                                  "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": answer.text}
        else:
            choice["text"] = answer.text
        if body.return_token_ids:
            choice["token_ids"] = list(answer.ids)
        return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice], "usage": usage()})

    return app


async def _sse(answer: "_Answer", events: asyncio.Queue, meta: dict[str, Any], chat: bool,
               include_usage: bool, return_token_ids: bool,
               usage: Callable[[], dict[str, int]]) -> AsyncIterator[str]:
    """The answer as server-sent events, chunk by chunk; a client gone cancels it."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: Optional[str], ids: list[int], finish: Optional[str],
              role: bool = False) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if return_token_ids:
            choice["token_ids"] = ids
        body = {**meta, "object": kind, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            yield chunk("", [], None, role=True)
        while not answer.finished:
            text, ids = answer.take(await events.get())
            if answer.error is not None:
                error = {"error": {"message": answer.error, "type": "server_error",
                                   "param": None, "code": "rejected"}}
                yield f"data: {json.dumps(error)}\n\n"
                break
            if text or ids:
                yield chunk(text, ids, None)
        else:
            yield chunk(None if chat else "", [], answer.finish_reason)
        if include_usage:
            last = {**meta, "object": kind, "choices": [], "usage": usage()}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not answer.finished:
            answer.live.cancel(answer.row)


class _Answer:
    """One request's answer as its events come: the text handed out, the stop rules."""

    def __init__(self, live: LiveRun, row: int, tokenizer: Tokenizer, stops: list[str],
                 eos: Optional[int]) -> None:
        self.live, self.row = live, row
        self.detokenizer = Detokenizer(tokenizer)
        self.stops = [s for s in stops if s]
        self.eos = eos
        self.ids: list[int] = []
        self.text = ""  # the whole answer's text handed out so far
        self._pending = ""  # decoded, held back: it may be the start of a stop string
        self.finished = False
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None

    def take(self, event: tuple[str, Any]) -> tuple[str, list[int]]:
        """Takes one event; returns the text and ids to hand out now."""
        kind, value = event
        if kind == "error":
            self.finished, self.error = True, str(value)
            return "", []
        if kind == "done":
            self.finished = True
            self.finish_reason = "stop" if value in ("stop", "cancelled") else "length"
            out, self._pending = self._pending, ""
            self.text += out
            return out, []
        new = list(value)
        if self.eos is not None and self.eos in new:
            new = new[:new.index(self.eos)]
            self._end()
        self.ids.extend(new)
        text = self._pending + self.detokenizer.add(new)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                text = text[:at]
                self._end()
        if self.finished:
            self._pending = ""
            self.text += text
            return text, new
        hold = max((len(s) - 1 for s in self.stops), default=0)
        cut = len(text) - hold
        out, self._pending = (text[:cut], text[cut:]) if cut > 0 else ("", text)
        self.text += out
        return out, new

    def _end(self) -> None:
        if not self.finished:
            self.finished, self.finish_reason = True, "stop"
            self.live.stop(self.row)
