"""The embedded model's tokenizer through the load cache: what a hit loads behaves exactly as the
tokenizer built from the GGUF, and a hit never opens the GGUF reader."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import gguf
import pytest

from llm_shared.load_cache import CACHE_DIR_ENV, SWITCH_ENV, LoadCache
from llm_shared.modelfile import default_gguf_path
from llm_shared.models import ModelConfig, tokenizer_for
from llm_shared.tokenizer import Tokenizer

pytestmark = pytest.mark.model

TEXTS = [
    "Hello world",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "3.14159265358979323846 and 1234567890123456789, -42e-7, 1,000,000",
    "a   b\t\t c \n\n  d  ",
    "日本語のテキスト、中文文本。한국어 텍스트 👨‍👩‍👧‍👦 🇯🇵🇺🇸",
    "Crème brûlée, naïve café, Ångström, Ελληνικά, русский, עברית, العربية",
    "<|im_start|>user\nhi<|im_end|>\n",
    "x<|im_end|>y <|endoftext|> <file_sep><jupyter_code>",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],  # the template adds its default system prompt
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
]


def forbid_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    def reader(*args: object, **kwargs: object) -> object:
        raise AssertionError("the GGUF reader was called on a cache hit")

    monkeypatch.setattr(gguf, "GGUFReader", reader)


def assert_same_tokenizer(got: Tokenizer, want: Tokenizer) -> None:
    assert (got.vocab_size, got.bos_id, got.eos_id, got.special_ids, got.max_token_bytes) == (
        want.vocab_size, want.bos_id, want.eos_id, want.special_ids, want.max_token_bytes)
    assert got.chat_template == want.chat_template
    assert all(got.token_bytes(i) == want.token_bytes(i) for i in range(want.vocab_size))
    for text in TEXTS:
        for special in (False, True):
            ids = want.encode(text, special=special)
            assert got.encode(text, special=special) == ids, (text, special)
            assert got.decode(ids) == want.decode(ids) and got.decode(ids, skip_special=True) == want.decode(
                ids, skip_special=True)
    for chat in CHATS:
        for gen in (True, False):
            assert got.apply_chat_template(chat, add_generation_prompt=gen) == want.apply_chat_template(
                chat, add_generation_prompt=gen)
            assert got.encode_chat(chat, add_generation_prompt=gen) == want.encode_chat(chat, add_generation_prompt=gen)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Path]:
    """The tokenizer built from the GGUF on a miss, and the cache root it was stored in."""
    root = tmp_path_factory.mktemp("tokenizer-cache")
    cache = LoadCache(root)
    tokenizer = Tokenizer.from_gguf(default_gguf_path(), cache=cache)
    assert cache.outcomes == {"tokenizer": "miss"}
    return tokenizer, root


def test_a_hit_behaves_exactly_as_the_built_tokenizer_without_the_gguf_reader(
    built: tuple[Tokenizer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    want, root = built
    forbid_reader(monkeypatch)
    cache = LoadCache(root)
    got = Tokenizer.from_gguf(default_gguf_path(), cache=cache)
    assert cache.outcomes == {"tokenizer": "hit"}
    assert_same_tokenizer(got, want)


def test_a_truncated_tokenizer_json_is_ignored_and_rebuilt(
    built: tuple[Tokenizer, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    want, root = built
    copy = tmp_path / "cache"
    shutil.copytree(root, copy)
    (entry,) = [p for p in copy.iterdir() if p.name.startswith("tokenizer-")]
    data = (entry / "tokenizer.json").read_bytes()
    (entry / "tokenizer.json").write_bytes(data[: len(data) // 3])
    cache = LoadCache(copy)
    with caplog.at_level(logging.WARNING, logger="llm_shared.load_cache"):
        rebuilt = Tokenizer.from_gguf(default_gguf_path(), cache=cache)
    assert cache.outcomes == {"tokenizer": "miss"}
    assert any("ignoring the tokenizer entry" in r.getMessage() for r in caplog.records)
    assert_same_tokenizer(rebuilt, want)
    forbid_reader(monkeypatch)  # stored whole again
    assert_same_tokenizer(Tokenizer.from_gguf(default_gguf_path(), cache=LoadCache(copy)), want)


def test_tokenizer_for_uses_the_environments_cache_and_its_off_switch(
    built: tuple[Tokenizer, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want, root = built
    model = ModelConfig(id="smollm2", source=str(default_gguf_path()))
    (tmp_path / "home").mkdir()
    shutil.copytree(root, tmp_path / "home" / "load")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "home"))
    monkeypatch.setattr(gguf, "GGUFReader", None)  # a hit must not need it
    assert_same_tokenizer(tokenizer_for(model), want)

    monkeypatch.undo()
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "other"))
    monkeypatch.setenv(SWITCH_ENV, "off")
    assert tokenizer_for(model).vocab_size == want.vocab_size  # built from the GGUF
    assert not (tmp_path / "other").exists()
