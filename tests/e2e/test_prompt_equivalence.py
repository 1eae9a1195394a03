"""One table of equivalences: for OpenAI (chat, completions, Responses) and Anthropic
requests, the gateway's counted
tokens, the router's hashed tokens and the engine's tokens are the same ids, because all
three read the prompt through `sluice.protocol.prompt`; and the ids the gateway passes
downstream are taken by the worker only when they are its own tokenizer's for its text."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sluice.engine.tokenizer import load_tokenizer
from sluice.gateway.tokens import PromptTokenCounter, estimate_view, kind_of
from sluice.protocol import anthropic, responses
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import ChatCompletionRequest, CompletionRequest, parse_request
from sluice.protocol.prompt import (
    CHAT,
    COMPLETION,
    MESSAGES,
    RESPONSES,
    IdsHint,
    TokenCache,
    fingerprint,
    kept,
    prompt_view,
    templated,
)
from sluice.router.parse import parse_request as router_parse
from sluice.router.tokens import PromptTokenizer
from sluice.worker import chat as worker_chat
from sluice.worker import completions as worker_completions
from sluice.worker.config import WorkerConfig
from sluice.worker.tool_parsers import HermesToolParser

M = "tiny"
U = {"role": "user", "content": "What is the capital of France?"}
TABLE: list[tuple[str, str, dict[str, Any]]] = [
    ("chat, one user message", CHAT, {"messages": [U]}),
    ("chat, system prompt", CHAT, {"messages": [{"role": "system", "content": "Be brief."}, U]}),
    ("chat, developer is system", CHAT, {"messages": [{"role": "developer", "content": "Be brief."}, U]}),
    ("chat, empty system kept", CHAT, {"messages": [{"role": "system", "content": ""}, U]}),
    ("chat, content parts", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "text", "text": "the capital?"}]}]}),
    ("chat, multi-turn", CHAT, {"messages": [U, {"role": "assistant", "content": "Paris."},
                                             {"role": "user", "content": "And of Spain?"}]}),
    ("anthropic, plain", MESSAGES, {"max_tokens": 8, "messages": [U]}),
    ("anthropic, system string", MESSAGES, {"max_tokens": 8, "system": "Be brief.",
                                            "messages": [U]}),
    ("anthropic, empty system dropped", MESSAGES, {"max_tokens": 8, "system": "",
                                                   "messages": [U]}),
    ("anthropic, system blocks", MESSAGES, {"max_tokens": 8, "system": [
        {"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}], "messages": [U]}),
    ("anthropic, content blocks", MESSAGES, {"max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]}]}),
    ("completion, text", COMPLETION, {"prompt": "The capital of France is"}),
    # a final message continued: Anthropic's prefill, vLLM's continue_final_message (the
    # `system` makes the body Anthropic's to the plain counter's guess, gateway.tokens.kind_of:
    # read as a chat body, a final assistant message is answered, not continued)
    ("anthropic, prefill", MESSAGES, {"max_tokens": 8, "system": "Be brief.", "messages": [
        U, {"role": "assistant", "content": "The capital is"}]}),
    ("chat, no generation prompt", CHAT, {
        "messages": [U, {"role": "assistant", "content": "Paris."}],
        "add_generation_prompt": False}),
    ("chat, continue_final_message", CHAT, {
        "messages": [U, {"role": "assistant", "content": "The capital is"}],
        "continue_final_message": True, "add_generation_prompt": False}),
    ("responses, string input", RESPONSES, {"input": U["content"]}),
    ("responses, instructions", RESPONSES, {"instructions": "Be brief.", "input": U["content"]}),
    ("responses, items, developer and text parts", RESPONSES, {"input": [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What is "}, {"type": "input_text",
                                                         "text": "the capital?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
        {"role": "user", "content": "And of Spain?"}]}),
]

# Tools, tool calls and tool results: the template writes the schemas and the calls' JSON.
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "unit": {"enum": ["C", "F"]}}, "required": ["city"]}
FN = {"name": "get_weather", "description": "Weather in a city.", "parameters": SCHEMA}
TOOL = {"type": "function", "function": FN}
SHUFFLED_TOOL = {"function": {"parameters": SCHEMA, "name": "get_weather",
                              "description": "Weather in a city."}, "type": "function"}
A_TOOL = {"name": "get_weather", "description": "Weather in a city.", "input_schema": SCHEMA}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}
TOOL_TABLE: list[tuple[str, str, dict[str, Any]]] = [
    ("chat, tools", CHAT, {"messages": [U], "tools": [TOOL]}),
    ("chat, tools in another key order", CHAT, {"messages": [U], "tools": [SHUFFLED_TOOL]}),
    ("chat, forced tool", CHAT, {"messages": [U], "tools": [TOOL, {"type": "function",
                                 "function": {"name": "noop"}}], "tool_choice": "required"}),
    ("chat, tool call and result", CHAT, {"tools": [TOOL], "messages": [
        {"role": "system", "content": "Be brief."}, U,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "user", "content": "And tomorrow?"}]}),
    ("anthropic, tools", MESSAGES, {"max_tokens": 8, "messages": [U], "tools": [A_TOOL]}),
    ("anthropic, forced tool", MESSAGES, {"max_tokens": 8, "messages": [U], "tools": [A_TOOL],
                                          "tool_choice": {"type": "tool", "name": "get_weather",
                                                          "disable_parallel_tool_use": True}}),
    ("anthropic, tool_use and tool_result", MESSAGES, {
        "max_tokens": 8, "system": "Be brief.", "tools": [A_TOOL], "messages": [
            U, {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris", "unit": "C"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                 "input": {"city": "Rome", "unit": "C"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "18 C, sunny"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": "timeout"},
                {"type": "text", "text": "And tomorrow?"}]}]}),
    ("responses, tools, a call and its output", RESPONSES, {
        "instructions": "Be brief.", "tools": [{"type": "function", **FN}], "input": [
            U, {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "C"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"},
            {"role": "user", "content": "And tomorrow?"}]}),
    ("anthropic, tool history without system", MESSAGES, {"max_tokens": 8, "messages": [
        U, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                              "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}),
]
TABLE += TOOL_TABLE
TABLE += [  # vLLM's truncate_prompt_tokens: every hop reads the last k tokens
    ("chat, truncated", CHAT, {"messages": [U], "truncate_prompt_tokens": 5}),
    ("completion, truncated", COMPLETION, {"prompt": "The capital of France is",
                                           "truncate_prompt_tokens": 3}),
]


class _Captured(Exception):
    def __init__(self, prompts: list[list[int]]) -> None:
        self.prompts = prompts


class _FakeState:
    """What prepare_chat/prepare_completion read from the worker's state."""

    def __init__(self, tokenizer: Any) -> None:
        info = SimpleNamespace(structured_outputs_backend="auto")  # the core's, as sent
        self.engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=4096,
                                      inputs=SimpleNamespace(info=info))
        self.tool_parser = HermesToolParser()
        self.config = WorkerConfig()  # no generation_config defaults: the GGUF has none

    def check_model(self, model: str | None) -> str:
        return model or M

    check_generates = check_model  # (a generating model)

    def lora_for(self, model: str | None) -> None:  # the base model: no adapter
        return None

    def require_engine(self) -> Any:
        return self.engine


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Any:
    return load_tokenizer(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def counter(tiny_llama_dir: Path) -> PromptTokenCounter:
    return PromptTokenCounter(default_source=str(tiny_llama_dir))


async def engine_ids(tok: Any, kind: str, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                     hint: IdsHint | None = None) -> list[int]:
    """The ids the worker's own prepare step hands the engine (Run.start intercepted)."""
    async def capture(cls: Any, state: Any, prompts: list[list[int]], params: Any,
                      *a: Any, **kw: Any) -> Any:
        keep = params.truncate_prompt_tokens  # (Run.start's cut: InputProcessor.truncate)
        raise _Captured([list(p)[-keep:] if keep else list(p) for p in prompts])

    monkeypatch.setattr(worker_chat.Run, "start", classmethod(capture))
    state: Any = _FakeState(tok)
    try:
        if kind == COMPLETION:
            req = parse_request(CompletionRequest, {"model": M, **body})
            await worker_completions.prepare_completion(state, req, "r", hint)
        else:
            if kind == MESSAGES:
                body = anthropic.to_chat_body(parse_request(anthropic.MessagesRequest,
                                                            {"model": M, **body}))
            elif kind == RESPONSES:
                raw = {"model": M, **body}
                body = responses.to_chat_body(parse_request(responses.ResponsesRequest, raw),
                                              raw)
            req = parse_request(ChatCompletionRequest, {"model": M, **body})
            await worker_chat.prepare_chat(state, req, "r", hint)
    except _Captured as got:
        return got.prompts[0]
    raise AssertionError("the engine was never reached")


@pytest.mark.parametrize(("name", "kind", "body"), TABLE, ids=[t[0] for t in TABLE])
async def test_gateway_router_and_engine_see_the_same_tokens(
        tok: Any, counter: PromptTokenCounter, monkeypatch: pytest.MonkeyPatch,
        name: str, kind: str, body: dict[str, Any]) -> None:
    view = prompt_view(kind, body)
    counted = counter.prompt_tokens(M, view)
    assert counted is not None
    count, hint = counted
    router = PromptTokenizer(client=None, cache=TokenCache())  # type: ignore[arg-type]
    req = router_parse(kind, json.dumps({"model": M, **body}).encode(), {})
    hashed = await router.tokens(req, M, tok, None)
    assert hashed is not None
    engine = await engine_ids(tok, kind, body, monkeypatch)
    assert count == len(hashed.tokens.ids) == len(engine), name
    assert hashed.tokens.ids == engine, name
    if kind_of(body) == kind or kind != RESPONSES:  # the plain counter agrees (it reads a
        # Responses body's bare string `input` as an embeddings or completion input; the
        # gateway counts /v1/responses by its path's view)
        assert counter(M, {"model": M, **body}) == count
    if kind != COMPLETION:
        assert hint is not None and kept(hint.ids, view) == engine
        # the worker takes the gateway's ids as they are, without tokenizing (marked ids
        # under the same fingerprint and digest show which ids it used) ...
        marked = IdsHint(hint.fingerprint, hint.digest, list(reversed(engine)))
        assert await engine_ids(tok, kind, body, monkeypatch, marked) == marked.ids
        # ... and the router passes on the gateway's hint without tokenizing again
        again = await router.tokens(req, M, tok, None, hint)
        assert again is not None and again.hint is hint


THINKING_TEMPLATE = (  # Qwen3's switch: an empty thinking block when thinking is off
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined "
    "and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


async def test_chat_template_kwargs_reach_the_template_at_every_hop(
        tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's `chat_template_kwargs` are part of the view: the router's hashed ids and the
    engine's are the same with them, and differ from the same body's without them; a
    cache keeps the two apart; a value that is no object, or a key that would replace
    the request's own variables, is a 400 naming the field."""
    import dataclasses

    thinking = dataclasses.replace(tok, chat_template=THINKING_TEMPLATE)
    on = {"messages": [U]}
    off = {"messages": [U], "chat_template_kwargs": {"enable_thinking": False}}
    seen = []
    for body in (on, off):
        router = PromptTokenizer(client=None, cache=TokenCache())  # type: ignore[arg-type]
        req = router_parse(CHAT, json.dumps({"model": M, **body}).encode(), {})
        hashed = await router.tokens(req, M, thinking, None)
        assert hashed is not None
        engine = await engine_ids(thinking, CHAT, body, monkeypatch)
        assert hashed.tokens.ids == engine
        seen.append(engine)
    assert seen[0] != seen[1]
    assert thinking.decode(seen[1][len(seen[0]):]) == "<think>\n\n</think>\n\n"
    cache = TokenCache()
    texts = [cache.chat_text(thinking, M, prompt_view(CHAT, b)) for b in (on, off, on)]
    assert texts[0] == texts[2] != texts[1]
    for bad in ("yes", ["enable_thinking"]):
        with pytest.raises(InvalidRequestError) as err:
            prompt_view(CHAT, {"messages": [U], "chat_template_kwargs": bad})
        assert err.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError) as err:
        templated(thinking, prompt_view(CHAT, {"messages": [U], "chat_template_kwargs": {
            "add_generation_prompt": False, "enable_thinking": False}}))
    assert err.value.param == "chat_template_kwargs" and "add_generation_prompt" in str(err.value)


async def test_the_worker_ignores_ids_not_made_for_its_text_or_tokenizer(
        tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"messages": [U]}
    real = await engine_ids(tok, CHAT, body, monkeypatch)
    other_text = IdsHint(fingerprint(tok), "0" * 24, [1, 2, 3])
    other_tok = IdsHint("ffffffffffff", other_text.digest, [1, 2, 3])
    for hint in (other_text, other_tok, IdsHint.decode(b"garbage")):
        assert await engine_ids(tok, CHAT, body, monkeypatch, hint) == real
    assert IdsHint.decode(IdsHint("ab", "cd", [0, 7, 2**31]).encode()) == IdsHint(
        "ab", "cd", [0, 7, 2**31])


@pytest.mark.parametrize("kind", [CHAT, MESSAGES])
def test_images_are_refused_naming_the_content(kind: str) -> None:
    image = {"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    with pytest.raises(InvalidRequestError) as err:
        prompt_view(kind, {"messages": [image]})
    assert err.value.param == "messages.0.content"


@pytest.mark.parametrize(("kind", "body", "tools"), [
    (CHAT, {"messages": [U]}, {"tools": [TOOL]}),
    (MESSAGES, {"max_tokens": 8, "messages": [U]}, {"tools": [A_TOOL]}),
])
def test_tool_schemas_count_as_prompt_tokens(tok: Any, counter: PromptTokenCounter, kind: str,
                                             body: dict[str, Any], tools: dict[str, Any]) -> None:
    """TPM limits see the tool schemas the template writes into the prompt."""
    bare = counter.prompt_tokens(M, prompt_view(kind, body))
    with_tools = counter.prompt_tokens(M, prompt_view(kind, {**body, **tools}))
    assert bare is not None and with_tools is not None
    schema_tokens = len(tok.encode(json.dumps(FN), add_special_tokens=False))
    assert with_tools[0] - bare[0] >= schema_tokens
    assert counter(M, {"model": M, **body, **tools}) == with_tools[0]


def test_the_plain_counter_reads_anthropic_tool_bodies_as_anthropic() -> None:
    """`count_prompt_tokens(model, body)` has no path to go by: Anthropic-only shapes
    (tools with `input_schema`, tool blocks) say which view to read."""
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                             "input": {}}]}
    assert kind_of({"messages": [U], "tools": [A_TOOL]}) == MESSAGES
    assert kind_of({"messages": [U, use]}) == MESSAGES
    assert kind_of({"messages": [U], "tools": [TOOL]}) == CHAT
    assert kind_of({"messages": [U]}) == CHAT
    # a body without messages: a Responses request's by its items or instructions; a
    # bare string input is an embeddings (completion) input, estimated the same either way
    assert kind_of({"input": [U]}) == RESPONSES
    assert kind_of({"input": "x", "instructions": "Be brief."}) == RESPONSES
    assert kind_of({"input": "x"}) == kind_of({"input": ["x", "y"]}) == COMPLETION
    assert estimate_view(prompt_view(COMPLETION, {"input": "What is it?"})) == \
        estimate_view(prompt_view(RESPONSES, {"input": "What is it?"}))
    # without a tokenizer, the chars/4 estimate charges the schemas and the calls too
    bare = estimate_view(prompt_view(MESSAGES, {"messages": [U]}))
    with_tools = estimate_view(prompt_view(MESSAGES, {"messages": [U, use], "tools": [A_TOOL]}))
    assert with_tools - bare >= len(json.dumps(SCHEMA)) // 4


def test_the_cache_renders_each_chat_view_once_and_only_equal_views_share_a_text(
        tok: Any) -> None:
    """`TokenCache.chat_text`: every table row (and the tool calls with other arguments)
    gets `templated`'s own text; a row seen again is not rendered again."""
    cache, renders = TokenCache(), []
    real = tok.apply_chat_template

    def counting(*args: Any, **kwargs: Any) -> str:
        renders.append(1)
        return real(*args, **kwargs)

    other_call = {**CALL, "function": {**CALL["function"], "arguments": '{"city": "Rome"}'}}
    bodies = [body for _, kind, body in TABLE if kind == CHAT] + [{"messages": [
        U, {"role": "assistant", "content": None, "tool_calls": [other_call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]}]
    views = [prompt_view(CHAT, body) for body in bodies]
    expected = [templated(tok, v) for v in views]
    tok_counting = SimpleNamespace(apply_chat_template=counting, chat_template="")
    for _ in range(2):
        assert [cache.chat_text(tok_counting, M, v) for v in views] == expected
    assert len(renders) == len(set(expected)) < len(views)  # rows that repeat a view
