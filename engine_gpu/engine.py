"""The in-process torch engine: a scheduler, a model runner and per-request text streams.

``step()`` is schedule, execute, update; timing, detokenization and stop strings wrap it.
The core process runs this loop behind a socket; benchmarks and exactness tests drive it
directly, with no process in between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from engine_gpu.config import EngineConfig
from engine_gpu.outputs import RequestOutput
from engine_gpu.runner import ModelRunner, SampledToken, StepResult
from engine_gpu.sched_output import RequestUpdate, SchedulerOutput
from engine_gpu.scheduler import Scheduler
from engine_gpu.speculative.speculator import Speculator, build_speculator
from llm_shared.contract import FinishEvent, FinishReason, Priority, SamplingParams, TokenEvent
from llm_shared.load_cache import LoadCache
from llm_shared.models import ModelConfig, tokenizer_for
from llm_shared.structured import RequestMatchers, SequenceMatcher, allocate_bitmask
from llm_shared.textstream import TextStream
from llm_shared.tokenizer import Tokenizer

log = logging.getLogger("engine_gpu.engine")

STEP_TIME_EMA = 0.1  # weight of the newest step in the smoothed step time


@dataclass
class _Request:
    """What the engine keeps per request besides the scheduler's state."""

    stream: TextStream
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0  # sampled tokens, the EOS or stop token included
    error: str = ""  # why the engine ended it, for its FinishEvent


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig,
                 *, model_cfg: ModelConfig | None = None, speculator: Speculator | None = None) -> None:
        if config.max_model_len > runner.max_position:
            # Positions past what the model was built for would run, but produce garbage.
            log.info("max_model_len %d capped at the model's %d positions", config.max_model_len, runner.max_position)
            config = replace(config, max_model_len=runner.max_position)
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.model_cfg = model_cfg
        self.last_plan: SchedulerOutput | None = None  # the latest step's plan, for benchmarks and logs
        self.scheduler = Scheduler(config, runner.num_blocks, eos_token_id=tokenizer.eos_id,
                                   vocab_size=runner.vocab_size)
        self.speculator = speculator
        if speculator is not None:
            speculator.calibrate(runner)  # before any request holds blocks: it borrows the first ones
        self._requests: dict[str, _Request] = {}
        self._grammars = RequestMatchers(tokenizer)
        self._constrained: dict[str, SequenceMatcher] = {}  # live requests with a grammar
        # Overlapped steps: a step's outputs (detokenizing, stop strings, events) are made during
        # the next step, after its forward is launched, so that host work runs while the device
        # computes; and a steady decode's next step is planned and launched before this one's
        # tokens are read back.
        self.overlap = config.overlap == "on" or (config.overlap == "auto" and runner.device.type == "cuda")
        self._deferred: tuple[SchedulerOutput, list[RequestUpdate], dict[str, list[SampledToken]]] | None = None
        # Overlapped, a steady decode plans step N+1 while step N runs (Scheduler.schedule_ahead):
        # the plan and its launched forward, taken up by the next step().
        self._ahead: tuple[SchedulerOutput, StepResult] | None = None
        self._steps = 0
        self._steps_ahead = 0  # of those, planned and launched before the previous one's tokens were read
        self._last_step_s = 0.0
        self._avg_step_s = 0.0
        self._generated = 0
        self._thread_changes = 0
        self._threads = runner.threads  # what set_threads last set (the process's count at start)

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, engine_cfg: EngineConfig,
                    draft_model_cfg: ModelConfig | None = None, *, cache: LoadCache | None = None) -> LLMEngine:
        """Load the model (and the drafter ``engine_cfg.speculative`` names; an edge drafter needs
        ``draft_model_cfg``, which ``config.check_engine_models`` resolves), through the load
        cache (default ``LoadCache.from_env()``)."""
        started = time.perf_counter()
        cache = cache if cache is not None else LoadCache.from_env()
        log.info("loading tokenizer of %s", model_cfg.id)
        tokenizer = tokenizer_for(model_cfg, cache=cache)
        log.info("loading model %s (%s, %s on %s)", model_cfg.id, model_cfg.format, engine_cfg.dtype, engine_cfg.device)
        runner = ModelRunner.from_config(model_cfg, engine_cfg, cache=cache)
        log.info("model loaded in %.1f s (%s): %d KV blocks of %d tokens", time.perf_counter() - started,
                 cache.describe(), runner.num_blocks, runner.block_size)
        speculator = build_speculator(engine_cfg.speculative, draft_model_cfg, tokenizer, engine_cfg.max_num_seqs,
                                      cache=cache)
        return cls(runner, tokenizer, engine_cfg, model_cfg=model_cfg, speculator=speculator)

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    priority: Priority = Priority.INTERACTIVE, draft_ids: Sequence[int] = (),
                    cache_salt: str = "") -> None:
        """Queue a request from an in-process caller. The scheduler checks its fields, then this
        engine's limits; raises EmptyPromptError, InvalidRequestError (a malformed field, a token
        outside the vocabulary, a grammar that does not compile), PromptTooLongError,
        DuplicateRequestError or OverloadedError. ``draft_ids`` are verified with the prompt's
        last chunk (``Scheduler.add_request``; under a grammar, their valid prefix); prefix-cache
        hits come only from requests with the same ``cache_salt``."""
        matcher = self._grammars.matcher(params.grammar, params.max_tokens)
        if matcher is not None and draft_ids:  # verified under the grammar: only its valid prefix
            draft_ids = list(draft_ids)[: matcher.valid_prefix_len(list(draft_ids))]
        self.scheduler.add_request(request_id, prompt_ids, params, priority, arrival=time.monotonic(),
                                   draft_ids=draft_ids, cache_salt=cache_salt)
        self._track(request_id, len(prompt_ids), params, matcher)

    def add_checked_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                            priority: Priority, draft_ids: list[int] | None = None, cache_salt: str = "",
                            matcher: SequenceMatcher | None = None) -> None:
        """Queue a request whose fields the core's socket decoder checked; only this engine's limits
        are checked (vocabulary, length, duplicates, load, the grammar), raising as ``add_request`` does.
        ``matcher``: the grammar's, already compiled (``compile_matcher``, on the core's compile thread)."""
        matcher = matcher if matcher is not None else self._grammars.matcher(params.grammar, params.max_tokens)
        if matcher is not None and draft_ids:  # verified under the grammar: only its valid prefix
            draft_ids = draft_ids[: matcher.valid_prefix_len(draft_ids)]
        self.scheduler.add_checked_request(request_id, prompt_ids, params, priority, arrival=time.monotonic(),
                                           draft_ids=draft_ids, cache_salt=cache_salt)
        self._track(request_id, len(prompt_ids), params, matcher)

    def compile_matcher(self, params: SamplingParams) -> SequenceMatcher | None:
        """The request's grammar compiled into a fresh matcher (None without one); SchemaError for
        a grammar that cannot be. Safe off the step thread: it touches only the compiler."""
        return self._grammars.matcher(params.grammar, params.max_tokens)

    def _track(self, request_id: str, prompt_tokens: int, params: SamplingParams,
               matcher: SequenceMatcher | None) -> None:
        self._requests[request_id] = _Request(TextStream(self.tokenizer, params.stop), prompt_tokens=prompt_tokens)
        if matcher is not None:
            self._constrained[request_id] = matcher

    def abort_request(self, request_id: str, reason: FinishReason = "abort", message: str = "") -> RequestOutput | None:
        """Free the request's blocks now; its final output, or None if it is not live."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self._constrained.pop(request_id, None)
        self.scheduler.abort_request(request_id)
        if self.speculator is not None:
            self.speculator.release(request_id, req.completion_tokens)
        return RequestOutput(request_id, [], self._finish(req, reason, text="", message=message))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._deferred is not None or self._ahead is not None

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        spec = self.speculator
        round_ = None
        if self._ahead is not None:  # planned and launched during the previous step
            (plan, result), self._ahead = self._ahead, None
        else:
            round_ = spec.prepare(self.scheduler, self.runner.sampler, self._valid_draft) if spec is not None else None
            plan = self.scheduler.schedule()
            masks = self._masks_for(plan) if self._constrained else None
            if round_ is not None:
                result = self.runner.launch(plan.scheduled, round_.probs, round_.seeds, masks=masks)
            else:
                result = self.runner.launch(plan.scheduled, masks=masks)
        self.last_plan = plan
        if self.overlap and not self._constrained and (spec is None or not spec.controller.prices(len(plan.scheduled))):
            # The next step, launched now behind this one: its tokens come from this step's ids
            # on the device, so the device never waits for the host to plan it.
            ahead = self.scheduler.schedule_ahead(plan)
            if ahead is not None:
                self._ahead = (ahead, self.runner.launch(ahead.scheduled, pending=(result, ahead.source_rows)))
                self._steps_ahead += 1
        deferred_started = time.perf_counter()
        outputs = self._emit_deferred()  # the previous step's, while the device computes this one
        deferred_s = time.perf_counter() - deferred_started
        sampled = result()
        updates = self.scheduler.update_from_output(plan, {
            rid: [tokens[0].token_id] if len(tokens) == 1 else [tok.token_id for tok in tokens]
            for rid, tokens in sampled.items()})
        if self._constrained:
            self._advance_grammars(updates)
        if self.overlap and plan.scheduled:
            self._deferred = (plan, updates, sampled)
        else:
            outputs += self._outputs(plan, updates, sampled)
        seconds = time.perf_counter() - started - deferred_s
        if spec is not None and round_ is not None:
            # requests a deferred stop string ended during this step are gone: nothing to learn
            spec.finish(round_, plan, {rid: t for rid, t in sampled.items() if rid in self._requests}, seconds)
        if spec is not None:
            for out in outputs:
                if out.finish is not None:
                    spec.release(out.request_id, out.finish.completion_tokens)
        self._record_step(seconds)
        return outputs

    def _valid_draft(self, request_id: str, draft: list[int]) -> int:
        """How many of a drafter's tokens may be verified: under a grammar, its valid prefix."""
        matcher = self._constrained.get(request_id)
        return len(draft) if matcher is None else matcher.valid_prefix_len(draft)

    def _masks_for(self, plan: SchedulerOutput) -> Callable[[], dict[str, np.ndarray]]:
        """The grammar masks of the plan's constrained items, made when the runner asks (after it
        queued the forward)."""
        items = [item for item in plan.scheduled if item.sample and item.request_id in self._constrained]

        def fill() -> dict[str, np.ndarray]:
            out: dict[str, np.ndarray] = {}
            for item in items:
                matcher = self._constrained[item.request_id]
                k = item.num_draft_tokens
                bitmask = allocate_bitmask(k + 1, self.tokenizer.vocab_size)  # all allowed: rows past an EOS
                if k:  # a mask for every position the drafts reach, the matcher left where it was
                    matcher.fill_draft_bitmasks(item.token_ids[len(item.token_ids) - k:], bitmask)
                    out[item.request_id] = bitmask
                else:
                    matcher.fill_bitmask(bitmask[0])
                    out[item.request_id] = bitmask[0]
            return out

        return fill

    def _advance_grammars(self, updates: list[RequestUpdate]) -> None:
        """Each constrained request's matcher takes its new tokens (before the next step's masks).
        A token the grammar refuses, or a matcher past its limits, ends the request with an error
        (its update cut to the tokens the grammar took)."""
        for i, update in enumerate(updates):
            matcher = self._constrained.get(update.request_id)
            if matcher is None:
                continue
            if update.finish_reason is not None:
                del self._constrained[update.request_id]
                continue
            taken = 0
            for token_id in update.new_token_ids:
                if not matcher.accept(token_id):
                    break
                taken += 1
            if taken == len(update.new_token_ids) and matcher.error is None:
                continue
            why = matcher.error or "a sampled token left the output grammar"
            log.warning("request %s ends: %s", update.request_id, why)
            del self._constrained[update.request_id]
            self.scheduler.finish_request(update.request_id, "error")
            self._requests[update.request_id].error = "the output could not be kept to its grammar"
            updates[i] = replace(update, new_token_ids=update.new_token_ids[:taken], finish_reason="error")

    def _emit_deferred(self) -> list[RequestOutput]:
        if self._deferred is None:
            return []
        plan, updates, sampled = self._deferred
        self._deferred = None
        return self._outputs(plan, updates, sampled)

    def _outputs(self, plan: SchedulerOutput, updates: list[RequestUpdate],
                 sampled: dict[str, list[SampledToken]]) -> list[RequestOutput]:
        for request_id, cached in plan.cached_tokens.items():
            if request_id in self._requests:
                self._requests[request_id].cached_tokens = cached
        outputs = []
        for update in updates:
            req = self._requests.get(update.request_id)
            if req is None:
                continue
            tokens: list[TokenEvent] = []
            out = RequestOutput(update.request_id, tokens)
            reason: FinishReason | None = update.finish_reason
            chosen = sampled.get(update.request_id, ())
            push = req.stream.push
            for i, token_id in enumerate(update.new_token_ids):  # a prefix of what the runner emitted
                text, stopped = push(token_id)
                if i < len(chosen) and (picked := chosen[i]).token_id == token_id:
                    tokens.append(TokenEvent(token_id, text, picked.logprob, tuple(picked.top_logprobs)))
                else:
                    tokens.append(TokenEvent(token_id, text, 0.0))
                if stopped:
                    # A stop string ended it: the scheduler frees the blocks; later tokens are dropped.
                    self.scheduler.finish_request(update.request_id, "stop")
                    reason = "stop"
                    break
            req.completion_tokens += len(tokens) + (update.stop_token_id is not None)  # the stop token counts too
            self._generated += len(tokens)
            if reason is not None:
                del self._requests[update.request_id]
                out.finish = self._finish(req, reason, text=req.stream.finish(), message=req.error)
            outputs.append(out)
        return outputs

    def _finish(self, req: _Request, reason: FinishReason, *, text: str, message: str = "") -> FinishEvent:
        return FinishEvent(reason, req.prompt_tokens, req.completion_tokens, req.cached_tokens,
                           text=text, message=message, tier="gpu")

    def _record_step(self, seconds: float) -> None:
        self._steps += 1
        self._last_step_s = seconds
        self._avg_step_s = seconds if self._steps == 1 else (1 - STEP_TIME_EMA) * self._avg_step_s + STEP_TIME_EMA * seconds

    # --- introspection ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def stats(self) -> dict[str, float]:
        out = self.scheduler.stats().as_dict()
        out.update(max_running=float(self.config.max_num_seqs),  # turns that can run at once (engine_backlog)
                   step_time_ms=self._last_step_s * 1e3, step_time_ms_avg=self._avg_step_s * 1e3,
                   steps=float(self._steps), steps_planned_ahead=float(self._steps_ahead),
                   generated_tokens=float(self._generated), threads=float(self._threads),
                   thread_changes=float(self._thread_changes))
        if self.speculator is not None:
            out.update(self.speculator.stats())
        return out

    def set_threads(self, threads: int) -> None:
        """Compute from the next step on ``threads`` threads: torch's intra-op pool (on CUDA its
        thread only launches kernels and stays as it is) and the drafter's, which takes turns with
        it inside a step. The speculation controller's costs follow from the forwards it times."""
        if threads == self._threads:
            return
        self.runner.set_threads(threads)
        if self.speculator is not None:
            self.speculator.set_threads(threads)
        self._threads = threads
        self._thread_changes += 1

    def close(self) -> None:
        """Free what lives outside torch's memory (the drafter's llama.cpp context)."""
        if self.speculator is not None:
            self.speculator.close()

    def info(self) -> dict[str, object]:
        """Static facts a client needs to validate requests cheaply before sending them."""
        return {
            "tier": "gpu",
            "model": self.model_cfg.id if self.model_cfg else "",
            "model_config": asdict(self.model_cfg) if self.model_cfg else {},
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
            "eos_id": self.tokenizer.eos_id,
            "block_size": self.runner.block_size,
            "num_blocks": self.runner.num_blocks,
        }

    # --- convenience for benchmarks and tests ------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 *, prefix: str = "gen") -> list[list[int]]:
        """Run prompts to completion in one batch; the generated token ids of each, in order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"{prefix}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.request_id in tokens:
                    tokens[out.request_id] += [t.token_id for t in out.tokens]
                    if out.finish is not None:
                        pending.discard(out.request_id)
        return [tokens[rid] for rid in ids]
