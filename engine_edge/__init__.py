"""The edge tier: a small model served in this process (llama.cpp or ONNX Runtime), for turns and drafts.

Backends are registered by dotted path and imported only when chosen, so llama-cpp-python and
onnxruntime stay optional at import time.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from llm_shared.errors import UnknownModelError

if TYPE_CHECKING:
    from engine_edge.base import EdgeBackend
    from engine_edge.config import EdgeConfig

BACKENDS = MappingProxyType({
    "llama_cpp": "engine_edge.llama_cpp_backend:LlamaCppBackend",
    "onnx": "engine_edge.onnx_backend:OnnxBackend",
    "synthetic": "engine_edge.synthetic_backend:SyntheticBackend",  # load tests: tokens at a fixed rate
})


def backend_class(name: str) -> type[EdgeBackend]:
    """The class registered as ``name``, importing its module now."""
    target = BACKENDS.get(name) if isinstance(name, str) else None
    if target is None:
        raise UnknownModelError(f"unknown edge backend {name!r}; known backends: {sorted(BACKENDS)}", param="backend")
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_backend(config: EdgeConfig, model_path: Path, **kwargs: Any) -> EdgeBackend:
    """Build the edge backend ``config.backend`` names for the model file at ``model_path``."""
    return backend_class(config.backend)(Path(model_path), config, **kwargs)
