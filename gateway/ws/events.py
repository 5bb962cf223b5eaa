"""Client events of the Realtime protocol, validated at the boundary (audio fields and events in
``audio_events``).

``parse_client_event`` turns one decoded frame (a dict from JSON or msgpack) into one of the
tagged dataclasses below, or raises ``ProtocolError`` with a stable ``code``, the offending
``param`` (dotted path, e.g. ``item.content[0].text``) and the client's ``event_id`` when it
had a usable one. Inside the session every field is then trusted.

Both the GA field names and the beta ones (``modalities``, ``max_response_output_tokens``)
are accepted in either flavour; only the server's answers differ by flavour.

``tools`` and ``tool_choice`` are the one exception to "parsed here": what they mean depends on
the constraints already in force (a response's ``tool_choice`` may name a tool of the session), so
they travel as sent in a ``ToolsPatch`` and the session parses them with the shared parser
(``llm_shared.structured.parse_realtime_constraints``), whose errors name the same params.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from gateway.ws.audio_events import (
    AUDIO_EVENT_TYPES,
    AudioAppend,
    AudioClear,
    AudioCommit,
    AudioEvent,
    AudioPatch,
    parse_audio_event,
    response_audio,
    session_audio,
)
from gateway.ws.conversation import ROOT, Role
from gateway.ws.fields import Fields, ProtocolError, is_unicode
from gateway.ws.truncation import Truncation, parse_truncation

__all__ = [
    "AudioAppend", "AudioClear", "AudioCommit", "ClientEvent", "ItemCreate", "ItemDelete", "ItemReference", "ItemRetrieve", "ItemTruncate", "NewFunctionCall",
    "NewFunctionCallOutput", "NewItem", "NewItems", "ProtocolError", "ResponseCancel", "ResponseCreate",
    "SessionLimits", "SessionUpdate", "ToolsPatch", "parse_client_event",
]

MAX_ID_CHARS = 64  # item ids, response ids, conversation ids chosen by clients
MAX_EVENT_ID_CHARS = 128
MAX_PARTS = 64  # content parts in one item
MAX_METADATA_PAIRS = 16  # Realtime API: 16 pairs, keys <= 64 chars, values <= 512 chars
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_FUNCTION_NAME = 64  # OpenAI's limit on function names

AUDIO_PART_TYPES = frozenset({"input_audio", "output_audio", "audio", "input_image"})
MCP_ITEM_TYPES = frozenset({"mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response"})
# Fields that only configure tracing or reasoning we do not run: accepted so that stock clients
# work, and ignored (documented in docs/protocol.md).
IGNORED_SESSION_FIELDS = frozenset({
    "tracing", "reasoning", "client_secret", "expires_at", "object", "id",
})
IGNORED_RESPONSE_FIELDS = frozenset({"reasoning"})


@dataclass(frozen=True)
class SessionLimits:
    """Per-session bounds; the gateway fills them from ``ServerConfig``."""

    max_conversation_items: int = 512
    max_conversation_chars: int = 200_000
    default_max_output_tokens: int = 512
    max_output_tokens: int = 4096
    # One input_audio_buffer.append, decoded: 15 MiB of base64, the API's limit (a recording sent whole).
    max_audio_append_bytes: int = 11_796_480
    max_audio_buffer_ms: int = 120_000  # the input audio buffer (and so one spoken turn)
    # Audio may arrive faster than real time (a file streamed), up to this rate sustained, with a
    # burst on top (a whole buffer at once: push to talk); beyond it an append is refused.
    # (audio/pcm is 48,000 bytes a second.)
    max_audio_bytes_per_s: int = 96_000
    audio_burst_bytes: int = 5_760_000

    def __post_init__(self) -> None:
        for name in ("max_conversation_items", "max_conversation_chars", "default_max_output_tokens",
                     "max_output_tokens", "max_audio_append_bytes", "max_audio_buffer_ms", "max_audio_bytes_per_s",
                     "audio_burst_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SessionLimits.{name} must be a positive integer, got {value!r}")
        if self.default_max_output_tokens > self.max_output_tokens:
            raise ValueError("SessionLimits.default_max_output_tokens must be <= max_output_tokens")


MaxTokens = int | Literal["inf"]


@dataclass(frozen=True)
class NewItem:
    """A message item sent by the client; ``id`` None means the server picks one."""

    id: str | None
    role: Role
    parts: tuple[str, ...]


@dataclass(frozen=True)
class NewFunctionCall:
    """A ``function_call`` item sent by the client (history it replays); ``call_id`` None means
    the server gives it one."""

    id: str | None
    call_id: str | None
    name: str
    arguments: str


@dataclass(frozen=True)
class NewFunctionCallOutput:
    """A ``function_call_output`` item: the result of the call ``call_id``."""

    id: str | None
    call_id: str
    output: str


NewItems = NewItem | NewFunctionCall | NewFunctionCallOutput


@dataclass(frozen=True)
class ItemReference:
    """``{"type": "item_reference", "id": ...}`` inside ``response.input``."""

    id: str


@dataclass(frozen=True)
class ToolsPatch:
    """The tool fields of a ``session`` or ``response`` object, as sent: ``raw`` holds ``tools``
    and/or ``tool_choice`` (only the keys given); the session applies them over the constraints in
    force. ``parallel_tool_calls`` is a plain boolean, checked here."""

    raw: Mapping[str, Any]
    parallel_tool_calls: bool | None = None


@dataclass(frozen=True)
class SessionUpdate:
    type: ClassVar[str] = "session.update"
    event_id: str | None
    model: str | None = None  # None: not given (same for every optional field below)
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = None
    tools: ToolsPatch | None = None  # tools / tool_choice / parallel_tool_calls, when any was given
    audio: AudioPatch | None = None  # modalities, voice, formats, transcription, turn detection
    truncation: Truncation | None = None


@dataclass(frozen=True)
class ItemCreate:
    type: ClassVar[str] = "conversation.item.create"
    event_id: str | None
    item: NewItems
    previous_item_id: str | None = None


@dataclass(frozen=True)
class ItemDelete:
    type: ClassVar[str] = "conversation.item.delete"
    event_id: str | None
    item_id: str


@dataclass(frozen=True)
class ItemRetrieve:
    type: ClassVar[str] = "conversation.item.retrieve"
    event_id: str | None
    item_id: str


@dataclass(frozen=True)
class ItemTruncate:
    type: ClassVar[str] = "conversation.item.truncate"
    event_id: str | None
    item_id: str
    content_index: int
    text_end: int | None  # our extension x_text_end: characters (code points) of a text part to keep
    audio_end_ms: int = 0  # of a spoken part: the audio played; the text said by then is kept


@dataclass(frozen=True)
class ResponseCreate:
    type: ClassVar[str] = "response.create"
    event_id: str | None
    conversation: str = "auto"  # "auto", "none", or the session's conversation id
    input: tuple[NewItems | ItemReference, ...] | None = None  # replaces the conversation as prompt
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = None
    metadata: dict[str, str] | None = None
    # (ext) the model's end-of-sequence token does not end the response: it runs to its token
    # limit, so a benchmark's cancel or long stream does not depend on how long the model answers.
    ignore_eos: bool = False
    tools: ToolsPatch | None = None  # overrides the session's for this response only
    audio: AudioPatch | None = None  # output modalities and voice of this response only


@dataclass(frozen=True)
class ResponseCancel:
    type: ClassVar[str] = "response.cancel"
    event_id: str | None
    response_id: str | None = None


ClientEvent = (SessionUpdate | ItemCreate | ItemDelete | ItemRetrieve | ItemTruncate | ResponseCreate | ResponseCancel
               | AudioEvent)


def parse_client_event(obj: object, limits: SessionLimits) -> ClientEvent:
    """Validate one decoded client event. Raises ``ProtocolError`` (never anything else)."""
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_event", "a client event must be a JSON object with a 'type'")
    event_id = _event_id(obj)
    try:
        return _parse(obj, event_id, limits)
    except ProtocolError as e:
        e.event_id = event_id
        raise


def _event_id(obj: dict[Any, Any]) -> str | None:
    """The client's event_id, if it is fit to be echoed back in an error."""
    value = obj.get("event_id")
    if isinstance(value, str) and len(value) <= MAX_EVENT_ID_CHARS and is_unicode(value):
        return value
    return None


def _parse(obj: dict[Any, Any], event_id: str | None, limits: SessionLimits) -> ClientEvent:
    f = Fields(obj, "")
    f.string("event_id", MAX_EVENT_ID_CHARS)
    kind = f.string("type", 64, required=True)
    if kind in AUDIO_EVENT_TYPES:
        return parse_audio_event(kind, f, event_id, limits.max_audio_append_bytes)
    if kind == "transcription_session.update":
        raise ProtocolError("unsupported_feature", "transcription sessions are not supported: open a realtime "
                            "session (speech is transcribed in it)", "type")
    parser = _PARSERS.get(kind or "")
    if parser is None:
        raise ProtocolError("unknown_event_type", f"unknown client event type {kind!r}", "type")
    return parser(f, event_id, limits)


def _session_update(f: Fields, event_id: str | None, limits: SessionLimits) -> SessionUpdate:
    if not f.has("session"):
        raise f.missing("session")
    s = Fields(f.raw("session"), "session")
    f.done()
    kind = s.string("type", 64)
    if kind not in (None, "realtime"):
        raise ProtocolError("unsupported_feature", "only 'realtime' sessions are supported", "session.type")
    if s.has("prompt"):
        raise ProtocolError("unsupported_feature", "stored prompts are not supported", "session.prompt")
    update = SessionUpdate(
        event_id=event_id,
        model=s.string("model", MAX_ID_CHARS),
        instructions=s.string("instructions", limits.max_conversation_chars),
        max_output_tokens=_max_tokens(s, limits),
        temperature=s.number("temperature", 0.0, 2.0),
        tools=_tools_patch(s),
        audio=session_audio(s),
        truncation=parse_truncation(s),
    )
    _include(s)
    s.done(IGNORED_SESSION_FIELDS)
    return update


def _include(s: Fields) -> None:
    """``session.include``: the API's one value asks for per-token logprobs of input transcripts,
    which Whisper here does not give (it scores segments), so it is refused rather than faked."""
    values = s.array("include", 8)
    for n, value in enumerate(values or ()):
        param = f"{s.param('include')}[{n}]"
        if value == "item.input_audio_transcription.logprobs":
            raise ProtocolError("unsupported_feature", "input transcription logprobs are not available: the "
                                "recognizer here scores whole segments, not tokens", param)
        raise ProtocolError("invalid_value", f"'{param}' must be \"item.input_audio_transcription.logprobs\"", param)


def _item_create(f: Fields, event_id: str | None, limits: SessionLimits) -> ItemCreate:
    if not f.has("item"):
        raise f.missing("item")
    item = _item(f.raw("item"), "item", limits, allow_reference=False)
    if isinstance(item, ItemReference):  # _item returns references only when allowed
        raise ProtocolError("invalid_value", "'item.type' must be \"message\", \"function_call\" or "
                            "\"function_call_output\"", "item.type")
    previous = f.string("previous_item_id", MAX_ID_CHARS)
    f.done()
    return ItemCreate(event_id=event_id, item=item, previous_item_id=previous)


def _item_delete(f: Fields, event_id: str | None, limits: SessionLimits) -> ItemDelete:
    item_id = f.string("item_id", MAX_ID_CHARS, required=True)
    f.done()
    return ItemDelete(event_id=event_id, item_id=str(item_id))


def _item_retrieve(f: Fields, event_id: str | None, limits: SessionLimits) -> ItemRetrieve:
    item_id = f.string("item_id", MAX_ID_CHARS, required=True)
    f.done()
    return ItemRetrieve(event_id=event_id, item_id=str(item_id))


def _item_truncate(f: Fields, event_id: str | None, limits: SessionLimits) -> ItemTruncate:
    item_id = f.string("item_id", MAX_ID_CHARS, required=True)
    content_index = f.integer("content_index", required=True)
    audio_end_ms = f.integer("audio_end_ms")
    text_end = f.integer("x_text_end")
    f.done()
    return ItemTruncate(event_id=event_id, item_id=str(item_id), content_index=int(content_index or 0),
                        text_end=text_end, audio_end_ms=audio_end_ms or 0)


def _response_create(f: Fields, event_id: str | None, limits: SessionLimits) -> ResponseCreate:
    r = Fields(f.raw("response") if f.has("response") else {}, "response")
    f.done()
    if r.has("prompt"):
        raise ProtocolError("unsupported_feature", "stored prompts are not supported", "response.prompt")
    conversation = r.string("conversation", MAX_ID_CHARS)
    items = r.array("input", limits.max_conversation_items)
    parsed_input = None
    if items is not None:
        parsed_input = tuple(_item(it, f"response.input[{n}]", limits, allow_reference=True)
                             for n, it in enumerate(items))
    create = ResponseCreate(
        event_id=event_id,
        conversation="auto" if conversation is None else conversation,
        input=parsed_input,
        instructions=r.string("instructions", limits.max_conversation_chars),
        max_output_tokens=_max_tokens(r, limits),
        temperature=r.number("temperature", 0.0, 2.0),
        metadata=_metadata(r),
        ignore_eos=bool(r.boolean("x_ignore_eos")),
        tools=_tools_patch(r),
        audio=response_audio(r),
    )
    r.done(IGNORED_RESPONSE_FIELDS)
    return create


def _response_cancel(f: Fields, event_id: str | None, limits: SessionLimits) -> ResponseCancel:
    response_id = f.string("response_id", MAX_ID_CHARS)
    f.done()
    return ResponseCancel(event_id=event_id, response_id=response_id)


_PARSERS = {
    "session.update": _session_update,
    "conversation.item.create": _item_create,
    "conversation.item.delete": _item_delete,
    "conversation.item.retrieve": _item_retrieve,
    "conversation.item.truncate": _item_truncate,
    "response.create": _response_create,
    "response.cancel": _response_cancel,
}


def _tools_patch(f: Fields) -> ToolsPatch | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a session or response object (None:
    none given). MCP tools are refused here; the rest is the shared parser's, in the session."""
    raw = {key: f.raw(key) for key in ("tools", "tool_choice") if f.has(key)}
    parallel = f.boolean("parallel_tool_calls")
    tools = raw.get("tools")
    if isinstance(tools, list):
        for n, tool in enumerate(tools):
            if isinstance(tool, dict) and tool.get("type") == "mcp":
                raise ProtocolError("unsupported_feature", "MCP tools are not supported: only function tools",
                                    f"{f.param('tools')}[{n}].type")
    if not raw and parallel is None:
        return None
    return ToolsPatch(raw, parallel)


def _max_tokens(f: Fields, limits: SessionLimits) -> MaxTokens | None:
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if not f.has(key):
            continue
        value = f.obj[key]
        if value == "inf":
            return "inf"
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError("invalid_type", f"'{f.param(key)}' must be an integer or \"inf\"", f.param(key))
        if not 1 <= value <= limits.max_output_tokens:
            raise ProtocolError("invalid_value",
                                f"'{f.param(key)}' must be between 1 and {limits.max_output_tokens}, or \"inf\"",
                                f.param(key))
        return value
    return None


def _metadata(f: Fields) -> dict[str, str] | None:
    if not f.has("metadata"):
        return None
    m = Fields(f.raw("metadata"), f.param("metadata"))
    if len(m.obj) > MAX_METADATA_PAIRS:
        raise ProtocolError("invalid_value", f"'{m.path}' allows at most {MAX_METADATA_PAIRS} pairs", m.path)
    out: dict[str, str] = {}
    for key in m.obj:
        if len(key) > MAX_METADATA_KEY:
            raise ProtocolError("string_above_max_length", f"metadata keys are at most {MAX_METADATA_KEY} characters",
                                m.path)
        if not is_unicode(key):
            raise ProtocolError("invalid_value", "metadata keys must be valid Unicode", m.path)
        out[key] = str(m.string(key, MAX_METADATA_VALUE, required=True))
    return out


def _item(obj: object, path: str, limits: SessionLimits, *,
          allow_reference: bool) -> NewItems | ItemReference:
    f = Fields(obj, path)
    kind = f.string("type", 64)
    kind = "message" if kind is None else kind  # the API's items are messages unless told
    if kind in MCP_ITEM_TYPES:
        raise ProtocolError("unsupported_feature", f"'{kind}' items are not supported (no MCP tools)",
                            f.param("type"))
    if kind == "item_reference" and allow_reference:
        ref = ItemReference(id=str(f.string("id", MAX_ID_CHARS, required=True)))
        f.done(frozenset({"object"}))
        return ref
    if kind not in ("message", "function_call", "function_call_output"):
        raise ProtocolError("invalid_value", f"'{f.param('type')}' must be \"message\", \"function_call\" or "
                            "\"function_call_output\"", f.param("type"))
    item_id = f.string("id", MAX_ID_CHARS)
    if item_id is not None and (not item_id or item_id == ROOT):
        raise ProtocolError("invalid_value", f"'{f.param('id')}' must be a non-empty id other than \"root\"",
                            f.param("id"))
    if f.string("object", 32) not in (None, "realtime.item"):
        raise ProtocolError("invalid_value", f"'{f.param('object')}' must be \"realtime.item\"", f.param("object"))
    if f.string("status", 32) not in (None, "completed", "incomplete", "in_progress"):
        raise ProtocolError("invalid_value", f"'{f.param('status')}' is not a valid item status", f.param("status"))
    if kind == "function_call":
        call = NewFunctionCall(id=item_id, call_id=_call_id(f, required=False),
                               name=str(f.string("name", MAX_FUNCTION_NAME, required=True)),
                               arguments=str(f.string("arguments", limits.max_conversation_chars, required=True)))
        f.done()
        return call
    if kind == "function_call_output":
        output = NewFunctionCallOutput(id=item_id, call_id=str(_call_id(f, required=True)),
                                       output=str(f.string("output", limits.max_conversation_chars, required=True)))
        f.done()
        return output
    role = f.string("role", 16, required=True)
    if role not in ("system", "user", "assistant"):
        raise ProtocolError("invalid_value", f"'{f.param('role')}' must be system, user or assistant",
                            f.param("role"))
    content = f.array("content", MAX_PARTS)
    if content is None:
        raise f.missing("content")
    if not content:
        raise ProtocolError("invalid_value", f"'{f.param('content')}' needs at least one part", f.param("content"))
    allowed = ("output_text", "text") if role == "assistant" else ("input_text", "text")
    parts = []
    for n, raw in enumerate(content):
        p = Fields(raw, f"{f.param('content')}[{n}]")
        part_type = p.string("type", 32, required=True)
        if part_type in AUDIO_PART_TYPES:
            raise ProtocolError("unsupported_feature", f"'{part_type}' content is not supported in items: send "
                                "speech with input_audio_buffer.append", p.param("type"))
        if part_type not in allowed:
            raise ProtocolError("invalid_value", f"'{p.param('type')}' must be one of {list(allowed)} for "
                                f"{role} messages", p.param("type"))
        parts.append(str(p.string("text", limits.max_conversation_chars, required=True)))
        p.done()
    f.done()
    return NewItem(id=item_id, role=role, parts=tuple(parts))  # type: ignore[arg-type]  # role checked above


def _call_id(f: Fields, *, required: bool) -> str | None:
    call_id = f.string("call_id", MAX_ID_CHARS, required=required)
    if call_id is not None and not call_id:
        raise ProtocolError("invalid_value", f"'{f.param('call_id')}' must not be empty", f.param("call_id"))
    return call_id
