"""Parts of bench/spec.py: the chat and copy workloads, a drafter wrapper that times every
``propose`` call, an engine driver that times every step, the verification cost of ``j`` draft
tokens measured on the runner itself, and the plot."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine_gpu.engine import LLMEngine
from engine_gpu.runner import ModelRunner
from engine_gpu.sched_output import ScheduledSeq
from engine_gpu.speculative.drafter import Draft, Drafter, DraftRequest
from llm_shared.contract import SamplingParams
from llm_shared.tokenizer import Tokenizer

_TASKS = ("Explain {} to a ten-year-old.", "Write a short story about {}.", "List five facts about {}.",
          "What are the pros and cons of {}?")
_TOPICS = ("volcanoes", "the moon", "bicycles", "coffee", "honeybees", "rain", "chess", "the internet")

_PARAGRAPHS = (
    "The lighthouse stood at the edge of the island for more than two hundred years. Every night its keeper "
    "climbed the spiral stairs, trimmed the wick and wound the clockwork that turned the great lens. Ships "
    "passing in the dark counted its flashes to know where they were, and fishermen coming home late said "
    "that the light felt like a hand on the shoulder, telling them the harbour was near.",
    "To make bread, mix five hundred grams of flour with ten grams of salt and seven grams of yeast. Add three "
    "hundred and fifty millilitres of warm water and knead the dough for ten minutes until it is smooth. Leave "
    "it to rise for an hour, shape it into a loaf, let it rise again for forty minutes, then bake it at two "
    "hundred and twenty degrees for thirty minutes until the crust is golden.",
)
_CODE = (
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError(\"window must be positive\")\n"
    "    averages = []\n"
    "    total = 0.0\n"
    "    for i, value in enumerate(values):\n"
    "        total += value\n"
    "        if i >= window:\n"
    "            total -= vaules[i - window]\n"
    "        if i >= window - 1:\n"
    "            averages.append(total / window)\n"
    "    return averages\n"
)


def chat_prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    """``n`` chat prompts (the template's default system prompt, one user question), cycling
    through 32 questions in a fixed shuffled order."""
    texts = [task.format(topic) for topic, task in itertools.product(_TOPICS, _TASKS)]
    random.Random(0).shuffle(texts)
    return [tokenizer.encode_chat([{"role": "user", "content": texts[k % len(texts)]}]) for k in range(n)]


def copy_prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    """Chat prompts whose answer mostly copies the prompt: two texts to repeat, one typo to fix."""
    texts = [f"Repeat the following text exactly:\n\n{p}" for p in _PARAGRAPHS]
    texts.append(f"Fix the typo in this code and print the whole corrected function:\n\n```python\n{_CODE}```")
    return [tokenizer.encode_chat([{"role": "user", "content": texts[k % len(texts)]}]) for k in range(n)]


@dataclass
class ProposeCall:
    seconds: float
    positions: int  # draft rounds in the call: the largest k asked for
    drafted: int  # draft tokens returned, all requests together
    first: bool  # some request's first call: its whole prompt was fed to the drafter too


class TimedDrafter:
    """A ``Drafter`` that times every ``propose`` of the one it wraps. Several arms share one
    edge drafter (one llama.cpp model); each arm wraps it, and counters are the arm's own."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: list[ProposeCall] = []
        self._seen: set[str] = set()
        self._base = dict(inner.stats())

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        first = any(r.request_id not in self._seen for r in requests)
        self._seen.update(r.request_id for r in requests)
        started = time.perf_counter()
        out = self.inner.propose(requests)
        seconds = time.perf_counter() - started
        self.calls.append(ProposeCall(seconds, max(r.k for r in requests), sum(len(d.token_ids) for d in out.values()),
                                      first))
        return out

    @property
    def last_forwards(self) -> list[tuple[int, float]]:
        return self.inner.last_forwards

    def behind(self, request_id: str, token_ids: Sequence[int]) -> int:
        return self.inner.behind(request_id, token_ids)

    def calibrate(self) -> list[tuple[int, float]]:
        return self.inner.calibrate()

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def stats(self) -> dict[str, float]:
        gauges = ("drafter_slots_in_use", "drafter_kv_cells_used", "drafter_kv_cells_total", "drafter_requests")
        return {k: v if k in gauges else v - self._base.get(k, 0.0) for k, v in self.inner.stats().items()}

    def close(self) -> None:
        pass  # the shared drafter is closed once, by its owner

    def steady_seconds_per_position(self) -> tuple[float, int]:
        """Mean seconds per draft round over calls that fed no new prompt, and how many calls."""
        steady = [c for c in self.calls if not c.first and c.positions > 0]
        positions = sum(c.positions for c in steady)
        return (sum(c.seconds for c in steady) / positions if positions else 0.0), len(steady)


@dataclass
class Run:
    outputs: list[list[int]]  # generated token ids per prompt, in prompt order
    seconds: float  # from the first add_request to the last token
    steps: list[tuple[float, bool]] = field(default_factory=list)  # (seconds, every scheduled sequence decoded)

    @property
    def decode_step_s(self) -> list[float]:
        return [t for t, decode in self.steps if decode]

    @property
    def other_step_s(self) -> list[float]:
        """Steps with prompt tokens in them (at concurrency 1: the prefill)."""
        return [t for t, decode in self.steps if not decode]

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def drive(engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int, tag: str) -> Run:
    """Add every prompt at once (greedy, ignore_eos, ``max_tokens`` each) and step until all finish."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{k}" for k in range(len(prompts))]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    steps: list[tuple[float, bool]] = []
    started = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - t
        plan = engine.last_plan
        if plan is not None and plan.scheduled:
            steps.append((seconds, all(len(s.token_ids) == s.num_draft_tokens + 1 for s in plan.scheduled)))
        for out in outs:
            outputs[out.request_id] += [tok.token_id for tok in out.tokens]
    return Run([outputs[rid] for rid in ids], time.perf_counter() - started, steps)


def verify_step_times(runner: ModelRunner, prompt: list[int], continuation: list[int], k: int,
                      reps: int) -> list[float]:
    """Median seconds of ``runner.execute`` at batch 1 with ``j`` draft tokens (``j + 1`` query
    tokens), for j = 0..k, mid-way through a real greedy continuation (its next tokens serve as
    drafts, so all are accepted). Uses the first blocks of the runner's pool: call it only while
    no engine holds requests, and with prefix caching off in every engine."""
    m = max(0, min(len(continuation) // 2, len(continuation) - k - 1))
    if m + k + 1 > len(continuation):
        raise ValueError(f"a continuation of {len(continuation)} tokens is too short for {k} drafts")
    context = [*prompt, *continuation[:m]]
    start = len(context)
    table = list(range(-(-(start + k + 1) // runner.block_size)))
    greedy = SamplingParams(temperature=0.0)
    runner.execute([ScheduledSeq("verify-cost", context, 0, table, True, 0, greedy, 0)])
    last, drafts = continuation[m], continuation[m + 1 : m + 1 + k]
    times: list[list[float]] = [[] for _ in range(k + 1)]
    for r in range(reps):
        for j in range(k + 1) if r % 2 == 0 else range(k, -1, -1):  # alternate the order: no j always first
            item = ScheduledSeq("verify-cost", [last, *drafts[:j]], start, table, True, j, greedy, m)
            t = time.perf_counter()
            runner.execute([item])
            times[j].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def plot(by_concurrency: dict[int, float], c1_fixed: float, max_batch: int, k: int, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted(by_concurrency)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(xs, [by_concurrency[c] for c in xs], marker="o", label=f"edge drafter, adaptive (k <= {k})")
    ax.plot([1], [c1_fixed], marker="s", linestyle="none", color="tab:green", label=f"edge drafter, fixed k = {k}")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.axvline(max_batch, color="tab:red", linestyle=":", linewidth=1, label=f"max_batch = {max_batch} (off above)")
    ax.set(xscale="log", xlabel="concurrent requests", ylabel="tokens/s vs no speculation", title=title)
    ax.set_xticks(xs, [str(c) for c in xs])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
