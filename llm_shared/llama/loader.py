"""Loading a Llama-family checkpoint into llm_shared.llama.model.LlamaModel.

Two formats: a GGUF file (tensors dequantized to float32 with the ``gguf`` package, llama.cpp's
Q/K row permutation undone) or a Hugging Face directory (config.json + *.safetensors, sharded or
not). Every problem with the files is a ModelFileError naming the file, key or tensor at fault.
Names and shapes are all checked before any tensor is read, so a bad file fails in seconds.
Parsing and dequantizing a GGUF takes seconds; given a ``LoadCache``, ``load_gguf`` keeps the
result (``weight_cache``) and maps it from there the next time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from llm_shared.errors import ModelFileError
from llm_shared.llama.model import LlamaModel, ModelArgs
from llm_shared.llama.rope import parse_rope_scaling
from llm_shared.llama.weight_cache import read_model, weights_key, write_model
from llm_shared.load_cache import LoadCache
from llm_shared.modelfile import check_gguf, check_hf_checkpoint

log = logging.getLogger(__name__)

# our per-layer role -> (GGUF name suffix, HF name suffix)
LAYER_TENSORS: dict[str, tuple[str, str]] = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "q": ("attn_q.weight", "self_attn.q_proj.weight"),
    "k": ("attn_k.weight", "self_attn.k_proj.weight"),
    "v": ("attn_v.weight", "self_attn.v_proj.weight"),
    "o": ("attn_output.weight", "self_attn.o_proj.weight"),
    "mlp_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "gate": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "up": ("ffn_up.weight", "mlp.up_proj.weight"),
    "down": ("ffn_down.weight", "mlp.down_proj.weight"),
}
GLOBAL_TENSORS: dict[str, tuple[str, str]] = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm": ("output_norm.weight", "model.norm.weight"),
    "head": ("output.weight", "lm_head.weight"),
}


@dataclass(frozen=True)
class TensorSource:
    """Named tensors of one checkpoint: cheap shapes first, values on demand."""

    shapes: Mapping[str, tuple[int, ...]]
    read: Callable[[str], torch.Tensor]  # any float dtype, on CPU, in HF layout
    describe: str  # for messages: the file or directory
    action: str = "read"  # progress wording: GGUF tensors are "dequantized"


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    h, i = args.hidden_size, args.intermediate_size
    return {
        "attn_norm": (h,), "q": (args.q_size, h), "k": (args.kv_size, h), "v": (args.kv_size, h),
        "o": (h, args.q_size), "mlp_norm": (h,), "gate": (i, h), "up": (i, h), "down": (h, i),
    }


def build_model(
    args: ModelArgs,
    source: TensorSource,
    names: Callable[[str, int | None], str],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> LlamaModel:
    """Check every needed tensor's presence and shape, then read them into a LlamaModel.

    ``names(role, layer)`` gives the checkpoint's name for one of our roles.
    """
    plan: list[tuple[str, str, tuple[int, ...]]] = []  # (state-dict target, checkpoint name, shape)
    roles = {"embed": (args.vocab_size, args.hidden_size), "norm": (args.hidden_size,)}
    if not args.tie_word_embeddings:
        roles["head"] = (args.vocab_size, args.hidden_size)
    for role, shape in roles.items():
        plan.append((role, names(role, None), shape))
    per_layer = expected_shapes(args)
    for layer in range(args.num_layers):
        for role, shape in per_layer.items():
            plan.append((f"{layer}.{role}", names(role, layer), shape))
    missing = [name for _, name, _ in plan if name not in source.shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(f"{source.describe}: missing tensor {missing[0]!r}{more}")
    for _, name, shape in plan:
        if tuple(source.shapes[name]) != shape:
            raise ModelFileError(
                f"{source.describe}: tensor {name!r} has shape {list(source.shapes[name])}, expected {list(shape)}"
            )

    loaded: dict[str, torch.Tensor] = {}
    step = max(1, len(plan) // 10)
    for n, (target, name, _) in enumerate(plan, 1):
        loaded[target] = source.read(name).to(device=device, dtype=dtype)
        if n % step == 0 or n == len(plan):
            log.info("loading %s: %d/%d tensors %s", source.describe, n, len(plan), source.action)
    return _assemble(args, loaded, device)


# the model's fused projections and the GGUF tensors stacked in each, in order
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "wqkv": ("q", "k", "v"), "wo": ("o",), "w_gate_up": ("gate", "up"), "w_down": ("down",),
}


def _assemble(args: ModelArgs, t: dict[str, torch.Tensor], device: torch.device | str) -> LlamaModel:
    state: dict[str, torch.Tensor] = {"embed.weight": t.pop("embed"), "norm.weight": t.pop("norm")}
    if "head" in t:
        state["lm_head.weight"] = t.pop("head")
    for i in range(args.num_layers):
        p = f"layers.{i}."
        state[p + "attn_norm.weight"] = t.pop(f"{i}.attn_norm")
        state[p + "mlp_norm.weight"] = t.pop(f"{i}.mlp_norm")
        for module_name, roles in FUSED_PROJECTIONS.items():
            parts = [t.pop(f"{i}.{role}") for role in roles]
            state[f"{p}{module_name}.weight"] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return LlamaModel.from_state_dict(args, state, device)


def load_model(
    path: Path, fmt: Literal["gguf", "safetensors"], *, dtype: torch.dtype, device: torch.device | str = "cpu",
    cache: LoadCache | None = None, packed4: bool = False,
) -> LlamaModel:
    """Load a checkpoint; a GGUF through ``cache`` when given (safetensors load mapped anyway),
    keeping its 4-bit blocks with ``packed4``."""
    if fmt == "gguf":
        return load_gguf(path, dtype=dtype, device=device, cache=cache, packed4=packed4)
    if fmt == "safetensors":
        return load_safetensors(path, dtype=dtype, device=device)
    raise ModelFileError(f"unknown model format {fmt!r}; expected 'gguf' or 'safetensors'")


# ---------------------------------------------------------------------------- GGUF


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate_half halves)."""
    out_features, in_features = w.shape
    head_dim = out_features // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, in_features).swapaxes(1, 2).reshape(out_features, in_features)


def load_gguf(path: Path, *, dtype: torch.dtype, device: torch.device | str = "cpu",
              cache: LoadCache | None = None, packed4: bool = False) -> LlamaModel:
    """The model in a GGUF file; through ``cache`` when given (keyed by the file's SHA-256, the
    dtype, ``packed4`` and ``weight_cache.CACHE_VERSION``), storing the loaded weights on a miss.
    ``packed4`` (a CPU model): the 4-bit projections keep their blocks too (``attach_packed4``)."""
    check_gguf(path)
    if cache is None or not cache.enabled:
        return _forget_parts(_parse_gguf(path, dtype=dtype, device=device, packed4=packed4))
    key = weights_key(cache.source_sha256(path), dtype, packed4)
    model = cache.load(key, lambda folder: read_model(folder, dtype=dtype, device=device))
    if model is not None:
        log.info("loading %s: %d tensors mapped from the load cache", path, len(model.state_dict()))
        return model
    model = _parse_gguf(path, dtype=dtype, device=device, packed4=packed4)
    cache.store(key, lambda folder: write_model(model, folder))
    return _forget_parts(model)


def _parse_gguf(path: Path, *, dtype: torch.dtype, device: torch.device | str, packed4: bool) -> LlamaModel:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError) as e:  # the reader's ways of rejecting a corrupt file
        raise ModelFileError(f"cannot parse GGUF file {str(path)!r}: {e}") from e
    model = _read_gguf_weights(reader, path, dtype=dtype, device=device)
    if packed4:
        attach_packed4(model, path, reader)
    return model


def _forget_parts(model: LlamaModel) -> LlamaModel:
    """The 4-bit blocks' stored form is for the load cache; a loaded model keeps the kernel's only."""
    for _, packed in model.packed_projections():
        packed.forget_parts()
    return model


def _read_gguf_weights(reader: Any, path: Path, *, dtype: torch.dtype, device: torch.device | str) -> LlamaModel:
    import gguf

    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(d) for d in reversed(t.shape)) for name, t in tensors.items()}
    try:
        args = read_gguf_args(reader, shapes, str(path))
    except (TypeError, ValueError) as e:  # e.g. a per-layer array where llama needs one number
        raise ModelFileError(f"{path}: unusable llama metadata: {e}") from e

    def read(name: str) -> torch.Tensor:
        t = tensors[name]
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelFileError(f"{path}: tensor {name!r} has unsupported type {t.tensor_type.name}") from e
        w = torch.from_numpy(values.reshape(shapes[name]).copy())
        if name.endswith(".attn_q.weight"):
            w = unpermute_qk(w, args.num_heads)
        elif name.endswith(".attn_k.weight"):
            w = unpermute_qk(w, args.num_kv_heads)
        return w

    def names(role: str, layer: int | None) -> str:
        if layer is None:
            return GLOBAL_TENSORS[role][0]
        return f"blk.{layer}.{LAYER_TENSORS[role][0]}"

    source = TensorSource(shapes, read, str(path), "dequantized")
    return build_model(args, source, names, dtype=dtype, device=device)


def attach_packed4(model: LlamaModel, path: Path, reader: Any = None) -> int:
    """Give each projection of ``model`` (loaded from the GGUF at ``path``) whose tensors are all
    Q4_0 or Q4_1 its 4-bit blocks in the CPU kernel's layout (``Linear.packed``, see
    ``packed4``), as llama.cpp stores them, Q and K un-permuted like the dequantized weights.
    ``reader``: the file's ``GGUFReader`` where one is open (parsing its metadata takes seconds).
    Returns how many projections got them (0 for another block type, or a torch without the kernel)."""
    import gguf

    from llm_shared.llama import packed4

    if not packed4.available():
        return 0
    args = model.args
    dtype = model.embed.weight.dtype
    tensors = {t.name: t for t in (reader if reader is not None else gguf.GGUFReader(path)).tensors}
    heads = {"q": args.num_heads, "k": args.num_kv_heads}
    attached = 0
    for i, layer in enumerate(model.layers):
        for module_name, roles in FUSED_PROJECTIONS.items():
            parts = []
            for role in roles:
                t = tensors[f"blk.{i}.{LAYER_TENSORS[role][0]}"]
                blocks = packed4.Blocks4.from_gguf(t.data, t.tensor_type, tuple(int(d) for d in reversed(t.shape)))
                if blocks is None:
                    break
                if role in heads:
                    rows = torch.arange(blocks.q.shape[0])[:, None]
                    blocks = blocks.rows(unpermute_qk(rows, heads[role])[:, 0])
                parts.append(blocks)
            else:
                fused = packed4.Blocks4.cat(parts)
                if packed4.Packed4.fits(tuple(fused.q.shape)):
                    getattr(layer, module_name).packed = packed4.Packed4(fused, dtype)
                    attached += 1
    log.info("%s: %d of %d projections keep their 4-bit blocks for few-row products", path, attached,
             len(FUSED_PROJECTIONS) * len(model.layers))
    return attached


def _gguf_value(reader: Any, key: str, default: Any = None, *, required: bool = False) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise ModelFileError(f"GGUF metadata is missing {key!r}")
        return default
    return field.contents()


def read_gguf_args(reader: Any, shapes: Mapping[str, tuple[int, ...]], describe: str) -> ModelArgs:
    arch = _gguf_value(reader, "general.architecture", required=True)
    if arch != "llama":
        raise ModelFileError(f"{describe}: architecture {arch!r} is not supported; this engine runs 'llama' models")

    def meta(key: str, default: Any = None, required: bool = True) -> Any:
        return _gguf_value(reader, f"llama.{key}", default, required=required and default is None)

    embed = shapes.get("token_embd.weight")
    if embed is None or len(embed) != 2:
        raise ModelFileError(f"{describe}: missing tensor 'token_embd.weight'")
    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_dims = int(meta("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelFileError(f"{describe}: partial rotary (rope.dimension_count {rope_dims} != head dim {head_dim})")
    scaling_type = meta("rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ModelFileError(f"{describe}: unsupported rope scaling type {scaling_type!r}; supported: none, linear")
    scaling = None
    if scaling_type == "linear":
        scaling = parse_rope_scaling({"rope_type": "linear", "factor": meta("rope.scaling.factor")})
    freq_factors = None
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:  # llama3-style scaling as llama.cpp stores it: per-pair divisors
        import gguf

        values = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type)
        freq_factors = tuple(float(x) for x in values.reshape(-1).tolist())
    return ModelArgs(
        vocab_size=int(embed[0]),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rope_freq_factors=freq_factors,
        tie_word_embeddings="output.weight" not in shapes,
        max_position_embeddings=int(meta("context_length", 2048)),
    )


# ---------------------------------------------------------------------------- safetensors


def read_hf_args(config: Mapping[str, Any], describe: str) -> ModelArgs:
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type != "llama" and "LlamaForCausalLM" not in archs:
        raise ModelFileError(
            f"{describe}: architecture {model_type or archs!r} is not supported; this engine runs Llama models"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ModelFileError(f"{describe}: {flag} = true is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ModelFileError(f"{describe}: hidden_act {config.get('hidden_act')!r} is not supported (silu only)")
    rope = config.get("rope_parameters") or {}  # transformers >= 5 nests theta and scaling here
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelArgs(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rope_scaling=parse_rope_scaling(config.get("rope_scaling") or rope or None),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        )
    except KeyError as e:
        raise ModelFileError(f"{describe}: config.json is missing {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{describe}: config.json has a bad value: {e}") from e


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFileError(f"{index}: unreadable shard index: {e}") from e
    files = sorted({path / f for f in weight_map.values()})
    for f in files:
        if not f.is_file():
            raise ModelFileError(f"{index} names shard {f.name!r}, which does not exist")
    return files


def load_safetensors(path: Path, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> LlamaModel:
    from safetensors import SafetensorError, safe_open

    check_hf_checkpoint(path)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}/config.json is not readable JSON: {e}") from e
    if not isinstance(config, dict):
        raise ModelFileError(f"{path}/config.json must hold an object")
    args = read_hf_args(config, str(path))
    with ExitStack() as stack:
        handles: dict[str, Any] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for file in _shard_files(path):
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except (SafetensorError, OSError) as e:
                raise ModelFileError(f"cannot read {file}: {e}") from e
            for name in handle.keys():
                handles[name] = handle
                shapes[name] = tuple(handle.get_slice(name).get_shape())

        def names(role: str, layer: int | None) -> str:
            if layer is None:
                return GLOBAL_TENSORS[role][1]
            return f"model.layers.{layer}.{LAYER_TENSORS[role][1]}"

        source = TensorSource(shapes, lambda name: handles[name].get_tensor(name), str(path))
        return build_model(args, source, names, dtype=dtype, device=device)

