"""The official OpenAI and Anthropic SDKs against a worker on the tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from sluice.engine.tokenizer import load_tokenizer
from sluice.protocol.prompt import MESSAGES, RESPONSES, prompt_view, templated

USER = [{"role": "user", "content": "Say something."}]
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def aclient(server) -> openai.AsyncOpenAI:  # noqa: ANN001
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:  # noqa: ANN001
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, **kw: object) -> object:
    extra = {k: kw.pop(k) for k in ("ignore_eos", "top_k", "min_tokens", "priority") if k in kw}
    return client.chat.completions.create(model="tiny", messages=USER, extra_body=extra, **kw)


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    resp = chat(client, **GREEDY)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    assert resp.model == "tiny"


def test_chat_stream_matches_non_stream_and_reports_usage(client: openai.OpenAI) -> None:
    whole = chat(client, **GREEDY).choices[0].message.content
    stream = chat(client, stream=True, stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_max_completion_tokens_and_stop_string(client: openai.OpenAI) -> None:
    whole = chat(client, **GREEDY).choices[0].message.content
    cut = next(i for i in range(1, len(whole)) if whole[i].strip())  # a visible char past 0
    stop = whole[cut]
    resp = client.chat.completions.create(model="tiny", messages=USER, temperature=0.0,
                                          max_completion_tokens=12, stop=[stop],
                                          extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == whole[:whole.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = chat(client, logprobs=True, top_logprobs=3, **GREEDY)
    content = resp.choices[0].logprobs.content
    assert len(content) == 12
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0.0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        # greedy: the sampled token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert bytes(entry.bytes).decode() == entry.token


def test_chat_logprobs_bytes_of_a_split_character_are_its_own(client: openai.OpenAI) -> None:
    """OpenAI's `bytes` exist for characters spread over several tokens; found by a
    new-user pass: every piece of 你好 had U+FFFD's bytes ([239, 191, 189]), the text of
    an incomplete character, so the pieces never joined back into the text."""
    resp = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=12, logprobs=True, top_logprobs=2,
        extra_body={"structured_outputs": {"regex": "你好"}})
    choice = resp.choices[0]
    assert choice.message.content == "你好" and choice.finish_reason == "stop"
    entries = choice.logprobs.content
    assert len(entries) > 2  # the characters are split over tokens
    text = b"".join(bytes(e.bytes) for e in entries if e.token != "<|im_end|>")  # the EOS
    assert text == "你好".encode()
    replacement = list("\ufffd".encode())
    assert all(t.bytes != replacement for e in entries for t in e.top_logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_report_cached_prompt_tokens(client: openai.OpenAI, stream: bool) -> None:
    """Found by a new-user pass: chat reported usage.prompt_tokens_details.cached_tokens,
    completions always null (400 of 401 prompt tokens were cached)."""
    prompt = f"Completion cache check {stream}: " + "one two three four " * 20

    def usage() -> object:
        if not stream:
            return client.completions.create(model="tiny", prompt=[prompt, prompt[:40]],
                                              max_tokens=2).usage
        chunks = list(client.completions.create(
            model="tiny", prompt=[prompt, prompt[:40]], max_tokens=2, stream=True,
            stream_options={"include_usage": True}))
        return chunks[-1].usage

    usage()
    again = usage()  # both prompts' full blocks are cached (summed over prompts)
    assert again.prompt_tokens_details.cached_tokens >= again.prompt_tokens - 16 * 2


async def test_async_chat_n_choices_and_stream(aclient: openai.AsyncOpenAI) -> None:
    resp = await aclient.chat.completions.create(model="tiny", messages=USER, n=3, seed=1,
                                                 temperature=1.0, max_tokens=6,
                                                 extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.completion_tokens == 18
    assert len({c.message.content for c in resp.choices}) > 1  # independent samples
    stream = await aclient.chat.completions.create(model="tiny", messages=USER, n=2,
                                                   max_tokens=4, stream=True,
                                                   extra_body={"ignore_eos": True})
    texts: dict[int, str] = {0: "", 1: ""}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(texts.values())


def test_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    kw = dict(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=8, ignore_eos=True)
    a = chat(client, **kw).choices[0].message.content
    b = chat(client, **kw).choices[0].message.content
    assert a == b


def test_completions(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="tiny", prompt=["Once upon", "The sky"], n=2,
                                     max_tokens=5, temperature=0.0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.choices[0].text == resp.choices[1].text  # greedy: same prompt, same text
    assert resp.usage.completion_tokens == 20
    lp = resp.choices[2].logprobs
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == resp.choices[2].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert all(len(top) == 2 for top in lp.top_logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs_hold_the_sampled_token(client: openai.OpenAI,
                                                        stream: bool) -> None:
    """OpenAI: "the API will always return the logprob of the sampled token, so there may
    be up to logprobs+1 elements"; vLLM answers so. Found by a new-user pass: a sampled
    token outside the top `logprobs` was missing from top_logprobs (and logprobs=0 gave
    null), so a client reading them never saw what was drawn."""
    for k in (1, 0):
        kw = dict(model="tiny", prompt="Once upon", max_tokens=12, temperature=1.0, seed=4,
                  logprobs=k, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        else:
            parts = [client.completions.create(**kw).choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        sampled = [lp for p in parts for lp in p.token_logprobs]
        tops = [top for p in parts for top in p.top_logprobs]
        assert len(tokens) == len(tops) == 12
        for token, logprob, top in zip(tokens, sampled, tops, strict=True):
            assert top[token] == pytest.approx(logprob) and 1 <= len(top) <= k + 1, top


def test_completions_stream_echo_and_token_prompt(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6,
                                      temperature=0.0, echo=True,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert whole.startswith("Hello there") and len(whole) > len("Hello there")
    stream = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6,
                                       temperature=0.0, stream=True, echo=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 6
    ids = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                     json={"prompt": "Hello there"}).json()["tokens"]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0.0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert "Hello there" + by_ids == whole


def test_echo_with_logprobs_scores_the_prompt_as_an_eval_harness_asks(
        client: openai.OpenAI) -> None:
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, one
    token (and OpenAI's max_tokens 0: the prompt alone). The prompt's tokens come first
    in the choice's logprobs, the first null; each equals vLLM's `prompt_logprobs` for the
    same prompt; a batch of prompts scores each."""
    ids = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                     json={"prompt": "The capital of France is Paris"}).json()["tokens"]
    scored = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0.0,
                                       echo=True, logprobs=1)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1 and choice.text.startswith(
        "The capital of France is Paris")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(top[t] == pytest.approx(v) and 1 <= len(top) <= 2 for t, v, top in
               zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] == len("The capital of France is Paris")
    assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == 1
    vllm = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0.0,
                                     extra_body={"prompt_logprobs": 0})
    extra = vllm.choices[0].model_extra["prompt_logprobs"]
    assert extra[0] is None and len(extra) == len(ids)
    for token_id, entry, want in zip(ids[1:], extra[1:], lp.token_logprobs[1:-1], strict=True):
        assert entry[str(token_id)]["logprob"] == pytest.approx(want, abs=1e-5)
    alone = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True,
                                      logprobs=0)
    assert alone.choices[0].text == "The capital of France is Paris"
    assert alone.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:-1])
    assert alone.usage.completion_tokens == 0
    batch = client.completions.create(model="tiny", prompt=[ids, ids[:4]], max_tokens=1,
                                      temperature=0.0, echo=True, logprobs=1)
    assert [len(c.logprobs.tokens) for c in batch.choices] == [len(ids) + 1, 5]
    assert batch.choices[1].logprobs.token_logprobs[:4] == pytest.approx(
        lp.token_logprobs[:4])


def test_echo_logprobs_stream_and_chat_prompt_logprobs(client: openai.OpenAI) -> None:
    """A streamed echo sends the prompt's text and logprobs first, then the answer's, the
    same as the whole response; a chat's `prompt_logprobs` (vLLM's top-level field) score
    the templated prompt, with ranks and decoded tokens."""
    kw = dict(model="tiny", prompt="Hello there", max_tokens=4, temperature=0.0, echo=True,
              logprobs=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.logprobs.tokens] == whole.logprobs.tokens
    assert [v for c in chunks for v in c.logprobs.token_logprobs] == pytest.approx(
        whole.logprobs.token_logprobs)
    assert [o for c in chunks for o in c.logprobs.text_offset] == whole.logprobs.text_offset
    resp = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                          extra_body={"prompt_logprobs": 3})
    scored = resp.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == resp.usage.prompt_tokens
    for entry in scored[1:]:
        ranks = sorted(e["rank"] for e in entry.values() if e["rank"] is not None)
        assert ranks == [1, 2, 3] and 3 <= len(entry) <= 4
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str)
                   for e in entry.values())
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert "prompt_logprobs" not in (plain.model_extra or {})


def test_raw_response_echoes_request_id(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=USER, max_tokens=2, extra_headers={"x-request-id": "req-42"})
    assert raw.headers["x-request-id"] == "req-42"
    assert raw.parse().id == "chatcmpl-req-42"
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=USER,
                                                           max_tokens=2)
    assert raw.parse().id == "chatcmpl-" + raw.headers["x-request-id"]


def test_anthropic_messages(claude: anthropic.Anthropic, client: openai.OpenAI) -> None:
    msg = claude.messages.create(model="tiny", max_tokens=12, system="You are terse.",
                                 messages=USER, extra_body={"temperature": 0.0})
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
    assert msg.stop_reason in ("end_turn", "max_tokens")
    expected = client.chat.completions.create(
        model="tiny", temperature=0.0, max_tokens=12,
        messages=[{"role": "system", "content": "You are terse."}, *USER])
    assert msg.content[0].text == expected.choices[0].message.content


def test_anthropic_stream_and_stop_sequence(claude: anthropic.Anthropic,
                                            client: openai.OpenAI) -> None:
    whole = chat(client, temperature=0.0, max_tokens=12).choices[0].message.content
    with claude.messages.stream(model="tiny", max_tokens=12, messages=USER,
                                extra_body={"temperature": 0.0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0
    stop = whole[next(i for i in range(1, len(whole)) if whole[i].strip())]
    msg = claude.messages.create(model="tiny", max_tokens=12, stop_sequences=[stop],
                                 messages=USER, extra_body={"temperature": 0.0})
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == whole[:whole.index(stop)]


def test_anthropic_sdk_errors(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="claude-nope", max_tokens=5, messages=USER)
    assert info.value.body["error"]["type"] == "not_found_error"
    bad_requests: list[tuple[dict, str]] = [
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_time"}},
         "tool_choice"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),  # no tools to choose from
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"tools": [{"name": "f", "input_schema": {"type": 5}}], "tool_choice": {"type": "any"}},
         "tools.0.input_schema"),  # named as the Anthropic client wrote it
    ]
    for extra, named in bad_requests:
        with pytest.raises(anthropic.BadRequestError) as bad:
            claude.messages.create(model="tiny", max_tokens=5, messages=USER, **extra)
        assert bad.value.body["type"] == "error", extra
        assert bad.value.body["error"]["type"] == "invalid_request_error", extra
        assert named in bad.value.body["error"]["message"], (extra, bad.value.body)
    # the worker keeps serving
    assert claude.messages.create(model="tiny", max_tokens=2, messages=USER).usage.output_tokens


# -- Anthropic tool use: forced calls are grammar-constrained, so even the random tiny
# model's calls are valid for their schema.

WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 7},
               "metric": {"type": "boolean"}},
               "required": ["city", "days", "metric"], "additionalProperties": False}}
CLOCK = {"name": "get_time", "description": "The time in a time zone.",
         "input_schema": {"type": "object", "properties": {
             "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, CLOCK)}


def tool_uses(msg: anthropic.types.Message) -> list[tuple[str, dict]]:
    return [(b.name, b.input) for b in msg.content if b.type == "tool_use"]


@pytest.mark.parametrize("choice", [
    {"type": "tool", "name": "get_weather"},
    {"type": "any", "disable_parallel_tool_use": True},
], ids=["tool", "any"])
def test_anthropic_forced_tool_use_whole_and_streamed(claude: anthropic.Anthropic,
                                                      choice: dict) -> None:
    kw: dict = dict(model="tiny", max_tokens=64, messages=ASK, tools=[WEATHER, CLOCK],
                    tool_choice=choice, extra_body={"temperature": 0.0})
    msg = claude.messages.create(**kw)
    assert msg.stop_reason == "tool_use", msg
    [block] = msg.content  # forced: the call and nothing else, one call
    assert block.type == "tool_use" and block.id
    assert block.name == choice.get("name", block.name) and block.name in SCHEMAS
    jsonschema.validate(block.input, SCHEMAS[block.name])
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert tool_uses(final) == [(block.name, block.input)]
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type, e.content_block.input) for e in starts] == [
        (0, "tool_use", {})]
    pieces = [e.delta.partial_json for e in events
              if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert json.loads("".join(pieces)) == block.input
    assert final.usage.input_tokens == msg.usage.input_tokens > 0


def test_openai_stream_helper_assembles_a_forced_tool_call(client: openai.OpenAI) -> None:
    """The SDK's `chat.completions.stream()` accumulates the pieces of a tool call; a
    later piece that carried `"type": null` overwrote the first one's type and failed
    its assertion (found by a new-user pass)."""
    tool = {"type": "function", "function": {"name": WEATHER["name"],
                                             "parameters": WEATHER["input_schema"]}}
    kw: dict = dict(model="tiny", messages=ASK, tools=[tool], max_tokens=64, temperature=0.0,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0].message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in final] == [
        (c.type, c.function.name, json.loads(c.function.arguments)) for c in whole]
    assert final[0].type == "function" and final[0].function.name == "get_weather"


def test_anthropic_tool_round_trip(claude: anthropic.Anthropic, tiny_llama_dir: Path) -> None:
    """tool_use -> the client runs the tool -> tool_result -> the final answer; the worker
    templates the history exactly as the one prompt view reads it."""
    first = claude.messages.create(model="tiny", max_tokens=64, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body={"temperature": 0.0})
    [call] = first.content
    assert call.type == "tool_use"
    result = {"type": "tool_result", "tool_use_id": call.id,
              "content": json.dumps({"temperature": 18, "sky": "clear"})}
    history = [*ASK, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [result]}]
    final = claude.messages.create(model="tiny", max_tokens=8, messages=history,
                                   tools=[WEATHER], tool_choice={"type": "none"},
                                   extra_body={"temperature": 0.0})
    assert [b.type for b in final.content] == ["text"] and final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens")
    plain = [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [result]}]
    tok = load_tokenizer(str(tiny_llama_dir))
    view = prompt_view(MESSAGES, {"messages": plain, "tools": [WEATHER]})
    expected = len(tok.encode(templated(tok, view), add_special_tokens=False))
    assert final.usage.input_tokens == expected
    assert expected > first.usage.input_tokens


def test_openai_sdk_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=USER)
    assert client.models.retrieve("tiny").id == "tiny"  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER,
                                       tools=[{"type": "function",
                                               "function": {"name": "f", "parameters": {}}}],
                                       tool_choice={"type": "function",
                                                    "function": {"name": "g"}})
    assert info.value.param == "tool_choice"


def test_anthropic_count_tokens_is_what_a_messages_request_reports(
        claude: anthropic.Anthropic) -> None:
    """`messages.count_tokens` (POST /v1/messages/count_tokens, Anthropic's and vLLM's):
    the prompt's tokens exactly as a Messages request with the same prompt counts them
    (system, tools, a prefill continued); it was a 404 'no route'."""
    prefill = [*ASK, {"role": "assistant", "content": "The weather in"}]
    prompts: list[dict] = [
        {"messages": USER},
        {"messages": ASK, "system": "You are terse.", "tools": [WEATHER, CLOCK]},
        {"messages": prefill},
    ]
    for prompt in prompts:
        counted = claude.messages.count_tokens(model="tiny", **prompt)
        sent = claude.messages.create(model="tiny", max_tokens=1, **prompt)
        assert counted.input_tokens == sent.usage.input_tokens > 0, prompt
    assert claude.messages.count_tokens(model="tiny", messages=ASK, tools=[WEATHER]) \
        .input_tokens > claude.messages.count_tokens(model="tiny", messages=ASK).input_tokens
    for extra, named in [({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking"),
                         ({"tools": [{"type": "web_search_20250305", "name": "s"}]},
                          "tools.0.type")]:
        with pytest.raises(anthropic.BadRequestError) as bad:
            claude.messages.count_tokens(model="tiny", messages=ASK, **extra)
        assert bad.value.body["type"] == "error" and named in bad.value.body["error"]["message"]
    assert claude.messages.count_tokens(  # thinking adds no prompt tokens
        model="tiny", messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}
    ).input_tokens == claude.messages.count_tokens(model="tiny", messages=ASK).input_tokens
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="claude-nope", messages=ASK)


def test_anthropic_structured_output_follows_the_schema(claude: anthropic.Anthropic) -> None:
    """Anthropic's structured outputs (`output_config.format`, the SDK's
    `messages.parse(output_format=...)`): the text is JSON that matches the schema, whole
    and streamed alike; it was a 400 "Unrecognized request argument". `effort` is a 400
    naming it; count_tokens takes the field and counts the same prompt."""
    from typing import Literal

    from pydantic import BaseModel

    class Answer(BaseModel):  # short values: the random model would ramble in a string
        ok: bool
        size: Literal["s", "m", "l"]

    kw: dict = dict(model="tiny", max_tokens=60, messages=USER,
                    extra_body={"temperature": 0.0})
    parsed = claude.messages.parse(output_format=Answer, **kw)
    assert isinstance(parsed.parsed_output, Answer), parsed
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}},
              "required": ["n"], "additionalProperties": False}
    config = {"format": {"type": "json_schema", "schema": schema}}
    msg = claude.messages.create(output_config=config, **kw)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(msg.content[0].text), schema)
    with claude.messages.stream(output_config=config, **kw) as stream:  # type: ignore[arg-type]
        assert stream.get_final_message().content[0].text == msg.content[0].text
    assert claude.messages.count_tokens(model="tiny", messages=USER, output_config=config) \
        .input_tokens == msg.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(output_config={"effort": "high"}, **kw)
    assert "effort" in bad.value.body["error"]["message"]


# --------------------------------------------------------------------- the Responses API

RESPONSE_TOOL = {"type": "function", "name": WEATHER["name"],
                 "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}


def test_responses_text_is_the_chat_answer_with_its_usage(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="tiny", instructions="You are terse.", input=USER,
                                   max_output_tokens=12, temperature=0.0)
    expected = client.chat.completions.create(
        model="tiny", temperature=0.0, max_tokens=12,
        messages=[{"role": "system", "content": "You are terse."}, *USER])
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == "tiny"
    assert resp.output_text == expected.choices[0].message.content
    assert resp.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (
        expected.usage.prompt_tokens, expected.usage.completion_tokens)
    cut = expected.choices[0].finish_reason == "length"
    assert resp.status == ("incomplete" if cut else "completed")
    assert (resp.incomplete_details is not None) == cut


def test_responses_stream_matches_the_whole_answer(client: openai.OpenAI) -> None:
    kw: dict = dict(model="tiny", input="Say something.", max_output_tokens=12,
                    temperature=0.0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage is not None and whole.usage is not None  # (its cached tokens differ)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens, whole.usage.output_tokens)
    with client.responses.stream(**kw) as stream:  # the SDK's helper reads it too (its
        last = list(stream)[-1]  # get_final_response wants `completed`, not `incomplete`)
    assert last.type == events[-1].type and last.response.output_text == whole.output_text


def test_responses_forced_function_call_whole_streamed_and_answered(
        client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    kw: dict = dict(model="tiny", input=ASK, tools=[RESPONSE_TOOL], temperature=0.0,
                    max_output_tokens=64, tool_choice={"type": "function", "name": "get_weather"})
    resp = client.responses.create(**kw)
    [call] = resp.output  # forced: the call and nothing else
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["input_schema"])
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [streamed] = final.output
    assert (streamed.name, json.loads(streamed.arguments)) == (call.name,
                                                               json.loads(call.arguments))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == streamed.arguments
    # the client runs the tool and sends its output back with the call
    history = [*ASK, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                      "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
    answer = client.responses.create(model="tiny", input=history, tools=[RESPONSE_TOOL],
                                     tool_choice="none", max_output_tokens=8, temperature=0.0)
    assert [i.type for i in answer.output] == ["message"]
    tok = load_tokenizer(str(tiny_llama_dir))
    view = prompt_view(RESPONSES, {"input": history, "tools": [RESPONSE_TOOL]})
    assert answer.usage is not None
    assert answer.usage.input_tokens == len(tok.encode(templated(tok, view),
                                                       add_special_tokens=False))


@pytest.mark.parametrize(("kw", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                               "image_url": "https://x/y.png"}]}]},
     "input.0.content.0"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to choose from
])
def test_responses_refusals_name_the_field(client: openai.OpenAI, kw: dict, param: str) -> None:
    args: dict = {"model": "tiny", "input": "Hi", **kw}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**args)
    assert info.value.param == param, info.value


def test_responses_input_tokens_is_what_a_response_reports(client: openai.OpenAI) -> None:
    """`POST /v1/responses/input_tokens` (the SDK's `responses.input_tokens.count`)."""
    prompt: dict = dict(model="tiny", instructions="Be brief.", input=ASK,
                        tools=[RESPONSE_TOOL])
    counted = client.responses.input_tokens.count(**prompt)
    assert counted.object == "response.input_tokens"
    resp = client.responses.create(max_output_tokens=2, **prompt)
    assert resp.usage is not None and counted.input_tokens == resp.usage.input_tokens
    assert client.responses.input_tokens.count(model="tiny", input="Hi").input_tokens < \
        counted.input_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.input_tokens.count(model="tiny", input="Hi", previous_response_id="r")
    assert info.value.param == "previous_response_id"


def test_a_stored_response_is_a_404_that_says_none_is_kept(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel,
                 client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError) as info:
            call(resp.id)
        assert info.value.param == "response_id" and "stores no responses" in info.value.message


def test_a_response_without_a_model_is_the_default_model_s(server) -> None:  # noqa: ANN001
    """As on chat, the worker serves its model when the request names none, and the
    Response says which (whole and in the stream's first event)."""
    body = {"input": "Hi", "max_output_tokens": 2}
    resp = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "tiny"
    stream = httpx.post(server.url + "/v1/responses", json={**body, "stream": True}, timeout=30)
    first = json.loads(stream.text.split("\n\n")[0].split("data: ", 1)[1])
    assert first["type"] == "response.created" and first["response"]["model"] == "tiny"
    assert json.loads(stream.text.strip().split("\n\n")[-1].split("data: ", 1)[1])[
        "response"]["model"] == "tiny"
