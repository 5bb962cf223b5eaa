"""Is the user's sentence finished? The words of a turn so far, judged by a small language model.

``semantic_vad``'s second opinion (``voice.semantic`` proposes an end from the audio, Smart Turn
v3; this confirms it from the transcript). The audio model alone was fooled by synthetic speech:
it scores flite saying "I'd like to book a table for" as finished (0.84-0.98, docs/voice.md). The
words say otherwise: a chat model that has just read "i'd like to book a table for" expects a
noun, not the end of the message. LiveKit's turn detector is this idea trained for it (a
fine-tuned SmolLM2-135M, then Qwen2.5-0.5B); here the edge tier's own instruct model serves it
untrained, read as:

    P(finished) = P(next token is <|im_end|>, ".", "?", "!" or "...")

after a ChatML prompt whose system message says it is a voice assistant, and the user's words
normalized as a recognizer's output should be (lower case, punctuation dropped: Whisper puts a
full stop after an unfinished clause as readily as after a finished one). Measured on 40 finished
and 40 unfinished assistant requests written for this (``tests/voice/test_text_turn.py``) and the
benchmark's phrases (docs/voice.md): every finished one at 0.03 or above, every unfinished one but
one under 0.01, so a threshold of 0.01 vetoes almost no finished turn.

The system prompt and the turn's opening stay in the KV cache; a judgement decodes only the
user's words (10-20 tokens: ~20-30 ms on one thread here). One llama.cpp context, one judgement
at a time (a lock): the voice pool's workers call it after a recognition.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from llm_shared.errors import EngineError
from llm_shared.llamacpp_runtime import ContextShape, LlamaContext, LlamaModel, TokenBatch
from llm_shared.load_cache import LoadCache
from llm_shared.modelfile import default_gguf_path
from llm_shared.tokenizer import Tokenizer
from voice.asr import transcript_words
from voice.errors import VoiceModelError

SYSTEM = "You are a voice assistant. The user speaks short requests and questions."
# What may come next when a message is over: the end of the turn, or the punctuation that ends a
# sentence (normalized text has none, so the model supplies it where the sentence is complete).
ENDINGS = ("<|im_end|>", ".", "?", "!", "...")
MAX_WORDS = 48  # the turn's last words are what tells; the cost stays bounded for a long turn
N_CTX = 256


def normalize(text: str) -> str:
    """Lower case, words and apostrophes only, the last ``MAX_WORDS`` words."""
    return " ".join(transcript_words(text)[-MAX_WORDS:])


class TextTurnJudge:
    """One per process (``VoiceService``), shared by the pool's workers. Blocking to build (~0.2 s:
    the GGUF is memory-mapped, the edge tier's pages shared)."""

    def __init__(self, path: str | Path = "auto") -> None:
        self.path = default_gguf_path() if path == "auto" else Path(path)
        try:
            self._tokenizer = Tokenizer.from_gguf(self.path, cache=LoadCache.from_env())
        except EngineError as e:  # ModelFileError included
            raise VoiceModelError(f"cannot load the end-of-turn text model: {e.message}") from e
        end = self._tokenizer.encode("<|im_end|>", special=True)
        if len(end) != 1:
            raise VoiceModelError(f"the end-of-turn text model {self.path} is not a ChatML model (no <|im_end|> token)")
        # the end of the turn, and the sentence ends that are single tokens in this vocabulary
        self._ending_ids = [ids[0] for ids in (self._tokenizer.encode(t, special=True) for t in ENDINGS) if len(ids) == 1]
        self._prefix = self._tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n",
                                              special=True)
        self._lock = threading.Lock()
        self._model: LlamaModel | None = None
        self._ctx: LlamaContext | None = None
        self._batch: TokenBatch | None = None
        try:
            self._model = LlamaModel(self.path)
            self._ctx = LlamaContext(self._model, ContextShape(n_ctx=N_CTX, n_seqs=1, n_batch=N_CTX, n_threads=1))
            self._batch = TokenBatch(N_CTX)
            self._decode(self._prefix, 0)  # kept: every judgement continues from it
        except EngineError as e:  # a file llama.cpp refuses, a context it cannot make: nothing left behind
            self.close()
            raise VoiceModelError(f"cannot load the end-of-turn text model: {e.message}") from e

    def end_probability(self, text: str) -> float | None:
        """How likely ``text`` (a transcript) is a finished turn; None when it has no words (the
        audio decides then). Blocking, ~20-30 ms; thread-safe."""
        words = normalize(text)
        if not words:
            return None
        ids = self._tokenizer.encode(words)[-(N_CTX - len(self._prefix)):]
        with self._lock:
            if self._ctx is not None:
                self._ctx.seq_rm(0, len(self._prefix), -1)
            logits = self._decode(ids, len(self._prefix)).astype(np.float64)
        logits -= logits.max()
        p = np.exp(logits)
        return float(p[self._ending_ids].sum() / p.sum())

    def _decode(self, ids: list[int], start: int) -> np.ndarray:
        """Decode ``ids`` at positions from ``start``: the logits after the last (a copy)."""
        batch, ctx = self._batch, self._ctx
        if batch is None or ctx is None:
            raise EngineError("the end-of-turn text model is closed")
        batch.clear()
        for i, token in enumerate(ids):
            batch.add(token, start + i, 0, want_logits=i == len(ids) - 1)
        if ctx.decode(batch) != 0:
            raise EngineError("the end-of-turn text model could not decode the turn")
        return ctx.logits(len(ids) - 1).copy()

    def close(self) -> None:
        with self._lock:
            for part in (self._batch, self._ctx, self._model):
                if part is not None:
                    part.free()
            self._batch = self._ctx = self._model = None
