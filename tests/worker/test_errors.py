"""Every error class gets OpenAI's (or, on /v1/messages, Anthropic's) JSON and the right
status; nothing a client sends takes the worker down."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

from .worker_helpers import ServerThread, wait_until

USER = [{"role": "user", "content": "hi"}]


def openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_malformed_json_is_400(http: httpx.Client) -> None:
    for body in (b"{", b"", b"\xff\xfe", b"[1, 2]", b"null", b'"text"'):
        resp = http.post("/v1/chat/completions", content=body,
                         headers={"content-type": "application/json"})
        assert openai_error(resp, 400)["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "max_tokens": "many"}, "max_tokens"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": USER, "stream": "yes please"}, "stream"),
    ({"messages": USER, "unknown_knob": 1}, "unknown_knob"),
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
])
def test_wrong_values_name_the_field(http: httpx.Client, body: dict, param: str) -> None:
    openai_error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize(("path", "body", "param"), [
    # found by a new-user pass: a top_k of 2**63 failed the whole engine step (every
    # request in it), larger integers failed msgpack on the way to the engine core
    ("/v1/chat/completions", {"messages": USER, "top_k": 2**63}, "top_k"),
    ("/v1/chat/completions", {"messages": USER, "top_k": 2 * 10**21}, "top_k"),
    ("/v1/completions", {"prompt": "a", "top_k": 2**63}, "top_k"),
    ("/v1/chat/completions", {"messages": USER, "stop_token_ids": [2 * 10**21]}, "stop_token_ids.0"),
    ("/v1/chat/completions", {"messages": USER, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": USER, "stop_token_ids": [-1]}, "stop_token_ids.0"),
    ("/v1/chat/completions", {"messages": USER, "priority": 2**64}, "priority"),
    ("/v1/completions", {"prompt": "a", "priority": 2**64}, "priority"),
    ("/v1/chat/completions", {"messages": USER, "min_tokens": 2**64}, "min_tokens"),
    # strict types: OpenAI's API refuses a string or a boolean where a number goes
    ("/v1/chat/completions", {"messages": USER, "max_tokens": "10"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "n": True}, "n"),
    ("/v1/chat/completions", {"messages": USER, "temperature": True}, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": "yes"}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "echo": "yes"}, "echo"),
])
def test_out_of_range_and_mistyped_numbers_are_400(http: httpx.Client, path: str, body: dict,
                                                   param: str) -> None:
    openai_error(http.post(path, json=body), 400, param)
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize(("parts", "index"), [([{"type": "text"}], 0),
                                              ([{"type": "text", "text": "a"},
                                                {"type": "text", "text": 5}], 1)])
def test_a_text_part_without_text_says_so(http: httpx.Client, parts: list, index: int) -> None:
    err = openai_error(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": parts}]}), 400, "messages.0.content")
    assert f"content part {index} is a text part without 'text'" in err["message"]


def test_a_refused_top_k_leaves_other_streams_running(http: httpx.Client) -> None:
    body = {"messages": USER, "max_tokens": 40, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert next(x for x in lines if x.startswith("data: "))  # the stream is running
        openai_error(http.post("/v1/chat/completions",
                               json={"messages": USER, "max_tokens": 1, "top_k": 2**63}),
                     400, "top_k")
        rest = [x for x in lines if x.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in x for x in rest)


def test_null_means_the_default(http: httpx.Client) -> None:
    """OpenAI's nullable fields: null for n, stream, logprobs, parallel_tool_calls (chat)
    or echo (completions) is their default, and a harmless unsupported one is dropped."""
    chat = http.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 2, "n": None, "stream": None, "logprobs": None,
        "parallel_tool_calls": None, "store": False, "metadata": None})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1 and chat.json()["choices"][0]["logprobs"] is None
    done = http.post("/v1/completions", json={"prompt": "zqxv", "max_tokens": 2, "echo": None,
                                              "n": None, "suffix": None, "temperature": 0})
    assert done.status_code == 200, done.text
    assert not done.json()["choices"][0]["text"].startswith("zqxv")  # no echo


def test_top_k_zero_is_disabled(http: httpx.Client) -> None:
    ok = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "top_k": 0})
    assert ok.status_code == 200, ok.text
    err = openai_error(http.post("/v1/chat/completions",
                                 json={"messages": USER, "top_k": -5}), 400, "top_k")
    assert "-1 or 0 (disabled)" in err["message"]


UNIQUE = {"type": "object", "properties": {"tags": {
    "type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}}}


def test_a_schema_keyword_no_backend_enforces_is_refused(http: httpx.Client) -> None:
    """Found by a new-user pass: {"uniqueItems": true} answered [1, 2, 2], finish_reason
    stop (auto fell back to xgrammar, which ignores it). A tool whose call is not forced
    compiles nothing, so its schema only has to be one."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": UNIQUE}}
    openai_error(http.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 2, "response_format": fmt}), 400, "response_format")
    tools = [{"type": "function", "function": {"name": "f", "parameters": UNIQUE}}]
    assert http.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 2, "tools": tools}).status_code == 200
    openai_error(http.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 2, "tools": tools, "tool_choice": "required"}),
        400, "tools.0.function.parameters")


def test_a_structural_tag_schema_keyword_no_backend_enforces_is_refused(
        http: httpx.Client) -> None:
    """As for response_format's schema: a structural tag's json_schema with
    {"uniqueItems": true} was compiled by xgrammar (auto's fallback), which ignores it."""
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<t>", "end": "</t>",
                                                "content": {"type": "json_schema",
                                                            "json_schema": UNIQUE}}}
    for path, body in (("/v1/chat/completions", {"messages": USER}),
                       ("/v1/completions", {"prompt": "a"})):
        openai_error(http.post(path, json={**body, "max_tokens": 2, "structured_outputs": {
            "structural_tag": json.dumps(tag)}}), 400, "structured_outputs")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": USER}),
    ("/v1/completions", {"prompt": "a"}),
])
def test_stream_options_without_stream_are_refused(http: httpx.Client, path: str,
                                                   body: dict) -> None:
    """Found by a new-user pass: ignored before; OpenAI's API and vLLM refuse them."""
    for stream in ({}, {"stream": False}):
        openai_error(http.post(path, json={**body, **stream, "max_tokens": 2,
                                           "stream_options": {"include_usage": True}}),
                     400, "stream_options")
    for options in (None, {}):  # asks for nothing
        resp = http.post(path, json={**body, "max_tokens": 2, "stream_options": options})
        assert resp.status_code == 200, resp.text


def test_infinite_temperature_is_refused(http: httpx.Client) -> None:
    """1e309 parses as infinity: refused, not sampled uniformly (found by the reliability
    suite's fuzzing)."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e309}'
    openai_error(http.post("/v1/chat/completions", content=body,
                           headers={"content-type": "application/json"}), 400, "temperature")


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f"}]),
    ("web_search_options", {"search_context_size": "low"}),
    ("audio", {"voice": "alloy", "format": "wav"}),
])
def test_unsupported_parameters_are_refused(http: httpx.Client, field: str, value: Any) -> None:
    err = openai_error(http.post("/v1/chat/completions",
                                 json={"messages": USER, field: value}), 400, field)
    assert "not supported" in err["message"]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "a"})])
@pytest.mark.parametrize(("field", "value", "instead"), [
    ("guided_json", {"type": "object"}, 'structured_outputs: {"json": ...}'),
    ("guided_regex", "a+", 'structured_outputs: {"regex": ...}'),
    ("guided_choice", ["a", "b"], 'structured_outputs: {"choice": ...}'),
    ("guided_grammar", "root ::= \"a\"", 'structured_outputs: {"grammar": ...}'),
])
def test_vllms_removed_guided_fields_say_what_replaces_them(
        http: httpx.Client, path: str, body: dict, field: str, value: Any,
        instead: str) -> None:
    """A vLLM user's guided_json was refused without a word on structured_outputs."""
    err = openai_error(http.post(path, json={**body, field: value}), 400, field)
    assert instead in err["message"]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [{**TOOL, "function": {"name": "f", "parameters": {"type": 5}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                               "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [*USER, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": "{oops"}}]}, *USER]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_bad_constraints_and_tools_name_the_field(http: httpx.Client, extra: dict,
                                                  param: str) -> None:
    openai_error(http.post("/v1/chat/completions", json={"messages": USER, **extra}), 400, param)
    assert http.get("/health").status_code == 200  # and the worker keeps serving


@pytest.mark.parametrize("choice", [{}, {"tool_choice": "auto"}, {"tool_choice": "none"},
                                    {"tool_choice": {"type": "function",
                                                     "function": {"name": "f"}}}])
@pytest.mark.parametrize("schema", [{"type": "objectx"},
                                    {"type": "object", "properties": {"a": {"type": 5}}}])
def test_a_bad_tool_schema_is_refused_whatever_the_tool_choice(
        http: httpx.Client, choice: dict, schema: dict) -> None:
    """Found by a new-user pass: with tool_choice auto (or none, or no tool_choice) a tool
    whose parameters were no JSON schema was accepted and generated from, while required
    and named choices refused it; every tool is checked, as OpenAI's API does (here the
    named tool is `f` and the bad one `g`)."""
    tools = [TOOL, {"type": "function", "function": {"name": "g", "parameters": schema}}]
    openai_error(http.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 2, "tools": tools, **choice}),
        400, "tools.1.function.parameters")


ASKED = {"role": "assistant", "content": None, "tool_calls": [CALL]}


@pytest.mark.parametrize(("messages", "param"), [
    ([*USER, {"role": "tool", "tool_call_id": "c1", "content": "x"}], "messages.1.role"),
    ([*USER, ASKED, {"role": "tool", "tool_call_id": "c2", "content": "x"}],
     "messages.2.tool_call_id"),
    ([*USER, ASKED, *USER, {"role": "tool", "tool_call_id": "c1", "content": "x"}],
     "messages.3.role"),
])
def test_a_tool_message_must_answer_a_call(http: httpx.Client, messages: list,
                                           param: str) -> None:
    """Found by a new-user pass: a tool result answering no call (none asked, another id,
    or a user turn in between) reached the template; OpenAI's API refuses it, as the
    worker's /v1/messages does for Anthropic's tool_result."""
    openai_error(http.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 2, "tools": [TOOL]}), 400, param)
    ok = [*USER, ASKED, {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    assert http.post("/v1/chat/completions", json={
        "messages": ok, "max_tokens": 2, "tools": [TOOL]}).status_code == 200


def test_completion_specific_refusals(http: httpx.Client) -> None:
    openai_error(http.post("/v1/completions", json={"prompt": "a", "suffix": "z"}), 400, "suffix")
    openai_error(http.post("/v1/completions", json={"prompt": "a", "best_of": 3}), 400, "best_of")
    openai_error(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 0}),
                 400, "max_tokens")  # 0 only with echo (the prompt alone)
    for path, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions",
                                                               {"messages": USER})):
        openai_error(http.post(path, json={**body, "prompt_logprobs": 1, "stream": True}),
                     400, "prompt_logprobs")
        openai_error(http.post(path, json={**body, "prompt_logprobs": 21}), 400,
                     "prompt_logprobs")
    openai_error(http.post("/v1/completions", json={"prompt": [10**9]}), 400, "prompt")
    openai_error(http.post("/v1/completions", json={"prompt": ""}), 400, "prompt")


def test_unknown_model_is_404(http: httpx.Client) -> None:
    err = openai_error(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": USER}),
                       404, "model")
    assert err["code"] == "model_not_found"
    openai_error(http.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}), 404, "model")


def test_context_length_is_400(http: httpx.Client) -> None:
    err = openai_error(http.post("/v1/chat/completions",
                                 json={"messages": USER, "max_tokens": 1020}), 400, "messages")
    assert err["code"] == "context_length_exceeded" and "1024" in err["message"]
    long_prompt = list(range(100, 1200))  # 1100 token ids > max_model_len 1024
    err = openai_error(http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}),
                       400, "prompt")
    assert err["code"] == "context_length_exceeded"


def test_unknown_route_and_method(http: httpx.Client) -> None:
    openai_error(http.get("/v1/nothing"), 404)
    openai_error(http.get("/v1/chat/completions"), 405)


USE = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}


@pytest.mark.parametrize(("messages", "says"), [
    ([{"role": "user", "content": ""}], "non-empty content"),
    ([{"role": "user", "content": []}], "non-empty content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
      {"role": "user", "content": "again"}], "non-empty content"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}],
     "unexpected tool_use_id 'nope'"),
    ([*USER, {"role": "assistant", "content": [USE]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2"}]}],
     "unexpected tool_use_id 't2'"),
])
def test_anthropic_conversation_rules(http: httpx.Client, messages: list, says: str) -> None:
    """Anthropic's API refuses these turns; so does the worker (found by a new-user pass)."""
    r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert says in r.json()["error"]["message"]


def test_anthropic_prefill_and_a_matching_tool_result_are_served(http: httpx.Client) -> None:
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    for messages in ([*USER, {"role": "assistant", "content": ""}],
                     [*USER, {"role": "assistant", "content": [USE]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                    "content": "42"}]}]):
        r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "tools": tools,
                                            "messages": messages})
        assert r.status_code == 200, r.text


def test_anthropic_errors_use_anthropic_shape(http: httpx.Client) -> None:
    cases = [
        (b"{", 400),
        (json.dumps({"model": "tiny", "messages": USER}).encode(), 400),  # max_tokens missing
        (json.dumps({"model": "x", "max_tokens": 3, "messages": USER}).encode(), 404),
        (json.dumps({"model": "tiny", "max_tokens": 3, "messages": USER,
                     "thinking": {"type": "enabled"}}).encode(), 400),
        (json.dumps({"model": "tiny", "max_tokens": 5000, "messages": USER}).encode(), 400),
    ]
    for body, status in cases:
        resp = http.post("/v1/messages", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == status, resp.text
        payload = resp.json()
        assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
    assert resp.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "x" * 20000}], "max_tokens": 1},
    {"messages": USER, "n": 10**12},
    {"messages": USER, "seed": 10**40},
    {"messages": USER, "stop": [""]},
    {"messages": USER, "stop": [None]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    b'{"messages": [{"role": "user", "content": "\\ud800\\u0000x"}], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "\\u0000\xf0\x9f\x98\x80"}], "max_tokens": 2}',
    {"messages": USER, "priority": 1.5},
    {"prompt": "x"},
])
def test_hostile_inputs_never_crash(http: httpx.Client, body: dict | bytes) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = http.post("/v1/chat/completions", content=raw,
                     headers={"content-type": "application/json"})
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        assert resp.json()["error"]["type"] == "invalid_request_error"
    assert http.get("/health").status_code == 200


def test_overload_is_503_with_retry_after(engine: Any) -> None:
    srv = ServerThread(build_app(engine, WorkerConfig(max_pending_requests=1))).start()
    first_chunk = threading.Event()
    done = threading.Event()

    def long_stream() -> None:
        body = {"messages": USER, "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                          timeout=30) as resp:
            for _ in resp.iter_lines():
                first_chunk.set()
                if done.is_set():
                    break

    thread = threading.Thread(target=long_stream)
    thread.start()
    try:
        assert first_chunk.wait(20)
        resp = httpx.post(srv.url + "/v1/chat/completions", json={"messages": USER})
        err = openai_error(resp, 503)
        assert err["type"] == "service_unavailable" and resp.headers["retry-after"] == "1"
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        done.set()
        thread.join(20)
        assert wait_until(lambda: engine.stats().num_running == 0)
        srv.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages",
                                  "/tokenize"])
def test_deep_nesting_and_lone_surrogates_are_400(http: httpx.Client, path: str) -> None:
    deep = b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested = b'{"model": "tiny", "prompt": ' + b"[" * 500 + b"]" * 500 + b"}"
    lone = b'{"model": "tiny", "max_tokens": 2, "prompt": "a \\ud800", ' \
           b'"messages": [{"role": "user", "content": "a \\ud800"}]}'
    for body in (deep, nested, lone, lone.replace(b"\\ud800", b"\xed\xa0\x80")):
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 400, (body[:40], resp.text)
        if path != "/v1/messages":
            openai_error(resp, 400)


def test_bodies_over_the_limit_are_413(engine: Any) -> None:
    srv = ServerThread(build_app(engine, WorkerConfig(served_model_names=("tiny",),
                                                      max_body_bytes=4000))).start()
    body = json.dumps({"model": "tiny", "prompt": "x" * 5000}).encode()

    def chunks() -> Any:
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
                err = openai_error(http.post(path, content=body), 413, "body")
                assert err["code"] == "request_too_large"
                openai_error(http.post(path, content=chunks()), 413, "body")
            resp = http.post("/v1/messages", content=body)
            assert resp.status_code == 413 and resp.json()["error"]["type"] == "request_too_large"
            ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                    "max_tokens": 1})
            assert ok.status_code == 200
    finally:
        srv.stop()


def test_the_worker_has_no_admin_surface(http: httpx.Client) -> None:
    for method in ("GET", "POST", "DELETE"):
        assert http.request(method, "/admin/workers").status_code == 404


def test_logit_bias_steers_the_answer_and_bad_ones_name_it(http: httpx.Client) -> None:
    """OpenAI's logit_bias: +100 on one token makes a greedy answer that token over and
    over; a key that is no token id, one past the vocabulary, or a bias past 100 is a 400
    naming logit_bias (it was refused whole as unsupported)."""
    body = {"messages": USER, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    completion = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                  "stream": True, "return_token_ids": True}

    def token_ids(extra: dict[str, Any]) -> list[int]:
        r = http.post("/v1/completions", json={**completion, **extra})
        assert r.status_code == 200, r.text
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        return [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]

    plain = token_ids({})
    forced = next(t for t in range(100, 110) if t not in plain)
    assert token_ids({"logit_bias": {str(forced): 100}}) == [forced] * 4
    chat = http.post("/v1/chat/completions", json={**body, "logit_bias": {str(forced): 100}})
    assert chat.status_code == 200, chat.text
    for bias in ({"abc": 1}, {"99999999": 1}, {"5": 101}):
        openai_error(http.post("/v1/chat/completions", json={**body, "logit_bias": bias}),
                     400, "logit_bias")
