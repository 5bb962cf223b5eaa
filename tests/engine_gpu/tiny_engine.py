"""A tiny random Llama checkpoint with a tokenizer, ready for LLMEngine and the core process.

The checkpoint comes from tiny_checkpoint.py; the tokenizer is a byte-level BPE without merges
whose ids 3.. are the printable ASCII bytes, so any generated id decodes to text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from greedy_compare import FLOAT32_CLEAR_MARGIN, assert_clear_picks
from tiny_checkpoint import random_weights, tiny_config, write_hf_checkpoint
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from llm_shared.contract import SamplingParams, TokenEvent
from llm_shared.models import ModelConfig
from llm_shared.tokenizer_load import byte_decoder

if TYPE_CHECKING:
    from engine_gpu.engine import LLMEngine  # tests that only write a checkpoint need no torch

SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the tiny config's BOS is 1 and EOS is 2


def write_tiny_tokenizer(directory: Path, vocab_size: int) -> Path:
    char_of_byte = {b: c for c, b in byte_decoder().items()}
    vocab = {name: i for i, name in enumerate(SPECIALS)}
    for i in range(len(SPECIALS), vocab_size):
        vocab[char_of_byte[32 + (i - len(SPECIALS)) % 95]] = i
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(name, special=True) for name in SPECIALS])
    path = directory / "tokenizer.json"
    backend.save(str(path))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def write_tiny_model(directory: Path, *, seed: int = 0, **overrides: Any) -> ModelConfig:
    """Checkpoint + tokenizer in ``directory``; the ModelConfig that names them."""
    config = tiny_config(**overrides)
    write_hf_checkpoint(directory, config, random_weights(config, seed=seed))
    tokenizer = write_tiny_tokenizer(directory, config["vocab_size"])
    return ModelConfig(id="tiny", source=str(directory), format="safetensors", tokenizer=str(tokenizer))



def generate_events(engine: LLMEngine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                    prefix: str = "gen") -> list[list[TokenEvent]]:
    """``LLMEngine.generate`` with each token's event (its logprobs where asked) instead of its id."""
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    out: dict[str, list[TokenEvent]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.tokens
    return [out[rid] for rid in ids]


def clear_greedy_reference(engine: LLMEngine, prompts: Sequence[Sequence[int]],
                           params: Sequence[SamplingParams], margin: float = FLOAT32_CLEAR_MARGIN) -> list[list[int]]:
    """Each prompt alone through ``engine`` (greedy params), checking that every pick wins over its
    runner-up by ``margin``: a reference other float32 paths must equal token for token on every CPU."""
    out = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        assert p.greedy
        [picks] = generate_events(engine, [prompt], [replace(p, logprobs=max(p.logprobs, 2))], f"clear-ref-{i}")
        assert_clear_picks(picks, margin)
        out.append([t.token_id for t in picks])
    return out
