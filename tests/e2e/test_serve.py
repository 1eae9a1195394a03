"""`sluice serve` end to end, as a subprocess, through the gateway with the printed dev key.

One test on the real default model (SmolLM2-135M-Instruct GGUF, one worker in process),
one with `--workers 2` on the tiny model (gateway -> router -> two worker processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from sluice.control.local import free_port
from worker.worker_helpers import wait_until


@contextmanager
def serve(args: list[str], home: Path, timeout: float) -> Iterator[tuple[str, str, list[str]]]:
    """Run `sluice serve ARGS` with SLUICE_HOME=home until healthy; yield (url, key, log)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SLUICE_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "serve", "--port", str(port),
                             *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=env)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")),  # type: ignore[union-attr]
                     daemon=True).start()
    try:
        assert wait_until(lambda: _healthy(url), timeout, 0.2), "".join(log)
        key = (home / "dev-key").read_text().strip()
        assert any(key in line for line in log), "the dev key is printed at start"
        yield url, key, log
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, "".join(log)


@pytest.mark.model
def test_serve_answers_a_chat_question(tmp_path: Path) -> None:
    with serve([], tmp_path, 120) as (url, key, log):
        assert any(f"listening on {url}" in line for line in log), "".join(log)
        bare = httpx.post(url + "/v1/chat/completions", timeout=10, json={
            "messages": [{"role": "user", "content": "hi"}]})
        assert bare.status_code == 401, bare.text
        client = openai.OpenAI(base_url=url + "/v1", api_key=key)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, temperature=0, max_tokens=12,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in (reply.choices[0].message.content or "")
        assert reply.usage is not None and reply.usage.completion_tokens > 0
    # The key is stored, not regenerated: a second start serves the same one.
    with serve([], tmp_path, 120) as (_, key_again, _):
        assert key_again == key


def test_serve_with_a_router_says_where_it_listens(tmp_path: Path,
                                                  tiny_llama_dir: Path) -> None:
    """Found by the docs new-user pass: `sluice serve --workers 2 --port 0` printed
    'router (cost) on http://127.0.0.1:0' and never the port it took (the router's
    'listening on' line was an INFO log under serve's default --log-level warning)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "serve", "--workers", "2", "--port", "0",
         "--no-gateway", "--model", str(tiny_llama_dir), "--num-kv-blocks", "64"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "SLUICE_HOME": str(tmp_path)})
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")),  # type: ignore[union-attr]
                     daemon=True).start()
    try:
        assert wait_until(lambda: any("listening on http" in x for x in log), 150, 0.2), \
            "".join(log)
        line = next(x for x in log if "listening on http" in x)
        url = line.split("listening on ", 1)[1].split()[0]
        assert not url.endswith(":0") and httpx.get(url + "/health", timeout=10).status_code == 200
        assert not any("127.0.0.1:0" in x for x in log), "".join(log)
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, "".join(log)


def test_serve_many_workers_behind_router_and_gateway(tmp_path: Path,
                                                      tiny_llama_dir: Path) -> None:
    args = ["--workers", "2", "--model", str(tiny_llama_dir), "--num-kv-blocks", "256"]
    with serve(args, tmp_path, 150) as (url, key, log):
        client = openai.OpenAI(base_url=url + "/v1", api_key=key)
        model = client.models.list().data[0].id
        for _ in range(3):
            reply = client.chat.completions.create(
                model=model, max_tokens=5, temperature=0,
                messages=[{"role": "user", "content": "Tell me about rivers."}])
            assert reply.choices[0].finish_reason in ("stop", "length")
        # predicted outputs: through the gateway and the router to a worker, the same
        # answer, the prediction tokens in the usage
        guessed = client.chat.completions.create(
            model=model, max_tokens=5, temperature=0,
            messages=[{"role": "user", "content": "Tell me about rivers."}],
            prediction={"type": "content", "content": reply.choices[0].message.content or ""})
        assert guessed.choices[0].message.content == reply.choices[0].message.content
        details = guessed.usage.completion_tokens_details  # type: ignore[union-attr]
        assert details is not None and details.accepted_prediction_tokens is not None
        msg = anthropic.Anthropic(base_url=url, api_key=key).messages.create(
            model=model, max_tokens=5, messages=[{"role": "user", "content": "hello"}])
        assert msg.usage.output_tokens >= 1
        _tools_and_structured_output_pass_through(url, key, model)
        # embeddings: routed like a completion's prompt, metered by the gateway
        vectors = client.embeddings.create(model=model, input=["rivers", "the sea"])
        assert [d.index for d in vectors.data] == [0, 1]
        assert all(abs(sum(x * x for x in d.embedding) - 1) < 1e-3 for d in vectors.data)
        auth = {"Authorization": f"Bearer {key}"}
        ranked = httpx.post(url + "/v1/rerank", headers=auth, timeout=60, json={
            "model": model, "query": "rivers", "documents": ["the sea", "rivers"]}).json()
        assert ranked["results"][0]["index"] == 1, ranked  # the query itself scores 1
        usage = httpx.get(url + "/v1/usage", headers=auth, timeout=10).json()
        rows = [(r["endpoint"], r["status"], r["prompt_tokens"], r["completion_tokens"])
                for r in usage["data"] if r["endpoint"] in ("/v1/embeddings", "/v1/rerank")]
        assert rows == [("/v1/embeddings", "ok", vectors.usage.prompt_tokens, 0),
                        ("/v1/rerank", "ok", ranked["usage"]["prompt_tokens"], 0)], usage
        metrics = httpx.get(url + "/metrics", timeout=10).text
        decisions = [line for line in metrics.splitlines()
                     if line.startswith("sluice_router_decisions_total")]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in decisions) >= 6, metrics


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1,
                                                    "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Weather in Rome?"}]


def _tools_and_structured_output_pass_through(url: str, key: str, model: str) -> None:
    """gateway -> router -> worker leave tools, tool_choice and response_format intact
    (chat, Anthropic's Messages and OpenAI's Responses API):
    forced calls and schema'd answers come back valid (the tiny model is random, so only
    the grammar can make them so)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key)
    reply = client.chat.completions.create(
        model=model, max_tokens=64, temperature=0, messages=ASK,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), SCHEMA)
    reply = client.chat.completions.create(
        model=model, max_tokens=64, temperature=0, messages=ASK,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)
    msg = anthropic.Anthropic(base_url=url, api_key=key).messages.create(
        model=model, max_tokens=64, messages=ASK, extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "input_schema": SCHEMA}],
        tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use" and msg.content[0].type == "tool_use"
    jsonschema.validate(msg.content[0].input, SCHEMA)
    # OpenAI's Responses API, through the same hops: a forced function call, a schema'd
    # text, and a stream whose last event carries the usage
    resp = client.responses.create(
        model=model, max_output_tokens=64, temperature=0, input=ASK,
        tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
        tool_choice={"type": "function", "name": "get_weather"})
    [call] = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    resp = client.responses.create(
        model=model, max_output_tokens=64, temperature=0, input=ASK,
        text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA,
                         "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
    events = list(client.responses.create(model=model, max_output_tokens=5, input="hello",
                                          stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage is not None
    assert events[-1].response.usage.output_tokens >= 1
    count = client.responses.input_tokens.count(model=model, input="hello")
    assert count.input_tokens == events[-1].response.usage.input_tokens  # through every hop
    # the gateway keeps them (gateway/responses.py): a later turn through the router to
    # any worker continues the conversation, and the SDK's stored-response calls work
    kept = client.responses.retrieve(events[-1].response.id)
    assert kept.id == events[-1].response.id and kept.store is True
    assert kept.output_text == events[-1].response.output_text
    turn = client.responses.create(model=model, max_output_tokens=3, input="again",
                                   previous_response_id=kept.id)
    assert turn.previous_response_id == kept.id
    assert turn.usage is not None and turn.usage.input_tokens > count.input_tokens
    items = list(client.responses.input_items.list(turn.id, order="asc"))
    assert [getattr(i, "role", None) for i in items] == ["user", "assistant", "user"]
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(kept.id)
    conv = client.conversations.create(items=[{"role": "user", "content": "I am Ada."}])
    turn = client.responses.create(model=model, max_output_tokens=3, input="Who am I?",
                                   conversation=conv.id)
    assert turn.conversation is not None and turn.conversation.id == conv.id
    assert len(list(client.conversations.items.list(conv.id))) == 3


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
