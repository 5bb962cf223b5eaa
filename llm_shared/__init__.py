"""What every tier and the client SDK share, torch-free: the engine contract, typed errors, config helpers, the model registry, the tokenizer and text streams.

The torch model definition (Llama, RoPE, GGUF/safetensors loading) lives in ``llm_shared.llama``,
which only the torch engine and the ONNX export import. Nothing here imports ``gateway``,
``engine_gpu``, ``engine_edge`` or ``client_sdk``; ``tests/test_layers.py`` keeps it so.
"""
