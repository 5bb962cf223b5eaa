"""One engine step's speculation: price the step, ask the drafter, hand drafts to the scheduler,
learn from the result.

``LLMEngine.step`` calls ``prepare`` before scheduling: the controller prices the step from the
decoding sequences (``controller.Candidate``: how far behind the drafter each is, how long it may
still run) and names who drafts how many tokens; the drafter proposes them; the runner verifies
them in the same forward as every other token of the step. ``finish`` then teaches the controller
what the step cost and what each sequence accepted. ``calibrate`` times the target and the
drafter before the first request, so the first step is priced from this machine's figures. The
drafter's per-request state is dropped with ``release`` when a request ends, however it ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine_gpu.config import SpeculativeConfig
from engine_gpu.sampler import SampledToken, Sampler
from engine_gpu.sched_output import ScheduledSeq, SchedulerOutput
from engine_gpu.scheduler import Scheduler
from engine_gpu.speculative.controller import Candidate, SpecController
from engine_gpu.speculative.drafter import Drafter, DraftRequest
from engine_gpu.speculative.ngram import NgramDrafter
from llm_shared.contract import SamplingParams
from llm_shared.load_cache import LoadCache
from llm_shared.modelfile import resolve_source
from llm_shared.models import ModelConfig
from llm_shared.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine_gpu.runner import ModelRunner

log = logging.getLogger(__name__)

CALIBRATION_CONTEXT = 64  # tokens of context the calibration's forwards attend to
CALIBRATION_ID = "spec-calibration"


@dataclass
class Round:
    """What one step drafted."""

    batch_size: int = 0  # decoding sequences when the step was planned
    speculated: bool = False
    probs: dict[str, torch.Tensor | None] = field(default_factory=dict)
    seeds: dict[str, int] = field(default_factory=dict)
    proposed: dict[str, int] = field(default_factory=dict)  # drafts the scheduler took, per request
    draft_seconds: float = 0.0  # the drafter's propose call, catch-up included


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter) -> None:
        self.config = config
        self.drafter = drafter
        self.controller = SpecController(config)
        self._proposed = 0
        self._accepted = 0
        self._rounds_with_drafts = 0
        self._emitted_in_rounds = 0

    def calibrate(self, runner: ModelRunner) -> None:
        """Time the drafter, and decode-like target forwards of 1 token to ``max_batch`` times
        ``k + 1``, before any request: the controller's curves start from this machine's figures.
        Uses the first blocks of the runner's KV pool: call it while no request holds blocks."""
        if not self.config.adaptive or self.config.method == "off":
            return
        started = time.perf_counter()
        self.controller.observe_drafter(self.drafter.calibrate())
        cap = self.config.max_batch * (self.config.num_draft_tokens + 1)
        sizes = sorted({n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n < cap} | {cap})
        for n, seconds in target_forwards(runner, sizes):
            self.controller.observe_target(n, seconds)
        log.info("speculation calibrated in %.2f s: target %s, drafter %s", time.perf_counter() - started,
                 _curve(self.controller.target.points()), _curve(self.controller.drafter.points()))

    def prepare(self, scheduler: Scheduler, sampler: Sampler,
                valid: Callable[[str, list[int]], int] | None = None) -> Round:
        """Price the step, draft, and hand the drafts to the scheduler; ``valid(request_id, draft)``
        says how many leading draft tokens may be verified (an output grammar's valid prefix)."""
        decoding = scheduler.decoding()
        round_ = Round(batch_size=len(decoding))
        if not self.controller.may_speculate(len(decoding)):
            return round_
        drafter = self.drafter
        plan = self.controller.plan([
            Candidate(seq.request_id, seq.draft_room, drafter.behind(seq.request_id, seq.token_ids),
                      seq.params.max_tokens - seq.num_output_tokens) for seq in decoding])
        if not plan:
            return round_
        requests = []
        for seq in decoding:
            k = plan.get(seq.request_id, 0)
            if k > 0:
                seed = sampler.seed_for(seq.params)
                round_.seeds[seq.request_id] = seed
                requests.append(DraftRequest(seq.request_id, seq.token_ids, k, seq.params, seed, seq.num_output_tokens))
        round_.speculated = True
        started = time.perf_counter()
        drafts = drafter.propose(requests)
        round_.draft_seconds = time.perf_counter() - started
        self.controller.observe_drafter(_whole_call(drafter.last_forwards, round_.draft_seconds))
        for request_id, draft in drafts.items():
            tokens = draft.token_ids if valid is None else draft.token_ids[: valid(request_id, list(draft.token_ids))]
            kept = scheduler.set_draft_tokens(request_id, tokens)
            if kept:
                round_.proposed[request_id] = kept
                round_.probs[request_id] = draft.probs[:kept] if draft.probs is not None else None
        return round_

    def finish(self, round_: Round, plan: SchedulerOutput, sampled: dict[str, list[SampledToken]],
               seconds: float) -> None:
        """Learn from a step: acceptance per sequence, and what the target's forward cost."""
        for request_id, proposed in round_.proposed.items():
            tokens = sampled.get(request_id)
            if tokens is None:
                continue
            accepted = len(tokens) - 1
            self.controller.observe_round(request_id, proposed, accepted)
            self._proposed += proposed
            self._accepted += accepted
            self._rounds_with_drafts += 1
            self._emitted_in_rounds += len(tokens)
        if plan.scheduled and all(_decode_like(s) for s in plan.scheduled):  # prompt chunks price otherwise
            self.controller.observe_target(plan.num_scheduled_tokens, seconds - round_.draft_seconds)

    def release(self, request_id: str, output_tokens: int) -> None:
        self.drafter.release(request_id)
        self.controller.observe_finished(request_id, output_tokens)

    def stats(self) -> dict[str, float]:
        out = {
            "spec_draft_tokens": float(self._proposed),
            "spec_accepted_tokens": float(self._accepted),
            "spec_acceptance_rate": self._accepted / self._proposed if self._proposed else 0.0,
            # tokens a round with drafts emits: accepted drafts plus the target's own
            "spec_mean_accepted_len": (self._emitted_in_rounds / self._rounds_with_drafts
                                       if self._rounds_with_drafts else 0.0),
        }
        out.update(self.controller.stats())
        out.update(self.drafter.stats())
        return out

    def set_threads(self, threads: int) -> None:
        self.drafter.set_threads(threads)

    def close(self) -> None:
        self.drafter.close()


def _whole_call(forwards: list[tuple[int, float]], seconds: float) -> list[tuple[int, float]]:
    """The forwards of a propose call, scaled to the whole call's time: what a step pays for
    drafting includes the drafter's own work between forwards (picking each draft from its
    logits, planning its slots), which the forwards' timings leave out."""
    forward_s = sum(s for _, s in forwards)
    if forward_s <= 0 or seconds <= forward_s:
        return forwards
    return [(n, s * seconds / forward_s) for n, s in forwards]


def _decode_like(seq: ScheduledSeq) -> bool:
    """Every token of it is sampled (the last sampled token, then drafts): what a plan prices."""
    return seq.sample and len(seq.token_ids) == seq.num_draft_tokens + 1


def _curve(points: list[tuple[float, float]]) -> str:
    return ", ".join(f"{n:.0f}: {s * 1e3:.1f} ms" for n, s in points) or "none"


def target_forwards(runner: ModelRunner, sizes: list[int], context: int = CALIBRATION_CONTEXT) -> list[tuple[int, float]]:
    """(n, seconds) of a verification-shaped runner forward of ``n`` tokens (all sampled) after
    ``context`` tokens, the faster of two each, on the first blocks of the pool."""
    greedy = SamplingParams(temperature=0.0)
    blocks = -(-(context + max(sizes)) // runner.block_size)
    if blocks > runner.num_blocks:
        return []
    table = list(range(blocks))
    ids = [i % runner.vocab_size for i in range(context + max(sizes))]
    runner.execute([ScheduledSeq(CALIBRATION_ID, ids[:context], 0, table, True, 0, greedy, 0)])
    out = []
    for n in sizes:
        item = ScheduledSeq(CALIBRATION_ID, ids[context : context + n], context, table, True, n - 1, greedy, 1)
        times = []
        for _ in range(2):
            started = time.perf_counter()
            runner.execute([item])
            times.append(time.perf_counter() - started)
        out.append((n, min(times)))
    return out


def build_speculator(config: SpeculativeConfig, draft_model: ModelConfig | None, target_tokenizer: Tokenizer,
                     max_num_seqs: int, *, cache: LoadCache | None = None) -> Speculator | None:
    """The speculator ``config`` asks for (None when off); an edge drafter loads its GGUF here
    (its tokenizer, for the check against the target's, through ``cache`` when given)."""
    if config.method == "off":
        return None
    if config.method == "ngram":
        drafter: Drafter = NgramDrafter(min_n=config.ngram_min, max_n=config.ngram_max)
    else:
        from engine_gpu.speculative.edge_drafter import EdgeDrafter  # llama.cpp only when asked for

        assert draft_model is not None, "check_engine_models resolves the draft model for method = 'edge'"
        path = Path(resolve_source(draft_model.source))
        log.info("loading drafter %s (%s) through llama.cpp", draft_model.id, path.name)
        drafter = EdgeDrafter(path, max_seqs=max_num_seqs, kv_mib=config.draft_kv_mib,
                              n_threads=config.draft_threads, window=config.draft_window,
                              target_tokenizer=target_tokenizer, tokenizer_cache=cache)
    log.info("speculative decoding: %s drafter, up to %d drafts, off above %d decoding sequences%s",
             drafter.name, config.num_draft_tokens, config.max_batch,
             ", each step priced" if config.adaptive else "")
    return Speculator(config, drafter)
