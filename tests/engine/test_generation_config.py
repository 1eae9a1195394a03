"""The model's generation_config.json sampling defaults (sluice.engine.generation_config)
as vLLM's `generation_config` setting reads them: only vLLM's keys, `max_new_tokens` as
`max_tokens`; "vllm" reads none; a folder replaces the model's file; a bad value is an
error naming the file and the key; the offline `LLM` uses them for
`sampling_params=None`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sluice.engine.config import EngineConfig
from sluice.engine.generation_config import generation_defaults, model_defaults
from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.protocol.errors import InvalidRequestError

FILE = {"temperature": 0, "top_k": 1, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
        "max_new_tokens": 5, "do_sample": False, "presence_penalty": 0.5, "eos_token_id": 2,
        "length_penalty": None}


def with_generation_config(out: Path, checkpoint: Path, **values: Any) -> Path:
    """`checkpoint`'s files linked into `out`, its generation_config.json with `values`."""
    out.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    return out


def write_config(folder: Path, data: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))
    return folder


def test_auto_reads_only_vllms_keys_with_max_new_tokens_as_max_tokens(tmp_path: Path) -> None:
    model = write_config(tmp_path / "m", FILE)
    assert generation_defaults(str(model)) == {
        "temperature": 0.0, "top_k": 1, "top_p": 0.9, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_tokens": 5}
    assert generation_defaults(str(write_config(tmp_path / "k", {"top_k": 0}))) == \
        {"top_k": -1}  # HF's "disabled", SamplingParams' spelling


def test_vllm_reads_nothing_and_a_folder_replaces_the_models_file(tmp_path: Path) -> None:
    model = write_config(tmp_path / "m", FILE)
    assert generation_defaults(str(model), "vllm") == {}
    other = write_config(tmp_path / "other", {"temperature": 0.6, "top_p": 0.95})
    assert generation_defaults(str(model), str(other)) == {"temperature": 0.6, "top_p": 0.95}
    config = EngineConfig.from_options(str(model), generation_config=other)  # a PathLike too
    assert model_defaults(config.model) == {"temperature": 0.6, "top_p": 0.95}
    assert EngineConfig.from_options(str(model)).model.generation_config == "auto"


def test_no_file_no_defaults(tmp_path: Path, default_gguf: Path) -> None:
    (tmp_path / "bare").mkdir()
    assert generation_defaults(str(tmp_path / "bare")) == {}
    assert generation_defaults(str(default_gguf)) == {}  # GGUF files carry none
    assert generation_defaults(None) == {}  # the default GGUF


def test_a_folder_without_the_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="no generation_config.json") as e:
        generation_defaults(str(write_config(tmp_path / "m", FILE)), str(tmp_path))
    assert e.value.param == "generation_config"


@pytest.mark.parametrize(("data", "key", "why"), [
    ({"temperature": -1}, "temperature", "must be finite and non-negative"),
    ({"temperature": "0.7"}, "temperature", "must be a number"),
    ({"temperature": True}, "temperature", "must be a number"),
    ({"top_p": 0}, "top_p", "must be in (0, 1]"),
    ({"top_k": 1.5}, "top_k", "must be an integer"),
    ({"top_k": -2}, "top_k", "must be -1 or 0"),
    ({"min_p": 2}, "min_p", "must be in [0, 1]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "must be greater than 0"),
    ({"max_new_tokens": 0}, "max_new_tokens", "must be at least 1"),
    ({"max_new_tokens": 5.0}, "max_new_tokens", "must be an integer"),
])
def test_a_bad_value_names_the_file_and_the_key(tmp_path: Path, data: dict[str, Any],
                                                key: str, why: str) -> None:
    model = write_config(tmp_path / "m", data)
    with pytest.raises(InvalidRequestError) as e:
        generation_defaults(str(model))
    assert str(model / "generation_config.json") in e.value.message
    assert f": {key} {why}" in e.value.message and e.value.param == "generation_config"


def test_a_file_that_is_no_json_object_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{temperature: 0")
    with pytest.raises(InvalidRequestError, match="generation_config.json: cannot read"):
        generation_defaults(str(tmp_path))
    write_config(tmp_path, [1])
    with pytest.raises(InvalidRequestError, match="must be a JSON object"):
        generation_defaults(str(tmp_path))


def test_llm_applies_the_models_defaults(tmp_path: Path, tiny_llama_dir: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    model = with_generation_config(tmp_path / "m", tiny_llama_dir, temperature=0,
                                   top_k=1, top_p=0.9, repetition_penalty=1.3, max_new_tokens=5)
    options: dict[str, Any] = dict(num_kv_blocks=64, max_model_len=256, dtype="float32")
    with caplog.at_level("WARNING", logger="sluice.engine"), LLM(str(model), **options) as llm:
        p = llm.get_default_sampling_params()
        assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.max_tokens) == \
            (0.0, 1, 0.9, 1.3, 5)
        assert (p.min_p, p.seed, p.n) == (0.0, None, 1)  # unset keys keep SamplingParams'
        assert llm.get_default_sampling_params() is not p  # a new one to change
        by_default = llm.generate(["Hello there", "Once upon"])
        explicit = llm.generate(["Hello there", "Once upon"], SamplingParams(
            temperature=0, top_k=1, top_p=0.9, repetition_penalty=1.3, max_tokens=5))
        chat = llm.chat([{"role": "user", "content": "Hi"}])
    assert [o.outputs[0].token_ids for o in by_default] == \
        [o.outputs[0].token_ids for o in explicit]
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 5
               for o in by_default)
    assert len(chat[0].outputs[0].token_ids) <= 5
    warned = [r.getMessage() for r in caplog.records if "overridden" in r.getMessage()]
    assert len(warned) == 1 and "max_tokens=5" in warned[0] and 'generation_config="vllm"' \
        in warned[0]
    with LLM(str(model), generation_config="vllm", **options) as llm:
        p = llm.get_default_sampling_params()
        assert (p.temperature, p.top_k, p.max_tokens) == (1.0, -1, 16)


def test_llm_refuses_a_bad_file_before_loading(tmp_path: Path, tiny_llama_dir: Path) -> None:
    model = with_generation_config(tmp_path / "m", tiny_llama_dir, top_p=1.5)
    with pytest.raises(InvalidRequestError, match=r"generation_config.json: top_p must be in"):
        LLM(str(model), num_kv_blocks=64, max_model_len=256, dtype="float32")
