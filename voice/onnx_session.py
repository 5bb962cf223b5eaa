"""The one way the voice models run in onnxruntime: one thread, no spinning, checked inputs.

Silero VAD (~60 us a window) and Smart Turn (~25 ms a judgement) run beside the engines in the
gateway's process: more threads would only contend with them, and onnxruntime's idle workers
otherwise spin after every run and starve the other compute of the process (FACTS.md)."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from voice.errors import VoiceModelError


def one_thread_session(path: Path, model: str, inputs: list[str], *, sequential: bool = False) -> ort.InferenceSession:
    """``model`` (its name in errors) from ``path``; ``VoiceModelError`` when it does not load or its
    inputs are not ``inputs`` (another graph than the code drives)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    if sequential:
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types for a bad or missing file
        raise VoiceModelError(f"cannot load the {model} model {path}: {e}") from e
    names = [i.name for i in session.get_inputs()]
    if names != inputs:
        raise VoiceModelError(f"{path} is not the {model} graph this code drives (inputs {names})")
    return session
