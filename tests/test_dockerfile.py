"""The Dockerfile against the repository: every path it copies from the build context exists,
and the runtime image holds the demo page and the JS SDK where the gateway looks for them
(``GATEWAY_WEB_ROOT``, laid out as in the repository)."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from gateway.http.demo import SDK_FILES, WEB_ROOT_ENV, WebFiles, web_root

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, list[str]]]:
    """(instruction, arguments) per instruction, continuation lines joined, comments dropped."""
    out: list[tuple[str, list[str]]] = []
    pending = ""
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), shlex.split(rest)))
    return out


def context_copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY/ADD from the build context (not ``--from=``)."""
    copies = []
    for word, args in instructions():
        if word not in ("COPY", "ADD"):
            continue
        flags = [a for a in args if a.startswith("--")]
        paths = [a for a in args if not a.startswith("--")]
        if any(f.startswith("--from=") for f in flags):
            continue
        copies.append((paths[:-1], paths[-1]))
    return copies


def runtime_env() -> dict[str, str]:
    """ENV of the last stage (KEY=VALUE pairs)."""
    stages: list[dict[str, str]] = []
    for word, args in instructions():
        if word == "FROM":
            stages.append({})
        elif word == "ENV":
            stages[-1].update(a.split("=", 1) for a in args if "=" in a)
    return stages[-1]


def test_every_copied_path_exists() -> None:
    copies = context_copies()
    assert copies
    for sources, _ in copies:
        for source in sources:
            assert (REPO / source).exists(), f"the Dockerfile copies {source}, which is not in the repository"


def test_the_image_has_the_page_and_the_sdk_where_the_gateway_reads_them(tmp_path: Path) -> None:
    env = runtime_env()
    root = Path(env[WEB_ROOT_ENV])
    image = tmp_path / "image"
    for sources, destination in context_copies():  # replay the context copies into a fake image
        if not destination.startswith("/"):
            continue  # relative to the build stage's WORKDIR: the source tree pip installs from
        target = image / destination.lstrip("/")
        for source in sources:
            path = REPO / source
            into = target / path.name if destination.endswith("/") else target  # a dir's contents go to target
            if path.is_dir():
                shutil.copytree(path, into, dirs_exist_ok=True)
            else:
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, into)
    files = WebFiles(web_root({WEB_ROOT_ENV: str(image / root.relative_to("/"))}))
    for name in ("index.html", "app.js", "style.css"):
        assert files.static(name) is not None, name
    for name in SDK_FILES:  # every file the page may import
        assert files.sdk(name) is not None, name
