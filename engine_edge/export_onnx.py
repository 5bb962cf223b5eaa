"""``python -m engine_edge.export_onnx``: a GGUF's weights as an ONNX decoder with past key/values.

The traced model is ``llm_shared.llama.model.LlamaModel`` (the one the torch engine runs), loaded by
``llm_shared.llama.loader`` with every tensor dequantized to float32, called with
``llm_shared.llama.model.ContiguousAttention``. The graph's inputs and outputs are described in
``engine_edge.onnx_decoder``; its logits are those of the last position only, so a long prompt
does not pay for a vocabulary projection per token.

Exporter: torch's dynamo exporter (``torch.export`` + onnxscript), opset 18. Both exporters
handle this model on torch 2.13 with the same numerics, but the TorchScript one is deprecated
since torch 2.9 (it warns on every call and fails on ``aten::rms_norm``, should the model ever
use ``nn.RMSNorm``), while ``torch.export`` checks the dynamic batch, sequence and past axes
instead of trusting a trace. It is slower (~7 s for a tiny model, ~1 min for the 135M one),
which the cache makes a one-off.

The result is cached (``engine_edge.onnx_cache``): re-running with the same GGUF returns at once,
a corrupt cached file is re-exported. Concurrent exports of the same file wait on a lock.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine_edge.onnx_cache import (
    EXPORTER_VERSION,
    MANIFEST_SUFFIX,
    Manifest,
    check_cached,
    default_onnx_path,
    file_sha256,
    hash_outputs,
    manifest_path,
)
from engine_edge.onnx_decoder import CONTEXT_LENGTH_KEY
from llm_shared.errors import EngineError, ModelFileError
from llm_shared.modelfile import check_gguf, default_gguf_path

EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf caps one file at 2 GiB; bigger weights go beside it

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    cached: bool  # an intact export was already there; nothing was traced
    seconds: float
    max_logit_diff: float | None = None  # ORT vs torch on the verification batch (None: cached or not verified)


def ensure_onnx(
    gguf_path: Path,
    out: Path | None = None,
    *,
    progress: Progress | None = None,
    force: bool = False,
    verify: bool = True,
) -> ExportResult:
    """The ONNX decoder for ``gguf_path``: from the cache if intact, else exported now.

    ``out`` is where model.onnx goes (default: the cache folder keyed by the GGUF's hash).
    """
    say = progress or (lambda _message: None)
    start = time.perf_counter()
    gguf_path = check_gguf(Path(gguf_path).expanduser())
    say(f"hashing {gguf_path.name}")
    source_sha = file_sha256(gguf_path)
    onnx_path = Path(out).expanduser().absolute() if out is not None else default_onnx_path(source_sha)
    if onnx_path.is_dir():
        raise ModelFileError(f"the ONNX output {str(onnx_path)!r} is a directory; give the path of the .onnx file")
    try:
        onnx_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFileError(f"cannot create {str(onnx_path.parent)!r}: {e.strerror}") from e
    with _export_lock(onnx_path):
        check = check_cached(onnx_path, source_sha)
        if check.hit and not force:
            say(f"cached export found: {onnx_path}")
            return ExportResult(onnx_path, True, time.perf_counter() - start)
        say(f"exporting: {'forced' if force else check.reason}")
        diff = _export(gguf_path, onnx_path, source_sha, say, verify=verify)
    seconds = time.perf_counter() - start
    say(f"done in {seconds:.1f} s: {onnx_path}")
    return ExportResult(onnx_path, False, seconds, diff)


@contextlib.contextmanager
def _export_lock(onnx_path: Path) -> Iterator[None]:
    """One exporter per target at a time; a second one waits, then finds the cache."""
    lock_path = onnx_path.with_name(onnx_path.name + ".lock")
    with lock_path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _export(gguf_path: Path, onnx_path: Path, source_sha: str, say: Progress, *, verify: bool) -> float | None:
    import torch

    from engine_edge.onnx_graph import OPSET, trace, verify_export
    from llm_shared.llama.loader import load_gguf

    t = time.perf_counter()
    say(f"loading weights from {gguf_path.name} (dequantizing to float32)")
    model = load_gguf(gguf_path, dtype=torch.float32, device="cpu")
    n_params = sum(p.numel() for p in model.parameters())
    say(f"loaded {n_params / 1e6:.1f} M parameters in {time.perf_counter() - t:.1f} s")

    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=onnx_path.parent))
    try:
        staged = staging / onnx_path.name
        t = time.perf_counter()
        say(f"tracing {model.args.num_layers} layers with the dynamo exporter (opset {OPSET})")
        program = trace(model)
        say(f"traced in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        program.model.metadata_props[CONTEXT_LENGTH_KEY] = str(model.args.max_position_embeddings)
        program.model.metadata_props["source_sha256"] = source_sha
        external = n_params * 4 > EXTERNAL_DATA_BYTES
        say(f"saving {n_params * 4 / 1e6:.1f} MB{' (external data)' if external else ''}")
        program.save(staged, external_data=external)
        say(f"saved in {time.perf_counter() - t:.1f} s")
        diff = None
        if verify:
            t = time.perf_counter()
            say("verifying against the torch model")
            diff = verify_export(model, staged)
            say(f"verified in {time.perf_counter() - t:.1f} s: max |Δlogit| {diff:.2e}")
        files = hash_outputs(staging)
        _install(staging, onnx_path, files)
        Manifest(source_sha, EXPORTER_VERSION, files, OPSET, "dynamo", torch.__version__).write(onnx_path)
        return diff
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _install(staging: Path, onnx_path: Path, files: dict[str, str]) -> None:
    """Move the staged files over the target, after removing what an older export left there.

    The manifest goes first: until the new one is written there is no cache hit.
    """
    folder = onnx_path.parent
    old = Manifest.read(onnx_path)
    stale = {manifest_path(onnx_path).name, onnx_path.name, onnx_path.name + ".data", *(old.files if old else ())}
    for name in sorted(stale, key=lambda n: not n.endswith(MANIFEST_SUFFIX)):
        (folder / name).unlink(missing_ok=True)
    for name in files:
        os.replace(staging / name, folder / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine_edge.export_onnx",
        description="Export a GGUF model's weights (dequantized to float32) as an ONNX decoder with past KV.",
    )
    parser.add_argument("gguf", nargs="?", type=Path, help="the .gguf file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write model.onnx (default: ~/.cache/rt-llm-gateway/onnx/<sha256>-v<N>/)")
    parser.add_argument("--force", action="store_true", help="export again even if an intact export is cached")
    parser.add_argument("--no-verify", action="store_true", help="skip comparing the graph with the torch model")
    args = parser.parse_args(argv)
    begun = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - begun:6.1f}s] {message}", file=sys.stderr, flush=True)

    try:
        gguf = args.gguf if args.gguf is not None else default_gguf_path()
        result = ensure_onnx(gguf, args.out, progress=say, force=args.force, verify=not args.no_verify)
    except EngineError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    print(result.onnx_path)  # stdout carries only the path, for scripts
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
