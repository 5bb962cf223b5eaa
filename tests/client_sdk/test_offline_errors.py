"""The on-device fallback fails loudly: whatever keeps the local model from answering (its runtime
not installed, a model file that does not load) raises ``OfflineModelError`` naming the cause and
the fix, from iterating the turn and from its result; never an empty answer."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rtgw import Backoff, OfflineConfig, OfflineModelError, RealtimeClient

NOWHERE = "http://127.0.0.1:9"  # nothing listens: every turn goes to the device


def offline_client(config: OfflineConfig) -> RealtimeClient:
    return RealtimeClient(NOWHERE, connect_timeout=2, offline=config, retry_online_s=3600.0,
                          backoff=Backoff(attempts=1))


async def test_a_model_file_that_does_not_load_raises_naming_it(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 64)
    async with offline_client(OfflineConfig(model_path=broken)) as client:
        turn = await client.send("Hello?")
        with pytest.raises(OfflineModelError, match=r"could not load from .*broken\.gguf"):
            async for _ in turn:
                pass
        with pytest.raises(OfflineModelError):
            await turn.result()
        missing = await client.send("And now?")  # the client goes on; the next turn says it again
        with pytest.raises(OfflineModelError, match="could not load"):
            await missing.text()


def test_without_the_edge_runtime_the_error_names_the_install_command() -> None:
    """As an app that installed the SDK without its [offline] extra sees it."""
    script = textwrap.dedent("""
        import asyncio, sys
        for name in ("engine_edge", "llm_shared"):
            sys.modules[name] = None  # as if not installed: importing it raises ImportError
        from rtgw import Backoff, OfflineConfig, OfflineModelError, RealtimeClient

        async def main():
            async with RealtimeClient("http://127.0.0.1:9", connect_timeout=2, offline=OfflineConfig(),
                                      backoff=Backoff(attempts=1)) as client:
                turn = await client.send("Hello?")
                try:
                    async for _ in turn:
                        pass
                except OfflineModelError as e:
                    print("RAISED", e)

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RAISED the on-device model needs the edge runtime" in out.stdout
    assert "pip install 'rtgw-client[offline]'" in out.stdout
