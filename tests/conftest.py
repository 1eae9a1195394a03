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


def tiny_checkpoint(name: str, arch: str, **overrides: object) -> object:
    """The session fixture `name` (`tiny_<key>_dir`): a tiny random `arch` checkpoint
    (tiny_models.make_tiny_checkpoint with `overrides`), built once in a folder named
    `tiny-<key>` (its served model name: tests read the `tiny-` prefix)."""
    folder = name.removesuffix("_dir").replace("_", "-")

    @pytest.fixture(scope="session", name=name)
    def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return make_tiny_checkpoint(tmp_path_factory.mktemp(folder), arch, **overrides)

    return build


tiny_llama_dir = tiny_checkpoint("tiny_llama_dir", "llama")
# Llama with `attention_bias`: a bias on Q, K, V and the output projection
tiny_llama_bias_dir = tiny_checkpoint("tiny_llama_bias_dir", "llama", attention_bias=True)
tiny_qwen2_dir = tiny_checkpoint("tiny_qwen2_dir", "qwen2")
tiny_qwen3_dir = tiny_checkpoint("tiny_qwen3_dir", "qwen3")
tiny_smollm3_dir = tiny_checkpoint("tiny_smollm3_dir", "smollm3")
tiny_granite_dir = tiny_checkpoint("tiny_granite_dir", "granite")
tiny_phi3_dir = tiny_checkpoint("tiny_phi3_dir", "phi3")
# Phi-4-mini's shape: longrope (its own short and long factors past 32 positions, 128
# served; the original context top-level, as Phi-3's configs have it) over half of each head
tiny_phi3_longrope_dir = tiny_checkpoint(
    "tiny_phi3_longrope_dir", "phi3", partial_rotary_factor=0.5, max_position_embeddings=128,
    original_max_position_embeddings=32, rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 32,
                  "short_factor": [1.0, 1.3, 1.7, 2.5], "long_factor": [1.0, 4.0, 11.0, 29.0]})
# Qwen2.5's YaRN, factor 4 over 32 positions
tiny_qwen2_yarn_dir = tiny_checkpoint(
    "tiny_qwen2_yarn_dir", "qwen2", max_position_embeddings=32,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
tiny_mixtral_dir = tiny_checkpoint("tiny_mixtral_dir", "mixtral")
tiny_qwen3_moe_dir = tiny_checkpoint("tiny_qwen3_moe_dir", "qwen3_moe")
tiny_granitemoe_dir = tiny_checkpoint("tiny_granitemoe_dir", "granitemoe")
tiny_qwen2_moe_dir = tiny_checkpoint("tiny_qwen2_moe_dir", "qwen2_moe")
tiny_olmoe_dir = tiny_checkpoint("tiny_olmoe_dir", "olmoe")
tiny_olmo2_dir = tiny_checkpoint("tiny_olmo2_dir", "olmo2")
tiny_olmo3_dir = tiny_checkpoint("tiny_olmo3_dir", "olmo3")
tiny_exaone4_dir = tiny_checkpoint("tiny_exaone4_dir", "exaone4")
tiny_granite4_dir = tiny_checkpoint("tiny_granite4_dir", "granitemoehybrid")
tiny_glm_dir = tiny_checkpoint("tiny_glm_dir", "glm")
tiny_glm4_dir = tiny_checkpoint("tiny_glm4_dir", "glm4")
tiny_helium_dir = tiny_checkpoint("tiny_helium_dir", "helium")
tiny_arcee_dir = tiny_checkpoint("tiny_arcee_dir", "arcee")
tiny_gemma2_dir = tiny_checkpoint("tiny_gemma2_dir", "gemma2")
tiny_gemma3_dir = tiny_checkpoint("tiny_gemma3_dir", "gemma3")


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
