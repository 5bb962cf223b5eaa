"""Streaming text never emits half a character and never emits any part of a stop string."""

from __future__ import annotations

import codecs
import itertools
from collections.abc import Sequence

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers

from llm_shared.errors import InvalidRequestError
from llm_shared.modelfile import default_gguf_path
from llm_shared.textstream import IncrementalDetokenizer, TextStream
from llm_shared.tokenizer import Tokenizer
from llm_shared.tokenizer_load import TokenizerParts, byte_decoder

SPECIAL = "<|end|>"


def tiny_tokenizer(pieces: Sequence[bytes] = ()) -> tuple[Tokenizer, list[int]]:
    """A byte-level tokenizer: ids 0-255 are single bytes, then ``pieces``, then one special token.

    Streams are driven by pushing ids directly, so token boundaries are whatever a test needs.
    Returns the tokenizer and the ids of ``pieces``.
    """
    by_byte = {b: c for c, b in byte_decoder().items()}
    backend = tokenizers.Tokenizer(models.BPE({by_byte[b]: b for b in range(256)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    table = (*(bytes([b]) for b in range(256)), *pieces, SPECIAL.encode())
    special_id = len(table) - 1
    parts = TokenizerParts(backend, table, frozenset({special_id}), None, special_id, "")
    return Tokenizer(parts), list(range(256, 256 + len(pieces)))


def push_all(stream: TextStream, ids: Sequence[int]) -> tuple[list[str], bool]:
    outputs, stopped = [], False
    for token_id in ids:
        text, stopped = stream.push(token_id)
        outputs.append(text)
        if stopped:
            break
    return outputs, stopped


# --- IncrementalDetokenizer -----------------------------------------------------------------


def test_characters_split_across_byte_tokens_come_out_whole() -> None:
    tok, _ = tiny_tokenizer()
    text = "日本👍🏽é!"
    detok = IncrementalDetokenizer(tok)
    outputs = [detok.push(b) for b in text.encode()]
    assert detok.flush() == ""
    assert "".join(outputs) == text
    # Each character appears exactly once, in the push that completed it.
    assert [o for o in outputs if o] == list(text)
    assert outputs[:3] == ["", "", "日"]


def test_invalid_and_unfinished_bytes_become_replacement_chars_like_decode() -> None:
    tok, ids = tiny_tokenizer([b"\xff", b"ok", b"\xe6\x97"])
    detok = IncrementalDetokenizer(tok)
    pushed = "".join(detok.push(i) for i in ids)
    assert pushed == "\ufffdok"
    assert pushed + detok.flush() == tok.decode(ids) == "\ufffdok\ufffd"


def test_special_tokens_are_skipped_or_spelled_out() -> None:
    tok, _ = tiny_tokenizer()
    assert IncrementalDetokenizer(tok).push(tok.eos_id) == ""
    assert IncrementalDetokenizer(tok, skip_special=False).push(tok.eos_id) == SPECIAL


def test_unknown_token_id_is_a_typed_error() -> None:
    tok, _ = tiny_tokenizer()
    with pytest.raises(InvalidRequestError):
        IncrementalDetokenizer(tok).push(tok.vocab_size)


# --- TextStream -----------------------------------------------------------------------------


def test_no_stop_strings_emits_everything() -> None:
    tok, ids = tiny_tokenizer([b"Hello", b" wor", b"ld"])
    stream = TextStream(tok)
    outputs, stopped = push_all(stream, ids)
    assert outputs == ["Hello", " wor", "ld"] and not stopped
    assert stream.finish() == ""
    assert stream.text == "Hello world"


def test_stop_split_across_tokens_is_held_back_and_cut() -> None:
    tok, ids = tiny_tokenizer([b"Hello S", b"T", b"O", b"P and more"])
    stream = TextStream(tok, ["STOP"])
    outputs, stopped = push_all(stream, ids)
    assert outputs == ["Hello ", "", "", ""] and stopped
    assert stream.text == "Hello " and stream.matched_stop == "STOP"
    assert stream.push(ids[0]) == ("", True)
    assert stream.finish() == ""


def test_stop_at_the_first_token() -> None:
    tok, ids = tiny_tokenizer([b"STOP right away"])
    stream = TextStream(tok, ["STOP"])
    assert stream.push(ids[0]) == ("", True)
    assert stream.text == ""


def test_stop_inside_one_token_keeps_the_text_before_it() -> None:
    tok, ids = tiny_tokenizer([b"abc\n\nUser: hi"])
    stream = TextStream(tok, ["\n\nUser:"])
    assert stream.push(ids[0]) == ("abc", True)


def test_false_start_is_released() -> None:
    tok, ids = tiny_tokenizer([b"ST", b"O", b"RE", b"!"])
    stream = TextStream(tok, ["STOP"])
    outputs, stopped = push_all(stream, ids)
    assert outputs == ["", "", "STORE", "!"] and not stopped
    assert stream.finish() == "" and stream.text == "STORE!"


def test_held_tail_is_released_at_finish() -> None:
    tok, ids = tiny_tokenizer([b"the end. ST"])
    stream = TextStream(tok, ["STOP"])
    assert stream.push(ids[0]) == ("the end. ", False)
    assert stream.finish() == "ST"
    assert stream.text == "the end. ST"


def test_overlapping_candidates_stop_at_the_earliest_start() -> None:
    # "bc" completes first and cuts the held "a"+"bc" after "a".
    tok, ids = tiny_tokenizer([b"a", b"b", b"c", b"d"])
    stream = TextStream(tok, ["abcd", "bc"])
    outputs, stopped = push_all(stream, ids)
    assert outputs == ["", "", "a"] and stopped and stream.matched_stop == "bc"
    # Both complete in one token: the one that starts first wins.
    tok, ids = tiny_tokenizer([b"xabcd"])
    stream = TextStream(tok, ["bcd", "abc"])
    assert stream.push(ids[0]) == ("x", True) and stream.matched_stop == "abc"


def test_repeated_prefix_characters() -> None:
    tok, ids = tiny_tokenizer([b"a", b"b"])
    stream = TextStream(tok, ["aab"])
    outputs, stopped = push_all(stream, [ids[0], ids[0], ids[0], ids[1]])
    assert outputs == ["", "", "a", ""] and stopped and stream.text == "a"


def test_stop_on_a_multibyte_character_split_across_tokens() -> None:
    tok, _ = tiny_tokenizer()
    stream = TextStream(tok, ["本"])
    outputs, stopped = push_all(stream, list("日本語".encode()))
    assert stopped and "".join(outputs) == "日"
    assert "\ufffd" not in "".join(outputs)


def test_special_tokens_do_not_reach_the_text() -> None:
    tok, ids = tiny_tokenizer([b"hi"])
    stream = TextStream(tok, ["<|"])
    outputs, stopped = push_all(stream, [ids[0], tok.eos_id])
    assert outputs == ["hi", ""] and not stopped
    # Spelled out, the special's text can match a stop string.
    stream = TextStream(tok, ["<|"], skip_special=False)
    assert push_all(stream, [ids[0], tok.eos_id]) == (["hi", ""], True)


@pytest.mark.parametrize("stop", ["STOP", ["STOP", ""], [None]])
def test_invalid_stop_strings_are_rejected(stop: object) -> None:
    tok, _ = tiny_tokenizer()
    with pytest.raises(InvalidRequestError) as e:
        TextStream(tok, stop)  # type: ignore[arg-type]
    assert e.value.param == "stop"


def reference_stream(pieces: Sequence[bytes], stops: Sequence[str]) -> tuple[list[str], bool]:
    """What a stream must emit: at each token, the decoded text so far minus its longest tail that
    is a proper prefix of a stop; once a stop occurs, everything before its earliest occurrence."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    seen, emitted, outputs = "", 0, []
    for i, piece in enumerate([*pieces, None]):
        seen += decoder.decode(b"", final=True) if piece is None else decoder.decode(piece)
        found = [at for s in stops if (at := seen.find(s)) != -1]
        if found:
            outputs.append(seen[emitted:min(found)])
            return outputs, True
        hold = max((k for s in stops for k in range(1, len(s)) if seen.endswith(s[:k])), default=0)
        keep = len(seen) if piece is None else len(seen) - hold
        outputs.append(seen[emitted:keep])
        emitted = keep
        assert i <= len(pieces)
    return outputs, False


ALPHABET = "ab日👍\n "


@st.composite
def token_pieces(draw: st.DrawFn) -> list[bytes]:
    """Text cut at random byte positions (splitting characters), sometimes with stray bytes."""
    data = draw(st.text(ALPHABET, max_size=24)).encode()
    if draw(st.booleans()):
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=2)) + data[at:]
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=len(data))))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@settings(max_examples=400, deadline=None)
@given(pieces=token_pieces(), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3))
def test_stream_matches_reference_model(pieces: list[bytes], stops: list[str]) -> None:
    tok, ids = tiny_tokenizer(pieces)
    stream = TextStream(tok, stops)
    outputs, stopped = push_all(stream, ids)
    if not stopped:
        text = stream.finish()
        outputs.append(text)
        stopped = stream.stopped
    assert (outputs, stopped) == reference_stream(pieces, stops)
    assert stream.text == "".join(outputs)
    if not stops:
        assert stream.text == tok.decode(ids)


# --- with the real model's tokenizer --------------------------------------------------------


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path())


@pytest.mark.model
@pytest.mark.parametrize("text", ["👨‍👩‍👧‍👦 family", "日本語のテキスト、中文文本。", "🇯🇵🇺🇸 flags", "naïve 👩🏽‍💻 ok"])
def test_real_tokens_split_characters_but_never_emit_halves(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    outputs = [detok.push(i) for i in ids]
    assert "" in outputs  # some token really did end inside a character
    assert not any("\ufffd" in o for o in outputs)
    assert "".join(outputs) + detok.flush() == tok.decode(ids) == text


@pytest.mark.model
@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=60))
def test_real_tokenizer_stream_reassembles_any_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    stream = TextStream(tok)
    outputs, stopped = push_all(stream, ids)
    assert not stopped
    # Not always == text: the vocabulary lacks a few single bytes (e.g. 0x04, 0xF1), which
    # llama.cpp drops too (see test_tokenizer.py).
    assert "".join(outputs) + stream.finish() == tok.decode(ids)
