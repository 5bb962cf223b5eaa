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
    "llm_shared.token_bucket", "voice.service", "voice.tts_piper",
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


# ----- between modules: no import circles, and a gateway in floors -------------------------------

# Where each import root lives: the packages at the top of the repository, and the Python SDK.
SOURCE_ROOTS = (REPO, REPO / "client_sdk" / "python")
MODULE_PACKAGES = (*sorted(OURS - {"client_sdk"}), "rtgw")

# The gateway's rooms, bottom first: a module may import its own room and the floors below,
# never one above or a room beside it on the same floor. The config is at the bottom, so
# nothing points up to it; the process side (start, workers, drain) is at the top.
GATEWAY_FLOORS: tuple[tuple[str, ...], ...] = (
    ("config",),  # every [table] of the gateway's config
    ("metrics", "json_wire"),  # leaves: Prometheus series, JSON on the wire
    ("auth",),  # API keys and origins
    ("shaping",),  # grammars and tool-call parsing for turns (a key's compile budget refuses as auth's limits do)
    ("limits", "cascade"),  # per-key limits; routing and the cascade
    ("tiers",),  # building and supervising the engine tiers
    ("context_fit",),  # a conversation cut to the serving tier's context
    ("turns",),  # one generation, from admission to its last token, for either API
    ("ws",),  # the Realtime session and its connection
    ("http",),  # the aiohttp app: state, OpenAI HTTP routes, demo page, model files
    ("process",),  # start, serve, workers on one port, drain
    ("tools", "__main__"),  # command-line entry points
)


def module_files(root: Path, top: str) -> dict[str, Path]:
    """Module name -> file for the package ``top`` under ``root``."""
    found = {}
    for path in sorted((root / top).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def import_graph(roots: tuple[Path, ...], packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports: every import (top level, in functions, under
    TYPE_CHECKING). ``from a.b import c`` counts as importing ``a.b.c`` when that is a module, else
    ``a.b``; a parent package whose ``__init__`` Python runs on the way is not counted."""
    files: dict[str, Path] = {}
    for root in roots:
        for top in packages:
            if (root / top / "__init__.py").exists():
                files.update(module_files(root, top))
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
        resolved = set()
        for target in targets:
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                resolved.add(target)
        graph[name] = resolved
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def gateway_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "gateway" and len(parts) > 1 else None


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    floor = {room: level for level, rooms in enumerate(GATEWAY_FLOORS) for room in rooms}
    out = []
    for module, imported in sorted(graph.items()):
        room = gateway_room(module)
        if room is None:
            continue
        if room not in floor:
            out.append(f"{module} is in no floor of GATEWAY_FLOORS")
            continue
        for target in sorted(imported):
            other = gateway_room(target)
            if other is None or other == room:
                continue
            if other not in floor or floor[other] >= floor[room]:
                out.append(f"{module} ({room}) imports {target} ({other}), which is not below it")
    return out


def test_no_import_circles_between_modules() -> None:
    assert circles(import_graph(SOURCE_ROOTS, MODULE_PACKAGES)) == []


def test_gateway_rooms_import_only_floors_below() -> None:
    assert floor_violations(import_graph(SOURCE_ROOTS, MODULE_PACKAGES)) == []


def test_the_checks_catch_a_planted_circle_and_an_upward_import(tmp_path: Path) -> None:
    """A circle hidden behind TYPE_CHECKING and a relative import, and a gateway module that
    reaches up a floor, are each found."""
    for package in ("llm_shared", "gateway", "gateway/config", "gateway/ws"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "llm_shared" / "a.py").write_text("from llm_shared import b\n")
    (tmp_path / "llm_shared" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n")
    (tmp_path / "llm_shared" / "c.py").write_text("def f():\n    import llm_shared.a\n")
    (tmp_path / "gateway" / "config" / "server.py").write_text("from gateway.ws.session import Session\n")
    (tmp_path / "gateway" / "ws" / "session.py").write_text("from gateway.config.server import X\n")
    graph = import_graph((tmp_path,), ("llm_shared", "gateway"))
    assert circles(graph) == [["gateway.config.server", "gateway.ws.session"],
                              ["llm_shared.a", "llm_shared.b", "llm_shared.c"]]
    assert floor_violations(graph) == [
        "gateway.config.server (config) imports gateway.ws.session (ws), which is not below it"]
    (tmp_path / "gateway" / "config" / "server.py").write_text("X = 1\n")
    graph = import_graph((tmp_path,), ("llm_shared", "gateway"))
    assert floor_violations(graph) == [] and circles(graph) == [["llm_shared.a", "llm_shared.b", "llm_shared.c"]]
