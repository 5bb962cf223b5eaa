"""One engine step's speculation: ask the drafter, hand drafts to the scheduler, learn from the result.

``LLMEngine.step`` calls ``prepare`` before scheduling (drafts for the decoding sequences the
controller lets draft), passes the round's draft distributions and seeds to the runner, which
verifies them in the same forward as every other token of the step, then calls ``finish`` with
what each sequence emitted. The drafter's per-request state is dropped with ``release`` when a
request ends, however it ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_gpu.config import SpeculativeConfig
from engine_gpu.sampler import SampledToken, Sampler
from engine_gpu.scheduler import Scheduler
from engine_gpu.speculative.controller import SpecController
from engine_gpu.speculative.drafter import Drafter, DraftRequest
from engine_gpu.speculative.ngram import NgramDrafter
from llm_shared.load_cache import LoadCache
from llm_shared.modelfile import resolve_source
from llm_shared.models import ModelConfig
from llm_shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class Round:
    """What one step drafted."""

    batch_size: int = 0  # decoding sequences when the step was planned
    speculated: bool = False
    probs: dict[str, torch.Tensor | None] = field(default_factory=dict)
    seeds: dict[str, int] = field(default_factory=dict)
    proposed: dict[str, int] = field(default_factory=dict)  # drafts the scheduler took, per request
    decoding: set[str] = field(default_factory=set)
    catchup_seconds: float = 0.0  # feeding the drafter sequences that were far behind (one-off)
    draft_seconds: float = 0.0  # the drafter's rounds
    draft_positions: int = 0


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter) -> None:
        self.config = config
        self.drafter = drafter
        self.controller = SpecController(config)
        self._proposed = 0
        self._accepted = 0
        self._rounds_with_drafts = 0
        self._emitted_in_rounds = 0

    def prepare(self, scheduler: Scheduler, sampler: Sampler) -> Round:
        decoding = scheduler.decoding()
        round_ = Round(batch_size=len(decoding), decoding={seq.request_id for seq in decoding})
        if not self.controller.speculate(len(decoding)):
            return round_
        round_.speculated = True
        requests = []
        for seq in decoding:
            k = min(self.controller.draft_len(seq.request_id, len(decoding)), seq.draft_room)
            if k > 0:
                seed = sampler.seed_for(seq.params)
                round_.seeds[seq.request_id] = seed
                requests.append(DraftRequest(seq.request_id, seq.token_ids, k, seq.params, seed, seq.num_output_tokens))
        if not requests:
            return round_
        started = time.perf_counter()
        drafts = self.drafter.propose(requests)
        round_.catchup_seconds = self.drafter.last_catchup_seconds
        round_.draft_seconds = time.perf_counter() - started - round_.catchup_seconds
        round_.draft_positions = max(r.k for r in requests)
        for request_id, draft in drafts.items():
            kept = scheduler.set_draft_tokens(request_id, draft.token_ids)
            if kept:
                round_.proposed[request_id] = kept
                round_.probs[request_id] = draft.probs[:kept] if draft.probs is not None else None
        return round_

    def finish(self, round_: Round, sampled: dict[str, list[SampledToken]], seconds: float) -> None:
        """Learn from a step: acceptance per sequence, and the step's rate for the switch."""
        emitted = 0
        for request_id in round_.decoding:
            tokens = sampled.get(request_id)
            if tokens is None:
                continue
            emitted += len(tokens)
            proposed = round_.proposed.get(request_id, 0)
            if proposed:
                accepted = len(tokens) - 1
                self.controller.observe_round(request_id, proposed, accepted)
                self._proposed += proposed
                self._accepted += accepted
                self._rounds_with_drafts += 1
                self._emitted_in_rounds += len(tokens)
        most = max(round_.proposed.values(), default=0)  # the round's verification width
        self.controller.observe_step(round_.batch_size, round_.speculated, emitted, seconds - round_.catchup_seconds,
                                     draft_seconds=round_.draft_seconds, draft_positions=round_.draft_positions,
                                     verify_width=most)

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)
        self.controller.forget(request_id)

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

    def close(self) -> None:
        self.drafter.close()


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
                              n_threads=config.draft_threads, target_tokenizer=target_tokenizer,
                              tokenizer_cache=cache)
    log.info("speculative decoding: %s drafter, up to %d drafts, off above %d decoding sequences%s",
             drafter.name, config.num_draft_tokens, config.max_batch,
             ", adaptive" if config.adaptive else "")
    return Speculator(config, drafter)
