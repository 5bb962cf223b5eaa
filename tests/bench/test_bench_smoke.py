"""Every benchmark still runs, and still prints the keys docs/benchmarks.md documents.

The table "Every benchmark, and the keys of its last line" in docs/benchmarks.md names each
benchmark's smoke command and the keys of the one JSON object its last stdout line must be (a
key written ``name?`` may be absent). Each smoke command runs here as a subprocess, as a user
would run it; a benchmark that fails, changes its keys, or writes over a real run's results or
figures fails its case. The cluster's needs Ray and runs with ``make test-cluster`` (``ray``).

Timeouts are generous: a smoke run takes seconds to a minute on an idle 2-core machine, and CI
machines are slower and busier.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "benchmarks.md"
HEADER = "| benchmark | smoke command | keys of the last line |"
PYTHON = ".venv/bin/python"  # how the table's commands name the interpreter; this test runs its own
RUN_TIMEOUT_S = 900.0
NEEDS_RAY = {"cluster"}
# What a smoke run must leave alone: a real run's results and the figures the docs show.
GUARDED_DIRS = (REPO_ROOT / "docs" / "img", REPO_ROOT / "bench" / "out")


@dataclass(frozen=True)
class Row:
    benchmark: str
    command: str
    required: frozenset[str]
    optional: frozenset[str]


def parse_table(text: str) -> list[Row]:
    """The rows of the table under ``HEADER``: a ValueError for a table that is missing or malformed."""
    lines = text.splitlines()
    if HEADER not in lines:
        raise ValueError(f"docs/benchmarks.md has no table headed {HEADER!r}")
    rows = []
    for line in lines[lines.index(HEADER) + 2:]:  # past the header and its --- line
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            raise ValueError(f"a row needs 3 cells: {line!r}")
        name, command, keys = cells
        commands = re.findall(r"`([^`]+)`", command)
        names = re.findall(r"`([^`]+)`", keys)
        if len(commands) != 1 or not names:
            raise ValueError(f"a row needs one command and at least one key, each in backticks: {line!r}")
        rows.append(Row(name, commands[0], frozenset(k for k in names if not k.endswith("?")),
                        frozenset(k[:-1] for k in names if k.endswith("?"))))
    return rows


def entry_points() -> set[str]:
    """Every benchmark script in bench/ (the ``_*.py`` modules are their helpers)."""
    return {p.stem for p in (REPO_ROOT / "bench").glob("*.py") if not p.name.startswith("_")}


ROWS = parse_table(DOC.read_text(encoding="utf-8"))


def test_the_table_lists_every_benchmark_once_with_its_smoke_command() -> None:
    names = [r.benchmark for r in ROWS]
    assert sorted(names) == sorted(entry_points()), "docs/benchmarks.md's table and bench/*.py differ"
    for row in ROWS:
        assert row.command == f"{PYTHON} bench/{row.benchmark}.py --smoke", row.command
        assert not row.required & row.optional, f"{row.benchmark}: a key is both required and optional"


def test_parse_table_reads_optional_keys_and_refuses_malformed_rows() -> None:
    table = f"{HEADER}\n| --- | --- | --- |\n| x | `{PYTHON} bench/x.py --smoke` | `a`, `b?` |\n\nafter"
    assert parse_table(table) == [Row("x", f"{PYTHON} bench/x.py --smoke", frozenset({"a"}), frozenset({"b"}))]
    with pytest.raises(ValueError, match="one command"):
        parse_table(f"{HEADER}\n| --- | --- | --- |\n| x | no command | `a` |")
    with pytest.raises(ValueError, match="no table"):
        parse_table("# Benchmarks\n")


def snapshot() -> dict[Path, int]:
    """Modification times of the guarded files (not recursive: bench/out/smoke/ is the smoke runs' own)."""
    return {p: p.stat().st_mtime_ns for d in GUARDED_DIRS if d.is_dir() for p in d.iterdir() if p.is_file()}


def last_json_line(stdout: str) -> dict[str, object]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "the benchmark printed nothing on stdout"
    parsed = json.loads(lines[-1])
    assert isinstance(parsed, dict), f"the last line is not a JSON object: {lines[-1]!r}"
    return parsed


def case(row: Row) -> object:
    marks = [pytest.mark.timeout(RUN_TIMEOUT_S + 60)]
    if row.benchmark in NEEDS_RAY:
        marks.append(pytest.mark.ray)
    return pytest.param(row, id=row.benchmark, marks=marks)


@pytest.mark.parametrize("row", [case(r) for r in ROWS])
def test_smoke_run_prints_the_documented_keys(row: Row) -> None:
    run_smoke(row)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_voice_sessions_smoke_runs_at_8_khz() -> None:
    """The voice benchmark's sessions in G.711 mu-law at 8 kHz (a phone line's audio): the same
    keys, ``truncate_exact`` among them."""
    (row,) = [r for r in ROWS if r.benchmark == "voice_sessions"]
    run_smoke(Row(row.benchmark, f"{row.command} --format audio/pcmu", row.required, row.optional))


def run_smoke(row: Row) -> None:
    argv = shlex.split(row.command)
    argv[0] = sys.executable  # the interpreter running the tests, whatever its path
    before = snapshot()
    try:
        done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{row.command} ran past {RUN_TIMEOUT_S:.0f} s; stderr ends:\n{(e.stderr or b'')[-3000:]!r}")
    assert done.returncode == 0, f"{row.command} exited {done.returncode}; stderr ends:\n{done.stderr[-3000:]}"
    keys = set(last_json_line(done.stdout))
    assert keys >= row.required, f"missing keys: {sorted(row.required - keys)}"
    assert keys <= row.required | row.optional, f"keys not in docs/benchmarks.md: {sorted(keys - row.required - row.optional)}"
    after = snapshot()
    touched = sorted(str(p.relative_to(REPO_ROOT)) for p, mtime in after.items() if before.get(p) != mtime)
    assert not touched, f"a smoke run wrote over a real run's files: {touched}"
