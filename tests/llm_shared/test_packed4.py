"""The 4-bit blocks a CPU model keeps are the GGUF's weights, and the tuned product goes through
them only where ``tune`` timed them faster.

Independently of ``packed4``'s own arithmetic: the ``gguf`` library dequantizes the file's tensors
(and quantizes synthetic Q4_0 and Q4_1 ones), and the model's dequantized projections (Q and K
un-permuted, Q/K/V and gate/up stacked) are what the kept blocks multiply by.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llm_shared.llama import matmul, packed4
from llm_shared.llama.loader import load_gguf
from llm_shared.llama.packed4 import Blocks4, Packed4
from llm_shared.llama.weight_cache import PACKED_FILE, read_model
from llm_shared.load_cache import CorruptEntry, LoadCache
from llm_shared.modelfile import default_gguf_path

pytestmark = pytest.mark.skipif(not packed4.available(), reason="this torch has no 4-bit CPU kernel")


@pytest.fixture(autouse=True)
def untuned() -> None:
    matmul.reset()
    yield
    matmul.reset()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_blocks_are_the_numbers_gguf_dequantizes(kind: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((32, 96)) * 0.05 + rng.uniform(-0.2, 0.2, (32, 1))).astype(np.float32)
    raw = quantize(values, qtype)
    blocks = Blocks4.from_gguf(raw, qtype, (32, 96))
    assert blocks is not None and blocks.q.max() <= 15
    expected = torch.from_numpy(dequantize(raw, qtype).reshape(32, 96).copy())
    assert torch.equal(blocks.dequantize(), expected)
    x = torch.from_numpy(rng.standard_normal((3, 96)).astype(np.float32))
    product = Packed4(blocks, torch.float32).mm(x)
    torch.testing.assert_close(product, F.linear(x, expected), rtol=1e-5, atol=1e-5)
    assert Blocks4.from_gguf(raw, GGMLQuantizationType.Q8_0, (32, 96)) is None  # not 4-bit: none kept
    assert not Packed4.fits((24, 96))  # rows the kernel does not take in 16s: the dense product stays
    with pytest.raises(ValueError, match="no weight of shape"):
        Packed4(Blocks4(blocks.q[:24], blocks.scale[:24], blocks.zero[:24]), torch.float32)


def test_the_kept_parts_give_the_same_product() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    values = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    blocks = Blocks4.from_gguf(quantize(values, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1, (16, 64))
    packed = Packed4(blocks, torch.bfloat16)
    again = Packed4.from_parts(packed.parts(), torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(again.mm(x), packed.mm(x))
    with pytest.raises(ValueError, match="4-bit parts"):
        Packed4.from_parts({**packed.parts(), "scale": packed.parts()["scale"][:, :1]}, torch.bfloat16)


@pytest.mark.model
def test_the_models_projections_keep_the_files_blocks_in_their_own_row_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = load_gguf(default_gguf_path(), dtype=torch.float32, packed4=True, cache=LoadCache(tmp_path / "cache"))
    kept = model.packed_projections()
    assert len(kept) == 4 * model.args.num_layers  # Q/K/V, output, gate/up, down of every layer
    layer = model.layers[5]
    for module in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
        eye = torch.eye(module.weight.shape[1])
        # the product with the identity is the weight itself: the blocks' rows are the dequantized rows
        torch.testing.assert_close(module.packed.mm(eye).T, module.weight, rtol=1e-5, atol=1e-6)

    # the load cache kept them: a second load maps them, never reading the GGUF's blocks again
    with pytest.raises(RuntimeError, match="dropped once stored"):
        layer.wqkv.packed.parts()  # a loaded model holds the kernel's form only
    again = load_gguf(default_gguf_path(), dtype=torch.float32, packed4=True, cache=LoadCache(tmp_path / "cache"))
    x = torch.randn(3, layer.wqkv.weight.shape[1])
    assert torch.equal(again.layers[5].wqkv.packed.mm(x), layer.wqkv.packed.mm(x))
    (entry,) = (p.parent for p in (tmp_path / "cache").rglob(PACKED_FILE))
    from safetensors.torch import load_file, save_file

    parts = load_file(str(entry / PACKED_FILE))
    parts["layers.5.wo.scale"] = parts["layers.5.wo.scale"][:, :3].contiguous()
    save_file(parts, str(entry / PACKED_FILE))
    with pytest.raises(CorruptEntry, match=r"layers\.5\.wo"):
        read_model(entry, dtype=torch.float32, device="cpu")


def test_linear_takes_the_blocks_only_for_the_rows_tune_found_them_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    values = np.random.default_rng(2).standard_normal((48, 64)).astype(np.float32)
    blocks = Blocks4.from_gguf(quantize(values, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1, (48, 64))
    weight = blocks.dequantize()
    packed = Packed4(blocks, torch.float32)
    calls: list[int] = []
    original_mm = Packed4.mm

    def counting_mm(self: Packed4, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return original_mm(self, x)

    monkeypatch.setattr(Packed4, "mm", counting_mm)

    # timings as a CPU where the blocks win up to 4 rows and lose beyond
    def timed(fn):  # type: ignore[no-untyped-def]
        before = len(calls)
        fn()
        if len(calls) == before:
            return 1.0  # a dense form
        return 0.1 if calls[-1] <= 4 else 10.0

    monkeypatch.setattr(matmul, "_median_seconds", timed)
    ratios = matmul.tune([weight], packed=[(weight, packed)])
    assert ratios["48x64 4-bit"] == pytest.approx(10.0)
    assert {k[3] for k in matmul._PACKED} == {1, 2, 4}
    calls.clear()
    few = torch.randn(1, 3, 64)
    torch.testing.assert_close(matmul.linear(few, weight, packed), F.linear(few, weight), rtol=1e-5, atol=1e-5)
    assert calls == [3]
    many = torch.randn(20, 64)
    assert torch.equal(matmul.linear(many, weight, packed), F.linear(many, weight))
    assert calls == [3], "20 rows went through the blocks"
    assert torch.equal(matmul.linear(few, weight), F.linear(few, weight))  # a weight without blocks: dense
