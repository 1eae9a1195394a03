"""Fixtures for the benchmark tests: a small word-level tokenizer file, the stub server."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from stub_server import StubConfig, StubState, running_stub  # noqa: E402

from sluice.bench.tokens import WORDS  # noqa: E402


def write_word_tokenizer(path: Path) -> Path:
    """A WordLevel tokenizer over the benchmark's words plus a few extra tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "tok": 2}
    for w in dict.fromkeys(WORDS):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_word_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def stub(tokenizer_file: Path) -> Iterator[tuple[str, StubState]]:
    with running_stub(StubConfig(tokenizer_path=str(tokenizer_file))) as s:
        yield s
