"""Text of a request's tokens in the step loop, at a table lookup a token.

``TextStream`` (llm_shared.textstream) decodes every token through an incremental UTF-8 decoder
and scans the text for stop strings. For a request without stop strings the engine uses
``PlainTextStream`` instead: nearly every token's bytes are whole characters, and while no bytes
of a split character are pending, such a token's text is its decoded bytes, looked up in a table
built once per tokenizer (``TokenTexts``). Only around a character split across tokens does the
incremental decoder run. The texts are exactly ``TextStream(tokenizer, ())``'s, token for token.
"""

from __future__ import annotations

import codecs

from llm_shared.tokenizer import Tokenizer


class TokenTexts:
    """Per token id: its text when no bytes are pending ("" for a special token, which is skipped),
    or None when its bytes are not whole UTF-8 characters by themselves."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_ids = tokenizer.special_ids
        self.texts: list[str | None] = []
        for token_id in range(tokenizer.vocab_size):
            if token_id in self.special_ids:
                self.texts.append("")
                continue
            try:
                self.texts.append(tokenizer.token_bytes(token_id).decode("utf-8"))
            except UnicodeDecodeError:
                self.texts.append(None)


class PlainTextStream:
    """``TextStream(tokenizer, ())`` (no stop strings, specials skipped) for the engine's hot loop:
    the same ``push`` and ``finish`` results."""

    __slots__ = ("_decoder", "_pending", "_texts")

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self._decoder: codecs.IncrementalDecoder | None = None  # made at the first split character
        self._pending = False  # the decoder holds bytes of an unfinished character

    def push(self, token_id: int) -> tuple[str, bool]:
        """(text this token completes, False): a stream without stop strings never stops."""
        if not self._pending:
            try:
                text = self._texts.texts[token_id]
            except IndexError:  # outside the vocabulary: token_bytes below raises the tokenizer's error
                text = None
            if text is not None:
                return text, False
        data = self._texts.tokenizer.token_bytes(token_id)  # checks the id, as IncrementalDetokenizer does
        if token_id in self._texts.special_ids:
            return "", False  # skipped without touching pending bytes, as IncrementalDetokenizer does
        if self._decoder is None:
            self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = self._decoder.decode(data)
        self._pending = bool(self._decoder.getstate()[0])
        return text, False

    def finish(self) -> str:
        """End of generation: pending bytes that cannot complete become U+FFFD."""
        if self._decoder is None:
            return ""
        self._pending = False
        return self._decoder.decode(b"", final=True)
