"""Structured output in the engine, on the tiny random model (SmolLM2's real tokenizer),
for each grammar backend (xgrammar, guidance): every constraint kind holds for greedy,
seeded and n > 1 sampling, under preemption, and with logprobs; compile failures and
timeouts fail only their own request; `auto` picks guidance where it can and xgrammar
where only it can, in one batch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams, StructuredOutputsParams
from sluice.engine.structured_output import check_constraint, resolve_backend
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


BACKENDS = ["xgrammar", "guidance"]


@pytest.fixture(scope="module", params=BACKENDS)
def llm(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=16, max_model_len=512,
               max_num_seqs=16, structured_outputs_backend=request.param)


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_preempted_constrained_requests_still_validate(tiny_llama_dir: Path,
                                                       backend: str) -> None:
    small = LLM(str(tiny_llama_dir), num_kv_blocks=14, block_size=16, max_model_len=512,
                max_num_seqs=8, structured_outputs_backend=backend)
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
    it finishes. The backend is loaded first so that only the compile is timed. (xgrammar
    only: guidance compiles this schema in milliseconds, see the test below.)"""
    props = {f"f{i}": {"anyOf": [{"type": "string", "pattern": f"[a-z]{{1,{i % 7 + 2}}}"},
                                 {"type": "integer", "minimum": i, "maximum": i * 1000 + 7}]}
             for i in range(80)}
    slow = StructuredOutputsParams.from_schema(
        {"type": "object", "properties": props, "required": list(props)}, "response_format")
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=16, max_model_len=512,
              structured_outputs_backend="xgrammar", structured_outputs_compile_timeout=0.05)
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


@pytest.mark.parametrize("n", [1, 2])
def test_a_grammar_that_breaks_mid_output_fails_its_request(tiny_llama_dir: Path,
                                                            n: int) -> None:
    """Found by a new-user pass: guidance admits `a{1000000}` and masks the first token
    ("aaaa"), then its lexer refuses that token (too many expressions constructed); the
    request ended as `stop` with no text, a 200 answer breaking its constraint. It fails
    with a 400 naming the constraint now, every sequence's blocks are freed, and a plain
    request beside it finishes. Again with the compiled constraint cached (the template's
    lexer already broken: the mask then allowed only EOS, an empty `stop` answer)."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=16, max_model_len=512,
              structured_outputs_backend="guidance")
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    broken = StructuredOutputsParams(regex="a{1000000}", param="structured_outputs")
    for attempt in range(2):
        engine.add_request(f"broken{attempt}", PROMPT, SamplingParams(
            max_tokens=8, n=n, structured_outputs=broken))
        engine.add_request(f"plain{attempt}", PROMPT, SamplingParams(temperature=0.0,
                                                                     max_tokens=4))
        finished: set[str] = set()
        with pytest.raises(InvalidRequestError) as info:
            for _ in range(50):
                finished |= {o.request_id for o in engine.step() if o.finished}
        assert info.value.param == "structured_outputs", info.value.message
        assert "too many expressions" in info.value.message
        for _ in range(50):
            if not engine.has_unfinished_requests():
                break
            finished |= {o.request_id for o in engine.step() if o.finished}
        assert finished == {f"plain{attempt}"} and not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == free


def test_a_complete_grammar_ends_the_output_before_min_tokens(llm: LLM) -> None:
    """Found by a new-user pass: choice ["yes", "no"] with min_tokens 5 masked the EOS the
    finished grammar allowed and nothing else, so a masked-out token was sampled (and
    then refused). The constraint wins: min_tokens holds only while it allows more."""
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5,
                            structured_outputs=CONSTRAINTS[2][0])
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("alpha", "beta", "gamma delta")


def test_structured_params_cross_the_process_boundary() -> None:
    from sluice.engine.messages import Add, CoreRequest, decode, encode

    params = SamplingParams(structured_outputs=StructuredOutputsParams(
        choice=("a", "b"), param="tool_choice"))
    back = decode(encode(Add(CoreRequest("r", [1, 2], params))))
    assert isinstance(back, Add)
    assert back.request.params.structured_outputs == params.structured_outputs


def test_guidance_compiles_the_slow_schema_at_once(tiny_llama_dir: Path) -> None:
    """The schema that outlasts xgrammar's compile above is milliseconds for guidance (its
    lexer is built lazily): admitted well inside the timeout, and it holds."""
    props = {f"f{i}": {"anyOf": [{"type": "string", "pattern": f"[a-z]{{1,{i % 7 + 2}}}"},
                                 {"type": "integer", "minimum": i, "maximum": i * 1000 + 7}]}
             for i in range(80)}
    schema = {"type": "object", "properties": props, "required": list(props)}
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=16, max_model_len=512,
              structured_outputs_backend="guidance", structured_outputs_compile_timeout=1.0)
    out = llm.generate([PROMPT], SamplingParams(
        temperature=0.0, max_tokens=12,
        structured_outputs=StructuredOutputsParams.from_schema(schema, "response_format")))
    text = out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "length" and text.startswith('{"f0": '), text


INTS = {"type": "array", "items": {"type": "integer"}}
OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


@pytest.mark.parametrize("schema", [
    {**INTS, "uniqueItems": True}, {**INTS, "contains": {"const": 5}},
    {**OBJ, "not": {"required": ["a"]}}, {"type": "integer", "not": {"const": 2}},
    {**OBJ, "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    {**OBJ, "dependentRequired": {"a": ["b"]}}, {**OBJ, "unevaluatedProperties": False},
    {"type": "object", "properties": {"x": {**INTS, "uniqueItems": True}}},
])
@pytest.mark.parametrize("backend", ["xgrammar", "auto"])
def test_schema_keywords_xgrammar_ignores_are_refused(schema: dict, backend: str) -> None:
    """Found by a new-user pass: guidance refuses these keywords, so `auto` fell back to
    xgrammar, which reads them and enforces nothing (its grammar is the same without
    them): {"uniqueItems": true} answered [1, 2, 2] with finish_reason stop. vLLM refuses
    them for xgrammar too."""
    with pytest.raises(InvalidRequestError) as info:
        check_constraint(StructuredOutputsParams.from_schema(schema, "response_format"),
                         backend)
    assert info.value.param == "response_format"


@pytest.mark.parametrize("schema", [
    {**INTS, "uniqueItems": False},  # asks for nothing
    {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"},
                                      "contains": {"type": "boolean"}}},  # property names
    {"type": "object", "properties": {"a": {"type": "string", "default": {"not": 1}}}},
])
def test_schemas_that_only_look_unenforced_pass_xgrammar(schema: dict) -> None:
    check_constraint(StructuredOutputsParams.from_schema(schema, "response_format"), "xgrammar")


def _tool_tag(schema: dict[str, Any]) -> str:
    """A structural tag shaped like a forced tool call: the schema inside a tag inside
    tags_with_separator."""
    return json.dumps({"type": "structural_tag", "format": {
        "type": "tags_with_separator", "separator": "\n", "tags": [{
            "type": "tag", "begin": "<f>", "end": "</f>",
            "content": {"type": "json_schema", "json_schema": schema}}]}})


@pytest.mark.parametrize("schema", [
    {**INTS, "uniqueItems": True}, {**OBJ, "not": {"required": ["a"]}},
    {**OBJ, "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    {"type": "object", "properties": {"x": {**INTS, "contains": {"const": 5}}}},
])
@pytest.mark.parametrize("backend", ["xgrammar", "auto"])
def test_structural_tag_schema_keywords_xgrammar_ignores_are_refused(schema: dict,
                                                                     backend: str) -> None:
    """The json_schema check (7ae9061) did not look inside a structural tag: guidance
    refuses these keywords there too, so auto fell back to xgrammar, which compiled the
    tag and enforced none of them."""
    with pytest.raises(InvalidRequestError) as info:
        check_constraint(StructuredOutputsParams(structural_tag=_tool_tag(schema),
                                                 param="structured_outputs"), backend)
    assert info.value.param == "structured_outputs"
    if backend == "xgrammar":
        assert "format.tags.0.content.json_schema#/" in info.value.message


def test_structural_tag_schemas_that_only_look_unenforced_pass_xgrammar() -> None:
    schema = {"type": "object", "properties": {"not": {"type": "integer"},
                                               "u": {**INTS, "uniqueItems": False}}}
    check_constraint(StructuredOutputsParams(structural_tag=_tool_tag(schema)), "xgrammar")


# xgrammar's structural tag with a `grammar` content: guidance has no translation for it
TAGGED = json.dumps({"type": "structural_tag", "format": {
    "type": "tag", "begin": "<n>", "content": {"type": "grammar", "grammar": 'root ::= [0-9]+'},
    "end": "</n>"}})


def test_auto_picks_per_constraint_and_mixes_backends_in_one_batch(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=16, max_model_len=512,
              max_num_seqs=16, structured_outputs_backend="auto")
    tagged = StructuredOutputsParams(structural_tag=TAGGED)
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c)
              for c in (CONSTRAINTS[1][0], tagged)]
    regex_out, tag_out = llm.generate([PROMPT, PROMPT], params)
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", regex_out.outputs[0].text)
    assert tag_out.outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"<n>[0-9]+</n>", tag_out.outputs[0].text), tag_out.outputs[0].text
    assert set(llm.engine.core.structured._backends) == {"guidance", "xgrammar"}


@pytest.mark.parametrize(("params", "expected"), [
    (CONSTRAINTS[0][0], "guidance"),
    (StructuredOutputsParams(json_object=True), "guidance"),
    (StructuredOutputsParams(grammar='start: "x" /[0-9]{2}/'), "guidance"),  # Lark
    (StructuredOutputsParams(grammar='root ::= x "b"\nx ::= "a" (= "b")'), "xgrammar"),  # lookahead
    (StructuredOutputsParams(structural_tag=TAGGED), "xgrammar"),
])
def test_auto_resolution(params: StructuredOutputsParams, expected: str) -> None:
    assert resolve_backend("auto", params) == expected
    assert resolve_backend("xgrammar", params) == "xgrammar"


def test_auto_reports_the_preferred_backends_error() -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_constraint(StructuredOutputsParams(regex="(ab", param="response_format"), "auto")
    assert info.value.param == "response_format"
    assert "unclosed group" in info.value.message  # llguidance's (regex crate) wording


def test_guidance_refuses_what_it_cannot_express_by_name() -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_constraint(StructuredOutputsParams(structural_tag=TAGGED, param="tool_choice"),
                         "guidance")
    assert info.value.param == "tool_choice" and "xgrammar" in info.value.message
    check_constraint(StructuredOutputsParams(structural_tag=TAGGED), "xgrammar")


@pytest.mark.parametrize("backend", BACKENDS)
def test_structural_tag_translations_hold(tiny_llama_dir: Path, backend: str) -> None:
    """Every structural-tag format guidance translates, generated under both backends."""
    fmt = {"type": "sequence", "elements": [
        {"type": "const_string", "value": "id="},
        {"type": "regex", "pattern": "[a-f]{2}/[0-9]"},
        {"type": "optional", "content": {"type": "const_string", "value": "!"}},
        {"type": "or", "elements": [{"type": "const_string", "value": ";"},
                                    {"type": "const_string", "value": ","}]},
        {"type": "repeat", "min": 1, "max": 2, "content": {"type": "const_string", "value": "z"}},
        {"type": "tags_with_separator", "separator": "|", "at_least_one": True,
         "stop_after_first": False, "tags": [
             {"type": "tag", "begin": "<j>", "end": "</j>", "content": {
                 "type": "json_schema", "json_schema": {"type": "object", "properties": {
                     "k": {"enum": [1, 2]}}, "required": ["k"], "additionalProperties": False}}}]},
    ]}
    params = StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag",
                                                                "format": fmt}))
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=16, max_model_len=512,
              structured_outputs_backend=backend)
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=5, max_tokens=120,
                                                structured_outputs=params))[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    assert re.fullmatch(r'id=[a-f]{2}/[0-9]!?[;,]z{1,2}<j>\{"k": [12]\}</j>'
                        r'(\|<j>\{"k": [12]\}</j>)*', out.text), out.text


@pytest.mark.parametrize("backend", BACKENDS)
def test_listed_properties_close_an_object_in_both_backends(tiny_llama_dir: Path,
                                                            backend: str) -> None:
    """xgrammar's strict mode closes an object that lists properties; guidance is made to
    agree (`closed_objects`), so neither lets a model invent keys. Nested ones too."""
    from sluice.engine.structured_output import BACKENDS as REGISTRY
    from sluice.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_llama_dir))
    grammar = REGISTRY[backend](tok, tok.vocab_size)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "o": {
        "type": "object", "properties": {"b": {"type": "integer"}}}}}

    def accepts(schema: dict[str, Any], text: str) -> bool:
        m: Any = grammar.matcher(grammar.compile(StructuredOutputsParams.from_schema(schema, "x")))
        ids = tok.encode(text, add_special_tokens=False) + [2]  # then EOS
        return all(m.accept_token(t) for t in ids) and m.is_terminated()

    assert accepts(schema, '{"a": 1, "o": {"b": 2}}')
    assert not accepts(schema, '{"a": 1, "z": 2}')
    assert not accepts(schema, '{"a": 1, "o": {"b": 2, "z": 3}}')
    assert accepts({"type": "object"}, '{"z": 3}')  # no properties listed: open


_SLOW_COMPILE_THEN_EXIT = """
import time
from sluice.engine.config import StructuredOutputsConfig
from sluice.engine.sampling_params import StructuredOutputsParams
from sluice.engine.structured_output import StructuredOutputManager

class Slow:
    def compile(self, params):
        time.sleep(60)

manager = StructuredOutputManager(StructuredOutputsConfig(), lambda name: Slow())
manager._compile_async(StructuredOutputsParams(regex="a+"))
time.sleep(0.5)  # the compile is running
manager.close()
print(time.time(), flush=True)
"""


def test_a_compile_still_running_does_not_hold_the_process_at_exit() -> None:
    """A compile cannot be stopped; its thread is a daemon, so a process that is done
    (its request failed by the timeout, or Ctrl-C) exits at once instead of after the
    compile (ThreadPoolExecutor's threads are joined at exit: 60 s here)."""
    done = subprocess.run([sys.executable, "-c", _SLOW_COMPILE_THEN_EXIT],
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert time.time() - float(done.stdout) < 10
