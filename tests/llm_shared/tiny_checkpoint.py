"""Tiny random Llama checkpoints for tests: HF safetensors directories and F32 GGUF files.

The GGUF writer applies llama.cpp's Q/K row permutation (as its HF->GGUF converter does), so a
loader that forgets to undo it produces different logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """An HF-style config.json for a 2-layer GQA model (4 query heads, 2 KV heads, head dim 16)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config.update(overrides)
    return config


def random_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 weights under HF names; large enough that attention and position matter."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * (cols**-0.5) * 1.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    w = {"model.embed_tokens.weight": torch.randn(v, h, generator=g), "model.norm.weight": norm(h)}
    if not config.get("tie_word_embeddings", False):
        w["lm_head.weight"] = mat(v, h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = mat(q, h)
        w[p + "self_attn.k_proj.weight"] = mat(kv, h)
        w[p + "self_attn.v_proj.weight"] = mat(kv, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, q)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = mat(i, h)
        w[p + "mlp.up_proj.weight"] = mat(i, h)
        w[p + "mlp.down_proj.weight"] = mat(h, i)
    return w


def write_hf_checkpoint(
    directory: Path, config: dict[str, Any], weights: dict[str, torch.Tensor], *, shards: int = 1
) -> Path:
    """config.json plus one model.safetensors, or ``shards`` files with an index."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n].contiguous() for n in names}, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n].contiguous() for n in part}, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    return directory


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (HF rotate_half layout -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gguf(
    path: Path,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    *,
    arch: str = "llama",
    linear_rope_factor: float | None = None,
    rope_freqs: torch.Tensor | None = None,
    skip: tuple[str, ...] = (),
) -> Path:
    """An F32 GGUF of the same model. ``skip`` drops tensors (GGUF names) to make broken files."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    if linear_rope_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(linear_rope_factor)

    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": weights["model.embed_tokens.weight"].numpy(),
        "output_norm.weight": weights["model.norm.weight"].numpy(),
    }
    if "lm_head.weight" in weights:
        tensors["output.weight"] = weights["lm_head.weight"].numpy()
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs.to(torch.float32).numpy()
    for layer in range(config["num_hidden_layers"]):
        for hf, ours in GGUF_NAMES.items():
            w = weights[f"model.layers.{layer}.{hf}"].numpy()
            if hf == "self_attn.q_proj.weight":
                w = permute_qk(w, config["num_attention_heads"])
            elif hf == "self_attn.k_proj.weight":
                w = permute_qk(w, config["num_key_value_heads"])
            tensors[f"blk.{layer}.{ours}"] = w
    for name, array in tensors.items():
        if name not in skip:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
