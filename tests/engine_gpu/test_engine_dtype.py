"""The torch engine's own config: dtype "auto" follows what the CPU computes natively."""

from __future__ import annotations

import pytest

from engine_gpu import config
from engine_gpu.config import resolve_dtype


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx2", "fma"}, "float32"),  # bf16 emulated: 5x slower prefill measured on such a CPU
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
    ({"avx2", "amx_bf16", "amx_tile"}, "bfloat16"),
])
def test_auto_dtype_on_cpu_follows_native_bfloat16(monkeypatch: pytest.MonkeyPatch, flags: set[str],
                                                   expected: str) -> None:
    monkeypatch.setattr(config, "cpu_flags", lambda: flags)
    dtype, why = resolve_dtype("auto", "cpu")
    assert dtype == expected and why.startswith("auto")


def test_explicit_and_cuda_dtypes() -> None:
    assert resolve_dtype("float16", "cpu") == ("float16", "configured")
    assert resolve_dtype("auto", "cuda")[0] == "bfloat16"


def test_this_machine_reads_its_own_flags() -> None:
    flags = config.cpu_flags()  # parsed from /proc/cpuinfo; every x86-64 CPU (these machines) reports sse2
    assert "sse2" in flags
