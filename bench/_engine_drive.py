"""Driving an in-process LLMEngine for bench/engine.py: workloads, open- and closed-loop runs
with per-token wall-clock times, and KV occupancy sampled after every step."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine_gpu.engine import LLMEngine
from engine_gpu.outputs import RequestOutput
from llm_shared.contract import SamplingParams


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    output_len: int  # fixed with ignore_eos, so every arm generates exactly this many tokens

    def params(self, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens or self.output_len, ignore_eos=True)


def make_requests(n: int, seed: int, *, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  vocab: int, prefix: Sequence[int] = ()) -> list[Req]:
    """Random token prompts (lengths uniform in the inclusive ranges) after an optional shared prefix."""
    rng = random.Random(seed)
    return [
        Req([*prefix, *(rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len)))], rng.randint(*output_len))
        for _ in range(n)
    ]


@dataclass
class Trace:
    added: float  # seconds since the run started
    token_times: list[float] = field(default_factory=list)
    done: float | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.added

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


StepHook = Callable[[LLMEngine, list[RequestOutput]], None]


def _record(traces: dict[str, Trace], outputs: list[RequestOutput], now: float) -> list[str]:
    finished = []
    for out in outputs:
        trace = traces[out.request_id]
        trace.token_times += [now] * len(out.tokens)
        if out.finish is not None:
            trace.done = now
            finished.append(out.request_id)
    return finished


def run_open(engine: LLMEngine, arrivals: Sequence[tuple[float, str, list[int], SamplingParams]],
             on_step: StepHook | None = None) -> tuple[dict[str, Trace], float]:
    """Add each request at its arrival time (seconds from start); run until all finish.
    Returns the traces and the wall time."""
    pending = sorted(arrivals, key=lambda a: a[0])
    traces: dict[str, Trace] = {}
    start = time.perf_counter()
    i = 0
    while i < len(pending) or engine.has_unfinished():
        now = time.perf_counter() - start
        while i < len(pending) and pending[i][0] <= now:
            _, rid, prompt, params = pending[i]
            engine.add_request(rid, prompt, params)
            traces[rid] = Trace(added=time.perf_counter() - start)
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[i][0] - now))  # idle until the next arrival
            continue
        outputs = engine.step()
        _record(traces, outputs, time.perf_counter() - start)
        if on_step is not None:
            on_step(engine, outputs)
    return traces, time.perf_counter() - start


def run_all_at_once(engine: LLMEngine, reqs: Sequence[Req], tag: str, *, max_tokens: Sequence[int] | None = None,
                    on_step: StepHook | None = None) -> tuple[dict[str, Trace], float]:
    arrivals = [(0.0, f"{tag}-{k}", r.prompt, r.params(max_tokens[k] if max_tokens else None))
                for k, r in enumerate(reqs)]
    return run_open(engine, arrivals, on_step)


def run_closed(engine: LLMEngine, reqs: Sequence[Req], concurrency: int, tag: str) -> tuple[dict[str, Trace], float]:
    """Keep ``concurrency`` requests in flight: each finish admits the next request."""
    traces: dict[str, Trace] = {}
    start = time.perf_counter()
    queue = list(enumerate(reqs))

    def admit() -> None:
        k, r = queue.pop(0)
        rid = f"{tag}-{k}"
        engine.add_request(rid, r.prompt, r.params())
        traces[rid] = Trace(added=time.perf_counter() - start)

    for _ in range(min(concurrency, len(queue))):
        admit()
    while engine.has_unfinished():
        for _ in _record(traces, engine.step(), time.perf_counter() - start):
            if queue:
                admit()
    return traces, time.perf_counter() - start


@dataclass
class KVPeak:
    """KV occupancy after each step: blocks held by live requests vs the tokens they store."""

    blocks: int = 0
    tokens: int = 0
    block_size: int = 16
    samples: int = 0

    def __call__(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        plan = engine.last_plan
        if plan is None:
            return
        finished = {o.request_id for o in outputs if o.finish is not None}
        live = [s for s in plan.scheduled if s.request_id not in finished]
        stats = engine.scheduler.stats()
        if len(live) != stats.running:
            return  # a running request sat this step out: its stored tokens are unknown here
        self.samples += 1
        if stats.kv_blocks_in_use > self.blocks:
            self.blocks = stats.kv_blocks_in_use
            self.tokens = sum(s.start_pos + len(s.token_ids) for s in live)  # KV written so far
            self.block_size = engine.runner.block_size

    @property
    def waste(self) -> float:
        allocated = self.blocks * self.block_size
        return (allocated - self.tokens) / allocated if allocated else 0.0


def output_tokens(traces: dict[str, Trace]) -> int:
    return sum(len(t.token_times) for t in traces.values())
