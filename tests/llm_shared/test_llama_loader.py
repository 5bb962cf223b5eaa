"""Model file validation: every broken checkpoint is a ModelFileError that names what is wrong."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tiny_checkpoint import permute_qk, random_weights, tiny_config, write_gguf, write_hf_checkpoint

from llm_shared.errors import ModelFileError
from llm_shared.llama.loader import load_gguf, load_model, load_safetensors, unpermute_qk


def test_loads_and_logs_progress(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = tiny_config()
    path = write_gguf(tmp_path / "m.gguf", config, random_weights(config))
    with caplog.at_level(logging.INFO, logger="llm_shared.llama.loader"):
        model = load_model(path, "gguf", dtype=torch.bfloat16)
    total = 3 + 9 * config["num_hidden_layers"]
    assert any(f"{total}/{total} tensors dequantized" in r.getMessage() for r in caplog.records)
    assert model.embed.weight.dtype == torch.bfloat16
    assert model.args.num_layers == config["num_hidden_layers"]
    assert model.args.max_position_embeddings == config["max_position_embeddings"]


def test_unpermute_inverts_the_llama_cpp_permutation() -> None:
    w = torch.randn(4 * 16, 32)
    assert not torch.equal(torch.from_numpy(permute_qk(w.numpy(), 4)), w)
    assert torch.equal(unpermute_qk(torch.from_numpy(permute_qk(w.numpy(), 4)), 4), w)


def test_gguf_of_another_architecture(tmp_path: Path) -> None:
    config = tiny_config()
    path = write_gguf(tmp_path / "m.gguf", config, random_weights(config), arch="gpt2")
    with pytest.raises(ModelFileError, match="architecture 'gpt2'"):
        load_gguf(path, dtype=torch.float32)


def test_gguf_missing_tensor_is_named(tmp_path: Path) -> None:
    config = tiny_config()
    path = write_gguf(tmp_path / "m.gguf", config, random_weights(config), skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelFileError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'"):
        load_gguf(path, dtype=torch.float32)


def test_gguf_shape_mismatch_is_named(tmp_path: Path) -> None:
    config = tiny_config()
    weights = random_weights(config)
    weights["model.layers.0.mlp.down_proj.weight"] = torch.randn(64, 100)
    path = write_gguf(tmp_path / "m.gguf", config, weights)
    with pytest.raises(ModelFileError, match=r"'blk\.0\.ffn_down\.weight' has shape \[64, 100\], expected \[64, 112\]"):
        load_gguf(path, dtype=torch.float32)


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    config = tiny_config()
    data = write_gguf(tmp_path / "m.gguf", config, random_weights(config)).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFileError, match=r"cut\.gguf"):
        load_gguf(cut, dtype=torch.float32)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        load_gguf(path, dtype=torch.float32)


def test_gguf_unknown_rope_scaling(tmp_path: Path) -> None:
    import gguf

    config = tiny_config()
    path = write_gguf(tmp_path / "m.gguf", config, random_weights(config))
    # rewrite with a YaRN scaling type, which this engine does not implement
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "yarn.gguf"), "llama")
    for field in reader.fields.values():
        if field.name.startswith("llama."):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="yarn"):
        load_gguf(tmp_path / "yarn.gguf", dtype=torch.float32)


def test_hf_other_architecture(tmp_path: Path) -> None:
    config = tiny_config(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    directory = write_hf_checkpoint(tmp_path / "hf", config, random_weights(config))
    with pytest.raises(ModelFileError, match="gpt_neox"):
        load_safetensors(directory, dtype=torch.float32)


def test_hf_missing_tensor_is_named(tmp_path: Path) -> None:
    config = tiny_config()
    weights = random_weights(config)
    del weights["lm_head.weight"]  # untied config, so the head is required
    directory = write_hf_checkpoint(tmp_path / "hf", config, weights)
    with pytest.raises(ModelFileError, match=r"missing tensor 'lm_head\.weight'"):
        load_safetensors(directory, dtype=torch.float32)


def test_hf_shape_mismatch_is_named(tmp_path: Path) -> None:
    config = tiny_config()
    weights = random_weights(config)
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.randn(64, 64)  # 4 KV heads' worth, config says 2
    directory = write_hf_checkpoint(tmp_path / "hf", config, weights)
    with pytest.raises(ModelFileError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \[64, 64\]"):
        load_safetensors(directory, dtype=torch.float32)


def test_hf_missing_config_key(tmp_path: Path) -> None:
    config = tiny_config()
    del config["num_hidden_layers"]
    directory = write_hf_checkpoint(tmp_path / "hf", config, random_weights(tiny_config()))
    with pytest.raises(ModelFileError, match="num_hidden_layers"):
        load_safetensors(directory, dtype=torch.float32)


def test_hf_corrupt_safetensors(tmp_path: Path) -> None:
    config = tiny_config()
    directory = write_hf_checkpoint(tmp_path / "hf", config, random_weights(config))
    (directory / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelFileError, match=r"model\.safetensors"):
        load_safetensors(directory, dtype=torch.float32)


def test_hf_index_names_a_missing_shard(tmp_path: Path) -> None:
    config = tiny_config()
    directory = write_hf_checkpoint(tmp_path / "hf", config, random_weights(config), shards=2)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFileError, match="model-00009-of-00009"):
        load_safetensors(directory, dtype=torch.float32)


def test_hf_attention_bias_is_refused(tmp_path: Path) -> None:
    config = tiny_config(attention_bias=True)
    directory = write_hf_checkpoint(tmp_path / "hf", config, random_weights(config))
    with pytest.raises(ModelFileError, match="attention_bias"):
        load_safetensors(directory, dtype=torch.float32)


def test_hf_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    with pytest.raises(ModelFileError, match="safetensors"):
        load_safetensors(tmp_path, dtype=torch.float32)


def test_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="unknown model format"):
        load_model(tmp_path, "pytorch_bin", dtype=torch.float32)  # type: ignore[arg-type]


def test_gguf_metadata_of_the_wrong_kind(tmp_path: Path) -> None:
    import gguf

    config = tiny_config()
    path = write_gguf(tmp_path / "m.gguf", config, random_weights(config))
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    for field in reader.fields.values():
        if field.name.startswith("llama.") and field.name != "llama.attention.head_count_kv":
            writer.add_key_value(field.name, field.contents(), field.types[0])
    writer.add_head_count_kv([2, 2])  # per-layer counts: not what a llama model has
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="unusable llama metadata"):
        load_gguf(tmp_path / "odd.gguf", dtype=torch.float32)
