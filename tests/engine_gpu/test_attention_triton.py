"""The Triton attention backend's tests (attention_triton_interpreted.py), run by pytest in a
process of their own.

Two reasons for the process: TRITON_INTERPRET=1 must be set before the kernels are decorated, and
Triton's interpreter leaves a screen of nanobind "leaked function" reports when its process exits.
Run in this process, those reports would end the output of every test run that includes this
module; in a child, they stay in the child's output, which is shown only when a test there fails.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INTERPRETED = Path(__file__).with_name("attention_triton_interpreted.py")
TIMEOUT_S = 600  # the whole module under the interpreter (each program in numpy), on two busy cores

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_the_kernels_pass_under_the_interpreter(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(INTERPRETED), "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    assert report.exists(), f"the interpreted tests did not run (exit {done.returncode}):\n{output[-6000:]}"
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None
    failed = [f"{case.get('name')}: {bad.get('message', '')[:300]}" for case in suite.iter("testcase")
              for bad in (*case.iter("failure"), *case.iter("error"))]
    assert done.returncode == 0 and not failed, "\n".join([*failed, output[-6000:]])
    assert int(suite.get("tests", "0")) > int(suite.get("skipped", "0")), output[-3000:]  # not all skipped
