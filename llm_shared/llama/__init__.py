"""The Llama-family model in torch, written once: the torch engine serves it and the ONNX export traces it."""
