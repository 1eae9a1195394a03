"""A migrated stream resumed on this worker (`x-sluice-resume-ids`): the continuation is
the uninterrupted run's, for plain text and under a JSON-schema grammar, on the tiny
model in float32 (the resumed step is a prefill: in bfloat16 its rounding differs from
a decode step's enough to flip a random model's near-ties)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sluice.protocol.prompt import RESUME_HEADER, TOKENIZER_HEADER, ResumeIds
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

from .worker_helpers import ServerThread

ENGINE_DTYPE = "float32"  # the conftest's engine (see the docstring)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def http(engine: Any) -> Iterator[httpx.Client]:
    srv = ServerThread(build_app(engine, WorkerConfig(served_model_names=("tiny",)))).start()
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client
    srv.stop()


def run(http: httpx.Client, path: str, body: dict[str, Any],
        resumed: list[int] | None = None) -> tuple[list[dict[str, Any]], str]:
    """A stream's chunks (with token ids) and the worker's tokenizer fingerprint."""
    fp = _fingerprint(http)
    headers = {RESUME_HEADER: ResumeIds(fp, resumed).encode().decode()} if resumed else {}
    with http.stream("POST", path, json={**body, "stream": True, "return_token_ids": True},
                     headers=headers) as s:
        assert s.status_code == 200, s.read()
        lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]], s.headers[TOKENIZER_HEADER]


def _fingerprint(http: httpx.Client) -> str:
    with http.stream("POST", "/v1/completions", json={
            "model": "tiny", "prompt": "x", "max_tokens": 1, "stream": True,
            "return_token_ids": True}) as s:
        s.read()
        return s.headers[TOKENIZER_HEADER]


def ids_text(chunks: list[dict[str, Any]]) -> tuple[list[int], str]:
    ids = [t for ch in chunks for c in ch["choices"] for t in c.get("token_ids", ())]
    text = "".join(c["delta"].get("content") or "" if "delta" in c else c["text"]
                   for ch in chunks for c in ch["choices"])
    return ids, text


@pytest.mark.parametrize("cut", [1, 6])
def test_a_json_schema_stream_resumes_in_its_grammar(http: httpx.Client, cut: int) -> None:
    body = {"model": "tiny", "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "A person as JSON"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": SCHEMA}},
            "stream_options": {"include_usage": True}}
    whole, _ = run(http, "/v1/chat/completions", body)
    ids, text = ids_text(whole)
    json.loads(text)  # the grammar's work: valid JSON
    before = len(ids_text(run(http, "/v1/chat/completions", {**body, "max_tokens": cut})[0])[1])
    rest, _ = run(http, "/v1/chat/completions", body, resumed=ids[:cut])
    assert not any(c["delta"].get("role") for ch in rest for c in ch["choices"])
    rest_ids, rest_text = ids_text(rest)
    assert ids[:cut] + rest_ids == ids
    assert text[:before] + rest_text == text
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    # the resumed ids count as completion tokens, the prompt as the original's
    assert [rest[-1]["usage"][k] for k in counts] == [whole[-1]["usage"][k] for k in counts]


def test_seeded_sampling_resumes_token_exact(http: httpx.Client) -> None:
    body = {"model": "tiny", "max_tokens": 24, "temperature": 1.0, "seed": 99,
            "ignore_eos": True, "prompt": "In the beginning"}
    ids, text = ids_text(run(http, "/v1/completions", body)[0])
    rest_ids, rest_text = ids_text(run(http, "/v1/completions", body, resumed=ids[:9])[0])
    assert ids[:9] + rest_ids == ids
    assert text.endswith(rest_text) and rest_text


def test_resumed_tokens_outside_the_grammar_are_refused(http: httpx.Client) -> None:
    body = {"model": "tiny", "max_tokens": 20, "prompt": "JSON:",
            "response_format": {"type": "json_object"}}
    bad = http.post("/v1/completions", json={**body, "stream": True},
                    headers={RESUME_HEADER: ResumeIds(_fingerprint(http), [17]).encode().decode()})
    assert bad.status_code == 400
    assert "resumed token 17" in bad.json()["error"]["message"]


def test_a_resume_from_another_tokenizer_or_with_n_2_is_a_400(http: httpx.Client) -> None:
    body = {"model": "tiny", "max_tokens": 4, "prompt": "Hi", "stream": True}
    other = http.post("/v1/completions", json=body,
                      headers={RESUME_HEADER: ResumeIds("0123456789ab", [5]).encode().decode()})
    assert other.status_code == 400 and other.json()["error"]["param"] == RESUME_HEADER
    resume = ResumeIds(_fingerprint(http), [5]).encode().decode()
    two = http.post("/v1/completions", json={**body, "n": 2}, headers={RESUME_HEADER: resume})
    assert two.status_code == 400 and two.json()["error"]["param"] == "prompt"
