"""The load cache's entries: whole or absent, checked against their manifest on every read,
bounded, and never a reason for a load to fail."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from llm_shared.load_cache import (
    CACHE_DIR_ENV,
    MANIFEST,
    MAX_GIB_ENV,
    SWITCH_ENV,
    CorruptEntry,
    LoadCache,
    cache_home,
)

KEY = {"kind": "thing", "source_sha256": "ab" * 32, "version": "1"}


def write_payload(text: str = "payload" * 100):
    def write(folder: Path) -> None:
        (folder / "data.txt").write_text(text, encoding="utf-8")
        (folder / "more.bin").write_bytes(bytes(range(256)))

    return write


def read_payload(folder: Path) -> str:
    return (folder / "data.txt").read_text(encoding="utf-8")


def entries(cache: LoadCache) -> list[str]:
    assert cache.root is not None
    return sorted(p.name for p in cache.root.iterdir())


def test_a_stored_entry_is_read_back_with_a_manifest_of_sizes_and_hashes(tmp_path: Path) -> None:
    cache = LoadCache(tmp_path / "load")
    assert cache.load(KEY, read_payload) is None and cache.outcomes == {"thing": "miss"}
    assert cache.store(KEY, write_payload())
    folder = cache.folder(KEY)
    assert entries(cache) == [folder.name] and folder.name.startswith("thing-")
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["key"] == KEY
    assert manifest["files"]["more.bin"]["size"] == 256 and len(manifest["files"]["more.bin"]["sha256"]) == 64
    assert cache.load(KEY, read_payload) == "payload" * 100
    assert cache.outcomes == {"thing": "hit"} and cache.describe() == "cache hit"


def test_another_key_is_another_entry(tmp_path: Path) -> None:
    cache = LoadCache(tmp_path)
    cache.store(KEY, write_payload("a"))
    other = {**KEY, "version": "2"}
    assert cache.load(other, read_payload) is None
    cache.store(other, write_payload("b"))
    assert (cache.load(KEY, read_payload), cache.load(other, read_payload)) == ("a", "b")


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest", "foreign_key", "no_manifest"])
def test_a_damaged_entry_is_ignored_with_a_warning_removed_and_stored_again(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = LoadCache(tmp_path)
    cache.store(KEY, write_payload())
    folder = cache.folder(KEY)
    data = folder / "data.txt"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:10])
    elif damage == "flip":  # same size, other bytes
        raw = bytearray(data.read_bytes())
        raw[5] ^= 1
        data.write_bytes(bytes(raw))
    elif damage == "delete":
        data.unlink()
    elif damage == "manifest":
        (folder / MANIFEST).write_text("{not json")
    elif damage == "foreign_key":
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["key"]["source_sha256"] = "cd" * 32
        (folder / MANIFEST).write_text(json.dumps(manifest))
    else:
        (folder / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="llm_shared.load_cache"):
        assert cache.load(KEY, read_payload) is None
    assert any("ignoring the thing entry" in r.getMessage() for r in caplog.records)
    assert entries(cache) == []  # removed, temporary folders included
    assert cache.store(KEY, write_payload("fresh"))
    assert cache.load(KEY, read_payload) == "fresh"


def test_a_reader_that_finds_nonsense_makes_a_miss_not_an_error(tmp_path: Path) -> None:
    cache = LoadCache(tmp_path)
    cache.store(KEY, write_payload())

    def picky(folder: Path) -> str:
        raise CorruptEntry("not what I wrote")

    assert cache.load(KEY, picky) is None
    assert entries(cache) == []


def test_two_writers_of_one_entry_leave_one_whole_entry(tmp_path: Path) -> None:
    """The second writer finishes while the first is still writing: the first one's rename
    fails, it keeps the other's entry and leaves no temporary folder behind."""
    cache, rival = LoadCache(tmp_path), LoadCache(tmp_path)

    def slow_write(folder: Path) -> None:
        write_payload("first")(folder)
        assert rival.store(KEY, write_payload("second"))

    assert cache.store(KEY, slow_write)
    assert entries(cache) == [cache.folder(KEY).name]
    assert LoadCache(tmp_path).load(KEY, read_payload) == "second"


def test_a_crashed_writer_leaves_no_entry(tmp_path: Path) -> None:
    cache = LoadCache(tmp_path)

    def crash(folder: Path) -> None:
        (folder / "data.txt").write_text("half")
        raise OSError(28, "No space left on device")

    assert not cache.store(KEY, crash)
    assert entries(cache) == []
    assert cache.load(KEY, read_payload) is None


def test_least_recently_used_entries_go_first(tmp_path: Path) -> None:
    cache = LoadCache(tmp_path, max_entries=2)
    keys = [{**KEY, "version": str(n)} for n in range(3)]
    cache.store(keys[0], write_payload("0"))
    cache.store(keys[1], write_payload("1"))
    old = time.time() - 100
    os.utime(cache.folder(keys[0]) / MANIFEST, (old, old))
    os.utime(cache.folder(keys[1]) / MANIFEST, (old - 10, old - 10))
    assert cache.load(keys[1], read_payload) == "1"  # a hit makes it the most recently used
    cache.store(keys[2], write_payload("2"))
    assert cache.load(keys[0], read_payload) is None
    assert (cache.load(keys[1], read_payload), cache.load(keys[2], read_payload)) == ("1", "2")


def test_the_byte_bound_evicts_and_an_entry_over_it_is_not_stored(tmp_path: Path) -> None:
    cache = LoadCache(tmp_path, max_bytes=2500)
    first, second = {**KEY, "version": "a"}, {**KEY, "version": "b"}
    cache.store(first, write_payload("x" * 1000))
    old = time.time() - 100
    os.utime(cache.folder(first) / MANIFEST, (old, old))
    cache.store(second, write_payload("y" * 1000))  # 2 x (1000 + 256) bytes > 2500
    assert entries(cache) == [cache.folder(second).name]
    assert not cache.store({**KEY, "version": "c"}, write_payload("z" * 3000))
    assert entries(cache) == [cache.folder(second).name]


def test_stale_temporary_folders_are_swept(tmp_path: Path) -> None:
    cache = LoadCache(tmp_path)
    stale, fresh = tmp_path / ".tmp-crashed", tmp_path / ".tmp-writing"
    stale.mkdir()
    fresh.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    cache.store(KEY, write_payload())
    assert not stale.exists() and fresh.exists()


def test_an_unwritable_cache_costs_a_warning_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("in the way")
    cache = LoadCache(tmp_path / "file" / "load")
    with caplog.at_level(logging.WARNING, logger="llm_shared.load_cache"):
        assert cache.load(KEY, read_payload) is None
        assert not cache.store(KEY, write_payload())
    assert any("cannot store" in r.getMessage() for r in caplog.records)


def test_off_reads_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(SWITCH_ENV, "off")
    cache = LoadCache.from_env()
    assert not cache.enabled and cache.describe() == "load cache off"
    assert not cache.store(KEY, write_payload())
    assert cache.load(KEY, read_payload) is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(SWITCH_ENV, "1")
    assert LoadCache.from_env().enabled


def test_where_the_cache_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_home() == tmp_path / "xdg" / "rt-llm-gateway"
    assert LoadCache.from_env().root == tmp_path / "xdg" / "rt-llm-gateway" / "load"
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert LoadCache.from_env().root == tmp_path / "mine" / "load"


def test_the_byte_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_GIB_ENV, "0.5")
    assert LoadCache.from_env().max_bytes == 2**29
    monkeypatch.setenv(MAX_GIB_ENV, "lots")
    assert LoadCache.from_env().max_bytes == 10 * 2**30


def test_a_model_file_is_hashed_once_per_handle_while_unchanged(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    cache = LoadCache(tmp_path / "load")
    first = cache.source_sha256(model)
    assert cache.source_sha256(model) == first
    model.write_bytes(b"GGUF" + bytes(101))
    assert cache.source_sha256(model) != first
