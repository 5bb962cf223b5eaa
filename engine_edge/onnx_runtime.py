"""The ONNX decoder behind the same model/context/batch surface as ``llm_shared.llamacpp_runtime``.

The edge worker (``engine_edge.llama_cpp_worker.LlamaWorker``) schedules, samples, streams,
aborts and drafts against three small objects: a model (``is_eog``), a context (``decode`` a
batch of (token, position, sequence) entries, ``logits`` per entry, ``seq_rm``/``seq_pos_max``
on a sequence's cache) and a token batch. Implementing them over ``OnnxDecoder`` lets the ONNX
backend reuse that worker unchanged, so both edge backends behave identically for callers.

Differences from llama.cpp, all inside ``decode``:
- Sequences with one new token are decoded together in one padded run; a sequence with several
  new tokens (a prompt chunk) runs alone. Only the last new token of a sequence can ask for
  logits (the graph returns the last position's), which is all the worker ever asks for.
- The cache is one pool of ``n_ctx`` cells shared by all sequences (like llama.cpp's unified
  KV), held as numpy arrays that grow per sequence; no sequence exceeds ``n_ctx_seq``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from engine_edge.onnx_decoder import KVState, OnnxDecoder
from llm_shared.errors import EngineError

DECODE_OK = 0
DECODE_NO_KV_ROOM = 1  # as llama_decode: the cache has no room; nothing was changed
DECODE_BAD_BATCH = -1  # positions not consecutive, or logits asked for a token that is not last

# Token texts llama.cpp treats as end of generation when they are special tokens (its
# auto-detected EOT/EOG names and the FIM pad/repo/separator tokens it adds to that set).
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
    "<reponame>", "<|file_sep|>",
})


def end_of_generation_ids(eos_id: int, special: Iterable[tuple[int, bytes]]) -> frozenset[int]:
    """EOS plus the special tokens whose text names an end of turn, as llama.cpp derives them."""
    return frozenset({eos_id, *(i for i, text in special if text.decode("utf-8", "replace") in END_OF_GENERATION_TEXTS)})


class OnnxModel:
    """The model facts the worker asks about."""

    def __init__(self, eog_ids: frozenset[int]) -> None:
        self._eog = eog_ids

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._eog

    def free(self) -> None:
        """Nothing to release: the session belongs to the context."""


@dataclass(frozen=True)
class _Entry:
    token_id: int
    pos: int
    seq_id: int
    want_logits: bool


class OnnxBatch:
    """Entries of one ``OnnxContext.decode`` call, filled with ``add``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: list[_Entry] = []

    @property
    def n_tokens(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()

    def add(self, token_id: int, pos: int, seq_id: int, want_logits: bool) -> int:
        """Append one token; returns its batch index (what ``OnnxContext.logits`` takes)."""
        if len(self.entries) >= self.capacity:
            raise EngineError(f"batch is full ({self.capacity} tokens)")
        self.entries.append(_Entry(token_id, pos, seq_id, want_logits))
        return len(self.entries) - 1

    def free(self) -> None:
        self.entries.clear()


class OnnxContext:
    """Per-sequence caches over one decoder. Used by one thread (the worker)."""

    def __init__(self, decoder: OnnxDecoder, *, n_ctx: int, n_ctx_seq: int) -> None:
        self.decoder: OnnxDecoder | None = decoder
        self.n_vocab = decoder.shape.vocab_size
        self.n_ctx = n_ctx  # cells shared by all sequences
        self.n_ctx_seq = min(n_ctx_seq, n_ctx)  # cells one sequence may use
        self.separate_streams = False  # one pool: the worker keeps admitted sequences within it
        self._states: dict[int, KVState] = {}
        self._logits: dict[int, np.ndarray] = {}  # batch index -> logits of the last decode

    def _decoder(self) -> OnnxDecoder:
        if self.decoder is None:
            raise EngineError("the ONNX context has been freed")
        return self.decoder

    def _state(self, seq_id: int) -> KVState:
        state = self._states.get(seq_id)
        if state is None:
            state = self._states[seq_id] = self._decoder().new_state()
        return state

    @property
    def cells_used(self) -> int:
        return sum(s.length for s in self._states.values())

    def decode(self, batch: OnnxBatch) -> int:
        """Run every entry of ``batch``; 0 on success, else a llama_decode-style code with no state changed."""
        decoder = self._decoder()
        self._logits = {}
        runs: dict[int, list[tuple[int, _Entry]]] = {}  # seq id -> its (batch index, entry), in order
        for index, entry in enumerate(batch.entries):
            runs.setdefault(entry.seq_id, []).append((index, entry))
        for seq_id, run in runs.items():
            start = self._state(seq_id).length
            if any(e.pos != start + k for k, (_, e) in enumerate(run)) or any(e.want_logits for _, e in run[:-1]):
                return DECODE_BAD_BATCH
            if start + len(run) > self.n_ctx_seq:
                return DECODE_NO_KV_ROOM
        if self.cells_used + batch.n_tokens > self.n_ctx:
            return DECODE_NO_KV_ROOM
        singles = [(seq_id, run[0]) for seq_id, run in runs.items() if len(run) == 1]
        if singles:
            rows = decoder.decode([self._states[s] for s, _ in singles], [e.token_id for s, (_, e) in singles])
            for row, (_, (index, entry)) in enumerate(singles):
                if entry.want_logits:
                    self._logits[index] = rows[row]
        for seq_id, run in runs.items():
            if len(run) > 1:
                logits = decoder.prefill(self._states[seq_id], [e.token_id for _, e in run])
                index, last = run[-1]
                if last.want_logits:
                    self._logits[index] = logits
        return DECODE_OK

    def logits(self, batch_index: int) -> np.ndarray:
        """Raw logits [n_vocab] of the token at ``batch_index`` of the last decoded batch."""
        logits = self._logits.get(batch_index)
        if logits is None:
            raise EngineError(f"no logits for batch index {batch_index}")
        return logits

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Drop the sequence's positions in [p0, p1) (-1: open end). Only suffixes can be dropped
        from a contiguous cache; a hole in the middle is refused (False), as llama.cpp may."""
        state = self._states.get(seq_id)
        if state is None:
            return True
        start = max(p0, 0)
        if p1 != -1 and p1 < state.length:
            return start >= p1  # an empty range is fine; a hole is not
        if start == 0:
            self._decoder().forget(state)
            del self._states[seq_id]  # the arrays go with it
        else:
            state.truncate(min(start, state.length))
        return True

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest cached position of the sequence, -1 when it holds no cells."""
        state = self._states.get(seq_id)
        return -1 if state is None else state.length - 1

    def free(self) -> None:
        self._states.clear()
        self._logits = {}
        self.decoder = None
