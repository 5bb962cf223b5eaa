"""The tuned projection product equals ``F.linear`` whichever form a shape was tuned to."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llm_shared.llama import matmul
from llm_shared.load_cache import LoadCache


@pytest.fixture(autouse=True)
def untuned() -> None:
    matmul.reset()
    yield
    matmul.reset()


def test_untuned_is_plain_linear_and_both_forms_agree() -> None:
    w = torch.randn(96, 40)
    x = torch.randn(1, 5, 40)
    assert torch.equal(matmul.linear(x, w), F.linear(x, w))
    matmul._TRANSPOSED.add((96, 40, torch.float32, 8))  # force the transposed form for 5..8 rows
    got = matmul.linear(x, w)
    assert got.shape == (1, 5, 96)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    one = torch.randn(1, 1, 40)  # a single row always takes F.linear
    assert torch.equal(matmul.linear(one, w), F.linear(one, w))


def test_tune_records_only_shapes_it_timed() -> None:
    weights = [torch.randn(64, 32), torch.randn(16, 32)]
    ratios = matmul.tune(weights)
    assert set(ratios) == {"64x32", "16x32"} and all(r > 0 for r in ratios.values())
    assert {(o, i) for o, i, _, _ in matmul._TRANSPOSED} <= {(64, 32), (16, 32)}


def test_tuning_decisions_are_reused_from_the_load_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = [torch.randn(64, 32), torch.randn(16, 32)]
    cache = LoadCache(tmp_path)
    ratios = matmul.tune(weights, cache=cache)
    decided = set(matmul._TRANSPOSED)
    assert cache.outcomes == {"matmul": "miss"}
    matmul.reset()

    def no_timing(fn: object, repeats: int = 3) -> float:
        raise AssertionError("timed again on a cache hit")

    monkeypatch.setattr(matmul, "_median_seconds", no_timing)
    again = LoadCache(tmp_path)
    assert matmul.tune(weights, cache=again) == ratios
    assert matmul._TRANSPOSED == decided and again.outcomes == {"matmul": "hit"}
    with pytest.raises(AssertionError, match="timed again"):  # other shapes: another entry
        matmul.tune([torch.randn(48, 32)], cache=again)


def test_a_traced_model_takes_the_plain_form_whatever_this_cpu_tuned() -> None:
    """The tuned choice is this CPU's and branches on the row count: an exported graph (ONNX goes
    through torch.export) must not carry it, nor fail on it because an engine in the same process
    tuned its shapes first (it did: the ONNX export's tests failed after the torch engine's)."""
    w = torch.randn(96, 40)
    matmul._TRANSPOSED.update({(96, 40, torch.float32, bucket) for bucket in matmul.ROW_BUCKETS})

    class Projection(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return matmul.linear(x, w)

    x = torch.randn(1, 5, 40)
    rows = torch.export.Dim("rows", max=512)
    exported = torch.export.export(Projection(), (x,), dynamic_shapes={"x": {1: rows}})
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert not any("mm" in t and "linear" not in t for t in targets), targets
    for n in (1, 3, 40):
        y = torch.randn(1, n, 40)
        torch.testing.assert_close(exported.module()(y), F.linear(y, w), rtol=1e-5, atol=1e-5)
