"""The OpenAI-compatible HTTP API over a `LiveRun` (FastAPI).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streamed as server-sent
events with `stream: true`), `GET /v1/models`, `GET /health`, `GET /metrics`. With an
API key, the `/v1` routes need `Authorization: Bearer KEY`.

Sampling fields: `max_tokens` (chat: or `max_completion_tokens`), `temperature`,
`top_p`, `seed` (the request's own sampling seed: the same seed, prompt and settings
give the same tokens, whatever batch the request shares), `stop` (a string or a list),
`n` (1 only), `stream` (a JSON boolean), `stream_options.include_usage`; extensions as
vLLM's: `ignore_eos`, and `return_token_ids` (each choice gets `token_ids`, its
generated ids). Fields the server cannot honour are taken only at the value that
asks for nothing (`NEUTRAL`: `logprobs` null, `best_of` 1, `echo` false, ...); any
other field is refused, so nothing a client asks for is silently dropped.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, every
one (the framework's 404 and 405 and an unexpected 500 too): 400 for bad JSON, a bad
or unknown field (`param` names it), a prompt over the context or `max_tokens` over
what is left of it; 401 a wrong key; 404 another model's name or route; 405 a wrong
method; 429 when the server holds its most requests (with `Retry-After`); 503 while it
drains or after its last row. A client that disconnects cancels its request (its
pages are freed at once); one stopped by a stop string or the end-of-sequence token
ends early with `finish_reason: "stop"`.
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
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.exceptions import HTTPException

from orca_jax.serving.live import LiveRun, QueueFull, Submission, Unavailable
from orca_jax.serving.metrics import ServingMetrics
from orca_jax.serving.tokenizer import Detokenizer, Tokenizer

# Seconds a client told 429 is asked to wait (`Retry-After`): about the time a batch
# place takes to free on the tiny model, and the OpenAI SDK's own first back-off.
RETRY_AFTER_S = 1
# OpenAI's fields that this server cannot honour, each with the values that ask for
# nothing (so a client that sends its defaults is served): another value is a 400.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),  # no log probabilities are computed
    "top_logprobs": (None, 0),
    "best_of": (None, 1),  # one answer per request (n = 1)
    "echo": (None, False),
    "suffix": (None,),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),  # vLLM's; its benchmark client sends 1.0
    "logit_bias": (None, {}),
}
MAX_SEED = 2**32 - 1  # a request's seed is the engine's per-request uint32


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class _Sampling(BaseModel):
    # Unknown fields are refused (400 naming the field), never silently dropped.
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    stop: Optional[Union[str, list[str]]] = None
    n: int = 1
    stream: StrictBool = False  # "yes" is not a boolean: 400, not a stream
    stream_options: Optional[StreamOptions] = None
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    user: Optional[str] = None  # the client's name for its user: nothing to honour
    # Taken only at a value in NEUTRAL (checked in `_refuse_unhonoured`).
    logprobs: Optional[Union[StrictBool, int]] = None
    best_of: Optional[int] = None
    echo: Optional[StrictBool] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str]]
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    top_logprobs: Optional[int] = None


class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error", code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, message, param, kind, code)

    def response(self, headers: Optional[dict[str, str]] = None) -> JSONResponse:
        return JSONResponse(status_code=self.status, headers=headers, content={"error": {
            "message": self.message, "type": self.kind, "param": self.param,
            "code": self.code}})


def _validation_error(error: RequestValidationError) -> ApiError:
    """The first complaint of FastAPI's validation, naming the field (`messages.0.role`)."""
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}")
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"{param}: this server does not take this field (the fields it "
                        "serves: docs/serving.md)", param=param, code="unsupported_field")
    return ApiError(400, f"{param or 'body'}: {first.get('msg')}", param=param)


def _http_error(error: HTTPException) -> ApiError:
    """The framework's own errors (no such route: 404, a wrong method: 405) as OpenAI's."""
    kind = "server_error" if error.status_code >= 500 else "invalid_request_error"
    return ApiError(error.status_code, str(error.detail), kind=kind)


def _is_neutral(value: Any, neutral: Any) -> bool:
    """Whether `value` is `neutral` (a JSON boolean only where a boolean is listed:
    `False == 0` in Python, not in these fields)."""
    if neutral is None or isinstance(neutral, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and value == neutral)
    return value == neutral


def _refuse_unhonoured(body: _Sampling) -> None:
    """A 400 naming the first field of `NEUTRAL` set to a value that asks for something
    this server does not do."""
    for name, neutral in NEUTRAL.items():
        value = getattr(body, name, None)
        if not any(_is_neutral(value, ok) for ok in neutral):
            raise ApiError(400, f"{name}: {json.dumps(value)} is not served by this server (it "
                           f"takes only {' or '.join(json.dumps(ok) for ok in neutral)}); "
                           "leave the field out", param=name, code="unsupported_value")


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
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 429 else None
        return error.response(headers)

    @app.exception_handler(HTTPException)
    async def _on_http_error(request: Request, error: HTTPException) -> JSONResponse:
        return _http_error(error).response(getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, error: Exception) -> JSONResponse:
        # Starlette logs the traceback after this answer; the client gets OpenAI's shape.
        return ApiError(500, f"internal error: {type(error).__name__}: {error}",
                        kind="server_error", code="internal_error").response()

    def authorize(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    @app.get("/health")
    async def health() -> JSONResponse:
        if live.error is not None:
            return JSONResponse({"status": "failed", "error": str(live.error)}, status_code=503)
        if live.draining:
            return JSONResponse({"status": "draining", "num_outstanding": live.num_outstanding},
                                status_code=503)
        return JSONResponse({"status": "ok", "model": model_name,
                             "num_outstanding": live.num_outstanding})

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
        _refuse_unhonoured(body)
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
                                seed=body.seed, on_event=lambda e: loop.call_soon_threadsafe(
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
