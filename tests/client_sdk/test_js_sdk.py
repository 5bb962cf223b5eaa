"""The JS SDK (client_sdk/js) under Node's own test runner.

``test_js_sdk_against_gateway`` starts a real gateway process (edge tier, one API key) and a
small control server beside it (``POST /restart`` restarts the gateway on the same port, with
SIGTERM, so the gateway drains first, and answers once it is ready again), then runs ``node --test`` on the SDK's tests with
``RTGW_URL``, ``RTGW_KEY`` and ``RTGW_CONTROL_URL`` set. The codec, client-logic and voice-part
tests need no gateway and run in the default (fast) selection; the SDK's voice in a browser is
``tests/gateway/test_demo_voice.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from gateway_process import REPO_ROOT, GatewayProcess, write_config

JS_DIR = REPO_ROOT / "client_sdk" / "js"
NODE = shutil.which("node")
KEY = "sk-js-sdk-test-key"
# Below the test's own pytest timeout, so that a hang reports node's output so far (which test, which step).
NODE_TIMEOUT_S = 480  # the model on a busy 2-core CPU; the whole file takes ~10 s on a quiet one

needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed (make system-deps)")


def node_command(*tests: str) -> list[str]:
    """``node --test`` on the files, one at a time; Node 20 needs its WebSocket flag."""
    assert NODE is not None
    version = subprocess.run([NODE, "--version"], capture_output=True, text=True, check=True).stdout
    major = int(version.strip().lstrip("v").split(".")[0])
    flags = ["--experimental-websocket"] if major < 22 else []
    return [NODE, *flags, "--test", "--test-concurrency=1", *(str(JS_DIR / "test" / t) for t in tests)]


def run_node(tests: tuple[str, ...], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(node_command(*tests), cwd=REPO_ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=timeout)


@contextmanager
def control_server(gateway: GatewayProcess) -> Iterator[str]:
    """``POST /restart``: 200 once the gateway serves again, 500 with the reason if it does not."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != "/restart":
                self.send_error(404)
                return
            try:
                gateway.restart()
                status, body = 200, b"restarted"
            except RuntimeError as e:
                status, body = 500, str(e).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@needs_node
def test_js_sdk_pure_parts() -> None:
    """The msgpack codec, the client's logic over a scripted socket and its voice parts (the
    downsampler, the player on a fake AudioContext, barge-in): no gateway, no browser, fast."""
    done = run_node(("msgpack.test.mjs", "client.test.mjs", "voice.test.mjs", "device.test.mjs", "no_dom.test.mjs"), {},
                    timeout=120)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


@pytest.mark.model
@pytest.mark.timeout(NODE_TIMEOUT_S + 120)
@needs_node
def test_js_sdk_against_gateway(tmp_path: Path) -> None:
    # The restart test drains the gateway mid-answer: a short reconnect spread, and no drain timeout
    # that a slow machine could reach before the answer ends.
    drain = {"drain_reconnect_spread_ms": 500, "drain_timeout_s": 600}
    gateway = GatewayProcess(write_config(tmp_path, api_keys=(KEY,), server=drain), tmp_path / "gateway.log")
    gateway.start()
    try:
        with control_server(gateway) as control:
            env = {"RTGW_URL": gateway.url, "RTGW_KEY": KEY, "RTGW_CONTROL_URL": control}
            try:
                done = run_node(("gateway.test.mjs",), env, timeout=NODE_TIMEOUT_S)
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
                pytest.fail(f"node --test ran past {NODE_TIMEOUT_S} s\n{out[-6000:]}\n"
                            f"gateway log:\n{gateway.log_tail()}")
    finally:
        gateway.stop()
    if done.returncode != 0:
        pytest.fail(f"node --test failed ({done.returncode}):\n{done.stdout[-8000:]}\n{done.stderr[-3000:]}\n"
                    f"gateway log:\n{gateway.log_tail()}")
