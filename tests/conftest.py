"""Tests, and every process they start, keep their model-load cache in a private folder.

Set before collection (processes inherit the environment), removed at the end: the suite never
reads or fills the user's ``~/.cache/rt-llm-gateway``, and one session's entries cannot make
another session's tests pass.

And Triton is not loaded in the main test process: torch (``torch.export``, the ONNX exports) and
transformers import it whenever it is installed, and at exit its extension (nanobind) prints a
screen of "leaked function" reports that would end every run's output. No test here needs it in
this process: the kernels' tests run under Triton's interpreter in a child pytest
(``tests/engine_gpu/test_attention_triton.py``, which sets ``TRITON_INTERPRET=1``, where this
block is off). It is still found (``find_spec``), so that child runs; importing it fails as if it
were absent, which torch and transformers take in their stride.

And no test module leaves the torch engine's matmul tuning behind: an engine built in this process
tunes process-wide forms for its shapes (``llm_shared.llama.matmul``), which a later module would
otherwise inherit (on a loaded machine even a tiny model's shapes get tuned one way or the other).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from types import ModuleType

import pytest

from llm_shared.load_cache import CACHE_DIR_ENV

_ORIGINAL = os.environ.get(CACHE_DIR_ENV)


class _TritonAbsentHere(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``triton`` (so a test can tell it is installed) but refuses to load it."""

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] != "triton":
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        raise ImportError(f"{spec.name} is not loaded in the main test process (tests/conftest.py)", name=spec.name)

    def exec_module(self, module: ModuleType) -> None:  # never reached: create_module refuses
        raise ImportError(module.__name__)


if os.environ.get("TRITON_INTERPRET") != "1" and "triton" not in sys.modules:
    sys.meta_path.insert(0, _TritonAbsentHere())


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
