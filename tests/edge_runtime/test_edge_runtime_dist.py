"""The edge runtime distribution (edge_runtime/, rtgw-edge) lists exactly the modules of llm_shared
and engine_edge that need neither torch nor onnxruntime: a module added to either package lands in
the runtime, or says by what it imports why it does not. (That the built wheel installs and runs
without torch: tests/client_sdk/test_offline_install.py.)"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("llm_shared", "engine_edge")
HEAVY = {"torch", "onnx", "onnxruntime", "onnxscript", "transformers", "safetensors"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function (a lazy import counts)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return out


def torch_free_modules() -> set[str]:
    files = {module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}
    deps = {name: imports(path) for name, path in files.items()}
    heavy: set[str] = set()
    changed = True
    while changed:  # heavy: imports a heavy library, or a module of ours that is heavy
        changed = False
        for name, imported in deps.items():
            if name not in heavy and any(i.split(".")[0] in HEAVY or i in heavy for i in imported):
                heavy.add(name)
                changed = True
    for name, path in files.items():  # a subpackage whose every module needs torch goes with them
        members = [m for m in files if m.startswith(name + ".")]
        if path.name == "__init__.py" and name not in PACKAGES and members and set(members) <= heavy:
            heavy.add(name)
    return {str(files[name].relative_to(REPO)) for name in files if name not in heavy}


def test_the_runtime_lists_every_torch_free_module_and_nothing_else() -> None:
    config = tomllib.loads((REPO / "edge_runtime" / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(config["tool"]["hatch"]["build"]["targets"]["wheel"]["hooks"]["custom"]["modules"])
    expected = torch_free_modules()
    assert listed == expected, (f"missing from edge_runtime/pyproject.toml: {sorted(expected - listed)}; "
                                f"listed but needing torch or onnxruntime: {sorted(listed - expected)}")
    assert "engine_edge/llama_cpp_backend.py" in listed and "llm_shared/llama/model.py" not in listed


def test_the_server_takes_the_two_packages_from_the_runtime() -> None:
    root = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert any(dep.startswith("rtgw-edge") for dep in root["project"]["dependencies"])
    assert not set(PACKAGES) & {p.rstrip("*") for p in root["tool"]["setuptools"]["packages"]["find"]["include"]}
