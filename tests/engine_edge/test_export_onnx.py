"""Exporting a GGUF to ONNX: the graph agrees with torch, and the on-disk cache hits, misses and
recovers from corruption as its manifest says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from onnx_tiny import tiny_export, write_tiny_gguf

from engine_edge.export_onnx import ensure_onnx, main
from engine_edge.onnx_cache import (
    EXPORTER_VERSION,
    check_cached,
    default_onnx_path,
    file_sha256,
    manifest_path,
)
from engine_edge.onnx_decoder import OnnxDecoder
from llm_shared.errors import ModelFileError
from llm_shared.load_cache import CACHE_DIR_ENV


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    gguf, result = tiny_export(tmp_path_factory.getbasetemp() / "onnx-tiny")
    return gguf, result.onnx_path


def copy_export(onnx_path: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for f in onnx_path.parent.iterdir():
        if f.name.startswith(onnx_path.name) and not f.name.endswith(".lock"):
            shutil.copy(f, target / f.name)
    return target / onnx_path.name


def test_export_writes_a_verified_graph_and_manifest(exported: tuple[Path, Path]) -> None:
    gguf, onnx_path = exported
    manifest = json.loads(manifest_path(onnx_path).read_text())
    assert manifest["source_sha256"] == file_sha256(gguf)
    assert manifest["exporter_version"] == EXPORTER_VERSION
    assert manifest["opset"] >= 17
    assert manifest["files"] == {"model.onnx": file_sha256(onnx_path)}
    decoder = OnnxDecoder(onnx_path, n_threads=1)
    assert (decoder.shape.n_layers, decoder.shape.n_kv_heads, decoder.shape.head_dim) == (2, 2, 16)
    assert decoder.metadata["context_length"] == "512"


def test_second_run_is_a_cache_hit(exported: tuple[Path, Path]) -> None:
    gguf, onnx_path = exported
    before = onnx_path.stat().st_mtime_ns
    messages: list[str] = []
    result = ensure_onnx(gguf, onnx_path, progress=messages.append)
    assert result.cached and result.onnx_path == onnx_path
    assert onnx_path.stat().st_mtime_ns == before
    assert any("cached" in m for m in messages)
    assert not any("tracing" in m for m in messages)


def test_default_location_is_keyed_by_the_gguf_hash(
    exported: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf, onnx_path = exported
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "ours"))  # our cache folder, when set, wins
    assert default_onnx_path(file_sha256(gguf)).parent.parent == tmp_path / "ours" / "onnx"
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    expected = tmp_path / "cache" / "rt-llm-gateway" / "onnx" / f"{file_sha256(gguf)}-v{EXPORTER_VERSION}" / "model.onnx"
    assert default_onnx_path(file_sha256(gguf)) == expected
    copy_export(onnx_path, expected.parent)
    result = ensure_onnx(gguf)
    assert result.cached and result.onnx_path == expected


def test_cache_misses_name_their_reason(exported: tuple[Path, Path], tmp_path: Path) -> None:
    gguf, onnx_path = exported
    sha = file_sha256(gguf)
    assert check_cached(tmp_path / "none" / "model.onnx", sha).reason == "no cached export"
    assert "different GGUF" in check_cached(onnx_path, "0" * 64).reason

    no_manifest = copy_export(onnx_path, tmp_path / "a")
    manifest_path(no_manifest).unlink()
    assert "no valid manifest" in check_cached(no_manifest, sha).reason

    old = copy_export(onnx_path, tmp_path / "b")
    raw = json.loads(manifest_path(old).read_text())
    manifest_path(old).write_text(json.dumps({**raw, "exporter_version": "0"}))
    assert "exporter version" in check_cached(old, sha).reason

    garbled = copy_export(onnx_path, tmp_path / "c")
    manifest_path(garbled).write_text("{not json")
    assert "no valid manifest" in check_cached(garbled, sha).reason


def test_corrupt_cached_file_is_detected_and_exported_again(exported: tuple[Path, Path], tmp_path: Path) -> None:
    gguf, onnx_path = exported
    corrupt = copy_export(onnx_path, tmp_path / "corrupt")
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte: only the hash can tell
    corrupt.write_bytes(bytes(data))
    check = check_cached(corrupt, file_sha256(gguf))
    assert not check.hit and "corrupt" in check.reason

    result = ensure_onnx(gguf, corrupt, verify=False)
    assert not result.cached
    assert check_cached(corrupt, file_sha256(gguf)).hit
    assert corrupt.read_bytes() == onnx_path.read_bytes()  # the export is deterministic


def test_graph_handles_batches_of_different_lengths(exported: tuple[Path, Path]) -> None:
    """A padded batch step gives each row what it gets alone."""
    _, onnx_path = exported
    decoder = OnnxDecoder(onnx_path, n_threads=1)
    prompts = [[5, 9, 33, 2, 71], [40, 41], [7, 7, 7, 80, 12, 1, 3, 4]]
    solo = []
    for p in prompts:
        state = decoder.new_state()
        decoder.prefill(state, p)
        solo.append(decoder.decode([state], [11])[0].copy())
    states = [decoder.new_state() for _ in prompts]
    for state, p in zip(states, prompts, strict=True):
        decoder.prefill(state, p)
    batched = decoder.decode(states, [11, 11, 11])
    again = decoder.decode(states, [12, 12, 12])  # reuses the padded output as the next past
    assert np.abs(batched - np.stack(solo)).max() < 1e-4
    assert [s.length for s in states] == [len(p) + 2 for p in prompts]
    for row, (state, p) in enumerate(zip(states, prompts, strict=True)):
        alone = decoder.new_state()
        decoder.prefill(alone, [*p, 11])
        assert np.abs(decoder.decode([alone], [12])[0] - again[row]).max() < 1e-4
        assert alone.length == state.length


def test_cli_prints_the_path_and_reports_bad_input(
    exported: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf, onnx_path = exported
    assert main([str(gguf), "--out", str(onnx_path)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(onnx_path)
    assert "cached export found" in err

    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a model at all, just some bytes")
    assert main([str(not_gguf), "--out", str(tmp_path / "o" / "model.onnx")]) == 1
    assert "not a GGUF file" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.gguf")]) == 1


def test_out_must_not_be_a_directory(exported: tuple[Path, Path], tmp_path: Path) -> None:
    gguf, _ = exported
    with pytest.raises(ModelFileError, match="directory"):
        ensure_onnx(gguf, tmp_path)


def test_a_different_gguf_gets_a_different_cache_entry(tmp_path: Path) -> None:
    a = file_sha256(write_tiny_gguf(tmp_path / "a.gguf", seed=0))
    b = file_sha256(write_tiny_gguf(tmp_path / "b.gguf", seed=1))
    assert a != b and default_onnx_path(a) != default_onnx_path(b)
