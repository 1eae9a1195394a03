"""SamplingParams and StructuredOutputsParams as a vLLM user builds them in Python: a
value of the wrong type is an InvalidRequestError naming the field (never a TypeError
from a comparison, nor a value silently kept: n=2.5, max_tokens=1.5, ignore_eos="yes"),
numpy numbers become Python's, and a parsed JSON schema is taken as vLLM takes it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

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


def test_a_json_constraint_takes_a_parsed_schema_as_vllm_does() -> None:
    schema: Any = {"type": "object", "properties": {"b": {}, "a": {}}}
    assert StructuredOutputsParams(json=schema) == StructuredOutputsParams(
        json='{"type":"object","properties":{"b":{},"a":{}}}')
    empty: Any = {}  # any JSON; still one constraint
    assert StructuredOutputsParams(json=empty).json == "{}"
    with pytest.raises(InvalidRequestError, match="regex must be a string"):
        StructuredOutputsParams(regex=5)  # type: ignore[arg-type]
