"""Tests, and every process they start, keep their model-load cache in a private folder.

Set before collection (processes inherit the environment), removed at the end: the suite never
reads or fills the user's ``~/.cache/rt-llm-gateway``, and one session's entries cannot make
another session's tests pass.
"""

from __future__ import annotations

import os
import shutil
import tempfile

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
