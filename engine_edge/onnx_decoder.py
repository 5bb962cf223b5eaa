"""Running the exported ONNX decoder: one onnxruntime session and per-sequence KV in numpy.

The graph (made by ``engine_edge.export_onnx``) takes ``input_ids`` [B, T], ``attention_mask``
[B, P+T] (1 = real token), ``position_ids`` [B, T] and ``past_key_values.{i}.{key,value}``
[B, KVH, P, D]; it returns ``logits`` [B, V] for the last position and ``present.{i}.*``
[B, KVH, P+T, D]. Each sequence owns its cache as arrays of batch 1 (often views into a batched
output). A decode step over sequences of different lengths left-pads their caches to the
longest and masks the padding; while the same sequences keep stepping together, the previous
step's batched output is fed straight back in, so padding is only rebuilt when the batch changes.

Not thread-safe: one worker thread owns the decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llm_shared.errors import ModelFileError

if TYPE_CHECKING:
    import onnxruntime

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
KV_KINDS = ("key", "value")
CONTEXT_LENGTH_KEY = "context_length"  # graph metadata: the model's trained context, in tokens


def past_names(n_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kind}" for i in range(n_layers) for kind in KV_KINDS]


def present_names(n_layers: int) -> list[str]:
    return [f"present.{i}.{kind}" for i in range(n_layers) for kind in KV_KINDS]


@dataclass(frozen=True)
class GraphShape:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int


class KVState:
    """One sequence's cache: ``2 * n_layers`` float32 arrays [1, KVH, length, D]."""

    __slots__ = ("arrays", "length")

    def __init__(self, arrays: tuple[np.ndarray, ...], length: int) -> None:
        self.arrays = arrays
        self.length = length

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions (a view; no copy)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {n}")
        if n < self.length:
            self.arrays = tuple(a[:, :, :n, :] for a in self.arrays)
            self.length = n


@dataclass
class _LastBatch:
    """The previous decode step, kept so an unchanged batch reuses its padded output."""

    states: tuple[KVState, ...]
    views: tuple[tuple[np.ndarray, ...], ...]  # what each state was given, to detect changes
    present: list[np.ndarray]  # [B, KVH, M, D] per layer and kind
    mask: np.ndarray  # [B, M]


def session_options(n_threads: int) -> onnxruntime.SessionOptions:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = n_threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Spinning workers burn the cores between runs and starve torch (and the event loop)
    # in the same process; a few microseconds of wake-up latency per run is the better deal.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return opts


class OnnxDecoder:
    """The session plus batched prefill/decode over ``KVState`` caches."""

    def __init__(self, onnx_path: Path, *, n_threads: int) -> None:
        import onnxruntime as ort
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

        try:
            self._session = ort.InferenceSession(
                str(onnx_path), sess_options=session_options(n_threads), providers=["CPUExecutionProvider"]
            )
        except (ort_errors.InvalidProtobuf, ort_errors.InvalidGraph, ort_errors.NoSuchFile, ort_errors.Fail) as e:
            raise ModelFileError(f"cannot load ONNX model {str(onnx_path)!r}: {e}") from e
        self.shape = self._read_shape()
        self.metadata: dict[str, str] = dict(self._session.get_modelmeta().custom_metadata_map)
        self._past_names = past_names(self.shape.n_layers)
        self._output_names = [LOGITS, *present_names(self.shape.n_layers)]
        self._last: _LastBatch | None = None

    def _read_shape(self) -> GraphShape:
        inputs = {i.name: i for i in self._session.get_inputs()}
        outputs = {o.name: o for o in self._session.get_outputs()}
        n_layers = sum(1 for name in inputs if name.startswith("past_key_values.") and name.endswith(".key"))
        needed = {INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *past_names(n_layers)}
        if n_layers == 0 or not needed <= set(inputs) or LOGITS not in outputs:
            raise ModelFileError(
                "the ONNX file is not a decoder exported by engine_edge.export_onnx "
                f"(inputs {sorted(inputs)[:6]}...); re-export it with `python -m engine_edge.export_onnx`"
            )
        _, kv_heads, _, head_dim = inputs[past_names(1)[0]].shape
        vocab = outputs[LOGITS].shape[-1]
        if not all(isinstance(d, int) for d in (kv_heads, head_dim, vocab)):
            raise ModelFileError("the ONNX decoder must have static head and vocabulary sizes; re-export it")
        return GraphShape(n_layers=n_layers, n_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab)

    def new_state(self) -> KVState:
        empty = np.zeros((1, self.shape.n_kv_heads, 0, self.shape.head_dim), dtype=np.float32)
        return KVState(tuple(empty for _ in self._past_names), 0)

    def _run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: Sequence[np.ndarray]) -> list[np.ndarray]:
        feed = {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: positions}
        feed.update(zip(self._past_names, past, strict=True))
        return self._session.run(self._output_names, feed)

    def prefill(self, state: KVState, token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids`` to one sequence; the logits [V] after its last token."""
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        n = len(token_ids)
        ids = np.asarray(token_ids, dtype=np.int64).reshape(1, n)
        mask = np.ones((1, state.length + n), dtype=np.int64)
        positions = np.arange(state.length, state.length + n, dtype=np.int64).reshape(1, n)
        logits, *present = self._run(ids, mask, positions, state.arrays)
        state.arrays, state.length = tuple(present), state.length + n
        return logits[0]

    def decode(self, states: Sequence[KVState], token_ids: Sequence[int]) -> np.ndarray:
        """One token for each sequence in one run; logits [B, V] in the same order."""
        if len(states) != len(token_ids) or not states:
            raise ValueError("decode needs one token per sequence and at least one sequence")
        batch = len(states)
        ids = np.asarray(token_ids, dtype=np.int64).reshape(batch, 1)
        positions = np.asarray([s.length for s in states], dtype=np.int64).reshape(batch, 1)
        last = self._last
        if (
            last is not None
            and len(last.states) == batch
            and all(s is t for s, t in zip(states, last.states, strict=True))
            and all(s.arrays is v for s, v in zip(states, last.views, strict=True))
        ):
            past, old_mask = last.present, last.mask
        else:
            past, old_mask = self._pad(states)
        mask = np.concatenate([old_mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        logits, *present = self._run(ids, mask, positions, past)
        total = mask.shape[1]
        views = []
        for row, state in enumerate(states):
            start = total - (state.length + 1)  # left padding of this row
            state.arrays = tuple(p[row:row + 1, :, start:, :] for p in present)
            state.length += 1
            views.append(state.arrays)
        self._last = _LastBatch(tuple(states), tuple(views), present, mask)
        return logits

    def _pad(self, states: Sequence[KVState]) -> tuple[list[np.ndarray], np.ndarray]:
        """Left-pad every cache to the longest; the mask marks real positions with 1."""
        longest = max(s.length for s in states)
        batch, kv_heads, head_dim = len(states), self.shape.n_kv_heads, self.shape.head_dim
        mask = np.zeros((batch, longest), dtype=np.int64)
        past = []
        for j in range(len(self._past_names)):
            if batch == 1:
                past.append(states[0].arrays[j])  # nothing to pad
                continue
            padded = np.zeros((batch, kv_heads, longest, head_dim), dtype=np.float32)
            for row, state in enumerate(states):
                padded[row, :, longest - state.length:, :] = state.arrays[j][0]
            past.append(padded)
        for row, state in enumerate(states):
            mask[row, longest - state.length:] = 1
        return past, mask

    def forget(self, state: KVState) -> None:
        """Drop the reused batch if it holds ``state`` (so its memory can be freed)."""
        if self._last is not None and any(s is state for s in self._last.states):
            self._last = None
