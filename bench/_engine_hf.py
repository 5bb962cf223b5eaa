"""The Hugging Face baseline of bench/engine.py: transformers' LlamaForCausalLM fed the same
dequantized GGUF weights as the engine, serving requests one at a time with ``generate()``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from llm_shared.llama.loader import GLOBAL_TENSORS, LAYER_TENSORS, read_gguf_args, unpermute_qk


def load_hf_llama(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """LlamaForCausalLM with the GGUF's tensors, dequantized and put back in HF layout."""
    import gguf
    import transformers

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(d) for d in reversed(t.shape)) for name, t in tensors.items()}
    args = read_gguf_args(reader, shapes, str(path))
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim, rms_norm_eps=args.rms_norm_eps, rope_theta=args.rope_theta,
        max_position_embeddings=args.max_position_embeddings, tie_word_embeddings=args.tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )

    def read(name: str) -> torch.Tensor:
        t = tensors[name]
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shapes[name]).copy())
        if name.endswith(".attn_q.weight"):
            w = unpermute_qk(w, args.num_heads)
        elif name.endswith(".attn_k.weight"):
            w = unpermute_qk(w, args.num_kv_heads)
        return w

    state = {}
    for role, (gguf_name, hf_name) in GLOBAL_TENSORS.items():
        if gguf_name in tensors:
            state[hf_name] = read(gguf_name)
        elif role == "head":
            state[hf_name] = state["model.embed_tokens.weight"]  # tied head
    for layer in range(args.num_layers):
        for gguf_suffix, hf_suffix in LAYER_TENSORS.values():
            state[f"model.layers.{layer}.{hf_suffix}"] = read(f"blk.{layer}.{gguf_suffix}")
    model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"HF baseline: missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval()


def hf_serve_one_at_a_time(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                           output_lens: Sequence[int]) -> tuple[float, int, list[list[int]]]:
    """(seconds, output tokens, outputs): each request alone, its output length fixed like ignore_eos."""
    outputs = []
    tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for prompt, n in zip(prompts, output_lens, strict=True):
            ids = torch.tensor([list(prompt)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False)
            new = out[0, ids.shape[1]:].tolist()
            assert len(new) == n, f"HF generated {len(new)} tokens, wanted {n}"
            outputs.append(new)
            tokens += n
    return time.perf_counter() - started, tokens, outputs
