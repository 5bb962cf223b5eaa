"""HTTP routes: health, readiness, Prometheus metrics, models and chat completions (+ SSE).

A chat completion runs as one ``Turn`` (gateway.turns: routing, metering, charging); this
module turns its events into a JSON body or SSE chunks. A completion whose client goes away
is aborted in the engine: aiohttp cancels the handler when the connection drops
(``handler_cancellation=True``), and writing to a closed stream raises; both paths reach the
``finally`` that closes the turn.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import math
import secrets
from typing import Any

from aiohttp import web

from gateway import json_wire
from gateway.auth import AuthError, RateLimitedError, origin_allowed
from gateway.http.chat_schema import (
    ChatRequest,
    CompletionIds,
    HttpError,
    chunk,
    completion,
    finish_reason,
    logprob_entry,
    parse_chat_request,
    usage_chunk,
)
from gateway.http.demo import add_demo_routes
from gateway.http.model_files import device_card, file_response, model_file_error, not_downloadable
from gateway.http.state import STATE, GatewayState
from gateway.limits import LimitsUnavailableError
from gateway.metrics import CONTENT_TYPE
from gateway.shaping import CallStream, call_stream
from gateway.turns import Turn
from gateway.ws.fields import is_unicode
from llm_shared.contract import FinishEvent, StreamEvent
from llm_shared.errors import EngineError, EngineUnavailableError, InvalidRequestError, ModelFileError, OverloadedError
from llm_shared.structured import ArgumentsDelta, CallStarted, TextDelta, render_messages

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_error(error: HttpError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


def engine_http_error(e: EngineError) -> HttpError:
    if isinstance(e, RateLimitedError):
        return HttpError(429, e.code, e.message, type_=e.type, headers={"Retry-After": f"{e.retry_after_s:.0f}"})
    if isinstance(e, InvalidRequestError):
        return HttpError(400, e.code, e.message, param=e.param, type_=e.type)
    if isinstance(e, LimitsUnavailableError):
        return HttpError(503, e.code, e.message, type_="server_error",
                         headers={"Retry-After": f"{max(1, math.ceil(e.retry_after_s))}"})
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


def _operator_check(request: web.Request, state: GatewayState, *, metrics: bool = False) -> web.Response | None:
    """``/readyz`` and ``/metrics`` may require an API key (``server.operator_endpoints_need_key``);
    ``/metrics`` does by default (``server.metrics_need_key``)."""
    server = state.config.server
    if not (server.operator_endpoints_need_key or (metrics and server.metrics_need_key)):
        return None
    try:
        authorize(request, state)
    except HttpError as e:
        return json_error(e)
    return None


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if (refused := _operator_check(request, state)) is not None:
        return refused
    tiers = state.router.tiers_up() if state.router is not None else {}
    down = state.router.why_down() if state.router is not None else {}
    up = await state.limits.recover()  # an idle gateway learns here that its store is back
    limits = {"backend": state.config.limits.backend, "failure": state.config.limits.failure,
              "degraded": not up}  # degraded: the shared store is away (fail_open: local limits)
    if state.ready:
        # degraded: the cascade serves on one tier while the other is down
        return web.json_response({"status": "ready", "tiers": tiers, "degraded": not all(tiers.values()),
                                  "down": down, "limits": limits})
    status = "shutting_down" if state.shutting_down else ("loading" if not state.engines else "engine_down")
    return web.json_response({"status": status, "tiers": tiers, "down": down, "message": state.unavailable_message()},
                             status=503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if (refused := _operator_check(request, state, metrics=True)) is not None:
        return refused
    body = state.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _model_card(state: GatewayState, model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": state.created, "owned_by": "rt-llm-gateway"}


async def _device_field(state: GatewayState) -> dict[str, Any] | None:
    """``x_device`` of a served model's card (our extension): the edge tier's model file, which a
    client may run on the device, when the config makes it downloadable."""
    model = state.config.models[state.config.edge.model]
    if model.id not in state.device_models:
        return None
    try:
        info = await state.device_models.info(model.id)
    except ModelFileError as e:
        model_file_error(e)
        return None
    return device_card(model.id, info, model.family, model.context_length)


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
    card = _model_card(state, model_id)
    if (device := await _device_field(state)) is not None:
        card["x_device"] = device
    return web.json_response(card)


async def get_model_file(request: web.Request) -> web.StreamResponse:
    """The GGUF file of a downloadable ``[models]`` entry (``gateway.http.model_files``)."""
    state = request.app[STATE]
    model_id = request.match_info["model"]
    try:
        authorize(request, state)
        if model_id not in state.device_models:
            raise HttpError(404, "model_not_downloadable", not_downloadable(model_id, model_id in state.config.models),
                            param="model")
        try:
            info = await state.device_models.info(model_id)
        except ModelFileError as e:
            raise HttpError(503, "model_file_unavailable", model_file_error(e), type_="server_error") from e
    except HttpError as e:
        return json_error(e)
    return file_response(info)


MAX_JSON_DEPTH = 32  # a chat body nests 5 levels; more is an attack on the parser


async def _read_json(request: web.Request) -> Any:
    """The body as JSON, or HttpError 400/413 with a reason: an unknown charset, bytes that do
    not decode, invalid JSON, nesting deeper than MAX_JSON_DEPTH, strings that are not valid
    Unicode (lone surrogates from ``\\ud800`` escapes). Never a 500."""
    charset = request.charset or "utf-8"
    try:
        codecs.lookup(charset)
    except LookupError:
        raise HttpError(400, "invalid_charset", f"the body's charset {charset[:40]!r} is unknown; send UTF-8") from None
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise HttpError(413, "request_too_large", f"the request body is larger than {request.client_max_size} "
                        "bytes") from e
    try:
        body = json.loads(raw.decode(charset), parse_constant=_no_constant)
    except RecursionError:
        raise HttpError(400, "invalid_json", f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(400, "invalid_json", f"the request body is not valid {charset} JSON") from e
    _check_json(body)
    return body


def _check_json(body: Any) -> None:
    """Depth and Unicode of a parsed body, walked without recursion."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if not is_unicode(value):
                raise HttpError(400, "invalid_json", "the request body holds a string that is not valid Unicode "
                                "(a lone surrogate escape)")
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise HttpError(400, "invalid_json", f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            items = list(value.items()) if isinstance(value, dict) else [(None, v) for v in value]
            for key, item in items:
                if key is not None:
                    stack.append((key, depth))
                stack.append((item, depth + 1))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    metrics = state.metrics
    try:
        key_id = authorize(request, state)
        body = await _read_json(request)
        if not state.ready or state.router is None:  # before the model check: no models are known while loading
            raise HttpError(503, "engine_unavailable", state.unavailable_message(), type_="server_error",
                            headers={"Retry-After": "1"})
        req = parse_chat_request(body, state.models, state.config.server)
        try:
            await state.limits.admit(key_id)
        except RateLimitedError as e:
            metrics.rate_limited.labels("chat").inc()
            error = engine_http_error(e)
            error.headers.update(state.limits.peek(key_id).headers())
            raise error from e
        except LimitsUnavailableError as e:
            raise engine_http_error(e) from e
        grammars = state.grammars
        turn = Turn(router=state.router, model=req.model,
                    messages=render_messages(req.messages, req.constraints, grammars.family), params=req.params,
                    priority=req.priority,
                    request_id=f"chatcmpl-{secrets.token_hex(12)}", api="chat", metrics=metrics,
                    limits=state.limits, key_id=key_id, grammars=grammars, constraints=req.constraints)
        try:
            await turn.prepare()
        except EngineError as e:
            raise engine_http_error(e) from e
    except HttpError as e:
        metrics.errors.labels("chat", e.code).inc()
        return json_error(e)
    return await _generate(request, state, key_id, req, turn)


async def _generate(request: web.Request, state: GatewayState, key_id: str, req: ChatRequest,
                    turn: Turn) -> web.StreamResponse:
    rid = turn.request_id
    state.http_requests[rid] = turn.engine
    try:
        try:
            # generate() validates before yielding: a refusal surfaces here, before any header is sent.
            first = await anext(turn)
        except EngineError as e:
            error = engine_http_error(e)
            state.metrics.errors.labels("chat", error.code).inc()
            return json_error(error)
        ids = CompletionIds.new(rid, req.model, turn.route)  # the cascade has decided by the first event
        if req.stream:
            return await _stream(request, state, key_id, req, ids, turn, first)
        return await _collect(state, key_id, req, ids, turn, first)
    finally:
        state.http_requests.pop(rid, None)
        if not turn.finished:
            state.metrics.cancels.labels("chat", "client_disconnected").inc()
        await turn.aclose()


def _count_end(state: GatewayState, finish: FinishEvent) -> None:
    """Count a completion the engine ended early (the turn has charged its tokens already)."""
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


async def _collect(state: GatewayState, key_id: str, req: ChatRequest, ids: CompletionIds, turn: Turn,
                   first: StreamEvent) -> web.Response:
    texts: list[str] = []
    logprobs: list[dict[str, Any]] | None = [] if req.logprobs else None
    event: StreamEvent = first
    while True:
        if isinstance(event, FinishEvent):
            break
        texts.append(event.text)
        if logprobs is not None:
            logprobs.append(logprob_entry(turn.engine.tokenizer, event))
        event = await anext(turn)
    _count_end(state, event)
    if event.reason not in ("stop", "length"):
        return json_error(_end_error(state, event))
    text = "".join(texts) + event.text
    calls = call_stream(turn.grammar, state.grammars.family)
    if calls is not None:  # the answer's text without its call block; the calls apart
        text = "".join(e.text for e in [*calls.feed(text), *calls.finish()] if isinstance(e, TextDelta))
    body = completion(ids, text, event, logprobs, calls.calls if calls is not None else None)
    return web.json_response(body, headers=state.limits.peek(key_id).headers())


async def _stream(request: web.Request, state: GatewayState, key_id: str, req: ChatRequest, ids: CompletionIds,
                  turn: Turn, first: StreamEvent) -> web.StreamResponse:
    response = web.StreamResponse(headers={**SSE_HEADERS, **state.limits.peek(key_id).headers()})
    await response.prepare(request)
    try:
        await _stream_events(response, state, req, ids, turn, first)
    except ConnectionError:
        pass  # the client went away; the caller's finally aborts the engine request
    return response


async def _stream_events(response: web.StreamResponse, state: GatewayState, req: ChatRequest, ids: CompletionIds,
                         turn: Turn, first: StreamEvent) -> None:
    usage = req.include_usage

    timeout = state.config.server.sse_write_timeout_s

    async def send(obj: Any) -> None:
        await _write(response, b"data: " + json_wire.dumps_bytes(obj) + b"\n\n", timeout)

    await send(chunk(ids, {"role": "assistant", "content": ""}, include_usage=usage))
    calls = call_stream(turn.grammar, state.grammars.family)
    pending: list[dict[str, Any]] = []  # logprobs of tokens whose text is not printable yet
    event: StreamEvent = first
    while not isinstance(event, FinishEvent):
        if req.logprobs:
            pending.append(logprob_entry(turn.engine.tokenizer, event))
        if event.text:
            if calls is None:
                await send(chunk(ids, {"content": event.text}, logprobs=pending if req.logprobs else None,
                                 include_usage=usage))
            else:
                for delta in _call_deltas(calls, calls.feed(event.text)):
                    await send(chunk(ids, delta, include_usage=usage))
            pending = []
        event = await anext(turn)
    _count_end(state, event)
    if calls is not None:
        for delta in _call_deltas(calls, [*calls.feed(event.text), *calls.finish()]):
            await send(chunk(ids, delta, include_usage=usage))
    elif event.text or pending:
        await send(chunk(ids, {"content": event.text}, logprobs=pending if req.logprobs else None,
                         include_usage=usage))
    if event.reason in ("stop", "length"):
        reason = finish_reason(event, calls is not None and bool(calls.calls))
        await send(chunk(ids, {}, finish_reason=reason, include_usage=usage))
        if usage:
            await send(usage_chunk(ids, event))
    else:
        await send(_end_error(state, event).body())
    await _write(response, b"data: [DONE]\n\n", timeout)
    await response.write_eof()


def _call_deltas(calls: CallStream, events: list) -> list[dict[str, Any]]:
    """Chunk deltas of parsed output: text as ``content``; a call's first chunk with its index, id,
    type and name, then its arguments in fragments (what the SDK's accumulator joins)."""
    out: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, TextDelta):
            if event.text:
                out.append({"content": event.text})
        elif isinstance(event, CallStarted):
            out.append({"tool_calls": [{"index": event.index, "id": calls.call_id(event.index), "type": "function",
                                        "function": {"name": event.name, "arguments": ""}}]})
        elif isinstance(event, ArgumentsDelta):
            out.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.delta}}]})
    return out


async def _write(response: web.StreamResponse, data: bytes, timeout: float) -> None:
    """One SSE write; a client that does not take it within ``timeout`` is treated as gone (the
    turn is aborted), so a stalled reader cannot hold a stream and its KV forever."""
    try:
        await asyncio.wait_for(response.write(data), timeout)
    except TimeoutError:
        raise ConnectionError(f"the client took no data for {timeout:g} s") from None


def add_routes(app: web.Application, *, isolate_page: bool = True) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/v1/models/{model}/file", get_model_file)
    app.router.add_post("/v1/chat/completions", chat_completions)
    add_demo_routes(app, isolate=isolate_page)  # the demo page and the JS SDK (gateway/http/demo.py)
