"""The wire protocol between the engine core process and its clients.

Frames are a 4-byte big-endian length followed by one msgpack map with a ``t`` tag. Every
message is validated here, at the boundary, into one tagged dataclass per kind; inside the
core and the client the types are trusted. Pure Python (no torch), so the gateway can import it.

Every connection is authenticated before anything else crosses it: the core opens with a
Challenge (a fresh random nonce), the client answers Authenticate (an HMAC-SHA256 of the nonce
under the shared secret), and only then does the core send Hello and accept commands. Until
then frames are capped at ``PRE_AUTH_MAX_FRAME_BYTES`` and the peer has ``AUTH_TIMEOUT_S``.

Client -> core: Authenticate (first), AddRequest, AbortRequest, StatsRequest, SetThreads, Shutdown.
Core -> client: Challenge (first), Hello (once authenticated), StepOutputs (each step), Rejected (an
add refused), AbortDone (blocks freed), StatsReply (also SetThreads' answer, once it is in force),
ErrorReply (a message the core could not accept).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from engine_gpu.outputs import RequestOutput
from llm_shared import errors
from llm_shared.contract import (
    FINISH_REASONS,
    MAX_PREFIX_DRAFT_TOKENS,
    FinishEvent,
    Priority,
    SamplingParams,
    TokenEvent,
    check_cache_salt,
)

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 8 * 1024 * 1024  # a 128k-token prompt is ~640 KB; far above any real message
MAX_REQUEST_ID_CHARS = 256
MAX_PROMPT_TOKENS = 1 << 20  # sanity bound before the scheduler's own max_model_len check
PRIVATE_SOCKET_PREFIX = "engine-core-"  # temp dir of a core's private unix socket (listen = "")
PRE_AUTH_MAX_FRAME_BYTES = 4096  # what an unauthenticated peer may send at most
AUTH_TIMEOUT_S = 10.0  # an unauthenticated peer is dropped after this
NONCE_BYTES = 32
MIN_SECRET_CHARS = 16
AUTH_CONTEXT = b"rt-llm-gateway engine core v1\x00"  # binds the MAC to this protocol
MAX_THREADS = 4096  # SetThreads' bound, as [host] cpus'

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_ERROR_CLASSES: dict[str, type[errors.EngineError]] = {
    cls.code: cls
    for cls in (
        errors.EngineError, errors.InvalidRequestError, errors.EmptyPromptError, errors.PromptTooLongError,
        errors.InvalidSamplingError, errors.UnknownModelError, errors.DuplicateRequestError,
        errors.OverloadedError, errors.EngineUnavailableError,
    )
}


class ProtocolError(errors.APIError):
    """A frame or message that does not follow the protocol. ``seq``/``request_id`` are filled
    when they could be read, so the reply can be routed to the waiting caller."""

    code = "bad_message"

    def __init__(self, message: str, *, code: str | None = None, seq: int | None = None,
                 request_id: str | None = None, param: str | None = None) -> None:
        super().__init__(message, code=code, param=param)
        self.seq = seq
        self.request_id = request_id


# --- client -> core -----------------------------------------------------------------------

@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: Priority
    draft_ids: list[int] = dataclasses.field(default_factory=list)  # verified with the prompt (Engine.generate)
    cache_salt: str = ""  # prefix-cache hits only from requests with the same salt (Engine.generate)
    t: Literal["add"] = "add"


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    seq: int  # echoed in AbortDone so the caller's future resolves
    t: Literal["abort"] = "abort"


@dataclass(frozen=True)
class StatsRequest:
    seq: int
    t: Literal["stats"] = "stats"


@dataclass(frozen=True)
class SetThreads:  # the gateway moving the host's threads between tiers (gateway/tiers/cores.py)
    seq: int  # echoed in the StatsReply sent once the count is in force
    threads: int
    t: Literal["threads"] = "threads"


@dataclass(frozen=True)
class Shutdown:
    t: Literal["shutdown"] = "shutdown"


@dataclass(frozen=True)
class Authenticate:
    mac: bytes  # auth_mac(secret, the challenge's nonce)
    t: Literal["auth"] = "auth"


ClientMessage = Authenticate | AddRequest | AbortRequest | StatsRequest | SetThreads | Shutdown


# --- core -> client -----------------------------------------------------------------------

@dataclass(frozen=True)
class Challenge:
    nonce: bytes
    t: Literal["challenge"] = "challenge"


@dataclass(frozen=True)
class Hello:
    info: dict[str, Any]  # model id, vocab_size, max_model_len, eos_id, block_size, num_blocks, model config
    stats: dict[str, float]
    t: Literal["hello"] = "hello"


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[RequestOutput]
    stats: dict[str, float]  # pushed with every step so the client's stats() stays fresh
    t: Literal["out"] = "out"


@dataclass(frozen=True)
class Rejected:
    request_id: str
    code: str  # an llm_shared.errors code; the client raises the matching class
    message: str
    param: str | None = None
    t: Literal["reject"] = "reject"


@dataclass(frozen=True)
class AbortDone:
    seq: int
    request_id: str
    stats: dict[str, float]  # taken after the blocks were freed
    t: Literal["aborted"] = "aborted"


@dataclass(frozen=True)
class StatsReply:
    seq: int
    stats: dict[str, float]
    t: Literal["stats"] = "stats"


@dataclass(frozen=True)
class ErrorReply:
    seq: int | None
    code: str
    message: str
    t: Literal["error"] = "error"


CoreMessage = Challenge | Hello | StepOutputs | Rejected | AbortDone | StatsReply | ErrorReply


def auth_mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, AUTH_CONTEXT + nonce, hashlib.sha256).digest()


def check_mac(secret: bytes, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(auth_mac(secret, nonce), mac)


def secret_bytes(secret: str | bytes | None, where: str) -> bytes:
    """The shared secret as bytes, or ConfigError naming where it should come from."""
    if secret is None or len(secret) < MIN_SECRET_CHARS:
        raise errors.ConfigError(
            f"the engine core's socket needs a shared secret of at least {MIN_SECRET_CHARS} characters in {where}; "
            "every connection proves it knows the secret before any command is taken")
    return secret.encode("utf-8") if isinstance(secret, str) else secret


def error_from_code(code: str, message: str, param: str | None = None) -> errors.EngineError:
    """The typed error a Rejected stands for (unknown codes become a plain EngineError)."""
    return _ERROR_CLASSES.get(code, errors.EngineError)(message, param=param)


def parse_listen(listen: str) -> tuple[int, str | tuple[str, int]]:
    """'unix:/path' or 'tcp:host:port' -> (socket family, address). IPv6 hosts go in brackets."""
    kind, _, rest = listen.partition(":")
    if kind == "unix" and rest:
        return socket.AF_UNIX, rest
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        host = host.strip("[]")
        if host and port.isdigit() and int(port) <= 65535:
            return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))
    raise errors.ConfigError(f"engine address {listen!r} must be 'unix:/path' or 'tcp:host:port'")


# --- framing ------------------------------------------------------------------------------

def encode_frame(message: ClientMessage | CoreMessage) -> bytes:
    return _frame(_to_wire(message))


def encode_step_outputs(outputs: Sequence[tuple[str, RequestOutput]], stats: dict[str, float]) -> bytes:
    """The frame of ``StepOutputs`` holding each output under the given request id, byte for byte,
    without copying the outputs to rename them (the core's per-step path)."""
    return _frame(_step_outputs_to_wire(outputs, stats))


def _frame(wire: dict[str, Any]) -> bytes:
    payload = msgpack.packb(wire, use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit",
                            code="frame_too_large")
    return HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Bytes in, complete frame payloads out (sans-I/O, used by the core's selector loop)."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self.max_frame_bytes = max_frame_bytes  # raised once the peer authenticated

    def feed(self, data: bytes) -> list[bytes]:
        """Raises ProtocolError(code="frame_too_large"): the stream cannot be resynchronised after it."""
        self._buf += data
        frames: list[bytes] = []
        while len(self._buf) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buf)
            if size > self.max_frame_bytes:
                raise ProtocolError(f"frame of {size} bytes exceeds the {self.max_frame_bytes}-byte limit",
                                    code="frame_too_large")
            if len(self._buf) < HEADER.size + size:
                break
            frames.append(bytes(self._buf[HEADER.size:HEADER.size + size]))
            del self._buf[:HEADER.size + size]
        return frames


async def read_frame(reader: asyncio.StreamReader, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes | None:
    """One payload from an asyncio stream; None on a clean end of stream between frames."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ProtocolError("connection closed inside a frame header", code="bad_frame") from e
    (size,) = HEADER.unpack(header)
    if size > max_frame_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds the {max_frame_bytes}-byte limit", code="frame_too_large")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as e:
        raise ProtocolError("connection closed inside a frame", code="bad_frame") from e


def _unpack(payload: bytes) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as e:
        raise ProtocolError(f"frame is not a valid msgpack message: {type(e).__name__}") from e
    if not isinstance(obj, dict):
        raise ProtocolError("a message must be a msgpack map")
    return obj


# --- encoding -----------------------------------------------------------------------------

def _to_wire(m: ClientMessage | CoreMessage) -> dict[str, Any]:
    match m:
        case AddRequest():
            params = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(m.params).items()}
            if not params["grammar"]:
                del params["grammar"]  # free decoding, the common case: as before grammars existed
            wire = {"t": m.t, "id": m.request_id, "prompt": list(m.prompt_ids), "params": params,
                    "priority": int(m.priority)}
            if m.draft_ids:
                wire["draft"] = list(m.draft_ids)
            if m.cache_salt:
                wire["salt"] = m.cache_salt
            return wire
        case Authenticate():
            return {"t": m.t, "mac": m.mac}
        case Challenge():
            return {"t": m.t, "nonce": m.nonce}
        case AbortRequest():
            return {"t": m.t, "id": m.request_id, "seq": m.seq}
        case StatsRequest() | StatsReply():
            return {"t": m.t, "seq": m.seq, **({"stats": m.stats} if isinstance(m, StatsReply) else {})}
        case SetThreads():  # torch's and the drafter's threads from the next step
            return {"t": m.t, "seq": m.seq, "threads": m.threads}
        case Shutdown():
            return {"t": m.t}
        case Hello():
            return {"t": m.t, "info": m.info, "stats": m.stats}
        case StepOutputs():
            return _step_outputs_to_wire([(o.request_id, o) for o in m.outputs], m.stats)
        case Rejected():
            return {"t": m.t, "id": m.request_id, "code": m.code, "message": m.message, "param": m.param}
        case AbortDone():
            return {"t": m.t, "seq": m.seq, "id": m.request_id, "stats": m.stats}
        case ErrorReply():
            return {"t": m.t, "seq": m.seq, "code": m.code, "message": m.message}
    raise TypeError(f"not a protocol message: {m!r}")


def _step_outputs_to_wire(outputs: Sequence[tuple[str, RequestOutput]], stats: dict[str, float]) -> dict[str, Any]:
    # One expression, no call per request or token (a call per request was a quarter of the core's
    # output path at 256 requests); msgpack packs top_logprobs' tuples as the arrays lists make.
    reqs = [[rid, [[t.token_id, t.text, t.logprob, t.top_logprobs] for t in o.tokens],
             None if (f := o.finish) is None
             else [f.reason, f.prompt_tokens, f.completion_tokens, f.cached_tokens, f.text, f.message]]
            for rid, o in outputs]
    return {"t": "out", "reqs": reqs, "stats": stats}


# --- decoding and validation --------------------------------------------------------------

def _int(obj: Mapping[str, Any], key: str, *, low: int = 0, high: int = 2**63 - 1) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ProtocolError(f"field {key!r} must be an integer in [{low}, {high}]")
    return v


def _str(obj: Mapping[str, Any], key: str, *, max_chars: int = 1 << 16, empty: bool = True) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or len(v) > max_chars or (not empty and not v):
        raise ProtocolError(f"field {key!r} must be a string of at most {max_chars} characters")
    return v


def _stats(obj: Mapping[str, Any]) -> dict[str, float]:
    v = obj.get("stats")
    if not isinstance(v, dict) or not all(
        isinstance(k, str) and isinstance(x, (int, float)) and not isinstance(x, bool) for k, x in v.items()
    ):
        raise ProtocolError("field 'stats' must map names to numbers")
    return v


def _keys(obj: Mapping[str, Any], allowed: set[str]) -> None:
    extra = set(obj) - allowed
    if extra:
        raise ProtocolError(f"unknown field(s) {sorted(extra)}")


def params_from_wire(raw: Any) -> SamplingParams:
    """SamplingParams from a msgpack map; type and range errors raise InvalidSamplingError."""
    if not isinstance(raw, dict):
        raise errors.InvalidSamplingError("params must be a map", param="params")
    unknown = sorted(k for k in raw if k not in _PARAM_FIELDS)
    if unknown:
        raise errors.InvalidSamplingError(f"unknown sampling parameter(s) {unknown}", param=str(unknown[0]))
    kwargs = dict(raw)
    for key in ("stop", "stop_token_ids"):
        if key in kwargs:
            if not isinstance(kwargs[key], list):
                raise errors.InvalidSamplingError(f"{key} must be a list", param=key)
            kwargs[key] = tuple(kwargs[key])
    if not isinstance(kwargs.get("ignore_eos", False), bool):
        raise errors.InvalidSamplingError("ignore_eos must be a boolean", param="ignore_eos")
    return SamplingParams(**kwargs)


def decode_client_message(payload: bytes) -> ClientMessage:
    """Validate a frame from a client. Raises ProtocolError (with seq/request_id when readable),
    or a typed InvalidRequestError carrying the request id for a bad add."""
    obj = _unpack(payload)
    seq = obj.get("seq") if isinstance(obj.get("seq"), int) and not isinstance(obj.get("seq"), bool) else None
    try:
        match obj.get("t"):
            case "add":
                _keys(obj, {"t", "id", "prompt", "params", "priority", "draft", "salt"})
                request_id = _str(obj, "id", max_chars=MAX_REQUEST_ID_CHARS, empty=False)
                try:
                    return _decode_add(obj, request_id)
                except errors.EngineError as e:
                    raise ProtocolError(e.message, code=e.code, request_id=request_id, param=e.param) from e
            case "auth":
                _keys(obj, {"t", "mac"})
                mac = obj.get("mac")
                if not isinstance(mac, bytes) or len(mac) != hashlib.sha256().digest_size:
                    raise ProtocolError("auth.mac must be 32 bytes", code="unauthenticated")
                return Authenticate(mac)
            case "abort":
                _keys(obj, {"t", "id", "seq"})
                return AbortRequest(_str(obj, "id", max_chars=MAX_REQUEST_ID_CHARS, empty=False), _int(obj, "seq"))
            case "stats":
                _keys(obj, {"t", "seq"})
                return StatsRequest(_int(obj, "seq"))
            case "threads":
                _keys(obj, {"t", "seq", "threads"})
                return SetThreads(_int(obj, "seq"), _int(obj, "threads", low=1, high=MAX_THREADS))
            case "shutdown":
                _keys(obj, {"t"})
                return Shutdown()
            case other:
                raise ProtocolError(f"unknown message type {other!r}")
    except ProtocolError as e:
        e.seq = e.seq if e.seq is not None else seq
        raise


def _token_list(obj: Mapping[str, Any], key: str, max_len: int) -> list[int]:
    ids = obj.get(key, [])
    if not isinstance(ids, list) or len(ids) > max_len or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise errors.InvalidRequestError(f"{key} must be a list of at most {max_len} non-negative token ids",
                                         param=key)
    return ids


def _decode_add(obj: Mapping[str, Any], request_id: str) -> AddRequest:
    prompt = _token_list(obj, "prompt", MAX_PROMPT_TOKENS)
    if not prompt:
        raise errors.EmptyPromptError("the prompt has no tokens", param="prompt")
    drafts = _token_list(obj, "draft", MAX_PREFIX_DRAFT_TOKENS)
    priority = obj.get("priority")
    if isinstance(priority, bool) or priority not in {int(p) for p in Priority}:
        raise errors.InvalidRequestError(f"priority must be one of {[int(p) for p in Priority]}", param="priority")
    salt = check_cache_salt(obj.get("salt", ""))  # a bad salt rejects this request only
    return AddRequest(request_id, prompt, params_from_wire(obj.get("params")), Priority(priority), drafts, salt)


def decode_core_message(payload: bytes) -> CoreMessage:
    """Validate a frame from the core; a core of another version fails loudly, not silently."""
    obj = _unpack(payload)
    match obj.get("t"):
        case "challenge":
            nonce = obj.get("nonce")
            if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
                raise ProtocolError(f"challenge.nonce must be {NONCE_BYTES} bytes")
            return Challenge(nonce)
        case "hello":
            info = obj.get("info")
            if not isinstance(info, dict):
                raise ProtocolError("hello.info must be a map")
            return Hello(info, _stats(obj))
        case "out":
            reqs = obj.get("reqs")
            if not isinstance(reqs, list):
                raise ProtocolError("out.reqs must be a list")
            return StepOutputs([_output_from_wire(r) for r in reqs], _stats(obj))
        case "reject":
            param = obj.get("param")
            if param is not None and not isinstance(param, str):
                raise ProtocolError("reject.param must be a string or nil")
            return Rejected(_str(obj, "id"), _str(obj, "code"), _str(obj, "message"), param)
        case "aborted":
            return AbortDone(_int(obj, "seq"), _str(obj, "id"), _stats(obj))
        case "stats":
            return StatsReply(_int(obj, "seq"), _stats(obj))
        case "error":
            seq = obj.get("seq")
            return ErrorReply(None if seq is None else _int(obj, "seq"), _str(obj, "code"), _str(obj, "message"))
        case other:
            raise ProtocolError(f"unknown message type {other!r} from the engine core")


def _output_from_wire(raw: Any) -> RequestOutput:
    try:
        request_id, tokens, finish = raw
        events = [TokenEvent(int(tok), str(text), float(lp), tuple((int(i), float(p)) for i, p in top))
                  for tok, text, lp, top in tokens]
        fin = None
        if finish is not None:
            reason, prompt_tokens, completion_tokens, cached_tokens, text, message = finish
            if reason not in FINISH_REASONS:
                raise ProtocolError(f"unknown finish reason {reason!r}")
            fin = FinishEvent(reason, int(prompt_tokens), int(completion_tokens), int(cached_tokens),
                              str(text), str(message), tier="gpu")
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"malformed step output: {e}") from e
    if not isinstance(request_id, str):
        raise ProtocolError("step output request id must be a string")
    return RequestOutput(request_id, events, fin)
