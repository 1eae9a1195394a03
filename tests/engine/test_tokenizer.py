"""Tokenizer: GGUF-built and HF-directory tokenizers agree with transformers', chat templates
render as transformers renders them, and bad model paths fail with errors naming the file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.engine.tokenizer import (
    DEFAULT_GGUF_NAME,
    ModelNotFoundError,
    Tokenizer,
    default_served_name,
    load_tokenizer,
    resolve_model,
)
from sluice.protocol.errors import InvalidRequestError

TEXTS = [
    "Hello world!",
    "  leading spaces,\n\nblank lines\tand tabs  ",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "naïve café, 東京, emoji 🤖, numbers 1234567 and don't / won't",
    "def f(x):\n    return x ** 2  # comment",
]
MESSAGES = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]


@pytest.fixture(scope="module")
def gguf_tok(default_gguf: Path) -> Tokenizer:
    return load_tokenizer(str(default_gguf))


@pytest.fixture(scope="module")
def hf_reference(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    """transformers' tokenizer for the GGUF: the session fixture built it with
    `AutoTokenizer.from_pretrained(dir, gguf_file=name)` and saved it; reloading the saved
    copy is much cheaper than converting the GGUF again."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(gguf_tok: Tokenizer, hf_reference, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = gguf_tok.encode(text)
    assert ids == hf_reference.encode(text)
    assert gguf_tok.decode(ids) == hf_reference.decode(ids, skip_special_tokens=True)
    assert gguf_tok.decode(ids, skip_special_tokens=False) == hf_reference.decode(ids)
    assert gguf_tok.convert_ids_to_tokens(ids) == hf_reference.convert_ids_to_tokens(ids)


def test_gguf_special_ids_and_template(gguf_tok: Tokenizer, hf_reference) -> None:  # type: ignore[no-untyped-def]
    assert gguf_tok.vocab_size == 49152
    assert gguf_tok.eos_token_ids == {hf_reference.eos_token_id}
    assert gguf_tok.eos_token_id == hf_reference.eos_token_id  # what vLLM users read
    assert gguf_tok.bos_token_id == hf_reference.bos_token_id
    assert gguf_tok.encode("<|im_end|>") == [hf_reference.eos_token_id]  # special stays whole
    assert gguf_tok.decode(gguf_tok.encode("<|im_start|>hi<|im_end|>")) == "hi"
    want = hf_reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert gguf_tok.apply_chat_template(MESSAGES) == want
    assert gguf_tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == \
        hf_reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    # what vLLM users write (`tokenize=False`), and transformers' ids
    assert gguf_tok.apply_chat_template(MESSAGES, tokenize=False,
                                        add_generation_prompt=True) == want
    assert gguf_tok.apply_chat_template(MESSAGES, tokenize=True) == \
        list(hf_reference.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                              return_dict=False))


def test_hf_directory_tokenizer_equals_gguf_one(tiny_llama_dir: Path, gguf_tok: Tokenizer) -> None:
    tok = load_tokenizer(str(tiny_llama_dir))
    for text in TEXTS:
        assert tok.encode(text) == gguf_tok.encode(text)
    assert tok.eos_token_ids == {2} and tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.apply_chat_template(MESSAGES) == gguf_tok.apply_chat_template(MESSAGES)
    assert tok.apply_chat_template(MESSAGES).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_into_the_text(gguf_tok: Tokenizer, text: str) -> None:
    """Each token's own bytes (logprobs' `bytes`), also for a piece of a character."""
    ids = gguf_tok.encode(text, add_special_tokens=False)
    assert b"".join(gguf_tok.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_byte_fallback_tokens() -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "a": 1, "<0xE4>": 2, "<0xBD>": 3, "<0xA0>": 4}
    backend = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.ByteFallback()
    tok = Tokenizer(backend, eos_token_ids=set(), bos_token_id=None)
    ids = tok.encode("a你", add_special_tokens=False)
    assert ids == [1, 2, 3, 4]
    assert [tok.token_bytes(i) for i in ids] == [b"a", b"\xe4", b"\xbd", b"\xa0"]


def test_template_from_tokenizer_config_and_raise_exception(tmp_path: Path,
                                                            tiny_llama_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
    template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}"
                "{% endif %}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}"
                "{% endfor %}{{ eos_token }}")
    config = {"chat_template": template, "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [0, 2]}')
    tok = load_tokenizer(str(tmp_path))
    assert tok.apply_chat_template([{"role": "user", "content": "a\"b"}]) == \
        '[user]"a\\"b"<|im_end|>'
    assert tok.eos_token_ids == {0, 2}
    with pytest.raises(InvalidRequestError, match="no system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_no_chat_template_is_a_clear_error(tmp_path: Path, tiny_llama_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
    with pytest.raises(InvalidRequestError, match="no chat template"):
        load_tokenizer(str(tmp_path)).apply_chat_template(MESSAGES)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="nope.gguf"):
        load_tokenizer(str(tmp_path / "nope.gguf"))


def test_default_model_resolution() -> None:
    assert resolve_model(None).endswith(DEFAULT_GGUF_NAME)
    assert Path(resolve_model(None)).is_file()
    assert resolve_model("org/name") == "org/name"
    assert default_served_name(None) == "SmolLM2-135M-Instruct.Q4_1"
    assert default_served_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_tokenizer_module_does_not_import_torch() -> None:
    code = ("import sys, sluice.engine.tokenizer as t; t.load_tokenizer(None).encode('hi'); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
