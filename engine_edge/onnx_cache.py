"""Where exported ONNX decoders live on disk, and how we know a cached one is intact.

An export is keyed by the SHA-256 of the GGUF file plus ``EXPORTER_VERSION``, so new weights
or a changed graph never reuse an old file. Beside ``model.onnx`` a manifest records the
hashes of every file the export wrote; a cached export counts only if all of them still hash
to what the manifest says, so a truncated or corrupted file is re-exported instead of loaded.
The manifest is written last: a crash mid-export leaves no manifest and hence no cache hit.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from llm_shared.load_cache import cache_home, file_sha256

# Bump whenever the graph's inputs/outputs, the traced model code or the export settings
# change in a way that makes older files wrong for the current backend.
EXPORTER_VERSION = "1"
MANIFEST_SUFFIX = ".manifest.json"


def default_cache_root() -> Path:
    """``onnx/`` in our cache folder: ``$RTGW_CACHE_DIR``, else ``$XDG_CACHE_HOME/rt-llm-gateway``
    (``~/.cache/...`` when unset); ``llm_shared.load_cache.cache_home``."""
    return cache_home() / "onnx"


def default_onnx_path(source_sha256: str, root: Path | None = None) -> Path:
    """``<root>/<sha256 of the GGUF>-v<EXPORTER_VERSION>/model.onnx``."""
    return (root or default_cache_root()) / f"{source_sha256}-v{EXPORTER_VERSION}" / "model.onnx"


def manifest_path(onnx_path: Path) -> Path:
    return onnx_path.with_name(onnx_path.name + MANIFEST_SUFFIX)


@dataclass(frozen=True)
class Manifest:
    """What an export was made from and what it wrote (file name relative to its folder -> sha256)."""

    source_sha256: str
    exporter_version: str
    files: dict[str, str]
    opset: int
    exporter: str  # "dynamo" or "torchscript": which torch.onnx path produced the graph
    torch_version: str

    def write(self, onnx_path: Path) -> None:
        target = manifest_path(onnx_path)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True))
        os.replace(tmp, target)

    @classmethod
    def read(cls, onnx_path: Path) -> Manifest | None:
        """The manifest beside ``onnx_path``, or None if there is none or it is unreadable."""
        try:
            raw = json.loads(manifest_path(onnx_path).read_text())
            manifest = cls(**raw)
        except (OSError, ValueError, TypeError):
            return None
        files_ok = isinstance(manifest.files, dict) and all(
            isinstance(k, str) and isinstance(v, str) and "/" not in k and k not in ("", ".", "..")
            for k, v in manifest.files.items()
        )
        return manifest if files_ok else None


def hash_outputs(folder: Path) -> dict[str, str]:
    """Hashes of every file an export wrote into its (otherwise empty) staging folder:
    the .onnx file and, for big models, its external data."""
    return {p.name: file_sha256(p) for p in sorted(folder.iterdir()) if p.is_file()}


@dataclass(frozen=True)
class CacheCheck:
    hit: bool
    reason: str  # why it is not a hit, for the progress output ("" on a hit)


def check_cached(onnx_path: Path, source_sha256: str) -> CacheCheck:
    """Is ``onnx_path`` a complete, intact export of the GGUF with this hash?"""
    if not onnx_path.is_file():
        return CacheCheck(False, "no cached export")
    manifest = Manifest.read(onnx_path)
    if manifest is None:
        return CacheCheck(False, "no valid manifest (interrupted or foreign export)")
    if manifest.source_sha256 != source_sha256:
        return CacheCheck(False, "cached export was made from a different GGUF file")
    if manifest.exporter_version != EXPORTER_VERSION:
        return CacheCheck(False, f"cached export has exporter version {manifest.exporter_version}, need {EXPORTER_VERSION}")
    if onnx_path.name not in manifest.files:
        return CacheCheck(False, "manifest does not list the model file")
    for name, expected in manifest.files.items():
        path = onnx_path.parent / name
        if not path.is_file():
            return CacheCheck(False, f"cached file {name} is missing")
        if file_sha256(path) != expected:
            return CacheCheck(False, f"cached file {name} is corrupt (hash mismatch)")
    return CacheCheck(True, "")
