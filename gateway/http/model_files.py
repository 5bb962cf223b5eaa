"""Model files for the device: ``GET /v1/models/{id}/file`` serves a ``[models.<id>]`` GGUF that the
config marks ``downloadable``, for clients that run it themselves when the gateway is away (the
JS SDK's in-browser engine, ``client_sdk/js/rtgw-device.js``).

The file is sent by aiohttp's ``FileResponse`` (``Content-Length``, ``Range`` and ``If-Range``, a
strong ``ETag`` from its size and mtime, ``If-None-Match`` answered 304), behind the same key as
the API. Its SHA-256, computed once per file version in a worker thread, goes with it as
``Repr-Digest`` (RFC 9530) and in the model card's ``x_device`` (``GET /v1/models/{id}``), so a
client checks what it stored before it ever runs it. Only ids of the config's ``[models]``
tables that say ``downloadable = true`` are served; anything else is a 404 that says why.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from llm_shared.errors import ModelFileError
from llm_shared.modelfile import check_gguf, resolve_source
from llm_shared.models import ModelConfig

log = logging.getLogger(__name__)

HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileInfo:
    """One version of a model file: where it is, how long, its digest."""

    path: Path
    size: int
    mtime_ns: int
    sha256: str  # hex

    @property
    def repr_digest(self) -> str:
        return "sha-256=:" + base64.b64encode(bytes.fromhex(self.sha256)).decode() + ":"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class DeviceModels:
    """The downloadable models of a config, each file hashed once per version (size, mtime)."""

    def __init__(self, models: dict[str, ModelConfig]) -> None:
        self._models = {m.id: m for m in models.values() if m.downloadable}
        self._known: dict[str, FileInfo] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._models

    async def info(self, model_id: str) -> FileInfo:
        """The file of ``model_id`` (downloadable, else KeyError) with its digest; ModelFileError
        when it is missing or not a GGUF file."""
        model = self._models[model_id]
        lock = self._locks.setdefault(model_id, asyncio.Lock())
        async with lock:  # one hash at a time per model: a burst of first downloads hashes once
            path = check_gguf(resolve_source(model.source))
            st = path.stat()
            known = self._known.get(model_id)
            if known is not None and (known.path, known.size, known.mtime_ns) == (path, st.st_size, st.st_mtime_ns):
                return known
            log.info("hashing %s for device downloads (%.0f MB)", path.name, st.st_size / 1e6)
            sha = await asyncio.to_thread(_sha256, path)
            info = FileInfo(path, st.st_size, st.st_mtime_ns, sha)
            self._known[model_id] = info
            return info


def device_card(model_id: str, info: FileInfo, family: str, context_length: int) -> dict[str, Any]:
    """The model card's ``x_device`` field (our extension): what a client needs to fetch, check
    and run the model on the device."""
    return {"model": model_id, "url": f"/v1/models/{model_id}/file", "format": "gguf", "bytes": info.size,
            "sha256": info.sha256, "family": family, "context_length": context_length}


def file_response(info: FileInfo) -> web.FileResponse:
    # private: the file is behind the API's key; no-cache: revalidate (the ETag) before reuse
    return web.FileResponse(info.path, headers={
        "Content-Type": "application/octet-stream", "Repr-Digest": info.repr_digest,
        "Cache-Control": "private, no-cache", "X-Content-Type-Options": "nosniff",
        "Content-Disposition": f'attachment; filename="{info.path.name}"'})


def not_downloadable(model_id: str, known: bool) -> str:
    if known:
        return f"The model '{model_id}' is not downloadable; set downloadable = true in its [models] table"
    return f"The model '{model_id}' does not exist"


def model_file_error(e: ModelFileError) -> str:
    log.error("a downloadable model file cannot be served: %s", e.message)
    return "the model file is not available on this server"
