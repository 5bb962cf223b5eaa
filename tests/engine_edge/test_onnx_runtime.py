"""The llama.cpp-shaped context over the ONNX decoder: batch checks, the shared cell pool,
cache truncation, and end-of-generation ids matching llama.cpp's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx_tiny import tiny_export

from engine_edge.onnx_decoder import OnnxDecoder
from engine_edge.onnx_runtime import (
    DECODE_BAD_BATCH,
    DECODE_NO_KV_ROOM,
    DECODE_OK,
    OnnxBatch,
    OnnxContext,
    end_of_generation_ids,
)
from llm_shared.errors import EngineError


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> OnnxDecoder:
    _, result = tiny_export(tmp_path_factory.getbasetemp() / "onnx-tiny")
    return OnnxDecoder(result.onnx_path, n_threads=1)


def fill(batch: OnnxBatch, seq_id: int, tokens: list[int], start: int = 0) -> list[int]:
    return [batch.add(t, start + i, seq_id, i == len(tokens) - 1) for i, t in enumerate(tokens)]


def test_mixed_batch_gives_the_same_logits_as_separate_runs(decoder: OnnxDecoder) -> None:
    ctx = OnnxContext(decoder, n_ctx=256, n_ctx_seq=128)
    batch = OnnxBatch(64)
    fill(batch, 0, [3, 4, 5])
    fill(batch, 1, [9, 9])
    assert ctx.decode(batch) == DECODE_OK
    batch.clear()
    decode_index = fill(batch, 0, [6], start=3)[-1]  # one token: joins the decode run
    prefill_index = fill(batch, 1, [7, 8, 10], start=2)[-1]  # a chunk: runs on its own
    fresh_index = fill(batch, 2, [1])[-1]  # a new one-token prompt decodes with seq 0
    assert ctx.decode(batch) == DECODE_OK
    assert [ctx.seq_pos_max(s) for s in (0, 1, 2, 3)] == [3, 4, 0, -1]
    solo = OnnxContext(decoder, n_ctx=256, n_ctx_seq=128)
    for seq_id, tokens, index in ((0, [3, 4, 5, 6], decode_index), (1, [9, 9, 7, 8, 10], prefill_index),
                                  (2, [1], fresh_index)):
        alone = OnnxBatch(64)
        last = fill(alone, seq_id, tokens)[-1]
        assert solo.decode(alone) == DECODE_OK
        assert np.abs(solo.logits(last) - ctx.logits(index)).max() < 1e-4


def test_bad_batches_change_nothing(decoder: OnnxDecoder) -> None:
    ctx = OnnxContext(decoder, n_ctx=16, n_ctx_seq=10)
    batch = OnnxBatch(64)
    fill(batch, 0, [1, 2, 3])
    assert ctx.decode(batch) == DECODE_OK
    batch.clear()
    batch.add(4, 5, 0, True)  # position 3 expected
    assert ctx.decode(batch) == DECODE_BAD_BATCH
    batch.clear()
    batch.add(4, 3, 0, True)
    batch.add(5, 4, 0, False)  # logits only come for a sequence's last new token
    assert ctx.decode(batch) == DECODE_BAD_BATCH
    batch.clear()
    fill(batch, 0, list(range(8)), start=3)  # 11 > n_ctx_seq
    assert ctx.decode(batch) == DECODE_NO_KV_ROOM
    batch.clear()
    fill(batch, 1, list(range(7)))
    fill(batch, 2, list(range(7)))  # 3 + 14 > n_ctx
    assert ctx.decode(batch) == DECODE_NO_KV_ROOM
    assert ctx.seq_pos_max(0) == 2 and ctx.cells_used == 3
    with pytest.raises(EngineError, match="no logits"):
        ctx.logits(0)


def test_seq_rm_truncates_suffixes_and_refuses_holes(decoder: OnnxDecoder) -> None:
    ctx = OnnxContext(decoder, n_ctx=64, n_ctx_seq=64)
    batch = OnnxBatch(64)
    fill(batch, 0, [5, 6, 7, 8, 9])
    assert ctx.decode(batch) == DECODE_OK
    assert not ctx.seq_rm(0, 1, 3)  # a hole in a contiguous cache
    assert ctx.seq_pos_max(0) == 4
    assert ctx.seq_rm(0, 3, -1) and ctx.seq_pos_max(0) == 2
    batch.clear()
    last = fill(batch, 0, [8, 9], start=3)[-1]
    assert ctx.decode(batch) == DECODE_OK
    again = OnnxContext(decoder, n_ctx=64, n_ctx_seq=64)
    whole = OnnxBatch(64)
    whole_last = fill(whole, 0, [5, 6, 7, 8, 9])[-1]
    assert again.decode(whole) == DECODE_OK
    assert np.abs(again.logits(whole_last) - ctx.logits(last)).max() < 1e-4
    assert ctx.seq_rm(0) and ctx.seq_pos_max(0) == -1 and ctx.cells_used == 0
    assert ctx.seq_rm(7)  # nothing cached: nothing to do


def test_batch_capacity_is_enforced() -> None:
    batch = OnnxBatch(2)
    batch.add(1, 0, 0, False)
    batch.add(2, 1, 0, True)
    with pytest.raises(EngineError, match="full"):
        batch.add(3, 2, 0, True)


def test_end_of_generation_ids_from_special_token_texts() -> None:
    special = [(0, b"<|endoftext|>"), (1, b"<|im_start|>"), (2, b"<|im_end|>"), (4, b"<reponame>"), (5, b"<file_sep>")]
    assert end_of_generation_ids(2, special) == {0, 2, 4}
    assert end_of_generation_ids(9, []) == {9}


@pytest.mark.model
def test_end_of_generation_ids_match_llama_cpp() -> None:
    from llm_shared.llamacpp_runtime import LlamaModel
    from llm_shared.modelfile import default_gguf_path
    from llm_shared.tokenizer import Tokenizer

    path: Path = default_gguf_path()
    tokenizer = Tokenizer.from_gguf(path)
    model = LlamaModel(path)
    try:
        llama_eog = {i for i in range(model.n_vocab) if model.is_eog(i)}
    finally:
        model.free()
    ours = end_of_generation_ids(tokenizer.eos_id, ((i, tokenizer.token_bytes(i)) for i in tokenizer.special_ids))
    assert ours == llama_eog


def test_sessions_never_spin_their_workers() -> None:
    """Spinning onnxruntime workers starve torch and the event loop in the same process."""
    from engine_edge.onnx_decoder import session_options

    opts = session_options(2)
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert opts.get_session_config_entry("session.inter_op.allow_spinning") == "0"
    assert opts.intra_op_num_threads == 2
