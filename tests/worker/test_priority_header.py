"""The gateway passes a tenant's priority to Anthropic Messages requests in the
`x-sluice-priority` header (the Messages body has no `priority` field); the worker hands
it to the engine, and refuses a header that is not an integer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

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


def test_a_non_integer_priority_header_is_refused(http: httpx.Client) -> None:
    resp = http.post("/v1/messages", json=BODY, headers={"x-sluice-priority": "high"})
    assert resp.status_code == 400
    assert resp.json()["type"] == "error"
    assert "x-sluice-priority" in resp.json()["error"]["message"]
