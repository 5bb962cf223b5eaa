"""The tokenizer every tier shares: text <-> token ids, raw token bytes, and chat prompts.

It wraps a Hugging Face ``tokenizers`` backend built to match llama.cpp's own tokenizer for
the same GGUF file, so the edge tier (llama.cpp) and the torch tier see identical ids.
Special-token text in user content never becomes a special token: ``encode`` parses it only
with ``special=True``, and ``encode_chat`` encodes message contents as ordinary text.
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

import tokenizers

from llm_shared.chat_template import ChatTemplate, validate_messages
from llm_shared.errors import ConfigError, InvalidRequestError
from llm_shared.load_cache import LoadCache
from llm_shared.tokenizer_load import TokenizerParts, load_gguf, load_hf

# Private-use delimiters around a per-call random nonce: content cannot forge a sentinel.
_SENTINEL_OPEN = "\ue000"
_SENTINEL_CLOSE = "\ue001"
# Any call's sentinels (their nonce is checked per match): compiling one pattern per call with the
# nonce in it costs more than the rest of a short prompt's encoding.
_SENTINEL = re.compile(re.escape(_SENTINEL_OPEN) + r"([0-9a-f]{16}):(\d+)" + re.escape(_SENTINEL_CLOSE))
# What a chat template writes around the contents (role headers, a default system prompt) is the
# same turn after turn: its split at special tokens and the ids of its plain runs are remembered
# (a short prompt's encoding was ~190 µs, mostly tokenizing that text again). Bounded in entries
# and in the length of a remembered text.
TEMPLATE_CACHE_ENTRIES = 256
TEMPLATE_CACHE_MAX_CHARS = 4096


class Tokenizer:
    """Byte-level BPE tokenizer with the model's special tokens and chat template. Thread-safe."""

    def __init__(self, parts: TokenizerParts) -> None:
        self._backend = parts.backend
        # A second backend that treats special-token text as ordinary text. The switch is a
        # mutable property, so it lives on its own copy instead of being toggled per call.
        self._plain_backend = tokenizers.Tokenizer.from_str(parts.backend.to_str())
        self._plain_backend.encode_special_tokens = True
        self._token_bytes = parts.token_bytes
        self.vocab_size: int = len(parts.token_bytes)
        # The most bytes any one token decodes to (specials: their text), so N bytes of text are
        # at least ceil(N / max_token_bytes) tokens: a length check that needs no tokenizing.
        self.max_token_bytes: int = max((len(b) for b in parts.token_bytes), default=1) or 1
        self.bos_id: int | None = parts.bos_id
        self.eos_id: int = parts.eos_id
        self.special_ids: frozenset[int] = parts.special_ids
        self.chat_template: str = parts.chat_template
        self._template = (
            ChatTemplate(parts.chat_template, bos_token=self._token_text(parts.bos_id),
                         eos_token=self._token_text(parts.eos_id))
            if parts.chat_template else None
        )
        self._remembered_pieces = functools.lru_cache(maxsize=TEMPLATE_CACHE_ENTRIES)(self._template_pieces)
        self._remembered_plain = functools.lru_cache(maxsize=TEMPLATE_CACHE_ENTRIES)(self._plain_ids)

    @classmethod
    def from_gguf(cls, path: str | Path, *, cache: LoadCache | None = None) -> Tokenizer:
        """The tokenizer stored in a GGUF model file (tokenizer.ggml.* metadata); through the
        load cache when given one (the first load stores it, later ones skip the GGUF parse)."""
        return cls(load_gguf(path, cache=cache))

    @classmethod
    def from_hf(cls, tokenizer_json: str | Path, tokenizer_config_json: str | Path | None = None) -> Tokenizer:
        """A Hugging Face tokenizer.json; the config (default: tokenizer_config.json beside it) names EOS/BOS
        and holds the chat template."""
        return cls(load_hf(tokenizer_json, tokenizer_config_json))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._token_bytes[token_id].decode("utf-8", errors="replace")

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids for ``text`` (no BOS added). With ``special=False`` text such as
        ``<|im_start|>`` is ordinary text, which is what user content must always be."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}", param="text")
        if not text:
            return []
        backend = self._backend if special else self._plain_backend
        return backend.encode(text, add_special_tokens=False).ids

    def _check_ids(self, ids: Sequence[int]) -> None:
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(
                    f"token id {token_id} is outside the vocabulary (size {self.vocab_size})", param="token_ids"
                )

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text for ``ids``; byte sequences that are not valid UTF-8 become U+FFFD."""
        self._check_ids(ids)
        table = self._token_bytes
        if skip_special:
            special = self.special_ids
            data = b"".join(table[i] for i in ids if i not in special)
        else:
            data = b"".join(table[i] for i in ids)
        return data.decode("utf-8", errors="replace")

    @functools.cached_property
    def whole_texts(self) -> tuple[str | None, ...]:
        """Per token id: its bytes decoded, where they are whole UTF-8 characters by themselves
        (nearly every token), else None. Built once (~50 ms for 49k tokens), on first use: the
        detokenizer's table lookup while no bytes of a split character are pending."""
        out: list[str | None] = []
        for data in self._token_bytes:
            try:
                out.append(data.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(None)
        return tuple(out)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (may be part of a UTF-8 character); specials give their text."""
        self._check_ids((token_id,))
        return self._token_bytes[token_id]

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` (either ``special``), found without tokenizing:
        the tokens' bytes join to the text's UTF-8, and none is longer than ``max_token_bytes``."""
        return -(-len(text.encode("utf-8", errors="surrogatepass")) // self.max_token_bytes)

    def min_chat_tokens(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> int:
        """A lower bound on ``len(encode_chat(messages))``: the rendered prompt's ``min_tokens``.
        Rendering is string work (tens of microseconds for 150k characters, where tokenizing them
        takes tens of milliseconds), so a prompt far past a context can be refused first."""
        return self.min_tokens(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))

    def _require_template(self) -> ChatTemplate:
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt", param="messages")
        return self._template

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text the model's template makes of ``messages`` (validated first)."""
        checked = validate_messages(messages)
        return self._require_template().render(checked, add_generation_prompt=add_generation_prompt)

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
        rendered: str | None = None,
    ) -> list[int]:
        """Token ids of the chat prompt, with message contents encoded as ordinary text.

        The template is rendered with each content replaced by a unique sentinel, so we know
        which text the template wrote. Special tokens are recognised only there; everything
        between two of them (template text and contents alike) is encoded as one run, exactly
        as ``encode(rendered, special=True)`` would, so ordinary prompts get identical ids
        (whitespace next to a content may merge with it). If the template alters contents (so
        substituting them back would not reproduce its output), this refuses rather than guess.
        ``rendered``: ``apply_chat_template`` of the same messages, when the caller already has it
        (checking a length bound first), so the template is not rendered for that once more.
        """
        checked = validate_messages(messages)
        template = self._require_template()
        nonce = secrets.token_hex(8)
        masked = [
            {"role": m["role"], "content": f"{_SENTINEL_OPEN}{nonce}:{i}{_SENTINEL_CLOSE}"}
            for i, m in enumerate(checked)
        ]
        with_sentinels = template.render(masked, add_generation_prompt=add_generation_prompt)

        ids: list[int] = []
        run: list[str] = []  # ordinary text since the last special token
        pos = 0
        for match in _SENTINEL.finditer(with_sentinels):
            if match.group(1) != nonce:
                continue  # not ours: template text that only looks like a sentinel
            self._add_template_text(with_sentinels[pos:match.start()], run, ids)
            run.append(checked[int(match.group(2))]["content"])
            pos = match.end()
        self._add_template_text(with_sentinels[pos:], run, ids)
        ids += self._encode_run(run)

        if rendered is None:
            rendered = template.render(checked, add_generation_prompt=add_generation_prompt)
        if self.decode(ids) != rendered:
            raise InvalidRequestError(
                "the model's chat template transforms message contents, so they cannot be encoded safely",
                param="messages",
            )
        return ids

    def _add_template_text(self, text: str, run: list[str], ids: list[int]) -> None:
        """Emit the special tokens in template-written ``text``; ordinary text goes on the run."""
        pieces, rest = (self._remembered_pieces if len(text) <= TEMPLATE_CACHE_MAX_CHARS
                        else self._template_pieces)(text)
        for before, special_id in pieces:
            run.append(before)
            ids += self._encode_run(run)
            run.clear()
            ids.append(special_id)
        run.append(rest)

    def _encode_run(self, run: list[str]) -> Sequence[int]:
        """The ids of a run of ordinary text. One piece is template text alone (a content always
        comes with the template text before it), and is encoded through the cache."""
        if len(run) == 1 and len(run[0]) <= TEMPLATE_CACHE_MAX_CHARS:
            return self._remembered_plain(run[0])
        return self.encode("".join(run), special=False)

    def _template_pieces(self, text: str) -> tuple[tuple[tuple[str, int], ...], str]:
        """``text`` split at its special tokens: (the ordinary text before one, its id) pairs, and
        the ordinary text after the last."""
        encoding = self._backend.encode(text, add_special_tokens=False)
        pieces: list[tuple[str, int]] = []
        cursor = 0
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in self.special_ids:
                pieces.append((text[cursor:start], token_id))
                cursor = end
        return tuple(pieces), text[cursor:]

    def _plain_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.encode(text, special=False))


def check_same_tokenizer(target: Tokenizer, drafter: Tokenizer, drafter_name: str, role: str = "drafter") -> None:
    """Refuse a model whose token ids mean something else than the target's: a drafter, or the
    cascade's edge tier, whose held tokens become the target's draft.

    Verification compares ids, so the vocabularies must agree id for id (bytes of every token)
    and on the end-of-sequence id; merges may differ without harm, since the drafter only ever
    reads and proposes ids.
    """
    if drafter is target:
        return
    why = ""
    if drafter.vocab_size != target.vocab_size:
        why = f"its vocabulary has {drafter.vocab_size} tokens, the target's {target.vocab_size}"
    elif drafter.eos_id != target.eos_id:
        why = f"its end-of-sequence id is {drafter.eos_id}, the target's {target.eos_id}"
    elif differ := [i for i in range(target.vocab_size) if target.token_bytes(i) != drafter.token_bytes(i)]:
        first = differ[0]
        why = (f"{len(differ)} token(s) differ, first id {first}: {drafter.token_bytes(first)!r} in the {role}, "
               f"{target.token_bytes(first)!r} in the target")
    if why:
        raise ConfigError(f"{role} {drafter_name!r} does not share the target's tokenizer: {why}; "
                          f"a {role} must use its target's vocabulary")
