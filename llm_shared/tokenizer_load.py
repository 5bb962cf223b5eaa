"""Building a Hugging Face ``tokenizers`` backend from a GGUF file or a tokenizer.json.

Only byte-level BPE vocabularies (GPT-2 style, as SmolLM2 uses) are supported; anything
else is refused at load time with a message saying what was found, rather than tokenizing
subtly differently from llama.cpp. Building from a GGUF takes seconds (gguf's Python reader
walks every token); with a ``LoadCache`` the parts are saved as a ``tokenizer.json`` and a small
JSON file, which load in a fraction of that the next time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from llm_shared.errors import ModelFileError
from llm_shared.load_cache import CorruptEntry, LoadCache
from llm_shared.modelfile import check_gguf

# llama.cpp token types (llama_token_type in llama.h).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizers llama.cpp implements with one regex set: split every digit on its own
# ("\p{N}"), then the GPT-2 regex. SmolLM2 ships as 'smollm'.
DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
GPT2_PRES = frozenset({"gpt-2"})

# Bump when what load_gguf builds from the same file changes, so older cache entries miss.
CACHE_VERSION = "1"


@dataclass(frozen=True)
class TokenizerParts:
    """Everything a Tokenizer is made of, independent of where it was read from."""

    backend: tokenizers.Tokenizer  # special tokens already registered as special AddedTokens
    token_bytes: tuple[bytes, ...]  # raw bytes per id, indexed by id
    special_ids: frozenset[int]
    bos_id: int | None
    eos_id: int
    chat_template: str


def byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte<->unicode map, inverted: the character a vocab entry uses -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shifted = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def unmap_byte_level(token: str, table: Mapping[str, int]) -> bytes:
    """The bytes a byte-level vocab entry stands for; entries outside the map are literal text."""
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _byte_level_backend(vocab: dict[str, int], merges: list[tuple[str, str]], pre: str) -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _field_str(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _field_int(reader: Any, key: str) -> int | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    return int(field.parts[field.data[0]][0])


def _field_str_list(reader: Any, key: str) -> list[str] | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def load_gguf(path: str | Path, *, cache: LoadCache | None = None) -> TokenizerParts:
    """Read the tokenizer.ggml.* metadata of a GGUF file and build the equivalent backend;
    through ``cache`` when given (keyed by the file's SHA-256, ``CACHE_VERSION`` and the
    ``tokenizers`` version), storing what was built on a miss."""
    path = check_gguf(Path(path))
    if cache is None or not cache.enabled:
        return _read_gguf(path)
    key = {"kind": "tokenizer", "source_sha256": cache.source_sha256(path), "version": CACHE_VERSION,
           "tokenizers": tokenizers.__version__}
    parts = cache.load(key, read_parts)
    if parts is None:
        parts = _read_gguf(path)
        cache.store(key, lambda folder: write_parts(parts, folder))
    return parts


def write_parts(parts: TokenizerParts, folder: Path) -> None:
    """``tokenizer.json`` (the backend, special tokens included) and ``parts.json`` (the rest)."""
    (folder / "tokenizer.json").write_text(parts.backend.to_str(), encoding="utf-8")
    rest = {
        "token_bytes": [b.decode("latin-1") for b in parts.token_bytes],  # one character per byte
        "special_ids": sorted(parts.special_ids),
        "bos_id": parts.bos_id,
        "eos_id": parts.eos_id,
        "chat_template": parts.chat_template,
    }
    (folder / "parts.json").write_text(json.dumps(rest, ensure_ascii=False), encoding="utf-8")


def read_parts(folder: Path) -> TokenizerParts:
    """What ``write_parts`` wrote; ``CorruptEntry`` if it is not that."""
    try:
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:  # the Rust side raises a bare Exception on a malformed file
        raise CorruptEntry(f"tokenizer.json does not load: {e}") from e
    try:
        rest = json.loads((folder / "parts.json").read_text(encoding="utf-8"))
        token_bytes = tuple(t.encode("latin-1") for t in rest["token_bytes"])
        special_ids = frozenset(rest["special_ids"])
        bos_id, eos_id, chat_template = rest["bos_id"], rest["eos_id"], rest["chat_template"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # UnicodeError is a ValueError
        raise CorruptEntry(f"parts.json is not what write_parts writes: {e}") from e
    ids = (*special_ids, eos_id) if bos_id is None else (*special_ids, eos_id, bos_id)
    if not all(isinstance(i, int) and 0 <= i < len(token_bytes) for i in ids) or not isinstance(chat_template, str):
        raise CorruptEntry("parts.json holds ids outside the vocabulary or values of the wrong type")
    return TokenizerParts(backend, token_bytes, special_ids, bos_id, eos_id, chat_template)


def _read_gguf(path: Path) -> TokenizerParts:
    # Imported here: gguf pulls in numpy and is only needed when parsing.
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        model = _field_str(reader, "tokenizer.ggml.model")
        pre = _field_str(reader, "tokenizer.ggml.pre") or "default"
        tokens = _field_str_list(reader, "tokenizer.ggml.tokens")
        merge_lines = _field_str_list(reader, "tokenizer.ggml.merges")
        type_field = reader.fields.get("tokenizer.ggml.token_type")
        types = [int(type_field.parts[i][0]) for i in type_field.data] if type_field is not None else None
        bos_id = _field_int(reader, "tokenizer.ggml.bos_token_id")
        eos_id = _field_int(reader, "tokenizer.ggml.eos_token_id")
        chat_template = _field_str(reader, "tokenizer.chat_template") or ""
    except (ValueError, UnicodeDecodeError, IndexError) as e:
        raise ModelFileError(f"cannot read tokenizer metadata from {str(path)!r}: {e}") from e

    if model != "gpt2":
        raise ModelFileError(f"{str(path)!r}: tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    if pre not in DIGIT_SPLIT_PRES and pre not in GPT2_PRES:
        raise ModelFileError(f"{str(path)!r}: pre-tokenizer {pre!r} is not supported")
    if not tokens or merge_lines is None:
        raise ModelFileError(f"{str(path)!r} has no tokenizer.ggml.tokens/merges")
    if types is None:
        types = [TOKEN_TYPE_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFileError(f"{str(path)!r}: {len(types)} token types for {len(tokens)} tokens")
    for name, value in (("bos", bos_id), ("eos", eos_id)):
        if value is not None and not 0 <= value < len(tokens):
            raise ModelFileError(f"{str(path)!r}: {name} token id {value} is outside the vocabulary")
    if eos_id is None:
        raise ModelFileError(f"{str(path)!r} names no EOS token (tokenizer.ggml.eos_token_id)")

    merges: list[tuple[str, str]] = []
    for line in merge_lines:
        left, sep, right = line.partition(" ")
        if not sep or not left or not right:
            raise ModelFileError(f"{str(path)!r}: malformed merge {line!r}")
        merges.append((left, right))
    # Some vocabularies repeat an entry; encoding can reach only the first id, decoding handles both.
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    backend = _byte_level_backend(vocab, merges, pre)

    special_ids = frozenset(i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL)
    user_defined = [i for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    # CONTROL tokens are parsed from text only on request; USER_DEFINED ones always, as in
    # llama.cpp's tokenizer_st_partition, so they are added as ordinary (non-special) added tokens.
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)])
    if user_defined:
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])

    table = byte_decoder()
    literal = special_ids.union(user_defined)
    token_bytes = tuple(
        tok.encode("utf-8") if i in literal else unmap_byte_level(tok, table) for i, tok in enumerate(tokens)
    )
    return TokenizerParts(backend, token_bytes, special_ids, bos_id, eos_id, chat_template)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json names tokens either as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _config_chat_template(config: Mapping[str, Any], config_dir: Path) -> str:
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, Sequence):
        # Several named templates: the default one is what apply_chat_template would use.
        for entry in template:
            if isinstance(entry, Mapping) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return entry["template"]
    # Recent transformers save the template next to the config instead.
    jinja_file = config_dir / "chat_template.jinja"
    return jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else ""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"cannot read {str(path)!r}: {e}") from e
    if not isinstance(data, dict):
        raise ModelFileError(f"{str(path)!r} must hold a JSON object")
    return data


def load_hf(tokenizer_json: str | Path, tokenizer_config_json: str | Path | None = None) -> TokenizerParts:
    """Load a Hugging Face tokenizer.json (+ tokenizer_config.json, by default the one beside it)."""
    tokenizer_json = Path(tokenizer_json)
    spec = _read_json(tokenizer_json)
    decoder = spec.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        raise ModelFileError(
            f"{str(tokenizer_json)!r}: decoder {decoder.get('type')!r} is not supported (only byte-level BPE)"
        )
    try:
        backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
    except Exception as e:  # the Rust side raises a bare Exception on a malformed spec
        raise ModelFileError(f"{str(tokenizer_json)!r} is not a valid tokenizer.json: {e}") from e

    config_path = Path(tokenizer_config_json) if tokenizer_config_json else tokenizer_json.with_name(
        "tokenizer_config.json"
    )
    if not config_path.is_file():
        raise ModelFileError(f"{str(config_path)!r} not found: it names the EOS token and the chat template")
    config = _read_json(config_path)

    id_to_text = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
    vocab_size = max(id_to_text, default=-1) + 1  # ids may have gaps; the table covers every one
    added = backend.get_added_tokens_decoder()
    special_ids = frozenset(i for i, tok in added.items() if tok.special)
    literal = set(added)

    def token_id(key: str) -> int | None:
        content = _token_content(config.get(key))
        if content is None:
            return None
        found = backend.token_to_id(content)
        if found is None:
            raise ModelFileError(f"{str(config_path)!r}: {key} {content!r} is not in the vocabulary")
        return found

    eos_id = token_id("eos_token")
    if eos_id is None:
        raise ModelFileError(f"{str(config_path)!r} names no eos_token")
    table = byte_decoder()
    token_bytes = tuple(
        b"" if i not in id_to_text
        else id_to_text[i].encode("utf-8") if i in literal
        else unmap_byte_level(id_to_text[i], table)
        for i in range(vocab_size)
    )
    return TokenizerParts(
        backend, token_bytes, special_ids, token_id("bos_token"), eos_id,
        _config_chat_template(config, config_path.parent),
    )
