"""One real tokenizer (SmolLM2's, from the embedded GGUF) and one grammar compiler over it for the
whole directory: building llguidance's tokenizer costs ~0.1 s, and a cache shared by the tests is
what the tiers share too (tests that count cache hits make their own compiler)."""

from __future__ import annotations

import pytest

from llm_shared.modelfile import default_gguf_path
from llm_shared.structured import GrammarCompiler
from llm_shared.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path())


@pytest.fixture(scope="session")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, family="smollm2")
