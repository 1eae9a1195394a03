"""SamplingParams, StructuredOutputsParams and engine options as a vLLM user builds them in
Python: a value of the wrong type is an InvalidRequestError naming the field (never a
TypeError from a comparison, nor a value silently kept: n=2.5, max_tokens=1.5,
ignore_eos="yes", enable_prefix_caching="False"), numpy numbers become Python's, and a
parsed JSON schema is taken as vLLM takes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.engine.config import EngineConfig
from sluice.engine.messages import _params_from_wire, _params_to_wire
from sluice.engine.sampling_params import SamplingParams, StructuredOutputsParams
from sluice.protocol.errors import InvalidRequestError


@pytest.mark.parametrize(("field", "value"), [
    ("n", "2"), ("n", 2.5), ("n", True), ("temperature", None), ("temperature", "0"),
    ("top_p", "1"), ("top_k", 1.0), ("max_tokens", 1.5), ("max_tokens", "5"),
    ("min_tokens", None), ("seed", "x"), ("seed", 2**64), ("logprobs", True),
    ("logprobs", 1.0), ("stop", 5), ("stop_token_ids", 5), ("stop_token_ids", [1.5]),
    ("ignore_eos", "yes"), ("skip_special_tokens", 0), ("output_kind", "delta"),
    ("structured_outputs", {"choice": ["a", "b"]}), ("kv_transfer_params", "x"),
    ("logit_bias", [1, 2]), ("logit_bias", {"a": 1.0}), ("logit_bias", {1: "x"}),
    ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}),
])
def test_a_value_of_the_wrong_type_names_its_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    assert field in str(err.value)


def test_numpy_numbers_and_tuples_become_python_values() -> None:
    options: dict[str, Any] = dict(n=np.int64(2), temperature=np.float32(0.5),
                                   seed=np.int64(5), stop=("a",),
                                   stop_token_ids=(np.int64(3),), top_k=np.int32(4))
    p = SamplingParams(**options)
    assert (p.n, p.temperature, p.seed, p.stop, p.stop_token_ids, p.top_k) == (
        2, 0.5, 5, ["a"], [3], 4)
    assert all(type(v) is int for v in (p.n, p.seed, p.top_k, p.stop_token_ids[0]))
    assert type(p.temperature) is float
    # what crosses the pipe to a core process comes back equal
    assert _params_from_wire(_params_to_wire(p)) == p
    biased = SamplingParams(logit_bias={np.int64(7): np.float32(-100), 3: 5})
    assert biased.logit_bias == {7: -100.0, 3: 5.0}
    assert _params_from_wire(_params_to_wire(biased)) == biased


def test_a_json_constraint_takes_a_parsed_schema_as_vllm_does() -> None:
    schema: Any = {"type": "object", "properties": {"b": {}, "a": {}}}
    assert StructuredOutputsParams(json=schema) == StructuredOutputsParams(
        json='{"type":"object","properties":{"b":{},"a":{}}}')
    empty: Any = {}  # any JSON; still one constraint
    assert StructuredOutputsParams(json=empty).json == "{}"
    with pytest.raises(InvalidRequestError, match="regex must be a string"):
        StructuredOutputsParams(regex=5)  # type: ignore[arg-type]


@pytest.mark.parametrize(("option", "value"), [
    ("enable_prefix_caching", "False"), ("enable_chunked_prefill", "no"),  # both were true
    ("enforce_eager", 1), ("max_num_seqs", 2.5), ("max_num_seqs", "8"), ("block_size", "16"),
    ("num_kv_blocks", 1.5), ("kv_cache_memory_bytes", "1G"), ("seed", "x"),
    ("max_model_len", "x"), ("tokenizer", 5), ("kv_lease_timeout", "30"),
    ("model", 5),
])
def test_an_engine_option_of_the_wrong_type_names_it(option: str, value: Any) -> None:
    """`LLM(model, **options)` as vLLM users write them: a string for a switch was taken
    as true, a float batch size was kept, "8" failed in a comparison."""
    kwargs: dict[str, Any] = {"model": value} if option == "model" else {option: value}
    with pytest.raises(InvalidRequestError) as err:
        EngineConfig.from_options(**kwargs)
    assert err.value.param == option and option in str(err.value)


def test_engine_options_of_the_right_type_are_kept() -> None:
    config = EngineConfig.from_options(Path("/models/m.gguf"), gpu_memory_utilization=1,
                                       tokenizer=Path("/tok"), seed=None,
                                       enable_prefix_caching=False)
    assert config.model.model == "/models/m.gguf" and config.model.tokenizer == "/tok"
    assert config.cache.gpu_memory_utilization == 1 and not config.cache.enable_prefix_caching


def test_an_engine_seed_of_none_is_a_random_one_as_in_vllm() -> None:
    """LLM(seed=None) failed in torch's manual_seed after the weights had loaded."""
    from sluice.engine.sampler import Sampler

    assert EngineConfig.from_options(seed=None).model.seed is None
    seeds = {Sampler({2}, None).generator.initial_seed() for _ in range(3)}
    assert len(seeds) == 3
    assert Sampler({2}, 7).generator.initial_seed() == 7
    with pytest.raises(InvalidRequestError) as err:
        EngineConfig.from_options(seed=2**64)
    assert err.value.param == "seed"
