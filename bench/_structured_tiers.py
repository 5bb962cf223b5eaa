"""The two tiers as bench/structured.py drives them: the torch engine and the edge worker in this process, each run to its outputs with and without grammars."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from bench._common import (
    progress,
)
from bench._spec_drive import TimedDrafter
from engine_edge import create_backend
from engine_edge.config import EdgeConfig
from engine_gpu.config import SpeculativeConfig
from engine_gpu.engine import LLMEngine
from engine_gpu.runner import ModelRunner
from engine_gpu.speculative.speculator import Speculator, build_speculator
from gateway.config import DEFAULT_CONFIG, load_config
from llm_shared.contract import FinishEvent, SamplingParams, TokenEvent
from llm_shared.modelfile import default_gguf_path
from llm_shared.models import tokenizer_for


@dataclass
class Out:
    text: str = ""
    finish: str = ""
    times: list[float] = field(default_factory=list)  # when each token arrived, seconds since the run began


def steady_tok_s(outs: Sequence[Out]) -> float:
    """Tokens/s while every sequence of the batch decodes: from the last one's first token to the
    first one's last (prefill and the ragged end left out)."""
    begin = max(o.times[0] for o in outs)
    end = min(o.times[-1] for o in outs)
    tokens = sum(sum(begin < t <= end for t in o.times) for o in outs)
    return tokens / (end - begin)


class Torch:
    """The torch tier's model and KV pool, one llama.cpp drafter, and a fresh engine for each run
    (a fresh scheduler: prefix caching never finds another run's blocks)."""

    def __init__(self, threads: int, drafter_threads: int, dtype: str) -> None:
        config = load_config(DEFAULT_CONFIG)
        self.base = replace(config.engine, dtype=dtype, device="cpu", threads=threads, speculative=SpeculativeConfig())
        self.model_cfg = config.model(self.base.model)
        progress(f"torch tier: loading {self.model_cfg.id} in {dtype}, {threads} threads, and the edge drafter "
                 f"({drafter_threads} threads)")
        self.tokenizer = tokenizer_for(self.model_cfg)
        self.runner = ModelRunner.from_config(self.model_cfg, self.base)
        self.draft_model = config.engine.speculative.draft_model
        drafting = SpeculativeConfig(method="edge", draft_model=self.draft_model, draft_threads=drafter_threads)
        edge = build_speculator(drafting, config.model(self.draft_model), self.tokenizer, self.base.max_num_seqs)
        assert edge is not None
        self.drafter = edge.drafter

    def engine(self, speculative: bool) -> LLMEngine:
        if not speculative:
            return LLMEngine(self.runner, self.tokenizer, self.base, model_cfg=self.model_cfg)
        spec = SpeculativeConfig(method="edge", draft_model=self.draft_model, num_draft_tokens=4, adaptive=False)
        return LLMEngine(self.runner, self.tokenizer, replace(self.base, speculative=spec), model_cfg=self.model_cfg,
                         speculator=Speculator(spec, TimedDrafter(self.drafter)))

    def run(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], engine: LLMEngine | None = None,
            tag: str = "run") -> list[Out]:
        engine = engine or self.engine(False)
        outs = {f"{tag}-{i}": Out() for i in range(len(prompts))}
        for (rid, _), prompt, p in zip(outs.items(), prompts, params, strict=True):
            engine.add_request(rid, prompt, p)
        started = time.perf_counter()
        pending = set(outs)
        while pending:
            for result in engine.step():
                now = time.perf_counter() - started
                out = outs[result.request_id]
                for token in result.tokens:
                    out.text += token.text
                    out.times.append(now)
                if result.finish is not None:
                    out.text += result.finish.text
                    out.finish = result.finish.reason
                    pending.discard(result.request_id)
        return list(outs.values())

    def close(self) -> None:
        self.drafter.close()


class Edge:
    def __init__(self, threads: int) -> None:
        progress(f"edge tier: loading the llama.cpp backend, {threads} threads")
        # 512 MiB of KV: 8 tool prompts of ~700 tokens and their answers fit at once.
        self.backend = create_backend(EdgeConfig(kv_cache_mib=512, n_seq_max=8, n_threads=threads, prefix_reuse=False),
                                      default_gguf_path())
        self.tokenizer = self.backend.tokenizer
        self._runs = 0

    def run(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], tag: str = "run") -> list[Out]:
        self._runs += 1

        async def one(rid: str, prompt: list[int], p: SamplingParams, started: float) -> Out:
            out = Out()
            async for event in self.backend.generate(rid, prompt, p):
                if isinstance(event, TokenEvent):
                    out.text += event.text
                    out.times.append(time.perf_counter() - started)
                else:
                    assert isinstance(event, FinishEvent)
                    out.text += event.text
                    out.finish = event.reason
            return out

        async def main() -> list[Out]:
            gate = asyncio.Semaphore(32)  # within the backend's queue (n_seq_max + max_queued)

            async def gated(rid: str, prompt: list[int], p: SamplingParams) -> Out:
                async with gate:
                    return await one(rid, prompt, p, started)

            started = time.perf_counter()
            return list(await asyncio.gather(*(gated(f"{tag}-{self._runs}-{i}", prompt, p)
                                               for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)))))

        return asyncio.run(main())

    def close(self) -> None:
        asyncio.run(self.backend.close())
