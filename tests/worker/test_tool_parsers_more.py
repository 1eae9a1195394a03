"""The llama3_json, mistral and pythonic tool-call parsers: whole responses, streamed ones (character
by character and in seeded random pieces) that reassemble byte for byte to the whole,
the grammar that forces calls (under each backend), and forced calls through a worker
on the tiny random model with the OpenAI SDK."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from sluice.engine.structured_output import BACKENDS, GrammarBackend
from sluice.engine.tokenizer import Tokenizer, load_tokenizer
from sluice.protocol.errors import InvalidRequestError
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig
from sluice.worker.tool_parsers import TOOL_PARSERS, CallDelta, ToolParser, get_tool_parser

from .test_structured_http import TOOLS as STRUCTURED_TOOLS
from .test_tool_parsers import _accepts
from .worker_helpers import ServerThread

ARGS = '{"city": "Paris", "n": [1, {"a": "}"}], "s": "a\\"]}"}'
LLAMA = {
    "plain text": ("Hello {there}", "Hello {there}", []),
    "text that mentions a call": ('Call {"name": "f", "parameters": {}}',
                                  'Call {"name": "f", "parameters": {}}', []),
    "one call": ('{"name": "get_weather", "parameters": ' + ARGS + "}", None,
                 [("get_weather", ARGS)]),
    "python tag, arguments key": ('  <|python_tag|>{"name": "f", "arguments": {"x": 1}}', None,
                                  [("f", '{"x": 1}')]),
    "two calls": ('{"name": "get_weather", "parameters": ' + ARGS + '}; '
                  '{"name": "get_time", "parameters": {}}', None,
                  [("get_weather", ARGS), ("get_time", "{}")]),
    "keys in another order": ('{"parameters": {"x":  "y\\"z"}, "name": "f"}; '
                              '{"name": "g", "id": 1, "parameters": {}}', None,
                              [("f", '{"x":  "y\\"z"}'), ("g", "{}")]),
    "text after the calls": ('{"name": "f", "parameters": {}} \n Done.', "Done.", [("f", "{}")]),
    "escaped name": ('{"name": "a\\u0062", "parameters": {}}', None, [("ab", "{}")]),
    # what is not a call is content, never dropped
    "head cut by max_tokens": ('<|python_tag|>{"name": "get_wea',
                               '<|python_tag|>{"name": "get_wea', []),
    "arguments cut by max_tokens": ('{"name": "f", "parameters": {"city": "Pa', None,
                                    [("f", '{"city": "Pa')]),
    "not a call": ('{"nam": "f"} and text', '{"nam": "f"} and text', []),
    "python tag, then code": ('<|python_tag|>search.call(q="x")',
                              '<|python_tag|>search.call(q="x")', []),
    "only whitespace": ("  \n", "  \n", []),
}
MISTRAL = {
    "plain text": ("Hello [TOOL] [x]", "Hello [TOOL] [x]", []),
    "one call": ('[TOOL_CALLS][{"name": "get_weather", "arguments": ' + ARGS + "}]", None,
                 [("get_weather", ARGS)]),
    "text then two calls": ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": '
                            + ARGS + '},\n{"name": "get_time", "arguments": {}}]',
                            "Let me check. ", [("get_weather", ARGS), ("get_time", "{}")]),
    "keys in another order": ('[TOOL_CALLS][{"arguments": {"x":  "y\\"z"}, "name": "f"}, '
                              '{"name": "g", "parameters": {}}]', None,
                              [("f", '{"x":  "y\\"z"}'), ("g", "{}")]),
    "a bare call object": ('[TOOL_CALLS]{"name": "f", "arguments": {}}', None, [("f", "{}")]),
    "text after the list": ('[TOOL_CALLS][{"name": "f", "arguments": {}}] \nDone.', "Done.",
                            [("f", "{}")]),
    "head cut by max_tokens": ('Sure [TOOL_CALLS][{"name": "get_wea',
                               'Sure [TOOL_CALLS][{"name": "get_wea', []),
    "arguments cut by max_tokens": ('[TOOL_CALLS][{"name": "f", "arguments": {"city": "Pa',
                                    None, [("f", '{"city": "Pa')]),
    "second call cut by max_tokens": ('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"na',
                                      '{"na', [("f", "{}")]),
    "not a call": ('[TOOL_CALLS][{"nam": "f"}] ok', '[TOOL_CALLS][{"nam": "f"}] ok', []),
    "empty list": ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
}
PYTHONIC = {
    "plain text": ("Hello [x] (y)", "Hello [x] (y)", []),
    "one call": ('[get_weather(city="Paris", n=[1, {"a": "]"}], s=\'it\\\'s )\', ok=True, '
                 'none=None, x=-1.5)]', None,
                 [("get_weather", '{"city": "Paris", "n": [1, {"a": "]"}], "s": "it\'s )", '
                                  '"ok": true, "none": null, "x": -1.5}')]),
    "two calls": ('  [get_weather(city="Paris"),\n get_time()]', None,
                  [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    "llama 4 tags": ('<|python_start|>[f(x="\u00e9")]<|python_end|>', None,
                     [("f", '{"x": "\u00e9"}')]),
    "text after the list": ("[f()] \n Done.", "Done.", [("f", "{}")]),
    # what is not a list of calls is content, never dropped
    "list cut by max_tokens": ('[get_weather(city="Pa', '[get_weather(city="Pa', []),
    "a positional argument": ("[f(1)] ok", "[f(1)] ok", []),
    "a call of a call": ("[f(x=g())]", "[f(x=g())]", []),
    "a method": ('[search.call(q="x")]', '[search.call(q="x")]', []),
    "empty list": ("[]", "[]", []),
    "not Python": ("[f(x=)] and text", "[f(x=)] and text", []),
    "tag, then text": ("<|python_start|>hello", "<|python_start|>hello", []),
    "only whitespace": ("  \n", "  \n", []),
}
CASES = [(name, case) for name, cases in [("llama3_json", LLAMA), ("mistral", MISTRAL),
                                          ("pythonic", PYTHONIC)]
         for case in cases]


def _cases(parser: str) -> dict[str, tuple[str, str | None, list[tuple[str, str]]]]:
    return {"llama3_json": LLAMA, "mistral": MISTRAL, "pythonic": PYTHONIC}[parser]


def test_the_parsers_are_registered() -> None:
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(TOOL_PARSERS)


def test_pythonic_refuses_a_forced_call_and_survives_deep_nesting() -> None:
    parser = get_tool_parser("pythonic")
    with pytest.raises(InvalidRequestError) as err:
        parser.constraint(STRUCTURED_TOOLS, None, True)
    assert err.value.param == "tool_choice" and "pythonic" in str(err.value)
    deep = "[f(x=" + "[" * 5000 + "]" * 5000 + ")]"  # past Python's parser's nesting limit
    assert parser.extract(deep) == (deep, [])


@pytest.mark.parametrize(("parser", "case"), CASES)
def test_whole_response(parser: str, case: str) -> None:
    text, content, calls = _cases(parser)[case]
    got_content, got_calls = get_tool_parser(parser).extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        assert c.id.startswith("call_")
        if "cut" not in case:
            json.loads(c.arguments)


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[CallDelta]]:
    stream, content, deltas = parser.stream(), "", []
    for piece in pieces:
        more, ds = stream.feed(piece)
        content, deltas = content + more, deltas + ds
    tail, ds = stream.finish()
    return content + tail, deltas + ds


def _splits(text: str) -> Iterator[list[str]]:
    yield list(text)  # character by character
    yield [text]
    rng = random.Random(len(text))
    for _ in range(20):
        pieces, at = [], 0
        while at < len(text):
            n = rng.randint(1, 9)
            pieces, at = pieces + [text[at:at + n]], at + n
        yield pieces


@pytest.mark.parametrize(("parser", "case"), CASES)
def test_streamed_pieces_reassemble_to_the_whole_response(parser: str, case: str) -> None:
    text, content, calls = _cases(parser)[case]
    whole_content, whole_calls = get_tool_parser(parser).extract(text)
    for pieces in _splits(text):
        got_content, deltas = _streamed(get_tool_parser(parser), pieces)
        assert got_content == (whole_content or "") == (content or "")
        firsts = [d for d in deltas if d.name is not None]
        assert [d.name for d in firsts] == [c.name for c in whole_calls]
        assert [d.index for d in firsts] == list(range(len(calls)))
        assert all(d.id for d in firsts) and all(d.id is None for d in deltas if d.name is None)
        for i, c in enumerate(whole_calls):
            assert "".join(d.arguments for d in deltas if d.index == i) == c.arguments


def test_a_call_s_first_delta_has_its_name_and_no_arguments_yet() -> None:
    stream = get_tool_parser("llama3_json").stream()
    content, deltas = stream.feed('{"name": "f", "parameters": ')
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "f", "")]
    content, deltas = stream.feed('{"a": 1')
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, None, '{"a": 1')]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


TOOLS: list[Any] = [
    STRUCTURED_TOOLS[0],  # get_weather
    {"type": "function", "function": {  # bounded: a free object lets noise run on
        "name": "get_time", "description": "The time now",
        "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}}}},
]
WEATHER = '{"name": "get_weather", "%s": {"city": "Paris", "unit": "C"}}'
TIME = '{"name": "get_time", "%s": {}}'
FORCED = {
    "llama3_json": [
        (None, True, WEATHER % "parameters", True),
        (None, True, f"{TIME}; {TIME}" % ("parameters", "parameters"), True),
        (None, False, f"{TIME}; {TIME}" % ("parameters", "parameters"), False),
        ("get_time", True, WEATHER % "parameters", False),
        (None, True, '{"name": "get_weather", "parameters": {"city": "Paris"}}', False),
        (None, True, WEATHER % "arguments", False),  # compact, one spelling
        (None, True, "Sure!", False),
    ],
    "mistral": [
        (None, True, f"[TOOL_CALLS][{WEATHER}]" % "arguments", True),
        (None, True, f"[TOOL_CALLS][{WEATHER}, {TIME}]" % ("arguments", "arguments"), True),
        (None, False, f"[TOOL_CALLS][{WEATHER}, {TIME}]" % ("arguments", "arguments"), False),
        ("get_time", True, f"[TOOL_CALLS][{WEATHER}]" % "arguments", False),
        (None, True, f"[TOOL_CALLS][{WEATHER}" % "arguments", False),  # the list never ends
        (None, True, f"[TOOL_CALLS]{WEATHER}" % "arguments", False),
        (None, True, "Sure!", False),
    ],
}


@pytest.mark.parametrize(("parser", "choice", "parallel", "text", "ok"),
                         [(p, *case) for p, cases in FORCED.items() for case in cases])
@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_forced_calls_admit_only_valid_calls(tokenizer: Tokenizer, backend: str, parser: str,
                                             choice: str | None, parallel: bool, text: str,
                                             ok: bool) -> None:
    grammar: GrammarBackend = BACKENDS[backend](tokenizer, tokenizer.vocab_size)
    params = get_tool_parser(parser).constraint(TOOLS, choice, parallel, backend)
    assert _accepts(grammar, params, text, tokenizer) == ok
    if ok:  # what the grammar admits, the parser reads back as calls
        content, calls = get_tool_parser(parser).extract(text)
        assert content is None and calls


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
@pytest.mark.parametrize("backend", ["xgrammar", "guidance", "auto"])
def test_a_bad_tool_schema_is_named(parser: str, backend: str) -> None:
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": 5}}}}}]
    with pytest.raises(InvalidRequestError) as info:
        get_tool_parser(parser).constraint(tools, None, True, backend)
    assert info.value.param == "tools.1.function.parameters"


# ----------------------------------------------------------------- through the worker

@pytest.fixture(scope="module", params=["llama3_json", "mistral"])
def client(request: pytest.FixtureRequest, engine: Any) -> Iterator[openai.OpenAI]:
    app = build_app(engine, WorkerConfig(served_model_names=("tiny",),
                                         tool_call_parser=request.param))
    srv = ServerThread(app).start()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


def _checked(name: str, arguments: str) -> dict[str, str]:
    schema = next(t["function"].get("parameters") or {"type": "object"} for t in TOOLS
                  if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)
    return {"name": name, "arguments": arguments}


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_through_the_worker(client: openai.OpenAI, tool_choice: Any,
                                         parallel: bool) -> None:
    kw: Any = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                   tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel,
                   temperature=0.0, max_tokens=160)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [_checked(c.function.name, c.function.arguments)
             for c in choice.message.tool_calls or []]
    assert calls and (parallel or len(calls) == 1)
    if isinstance(tool_choice, dict):
        assert {c["name"] for c in calls} == {"get_weather"} and len(calls) == 1

    streamed: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    assert d.function and d.function.name and d.function.arguments == ""
                    streamed[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.function and d.function.name is None
                streamed[d.index]["arguments"] += d.function.arguments or ""
    assert [streamed[i] for i in sorted(streamed)] == calls


def test_pythonic_worker_answers_auto_and_refuses_a_forced_call(engine: Any) -> None:
    app = build_app(engine, WorkerConfig(served_model_names=("tiny",),
                                         tool_call_parser="pythonic"))
    srv = ServerThread(app).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        kw: Any = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                       tools=TOOLS, temperature=0.0, max_tokens=8)
        choice = client.chat.completions.create(tool_choice="auto", **kw).choices[0]
        assert choice.message.content and not choice.message.tool_calls  # random text
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(tool_choice="required", **kw)
        assert err.value.body["param"] == "tool_choice"  # type: ignore[index]
    finally:
        srv.stop()


def test_mistral_reads_calls_that_begin_with_a_special_token(tmp_path: Any) -> None:
    """A tokenizer with `[TOOL_CALLS]` as a special token: under `mistral`, a request with
    tools is decoded with special tokens kept, so the token reaches the parser (here the
    model is pushed to write it, then nonsense: content that keeps the tag); without
    tools, decoding drops it as usual."""
    from transformers import AutoTokenizer

    from sluice.engine.async_engine import AsyncEngine
    from sluice.engine.config import EngineConfig
    from tiny_models import make_tiny_checkpoint

    out = make_tiny_checkpoint(tmp_path / "mistral-tok", "llama", vocab_size=49153)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tok.save_pretrained(str(out))
    tag = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    engine = AsyncEngine(EngineConfig.from_options(str(out), dtype="float32", num_kv_blocks=64))
    srv = ServerThread(build_app(engine, WorkerConfig(served_model_names=("tiny",),
                                                      tool_call_parser="mistral"))).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        ask: dict[str, Any] = dict(model="tiny", max_tokens=3, temperature=0,
                                   messages=[{"role": "user", "content": "Weather?"}],
                                   logit_bias={str(tag): 100})
        with_tools = client.chat.completions.create(tools=TOOLS, **ask).choices[0].message
        without = client.chat.completions.create(**ask).choices[0].message
        assert (with_tools.content or "").startswith("[TOOL_CALLS]")
        assert "[TOOL_CALLS]" not in (without.content or "")
    finally:
        srv.stop()
        engine.shutdown()
