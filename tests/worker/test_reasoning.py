"""Reasoning parsers on plain text: the whole-output split, and a stream cut at every
point giving the same split; then a worker with `--reasoning-parser` on the tiny model
(whose random output never closes a thinking block): reasoning apart from content in
JSON and in a stream, a constrained output all answer on an engine without the parser
and thinking first on one with it, the fields absent without a parser, the flag
checked."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sluice.protocol.errors import InvalidRequestError
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig
from sluice.worker.reasoning import REASONING_PARSERS

from .worker_helpers import ServerThread

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]

CASES = [  # parser, output, (reasoning, content)
    (R1, "Let me think.</think>\n\nParis.", ("Let me think.", "\n\nParis.")),
    (R1, "<think>Hmm, 2+2.</think>4", ("Hmm, 2+2.", "4")),
    (R1, "\n<think>a</think>b", ("a", "b")),
    (R1, "still thinking when cut", ("still thinking when cut", None)),
    (R1, "</think>just the answer", (None, "just the answer")),
    (R1, "x < y and a</thin", ("x < y and a</thin", None)),
    (QWEN3, "<think>Plan: greet.</think>Hello!", ("Plan: greet.", "Hello!")),
    (QWEN3, "  <think>\nsteps\n</think>\n\nDone", ("\nsteps\n", "\n\nDone")),
    (QWEN3, "Hello! No thinking here.", (None, "Hello! No thinking here.")),
    (QWEN3, "<think>cut mid-thought", ("cut mid-thought", None)),
    (QWEN3, "<thin>not a tag</thin>", (None, "<thin>not a tag</thin>")),
    (QWEN3, "The tag </think> inside an answer", (None, "The tag </think> inside an answer")),
    (QWEN3, "<", (None, "<")),
]


@pytest.mark.parametrize(("parser", "text", "want"), CASES)
def test_split(parser: Any, text: str, want: tuple[str | None, str | None]) -> None:
    assert parser.split(text) == want


@pytest.mark.parametrize(("parser", "text", "want"), CASES)
def test_a_stream_cut_anywhere_splits_alike(parser: Any, text: str,
                                             want: tuple[str | None, str | None]) -> None:
    for cuts in ([i] for i in range(len(text) + 1)):
        pieces = [text[:cuts[0]], text[cuts[0]:]]
        stream = parser.stream()
        reasoning = content = ""
        for i, piece in enumerate(pieces):
            r, c = stream.feed(piece, finished=i == len(pieces) - 1)
            reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content or None) == want, cuts
    stream = parser.stream()  # one character at a time
    parts = [stream.feed(ch, finished=False) for ch in text] + [stream.feed("", finished=True)]
    assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None) == want


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as err:
        WorkerConfig(reasoning_parser="o1")
    assert err.value.param == "reasoning_parser"


@pytest.fixture(scope="module")
def r1_url(engine: Any) -> Iterator[str]:
    """A second worker app on the module's engine, with the deepseek_r1 parser."""
    app = build_app(engine, WorkerConfig(served_model_names=("tiny",),
                                         reasoning_parser="deepseek_r1"))
    srv = ServerThread(app).start()
    yield srv.url
    srv.stop()


BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Think."}], "max_tokens": 12,
        "temperature": 0, "ignore_eos": True}


def test_a_worker_hands_the_thinking_out_as_reasoning(r1_url: str, server: Any) -> None:
    """deepseek_r1 on a model that never writes </think>: every token is thinking, the
    answer empty; the stream says the same; the text is the one a worker without a
    parser answers as content. A JSON-constrained output is all answer: this engine has
    no reasoning parser, so its grammar holds from the first token."""
    plain = httpx.post(server.url + "/v1/chat/completions", json=BODY).json()
    text = plain["choices"][0]["message"]["content"]
    assert "reasoning" not in plain["choices"][0]["message"]  # no parser: no field
    got = httpx.post(r1_url + "/v1/chat/completions", json=BODY).json()
    message = got["choices"][0]["message"]
    assert "</think>" not in text
    assert message["reasoning"] == message["reasoning_content"] == text
    assert message["content"] is None and got["usage"]["completion_tokens"] == 12
    assert got["usage"]["completion_tokens_details"] == {"reasoning_tokens": 12}
    assert "completion_tokens_details" not in plain["usage"]  # no parser: no field
    with httpx.stream("POST", r1_url + "/v1/chat/completions", json={
            **BODY, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        chunks = [json.loads(line[5:]) for line in resp.iter_lines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 12}
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert not "".join(d.get("content") or "" for d in deltas)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = httpx.post(r1_url + "/v1/chat/completions", json={
        **BODY, "max_tokens": 40, "ignore_eos": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }).json()["choices"][0]["message"]
    assert constrained["reasoning"] is None
    assert isinstance(json.loads(constrained["content"])["a"], int)


def test_responses_carry_the_thinking_as_a_reasoning_item_anthropic_leaves_it_out(
        r1_url: str) -> None:
    """/v1/responses: a reasoning item with the thinking, then the (empty) answer, whole
    and streamed; /v1/messages carries the answer alone, as Anthropic's API does without
    `thinking` enabled."""
    chat = httpx.post(r1_url + "/v1/chat/completions", json={**BODY, "max_tokens": 8}).json()
    thinking = chat["choices"][0]["message"]["reasoning"]
    resp = httpx.post(r1_url + "/v1/responses", json={
        "model": "tiny", "input": "Think.", "max_output_tokens": 8, "temperature": 0}).json()
    assert resp["status"] == "incomplete" and resp["usage"]["output_tokens"] == 8
    assert resp["usage"]["output_tokens_details"] == {"reasoning_tokens": 8}
    assert [item["type"] for item in resp["output"]] == ["reasoning", "message"]
    assert resp["output"][0]["content"] == [{"type": "reasoning_text", "text": thinking}]
    assert resp["output"][1]["content"][0]["text"] == ""
    with httpx.stream("POST", r1_url + "/v1/responses", json={
            "model": "tiny", "input": "Think.", "max_output_tokens": 8, "temperature": 0,
            "stream": True}) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") \
        == thinking
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]
    messages = {"model": "tiny", "max_tokens": 8, "messages": BODY["messages"],
                "temperature": 0}
    got = httpx.post(r1_url + "/v1/messages", json=messages).json()
    assert got["type"] == "message" and got["usage"]["output_tokens"] == 8
    assert "".join(b.get("text", "") for b in got["content"]) == ""
    with httpx.stream("POST", r1_url + "/v1/messages", json={**messages, "stream": True}) as r:
        names = [line[6:].strip() for line in r.iter_lines() if line.startswith("event:")]
    assert names[0] == "message_start" and names[-1] == "message_stop"


THINKING_TEMPLATE = (  # Qwen3's switch: an empty thinking block when thinking is off
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined "
    "and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_switch_thinking_off_as_qwen3_templates_do(engine: Any) -> None:
    """vLLM's `chat_template_kwargs` reach the template on /v1/chat/completions and
    /tokenize alike (the empty thinking block Qwen3 writes for enable_thinking: false);
    a bad value or a key that would replace the request's own is a 400 naming it."""
    app = build_app(engine, WorkerConfig(served_model_names=("tiny",),
                                         chat_template=THINKING_TEMPLATE,
                                         reasoning_parser="qwen3"))
    srv = ServerThread(app).start()
    try:
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        counts = [httpx.post(srv.url + "/tokenize", json={
            "messages": BODY["messages"], **kw, "return_token_strs": True}).json()
            for kw in ({}, off)]
        assert counts[1]["count"] > counts[0]["count"]
        assert "think" in "".join(counts[1]["token_strs"][counts[0]["count"]:])
        answer = httpx.post(srv.url + "/v1/chat/completions", json={**BODY, **off}).json()
        assert answer["usage"]["prompt_tokens"] == counts[1]["count"]
        # qwen3: an output that does not open <think> is all answer
        assert answer["choices"][0]["message"]["reasoning"] is None
        for bad in ("no", {"add_generation_prompt": False}, {"messages": []}):
            err = httpx.post(srv.url + "/v1/chat/completions",
                             json={**BODY, "chat_template_kwargs": bad})
            assert err.status_code == 400 and err.json()["error"]["param"] == \
                "chat_template_kwargs", err.text
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def long_r1_url(tiny_llama_dir: Any) -> Iterator[str]:
    """deepseek_r1 on an engine whose context takes Anthropic's smallest thinking budget
    (1,024 tokens, below max_tokens)."""
    from sluice.engine.async_engine import AsyncEngine
    from sluice.engine.config import EngineConfig

    from .conftest import TINY_OPTIONS

    engine = AsyncEngine(EngineConfig.from_options(str(tiny_llama_dir), **{
        **TINY_OPTIONS, "max_model_len": 2048}))
    srv = ServerThread(build_app(engine, WorkerConfig(served_model_names=("tiny",),
                                                      reasoning_parser="deepseek_r1"))).start()
    yield srv.url
    srv.stop()
    engine.shutdown()


def test_anthropic_thinking_enabled_gets_the_thinking_as_thinking_blocks(
        long_r1_url: str) -> None:
    """With `thinking` enabled, the Anthropic SDK reads a thinking block holding what
    the chat route calls reasoning, whole and streamed (thinking_delta, a signature_delta,
    then an empty text block: nothing else was said); a thinking block sent back in the
    next turn is taken and adds nothing to the prompt; max_tokens not above the budget
    is a 400 naming it, as Anthropic's API answers."""
    import anthropic

    r1_url = long_r1_url
    claude = anthropic.Anthropic(base_url=r1_url, api_key="unused", max_retries=0)
    chat = httpx.post(r1_url + "/v1/chat/completions", json={
        **BODY, "max_tokens": 1030, "ignore_eos": False}).json()
    thinking = chat["choices"][0]["message"]["reasoning"]
    kw: dict[str, Any] = dict(model="tiny", max_tokens=1030, messages=BODY["messages"],
                              extra_body={"temperature": 0},  # (this SDK has no such argument)
                              thinking={"type": "enabled", "budget_tokens": 1024})
    whole = claude.messages.create(**kw)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == thinking and whole.content[0].signature == ""
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(**{**kw, "max_tokens": 1024})
    assert "max_tokens" in bad.value.body["error"]["message"]
    with claude.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == thinking
    assert "thinking" in kinds and "signature" in kinds
    turns = [*BODY["messages"], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": thinking, "signature": ""},
        {"type": "text", "text": "Done."}]}, {"role": "user", "content": "Again."}]
    bare = [*BODY["messages"], {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "Again."}]
    assert claude.messages.count_tokens(model="tiny", messages=turns).input_tokens == \
        claude.messages.count_tokens(model="tiny", messages=bare).input_tokens
    assert claude.messages.create(model="tiny", max_tokens=2, messages=turns).usage.output_tokens


def test_reasoning_tokens_are_those_that_said_the_thinking() -> None:
    """Each delta's tokens count as reasoning when they said thinking or left the block
    open (a piece of `</think>` held back); the closing tag's own token and the answer's
    do not."""
    from sluice.engine.outputs import CompletionOutput
    from sluice.worker.chat import ChatJob

    job = ChatJob(None, None, "chatcmpl-x", "m", None, None,  # type: ignore[arg-type]
                  reasoning=R1, reasoning_fields=True)
    pieces = ["Let", " me", " see.</", "think>", "\n\n", "Paris"]
    said = [job.split(CompletionOutput(0, text, [i], finish_reason="stop" if i == 5 else None))
            for i, text in enumerate(pieces)]
    assert "".join(t for t, _ in said) == "Let me see."
    assert "".join(a for _, a in said) == "\n\nParis"
    assert job.reasoning_tokens == 3  # "Let", " me", " see.</" (held "</")


@pytest.fixture(scope="module")
def thinker(thinker_dir: Any) -> Iterator[tuple[Any, str]]:
    """A worker and its engine with the deepseek_r1 parser (`sluice worker
    --reasoning-parser` sets both), on the tiny model whose tokenizer has the tags."""
    from sluice.engine.async_engine import AsyncEngine
    from sluice.engine.config import EngineConfig

    engine = AsyncEngine(EngineConfig.from_options(
        str(thinker_dir), dtype="float32", num_kv_blocks=256, block_size=16,
        max_model_len=2048, max_num_seqs=4, reasoning_parser="deepseek_r1"))
    srv = ServerThread(build_app(engine, WorkerConfig(served_model_names=("tiny",),
                                                      reasoning_parser="deepseek_r1"))).start()
    yield engine, srv.url
    srv.stop()
    engine.shutdown()


def test_a_thinking_budget_ends_the_thinking_for_the_model(thinker: tuple[Any, str],
                                                           server: Any) -> None:
    """vLLM's `thinking_token_budget` on chat: that many tokens of reasoning, then the
    answer (the model's `</think>` written for it), in JSON and in a stream; Anthropic's
    `thinking.budget_tokens` is the same budget; a worker without a parser refuses it."""
    engine, url = thinker
    body = {**BODY, "max_tokens": 8, "thinking_token_budget": 3}
    got = httpx.post(url + "/v1/chat/completions", json=body).json()
    message, usage = got["choices"][0]["message"], got["usage"]
    assert message["reasoning"] and message["content"]
    assert len(engine.tokenizer.encode(message["reasoning"], add_special_tokens=False)) == 3
    assert usage["completion_tokens"] == 8
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 3}
    with httpx.stream("POST", url + "/v1/chat/completions",
                      json={**body, "stream": True}) as resp:
        deltas = [json.loads(line[5:])["choices"][0]["delta"] for line in resp.iter_lines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    anthropic = httpx.post(url + "/v1/messages", json={
        "model": "tiny", "max_tokens": 1030, "messages": BODY["messages"], "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": 1024}}).json()
    assert [b["type"] for b in anthropic["content"]] == ["thinking", "text"]
    assert anthropic["usage"]["output_tokens"] <= 1030 and anthropic["content"][1]["text"]
    refused = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "thinking_token_budget"


def test_a_constrained_output_thinks_first_where_the_engine_waits_for_it(
        thinker: tuple[Any, str]) -> None:
    """A JSON-constrained chat answer on a worker whose engine knows the parser thinks
    first; the thinking is `reasoning`, the answer after `</think>` follows the schema.
    The tiny model never closes the block by itself (all of it thinking, unconstrained);
    a bias on `</think>` closes it at once (no thinking, the answer valid)."""
    engine, url = thinker
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "required": ["a"]}
    body = {**BODY, "max_tokens": 40, "ignore_eos": False, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    end = engine.tokenizer.encode("</think>", add_special_tokens=False)
    assert len(end) == 1
    plain = httpx.post(url + "/v1/chat/completions", json={
        **BODY, "max_tokens": 10}).json()["choices"][0]["message"]
    thought = httpx.post(url + "/v1/chat/completions", json={
        **body, "max_tokens": 10}).json()["choices"][0]
    assert thought["finish_reason"] == "length" and thought["message"]["content"] is None
    assert thought["message"]["reasoning"] == plain["reasoning"]  # unconstrained
    closed = httpx.post(url + "/v1/chat/completions", json={
        **body, "logit_bias": {str(end[0]): 100}}).json()["choices"][0]
    assert closed["finish_reason"] == "stop" and closed["message"]["reasoning"] is None
    assert isinstance(json.loads(closed["message"]["content"])["a"], int)
