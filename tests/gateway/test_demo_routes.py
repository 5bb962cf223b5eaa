"""The demo page and the JS SDK files on a real loopback gateway (gateway/http/demo.py): served
without a key, with their content types and ``Cache-Control: no-cache``; anything but a plain
file name of the two folders is refused with 404, however the path is spelled."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest
from gateway_harness import KEY, running_gateway

from gateway.http.demo import SDK_FILES, WEB_ROOT_ENV, WebFiles, add_demo_routes, web_root

REPO = Path(__file__).resolve().parents[2]


async def raw_get(port: int, target: str) -> tuple[int, bytes]:
    """One GET with the request target exactly as written (clients would normalize ``..``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode("latin-1"))
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def test_page_assets_and_sdk_are_served_without_a_key() -> None:
    async with running_gateway(api_keys=(KEY,)) as gw, aiohttp.ClientSession(gw.http) as http:
        page = await http.get("/")
        assert page.status == 200
        assert page.headers["Content-Type"] == "text/html; charset=utf-8"
        assert page.headers["Cache-Control"] == "no-cache"
        html = await page.text()
        assert 'src="static/app.js"' in html and 'name="viewport"' in html
        for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
            asset = await http.get(f"/static/{name}")
            assert asset.status == 200 and asset.headers["Content-Type"].startswith(kind)
            assert await asset.read() == (REPO / "gateway" / "static" / name).read_bytes()
        for name in sorted(SDK_FILES):
            sdk = await http.get(f"/sdk/{name}")
            assert sdk.status == 200
            assert sdk.headers["Content-Type"] == "text/javascript; charset=utf-8"
            assert sdk.headers["Cache-Control"] == "no-cache"
            assert await sdk.read() == (REPO / "client_sdk" / "js" / name).read_bytes()
        # the API itself still wants the key
        assert (await http.get("/v1/models")).status == 401


def test_the_page_imports_the_served_sdk() -> None:
    script = (REPO / "gateway" / "static" / "app.js").read_text(encoding="utf-8")
    assert 'from "../sdk/rtgw.js"' in script  # /static/app.js -> /sdk/rtgw.js
    assert 'from "../sdk/rtgw-voice.js"' in script  # Talk's VoiceSession
    # every module the page loads, and every module those load, is one the gateway serves
    imported = set(re.findall(r'from "\.\./sdk/([^"]+)"', script))
    for name in sorted(SDK_FILES):
        module = (REPO / "client_sdk" / "js" / name).read_text(encoding="utf-8")
        imported |= set(re.findall(r'from "\./([^"]+)"', module))
    assert imported and imported <= SDK_FILES, imported - SDK_FILES


REFUSED = [
    "/static/../http_api.py",
    "/static/..%2Fhttp_api.py",
    "/static/%2e%2e%2f%2e%2e%2fpyproject.toml",
    "/static/..%5C..%5Cpyproject.toml",
    "/static/%2Fetc%2Fpasswd",
    "/static/..",
    "/static/.",
    "/static/.hidden.js",
    "/static/missing.css",
    "/static/app.js%00.png",
    "/static/index.html.bak",
    "/static/",
    "/sdk/..%2Fpython%2Frtgw%2F__init__.py",
    "/sdk/%2e%2e%2f%2e%2e%2fgateway%2Fdemo.py",
    "/sdk/rtgw.d.ts",
    "/sdk/rtgw-voice.d.ts",
    "/sdk/package.json",
    "/sdk/README.md",
    "/sdk/test",
    "/sdk/index.html",
    "/static/../../../../etc/passwd",
]


async def test_traversal_and_unknown_names_are_404() -> None:
    async with running_gateway() as gw:
        for target in REFUSED:
            status, body = await raw_get(gw.port, target)
            assert status == 404, (target, status, body[:200])
            assert b"root:" not in body and b"[project]" not in body and b"import" not in body


def test_web_root_from_the_environment_or_the_checkout(tmp_path: Path) -> None:
    assert web_root({}) == REPO
    assert web_root({WEB_ROOT_ENV: str(tmp_path)}) == tmp_path
    assert web_root({WEB_ROOT_ENV: "  "}) == REPO


def test_only_plain_regular_files_are_served(tmp_path: Path) -> None:
    static = tmp_path / "gateway" / "static"
    sdk = tmp_path / "client_sdk" / "js"
    static.mkdir(parents=True)
    sdk.mkdir(parents=True)
    (static / "index.html").write_text("<p>hi</p>")
    (static / "dir.js").mkdir()
    (static / "link.js").symlink_to(REPO / "gateway" / "demo.py")
    (static / "notes.txt").write_text("not a served type")
    (sdk / "rtgw.js").write_text("export {};")
    (sdk / "other.js").write_text("export {};")
    files = WebFiles(tmp_path)
    assert files.static("index.html") == static / "index.html"
    assert files.sdk("rtgw.js") == sdk / "rtgw.js"
    for name in ("dir.js", "link.js", "notes.txt", "missing.js", "../static/index.html", ".index.html", ""):
        assert files.static(name) is None, name
    assert files.sdk("other.js") is None
    assert files.sdk("msgpack.js") is None  # listed, but not there


async def test_a_configured_root_serves_its_own_files(tmp_path: Path) -> None:
    static = tmp_path / "gateway" / "static"
    static.mkdir(parents=True)
    (static / "index.html").write_text("<p>from the web root</p>")
    app = aiohttp.web.Application()
    add_demo_routes(app, WebFiles(tmp_path))
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            assert await (await http.get("/")).text() == "<p>from the web root</p>"
            assert (await http.get("/sdk/rtgw.js")).status == 404
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("name", ["index.html", "app.js", "style.css"])
def test_shipped_page_files_exist(name: str) -> None:
    assert WebFiles(REPO).static(name) is not None
