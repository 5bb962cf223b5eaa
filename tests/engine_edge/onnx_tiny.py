"""A tiny random Llama as GGUF, its ONNX export, a matching tokenizer and the torch reference,
shared by the ONNX tests. The export is cached under the session's temp folder, so every test
module after the first one gets a cache hit instead of another ~10 s trace."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers
import torch
from greedy_compare import FLOAT32_CLEAR_MARGIN, Pick, assert_clear_picks, pick_from_logits
from tiny_checkpoint import random_weights, tiny_config, write_gguf
from tokenizers import decoders, models, pre_tokenizers

from engine_edge.export_onnx import ExportResult, ensure_onnx
from llm_shared.llama.model import LlamaModel
from llm_shared.tokenizer import Tokenizer
from llm_shared.tokenizer_load import TokenizerParts, byte_decoder

VOCAB = 96  # tiny_config's vocabulary: ids 0..94 are the characters ' '..'~', 95 is the EOS
EOS_TEXT = "<|im_end|>"
EOS_ID = VOCAB - 1


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    config = tiny_config(vocab_size=VOCAB)
    return write_gguf(path, config, random_weights(config, seed=seed))


def tiny_tokenizer(vocab: int = VOCAB, eos: int | None = None) -> Tokenizer:
    """One character per id (from ' ' on), except EOS (default: the last id), a special token."""
    eos = vocab - 1 if eos is None else eos
    to_char = {b: c for c, b in byte_decoder().items()}
    table = [EOS_TEXT.encode() if i == eos else bytes([32 + i]) for i in range(vocab)]
    backend = tokenizers.Tokenizer(models.BPE({to_char[t[0]]: i for i, t in enumerate(table) if i != eos}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    parts = TokenizerParts(backend, tuple(table), frozenset({eos}), None, eos, "")
    return Tokenizer(parts)


def tiny_export(base: Path) -> tuple[Path, ExportResult]:
    """(the tiny GGUF, its export), both under ``base``; an export already there is reused."""
    base.mkdir(parents=True, exist_ok=True)
    gguf = write_tiny_gguf(base / "tiny.gguf")
    return gguf, ensure_onnx(gguf, base / "onnx" / "model.onnx")


def torch_greedy(model: LlamaModel, prompt: Sequence[int], n: int) -> list[int]:
    """The torch model's own greedy continuation (float32, contiguous past), every pick clear of
    float32 rounding (``greedy_compare``): ONNX Runtime's kernels must give the same tokens on every CPU."""
    picks: list[Pick] = []
    with torch.inference_mode():
        logits, past = model.forward_contiguous(torch.tensor([list(prompt)]))
        for _ in range(n):
            picks.append(pick_from_logits(logits[0, -1]))
            logits, past = model.forward_contiguous(torch.tensor([[picks[-1].token_id]]), past)
    assert_clear_picks(picks, FLOAT32_CLEAR_MARGIN)
    return [p.token_id for p in picks]
