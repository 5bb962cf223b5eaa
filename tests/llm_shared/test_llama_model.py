"""The torch Llama against transformers' LlamaForCausalLM, in float32, on tiny random checkpoints."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_checkpoint import random_weights, tiny_config, write_gguf, write_hf_checkpoint

from llm_shared.errors import ModelFileError
from llm_shared.llama.loader import load_gguf, load_safetensors
from llm_shared.llama.model import LlamaModel
from llm_shared.llama.rope import RopeScaling, inv_frequencies, parse_rope_scaling

transformers = pytest.importorskip("transformers")

TOL = 1e-4
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def hf_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def our_logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward_contiguous(ids)[0]


def ids_for(config: dict[str, Any], batch: int = 2, length: int = 96, seed: int = 1) -> torch.Tensor:
    # 96 positions: past llama3's original 64-token context, so every frequency band is exercised
    return torch.randint(0, config["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


CASES = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.5}},
    "llama3": {"rope_scaling": LLAMA3, "rope_theta": 500000.0},
    # transformers >= 5 writes theta and scaling nested under rope_parameters
    "llama3_nested": {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}},
    "mha": {"num_key_value_heads": 4, "num_attention_heads": 4},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_safetensors_matches_transformers(tmp_path: Path, case: str) -> None:
    config = tiny_config(**CASES[case])
    directory = write_hf_checkpoint(tmp_path / "hf", config, random_weights(config))
    ids = ids_for(config)
    ours = our_logits(load_safetensors(directory, dtype=torch.float32), ids)
    assert (ours - hf_logits(directory, ids)).abs().max().item() < TOL


def test_sharded_checkpoint_loads_the_same_weights(tmp_path: Path) -> None:
    config = tiny_config()
    weights = random_weights(config)
    one = load_safetensors(write_hf_checkpoint(tmp_path / "one", config, weights), dtype=torch.float32)
    three = load_safetensors(write_hf_checkpoint(tmp_path / "three", config, weights, shards=3), dtype=torch.float32)
    assert len(list((tmp_path / "three").glob("*.safetensors"))) == 3
    for (name, a), (_, b) in zip(one.state_dict().items(), three.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _llama3_factors(config: dict[str, Any]) -> torch.Tensor:
    """What llama.cpp's converter stores as rope_freqs: base frequencies / llama3 frequencies."""
    d, theta = config["head_dim"], config["rope_theta"]
    scaling = parse_rope_scaling(config["rope_scaling"])
    return inv_frequencies(d, theta) / inv_frequencies(d, theta, scaling)


@pytest.mark.parametrize("case", ["untied", "tied", "linear", "llama3_rope_freqs"])
def test_gguf_matches_transformers(tmp_path: Path, case: str) -> None:
    overrides = CASES["llama3" if case == "llama3_rope_freqs" else case]
    config = tiny_config(**overrides)
    weights = random_weights(config)
    directory = write_hf_checkpoint(tmp_path / "hf", config, weights)
    # the GGUF carries no HF rope_scaling dict: linear as metadata, llama3 as rope_freqs factors
    path = write_gguf(
        tmp_path / "m.gguf", config, weights,
        linear_rope_factor=2.5 if case == "linear" else None,
        rope_freqs=_llama3_factors(config) if case == "llama3_rope_freqs" else None,
    )
    model = load_gguf(path, dtype=torch.float32)
    assert model.args.tie_word_embeddings == (case == "tied")
    ids = ids_for(config)
    assert (our_logits(model, ids) - hf_logits(directory, ids)).abs().max().item() < TOL


def test_gguf_qk_permutation_is_undone(tmp_path: Path) -> None:
    config = tiny_config()
    weights = random_weights(config)
    model = load_gguf(write_gguf(tmp_path / "m.gguf", config, weights), dtype=torch.float32)
    q_size, kv_size = model.args.q_size, model.args.kv_size
    wq, wk, _ = model.layers[0].wqkv.weight.split([q_size, kv_size, kv_size])
    assert torch.equal(wq, weights["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(wk, weights["model.layers.0.self_attn.k_proj.weight"])


def test_contiguous_forward_with_past_equals_one_pass(tmp_path: Path) -> None:
    config = tiny_config()
    model = load_safetensors(write_hf_checkpoint(tmp_path / "hf", config, random_weights(config)), dtype=torch.float32)
    ids = ids_for(config, length=30)
    whole = our_logits(model, ids)
    with torch.inference_mode():
        first, past = model.forward_contiguous(ids[:, :11])
        second, past = model.forward_contiguous(ids[:, 11:12], past)
        third, past = model.forward_contiguous(ids[:, 12:], past)
    assert past[0][0].shape == (2, config["num_key_value_heads"], 30, config["head_dim"])
    assert (torch.cat([first, second, third], dim=1) - whole).abs().max().item() < TOL


def test_forward_contiguous_exports_to_onnx(tmp_path: Path) -> None:
    """The ONNX backend exports this model: past length and batch must stay dynamic."""
    ort = pytest.importorskip("onnxruntime")
    config = tiny_config(num_hidden_layers=1)
    model = load_safetensors(write_hf_checkpoint(tmp_path / "hf", config, random_weights(config)), dtype=torch.float32)

    class Export(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            logits, present = self.model.forward_contiguous(ids, [(k, v)])
            return logits, present[0][0], present[0][1]

    def past(length: int) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            _, p = model.forward_contiguous(ids_for(config, batch=1, length=length, seed=length))
        return p[0][0].clone(), p[0][1].clone()

    k, v = past(7)
    batch, steps, cached = torch.export.Dim("batch"), torch.export.Dim("steps"), torch.export.Dim("cached")
    dynamic = {"ids": {0: batch, 1: steps}, "k": {0: batch, 2: cached}, "v": {0: batch, 2: cached}}
    with torch.no_grad():
        torch.onnx.export(Export().eval(), (ids_for(config, 1, 5), k, v), tmp_path / "m.onnx",
                          dynamic_shapes=dynamic, dynamo=True, verbose=False)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"))
    names = [i.name for i in session.get_inputs()]
    for steps_now, cached_now in [(1, 12), (4, 3)]:
        ids = ids_for(config, batch=1, length=steps_now, seed=99)
        k, v = past(cached_now)
        with torch.inference_mode():
            expected, _ = model.forward_contiguous(ids, [(k, v)])
        got = session.run(None, dict(zip(names, [ids.numpy(), k.numpy(), v.numpy()], strict=True)))[0]
        assert abs(got - expected.numpy()).max() < TOL


def test_unknown_rope_scaling_is_refused(tmp_path: Path) -> None:
    config = tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    directory = write_hf_checkpoint(tmp_path / "hf", config, random_weights(config))
    with pytest.raises(ModelFileError, match="yarn"):
        load_safetensors(directory, dtype=torch.float32)


def test_llama3_scaling_leaves_high_frequencies_and_slows_low_ones() -> None:
    base = inv_frequencies(16, 500000.0)
    scaled = inv_frequencies(16, 500000.0, RopeScaling("llama3", 4.0, 1.0, 4.0, 64))
    wavelen = 2 * math.pi / base
    assert torch.equal(scaled[wavelen < 16], base[wavelen < 16])
    assert torch.allclose(scaled[wavelen > 64], base[wavelen > 64] / 4.0)
    middle = (wavelen >= 16) & (wavelen <= 64)
    assert middle.any()
    assert ((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 4.0)).all()
