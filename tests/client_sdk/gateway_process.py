"""A real ``python -m gateway serve`` process for the client SDK tests (Python, JS, the demo page).

The shipped default config with the edge tier alone (the torch tier is not needed to test a
client, and starts slower), on a fixed port so a test can stop the server and start it again
at the same address, as a restarted deployment would be. Set-up and teardown have generous
timeouts: a busy 2-core machine may take a while to load the model.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 120.0  # SIGTERM drains: a turn in progress may finish first, slowly on a busy machine


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def write_config(directory: Path, *, api_keys: tuple[str, ...] = (), routing: str = "edge",
                 server: dict[str, Any] | None = None, tables: dict[str, dict[str, Any]] | None = None,
                 name: str = "gateway.toml") -> Path:
    """The shipped config, edge tier only unless ``routing`` says otherwise, loopback, keys as given;
    ``tables``: keys to set in other tables (``{"edge": {"backend": "synthetic"}, "limits": {...}}``)."""
    raw = tomllib.loads((REPO_ROOT / "configs" / "default.toml").read_text(encoding="utf-8"))
    raw["routing"]["default"] = routing
    raw["server"].update({"api_keys": list(api_keys), "api_keys_env": "", **(server or {})})
    for section, values in (tables or {}).items():
        raw.setdefault(section, {}).update(values)
    lines: list[str] = []
    for section, table in raw.items():
        if section == "models":
            for model_id, model in table.items():
                lines.append(f'[models."{model_id}"]')
                lines += [f"{k} = {_toml(v)}" for k, v in model.items()]
            continue
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml(v)}" for k, v in scalars.items()]
        for sub, subtable in table.items():
            if isinstance(subtable, dict):
                lines.append(f"[{section}.{sub}]")
                lines += [f"{k} = {_toml(v)}" for k, v in subtable.items()]
    path = directory / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class GatewayProcess:
    """``start()`` / ``stop()`` / ``restart()`` a gateway on one port; ``url`` and ``ws_url``.
    ``stop`` sends SIGTERM, so the gateway drains its sessions (each closed with a reconnect hint)
    before it exits."""

    def __init__(self, config: Path, log: Path, port: int | None = None) -> None:
        self.config = config
        self.log_path = log
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/realtime"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(self.config), "--host", "127.0.0.1",
             "--port", str(self.port)],
            cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self._proc.returncode}; log: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the gateway was not ready within {READY_TIMEOUT_S:.0f} s; log: {self.log_tail()}")

    def terminate(self) -> None:
        """Send SIGTERM and return at once: the gateway drains, then exits (``stop`` waits for that)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT_S)
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as a crashed host's would (no drain, no close frames)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return "(no log)"


@contextmanager
def serving(directory: Path, **config: Any) -> Iterator[GatewayProcess]:
    """A started gateway on ``write_config(directory, **config)`` (its log beside it), stopped after."""
    process = GatewayProcess(write_config(directory, **config), directory / "gateway.log")
    process.start()
    try:
        yield process
    finally:
        process.stop()
