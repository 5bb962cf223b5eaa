"""The packages depend one way: gateway -> {engine_cluster -> engine_gpu, engine_edge, voice} -> llm_shared, and the
client SDK -> {llm_shared, engine_edge, voice} (its on-device fallback, text and voice), never the gateway. Read from the source with ``ast`` (every import,
lazy ones inside functions and ``TYPE_CHECKING`` blocks included), so a cycle cannot hide
behind a deferred import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Which of our packages each package may import (itself always).
ALLOWED: dict[str, frozenset[str]] = {
    "llm_shared": frozenset(),
    "engine_edge": frozenset({"llm_shared"}),
    "engine_gpu": frozenset({"llm_shared"}),
    "engine_cluster": frozenset({"llm_shared", "engine_gpu"}),
    "voice": frozenset({"llm_shared"}),
    "gateway": frozenset({"llm_shared", "engine_edge", "engine_gpu", "engine_cluster", "voice"}),
    "client_sdk": frozenset({"llm_shared", "engine_edge", "voice"}),
}
OURS = frozenset(ALLOWED)


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """Top-level packages of ours that ``path`` imports, with the line of each import."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update((name.split(".")[0], node.lineno) for name in names if name.split(".")[0] in OURS)
    return found


def violations(root: Path) -> list[str]:
    out = []
    for package, allowed in ALLOWED.items():
        for path in sorted((root / package).rglob("*.py")):
            for imported, line in sorted(imported_packages(path)):
                if imported != package and imported not in allowed:
                    out.append(f"{path.relative_to(root)}:{line} imports {imported}")
    return out


def test_dependencies_point_one_way() -> None:
    assert violations(REPO) == []


def test_the_client_sdk_never_imports_the_server() -> None:
    """The SDK's fallback runs the device's parts (edge runtime, voice), never the gateway's."""
    assert "gateway" not in ALLOWED["client_sdk"] and "engine_gpu" not in ALLOWED["client_sdk"]
    assert ALLOWED["voice"] == frozenset({"llm_shared"})  # so client_sdk -> voice brings nothing more


def test_the_check_catches_a_backward_import(tmp_path: Path) -> None:
    """A lazy import from a lower layer into a higher one (the kind this tree used to have) is found."""
    for package in ALLOWED:
        (tmp_path / package).mkdir()
    (tmp_path / "engine_gpu" / "core.py").write_text(
        "def load():\n    from gateway.config import load_config\n    return load_config\n")
    (tmp_path / "llm_shared" / "x.py").write_text("import engine_edge.base\n")
    assert sorted(violations(tmp_path)) == ["engine_gpu/core.py:2 imports gateway", "llm_shared/x.py:1 imports engine_edge"]


TORCH_FREE = [
    "llm_shared", "llm_shared.contract", "llm_shared.errors", "llm_shared.models", "llm_shared.tokenizer",
    "llm_shared.textstream", "llm_shared.chat_template", "llm_shared.llamacpp_runtime", "engine_edge",
    "engine_edge.config",
    "engine_gpu.config", "engine_gpu.client", "engine_gpu.scheduler", "gateway.config",
    "engine_cluster.config", "engine_cluster.policy", "engine_cluster.pool", "gateway.tiers.build",
    "voice.config", "voice.audio", "voice.vad", "voice.asr", "voice.tts", "voice.pool", "voice.phrases", "voice.alignment",
    "voice.limits", "voice.service", "voice.tts_piper",
]


def test_importing_the_torch_free_parts_loads_no_torch_or_ray() -> None:
    # A fresh interpreter (this one may have imported torch already); modules in order, so the
    # first one that loads torch is named.
    code = ("import importlib, sys\n"
            f"for name in {TORCH_FREE!r}:\n"
            "    importlib.import_module(name)\n"
            "    if 'torch' in sys.modules:\n"
            "        sys.exit(f'importing {name} loaded torch')\n"
            # Ray too: the single-machine default never needs it (only [cluster] enabled joins).
            "    if 'ray' in sys.modules:\n"
            "        sys.exit(f'importing {name} loaded ray')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
