"""The browser engine's form of the model is the same model.

``client_sdk/js/gguf.js`` rewrites the shipped GGUF's Q4_1 tensors as Q5_1 before the page stores it
(llama.cpp's WebAssembly build has SIMD code for Q5_1, none for Q4_1). Here Node widens the real
file, and then, independently of that code: the gguf library dequantizes every tensor of both files
to the same numbers, and native llama.cpp answers the same prompt with the same tokens from both.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gateway_process import REPO_ROOT

NODE = shutil.which("node")
pytestmark = [pytest.mark.model, pytest.mark.skipif(NODE is None, reason="node is not installed (make system-deps)")]

WIDEN = """
import { readFileSync, writeFileSync } from "node:fs";
import { widenQ4_1 } from "./client_sdk/js/gguf.js";
const file = readFileSync(process.argv[1]);
const widened = widenQ4_1(file.buffer.slice(file.byteOffset, file.byteOffset + file.byteLength));
writeFileSync(process.argv[2], new Uint8Array(widened));
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from llm_shared.modelfile import default_gguf_path

    served = default_gguf_path()
    widened = tmp_path_factory.mktemp("gguf") / "widened.gguf"
    subprocess.run([NODE, "--input-type=module", "-e", WIDEN, str(served), str(widened)],
                   cwd=REPO_ROOT, check=True, timeout=300)
    return served, widened


def test_every_tensor_dequantizes_to_the_same_numbers(files: tuple[Path, Path]) -> None:
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    served, widened = (GGUFReader(path) for path in files)
    assert [t.name for t in served.tensors] == [t.name for t in widened.tensors]
    widened_types = {t.tensor_type for t in widened.tensors}
    assert GGMLQuantizationType.Q4_1 not in widened_types and GGMLQuantizationType.Q5_1 in widened_types
    for a, b in zip(served.tensors, widened.tensors, strict=True):
        expected = {GGMLQuantizationType.Q4_1: GGMLQuantizationType.Q5_1}.get(a.tensor_type, a.tensor_type)
        assert b.tensor_type == expected, a.name
        assert list(a.shape) == list(b.shape), a.name
        np.testing.assert_array_equal(dequantize(b.data, b.tensor_type), dequantize(a.data, a.tensor_type),
                                      err_msg=a.name)
    for key in served.fields:  # the metadata is copied as it was
        assert key in widened.fields, key


def test_llama_cpp_reads_the_same_logits_from_both(files: tuple[Path, Path]) -> None:
    """The next-token scores after a prompt agree to float rounding (the two block types go through
    different SIMD kernels, so their sums are not added in one order)."""
    from llama_cpp import Llama

    prompt = ("<|im_start|>user\nName three things a lighthouse keeper does in a storm.<|im_end|>\n"
              "<|im_start|>assistant\nA lighthouse keeper")
    scores = []
    for path in files:
        model = Llama(str(path), n_ctx=256, n_threads=1, n_threads_batch=1, logits_all=True, verbose=False)
        tokens = model.tokenize(prompt.encode(), special=True)
        model.eval(tokens)
        scores.append(np.array(model.scores[len(tokens) - 1], dtype=np.float64))
        model.close()
    spread = float(scores[0].max() - scores[0].min())
    assert spread > 5.0  # real scores, not a zero row
    assert float(np.abs(scores[0] - scores[1]).max()) <= 1e-3 * spread
