"""The gateway passes a tenant's priority class in the `x-sluice-priority` header (the
Messages body has no `priority` field, and a body priority would be refused by a worker
under fcfs); the worker hands it to the engine where the body names none, and refuses a
header that is not an integer. A worker whose policy is fcfs refuses a `priority` other
than 0 in the body, as vLLM does, and ignores the header."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.engine.config import EngineConfig
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

from .conftest import TINY_OPTIONS
from .worker_helpers import ServerThread

BODY = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture()
def seen_priorities(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    generate = engine.generate

    def recording(prompt: Any, params: Any, request_id: str, priority: int = 0,
                  *rest: Any, **options: Any) -> AsyncIterator[Any]:
        seen.append(priority)
        return generate(prompt, params, request_id, priority, *rest, **options)

    monkeypatch.setattr(engine, "generate", recording)
    return seen


def test_messages_take_priority_from_the_header(http: httpx.Client,
                                                seen_priorities: list[int]) -> None:
    resp = http.post("/v1/messages", json=BODY, headers={"x-sluice-priority": "2"})
    assert resp.status_code == 200, resp.text
    resp = http.post("/v1/messages", json=BODY)
    assert resp.status_code == 200, resp.text
    assert seen_priorities == [2, 0]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "tiny", "messages": BODY["messages"], "max_tokens": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2}),
])
def test_openai_routes_take_the_class_from_the_header_unless_the_body_says(
        http: httpx.Client, seen_priorities: list[int], path: str, body: dict) -> None:
    assert http.post(path, json=body, headers={"x-sluice-priority": "2"}).status_code == 200
    assert http.post(path, json={**body, "priority": 3},
                     headers={"x-sluice-priority": "2"}).status_code == 200
    assert seen_priorities == [2, 3]


def test_a_non_integer_priority_header_is_refused(http: httpx.Client) -> None:
    resp = http.post("/v1/messages", json=BODY, headers={"x-sluice-priority": "high"})
    assert resp.status_code == 400
    assert resp.json()["type"] == "error"
    assert "x-sluice-priority" in resp.json()["error"]["message"]


@pytest.fixture(scope="module")
def fcfs_url(tiny_llama_dir: Path) -> Iterator[str]:
    from sluice.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig.from_options(str(tiny_llama_dir), **TINY_OPTIONS,
                                                   scheduling_policy="fcfs"))
    server = ServerThread(build_app(engine, WorkerConfig(served_model_names=("tiny",)))).start()
    yield server.url
    server.stop()
    engine.shutdown()


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": BODY["messages"], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
])
def test_a_priority_under_fcfs_is_refused(fcfs_url: str, path: str, body: dict) -> None:
    """fcfs never reads a priority: one other than 0 answered 200 and was ignored. vLLM
    refuses it ("Got priority 3 but Priority scheduling is not enabled"); so does the
    worker, with OpenAI's error JSON naming `priority`."""
    resp = httpx.post(fcfs_url + path, json={**body, "priority": 3}, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "priority" and "Priority scheduling is not enabled" in err["message"]
    assert httpx.post(fcfs_url + path, json={**body, "priority": 0}, timeout=30).status_code == 200
    # the gateway's class (x-sluice-priority, sent for every tenant: "standard" is 1) is a
    # hint a worker under fcfs ignores; refused, every request of such a tenant failed
    for p, b in ((path, body), ("/v1/messages", BODY)):
        resp = httpx.post(fcfs_url + p, json=b, headers={"x-sluice-priority": "3"}, timeout=30)
        assert resp.status_code == 200, resp.text
