"""Streams over a real server: a client that hangs up still gets exactly one record."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import pytest

from sluice.gateway.middleware import GatewayMiddleware, limit_scopes
from sluice.gateway.pricing import Price, PriceTable
from sluice.gateway.store import SQLStore, UsageQuery

from .conftest import CHAT, make_state, new_key, serve
from .stub import StubUpstream


async def wait_for_records(store: SQLStore, n: int, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if len(store.query_usage(UsageQuery())) >= n:
            return
        await asyncio.sleep(0.02)


async def test_client_abort_mid_stream_records_once_with_tokens_so_far(
        sqlite_store: SQLStore) -> None:
    stub = StubUpstream(chunk_delay=0.03, max_reply=60)
    key = new_key(sqlite_store, max_concurrent=1)
    state = make_state(sqlite_store)
    gw = GatewayMiddleware(stub, state)
    body = {**CHAT, "max_tokens": 60, "stream": True}
    async with serve(gw) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        headers = {"Authorization": f"Bearer {key}"}
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers=headers) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 4:
                    break  # hang up mid-stream
        await wait_for_records(sqlite_store, 1)
        [rec] = sqlite_store.query_usage(UsageQuery())
        assert rec.status == "aborted"
        assert 4 <= rec.completion_tokens < 60
        assert rec.prompt_tokens > 0  # counted at admission; upstream never sent usage
        # the concurrency slot came back: the next request is admitted
        r2 = await client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                               headers=headers)
        assert r2.status_code == 200 and r2.text.endswith("data: [DONE]\n\n")
        await wait_for_records(sqlite_store, 2)  # settled before its last bytes were sent
    statuses = [r.status for r in sqlite_store.query_usage(UsageQuery())]
    assert statuses == ["aborted", "ok"]
    assert state.metrics.inflight._value.get() == 0


async def test_client_hang_up_on_a_json_request_is_aborted_with_its_prompt_tokens(
        sqlite_store: SQLStore) -> None:
    """The non-streamed twin of the test above: the client hangs up while the upstream
    generates; the upstream (like the sluice worker) cancels and answers 499. The record
    was status "error" with 0 tokens; it is "aborted" with the prompt tokens counted at
    admission, once, and the slot and the tokens reserved come back."""
    stub = StubUpstream()
    stub.hold_json = True
    state = make_state(sqlite_store)
    key = new_key(sqlite_store, max_concurrent=1, tpm=1000)
    gw = GatewayMiddleware(stub, state)
    body = {**CHAT, "max_tokens": 500}
    headers = {"Authorization": f"Bearer {key}"}
    async with serve(gw) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        hanging = asyncio.create_task(client.post("/v1/chat/completions", json=body,
                                                  headers=headers))
        while not stub.received:
            await asyncio.sleep(0.01)
        hanging.cancel()  # the client hangs up (its connection is closed)
        await wait_for_records(sqlite_store, 1)
        [rec] = sqlite_store.query_usage(UsageQuery())
        admitted = state.count_prompt_tokens("stub-model", body)
        assert (rec.status, rec.http_status) == ("aborted", 499)
        assert (rec.prompt_tokens, rec.completion_tokens) == (admitted, 0)
        assert stub.json_cancelled == 1
        stub.hold_json = False  # the slot came back; of the tokens, the prompt stays spent
        over = {**CHAT, "max_tokens": 1001 - 2 * admitted}  # fits only if nothing was spent
        r = await client.post("/v1/chat/completions", json=over, headers=headers)
        assert r.status_code == 429, r.text
        r = await client.post("/v1/chat/completions", headers=headers,
                              json={**CHAT, "max_tokens": 1000 - 2 * admitted})
        assert r.status_code == 200 and r.headers["x-ratelimit-remaining-tokens"] == "0"
        await wait_for_records(sqlite_store, 3)
    statuses = [r.status for r in sqlite_store.query_usage(UsageQuery())]
    assert statuses == ["aborted", "rejected", "ok"]
    assert state.metrics.inflight._value.get() == 0


async def test_json_hang_up_of_a_budgeted_tenant_settles_its_budget_once(
        sqlite_store: SQLStore) -> None:
    """The same hang-up with a priced model and a budget: the worst-case reservation is
    given back and the prompt's cost is spent, once (one transaction with the record)."""
    stub = StubUpstream()
    stub.hold_json = True
    prices = PriceTable({"stub-model": Price(1_000_000.0, 2_000_000.0)})  # $1 / $2 a token
    state = make_state(sqlite_store, prices=prices)
    key = new_key(sqlite_store, budget_usd=10_000.0)
    gw = GatewayMiddleware(stub, state)
    body = {**CHAT, "max_tokens": 500}
    async with serve(gw) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        hanging = asyncio.create_task(client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}))
        while not stub.received:
            await asyncio.sleep(0.01)
        assert sqlite_store.get_tenant("acme").reserved_usd > 1000  # 500 tokens at $2
        hanging.cancel()
        await wait_for_records(sqlite_store, 1)
    await state.flush()
    [rec] = sqlite_store.query_usage(UsageQuery())
    admitted = state.count_prompt_tokens("stub-model", body)
    assert (rec.status, rec.prompt_tokens, rec.completion_tokens) == ("aborted", admitted, 0)
    assert rec.cost_usd == float(admitted)
    tenant = sqlite_store.get_tenant("acme")
    assert (tenant.spend_usd, tenant.reserved_usd) == (float(admitted), 0.0)


async def test_a_hang_up_right_after_the_last_event_keeps_the_record(
        sqlite_store: SQLStore) -> None:
    """`sluice gateway --upstream`: the proxy sends a stream's last event, then an empty
    closing message, at which the gateway settles. A client that closes its connection
    on `data: [DONE]` (the OpenAI SDK does) makes the proxy cancel its forwarding task,
    and that cancellation landed inside the settlement already begun: the record was
    never written (1 stream in 3 through two replicas lost its ledger row). The limiter
    here holds the settlement until the proxy has returned, so it lands every time."""
    from sluice.gateway.limits import Lease, LocalLimiter
    from sluice.gateway.proxy import UpstreamProxy

    events = (b'data: {"id":"c","object":"chat.completion.chunk","model":"stub-model",'
              b'"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
              b'data: {"id":"c","object":"chat.completion.chunk","model":"stub-model",'
              b'"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1,'
              b'"total_tokens":8}}\n\ndata: [DONE]\n\n')

    async def stream() -> AsyncIterator[bytes]:
        yield events

    upstream = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=stream())))
    settling, proxy_returned = asyncio.Event(), asyncio.Event()

    class HeldLimiter(LocalLimiter):
        async def finish(self, lease: Lease, actual_tokens: int) -> None:
            settling.set()
            await proxy_returned.wait()
            await super().finish(lease, actual_tokens)

    proxy = UpstreamProxy("http://upstream", client=upstream)

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        try:
            await proxy(scope, receive, send)
        finally:
            proxy_returned.set()

    key = new_key(sqlite_store, tpm=10_000)  # a TPM limit: the limiter settles first
    gw = GatewayMiddleware(inner, make_state(sqlite_store, HeldLimiter()))
    body = json.dumps({**CHAT, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> MutableMapping[str, Any]:
        if messages:
            return messages.pop()
        await settling.wait()  # the client closes its connection as the stream ends
        return {"type": "http.disconnect"}

    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "query_string": b"", "headers": [(b"authorization", f"Bearer {key}".encode()),
                                              (b"content-type", b"application/json")]}
    await gw(scope, receive, send)
    await gw.state.aclose()
    assert sent[0]["status"] == 200
    [rec] = sqlite_store.query_usage(UsageQuery())
    assert (rec.status, rec.prompt_tokens, rec.completion_tokens) == ("ok", 7, 1)


async def test_anthropic_abort_mid_stream_is_charged_the_tokens_streamed(
        sqlite_store: SQLStore) -> None:
    """Anthropic's `message_start` carries `usage.output_tokens` (0 from sluice's worker,
    1 from Anthropic's), a count at the start, not of the stream: the meter took it as
    the completion count, so a client that hung up after some text was charged 0 (or 1)
    completion tokens instead of the text streamed so far, as an OpenAI stream is."""
    stub = StubUpstream(chunk_delay=0.03, max_reply=60)
    key = new_key(sqlite_store)
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    body = {"model": "stub-model", "max_tokens": 60, "stream": True,
            "messages": [{"role": "user", "content": "Hello there"}]}
    async with serve(gw) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        async with client.stream("POST", "/v1/messages", json=body,
                                 headers={"x-api-key": key}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line == "event: content_block_delta"
                if seen == 8:
                    break  # hang up mid-stream: " tok" x 8 received
        await wait_for_records(sqlite_store, 1)
    [rec] = sqlite_store.query_usage(UsageQuery())
    assert rec.status == "aborted"
    assert 8 <= rec.completion_tokens < 60
    assert rec.prompt_tokens == 7  # message_start's input_tokens


OPENAI_EVENTS = (
    b'data: {"id":"c","object":"chat.completion.chunk","model":"stub-model",'
    b'"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n',
    b'data: {"id":"c","object":"chat.completion.chunk","model":"stub-model",'
    b'"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8}}\n\n',
    b"data: [DONE]\n\n")
ANTHROPIC_EVENTS = (
    b'event: message_start\ndata: {"type":"message_start","message":{"model":"stub-model",'
    b'"usage":{"input_tokens":7,"output_tokens":0}}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"hi"}}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
    b'"end_turn"},"usage":{"output_tokens":1}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


@pytest.mark.parametrize("path,events", [("/v1/chat/completions", OPENAI_EVENTS),
                                         ("/v1/messages", ANTHROPIC_EVENTS)])
async def test_a_stream_settles_before_its_last_event_reaches_the_client(
        sqlite_store: SQLStore, path: str, events: tuple[bytes, ...]) -> None:
    """The `--upstream` proxy forwards a stream's last event (`data: [DONE]`, Anthropic's
    `message_stop`) with more to come, then an empty closing message, and the gateway
    settled only at that message: a client that sent its next request on reading the
    last event (to the other replica) found its `max_concurrent: 1` slot still taken,
    429 (1 in 40 through two replicas), or a budget's spend not yet written. It settles
    before forwarding the last event now, as a JSON answer does before its last bytes."""
    key = new_key(sqlite_store, max_concurrent=1)
    seen_at_last_event: list[int] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    gw = GatewayMiddleware(inner, make_state(sqlite_store))
    body = json.dumps({**CHAT, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> MutableMapping[str, Any]:
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        if events[-1] in message.get("body", b""):
            seen_at_last_event.append(len(sqlite_store.query_usage(UsageQuery())))
            retry = await gw.state.limiter.acquire(limit_scopes(
                sqlite_store.authenticate(key)), 1)  # type: ignore[arg-type]
            seen_at_last_event.append(int(retry.allowed))

    headers = [(b"x-api-key", key.encode()), (b"content-type", b"application/json")]
    await gw({"type": "http", "method": "POST", "path": path, "query_string": b"",
              "headers": headers}, receive, send)
    assert seen_at_last_event == [1, 1]  # recorded, and the slot free for the next request
    [rec] = sqlite_store.query_usage(UsageQuery())
    assert (rec.status, rec.prompt_tokens, rec.completion_tokens) == ("ok", 7, 1)


@pytest.mark.parametrize("path,first", [("/v1/chat/completions", OPENAI_EVENTS[0]),
                                        ("/v1/messages", ANTHROPIC_EVENTS[0])])
async def test_an_upstream_failing_mid_stream_ends_it_with_an_error_event(
        sqlite_store: SQLStore, path: str, first: bytes) -> None:
    """An upstream that fails after the first events (a worker killed mid-stream behind
    `--upstream`) left the client's response unfinished: uvicorn cut the connection
    ("ASGI callable returned without completing response") and the SDKs raised a bare
    transport error (httpx.RemoteProtocolError, not openai.APIError). The stream now
    ends with the error event each API streams (OpenAI's `data: {"error": ...}`,
    Anthropic's `event: error`), which the SDKs raise as their own errors; the record
    is an `error` with the tokens streamed so far, as for a stream cut short."""
    import anthropic
    import openai

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": first + first[:20],
                    "more_body": True})  # and a cut event, never forwarded
        raise httpx.RemoteProtocolError("peer closed connection without sending complete "
                                        "message body (incomplete chunked read)")

    key = new_key(sqlite_store)
    gw = GatewayMiddleware(inner, make_state(sqlite_store))
    messages: Any = [{"role": "user", "content": "Hi"}]
    async with serve(gw) as url:
        if path == "/v1/messages":
            claude = anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)
            stream = await claude.messages.create(model="stub-model", max_tokens=5,
                                                  stream=True, messages=messages)
            with pytest.raises(anthropic.APIStatusError, match="upstream failed mid-stream"):
                async for _ in stream:
                    pass
        else:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            chunks = await client.chat.completions.create(
                model="stub-model", max_tokens=5, stream=True, messages=messages)
            with pytest.raises(openai.APIError, match="upstream failed mid-stream"):
                async for _ in chunks:
                    pass
        await gw.state.aclose()
    [rec] = sqlite_store.query_usage(UsageQuery())
    # an `error` (the upstream's failure, not the client's hang-up: it was `aborted`),
    # charged the prompt and what was streamed, as a stream cut short is
    assert (rec.status, rec.http_status) == ("error", 200)
    assert (rec.prompt_tokens, rec.completion_tokens) == (
        (1, 1) if path == "/v1/chat/completions" else (7, 0))
