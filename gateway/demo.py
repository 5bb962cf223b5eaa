"""The demo page at ``/`` and the JS SDK it runs on, served as plain files.

No API key is needed for these routes: the page itself is public, its WebSocket authenticates.
Files are read from a web root laid out like the repository (``gateway/static/`` for the page,
``client_sdk/js/`` for the SDK): the checkout this module sits in, or ``GATEWAY_WEB_ROOT`` where
the gateway runs as an installed package (the Docker image copies both folders under
``/app/web``). Only plain files named by a plain file name are served: no path separators, no
leading dot, a known suffix, and the SDK's modules (``SDK_FILES``) alone from ``client_sdk/js``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

log = logging.getLogger(__name__)

WEB_ROOT_ENV = "GATEWAY_WEB_ROOT"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
SDK_FILES = frozenset({"rtgw.js", "rtgw-voice.js", "msgpack.js"})
INDEX = "index.html"
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
# the page and the SDK change with the server: browsers revalidate instead of running stale code
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def web_root(environ: Mapping[str, str] = os.environ) -> Path:
    """``GATEWAY_WEB_ROOT`` when set, else the repository this package was loaded from."""
    configured = environ.get(WEB_ROOT_ENV, "").strip()
    return Path(configured) if configured else Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class WebFiles:
    root: Path

    @property
    def static_dir(self) -> Path:
        return self.root / "gateway" / "static"

    @property
    def sdk_dir(self) -> Path:
        return self.root / "client_sdk" / "js"

    def static(self, name: str) -> Path | None:
        return _plain_file(self.static_dir, name)

    def sdk(self, name: str) -> Path | None:
        return _plain_file(self.sdk_dir, name) if name in SDK_FILES else None


def _plain_file(directory: Path, name: str) -> Path | None:
    """``directory / name`` when ``name`` is a plain file name of a served type and a regular
    file (not a link) sits there; None otherwise."""
    if not PLAIN_NAME.fullmatch(name) or Path(name).suffix not in CONTENT_TYPES:
        return None
    path = directory / name
    if path.is_symlink() or not path.is_file():
        return None
    return path


WEB_FILES = web.AppKey("web_files", WebFiles)


def _serve(path: Path | None) -> web.Response:
    if path is None:
        return web.json_response({"error": {"message": "not found", "type": "invalid_request_error",
                                             "code": "not_found", "param": None}}, status=404)
    try:
        body = path.read_bytes()
    except OSError as e:
        log.warning("cannot read %s: %s", path, e)
        return _serve(None)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPES[path.suffix], **HEADERS})


async def index(request: web.Request) -> web.Response:
    files = request.app[WEB_FILES]
    path = files.static(INDEX)
    if path is None:
        log.warning("the demo page is missing: no %s under %s (set %s)", INDEX, files.static_dir, WEB_ROOT_ENV)
    return _serve(path)


async def static_file(request: web.Request) -> web.Response:
    return _serve(request.app[WEB_FILES].static(request.match_info["name"]))


async def sdk_file(request: web.Request) -> web.Response:
    return _serve(request.app[WEB_FILES].sdk(request.match_info["name"]))


def add_demo_routes(app: web.Application, files: WebFiles | None = None) -> None:
    app[WEB_FILES] = files or WebFiles(web_root())
    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", static_file)
    app.router.add_get("/sdk/{name}", sdk_file)
