"""The voice package's helper processes (the flite children, piper): the environment they run
with, and the pool that lends them out one phrase at a time.

They get the few variables a program needs to run and read text (``PATH``, locale, ``HOME``,
``TMPDIR``), never the gateway's own: ``ENGINE_CORE_SECRET`` (the engine core's shared secret,
which the worker parent puts in its environment for the core and the workers to inherit), API keys
from ``GATEWAY_API_KEYS``, a Redis URL with its password. A synthesizer that misbehaves, or a
text that makes one misbehave, has nothing of the server's to show.
"""

from __future__ import annotations

import logging
import os
import queue
from collections.abc import Callable, Mapping
from typing import Generic, Protocol, TypeVar

PASSED = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "HOME", "TMPDIR")


def child_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What a voice program's process is given of ``environ``."""
    return {k: environ[k] for k in PASSED if k in environ}


class Child(Protocol):
    def kill(self) -> None: ...


C = TypeVar("C", bound=Child)
T = TypeVar("T")
log = logging.getLogger(__name__)


class ChildPool(Generic[C]):
    """Long-lived helper processes, each doing one job at a time: ``run`` takes an idle one (waiting
    at most ``timeout_s``: as many callers at once as children), and one whose job raises one of
    ``failures`` is killed and replaced by ``start`` (the pool shrinks when no replacement starts:
    a killed child never goes back, or the next caller would wait on it). ``name`` says whose
    processes they are in the errors: "no {name} process free", "{name} did not speak: ..."."""

    def __init__(self, name: str, start: Callable[[], C], timeout_s: float,
                 failures: tuple[type[BaseException], ...] = (RuntimeError,)) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._start = start
        self._failures = failures
        self._idle: queue.Queue[C] = queue.Queue()

    def add(self, child: C) -> None:
        self._idle.put(child)

    def idle(self) -> list[C]:
        """The children free now (for tests and diagnostics)."""
        return list(self._idle.queue)

    def run(self, job: Callable[[C], T]) -> T:
        """``job`` on an idle child; RuntimeError when none is free in time or the job fails."""
        try:
            child: C | None = self._idle.get(timeout=self.timeout_s)
        except queue.Empty:
            raise RuntimeError(f"no {self.name} process free within {self.timeout_s:g} s") from None
        try:
            return job(child)
        except self._failures as e:
            child.kill()  # stuck, dead or lying: a fresh one takes its place
            child = self._replacement()
            raise RuntimeError(f"{self.name} did not speak: {e or 'timed out'}") from e
        finally:
            if child is not None:
                self._idle.put(child)

    def _replacement(self) -> C | None:
        try:
            return self._start()
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
            log.error("a %s process could not be started again: %s", self.name, e)
            return None

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                break
