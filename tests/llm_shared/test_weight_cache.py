"""A GGUF's weights through the load cache (tiny random checkpoints): the hit gives the same
tensors and arguments as parsing, without the GGUF reader; a damaged entry is parsed again."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import pytest
import torch
from tiny_checkpoint import random_weights, tiny_config, write_gguf

from llm_shared.llama.loader import load_gguf, load_model
from llm_shared.llama.model import LlamaModel, ModelArgs
from llm_shared.llama.rope import RopeScaling
from llm_shared.llama.weight_cache import WEIGHTS_FILE, args_from_json, args_to_json, weights_key
from llm_shared.load_cache import CACHE_DIR_ENV, SWITCH_ENV, LoadCache


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    config = tiny_config(tie_word_embeddings=True)
    return write_gguf(tmp_path / "m.gguf", config, random_weights(config))


class ReaderCalls:
    """Counts GGUFReader constructions; raises instead when ``forbid`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.forbid = False
        real = gguf.GGUFReader

        def reader(*args: object, **kwargs: object) -> object:
            if self.forbid:
                raise AssertionError("the GGUF reader was called on a cache hit")
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(gguf, "GGUFReader", reader)


def assert_same_model(a: LlamaModel, b: LlamaModel) -> None:
    assert a.args == b.args
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name
    ids = torch.tensor([[5, 17, 3, 42, 8, 90, 1]])
    with torch.inference_mode():
        assert torch.equal(a.forward_contiguous(ids)[0], b.forward_contiguous(ids)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hit_gives_the_parsed_weights_without_reading_the_gguf(
    gguf_file: Path, tmp_path: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = ReaderCalls(monkeypatch)
    parsed = load_gguf(gguf_file, dtype=dtype)
    cold_cache = LoadCache(tmp_path / "cache")
    assert_same_model(load_gguf(gguf_file, dtype=dtype, cache=cold_cache), parsed)
    assert cold_cache.outcomes == {"weights": "miss"} and calls.count == 2
    assert (cold_cache.folder(weights_key(cold_cache.source_sha256(gguf_file), dtype)) / WEIGHTS_FILE).is_file()

    calls.forbid = True
    warm_cache = LoadCache(tmp_path / "cache")
    warm = load_model(gguf_file, "gguf", dtype=dtype, cache=warm_cache)
    assert warm_cache.outcomes == {"weights": "hit"}
    assert_same_model(warm, parsed)


def test_another_dtype_is_another_entry(gguf_file: Path, tmp_path: Path) -> None:
    cache = LoadCache(tmp_path / "cache")
    load_gguf(gguf_file, dtype=torch.float32, cache=cache)
    bf16 = load_gguf(gguf_file, dtype=torch.bfloat16, cache=cache)
    assert cache.outcomes == {"weights": "miss"} and bf16.embed.weight.dtype == torch.bfloat16


def test_a_truncated_weights_file_is_ignored_and_rebuilt(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = LoadCache(tmp_path / "cache")
    parsed = load_gguf(gguf_file, dtype=torch.float32, cache=cache)
    weights = cache.folder(weights_key(cache.source_sha256(gguf_file), torch.float32)) / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    calls = ReaderCalls(monkeypatch)
    again = LoadCache(tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="llm_shared.load_cache"):
        assert_same_model(load_gguf(gguf_file, dtype=torch.float32, cache=again), parsed)
    assert calls.count == 1 and again.outcomes == {"weights": "miss"}
    assert any("ignoring the weights entry" in r.getMessage() and "bytes" in r.getMessage() for r in caplog.records)

    calls.forbid = True  # the rebuilt entry is whole again
    assert_same_model(load_gguf(gguf_file, dtype=torch.float32, cache=LoadCache(tmp_path / "cache")), parsed)


def test_with_the_cache_off_every_load_parses_and_nothing_is_written(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(SWITCH_ENV, "off")
    calls = ReaderCalls(monkeypatch)
    for _ in range(2):
        load_gguf(gguf_file, dtype=torch.float32, cache=LoadCache.from_env())
    assert calls.count == 2 and not (tmp_path / "cache").exists()


def test_model_arguments_survive_the_header() -> None:
    args = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=112, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1.25e-6, rope_theta=500000.0,
                     rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
                     rope_freq_factors=tuple(1.0 + i / 7 for i in range(8)), tie_word_embeddings=True,
                     max_position_embeddings=131072)
    assert args_from_json(args_to_json(args)) == args
