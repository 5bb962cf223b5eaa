"""A GGUF's loaded weights as a load-cache entry: one safetensors file, memory-mapped on a hit.

The file holds the model's state dict exactly as ``loader.load_gguf`` built it (dequantized,
llama.cpp's Q/K permutation undone, Q/K/V and gate/up fused, in the requested dtype), and the
``ModelArgs`` as JSON in its header, so a hit needs neither the ``gguf`` reader nor any
arithmetic: the tensors are views of the mapped file (copy-on-write, shared through the page
cache with every other process that maps it).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from llm_shared.errors import ModelFileError
from llm_shared.llama.matmul import Linear
from llm_shared.llama.model import LlamaModel, ModelArgs
from llm_shared.llama.packed4 import Packed4
from llm_shared.llama.rope import RopeScaling
from llm_shared.load_cache import CorruptEntry

# Bump when load_gguf's tensors for the same file change (dequantization, un-permutation,
# fusing, names), so older entries miss instead of loading stale weights.
CACHE_VERSION = "1"
WEIGHTS_FILE = "model.safetensors"
PACKED_FILE = "packed4.safetensors"  # the projections' 4-bit blocks, where they were kept (packed4)
ARGS_KEY = "model_args"  # in the safetensors header's metadata


def weights_key(source_sha256: str, dtype: torch.dtype, packed4: bool = False) -> dict[str, str]:
    return {"kind": "weights", "source_sha256": source_sha256, "version": CACHE_VERSION,
            "dtype": str(dtype).removeprefix("torch."), "packed4": "kept" if packed4 else "no"}


def args_to_json(args: ModelArgs) -> str:
    return json.dumps(asdict(args), sort_keys=True)


def args_from_json(text: str) -> ModelArgs:
    """The ``ModelArgs`` ``args_to_json`` wrote; ``CorruptEntry`` if it is not that."""
    try:
        raw: dict[str, Any] = json.loads(text)
        scaling = raw.get("rope_scaling")
        factors = raw.get("rope_freq_factors")
        raw["rope_scaling"] = None if scaling is None else RopeScaling(**scaling)
        raw["rope_freq_factors"] = None if factors is None else tuple(float(x) for x in factors)
        return ModelArgs(**raw)
    except (ValueError, TypeError, AttributeError, ModelFileError) as e:
        raise CorruptEntry(f"unusable model arguments in the header: {e}") from e


def write_model(model: LlamaModel, folder: Path) -> None:
    from safetensors.torch import save_file

    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={ARGS_KEY: args_to_json(model.args)})
    packed = {f"{name}.{part}": t.contiguous() for name, module in model.named_modules()
              if isinstance(module, Linear) and module.packed is not None
              for part, t in module.packed.parts().items()}
    if packed:
        save_file(packed, str(folder / PACKED_FILE))


def read_model(folder: Path, *, dtype: torch.dtype, device: torch.device | str) -> LlamaModel:
    """The model ``write_model`` saved, its tensors mapped from the file (copied only to move
    them to another device); ``CorruptEntry`` if the file is not that."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            state = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        raise CorruptEntry(f"{WEIGHTS_FILE} does not open: {e}") from e
    if ARGS_KEY not in metadata:
        raise CorruptEntry(f"{WEIGHTS_FILE} has no {ARGS_KEY!r} in its header")
    args = args_from_json(metadata[ARGS_KEY])
    wrong = sorted(name for name, t in state.items() if t.dtype != dtype)
    if wrong:
        raise CorruptEntry(f"tensor {wrong[0]!r} is {state[wrong[0]].dtype}, expected {dtype}")
    if torch.device(device).type != "cpu":
        state = {name: t.to(device) for name, t in state.items()}
    try:
        model = LlamaModel.from_state_dict(args, state, device)
    except RuntimeError as e:  # load_state_dict: missing, unexpected or misshapen tensors
        raise CorruptEntry(f"{WEIGHTS_FILE} does not fit the model it describes: {e}") from e
    if (folder / PACKED_FILE).exists():
        _read_packed(model, folder / PACKED_FILE, dtype)
    return model


def _read_packed(model: LlamaModel, path: Path, dtype: torch.dtype) -> None:
    """The 4-bit blocks ``write_model`` kept, given back to their projections."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        raise CorruptEntry(f"{PACKED_FILE} does not open: {e}") from e
    modules = dict(model.named_modules())
    for name in {key.rsplit(".", 1)[0] for key in tensors}:
        module = modules.get(name)
        if not isinstance(module, Linear):
            raise CorruptEntry(f"{PACKED_FILE} names {name!r}, which is no projection of the model")
        try:
            module.packed = Packed4.from_parts({part: tensors.get(f"{name}.{part}") for part in ("q", "scale", "zero")},
                                               dtype)
        except (ValueError, AttributeError, RuntimeError) as e:
            raise CorruptEntry(f"{PACKED_FILE}: the 4-bit blocks of {name!r} are unusable: {e}") from e
        if module.packed.shape != tuple(module.weight.shape):
            raise CorruptEntry(f"{PACKED_FILE}: the 4-bit blocks of {name!r} are {list(module.packed.shape)}, "
                               f"the weight {list(module.weight.shape)}")
