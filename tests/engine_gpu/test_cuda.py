"""On a CUDA device only (``make gpu-check``): the Triton kernel, the decode graphs and the warm-up
where they will serve. Elsewhere every test here is skipped; CI proves the same code on the CPU
(attention_triton_interpreted.py through Triton's interpreter, test_graph_runner.py eagerly).

Only the GPU machine's packages are used (no llama.cpp, no model wheel: random weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runner_batches import scheduled
from tiny_checkpoint import random_weights, tiny_config, write_hf_checkpoint

from engine_gpu.config import EngineConfig
from engine_gpu.kv_cache import PagedKVCache
from engine_gpu.runner import ModelRunner
from engine_gpu.sched_output import ScheduledSeq
from llm_shared.llama.loader import load_safetensors
from llm_shared.llama.model import LlamaModel
from llm_shared.models import ModelConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")
BLOCK = 16
SHAPE = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
         "intermediate_size": 512, "num_hidden_layers": 3, "max_position_embeddings": 2048}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_config(**SHAPE)
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf"), config, random_weights(config, seed=9))


def runner(checkpoint: Path, backend: str, dtype: torch.dtype, *, scratch: bool = False) -> ModelRunner:
    model: LlamaModel = load_safetensors(checkpoint, dtype=dtype, device=CUDA)
    cache = PagedKVCache.for_model(model.args, block_size=BLOCK, dtype=dtype, device=CUDA, num_blocks=256,
                                   scratch=scratch)
    return ModelRunner(model, cache, device=CUDA, dtype=dtype, attention_backend=backend)


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def tables(lengths: list[int]) -> list[list[int]]:
    out, start = [], 200
    for n in lengths:
        need = -(-n // BLOCK)
        out.append(list(range(start, start - need, -1)))  # out of order, as a busy pool hands them out
        start -= need
    return out


def mixed_batch(ids: list[list[int]], table: list[list[int]]) -> list[ScheduledSeq]:
    """A prefill chunk, decodes and a 5-token verification in one step, after the prompts' KV."""
    return [scheduled("chunk", ids[0][40:], 40, table[0]),
            scheduled("decode-1", ids[1][-1:], len(ids[1]) - 1, table[1]),
            scheduled("verify", ids[2][-5:], len(ids[2]) - 5, table[2]),
            scheduled("decode-2", ids[3][-1:], len(ids[3]) - 1, table[3])]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-3), (torch.bfloat16, 6e-2)])
def test_the_triton_kernel_attends_as_the_torch_path_does(checkpoint: Path, dtype: torch.dtype, tol: float) -> None:
    lengths = [300, 17, 645, 1]
    ids = prompts(lengths, seed=1)
    table = tables(lengths)
    logits = []
    for backend in ("torch", "triton"):
        r = runner(checkpoint, backend, dtype)
        r.execute([scheduled(f"p{i}", p[:40] if i == 0 else p[:-5 if i == 2 else -1], 0, t)
                   for i, (p, t) in enumerate(zip(ids, table, strict=True)) if len(p) > 1])
        logits.append(r.execute_logits(mixed_batch(ids, table)))
    for torch_rows, triton_rows in zip(*logits, strict=True):
        torch.testing.assert_close(triton_rows, torch_rows, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_captured_decode_graphs_replay_what_eager_steps_compute(checkpoint: Path, backend: str) -> None:
    eager = runner(checkpoint, backend, torch.float32)
    graphed = runner(checkpoint, backend, torch.float32, scratch=True)
    graphs = graphed.enable_decode_graphs(12, 1024)
    graphed.warm_up()
    assert set(graphs._graphs) == set(graphs.sizes)  # every size captured before any request
    for batch in (1, 3, 9, 12, 5):  # growing and shrinking: stale rows re-padded
        lengths = [20 + 13 * i for i in range(batch)]
        ids = prompts(lengths, seed=batch)
        table = tables([n + 1 for n in lengths])
        for r in (eager, graphed):
            r.execute([scheduled(f"s{i}", p, 0, t) for i, (p, t) in enumerate(zip(ids, table, strict=True))])
        step = [scheduled(f"s{i}", [5 + i], len(p), t) for i, (p, t) in enumerate(zip(ids, table, strict=True))]
        for want, got in zip(eager.execute_logits(step), graphed.execute_logits(step), strict=True):
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_an_engine_on_cuda_is_warm_before_its_first_request(checkpoint: Path, tmp_path: Path) -> None:
    from tiny_engine import write_tiny_tokenizer

    from engine_gpu.engine import LLMEngine
    from llm_shared.contract import SamplingParams

    tokenizer = write_tiny_tokenizer(checkpoint, SHAPE.get("vocab_size", 96))
    cfg = ModelConfig(id="tiny", source=str(checkpoint), format="safetensors", tokenizer=str(tokenizer))
    engine = LLMEngine.from_config(cfg, EngineConfig(device="cuda", dtype="bfloat16", block_size=BLOCK,
                                                     num_blocks=128, max_num_seqs=16, max_model_len=512))
    graphs = engine.runner.graphs
    assert engine.runner.attention_backend.name == "triton" and graphs is not None
    assert set(graphs._graphs) == set(graphs.sizes)
    out = engine.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [len(o) for o in out] == [8, 8, 8] and out[0] == out[1] == out[2]
    engine.close()


def test_steps_planned_ahead_on_cuda_stream_what_serial_steps_do(checkpoint: Path) -> None:
    """The overlapped loop as it serves (decode graphs, the next step launched before this one's
    ids are read back, its input ids taken on the device): the same tokens as the serial loop.
    Requests end only by length, so both loops run the same batches, shape for shape."""
    from tiny_engine import write_tiny_tokenizer

    from engine_gpu.engine import LLMEngine
    from llm_shared.contract import SamplingParams

    tokenizer = write_tiny_tokenizer(checkpoint, SHAPE.get("vocab_size", 96))
    cfg = ModelConfig(id="tiny", source=str(checkpoint), format="safetensors", tokenizer=str(tokenizer))
    ids = prompts([7, 19, 33, 4, 60, 12], seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 7 * i, ignore_eos=True) for i in range(len(ids))]
    runs = {}
    for overlap in ("off", "on"):
        engine = LLMEngine.from_config(cfg, EngineConfig(device="cuda", dtype="float32", block_size=BLOCK,
                                                         num_blocks=128, max_num_seqs=8, max_model_len=512,
                                                         overlap=overlap))
        assert engine.runner.graphs is not None
        runs[overlap] = engine.generate(ids, params)
        assert (engine.stats()["steps_planned_ahead"] > 0) is (overlap == "on")
        engine.close()
    assert runs["on"] == runs["off"]
    assert [len(out) for out in runs["on"]] == [p.max_tokens for p in params]
