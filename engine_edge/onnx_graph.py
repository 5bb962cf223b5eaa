"""The torch side of the ONNX export: the traced wrapper, the trace itself, and its verification.

The wrapper gives ``llm_shared.llama.model.LlamaModel`` the graph contract of
``engine_edge.onnx_decoder``: flat past/present tensors, an attention mask for left-padded
batches, explicit positions, and logits of the last position only (a long prompt does not pay
for a vocabulary projection per token). Imported only while exporting, so serving a cached
export never imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.export import Dim

from engine_edge.onnx_decoder import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOGITS,
    POSITION_IDS,
    OnnxDecoder,
    past_names,
    present_names,
)
from llm_shared.errors import EngineError
from llm_shared.llama.model import ContiguousAttention, LlamaModel

OPSET = 18
VERIFY_RTOL = 1e-3  # ORT vs torch, both float32: max |Δlogit| relative to the largest logit


class ExportError(EngineError):
    """Tracing or verifying the ONNX graph failed."""

    code = "onnx_export_failed"


class DecoderGraph(torch.nn.Module):
    """(input_ids [B, T], attention_mask [B, P+T], position_ids [B, T], *past [B, KVH, P, D])
    -> (logits [B, V], *present [B, KVH, P+T, D]), past/present ordered layer, then key/value."""

    def __init__(self, model: LlamaModel) -> None:
        super().__init__()
        self.model = model
        self.n_layers = model.args.num_layers

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(self.n_layers)]
        attention = ContiguousAttention(pairs, self.n_layers, key_mask=attention_mask)
        hidden = self.model(input_ids, position_ids, attention)  # [B, T, hidden]
        logits = self.model.compute_logits(hidden[:, -1])  # [B, V]
        return (logits, *(t for kv in attention.present for t in kv))


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Hide the exporter's chatter that says nothing about our model (optional torchvision ops,
    deprecations inside torch, axis renames it resolves itself), so the progress stays readable."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"# The axis name: .* will not be used")
            warnings.filterwarnings("ignore", category=FutureWarning, message=r".*LeafSpec.*")
            yield
    finally:
        registration.setLevel(level)


def trace(model: LlamaModel) -> torch.onnx.ONNXProgram:
    """The ONNX program of ``DecoderGraph(model)`` with dynamic batch, sequence and past axes."""
    args = model.args
    # Example sizes avoid 0 and 1, which torch.export would otherwise specialize on.
    batch, seq, past = 2, 3, 4
    ids = torch.randint(0, args.vocab_size, (batch, seq))
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    positions = torch.arange(past, past + seq).expand(batch, -1).contiguous()
    kv = [torch.zeros(batch, args.num_kv_heads, past, args.head_dim) for _ in range(2 * args.num_layers)]
    b, t, p, total = Dim("batch"), Dim("sequence"), Dim("past_sequence"), Dim("total_sequence")
    shapes = ({0: b, 1: t}, {0: b, 1: total}, {0: b, 1: t}, tuple({0: b, 2: p} for _ in kv))
    with torch.no_grad(), _quiet_exporter():
        program = torch.onnx.export(
            DecoderGraph(model).eval(), (ids, mask, positions, *kv), dynamo=True, opset_version=OPSET,
            input_names=[INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *past_names(args.num_layers)],
            output_names=[LOGITS, *present_names(args.num_layers)],
            dynamic_shapes=shapes, external_data=False, verbose=False,
        )
    if program is None:
        raise ExportError("torch.onnx.export returned no program")
    return program


def verify_export(model: LlamaModel, onnx_path: Path) -> float:
    """Prefill, then one batched left-padded decode step in ORT, compared with torch per sequence.

    Returns the max |Δlogit|; raises ExportError above the tolerance or if an argmax differs.
    """
    vocab = model.args.vocab_size
    seqs = [[(7 * i + 3) % vocab for i in range(6)], [(11 * i + 5) % vocab for i in range(4)]]
    decoder = OnnxDecoder(onnx_path, n_threads=0)
    states = [decoder.new_state() for _ in seqs]
    got = [decoder.prefill(state, s[:-1]) for state, s in zip(states, seqs, strict=True)]
    got += list(decoder.decode(states, [s[-1] for s in seqs]))
    with torch.no_grad():
        want = [model.forward_contiguous(torch.tensor([s[:-1]]))[0][0, -1].numpy() for s in seqs]
        want += [model.forward_contiguous(torch.tensor([s]))[0][0, -1].numpy() for s in seqs]
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        diff = float(np.abs(g - w).max())
        worst = max(worst, diff)
        if diff > VERIFY_RTOL * max(1.0, float(np.abs(w).max())) or int(np.argmax(g)) != int(np.argmax(w)):
            raise ExportError(f"the exported graph disagrees with the torch model (max |Δlogit| {diff:.3g})")
    return worst
