"""Model files for the device (``/v1/models/{id}/file``), the vendored browser packages and the
demo page's cross-origin isolation, against the gateway in-process (a fake engine; the file is the
embedded model's real GGUF)."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import replace

import aiohttp
import pytest
from fake_engine import FakeEngine
from gateway_harness import KEY, make_config, running_gateway

from gateway.http.demo import VENDOR_FILES
from gateway.process.server import create_app, start_server
from llm_shared.modelfile import default_gguf_path

pytestmark = pytest.mark.model
AUTH = {"Authorization": f"Bearer {KEY}"}
FILE = "/v1/models/smollm2-135m/file"


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    return default_gguf_path().read_bytes()


async def test_the_model_file_is_served_whole_in_ranges_and_revalidated(model_bytes: bytes) -> None:
    digest = hashlib.sha256(model_bytes).digest()
    async with running_gateway(api_keys=(KEY,)) as gw, aiohttp.ClientSession(gw.http) as http:
        async with http.get(FILE) as refused:
            assert refused.status == 401
        async with http.get(FILE, headers=AUTH) as whole:
            assert whole.status == 200
            assert int(whole.headers["Content-Length"]) == len(model_bytes)
            assert whole.headers["Repr-Digest"] == "sha-256=:" + base64.b64encode(digest).decode() + ":"
            assert whole.headers["Accept-Ranges"] == "bytes"
            assert "private" in whole.headers["Cache-Control"]
            etag = whole.headers["ETag"]
            assert hashlib.sha256(await whole.read()).digest() == digest
        async with http.get(FILE, headers={**AUTH, "Range": "bytes=1000-1999"}) as part:
            assert part.status == 206
            assert part.headers["Content-Range"] == f"bytes 1000-1999/{len(model_bytes)}"
            assert await part.read() == model_bytes[1000:2000]
        async with http.get(FILE, headers={**AUTH, "Range": "bytes=1000-", "If-Range": etag}) as resumed:
            assert resumed.status == 206 and await resumed.read() == model_bytes[1000:]
        async with http.get(FILE, headers={**AUTH, "If-None-Match": etag}) as unchanged:
            assert unchanged.status == 304
        async with http.get("/v1/models/nope/file", headers=AUTH) as unknown:
            assert unknown.status == 404
            assert (await unknown.json())["error"]["code"] == "model_not_downloadable"
        async with http.get("/v1/models/smollm2-135m-edge", headers=AUTH) as card:
            device = (await card.json())["x_device"]
        assert device == {"model": "smollm2-135m", "url": FILE, "format": "gguf", "bytes": len(model_bytes),
                          "sha256": digest.hex(), "family": "smollm2", "context_length": 0}


async def test_a_model_not_marked_downloadable_is_not_served() -> None:
    config = make_config()
    models = {k: replace(m, downloadable=False) for k, m in config.models.items()}
    app = create_app(replace(config, models=models), {"edge": FakeEngine()})
    running = await start_server(app)
    try:
        async with aiohttp.ClientSession(running.url) as http:
            async with http.get(FILE) as refused:
                assert refused.status == 404
                assert "not downloadable" in (await refused.json())["error"]["message"]
            async with http.get("/v1/models/smollm2-135m-edge") as card:
                assert "x_device" not in await card.json()
    finally:
        await running.stop()


@pytest.mark.parametrize("isolated", [True, False])
async def test_the_page_is_cross_origin_isolated_when_configured(isolated: bool) -> None:
    async with running_gateway(cross_origin_isolation=isolated) as gw, aiohttp.ClientSession(gw.http) as http:
        async with http.get("/") as page:
            assert page.status == 200
            assert (page.headers.get("Cross-Origin-Opener-Policy") == "same-origin") is isolated
            assert (page.headers.get("Cross-Origin-Embedder-Policy") == "require-corp") is isolated
        async with http.get("/sdk/rtgw-device.js") as sdk:
            assert sdk.status == 200 and sdk.headers["Cross-Origin-Resource-Policy"] == "same-origin"


async def test_the_vendored_browser_packages_are_served_from_the_origin() -> None:
    types = {".js": "text/javascript; charset=utf-8", ".wasm": "application/wasm"}
    async with running_gateway() as gw, aiohttp.ClientSession(gw.http) as http:
        for name in VENDOR_FILES:
            async with http.get(f"/vendor/{name}") as response:
                assert response.status == 200, f"{name}: run make install (npm ci in gateway/static/vendor)"
                assert response.headers["Content-Type"] == types[name[name.rindex("."):]]
                assert len(await response.read()) > 10_000
        for name in ("package.json", "../package-lock.json", "index.js"):
            async with http.get(f"/vendor/{name}") as response:
                assert response.status == 404, name
        async with http.get("/vendor/wllama.js") as wllama:
            body = await wllama.text()
        # the CDN build is only named in wllama's source; rtgw-device.js switches it off (setCompat(null))
        assert "cdn.jsdelivr.net" in body
