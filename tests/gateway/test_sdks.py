"""The official OpenAI and Anthropic SDKs, with a sluice key, against the gateway."""

from __future__ import annotations

import anthropic
import httpx
import httpx2
import openai
import pytest

from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.store import SQLStore, UsageQuery, UsageRecord

from .conftest import make_state, new_key
from .stub import PROMPT_TOKENS, StubUpstream


def transport(gw: GatewayMiddleware) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gw))  # type: ignore[arg-type]


def transport2(gw: GatewayMiddleware) -> httpx2.AsyncClient:
    """The anthropic SDK is built on httpx2, which has its own ASGI transport."""
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gw))  # type: ignore[arg-type]


async def test_openai_sdk_chat_stream_and_rate_limit(sqlite_store: SQLStore) -> None:
    key = new_key(sqlite_store, rpm=3)
    gw = GatewayMiddleware(StubUpstream(), make_state(sqlite_store))
    client = openai.AsyncOpenAI(api_key=key, base_url="http://gateway/v1",
                                http_client=transport(gw), max_retries=0)
    messages = [{"role": "user", "content": "Say hi"}]
    chat = await client.chat.completions.create(model="stub-model", messages=messages,  # type: ignore[arg-type]
                                                max_tokens=4)
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    stream = await client.chat.completions.create(model="stub-model", messages=messages,  # type: ignore[arg-type]
                                                  max_tokens=3, stream=True)
    pieces = [c.choices[0].delta.content async for c in stream]
    assert "".join(p or "" for p in pieces) == "tok tok tok"
    models = await client.models.list()
    assert [m.id for m in models.data] == ["stub-model"]
    with pytest.raises(openai.RateLimitError) as exc:
        await client.completions.create(model="stub-model", prompt="x", max_tokens=1)
    assert exc.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    bad = openai.AsyncOpenAI(api_key="sk-sluice-wrong", base_url="http://gateway/v1",
                             http_client=transport(gw), max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    records = sqlite_store.query_usage(UsageQuery())
    assert [(r.endpoint, r.status, r.completion_tokens) for r in records] == [
        ("/v1/chat/completions", "ok", 4), ("/v1/chat/completions", "ok", 3),
        ("/v1/models", "ok", 0), ("/v1/completions", "rejected", 0)]


async def test_anthropic_sdk_messages_and_stream(sqlite_store: SQLStore) -> None:
    key = new_key(sqlite_store)
    gw = GatewayMiddleware(StubUpstream(), make_state(sqlite_store))
    client = anthropic.AsyncAnthropic(api_key=key, base_url="http://gateway",
                                      http_client=transport2(gw), max_retries=0)
    msg = await client.messages.create(model="stub-model", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert msg.usage.input_tokens == PROMPT_TOKENS and msg.usage.output_tokens == 2
    async with client.messages.stream(model="stub-model", max_tokens=3,
                                      messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join([t async for t in s.text_stream])
    assert text == "tok tok tok"
    records = sqlite_store.query_usage(UsageQuery())
    assert [(r.prompt_tokens, r.completion_tokens) for r in records] == [
        (PROMPT_TOKENS, 2), (PROMPT_TOKENS, 3)]
    wrong = anthropic.AsyncAnthropic(api_key="nope", base_url="http://gateway",
                                     http_client=transport2(gw), max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        await wrong.messages.create(model="stub-model", max_tokens=2,
                                    messages=[{"role": "user", "content": "hi"}])


async def test_sdks_do_not_retry_a_request_over_the_tpm_limit_alone(
        sqlite_store: SQLStore) -> None:
    """With their default retries on, the OpenAI and Anthropic SDKs send a request that
    can never fit the tenant's TPM once (they retried the 429 before), and see the field."""
    key = new_key(sqlite_store, tpm=50)
    gw = GatewayMiddleware(StubUpstream(), make_state(sqlite_store))
    client = openai.AsyncOpenAI(api_key=key, base_url="http://gateway/v1",
                                http_client=transport(gw))
    with pytest.raises(openai.RateLimitError) as exc:
        await client.chat.completions.create(
            model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=100)
    assert exc.value.param == "max_tokens" and "Limit 50" in exc.value.message
    claude = anthropic.AsyncAnthropic(api_key=key, base_url="http://gateway",
                                      http_client=transport2(gw))
    with pytest.raises(anthropic.RateLimitError) as aexc:
        await claude.messages.create(model="stub-model", max_tokens=100,
                                     messages=[{"role": "user", "content": "hi"}])
    assert "Limit 50" in aexc.value.message
    records = sqlite_store.query_usage(UsageQuery())
    assert [(r.endpoint, r.status) for r in records] == [
        ("/v1/chat/completions", "rejected"), ("/v1/messages", "rejected")]


async def test_sdks_do_not_retry_a_spent_budget(sqlite_store: SQLStore) -> None:
    """A tenant whose spend reached its budget is refused until a reset: with their default
    retries on, the SDKs sent each such request three times (three refused records)."""
    from sluice.gateway.pricing import Price, PriceTable

    key = new_key(sqlite_store, budget_usd=1.0)
    sqlite_store.record_usage(UsageRecord(
        request_id="spent", tenant_id=sqlite_store.get_tenant("acme").id, key_id="k",
        endpoint="/v1/chat/completions", model="stub-model", status="ok", http_status=200,
        cost_usd=1.0))
    prices = PriceTable({"stub-model": Price(1.0, 1.0)})
    gw = GatewayMiddleware(StubUpstream(), make_state(sqlite_store, prices=prices))
    client = openai.AsyncOpenAI(api_key=key, base_url="http://gateway/v1",
                                http_client=transport(gw))
    with pytest.raises(openai.RateLimitError) as exc:
        await client.chat.completions.create(
            model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert exc.value.code == "insufficient_quota"
    claude = anthropic.AsyncAnthropic(api_key=key, base_url="http://gateway",
                                      http_client=transport2(gw))
    with pytest.raises(anthropic.RateLimitError):
        await claude.messages.create(model="stub-model", max_tokens=1,
                                     messages=[{"role": "user", "content": "hi"}])
    records = sqlite_store.query_usage(UsageQuery())
    assert [(r.endpoint, r.status) for r in records] == [
        ("/v1/chat/completions", "ok"), ("/v1/chat/completions", "rejected"),
        ("/v1/messages", "rejected")]
