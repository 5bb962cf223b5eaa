"""Chat completions over HTTP: validating the request body and building OpenAI's shapes.

Validation happens here, once, at the boundary: a bad body is an ``HttpError`` that names the
offending parameter; what comes out (``ChatRequest``) is trusted by the handler.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.cascade.route import RouteInfo
from gateway.config import ServerConfig
from gateway.shaping import Message, ToolCall, message_from_wire, tool_calls_wire
from llm_shared.content import AudioPart, ContentPart, ImagePart, TextPart, UnsupportedContentError, text_of
from llm_shared.contract import MAX_TOP_LOGPROBS, FinishEvent, Priority, SamplingParams, TokenEvent
from llm_shared.errors import APIError, InvalidRequestError, InvalidSamplingError
from llm_shared.structured import OutputConstraints, parse_chat_constraints

if TYPE_CHECKING:
    from llm_shared.tokenizer import Tokenizer

MAX_STOP = 4  # OpenAI's limit on stop sequences
ROLE_MAP = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls", "refusal"})
# Accepted so stock clients work; they change nothing here (see docs/protocol.md).
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "modalities", "safety_identifier", "prompt_cache_key"})
SERVICE_TIERS = {"auto": Priority.INTERACTIVE, "default": Priority.INTERACTIVE, "priority": Priority.INTERACTIVE,
                 "flex": Priority.BATCH}
PRIORITIES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}
KNOWN_FIELDS = frozenset({
    "model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed", "n",
    "logprobs", "top_logprobs", "stream", "stream_options", "priority", "service_tier", "frequency_penalty",
    "presence_penalty", "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions",
    "function_call", "logit_bias",
}) | IGNORED_FIELDS


class HttpError(APIError):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 type_: str = "invalid_request_error", headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message, code=code, param=param, type=type_)
        self.status = status
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": self.to_dict()}


def _bad(message: str, param: str, code: str = "invalid_value") -> HttpError:
    return HttpError(400, code, message, param=param)


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[Message]
    constraints: OutputConstraints  # tools, tool_choice, parallel_tool_calls, response_format
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool  # report per-token logprobs (params.logprobs alternatives each)
    priority: Priority


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"'{key}' must be a number", key, "invalid_type")
    return float(value)


def _integer(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{key}' must be an integer", key, "invalid_type")
    return value


def _content(value: Any, where: str) -> tuple[ContentPart, ...]:
    """A message's content as typed parts: a string, or text, ``image_url`` and ``input_audio``
    parts (kept as they are: ``text_of`` refuses what no tier reads, with its own error)."""
    if isinstance(value, str):
        return (TextPart(value),) if value else ()
    if not isinstance(value, list):
        raise _bad(f"'{where}' must be a string or a list of content parts", where, "invalid_type")
    parts: list[ContentPart] = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        body = part.get(kind) if isinstance(part, dict) and isinstance(kind, str) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(TextPart(part["text"]))
        elif kind == "image_url" and isinstance(body, dict) and isinstance(body.get("url"), str):
            parts.append(ImagePart(body["url"]))
        elif (kind == "input_audio" and isinstance(body, dict) and isinstance(body.get("data"), str)
              and isinstance(body.get("format"), str)):
            parts.append(AudioPart(body["format"], body["data"]))
        else:
            raise _bad(f"{where}[{i}] must be a content part: {{\"type\": \"text\", \"text\": ...}}, "
                       "{\"type\": \"image_url\", \"image_url\": {\"url\": ...}} or {\"type\": \"input_audio\", "
                       "\"input_audio\": {\"data\": ..., \"format\": ...}}", f"{where}[{i}]")
    return tuple(parts)


def _messages(value: Any, limits: ServerConfig) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise _bad("'messages' must be a non-empty list of messages", "messages", "invalid_type")
    if len(value) > limits.max_conversation_items:
        raise _bad(f"'messages' has {len(value)} entries, more than this server's limit of "
                   f"{limits.max_conversation_items}", "messages", "conversation_limit_exceeded")
    messages, chars = [], 0
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"'{where}' must be an object", where, "invalid_type")
        extra = sorted(set(message) - MESSAGE_FIELDS)
        if extra:
            raise _bad(f"'{where}' has unsupported fields {extra}", where)
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise _bad(f"'{where}.{key}' must be a string", f"{where}.{key}", "invalid_type")
        role = message.get("role")
        if role not in ROLE_MAP:
            raise _bad(f"'{where}.role' must be one of {sorted(ROLE_MAP)}", f"{where}.role")
        calls = message.get("tool_calls")
        raw = message.get("content")
        content = () if raw is None and calls else _content(raw, f"{where}.content")
        try:
            text = text_of(content, f"{where}.content")  # the models read text only
        except UnsupportedContentError as e:
            raise HttpError(400, e.code, e.message, param=e.param) from None
        if role == "tool" and not message.get("tool_call_id"):
            raise _bad(f"'{where}' is a tool message: it needs the 'tool_call_id' of the call it answers",
                       f"{where}.tool_call_id")
        try:
            parsed = message_from_wire(ROLE_MAP[role], content, calls, message.get("tool_call_id") or "", where)
        except ValueError as e:
            raise _bad(str(e), f"{where}.tool_calls") from None
        chars += len(text) + sum(len(c.name) + len(c.arguments) for c in parsed.tool_calls)
        messages.append(parsed)
    if chars > limits.max_conversation_chars:
        raise _bad(f"the messages have {chars} characters, more than this server's limit of "
                   f"{limits.max_conversation_chars}", "messages", "conversation_limit_exceeded")
    return messages


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP:
        raise _bad(f"'stop' allows at most {MAX_STOP} sequences", "stop")
    return tuple(stops)


def _priority(body: Mapping[str, Any]) -> Priority:
    priority = body.get("priority")
    if priority is not None:
        if priority not in PRIORITIES:
            raise _bad(f"'priority' must be one of {sorted(PRIORITIES)}", "priority")
        return PRIORITIES[priority]
    tier = body.get("service_tier")
    if tier is None:
        return Priority.INTERACTIVE
    if tier not in SERVICE_TIERS:
        raise _bad(f"'service_tier' must be one of {sorted(SERVICE_TIERS)}", "service_tier")
    return SERVICE_TIERS[tier]


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise _bad(f"Unrecognized request argument supplied: {', '.join(map(str, unknown))}", unknown[0],
                   "unknown_parameter")
    for key, instead in (("functions", "tools"), ("function_call", "tool_choice"), ("logit_bias", "")):
        if body.get(key):
            raise _bad(f"'{key}' is not supported by this server" + (f"; use '{instead}'" if instead else ""), key,
                       "unsupported_parameter")
    for key in ("frequency_penalty", "presence_penalty"):
        if _number(body, key) not in (None, 0.0):
            raise _bad(f"'{key}' is not supported by this server (only 0)", key, "unsupported_parameter")
    _check_ignored(body)


def _check_ignored(body: Mapping[str, Any]) -> None:
    """Fields accepted and ignored still have OpenAI's types: a wrong one is a client bug to report."""
    for key in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise _bad(f"'{key}' must be a string", key, "invalid_type")
    for key in ("store",):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise _bad(f"'{key}' must be a boolean", key, "invalid_type")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16
                                 or not all(isinstance(v, str) for v in metadata.values())):
        raise _bad("'metadata' must be an object of at most 16 string values", "metadata", "invalid_type")
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities)):
        raise _bad("'modalities' must be a list of strings", "modalities", "invalid_type")


def parse_chat_request(body: Any, models: Mapping[str, str], limits: ServerConfig) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body", "invalid_type")
    _refuse_unsupported(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model", "invalid_type")
    if model not in models:
        raise HttpError(404, "model_not_found", f"The model '{model}' does not exist or you do not have access "
                        f"to it; available: {sorted(models)}", param="model")
    messages = _messages(body.get("messages"), limits)
    n = _integer(body, "n")
    if n not in (None, 1):
        raise _bad("'n' must be 1 on this server", "n")
    max_tokens = _integer(body, "max_completion_tokens")
    max_key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_key = _integer(body, "max_tokens"), "max_tokens"
    if max_tokens is None:
        max_tokens = limits.default_max_output_tokens
    elif not 1 <= max_tokens <= limits.max_output_tokens:
        raise _bad(f"'{max_key}' must be between 1 and {limits.max_output_tokens}", max_key)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("'logprobs' must be a boolean", "logprobs", "invalid_type")
    top_logprobs = _integer(body, "top_logprobs")
    if top_logprobs is not None:
        if not logprobs:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise _bad(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream", "invalid_type")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise _bad("'stream_options' may only hold 'include_usage'", "stream_options")
        include_usage = options.get("include_usage") is True
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    try:
        params = SamplingParams(
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            seed=_integer(body, "seed"),
            max_tokens=max_tokens,
            stop=_stop(body.get("stop")),
            logprobs=top_logprobs or 0,
        )
    except InvalidSamplingError as e:
        raise HttpError(400, e.code, e.message, param=e.param) from e
    try:
        constraints = parse_chat_constraints(body)
    except InvalidRequestError as e:  # SchemaError among them: the field is named
        raise HttpError(400, e.code, e.message, param=e.param) from e
    return ChatRequest(model=model, messages=messages, constraints=constraints, params=params, stream=bool(stream),
                       include_usage=include_usage, logprobs=bool(logprobs), priority=_priority(body))


# ----- response shapes ---------------------------------------------------------------------

FINISH_REASONS = {"stop": "stop", "length": "length"}


def finish_reason(finish: FinishEvent, calls: bool) -> str:
    """OpenAI's finish_reason: "tool_calls" when the answer is calls (and it was not cut short)."""
    if calls and finish.reason == "stop":
        return "tool_calls"
    return FINISH_REASONS.get(finish.reason, "stop")


def usage(finish: FinishEvent) -> dict[str, Any]:
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finish.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                      "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    }


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def logprob_entry(tokenizer: Tokenizer, event: TokenEvent) -> dict[str, Any]:
    entry = _token_entry(tokenizer, event.token_id, event.logprob)
    entry["top_logprobs"] = [_token_entry(tokenizer, t, lp) for t, lp in event.top_logprobs]
    return entry


@dataclass(frozen=True)
class CompletionIds:
    id: str
    model: str
    created: int
    route: RouteInfo

    @classmethod
    def new(cls, completion_id: str, model: str, route: RouteInfo) -> CompletionIds:
        return cls(completion_id, model, int(time.time()), route)

    def head(self, kind: str) -> dict[str, Any]:
        # Our extensions: x_tier, the engine tier that served the request; x_route, how the
        # cascade routed it (only when the cascade did, not when the client named a tier).
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None, "x_tier": self.route.tier}
        if self.route.cascaded:
            head["x_route"] = self.route.wire()
        return head


def completion(ids: CompletionIds, text: str, finish: FinishEvent,
               logprobs: list[dict[str, Any]] | None, calls: list[ToolCall] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if calls:
        message["tool_calls"] = tool_calls_wire(calls)
        message["content"] = text or None
    return {
        **ids.head("chat.completion"),
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish_reason(finish, bool(calls)),
        }],
        "usage": usage(finish),
    }


def chunk(ids: CompletionIds, delta: dict[str, Any], *, finish_reason: str | None = None,
          logprobs: list[dict[str, Any]] | None = None, include_usage: bool = False) -> dict[str, Any]:
    body = {**ids.head("chat.completion.chunk"), "choices": [{
        "index": 0, "delta": delta, "finish_reason": finish_reason,
        "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
    }]}
    if include_usage:
        body["usage"] = None  # every chunk but the last carries usage: null (OpenAI's convention)
    return body


def usage_chunk(ids: CompletionIds, finish: FinishEvent) -> dict[str, Any]:
    return {**ids.head("chat.completion.chunk"), "choices": [], "usage": usage(finish)}
