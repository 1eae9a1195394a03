"""GatewayMiddleware over the stub upstream, in process (SQLite + LocalLimiter)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pytest

from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.pricing import Price, PriceTable
from sluice.gateway.store import (
    KeySettings,
    SQLStore,
    TenantSettings,
    UsageQuery,
    UsageRecord,
)

from .conftest import ADMIN_KEY, CHAT, client_for, make_state, new_key
from .stub import PROMPT_TOKENS, StubUpstream


async def test_missing_and_wrong_keys_get_401_in_openai_shape(gateway: GatewayMiddleware) -> None:
    async with client_for(gateway) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = await c.post("/v1/chat/completions", json=CHAT,
                         headers={"Authorization": "Bearer sk-sluice-nope"})
        assert r.status_code == 401


async def test_request_passes_with_its_class_priority_in_a_header_and_is_recorded(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    key = new_key(sqlite_store, rpm=10, tpm=1000, priority_class="interactive")
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, key) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        assert r.headers["x-ratelimit-limit-requests"] == "10"
        assert r.headers["x-ratelimit-remaining-requests"] == "9"
        assert r.headers["x-ratelimit-limit-tokens"] == "1000"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    sent = stub.received[-1]  # the class goes as a header, the body as the client sent it
    assert "priority" not in sent and sent["model"] == "stub-model"
    headers = stub.headers[-1]
    assert "authorization" not in headers and headers["x-sluice-priority"] == "0"
    [rec] = sqlite_store.query_usage(UsageQuery())
    assert (rec.status, rec.http_status, rec.prompt_tokens, rec.completion_tokens) == (
        "ok", 200, PROMPT_TOKENS, 5)
    assert rec.endpoint == "/v1/chat/completions" and rec.model == "stub-model"
    assert rec.request_id == r.headers["x-request-id"]
    assert rec.request_body is None and rec.response_body is None


async def test_client_priority_may_only_go_down(sqlite_store: SQLStore, stub: StubUpstream) -> None:
    key = new_key(sqlite_store, priority_class="standard")
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, key) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "priority": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        r = await c.post("/v1/chat/completions", json={**CHAT, "priority": 5})
        assert r.status_code == 200
    assert stub.received[-1]["priority"] == 5
    assert len(stub.received) == 1  # the refused one never reached upstream


async def test_clients_may_not_send_kv_transfer_params(sqlite_store: SQLStore,
                                                       stub: StubUpstream) -> None:
    """The field names a host and port a decode worker connects to: only the router sets it."""
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    params = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 22}
    async with client_for(gw, new_key(sqlite_store)) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "kv_transfer_params": params})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "kv_transfer_params"
    assert stub.received == []


async def test_key_class_narrows_tenant_class(sqlite_store: SQLStore, stub: StubUpstream) -> None:
    key = new_key(sqlite_store, key_settings=KeySettings(priority_class="batch"),
                  priority_class="interactive")
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, key) as c:
        assert (await c.post("/v1/completions", json={"model": "m", "prompt": "hi"})).is_success
    assert stub.headers[-1]["x-sluice-priority"] == "2" and "priority" not in stub.received[-1]


async def test_allowed_models_narrowed_by_key(sqlite_store: SQLStore, stub: StubUpstream) -> None:
    key = new_key(sqlite_store, key_settings=KeySettings(allowed_models=("stub-model",)),
                  allowed_models=("stub-model", "other"))
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, key) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    statuses = [r.status for r in sqlite_store.query_usage(UsageQuery())]
    assert statuses == ["rejected", "ok"]


async def test_a_missing_or_mistyped_model_is_a_400_naming_model(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """Before, a model that was not a string was read as none, and a key with an allow
    list got a 404 `model_not_found` for "The model None"; a missing model (the upstream's
    default) passes only for a key without a list."""
    listed = new_key(sqlite_store, key_settings=KeySettings(allowed_models=("stub-model",)))
    free = new_key(sqlite_store)
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    no_model = {k: v for k, v in CHAT.items() if k != "model"}
    async with client_for(gw, listed) as c:
        for path, body in (("/v1/chat/completions", no_model),
                           ("/v1/chat/completions", {**CHAT, "model": 5}),
                           ("/v1/messages", {**no_model, "model": ["stub-model"]})):
            r = await c.post(path, json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and "None" not in error["message"]
            if path != "/v1/messages":
                assert error["param"] == "model"
        r = await c.post("/v1/messages", json=no_model)
        assert r.json()["type"] == "error" and "model" in r.json()["error"]["message"]
    async with client_for(gw, free) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": {"id": "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert (await c.post("/v1/chat/completions", json=no_model)).status_code == 200
    assert len(stub.received) == 1


async def test_a_completion_too_large_names_the_field_that_makes_it_so(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """max_tokens x n above 2^31 - 1 is a 400: naming `n` when max_tokens alone is fine
    (it named max_tokens for `max_tokens: 2, n: 10**12`)."""
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, new_key(sqlite_store)) as c:
        for extra, param in (({"n": 10**12}, "n"), ({"max_tokens": 10**12}, "max_tokens"),
                             ({"max_completion_tokens": 2**40, "n": 2},
                              "max_completion_tokens"),
                             ({"max_completion_tokens": 2**20, "n": 2**20}, "n")):
            r = await c.post("/v1/chat/completions", json={**CHAT, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    assert stub.received == []


async def test_bad_json_is_a_400_naming_body(gateway: GatewayMiddleware,
                                             sqlite_store: SQLStore) -> None:
    key = new_key(sqlite_store)
    async with client_for(gateway, key) as c:
        r = await c.post("/v1/chat/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"


async def test_rpm_limit_in_process_burst_is_exact(sqlite_store: SQLStore,
                                                   stub: StubUpstream) -> None:
    key = new_key(sqlite_store, rpm=7)
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, key) as c:
        rs = await asyncio.gather(*[c.post("/v1/chat/completions", json=CHAT) for _ in range(20)])
    codes = [r.status_code for r in rs]
    assert codes.count(200) == 7 and codes.count(429) == 13
    refused = next(r for r in rs if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    records = sqlite_store.query_usage(UsageQuery())
    assert sorted(r.status for r in records) == ["ok"] * 7 + ["rejected"] * 13


async def test_tokens_per_minute_reserve_then_reconcile(sqlite_store: SQLStore,
                                                        stub: StubUpstream) -> None:
    """Real tokenizer: the reservation is the templated prompt + max_tokens; afterwards
    the key is charged upstream's prompt tokens + actual completion tokens."""
    from sluice.gateway.tokens import PromptTokenCounter

    counter = PromptTokenCounter()
    prompt = counter("stub-model", CHAT)
    assert not counter.estimated and prompt > 10
    key = new_key(sqlite_store, tpm=prompt + 100)
    gw = GatewayMiddleware(stub, make_state(sqlite_store, count=counter))
    async with client_for(gw, key) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100})
        assert r.status_code == 200
        assert r.headers["x-ratelimit-remaining-tokens"] == "0"  # reserved in full
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100})
        assert r.status_code == 429 and "tokens" in r.json()["error"]["message"]
        # reconciled: 7 prompt + 8 completion were used, the rest came back
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
        assert r.status_code == 200
        used_before = PROMPT_TOKENS + 8
        assert r.headers["x-ratelimit-remaining-tokens"] == str(
            prompt + 100 - used_before - (prompt + 1))
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10**6})
        assert r.status_code == 429 and "too large" in r.json()["error"]["message"]


async def test_a_request_over_the_tpm_limit_alone_is_told_not_to_retry(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """tpm 50, max_tokens 100: it can never fit. OpenAI's answer: 429 rate_limit_exceeded,
    "Request too large ... Limit X, Requested Y", naming the field; no Retry-After (it was
    `Retry-After: 60` and `param: null`, so the SDKs retried it), `x-should-retry: false`.
    Also when another limit refuses it too (that one's wait would not help), on
    /v1/messages in Anthropic's shape, and nothing is charged for it."""
    key = new_key(sqlite_store, tpm=50, key_settings=KeySettings(rpm=3))
    state = make_state(sqlite_store)
    gw = GatewayMiddleware(stub, state)
    cases = [("/v1/chat/completions", {**CHAT, "max_tokens": 100}, "max_tokens"),
             ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 60},
              "max_completion_tokens"),
             ("/v1/completions", {"model": "stub-model", "prompt": "hi", "max_tokens": 49,
                                  "n": 2}, "max_tokens")]
    async with client_for(gw, key) as c:
        for path, body, field in cases:
            r = await c.post(path, json=body)
            requested = state.count_prompt_tokens("stub-model", body) + (
                body.get(field, 0) * body.get("n", 1))  # type: ignore[operator]
            assert r.status_code == 429, r.text
            assert "retry-after" not in r.headers and r.headers["x-should-retry"] == "false"
            assert r.headers["x-ratelimit-limit-tokens"] == "50"
            error = r.json()["error"]
            assert (error["code"], error["type"], error["param"]) == (
                "rate_limit_exceeded", "rate_limit_error", field)
            assert error["message"].startswith(
                f"Request too large for tokens per minute (TPM): Limit 50, Requested "
                f"{requested}. The request alone (its prompt plus {field}) exceeds the limit")
        r = await c.post("/v1/messages", json={"model": "stub-model", "max_tokens": 100,
                                               "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and "retry-after" not in r.headers
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "rate_limit_error"
        assert "Limit 50" in r.json()["error"]["message"]
        assert "max_tokens" in r.json()["error"]["message"]
        # nothing was charged: the key's 3 requests a minute are all still there
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100})
        assert r.status_code == 429 and r.json()["error"]["param"] == "max_tokens"
        assert "retry-after" not in r.headers  # over rpm as well: still too large
        r = await c.post("/v1/chat/completions", json=CHAT)  # over rpm only: retry later
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["param"] is None and "x-should-retry" not in r.headers
    statuses = [rec.status for rec in sqlite_store.query_usage(UsageQuery())]
    assert statuses == ["rejected"] * 4 + ["ok"] * 3 + ["rejected"] * 2


async def test_concurrency_limit(sqlite_store: SQLStore, stub: StubUpstream) -> None:
    key = new_key(sqlite_store, max_concurrent=2)
    stub.gate = asyncio.Event()
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, key) as c:
        held = [asyncio.create_task(c.post("/v1/chat/completions", json=CHAT)) for _ in range(2)]
        while len(stub.received) < 2:
            await asyncio.sleep(0.01)
        third = await c.post("/v1/chat/completions", json=CHAT)
        assert third.status_code == 429
        assert "concurrent" in third.json()["error"]["message"]
        stub.gate.set()
        assert [(await t).status_code for t in held] == [200, 200]
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_budget_exhaustion_gives_insufficient_quota(sqlite_store: SQLStore,
                                                          stub: StubUpstream) -> None:
    prices = PriceTable({"stub-model": Price(1_000_000.0, 2_000_000.0)})  # $1 in, $2 out / token
    key = new_key(sqlite_store, budget_usd=40.0, soft_budget_usd=10.0)
    state = make_state(sqlite_store, prices=prices)
    gw = GatewayMiddleware(stub, state)
    async with client_for(gw, key) as c:
        codes = [(await c.post("/v1/chat/completions", json=CHAT)).status_code for _ in range(4)]
        # each costs 7*$1 + 5*$2 = $17 and is admitted on its worst case, 3 counted prompt
        # tokens (chars/4) + 5 max_tokens = $13: at spend 0 and 17 it fits the $40
        # budget, at 34 it does not (34 + 13 > 40)
        assert codes == [200, 200, 429, 429]
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.json()["error"]["code"] == "insufficient_quota"
        assert r.json()["error"]["type"] == "insufficient_quota"
        assert "max_tokens" in r.json()["error"]["message"]
    tenant = sqlite_store.get_tenant("acme")
    records = sqlite_store.query_usage(UsageQuery())
    assert tenant.spend_usd == pytest.approx(34.0) == sum(r.cost_usd for r in records)
    assert tenant.reserved_usd == pytest.approx(0.0)
    # over the $10 soft budget: the requests seen at spend 17, 34, 34, 34
    assert state.metrics.soft_budget.labels(tenant=tenant.id)._value.get() == 4


async def test_a_spent_budget_is_reset_by_the_admin_api_and_the_cli(
        sqlite_store: SQLStore, stub: StubUpstream, tmp_path: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A tenant that reached its budget was refused for good: no route or command set its
    spend back (LiteLLM resets on `budget_duration`); an operator had to raise the budget
    or edit the table. `POST /admin/tenants/{ref}/reset_spend` and `sluice tenants
    reset-spend` start a new period; the ledger keeps its rows."""
    from sluice.cli import main

    prices = PriceTable({"stub-model": Price(1_000_000.0, 2_000_000.0)})
    key = new_key(sqlite_store, budget_usd=20.0)
    gw = GatewayMiddleware(stub, make_state(sqlite_store, prices=prices))
    async with client_for(gw, key) as c, client_for(gw, ADMIN_KEY) as admin:
        assert [(await c.post("/v1/chat/completions", json=CHAT)).status_code
                for _ in range(2)] == [200, 429]
        r = await admin.post("/admin/tenants/acme/reset_spend")
        assert r.status_code == 200 and r.json()["spend_usd"] == 0.0, r.text
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 429
        db = ["--database-url", str(sqlite_store.engine.url)]
        assert main(["tenants", "reset-spend", "acme", *db]) == 0
        assert "reset the spend of tenant acme to 0" in capsys.readouterr().out
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        r = await admin.post("/admin/tenants/nobody/reset_spend")
        assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"
        assert (await c.post("/admin/tenants/acme/reset_spend")).status_code == 401
    assert main(["tenants", "reset-spend", "nobody", *db]) == 1
    assert sqlite_store.get_tenant("acme").spend_usd == pytest.approx(17.0)
    assert [r.status for r in sqlite_store.query_usage(UsageQuery())] == [
        "ok", "rejected", "ok", "rejected", "ok"]


async def test_streaming_usage_is_metered_and_extra_chunk_stripped(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    key = new_key(sqlite_store)
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, key) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        events = [e for e in r.text.split("\n\n") if e]
        assert stub.received[-1]["stream_options"] == {"include_usage": True}
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert len(chunks) == 5 and all(ch["choices"] for ch in chunks)  # no usage chunk
        assert not any("usage" in ch for ch in chunks)  # nor the option's usage: null
        r = await c.post("/v1/chat/completions", json={
            **CHAT, "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
        assert all(ch["usage"] is None for ch in chunks[:-1])  # asked for: as sent
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    records = sqlite_store.query_usage(UsageQuery())
    assert [(x.status, x.prompt_tokens, x.completion_tokens) for x in records] == [
        ("ok", PROMPT_TOKENS, 5), ("ok", PROMPT_TOKENS, 5)]


async def test_anthropic_messages_with_x_api_key(sqlite_store: SQLStore, stub: StubUpstream) -> None:
    key = new_key(sqlite_store, rpm=1)
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    body = {"model": "stub-model", "max_tokens": 3, "system": "be brief",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    async with client_for(gw) as c:
        r = await c.post("/v1/messages", json={**body, "stream": True},
                         headers={"x-api-key": key})
        assert r.status_code == 200 and "message_stop" in r.text
        r = await c.post("/v1/messages", json=body, headers={"x-api-key": key})
        assert r.status_code == 429
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "rate_limit_error"
        r = await c.post("/v1/messages", json=body, headers={"x-api-key": "sk-sluice-bad"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "priority" not in stub.received[-1]  # Anthropic bodies are not extended
    assert stub.headers[-1]["x-sluice-priority"] == "1"
    rec = sqlite_store.query_usage(UsageQuery())[0]
    assert (rec.endpoint, rec.prompt_tokens, rec.completion_tokens) == ("/v1/messages", 7, 3)


async def test_upstream_error_recorded_without_tokens(sqlite_store: SQLStore,
                                                      stub: StubUpstream) -> None:
    key = new_key(sqlite_store)
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, key) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "broken"})
        assert r.status_code == 400
    [rec] = sqlite_store.query_usage(UsageQuery())
    assert (rec.status, rec.http_status, rec.prompt_tokens, rec.cost_usd) == ("error", 400, 0, 0)


async def test_bodies_stored_redacted_only_when_tenant_opts_in(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    quiet = new_key(sqlite_store, tenant="quiet")
    audited = new_key(sqlite_store, tenant="audited", store_bodies=True)
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    body = {**CHAT, "messages": [{"role": "user", "content": "mail me: ann@example.org"}]}
    for key in (quiet, audited):
        async with client_for(gw, key) as c:
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
    q, a = sqlite_store.query_usage(UsageQuery())
    assert q.request_body is None and q.response_body is None
    assert a.request_body is not None and "[EMAIL]" in a.request_body
    assert "ann@example.org" not in a.request_body
    assert a.response_body is not None and "tok" in a.response_body


async def test_passthrough_paths_and_merged_metrics(gateway: GatewayMiddleware) -> None:
    async with client_for(gateway) as c:
        assert (await c.get("/health")).text == "ok"
        assert (await c.get("/admin/workers")).json() == {"workers": []}  # the router's admin
        assert (await c.get("/admin/tenants")).status_code == 401  # the gateway's admin
        text = (await c.get("/metrics")).text
        assert "vllm:num_requests_running" in text
        assert "sluice_gateway_requests_in_flight" in text


async def test_revoked_key_rejected_at_once_and_admin_api(sqlite_store: SQLStore,
                                                         stub: StubUpstream) -> None:
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, ADMIN_KEY) as admin:
        assert (await admin.post("/admin/tenants", json={"name": "a", "rpm": 0})).status_code == 201
        r = await admin.post("/admin/tenants", json={"name": "a", "colour": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "colour"
        r = await admin.patch("/admin/tenants/a", json={"rpm": 5})
        assert r.json()["rpm"] == 5
        created = (await admin.post("/admin/keys", json={"tenant": "a", "name": "ci"})).json()
        key = created["key"]
        listed = (await admin.get("/admin/keys", params={"tenant": "a"})).json()["data"]
        assert [k["id"] for k in listed] == [created["id"]] and "key" not in listed[0]
        async with client_for(gw, key) as c:
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert (await admin.delete(f"/admin/keys/{created['id']}")).status_code == 200
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 401
        async with client_for(gw, "wrong") as bad:
            assert (await bad.get("/admin/tenants")).status_code == 401


async def test_admin_reads_one_key_without_its_secret(sqlite_store: SQLStore,
                                                      stub: StubUpstream) -> None:
    """`GET /admin/keys/{id}` (LiteLLM's /key/info) was a 405: one key's settings and
    state took listing them all; it never shows the secret or its digest."""
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, ADMIN_KEY) as admin:
        assert (await admin.post("/admin/tenants", json={"name": "a"})).status_code == 201
        created = (await admin.post("/admin/keys", json={
            "tenant": "a", "name": "ci", "rpm": 3, "allowed_models": ["m"]})).json()
        r = await admin.get(f"/admin/keys/{created['id']}")
        assert r.status_code == 200, r.text
        one = r.json()
        assert one == {k: v for k, v in created.items() if k != "key"}
        assert (one["rpm"], one["allowed_models"], one["revoked_at"]) == (3, ["m"], None)
        assert created["key"] not in r.text and "digest" not in one
        assert (await admin.delete(f"/admin/keys/{created['id']}")).status_code == 200
        assert (await admin.get(f"/admin/keys/{created['id']}")).json()["revoked_at"] is not None
        r = await admin.get("/admin/keys/key_nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "key_not_found", r.text


async def test_deleting_a_tenant_revokes_its_keys_everywhere_and_keeps_its_ledger(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """`DELETE /admin/tenants/{ref}` (LiteLLM's /team/delete) was a 405. It revokes
    every key of the tenant in one transaction that bumps the auth version, so another
    replica (its own store on the same file) refuses a key it had cached at its next
    request; a request in flight finishes and is recorded, spend included; the ledger
    keeps the tenant's records, still read by its name."""
    prices = PriceTable({"stub-model": Price(1_000_000.0, 2_000_000.0)})
    replica_a = GatewayMiddleware(stub, make_state(sqlite_store, prices=prices))
    replica_b = GatewayMiddleware(stub, make_state(SQLStore(sqlite_store.url), prices=prices))
    async with client_for(replica_a, ADMIN_KEY) as admin:
        assert (await admin.post("/admin/tenants", json={"name": "a"})).status_code == 201
        keys = [(await admin.post("/admin/keys", json={"tenant": "a"})).json()
                for _ in range(2)]
        async with client_for(replica_b, keys[0]["key"]) as b, \
                client_for(replica_a, keys[1]["key"]) as a:
            assert (await b.post("/v1/chat/completions", json=CHAT)).status_code == 200
            stub.gate = asyncio.Event()
            in_flight = asyncio.create_task(a.post("/v1/chat/completions", json=CHAT))
            while len(stub.received) < 2:
                await asyncio.sleep(0.01)
            r = await admin.delete("/admin/tenants/a")
            assert r.status_code == 200, r.text
            deleted = r.json()
            assert deleted["name"] == "a" and deleted["deleted_at"] is not None
            assert deleted["revoked_keys"] == sorted(k["id"] for k in keys)
            assert (await b.post("/v1/chat/completions", json=CHAT)).status_code == 401
            stub.gate.set()
            assert (await in_flight).status_code == 200
            assert (await a.post("/v1/chat/completions", json=CHAT)).status_code == 401
        usage = (await admin.get("/admin/usage", params={"tenant": "a"})).json()
        assert [row["status"] for row in usage["data"]] == ["ok", "ok"]
        tenant = sqlite_store.get_tenant("a", deleted=True)
        assert tenant.spend_usd == pytest.approx(usage["totals"]["cost_usd"]) and tenant.spend_usd > 0
        assert tenant.reserved_usd == 0
        listed = (await admin.get("/admin/keys", params={"tenant": "a"})).json()["data"]
        assert [k["revoked_at"] is not None for k in listed] == [True, True]
        assert (await admin.get("/admin/tenants")).json()["data"] == []
        for method, path, body in (("GET", "/admin/tenants/a", None),
                                   ("DELETE", "/admin/tenants/a", None),
                                   ("PATCH", "/admin/tenants/a", {"rpm": 1}),
                                   ("POST", "/admin/keys", {"tenant": "a"})):
            r = await admin.request(method, path, json=body)
            assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found", r.text
        r = await admin.post("/admin/tenants", json={"name": "a"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "name"


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/admin/tenants"), ("PATCH", "/admin/tenants/a"), ("POST", "/admin/keys"),
    ("POST", "/admin/purge")])
async def test_admin_bodies_that_are_not_a_json_object_are_a_400_naming_body(
        sqlite_store: SQLStore, stub: StubUpstream, method: str, path: str) -> None:
    """Every admin route that takes a body answers as /v1 does (`load_json_object`):
    before, `xx` was "0: JSON decode error" with param "0", and `[1]` "None: Input
    should be a valid dictionary" with param null."""
    sqlite_store.create_tenant("a", TenantSettings())
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, ADMIN_KEY) as admin:
        for raw, message in ((b"xx", "the request body is not valid JSON"),
                             (b"", "the request body is not valid JSON"),
                             (b"[1]", "the request body must be a JSON object"),
                             (b'"a"', "the request body must be a JSON object"),
                             (b'{"a": ' * 200 + b"1" + b"}" * 200,
                              "the request body nests deeper than 100 levels"),
                             (b'{"name": "\\ud800"}', "the request body holds a lone UTF-16 surrogate")):
            r = await admin.request(method, path, content=raw,
                                    headers={"content-type": "application/json"})
            assert r.status_code == 400, (raw, r.text)
            error = r.json()["error"]
            assert error["param"] == "body" and error["type"] == "invalid_request_error"
            assert error["message"].startswith(message), error
    async with client_for(gw) as anonymous:  # the admin key is checked before the body
        assert (await anonymous.request(method, path, content=b"xx")).status_code == 401


@pytest.mark.parametrize(("method", "path", "field", "body"), [
    ("POST", "/admin/tenants", "rpm", {"name": "t10", "rpm": True}),  # was a tenant, rpm 1
    ("POST", "/admin/tenants", "tpm", {"name": "t10", "tpm": "50"}),
    ("POST", "/admin/tenants", "max_concurrent", {"name": "t10", "max_concurrent": 2.0}),
    ("POST", "/admin/tenants", "budget_usd", {"name": "t10", "budget_usd": False}),
    ("POST", "/admin/tenants", "soft_budget_usd", {"name": "t10", "soft_budget_usd": "1.5"}),
    ("POST", "/admin/tenants", "budget_usd", {"name": "t10", "budget_usd": float("nan")}),
    ("POST", "/admin/tenants", "store_bodies", {"name": "t10", "store_bodies": "yes"}),
    ("POST", "/admin/tenants", "name", {"name": 10}),
    ("PATCH", "/admin/tenants/a", "rpm", {"rpm": True}),
    ("PATCH", "/admin/tenants/a", "budget_usd", {"budget_usd": float("inf")}),
    ("POST", "/admin/keys", "tpm", {"tenant": "a", "tpm": True}),
    ("POST", "/admin/keys", "rpm", {"tenant": "a", "rpm": "5"}),
    ("POST", "/admin/keys", "allowed_models.0", {"tenant": "a", "allowed_models": [1]}),
    ("POST", "/admin/purge", "older_than_days", {"older_than_days": True}),
    ("POST", "/admin/purge", "older_than_days", {"older_than_days": "30"}),
])
async def test_admin_fields_are_strict(sqlite_store: SQLStore, stub: StubUpstream, method: str,
                                       path: str, field: str, body: dict[str, object]) -> None:
    """Booleans and numeric strings are not numbers: a 400 naming the field, and nothing
    is created or changed."""
    sqlite_store.create_tenant("a", TenantSettings(rpm=7))
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, ADMIN_KEY) as admin:
        r = await admin.request(method, path, content=json.dumps(body).encode())
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        assert r.json()["error"]["message"].startswith(f"{field}: ")
        r = await admin.post("/admin/tenants", json={"name": "ok", "rpm": 3, "budget_usd": 2})
        assert r.status_code == 201 and (r.json()["rpm"], r.json()["budget_usd"]) == (3, 2.0)
    assert [t.name for t in sqlite_store.list_tenants()] == ["a", "ok"]
    assert sqlite_store.get_tenant("a").settings.rpm == 7
    assert sqlite_store.list_keys() == []


async def test_tenant_never_sees_another_tenants_usage(sqlite_store: SQLStore,
                                                       stub: StubUpstream) -> None:
    key_a = new_key(sqlite_store, tenant="A")
    key_b = new_key(sqlite_store, tenant="B")
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    for key, n in ((key_a, 2), (key_b, 3)):
        async with client_for(gw, key) as c:
            for _ in range(n):
                assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    tenant_b = sqlite_store.get_tenant("B")
    async with client_for(gw, key_a) as c:
        mine = (await c.get("/v1/usage")).json()
        assert mine["totals"]["requests"] == 2
        assert {r["tenant_id"] for r in mine["data"]} == {sqlite_store.get_tenant("A").id}
        r = await c.get("/v1/usage", params={"tenant": tenant_b.id})
        assert r.status_code == 403
        assert (await c.get("/admin/usage")).status_code == 401
    async with client_for(gw, ADMIN_KEY) as admin:
        assert (await admin.get("/admin/usage")).json()["totals"]["requests"] == 5
        r = await admin.get("/admin/usage", params={"tenant": "B"})
        assert r.json()["totals"]["requests"] == 3
        r = await admin.post("/admin/purge", json={"older_than_days": 1})
        assert r.json() == {"deleted": 0}  # all records are fresh
        r = await admin.post("/admin/purge", json={"older_than_days": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "older_than_days"


async def test_concurrent_spend_equals_ledger_sum(sqlite_store: SQLStore,
                                                  stub: StubUpstream) -> None:
    prices = PriceTable({"stub-model": Price(1_000_000.0, 2_000_000.0)})
    key = new_key(sqlite_store)
    gw = GatewayMiddleware(stub, make_state(sqlite_store, prices=prices))
    async with client_for(gw, key) as c:
        rs = await asyncio.gather(*[c.post("/v1/chat/completions", json=CHAT) for _ in range(30)])
    assert {r.status_code for r in rs} == {200}
    records = sqlite_store.query_usage(UsageQuery())
    assert len(records) == 30 and len({r.request_id for r in records}) == 30
    assert sqlite_store.get_tenant("acme").spend_usd == pytest.approx(
        sum(r.cost_usd for r in records)) == pytest.approx(30 * 17.0)


async def test_settlement_off_the_critical_path_is_still_written_exactly_once(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """Without a budget nothing at admission reads the ledger: the commit happens just
    after the response; a budgeted tenant's still happens first."""
    free = new_key(sqlite_store, tenant="free", rpm=100, tpm=10**6)
    budgeted = new_key(sqlite_store, tenant="budgeted", budget_usd=100.0)
    state = make_state(sqlite_store, await_ledger=False)
    gw = GatewayMiddleware(stub, state)
    async with client_for(gw, budgeted) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert len(sqlite_store.query_usage(UsageQuery())) == 1  # written before the reply
    async with client_for(gw, free) as c:
        rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=CHAT) for _ in range(20)))
        assert all(r.status_code == 200 for r in rs)
    await state.flush()
    records = sqlite_store.query_usage(UsageQuery())
    assert len(records) == 21 and len({r.request_id for r in records}) == 21
    assert sum(r.completion_tokens for r in records) == 21 * 5
    assert not state.background


class RawUpstream:
    """Keeps the exact bytes each request's body arrived with; answers a tiny JSON."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"usage": {"prompt_tokens": 1, '
                    b'"completion_tokens": 1}}'})


@pytest.mark.parametrize(("sent", "forwarded"), [
    # nothing to change: the client's bytes, spacing and all
    (b'{ "model":"m",  "messages":[{"role":"user","content":"hi \\u00e9"}], "priority": 1 }',
     b'{ "model":"m",  "messages":[{"role":"user","content":"hi \\u00e9"}], "priority": 1 }'),
    # no priority: none added (the class goes as x-sluice-priority, which a worker under
    # fcfs ignores, where it refuses a priority in the body as vLLM does)
    (b'{"model":"m","messages":[{"role":"user","content":"hi"}]}\n',
     b'{"model":"m","messages":[{"role":"user","content":"hi"}]}\n'),
    # stream_options sent without include_usage: re-encoded
    (b'{"model":"m","messages":[],"stream":true,"stream_options":{},"priority":1}',
     b'{"model": "m", "messages": [], "stream": true, "stream_options": '
     b'{"include_usage": true}, "priority": 1}'),
])
async def test_body_is_forwarded_as_sent_unless_policy_changes_it(
        sqlite_store: SQLStore, sent: bytes, forwarded: bytes) -> None:
    upstream = RawUpstream()
    gw = GatewayMiddleware(upstream, make_state(sqlite_store))
    async with client_for(gw, new_key(sqlite_store)) as client:
        r = await client.post("/v1/chat/completions", content=sent,
                              headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert upstream.bodies == [forwarded]


async def test_usage_queries_out_of_range_are_400s_naming_the_parameter(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """A `limit` past 64 bits was a 500 from SQLite (found by the reliability fuzz)."""
    key = new_key(sqlite_store, tenant="A")
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, key) as c:
        for params, param in (({"limit": 10**30}, "limit"), ({"limit": 0}, "limit"),
                              ({"since": "nan"}, "since"), ({"until": "inf"}, "until")):
            r = await c.get("/v1/usage", params=params)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert (await c.get("/v1/usage", params={"limit": 100_000})).status_code == 200
    async with client_for(gw, ADMIN_KEY) as admin:
        r = await admin.get("/admin/usage", params={"limit": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


async def test_usage_since_and_until_take_what_the_cli_takes(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """`since=24h` or an ISO time was a 400 ("Input should be a valid number") on
    /v1/usage and /admin/usage while `sluice usage --since 24h` took it: the routes
    now read them with the CLI's own parser (`parse_time`)."""
    key = new_key(sqlite_store, tenant="A")
    principal = sqlite_store.authenticate(key)
    assert principal is not None
    for request_id, ts in (("old", 1704067200.0 - 3600), ("new", None)):
        record = UsageRecord(request_id=request_id, tenant_id=principal.tenant.id,
                             key_id=principal.key.id, endpoint="/v1/completions",
                             model="m", status="ok", http_status=200)
        sqlite_store.record_usage(record if ts is None else replace(record, ts=ts))
    gw = GatewayMiddleware(stub, make_state(sqlite_store))

    async def ids(client: Any, path: str, **params: str) -> list[str]:
        r = await client.get(path, params=params)
        assert r.status_code == 200, r.text
        return [row["request_id"] for row in r.json()["data"]]

    async with client_for(gw, key) as c, client_for(gw, ADMIN_KEY) as admin:
        for client, path in ((c, "/v1/usage"), (admin, "/admin/usage")):
            assert await ids(client, path, since="1h") == ["new"]
            assert await ids(client, path, until="30m") == ["old"]
            assert await ids(client, path, since="2024-01-01T00:00:00+00:00") == ["new"]
            assert await ids(client, path, until="2024-01-01T00:00:00+00:00") == ["old"]
            assert await ids(client, path, since="0", until="1d") == ["old"]
            for name in ("since", "until"):
                r = await client.get(path, params={name: "1x"})
                error = r.json()["error"]
                assert r.status_code == 400 and error["param"] == name, r.text
                assert "24h" in error["message"], error


async def test_usage_and_admin_routes_refuse_query_parameters_they_do_not_take(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """`/v1/usage?start_date=...` (LiteLLM's spelling) answered every record, unfiltered;
    now an unknown query parameter is a 400 naming it, after the key is checked."""
    key = new_key(sqlite_store, tenant="A")
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, key) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        r = await c.get("/v1/usage", params={"start_date": "2026-12-01", "limit": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "start_date", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert (await c.get("/v1/usage", params={"key": "x", "since": 0, "until": 1e12,
                                                 "limit": 5})).status_code == 200
    async with client_for(gw) as anonymous:
        assert (await anonymous.get("/v1/usage", params={"x": 1})).status_code == 401
    async with client_for(gw, ADMIN_KEY) as admin:
        for path, param in (("/admin/usage", "tenant_id"), ("/admin/keys", "team_id"),
                            ("/admin/tenants", "limit"), ("/admin/tenants/A", "x")):
            r = await admin.get(path, params={param: "A"})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
        assert (await admin.get("/admin/usage", params={"tenant": "A"})).status_code == 200
        assert (await admin.get("/admin/keys", params={"tenant": "A"})).status_code == 200
        r = await admin.post("/admin/purge", params={"dry_run": 1}, json={"older_than_days": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dry_run"
    async with client_for(gw, "wrong") as wrong:
        assert (await wrong.get("/admin/usage", params={"x": 1})).status_code == 401


async def test_usage_totals_count_every_record_of_the_window_with_has_more(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """`totals` summed only the `limit` rows returned; they now cover the whole query,
    and `has_more` says that rows were left out."""
    key = new_key(sqlite_store, tenant="A")
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, key) as c:
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        page = (await c.get("/v1/usage", params={"limit": 2})).json()
        assert len(page["data"]) == 2 and page["has_more"] is True
        assert page["totals"] == {"requests": 3, "prompt_tokens": 3 * PROMPT_TOKENS,
                                  "completion_tokens": 15, "cost_usd": 0.0}
        assert (await c.get("/v1/usage")).json()["has_more"] is False
    async with client_for(gw, ADMIN_KEY) as admin:
        page = (await admin.get("/admin/usage", params={"tenant": "A", "limit": 1})).json()
        assert page["totals"]["requests"] == 3 and page["has_more"] is True


class TrailingEmptyUpstream:
    """Sends a JSON answer the way the `--upstream` proxy does: every byte with
    `more_body`, then an empty last message, which the first request holds back until
    `release` is set (the client has its whole answer, by content-length, before)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        self.calls += 1
        body = json.dumps({"model": "stub-model", "usage": {"prompt_tokens": 3,
                                                            "completion_tokens": 2}}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body[:10], "more_body": True})
        await send({"type": "http.response.body", "body": body[10:], "more_body": True})
        if self.calls == 1:
            await self.release.wait()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_settles_once_the_content_length_is_sent_before_a_trailing_empty_message(
        sqlite_store: SQLStore) -> None:
    """Under `sluice gateway --upstream` a JSON answer ended with an empty message after
    its last bytes, and the slot, the tokens and a budgeted tenant's ledger row were
    settled only then: a client with `max_concurrent: 1` that sent its next request
    once it had the answer got a 429, and the spend was not yet there to read."""
    import httpx

    from .conftest import serve

    key = new_key(sqlite_store, max_concurrent=1, budget_usd=10.0)
    upstream = TrailingEmptyUpstream()
    state = make_state(sqlite_store, await_ledger=False, prices=PriceTable(
        {"stub-model": Price(input_per_million=1e5, output_per_million=1e5)}))
    gw = GatewayMiddleware(upstream, state)
    headers = {"Authorization": f"Bearer {key}"}
    async with serve(gw) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10, headers=headers) as c:
            first = await c.post("/v1/chat/completions", json=CHAT)
        assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 2
        assert sqlite_store.get_tenant("acme").spend_usd == pytest.approx(0.5)
        # the next request on a connection of its own (one connection waits for the first
        # answer's end: the server reads nothing more on it until then)
        async with httpx.AsyncClient(base_url=url, timeout=10, headers=headers) as c:
            second = await c.post("/v1/chat/completions", json=CHAT)
        upstream.release.set()
        assert second.status_code == 200, second.text
    records = sqlite_store.query_usage(UsageQuery())
    assert [(r.status, r.prompt_tokens, r.completion_tokens) for r in records] == [
        ("ok", 3, 2), ("ok", 3, 2)]
    assert sqlite_store.get_tenant("acme").reserved_usd == pytest.approx(0.0)


@pytest.mark.parametrize(("tenant", "key", "named"), [
    ({"rpm": 0}, KeySettings(), "Its tenant's requests per minute (RPM) limit is 0"),
    ({"max_concurrent": 0}, KeySettings(rpm=5), "Its tenant's concurrent requests limit is 0"),
    ({"rpm": 9}, KeySettings(rpm=0), "This key's requests per minute (RPM) limit is 0"),
])
async def test_a_limit_of_zero_is_a_429_that_says_not_to_retry(
        sqlite_store: SQLStore, stub: StubUpstream, tenant: dict[str, int], key: KeySettings,
        named: str) -> None:
    """A limit of 0 (a paused key or tenant) admits nothing, now or later; its 429 had
    `Retry-After: 60` (1 for concurrency), so the OpenAI and Anthropic SDKs waited and
    retried in vain. Like a request over the TPM limit alone: no Retry-After,
    `x-should-retry: false`, a message that says which limit."""
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, new_key(sqlite_store, key_settings=key, **tenant)) as c:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/messages", {
                "model": "stub-model", "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}]})):
            r = await c.post(path, json=body)
            assert r.status_code == 429 and "retry-after" not in r.headers, r.headers
            assert r.headers["x-should-retry"] == "false"
            assert named in r.text
    assert stub.received == []


async def test_an_embeddings_input_that_is_not_text_or_ids_is_a_400_naming_input(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """The prompt counter's error named `prompt`, a field an embeddings body lacks."""
    gw = GatewayMiddleware(stub, make_state(sqlite_store))
    async with client_for(gw, new_key(sqlite_store)) as c:
        for bad in ({"a": 1}, 5, [1.5], [["x"]]):
            r = await c.post("/v1/embeddings", json={"model": "stub-model", "input": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        for good in ("hello", ["a", "b"], [1, 2], [[1], [2, 3]]):
            r = await c.post("/v1/embeddings", json={"model": "stub-model", "input": good})
            assert r.status_code == 404  # passed on: the stub serves no embeddings
    statuses = [r.status for r in sqlite_store.query_usage(UsageQuery())]
    assert statuses == ["rejected"] * 4 + ["error"] * 4


async def test_score_and_rerank_count_their_texts_and_name_them(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """/v1/score and /v1/rerank reserve no completion: their texts are the prompt, a bad
    one a 400 naming its field, too many tokens for the TPM limit a 429 naming it."""
    state = make_state(sqlite_store)
    gw = GatewayMiddleware(stub, state)
    docs = ["a river runs to the sea " * 4] * 3
    counted = state.count_prompt_tokens("stub-model", {"prompt": ["rivers", *docs]})
    async with client_for(gw, new_key(sqlite_store, tpm=counted - 1)) as c:
        for path, body, param in (("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
                                  ("/v1/score", {"text_1": 3, "text_2": "b"}, "text_1"),
                                  ("/v1/rerank", {"query": ["q"], "documents": ["d"]}, "query"),
                                  ("/v1/rerank", {"query": "q", "documents": "d"}, "documents")):
            r = await c.post(path, json={"model": "stub-model", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
        r = await c.post("/v1/rerank", json={"model": "stub-model", "query": "rivers",
                                             "documents": docs})
        assert r.status_code == 429 and r.json()["error"]["param"] == "documents", r.text
        assert f"Requested {counted}. The request alone (its input)" in r.text
        r = await c.post("/v1/score", json={"model": "stub-model", "text_1": "rivers",
                                            "text_2": docs[:1]})
        assert r.status_code == 404  # admitted and passed on: the stub serves no scores
        assert r.headers["x-ratelimit-remaining-tokens"] == str(  # its texts reserved
            counted - 1 - state.count_prompt_tokens("stub-model",
                                                    {"prompt": ["rivers", docs[0]]}))
    rows = sqlite_store.query_usage(UsageQuery())
    assert [(x.endpoint, x.status) for x in rows][-2:] == [
        ("/v1/rerank", "rejected"), ("/v1/score", "error")]


async def test_classify_counts_its_input_on_both_paths(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """vLLM's `/classify` (and `/v1/classify`): a key is needed outside `/v1/` too; its
    `input` is the prompt, as embeddings' is (a bad one a 400 naming `input`), no
    completion reserved; each request passed on and recorded under its own path."""
    state = make_state(sqlite_store)
    gw = GatewayMiddleware(stub, state)
    counted = state.count_prompt_tokens("stub-model", {"prompt": ["a river runs"]})
    async with client_for(gw) as anonymous:
        r = await anonymous.post("/classify", json={"model": "stub-model", "input": "a"})
        assert r.status_code == 401 and stub.received == []
    async with client_for(gw, new_key(sqlite_store, tpm=10 * counted)) as c:
        for path in ("/classify", "/v1/classify"):
            r = await c.post(path, json={"model": "stub-model", "input": {"a": 1}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
            r = await c.post(path, json={"model": "stub-model", "input": "a river runs"})
            assert r.status_code == 404  # admitted and passed on: the stub classifies nothing
            assert r.headers["x-ratelimit-remaining-tokens"] == str(9 * counted)
    rows = sqlite_store.query_usage(UsageQuery())
    assert [(x.endpoint, x.status) for x in rows] == [
        ("/classify", "rejected"), ("/classify", "error"),
        ("/v1/classify", "rejected"), ("/v1/classify", "error")]


async def test_pooling_and_chat_form_embeddings_are_admitted_and_counted(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """vLLM's `/pooling` needs a key as `/classify` does and counts its `input`; the chat
    form of `/v1/embeddings` (`messages`, no `input`) counts its conversation, as a chat
    request's prompt is counted (not as an empty input)."""
    state = make_state(sqlite_store)
    gw = GatewayMiddleware(stub, state)
    messages = [{"role": "user", "content": "a river runs to the sea"}]
    chat = state.count_prompt_tokens("stub-model", {"messages": messages})
    text = state.count_prompt_tokens("stub-model", {"prompt": ["a river runs"]})
    assert chat > 2 and text > 0
    async with client_for(gw) as anonymous:
        r = await anonymous.post("/pooling", json={"model": "stub-model", "input": "a"})
        assert r.status_code == 401 and stub.received == []
    budget = 10 * text
    async with client_for(gw, new_key(sqlite_store, tpm=budget)) as c:
        r = await c.post("/pooling", json={"model": "stub-model", "input": "a river runs",
                                           "task": "token_embed"})
        assert r.status_code == 404  # admitted and passed on: the stub pools nothing
        assert r.headers["x-ratelimit-remaining-tokens"] == str(budget - text)
    async with client_for(gw, new_key(sqlite_store, "small", tpm=chat - 1)) as c:
        r = await c.post("/v1/embeddings", json={"model": "stub-model", "messages": messages})
        assert r.status_code == 429, r.text  # its turns counted: more than the key's minute
        r = await c.post("/v1/embeddings", json={"model": "stub-model", "input": "a"})
        assert r.status_code == 404, r.text  # a short input fits: admitted and passed on
