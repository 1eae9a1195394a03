"""Shared fixtures: tiny random checkpoints built once per session, the default GGUF path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import default_gguf_path, make_tiny_checkpoint  # noqa: E402

SERVICE_FIXTURES = frozenset({"pg_store", "redis_prefix"})  # PostgreSQL / Redis on 127.0.0.1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that needs PostgreSQL or Redis carries the `services` marker, so that
    `-m "not services"` runs where they are absent: a test that forgets it fails here."""
    unmarked = [item.nodeid for item in items
                if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ()))
                and item.get_closest_marker("services") is None]
    if unmarked:
        raise pytest.UsageError("tests using PostgreSQL/Redis fixtures without "
                                f"@pytest.mark.services: {unmarked}")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def thinker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with `<think>` and `</think>` added to its vocabulary, one token
    each (as a reasoning model's tokenizer has them)."""
    from transformers import AutoTokenizer

    out = make_tiny_checkpoint(tmp_path_factory.mktemp("thinker"), "llama", vocab_size=49154)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_tokens(["<think>", "</think>"])
    assert len(tok) == 49154
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_llama_bias_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with `attention_bias`: a bias on Q, K, V and the output projection."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-bias"), "llama",
                                attention_bias=True)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_smollm3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-smollm3"), "smollm3")


@pytest.fixture(scope="session")
def tiny_granite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-granite"), "granite")


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-mixtral"), "mixtral")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_granitemoe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-granitemoe"), "granitemoe")


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2-moe"), "qwen2_moe")


@pytest.fixture(scope="session")
def tiny_olmoe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-olmoe"), "olmoe")


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-phi3"), "phi3")


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="session", autouse=True)
def native_kernels_built() -> None:
    """Build the engine's CPU kernels once, first (about 45 s on a machine that has never
    built them), so engines started in subprocesses (e2e, real workers) find them cached
    instead of compiling inside their startup timeouts."""
    import torch

    from sluice.engine.native import native_ops

    native_ops("auto", torch.device("cpu"), torch.float32)
