"""bench/limits.py's ``edge`` arm: should gateway workers share one edge model or each load its own?

The edge tier is llama.cpp in the gateway process. Sharing one between workers would mean one
context batching every worker's streams on all the edge's threads; each worker's own means one
context per worker on its share of the threads. Both are measured here, as processes of their
own started together: tokens/s summed over the same streams (decoding only, bench/edge.py's
count), and memory (USS: a process's own pages; PSS: the weights' file pages, mapped by every
process, split between them).
"""

from __future__ import annotations

import asyncio
import multiprocessing
from typing import Any

from bench._common import progress


def _context(threads: int, streams: int, tokens: int, start: Any, out: Any) -> None:
    """One process, one llama.cpp context: ``streams`` streams of ``tokens`` tokens, best of two."""
    import psutil

    from bench.edge import decode_rate
    from engine_edge.config import EdgeConfig
    from engine_edge.llama_cpp_backend import LlamaCppBackend
    from llm_shared.modelfile import default_gguf_path

    async def run() -> dict[str, float]:
        engine = LlamaCppBackend(default_gguf_path(), EdgeConfig(n_seq_max=max(8, streams), n_threads=threads))
        try:
            await decode_rate(engine, 1, 8, run=-1)  # warm-up: page the weights in
            memory = psutil.Process().memory_full_info()
            start.wait(300)  # every context of the arm decodes at the same time
            rates = [await decode_rate(engine, streams, tokens, run=r) for r in range(2)]
        finally:
            await engine.close()
        return {"tok_s": max(rates), "uss_mib": memory.uss / 2**20, "pss_mib": memory.pss / 2**20}

    out.put(asyncio.run(run()))


def _contexts(count: int, threads: int, streams: int, tokens: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(count), ctx.Queue()
    procs = [ctx.Process(target=_context, args=(threads, streams, tokens, start, out), daemon=True)
             for _ in range(count)]
    for proc in procs:
        proc.start()
    try:
        results = [out.get(timeout=600) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return {key: sum(r[key] for r in results) for key in ("tok_s", "uss_mib", "pss_mib")}


def arm_edge(cores: int, streams: int, tokens: int) -> dict[str, Any]:
    """One context on every core against two contexts on half the cores each, ``streams``
    streams in all (needs at least two cores)."""
    half = max(1, cores // 2)
    shared = _contexts(1, 2 * half, streams, tokens)
    progress(f"edge, one context ({2 * half} threads, {streams} streams): {shared['tok_s']:.0f} tok/s, "
             f"PSS {shared['pss_mib']:.0f} MiB")
    own = _contexts(2, half, streams // 2, tokens)
    progress(f"edge, a context per worker (2 x {half} threads, {streams // 2} streams each): {own['tok_s']:.0f} tok/s, "
             f"PSS {own['pss_mib']:.0f} MiB")
    return {"one_context": shared, "context_per_worker": own,
            "edge_own_over_shared_tok_s": own["tok_s"] / shared["tok_s"],
            "edge_extra_worker_mib": own["pss_mib"] - shared["pss_mib"]}
