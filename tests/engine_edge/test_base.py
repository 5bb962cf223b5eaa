"""Shared edge-backend input checks and the lazy backend registry."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import engine_edge
from engine_edge.base import MAX_DRAFT_TOKENS, EdgeBackend, check_draft_request, check_prompt, check_token_ids
from llm_shared.errors import EmptyPromptError, InvalidRequestError, PromptTooLongError, UnknownModelError


def test_check_prompt_accepts_ints_and_numpy_ints() -> None:
    assert check_prompt([1, 2, 3], 10, 5) == (1, 2, 3)
    assert check_prompt(np.array([4, 9]), 10, 5) == (4, 9)


@pytest.mark.parametrize(
    ("prompt", "error", "param"),
    [
        ([], EmptyPromptError, "prompt"),
        ([1] * 6, PromptTooLongError, "prompt"),
        ([1, 10], InvalidRequestError, "prompt"),
        ([-1], InvalidRequestError, "prompt"),
        ([1, 2.0], InvalidRequestError, "prompt"),
        ([True], InvalidRequestError, "prompt"),
        ("hello", InvalidRequestError, "prompt"),
    ],
)
def test_check_prompt_rejects(prompt: object, error: type[Exception], param: str) -> None:
    with pytest.raises(error) as info:
        check_prompt(prompt, 10, 5)  # type: ignore[arg-type]
    assert info.value.param == param  # type: ignore[attr-defined]


@given(st.lists(st.one_of(st.integers(-3, 12), st.booleans(), st.floats(0, 9), st.just(None),
                          st.integers(0, 9).map(np.int64)), max_size=8))
def test_token_ids_are_accepted_exactly_when_each_is_an_integer_in_the_vocabulary(ids: list[object]) -> None:
    """The fast path for plain ints and the one-by-one check agree: the first bad id is named."""
    bad = [i for i, t in enumerate(ids)
           if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < 10]  # type: ignore[operator]
    if bad:
        with pytest.raises(InvalidRequestError, match=rf"p\[{bad[0]}\]"):
            check_token_ids(ids, 10, param="p")  # type: ignore[arg-type]
    else:
        checked = check_token_ids(ids, 10, param="p")  # type: ignore[arg-type]
        assert checked == tuple(int(t) for t in ids) and all(type(t) is int for t in checked)  # type: ignore[call-overload]


def test_too_long_prompt_says_the_limit() -> None:
    with pytest.raises(PromptTooLongError, match=r"6 tokens.*at most 5"):
        check_prompt([1] * 6, 10, 5)


def test_check_draft_request() -> None:
    assert check_draft_request([1, 2], 3, 10, 4) == (1, 2)
    with pytest.raises(InvalidRequestError) as info:
        check_draft_request([1, 2], 0, 10, 100)
    assert info.value.param == "k"
    with pytest.raises(InvalidRequestError):
        check_draft_request([1, 2], MAX_DRAFT_TOKENS + 1, 10, 1000)
    with pytest.raises(EmptyPromptError):
        check_draft_request([], 2, 10, 100)
    with pytest.raises(PromptTooLongError):
        check_draft_request([1, 2], 4, 10, 4)  # 2 context + 3 drafts to store > 4 cells
    with pytest.raises(InvalidRequestError):
        check_draft_request([1, 99], 2, 10, 100)


def test_unknown_backend_is_a_typed_error() -> None:
    with pytest.raises(UnknownModelError) as info:
        engine_edge.backend_class("tensorrt")
    assert info.value.param == "backend"
    assert "llama_cpp" in info.value.message


def test_registry_resolves_llama_cpp_lazily() -> None:
    # A fresh interpreter: importing the package must not import llama-cpp-python.
    code = (
        "import sys, engine_edge\n"
        "assert 'llama_cpp' not in sys.modules\n"
        "cls = engine_edge.backend_class('llama_cpp')\n"
        "assert 'llama_cpp' in sys.modules\n"
        "print(cls.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "LlamaCppBackend"
    assert issubclass(engine_edge.backend_class("llama_cpp"), EdgeBackend)
    assert set(engine_edge.BACKENDS) == {"llama_cpp", "onnx", "synthetic"}
