"""Structured output in the engine, on the tiny random model (SmolLM2's real tokenizer):
every constraint kind holds for greedy, seeded and n > 1 sampling, under preemption, and
with logprobs; compile failures and timeouts fail only their own request."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams, StructuredOutputsParams
from sluice.protocol.errors import InvalidRequestError

# Bounded schemas: a random model under a mask still has to stop somewhere.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}
CONSTRAINTS: list[tuple[StructuredOutputsParams, Any]] = [
    (StructuredOutputsParams.from_schema(PERSON, "response_format"),
     lambda text: jsonschema.validate(json.loads(text), PERSON)),
    (StructuredOutputsParams(regex=r"[A-Z]{2}-[0-9]{3}"),
     lambda text: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text) or pytest.fail(text)),
    (StructuredOutputsParams(choice=("alpha", "beta", "gamma delta")),
     lambda text: text in ("alpha", "beta", "gamma delta") or pytest.fail(text)),
    (StructuredOutputsParams(grammar='root ::= "(" [0-9] ("+" [0-9]){0,3} ")"'),
     lambda text: re.fullmatch(r"\([0-9](\+[0-9]){0,3}\)", text) or pytest.fail(text)),
]
PROMPT = "Answer in the requested format: "


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=16, max_model_len=512,
               max_num_seqs=16)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=7, n=2)],
                         ids=["greedy", "seeded-n2"])
def test_every_constraint_kind_holds(llm: LLM, sampling: dict[str, Any]) -> None:
    params = [SamplingParams(max_tokens=120, structured_outputs=c, **sampling)
              for c, _ in CONSTRAINTS]
    outputs = llm.generate([PROMPT] * len(params), params)
    for (_, check), out in zip(CONSTRAINTS, outputs, strict=True):
        assert len(out.outputs) == sampling.get("n", 1)
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion.text
            check(completion.text)


def test_unconstrained_neighbours_are_untouched(llm: LLM) -> None:
    """A constrained request in the batch masks only its own row."""
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], plain)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPT, PROMPT], [plain, SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=CONSTRAINTS[1][0])])
    assert mixed[0].outputs[0].token_ids == alone


def test_preempted_constrained_requests_still_validate(tiny_llama_dir: Path) -> None:
    small = LLM(str(tiny_llama_dir), num_kv_blocks=14, block_size=16, max_model_len=512,
                max_num_seqs=8)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=120,
                            structured_outputs=CONSTRAINTS[0][0])
    outputs = small.generate([PROMPT * 6 + str(i) for i in range(8)], params)
    assert small.engine.stats().num_preemptions > 0
    for out in outputs:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_logprobs_are_computed_after_the_mask(llm: LLM) -> None:
    choices = ("alpha", "beta")
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=20,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    out = llm.generate([PROMPT], params)[0].outputs[0]
    tok = llm.get_tokenizer()
    first = out.logprobs[0] if out.logprobs else {}
    allowed = {t: lp for t, lp in first.items() if lp > float("-inf")}
    assert allowed, first
    for token_id in allowed:  # only tokens that can start one of the choices
        assert any(c.startswith(tok.decode([token_id])) for c in choices)


def test_bad_constraints_are_refused_before_admission(llm: LLM) -> None:
    for bad in (StructuredOutputsParams(regex="(ab", param="structured_outputs"),
                StructuredOutputsParams(json='{"type": 5}', param="response_format"),
                StructuredOutputsParams(grammar="root ::= nowhere", param="structured_outputs")):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate([PROMPT], SamplingParams(structured_outputs=bad))
        assert info.value.param == bad.param


def test_slow_compile_times_out_with_a_400_and_others_run(tiny_llama_dir: Path) -> None:
    """A schema past the compile timeout fails its own request; a plain request beside
    it finishes. The backend is loaded first so that only the compile is timed."""
    props = {f"f{i}": {"anyOf": [{"type": "string", "pattern": f"[a-z]{{1,{i % 7 + 2}}}"},
                                 {"type": "integer", "minimum": i, "maximum": i * 1000 + 7}]}
             for i in range(80)}
    slow = StructuredOutputsParams.from_schema(
        {"type": "object", "properties": props, "required": list(props)}, "response_format")
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=16, max_model_len=512,
              structured_outputs_compile_timeout=0.05)
    llm.generate([PROMPT], SamplingParams(max_tokens=8, structured_outputs=CONSTRAINTS[2][0]))
    engine = llm.engine
    engine.add_request("slow", PROMPT, SamplingParams(max_tokens=8, structured_outputs=slow))
    engine.add_request("plain", PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
    finished: set[str] = set()
    with pytest.raises(InvalidRequestError) as info:
        for _ in range(200):
            finished |= {o.request_id for o in engine.step() if o.finished}
    assert info.value.param == "response_format" and "took longer" in info.value.message
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert "plain" in finished and not engine.has_unfinished_requests()


def test_structured_params_cross_the_process_boundary() -> None:
    from sluice.engine.messages import Add, CoreRequest, decode, encode

    params = SamplingParams(structured_outputs=StructuredOutputsParams(
        choice=("a", "b"), param="tool_choice"))
    back = decode(encode(Add(CoreRequest("r", [1, 2], params))))
    assert isinstance(back, Add)
    assert back.request.params.structured_outputs == params.structured_outputs
