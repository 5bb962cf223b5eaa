"""A disk cache of what loading a model file computes, so the next start of the same file is fast.

Building the tokenizer from a GGUF's metadata, parsing the file again for its tensors,
dequantizing them and timing the matmul forms took a restarted engine core ~17 s; their results
are kept here as *entries*. An entry is a folder named by a hash of its key (the model file's
SHA-256 and whatever else changes the result: the dtype, the writer's version, the CPU...)
holding the result's files and ``manifest.json`` (the key, and each file's size and SHA-256).

- A writer builds the entry in a private temporary folder beside the others, manifest last,
  and renames the folder into place: readers see a whole entry or none, and of two processes
  storing the same entry at once one rename wins and the other drops its copy.
- A reader uses an entry only if its manifest names the same key and every file still has its
  size and hash; anything else (a truncated file, a crash's leftovers, a foreign folder) is
  logged, removed, and the load goes the slow way and stores a fresh entry.
- The cache never fails a load: a disk that cannot be written costs a warning.
- Bounded: at most ``max_bytes`` and ``max_entries`` (defaults 10 GiB and 64; entries over the
  byte bound are not stored); the least recently used entries go first (a hit touches its
  manifest).

Where and whether: ``$RTGW_CACHE_DIR/load``, else ``$XDG_CACHE_HOME/rt-llm-gateway/load`` (else
``~/.cache/...``); ``RTGW_LOAD_CACHE=off`` turns it off; ``RTGW_LOAD_CACHE_MAX_GIB`` sets the
byte bound. Library functions (``llama.loader.load_gguf``, ``Tokenizer.from_gguf``,
``llama.matmul.tune``) cache only when handed a ``LoadCache``; the functions that load a model
from configuration (``models.tokenizer_for``, the engine's ``from_config``) use
``LoadCache.from_env()`` unless given one. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from llm_shared.errors import ModelFileError

log = logging.getLogger(__name__)

T = TypeVar("T")

CACHE_DIR_ENV = "RTGW_CACHE_DIR"  # replaces $XDG_CACHE_HOME/rt-llm-gateway for every cache of ours
SWITCH_ENV = "RTGW_LOAD_CACHE"  # "0", "off", "false" or "no": no load cache
MAX_GIB_ENV = "RTGW_LOAD_CACHE_MAX_GIB"
DEFAULT_MAX_GIB = 10.0
DEFAULT_MAX_ENTRIES = 64
MANIFEST = "manifest.json"
_TMP_PREFIX = ".tmp-"  # entries being written, and entries being removed
_STALE_TMP_S = 3600.0  # a temporary folder this old is a crashed writer's
_HASH_CHUNK = 8 << 20


def cache_home() -> Path:
    """``$RTGW_CACHE_DIR``, else ``$XDG_CACHE_HOME/rt-llm-gateway`` (``~/.cache/...`` when unset)."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rt-llm-gateway"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    except OSError as e:
        raise ModelFileError(f"cannot read {str(path)!r}: {e.strerror}") from e
    return digest.hexdigest()


class CorruptEntry(Exception):
    """A cached entry's files do not hold what its reader expects (raised by readers)."""


def _canonical(key: Mapping[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


class LoadCache:
    """One process's handle on the cache folder: lookups, stores, and what happened (for the log).

    ``root`` None is a cache that is off: every lookup misses and nothing is stored."""

    def __init__(self, root: Path | None, *, max_bytes: int = int(DEFAULT_MAX_GIB * 2**30),
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_bytes <= 0 or max_entries <= 0:
            raise ValueError(f"cache bounds must be positive, got {max_bytes} bytes and {max_entries} entries")
        self.root = root
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.outcomes: dict[str, str] = {}  # entry kind -> "hit" or "miss", latest lookup (for the log)
        self._hashes: dict[tuple[str, int, int, int], str] = {}  # (path, size, mtime, inode) -> SHA-256

    @classmethod
    def from_env(cls) -> LoadCache:
        """The cache the environment asks for (see the module's docstring)."""
        if os.environ.get(SWITCH_ENV, "").strip().lower() in ("0", "off", "false", "no"):
            return cls.off()
        max_gib = DEFAULT_MAX_GIB
        raw = os.environ.get(MAX_GIB_ENV, "").strip()
        if raw:
            try:
                max_gib = float(raw)
                if not 0 < max_gib < float("inf"):
                    raise ValueError(raw)
            except ValueError:
                log.warning("$%s=%r is not a positive number of GiB; using %g", MAX_GIB_ENV, raw, DEFAULT_MAX_GIB)
                max_gib = DEFAULT_MAX_GIB
        return cls(cache_home() / "load", max_bytes=int(max_gib * 2**30))

    @classmethod
    def off(cls) -> LoadCache:
        return cls(None)

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def describe(self) -> str:
        """How the lookups went, for the "model loaded in ..." line."""
        if not self.enabled:
            return "load cache off"
        hits = sorted(kind for kind, outcome in self.outcomes.items() if outcome == "hit")
        misses = sorted(kind for kind, outcome in self.outcomes.items() if outcome != "hit")
        if not misses:
            return "cache hit"
        if not hits:
            return "cache miss"
        return f"cache hit: {', '.join(hits)}; miss: {', '.join(misses)}"

    def source_sha256(self, path: Path) -> str:
        """The SHA-256 of a model file, computed once per handle while the file is unchanged."""
        st = path.stat()
        memo = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
        if memo not in self._hashes:
            self._hashes[memo] = file_sha256(path)
        return self._hashes[memo]

    def folder(self, key: Mapping[str, Any]) -> Path:
        """Where the entry for ``key`` lives (its ``kind`` names it, the rest is hashed)."""
        assert self.root is not None, "a cache that is off has no folders"
        digest = hashlib.sha256(_canonical(key).encode()).hexdigest()[:32]
        return self.root / f"{key['kind']}-{digest}"

    # --- reading ------------------------------------------------------------------------------

    def load(self, key: Mapping[str, Any], read: Callable[[Path], T]) -> T | None:
        """``read(folder)`` of the intact entry for ``key``, or None (a miss). ``read`` raises
        ``CorruptEntry`` (or ``OSError``) when the files are not what it needs; the entry is
        then logged, removed, and this is a miss."""
        if self.root is None:
            return None
        kind = str(key["kind"])
        self.outcomes[kind] = "miss"
        folder = self.folder(key)
        if not folder.exists():
            return None
        try:
            self._verify(folder, key)
            value = read(folder)
        except (CorruptEntry, OSError) as e:
            log.warning("load cache: ignoring the %s entry %s: %s", kind, folder, e)
            self._discard(folder)
            return None
        try:
            os.utime(folder / MANIFEST)  # recently used: evicted last
        except OSError:
            pass  # evicted under us since: the value read stays valid
        self.outcomes[kind] = "hit"
        return value

    @staticmethod
    def _verify(folder: Path, key: Mapping[str, Any]) -> None:
        try:
            manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
            files = manifest["files"]
            same_key = _canonical(manifest["key"]) == _canonical(key)
            listed = {str(name): (int(info["size"]), str(info["sha256"])) for name, info in files.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptEntry(f"unreadable manifest ({type(e).__name__}: {e})") from e
        except FileNotFoundError as e:
            raise CorruptEntry("no manifest (a foreign or damaged folder)") from e
        if not same_key:
            raise CorruptEntry("its manifest names another key")
        for name, (size, sha256) in listed.items():
            path = folder / name
            if "/" in name or name in ("", ".", "..", MANIFEST) or not path.is_file():
                raise CorruptEntry(f"file {name!r} is missing")
            if path.stat().st_size != size:
                raise CorruptEntry(f"file {name!r} has {path.stat().st_size} bytes, the manifest says {size}")
            try:
                actual = file_sha256(path)
            except ModelFileError as e:
                raise CorruptEntry(str(e)) from e
            if actual != sha256:
                raise CorruptEntry(f"file {name!r} does not hash to what the manifest says")

    # --- writing ------------------------------------------------------------------------------

    def store(self, key: Mapping[str, Any], write: Callable[[Path], None]) -> bool:
        """Make the entry for ``key`` from the files ``write(folder)`` puts into an empty folder.
        True if the entry exists afterwards (ours, or a concurrent writer's); never raises for
        the disk's sake."""
        if self.root is None:
            return False
        target = self.folder(key)
        tmp: Path | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=self.root))
            write(tmp)
            files = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
                     for p in sorted(tmp.iterdir()) if p.is_file()}
            size = sum(int(info["size"]) for info in files.values())
            if size > self.max_bytes:
                log.info("load cache: the %s entry (%.2f GiB) is larger than the cache's bound (%.2f GiB); "
                         "not stored", key["kind"], size / 2**30, self.max_bytes / 2**30)
                return False
            manifest = {"key": dict(key), "files": files, "created": time.time()}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
            try:
                os.rename(tmp, target)  # atomic; fails if the target exists (another writer was first)
                tmp = None
            except OSError:
                if not (target / MANIFEST).is_file():
                    raise
            self._evict(keep=target)
            return True
        except (OSError, ModelFileError) as e:
            log.warning("load cache: cannot store the %s entry in %s: %s", key["kind"], self.root, e)
            return False
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _discard(self, folder: Path) -> None:
        """Remove an entry: renamed out of the way first, so no reader finds half of it."""
        assert self.root is not None
        trash = self.root / f"{_TMP_PREFIX}gone-{uuid.uuid4().hex}"
        try:
            os.rename(folder, trash)
        except OSError:
            return  # already gone (another process removed or replaced it)
        shutil.rmtree(trash, ignore_errors=True)

    def _evict(self, *, keep: Path) -> None:
        """Least recently used entries out until the bounds hold; ``keep`` (just stored) stays."""
        assert self.root is not None
        entries: list[tuple[float, Path, int]] = []
        now = time.time()
        for child in self.root.iterdir():
            try:
                if child.name.startswith(_TMP_PREFIX):
                    if now - child.stat().st_mtime > _STALE_TMP_S:
                        shutil.rmtree(child, ignore_errors=True)
                    continue
                used = (child / MANIFEST).stat().st_mtime
                size = sum(p.stat().st_size for p in child.iterdir() if p.is_file())
            except OSError:
                continue  # not an entry (no manifest), or removed while we looked
            entries.append((used, child, size))
        total = sum(size for _, _, size in entries)
        count = len(entries)
        for _, child, size in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes and count <= self.max_entries:
                break
            if child == keep:
                continue
            log.info("load cache: evicting %s (%.0f MiB)", child.name, size / 2**20)
            self._discard(child)
            total -= size
            count -= 1
