"""Fixed-shape decode steps over persistent buffers (engine_gpu.graph_runner), run eagerly on CPU:
the same buffers, bucketing and padding a CUDA graph replays, checked against the step-sized path."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from runner_batches import scheduled
from tiny_checkpoint import random_weights, tiny_config, write_hf_checkpoint
from tiny_engine import write_tiny_model

from engine_gpu.config import EngineConfig
from engine_gpu.engine import LLMEngine
from engine_gpu.graph_runner import GraphRunner, capture_sizes, graphs_wanted
from engine_gpu.kv_cache import PagedKVCache
from engine_gpu.runner import ModelRunner
from engine_gpu.sched_output import ScheduledSeq
from llm_shared.contract import SamplingParams
from llm_shared.errors import ConfigError
from llm_shared.llama.loader import load_safetensors
from llm_shared.llama.model import LlamaModel

BLOCK = 8
MAX_LEN = 96  # 12 blocks a table row
TOL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    config = tiny_config()
    directory = write_hf_checkpoint(tmp_path_factory.mktemp("hf"), config, random_weights(config, seed=5))
    return load_safetensors(directory, dtype=torch.float32)


def runner_pair(model: LlamaModel, max_batch: int = 12) -> tuple[ModelRunner, ModelRunner]:
    """Two runners on pools of the same contents: step-sized eager, and fixed-shape decode."""
    def make(scratch: bool) -> ModelRunner:
        cache = PagedKVCache.for_model(model.args, block_size=BLOCK, dtype=torch.float32, device="cpu",
                                       num_blocks=48, scratch=scratch)
        return ModelRunner(model, cache, device="cpu", dtype=torch.float32, attention_backend="torch")

    eager, fixed = make(False), make(True)
    fixed.enable_decode_graphs(max_batch, MAX_LEN)
    return eager, fixed


def prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (count,), generator=g)]


def tables(lengths: list[int], reserve: int = 0) -> list[list[int]]:
    """Disjoint block tables, deliberately out of order, covering each length (plus reserve tokens)."""
    out, next_block = [], 47
    for n in lengths:
        need = -(-(n + reserve) // BLOCK)
        out.append(list(range(next_block, next_block - need, -1)))
        next_block -= need
    return out


def prefill(runner: ModelRunner, ids: list[list[int]], table: list[list[int]]) -> None:
    runner.execute([scheduled(f"r{i}", p, 0, t) for i, (p, t) in enumerate(zip(ids, table, strict=True))])


def decode_batch(ids: list[list[int]], table: list[list[int]], nxt: list[int]) -> list[ScheduledSeq]:
    return [scheduled(f"r{i}", [t], len(p), tb) for i, (p, tb, t) in enumerate(zip(ids, table, nxt, strict=True))]


def test_the_size_ladder() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(33) == [1, 2, 4, 8, 16, 24, 32, 40]
    ladder = capture_sizes(256)
    assert ladder[:12] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80] and ladder[-1] == 256
    assert all(b - a == 16 for a, b in itertools.pairwise(ladder[10:]))
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_buckets_pad_up_to_the_next_size(model: LlamaModel) -> None:
    _, fixed = runner_pair(model, max_batch=12)
    graphs = fixed.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16]
    assert [graphs.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError):
        graphs.bucket(17)
    assert graphs.covers([1, 1], [5, 9]) and not graphs.covers([1, 2], [5, 9])  # a verify step stays eager
    assert not graphs.covers([1], [MAX_LEN + 1]) and not graphs.covers([1] * 17, [4] * 17)


@pytest.mark.parametrize("batch", [1, 3, 5, 9])
def test_decode_at_a_padded_size_equals_the_step_sized_path(model: LlamaModel, batch: int) -> None:
    eager, fixed = runner_pair(model)
    ids = prompts(batch, seed=batch)
    table = tables([len(p) for p in ids], reserve=8)
    for runner in (eager, fixed):
        prefill(runner, ids, table)
    nxt = [(7 * i + 3) % 96 for i in range(batch)]
    for step in range(3):  # several steps: buffers refilled in place, tables growing past block edges
        want = eager.execute_logits(decode_batch(ids, table, nxt))
        got = fixed.execute_logits(decode_batch(ids, table, nxt))
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=TOL, rtol=TOL)
        ids = [[*p, t] for p, t in zip(ids, nxt, strict=True)]
        nxt = [(t * 5 + step) % 96 for t in nxt]


def test_stale_rows_of_a_larger_step_never_reach_a_smaller_one(model: LlamaModel) -> None:
    eager, fixed = runner_pair(model)
    ids = prompts(7, seed=11)
    table = tables([len(p) for p in ids], reserve=4)
    nxt = list(range(10, 17))
    for runner in (eager, fixed):
        prefill(runner, ids, table)
        runner.execute_logits(decode_batch(ids, table, nxt))  # fixed: 7 real rows of size 8
    ids = [[*p, t] for p, t in zip(ids, nxt, strict=True)]
    smaller = decode_batch(ids[:3], table[:3], [20, 21, 22])  # size 4: row 3 was real a step ago
    want = eager.execute_logits(smaller)
    got = fixed.execute_logits(smaller)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=TOL, rtol=TOL)
    graphs = fixed.graphs
    assert graphs is not None
    assert graphs.input_ids[3:8].tolist() == [0] * 5 and graphs.context_lens[3:8].tolist() == [1] * 5
    assert graphs.slot_mapping[3:8].tolist() == [fixed.kv_cache.scratch_slot] * 5


def test_padded_rows_write_only_the_scratch_block(model: LlamaModel) -> None:
    _, fixed = runner_pair(model)
    ids = prompts(3, seed=2)
    table = tables([len(p) for p in ids], reserve=2)
    prefill(fixed, ids, table)
    cache = fixed.kv_cache
    before_k, before_v = cache.k.clone(), cache.v.clone()
    fixed.execute(decode_batch(ids, table, [5, 6, 7]))  # 3 real rows at size 4: one padded row
    real = {tb[len(p) // BLOCK] * BLOCK + len(p) % BLOCK for p, tb in zip(ids, table, strict=True)}
    scratch = set(range(cache.scratch_slot, cache.scratch_slot + BLOCK))
    for before, after in ((before_k, cache.k), (before_v, cache.v)):
        changed = (before != after).any(dim=-1)  # [layers, KVH, blocks, block_size]
        slots = changed.any(dim=0).any(dim=0).flatten().nonzero().squeeze(1).tolist()
        assert set(slots) - scratch == real


def test_a_step_makes_no_tensor_and_reuses_its_buffers(model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    _, fixed = runner_pair(model)
    graphs = fixed.graphs
    assert graphs is not None
    ids = prompts(5, seed=4)
    table = tables([len(p) for p in ids], reserve=8)
    prefill(fixed, ids, table)
    buffers = (graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.block_table, graphs.context_lens)
    pointers = [b.data_ptr() for b in buffers]

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor was built from Python data while filling a step")

    staging = graphs._stagings[0]  # on a CPU the one staging set is the buffers themselves
    with monkeypatch.context() as patch:
        patch.setattr(torch, "tensor", refuse)
        patch.setattr(torch, "as_tensor", refuse)
        staging.fill([1, 2, 3, 4, 5], [len(p) for p in ids], table, graphs.block_size)
    fixed.execute(decode_batch(ids, table, [1, 2, 3, 4, 5]))
    assert [b.data_ptr() for b in buffers] == pointers
    assert graphs.positions[:5].tolist() == [len(p) for p in ids]
    assert graphs.context_lens[:5].tolist() == [len(p) + 1 for p in ids]


def test_settings_and_what_they_need(model: LlamaModel) -> None:
    cpu = torch.device("cpu")
    eager, _ = runner_pair(model)
    backend = eager.attention_backend
    assert not graphs_wanted("auto", cpu, backend)  # CPU serving keeps the step-sized path
    assert graphs_wanted("on", cpu, backend) and not graphs_wanted("off", cpu, backend)
    with pytest.raises(ValueError, match="scratch block"):
        GraphRunner(model, eager.kv_cache, backend, max_batch=4, max_model_len=MAX_LEN)

    class NoFixedShapes:
        name = "other"
        kv_layout = "heads_first"

    with pytest.raises(ConfigError, match="no fixed-shape decode path"):
        graphs_wanted("on", cpu, NoFixedShapes())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="sometimes")  # type: ignore[arg-type]


def test_an_engine_on_fixed_shapes_generates_what_the_eager_one_does(tmp_path: Path) -> None:
    """Whole engine, several requests joining and leaving (prefill, mixed and decode steps, a
    shrinking batch), greedy and seeded sampling: the same tokens either way."""
    model_cfg = write_tiny_model(tmp_path, seed=8)
    base = EngineConfig(dtype="float32", block_size=BLOCK, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=6,
                        max_model_len=128, attention="torch")
    outputs = []
    for setting in ("off", "on"):
        engine = LLMEngine.from_config(model_cfg, EngineConfig(**{**base.__dict__, "cuda_graphs": setting}))
        assert (engine.runner.graphs is not None) == (setting == "on")
        params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=0.9, top_p=0.9, seed=40 + i, max_tokens=12, ignore_eos=True)
                  for i in range(5)]
        outputs.append(engine.generate(prompts(5, seed=3), params))
        engine.close()
    assert outputs[0] == outputs[1]
