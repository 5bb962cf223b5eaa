"""Small helpers shared by the benchmarks in bench/: progress lines, percentiles, free ports,
file-descriptor limits, machine load, and writing results (JSON, TOML configs).

Every benchmark prints progress on stderr and ends its stdout with one JSON line; the full
results go to bench/out/<name>.json (a ``--smoke`` run's to bench/out/smoke/).
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine_gpu.config import BF16_CPU_FLAGS, resolve_dtype

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = REPO_ROOT / "bench" / "out"
IMG_DIR = REPO_ROOT / "docs" / "img"
# A --smoke run (tiny sizes, to check that a benchmark still runs and prints its keys) writes its
# results and figures here, never over a real run's.
SMOKE_DIR = OUT_DIR / "smoke"
SMOKE_HELP = "tiny sizes, seconds, to check that it runs and prints its keys (results and figures in bench/out/smoke/)"


class BenchError(RuntimeError):
    """The gateway or engine did something the benchmark cannot measure around."""


def result_path(name: str, smoke: bool) -> Path:
    """Where a run writes its results file ``name``: bench/out/, or bench/out/smoke/ for a smoke run."""
    return (SMOKE_DIR if smoke else OUT_DIR) / name


def figure_path(name: str, smoke: bool) -> Path:
    """Where a run draws its figure ``name``: docs/img/, or bench/out/smoke/ for a smoke run."""
    return (SMOKE_DIR if smoke else IMG_DIR) / name


def progress(message: str) -> None:
    """One progress line on stderr, stamped with the wall-clock time."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks (numpy's
    default); NaN for no values, so an empty phase shows up instead of raising."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in 0..100, got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (another process may still take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def raise_nofile_limit(wanted: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards ``wanted`` (children inherit it).

    Returns the soft limit now in force; the caller decides whether it is enough, since the
    hard limit can only be raised by root.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has used since boot (all cores, not idle)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)




def cpu_facts() -> dict[str, Any]:
    """This machine's CPU, for every benchmark's output: the same machine kind comes with
    different CPUs from day to day (two "AMD EPYC" sessions differed 1.6x in the gateway's CPU a
    delta), and figures compare only within one run. ``model`` carries the family, model and clock
    where the name alone is generic; ``python_ref_ms`` times a fixed piece of pure Python here, so
    figures of different sessions can at least be read against each machine's speed."""
    flags: set[str] = set()
    name = platform.processor() or platform.machine()
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "flags":
                flags = set(value.split())
            elif key not in info:  # the first processor's
                info[key] = value.strip()
    except OSError:
        pass  # not Linux: the model name from platform is all there is
    name = info.get("model name", name)
    ids = [f"{k} {info[k]}" for k in ("cpu family", "model", "stepping") if info.get(k)]
    if "cpu MHz" in info:
        ids.append(f"{float(info['cpu MHz']):.0f} MHz")
    wanted = ("avx2", "avx512f", *BF16_CPU_FLAGS)
    return {"model": f"{name} ({', '.join(ids)})" if ids else name, "cores": os.cpu_count(),
            "flags": [f for f in wanted if f in flags], "python_ref_ms": round(python_reference_ms(), 2)}


def python_reference_ms(repeat: int = 5) -> float:
    """Milliseconds this machine takes (best of ``repeat``) for a fixed piece of pure Python shaped
    like a server's per-event work: calls, small objects, f-strings, dict updates."""

    def work() -> int:
        seen: dict[str, int] = {}
        for i in range(20_000):
            key = f"event_{i:x}"
            seen[key] = len(key) + seen.get(key[:-1], 0)
        return len(seen)

    best = math.inf
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def cpu_dtype(requested: str = "auto") -> str:
    """``requested``, or what the torch engine picks for "auto" on this CPU (bfloat16 where it is
    computed natively, else float32: on an AVX2-only CPU bf16 prefill ran 5x slower)."""
    return resolve_dtype(requested, "cpu")[0]


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _toml_value(value: Any, key: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{key}: TOML here takes finite floats only")
        return repr(value)
    if isinstance(value, str):
        # A JSON string with ensure_ascii is a valid TOML basic string.
        return json.dumps(value, ensure_ascii=True)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, key) for v in value) + "]"
    raise TypeError(f"{key}: cannot write {type(value).__name__} to TOML")


def dump_toml(data: Mapping[str, Any]) -> str:
    """TOML text for nested tables of scalars and arrays (what configs/*.toml hold).

    Written by hand because the standard library only reads TOML; tables nested in tables
    become dotted headers (``[models."smollm2-135m"]``).
    """
    lines: list[str] = []

    def table(prefix: tuple[str, ...], body: Mapping[str, Any]) -> None:
        scalars = {k: v for k, v in body.items() if not isinstance(v, Mapping)}
        if prefix and (scalars or not body):
            lines.append("[" + ".".join(json.dumps(p) for p in prefix) + "]")
        for k, v in scalars.items():
            lines.append(f"{json.dumps(k)} = {_toml_value(v, '.'.join((*prefix, k)))}")
        if prefix and (scalars or not body):
            lines.append("")
        for k, v in body.items():
            if isinstance(v, Mapping):
                table((*prefix, k), v)

    table((), data)
    return "\n".join(lines) + "\n"
