"""Tests, and every process they start, keep their model-load cache in a private folder.

Set before collection (processes inherit the environment), removed at the end: the suite never
reads or fills the user's ``~/.cache/rt-llm-gateway``, and one session's entries cannot make
another session's tests pass.

And no test module leaves the torch engine's matmul tuning behind: an engine built in this process
tunes process-wide forms for its shapes (``llm_shared.llama.matmul``), which a later module would
otherwise inherit (on a loaded machine even a tiny model's shapes get tuned one way or the other).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator

import pytest

from llm_shared.load_cache import CACHE_DIR_ENV

_ORIGINAL = os.environ.get(CACHE_DIR_ENV)


def pytest_configure(config: pytest.Config) -> None:
    os.environ[CACHE_DIR_ENV] = tempfile.mkdtemp(prefix="rtgw-test-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ[CACHE_DIR_ENV], ignore_errors=True)
    if _ORIGINAL is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = _ORIGINAL


@pytest.fixture(autouse=True, scope="module")
def _untuned_matmul_after_each_module() -> Iterator[None]:
    """After the module, not each test: a module's shared engine keeps its tuning for all its tests."""
    yield
    matmul = sys.modules.get("llm_shared.llama.matmul")  # only where a test loaded it: no torch import here
    if matmul is not None:
        matmul.reset()
