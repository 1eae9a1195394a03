"""The hermes tool-call parser on plain text: whole responses, every streamed split of
them (character by character), and the grammar that forces calls (under each backend)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.engine.sampling_params import StructuredOutputsParams
from sluice.engine.structured_output import BACKENDS, GrammarBackend, XGrammarBackend
from sluice.engine.tokenizer import Tokenizer, load_tokenizer
from sluice.protocol.errors import InvalidRequestError
from sluice.worker.tool_parsers import CallDelta, HermesToolParser, JsonValueScanner

PARSER = HermesToolParser()
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
CASES = {
    "plain text": ("Hello <b>there</b> <tool", "Hello <b>there</b> <tool", []),
    "one call": (WEATHER, None, [("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}')]),
    "text then two calls": ("Let me check.\n" + WEATHER + "\n" + TIME,
                            "Let me check.\n",
                            [("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'),
                             ("get_time", "{}")]),
    "keys in another order": ('<tool_call>{"arguments": {"x":  "y\\"z"}, "name": "f"}</tool_call>',
                              None, [("f", '{"x":  "y\\"z"}')]),  # as written, not re-encoded
    "escaped name and string": ('<tool_call>{"name": "a\\u0062", "arguments": '
                                '{"s": "a\\\\\\"}b"}}</tool_call>', None,
                                [("ab", '{"s": "a\\\\\\"}b"}')]),
    # what is not a call stays content (vLLM's hermes parser), never dropped
    "head cut by max_tokens": ('Let me see <tool_call>\n{"name": "get_wea',
                               'Let me see <tool_call>\n{"name": "get_wea', []),
    "block that is not JSON": ("a <tool_call>oops</tool_call> b",
                               "a <tool_call>oops</tool_call> b", []),
    "block without a name": ('<tool_call>{"nam": "f"}</tool_call>',
                             '<tool_call>{"nam": "f"}</tool_call>', []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_whole_response(case: str) -> None:
    text, content, calls = CASES[case]
    got_content, got_calls = PARSER.extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        json.loads(c.arguments)
        assert c.id.startswith("call_")


def _streamed(text: str, sizes: list[int]) -> tuple[str, list[CallDelta]]:
    stream, content, deltas, pos, i = PARSER.stream(), "", [], 0, 0
    while pos < len(text):
        piece = text[pos:pos + sizes[i % len(sizes)]]
        pos, i = pos + len(piece), i + 1
        more, ds = stream.feed(piece)
        content, deltas = content + more, deltas + ds
    tail, ds = stream.finish()
    return content + tail, deltas + ds


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sizes", [[1], [2, 5, 1], [7], [1000]])
def test_streamed_pieces_reassemble_to_the_whole_response(case: str, sizes: list[int]) -> None:
    text, content, calls = CASES[case]
    got_content, deltas = _streamed(text, sizes)
    assert got_content == (content or "")
    names = [d for d in deltas if d.name is not None]
    assert [d.name for d in names] == [name for name, _ in calls]
    assert [d.index for d in names] == list(range(len(calls)))
    assert all(d.id for d in names) and all(d.id is None for d in deltas if d.name is None)
    for i, (_, arguments) in enumerate(calls):
        assert "".join(d.arguments for d in deltas if d.index == i) == arguments


def test_json_value_scanner_stops_at_the_value_end() -> None:
    for value, rest in [('{"a": "}"}', "}\n</tool_call>"), ("[1, [2]]", " x"),
                        ('"s\\"t"', ","), ("  {}", "}")]:
        scanner = JsonValueScanner()
        assert scanner.feed(value + rest) == len(value) and scanner.done


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


def _accepts(backend: GrammarBackend, params: StructuredOutputsParams, text: str,
             tokenizer: Tokenizer) -> bool:
    """Whether the compiled constraint takes all of `text` and may end there."""
    matcher: Any = backend.matcher(backend.compile(params))
    if isinstance(backend, XGrammarBackend):
        return bool(matcher.accept_string(text) and matcher.is_completed())
    inner = matcher.inner  # llguidance: any tokenization of the text's bytes will do
    return bool(inner.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
                and inner.is_accepting())


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize(("choice", "parallel", "text", "ok"), [
    (None, True, WEATHER.replace(', "n": [1, {"a": "}"}]', ""), True),
    (None, True, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', True),
    (None, False, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
                  '<tool_call>', False),
    ("get_time", True, '<tool_call>\n{"name": "get_weather", "arguments": {}}', False),
    (None, True, '<tool_call>\n{"name": "get_weather", "arguments": {}}', False),  # no city
    (None, True, "Sure!", False),
])
@pytest.mark.parametrize("name", ["xgrammar", "guidance"])
def test_forced_calls_admit_only_valid_calls(tokenizer: Tokenizer, name: str,
                                             choice: str | None, parallel: bool, text: str,
                                             ok: bool) -> None:
    backend = BACKENDS[name](tokenizer, tokenizer.vocab_size)
    params = PARSER.constraint(TOOLS, choice, parallel, name)
    assert _accepts(backend, params, text, tokenizer) == ok


@pytest.mark.parametrize("name", ["xgrammar", "guidance", "auto"])
def test_a_bad_tool_schema_is_named(name: str) -> None:
    tools = [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": 5}}}}}]
    with pytest.raises(InvalidRequestError) as info:
        PARSER.constraint(tools, None, True, name)
    assert info.value.param == "tools.1.function.parameters"
