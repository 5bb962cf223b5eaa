"""HTTP routes: health, readiness, Prometheus metrics, models and chat completions (+ SSE).

A chat completion whose client goes away is aborted in the engine: aiohttp cancels the
handler when the connection drops (``handler_cancellation=True``), and writing to a closed
stream raises; both paths reach the ``finally`` that aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.auth import AuthError, RateLimitedError, origin_allowed
from gateway.chat_schema import (
    ChatRequest,
    CompletionIds,
    HttpError,
    chunk,
    completion,
    logprob_entry,
    parse_chat_request,
    usage_chunk,
)
from gateway.engines import encode_chat
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.state import STATE, GatewayState
from llm_shared.contract import Engine, FinishEvent, StreamEvent, TokenEvent
from llm_shared.errors import EngineError, EngineUnavailableError, InvalidRequestError, OverloadedError

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_error(error: HttpError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


def engine_http_error(e: EngineError) -> HttpError:
    if isinstance(e, RateLimitedError):
        return HttpError(429, e.code, e.message, type_=e.type, headers={"Retry-After": f"{e.retry_after_s:.0f}"})
    if isinstance(e, InvalidRequestError):
        return HttpError(400, e.code, e.message, param=e.param, type_=e.type)
    if isinstance(e, (OverloadedError, EngineUnavailableError)):
        return HttpError(503, e.code, e.message, type_="server_error", headers={"Retry-After": "1"})
    return HttpError(500, e.code, e.message, type_="server_error")


def authorize(request: web.Request, state: GatewayState) -> str:
    """The caller's key id, or HttpError 403 (Origin not allowed) / 401 (no or bad key)."""
    if not origin_allowed(request.headers.get("Origin"), request.host, state.config.server.allowed_origins):
        raise HttpError(403, "origin_not_allowed", "this Origin is not allowed; add it to server.allowed_origins")
    try:
        return state.auth.authenticate(request.headers.get("Authorization"))
    except AuthError as e:
        raise HttpError(e.status, e.code, e.message, type_=e.type) from e


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tiers = {tier: engine.ready for tier, engine in state.engines.items()}
    if state.ready:
        return web.json_response({"status": "ready", "tiers": tiers})
    status = "shutting_down" if state.shutting_down else ("loading" if not state.engines else "engine_down")
    return web.json_response({"status": status, "tiers": tiers}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _model_card(state: GatewayState, model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": state.created, "owned_by": "rt-llm-gateway"}


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        authorize(request, state)
    except HttpError as e:
        return json_error(e)
    return web.json_response({"object": "list", "data": [_model_card(state, m) for m in sorted(state.models)]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model_id = request.match_info["model"]
    try:
        authorize(request, state)
        if model_id not in state.models:
            raise HttpError(404, "model_not_found", f"The model '{model_id}' does not exist", param="model")
    except HttpError as e:
        return json_error(e)
    return web.json_response(_model_card(state, model_id))


async def _read_json(request: web.Request) -> Any:
    try:
        return await request.json(loads=lambda text: json.loads(text, parse_constant=_no_constant))
    except web.HTTPRequestEntityTooLarge as e:
        raise HttpError(413, "request_too_large", f"the request body is larger than {request.client_max_size} "
                        "bytes") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(400, "invalid_json", "the request body is not valid JSON") from e


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class _Metered:
    """The engine stream of one request, observed for metrics; knows whether it finished."""

    def __init__(self, stream: AsyncIterator[StreamEvent], metrics: GatewayMetrics) -> None:
        self._stream = stream
        self._metrics = metrics
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._first = True
        self.finished = False

    def __aiter__(self) -> _Metered:
        return self

    async def __anext__(self) -> StreamEvent:
        event = await anext(self._stream)
        metrics = self._metrics
        if isinstance(event, TokenEvent):
            now = self._loop.time()
            (metrics.ttft if self._first else metrics.itl).labels("chat").observe(now - self._last)
            self._first, self._last = False, now
            metrics.output_tokens.labels("chat").inc()
        else:
            self.finished = True
            metrics.prompt_tokens.labels("chat").inc(event.prompt_tokens)
            metrics.cached_tokens.labels("chat").inc(event.cached_tokens)
        return event

    async def close(self, engine: Engine, rid: str) -> None:
        """Abort the request unless it finished, then close the engine's stream (its clean-up
        runs now rather than whenever the generator is collected)."""
        if not self.finished:
            try:
                await engine.abort(rid)
            except EngineError as e:
                log.warning("engine abort of %s failed: %s", rid, e.message)
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(EngineError, RuntimeError):
                await aclose()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    metrics = state.metrics
    try:
        key_id = authorize(request, state)
        body = await _read_json(request)
        if not state.ready or state.router is None:  # before the model check: no models are known while loading
            raise HttpError(503, "engine_unavailable", "the model is not ready (loading or shutting down); "
                            "retry shortly", type_="server_error", headers={"Retry-After": "1"})
        req = parse_chat_request(body, state.models, state.config.server)
        try:
            state.limiter.admit(key_id)
        except RateLimitedError as e:
            metrics.rate_limited.labels("chat").inc()
            error = engine_http_error(e)
            error.headers.update(state.limiter.headers(key_id))
            raise error from e
        try:
            engine = state.router.choose(req.messages, req.params)
            prompt_ids = await encode_chat(engine, req.messages)
        except EngineError as e:
            raise engine_http_error(e) from e
    except HttpError as e:
        metrics.errors.labels("chat", e.code).inc()
        return json_error(e)
    return await _generate(request, state, key_id, req, engine, prompt_ids)


async def _generate(request: web.Request, state: GatewayState, key_id: str, req: ChatRequest, engine: Engine,
                    prompt_ids: list[int]) -> web.StreamResponse:
    rid = f"chatcmpl-{secrets.token_hex(12)}"
    ids = CompletionIds.new(rid, req.model, engine.tier)
    state.metrics.requests.labels("chat", engine.tier).inc()
    events = _Metered(engine.generate(rid, prompt_ids, req.params, req.priority), state.metrics)
    state.http_requests[rid] = engine
    try:
        try:
            # generate() validates before yielding: a refusal surfaces here, before any header is sent.
            first = await anext(events)
        except EngineError as e:
            events.finished = True  # refused: there is no request to abort
            error = engine_http_error(e)
            state.metrics.errors.labels("chat", error.code).inc()
            return json_error(error)
        if req.stream:
            return await _stream(request, state, key_id, req, ids, engine, first, events)
        return await _collect(state, key_id, req, ids, engine, first, events)
    finally:
        state.http_requests.pop(rid, None)
        if not events.finished:
            state.metrics.cancels.labels("chat", "client_disconnected").inc()
        # Shielded: a cancelled handler (client gone) must still free the engine's work.
        await asyncio.shield(events.close(engine, rid))


def _account(state: GatewayState, key_id: str, finish: FinishEvent) -> None:
    state.limiter.charge_tokens(key_id, finish.completion_tokens)
    if finish.reason == "abort":
        reason = "server_shutdown" if state.shutting_down else "engine_aborted"
        state.metrics.cancels.labels("chat", reason).inc()
    elif finish.reason == "error":
        state.metrics.errors.labels("chat", "engine_error").inc()


def _end_error(state: GatewayState, finish: FinishEvent) -> HttpError:
    if finish.reason == "abort":
        code = "server_shutdown" if state.shutting_down else "request_aborted"
        return HttpError(503, code, "the request was aborted before it finished; retry", type_="server_error")
    return HttpError(500, "engine_error", finish.message or "the engine failed while generating",
                     type_="server_error")


async def _collect(state: GatewayState, key_id: str, req: ChatRequest, ids: CompletionIds, engine: Engine,
                   first: StreamEvent, events: _Metered) -> web.Response:
    texts: list[str] = []
    logprobs: list[dict[str, Any]] | None = [] if req.logprobs else None
    event: StreamEvent = first
    while True:
        if isinstance(event, FinishEvent):
            break
        texts.append(event.text)
        if logprobs is not None:
            logprobs.append(logprob_entry(engine.tokenizer, event))
        event = await anext(events)
    _account(state, key_id, event)
    if event.reason not in ("stop", "length"):
        return json_error(_end_error(state, event))
    body = completion(ids, "".join(texts) + event.text, event, logprobs)
    return web.json_response(body, headers=state.limiter.headers(key_id))


async def _stream(request: web.Request, state: GatewayState, key_id: str, req: ChatRequest, ids: CompletionIds,
                  engine: Engine, first: StreamEvent, events: _Metered) -> web.StreamResponse:
    response = web.StreamResponse(headers={**SSE_HEADERS, **state.limiter.headers(key_id)})
    await response.prepare(request)
    try:
        await _stream_events(response, state, key_id, req, ids, engine, first, events)
    except ConnectionError:
        pass  # the client went away; the caller's finally aborts the engine request
    return response


async def _stream_events(response: web.StreamResponse, state: GatewayState, key_id: str, req: ChatRequest,
                         ids: CompletionIds, engine: Engine, first: StreamEvent,
                         events: _Metered) -> None:
    usage = req.include_usage

    async def send(obj: Any) -> None:
        await response.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    await send(chunk(ids, {"role": "assistant", "content": ""}, include_usage=usage))
    pending: list[dict[str, Any]] = []  # logprobs of tokens whose text is not printable yet
    event: StreamEvent = first
    while not isinstance(event, FinishEvent):
        if req.logprobs:
            pending.append(logprob_entry(engine.tokenizer, event))
        if event.text:
            await send(chunk(ids, {"content": event.text}, logprobs=pending if req.logprobs else None,
                             include_usage=usage))
            pending = []
        event = await anext(events)
    _account(state, key_id, event)
    if event.text or pending:
        await send(chunk(ids, {"content": event.text}, logprobs=pending if req.logprobs else None,
                         include_usage=usage))
    if event.reason in ("stop", "length"):
        await send(chunk(ids, {}, finish_reason=event.reason, include_usage=usage))
        if usage:
            await send(usage_chunk(ids, event))
    else:
        await send(_end_error(state, event).body())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
