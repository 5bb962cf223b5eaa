"""The demo page at ``/`` and the JS SDK it runs on, served as plain files.

No API key is needed for these routes: the page itself is public, its WebSocket authenticates.
Files are read from a web root laid out like the repository (``gateway/static/`` for the page,
``client_sdk/js/`` for the SDK): the checkout this module sits in, or ``GATEWAY_WEB_ROOT`` where
the gateway runs as an installed package (the Docker image copies both folders under
``/app/web``). Only plain files named by a plain file name are served: no path separators, no
leading dot, a known suffix, and the SDK's modules (``SDK_FILES``) alone from ``client_sdk/js``.

Third-party browser code comes from npm, never a CDN: ``gateway/static/vendor/package-lock.json``
pins each package with its integrity hash, ``make install`` runs ``npm ci`` there, and
``/vendor/<name>`` serves the few files named in ``VENDOR_FILES`` out of its ``node_modules``
(llama.cpp in WebAssembly for the SDK's on-device engine; markdown and its sanitizer for the
page). With ``server.cross_origin_isolation`` the page is sent with COOP ``same-origin`` and COEP
``require-corp``, which gives it ``SharedArrayBuffer`` and so threads for the in-browser model;
every file here is same-origin (and says ``Cross-Origin-Resource-Policy: same-origin``), so
nothing the page loads is blocked by it.
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
    ".wasm": "application/wasm",
}
SDK_FILES = frozenset({"rtgw.js", "rtgw-voice.js", "rtgw-device.js", "model-store.js", "gguf.js", "msgpack.js"})
# served name -> the file inside gateway/static/vendor/node_modules (versions: its package-lock.json)
VENDOR_FILES = {
    "wllama.js": "@wllama/wllama/esm/index.js",
    "wllama.wasm": "@wllama/wllama/esm/wasm/wllama.wasm",
    "marked.js": "marked/lib/marked.esm.js",
    "purify.js": "dompurify/dist/purify.es.mjs",
}
INDEX = "index.html"
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
# the page and the SDK change with the server: browsers revalidate instead of running stale code
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Cross-Origin-Resource-Policy": "same-origin"}
ISOLATION_HEADERS = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp"}


def web_root(environ: Mapping[str, str] = os.environ) -> Path:
    """``GATEWAY_WEB_ROOT`` when set, else the repository this package was loaded from."""
    configured = environ.get(WEB_ROOT_ENV, "").strip()
    return Path(configured) if configured else Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class WebFiles:
    root: Path

    @property
    def static_dir(self) -> Path:
        return self.root / "gateway" / "static"

    @property
    def sdk_dir(self) -> Path:
        return self.root / "client_sdk" / "js"

    @property
    def vendor_dir(self) -> Path:
        return self.static_dir / "vendor" / "node_modules"

    def static(self, name: str) -> Path | None:
        return _plain_file(self.static_dir, name)

    def sdk(self, name: str) -> Path | None:
        return _plain_file(self.sdk_dir, name) if name in SDK_FILES else None

    def vendor(self, name: str) -> Path | None:
        """A file of ``VENDOR_FILES``, when ``npm ci`` put it there (``make install``)."""
        relative = VENDOR_FILES.get(name)
        if relative is None:
            return None
        path = self.vendor_dir / relative
        return path if path.is_file() else None


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
ISOLATED = web.AppKey("cross_origin_isolated", bool)  # the page is sent with COOP/COEP


def _serve(path: Path | None, *, content_type: str | None = None, isolate: bool = False) -> web.Response:
    if path is None:
        return web.json_response({"error": {"message": "not found", "type": "invalid_request_error",
                                             "code": "not_found", "param": None}}, status=404)
    try:
        body = path.read_bytes()
    except OSError as e:
        log.warning("cannot read %s: %s", path, e)
        return _serve(None)
    headers = {"Content-Type": content_type or CONTENT_TYPES[path.suffix], **HEADERS}
    if isolate:
        headers.update(ISOLATION_HEADERS)
    return web.Response(body=body, headers=headers)


async def index(request: web.Request) -> web.Response:
    files = request.app[WEB_FILES]
    path = files.static(INDEX)
    if path is None:
        log.warning("the demo page is missing: no %s under %s (set %s)", INDEX, files.static_dir, WEB_ROOT_ENV)
    return _serve(path, isolate=request.app[ISOLATED])


async def static_file(request: web.Request) -> web.Response:
    return _serve(request.app[WEB_FILES].static(request.match_info["name"]))


async def sdk_file(request: web.Request) -> web.Response:
    return _serve(request.app[WEB_FILES].sdk(request.match_info["name"]))


async def vendor_file(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    files = request.app[WEB_FILES]
    path = files.vendor(name)
    if path is None and name in VENDOR_FILES:
        log.warning("%s is missing under %s: run make install (npm ci in gateway/static/vendor)", name,
                    files.vendor_dir)
    return _serve(path, content_type=CONTENT_TYPES[Path(name).suffix] if path is not None else None)


def add_demo_routes(app: web.Application, files: WebFiles | None = None, *, isolate: bool = True) -> None:
    app[WEB_FILES] = files or WebFiles(web_root())
    app[ISOLATED] = isolate
    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", static_file)
    app.router.add_get("/sdk/{name}", sdk_file)
    app.router.add_get("/vendor/{name}", vendor_file)
