"""Overlapped steps (engine.overlap): a step's outputs are made during the next step, after its
forward is launched, and a steady decode's next step is planned and launched before this one's
tokens are read back (its input ids taken from this step's picks on the device). On a CPU
nothing runs beside the forward, so what is tested is that the overlapped engine streams exactly
what the serial one does: with chunked prefill, preemption (a pool too small for every request),
stop strings (whose request the overlapped engine has already scheduled once more), stop tokens
(which end a sequence whose next step is already launched) and aborts by a client that has seen
a given number of tokens; with the step-sized path and with the fixed-shape decode buffers."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from tiny_engine import clear_greedy_reference, write_tiny_model

from engine_gpu.config import EngineConfig
from engine_gpu.engine import LLMEngine
from llm_shared.contract import SamplingParams
from llm_shared.models import ModelConfig

ALONE = EngineConfig(dtype="float32", block_size=16, num_blocks=128, max_num_batched_tokens=512, max_num_seqs=1,
                     enable_prefix_caching=False, threads=1)
# 12 requests of up to ~140 tokens in 14 blocks of 16: they preempt one another
BATCHED = replace(ALONE, num_blocks=14, max_num_batched_tokens=48, long_prefill_threshold=8, max_num_seqs=12,
                  enable_prefix_caching=True)
ABORT_AFTER = {"r3": 3, "r7": 1, "r10": 6}  # request -> tokens the client has seen when it cancels
STOP_AT = {"r5": 4, "r9": 7}  # request -> where in its greedy text a stop string is cut from


@pytest.fixture(scope="module")
def model_cfg(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, 96) for _ in range(32)]
    prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(3, 96) for _ in range(rng.randrange(3, 60))]
               for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(12, 48), ignore_eos=True) for _ in prompts]
    return prompts, params


def drive(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, tuple]:
    """Every request to its end; per request: token ids, text, finish reason, completion tokens."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    ids: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    texts = dict.fromkeys(ids, "")
    ends: dict[str, tuple[str, int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            ids[out.request_id] += [t.token_id for t in out.tokens]
            texts[out.request_id] += "".join(t.text for t in out.tokens)
            if out.finish is not None:
                texts[out.request_id] += out.finish.text
                ends[out.request_id] = (out.finish.reason, out.finish.completion_tokens)
        for rid, seen in ABORT_AFTER.items():
            if rid not in ends and len(ids[rid]) >= seen:
                final = engine.abort_request(rid)
                assert final is not None and final.finish is not None
                texts[rid] += final.finish.text
                ends[rid] = (final.finish.reason, final.finish.completion_tokens)
        engine.scheduler.check_invariants()
    stats = engine.stats()
    assert stats["kv_blocks_in_use"] == 0 and stats["running"] == 0
    return {rid: (ids[rid], texts[rid], *ends[rid]) for rid in ids}


def test_overlapped_steps_stream_what_serial_steps_do(model_cfg: ModelConfig) -> None:
    prompts, params = workload()
    alone = LLMEngine.from_config(model_cfg, ALONE)
    reference = clear_greedy_reference(alone, prompts, params)  # every pick clear: batch-proof on any CPU
    for rid, cut in STOP_AT.items():  # a stop string taken from the request's own greedy text
        i = int(rid[1:])
        text = alone.tokenizer.decode(reference[i])
        params[i] = replace(params[i], stop=(text[cut:cut + 2],))
    alone.close()

    runs = {}
    for overlap in ("off", "on"):
        engine = LLMEngine.from_config(model_cfg, replace(BATCHED, overlap=overlap))
        assert engine.overlap is (overlap == "on")
        runs[overlap] = drive(engine, prompts, params)
        assert engine.stats()["preemptions"] > 0  # the pool was too small: preemption was exercised
        assert (engine.stats()["steps_planned_ahead"] > 0) is (overlap == "on")
        engine.close()
    assert runs["on"] == runs["off"]

    serial = runs["off"]
    for i, want in enumerate(reference):
        rid = f"r{i}"
        got, _, reason, completion = serial[rid]
        if rid in ABORT_AFTER:
            assert (got, reason) == (want[:ABORT_AFTER[rid]], "abort")
        elif rid in STOP_AT:
            assert reason == "stop" and got == want[:len(got)] and len(got) < len(want)
        else:
            assert (got, reason, completion) == (want, "length", len(want))


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_steps_planned_ahead_stream_what_serial_steps_do(model_cfg: ModelConfig, graphs: str) -> None:
    """Every request fits: after the prompts, decode steps are planned ahead one after another.
    Stop tokens end three requests at a token no plan foresaw, so their next step ran anyway."""
    prompts, params = workload()
    alone = LLMEngine.from_config(model_cfg, ALONE)
    reference = clear_greedy_reference(alone, prompts, params)
    alone.close()
    stop_at = {}
    for i in (1, 4, 8):  # the first occurrence of a token halfway through the reference
        token = reference[i][len(reference[i]) // 2]
        stop_at[f"r{i}"] = reference[i].index(token)
        params[i] = replace(params[i], stop_token_ids=(token,))
    roomy = replace(BATCHED, num_blocks=128, max_num_batched_tokens=256, cuda_graphs=graphs)
    runs = {}
    for overlap in ("off", "on"):
        engine = LLMEngine.from_config(model_cfg, replace(roomy, overlap=overlap))
        assert (engine.runner.graphs is not None) is (graphs == "on")
        runs[overlap] = drive(engine, prompts, params)
        stats = engine.stats()
        assert stats["preemptions"] == 0
        if overlap == "on":  # most steps: only the prompts' and the first decode's are planned in turn
            assert stats["steps_planned_ahead"] > stats["steps"] / 2
        engine.close()
    assert runs["on"] == runs["off"]
    for i, want in enumerate(reference):
        rid = f"r{i}"
        got, _, reason, completion = runs["on"][rid]
        if rid in ABORT_AFTER:
            assert (got, reason) == (want[:ABORT_AFTER[rid]], "abort")
        elif rid in stop_at:
            assert (got, reason, completion) == (want[:stop_at[rid]], "stop", stop_at[rid] + 1)
        else:
            assert (got, reason, completion) == (want, "length", len(want))


def test_the_last_outputs_come_with_the_step_after_them(model_cfg: ModelConfig) -> None:
    """Overlapped, a step returns the previous step's outputs; the engine stays unfinished until
    they are out, and a request aborted meanwhile streams nothing more."""
    engine = LLMEngine.from_config(model_cfg, replace(BATCHED, overlap="on"))
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    assert engine.step() == []  # the prompts' step: its tokens come with the next step
    second = engine.step()
    assert {o.request_id for o in second} == {"a", "b"} and all(len(o.tokens) == 1 for o in second)
    final = engine.abort_request("b")
    assert final is not None and final.finish is not None and final.finish.completion_tokens == 1
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"a"} and outputs[-1].finish is not None
    assert sum(len(o.tokens) for o in outputs) == 2 and outputs[-1].finish.reason == "length"
    assert engine.stats()["kv_blocks_in_use"] == 0
    engine.close()
