"""The Responses API's `background` mode, run by the gateway in front of a real sluice
worker (tiny random Llama): answered `queued` at once, polled to its end, cancelled,
refused where it cannot be kept, and failed when the gateway stops (gateway/responses.py,
`Exchange.run_in_background`); runs whose replica is gone, ended by a read or by
another replica's sweep, with their ledger row (once, whoever writes it first)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.pricing import Price, PriceTable
from sluice.gateway.state import GatewayState
from sluice.gateway.store import RunAdmission, SQLStore, StoredResponse, UsageQuery, UsageRecord
from sluice.gateway.tokens import PromptTokenCounter
from sluice.protocol.responses import sse

from .conftest import PG_URL, client_for, make_state, new_key

TURN = {"model": "tiny", "max_output_tokens": 6, "temperature": 0, "input": "Count to ten."}


def gateway(engine: Any, store: SQLStore, counter: PromptTokenCounter) -> GatewayMiddleware:
    from sluice.worker.app import build_app
    from sluice.worker.config import WorkerConfig

    return GatewayMiddleware(build_app(engine, WorkerConfig(served_model_names=("tiny",))),
                             make_state(store, count=counter))


async def until_ended(c: httpx.AsyncClient, response_id: str) -> dict[str, Any]:
    for _ in range(600):  # bounded: 60 s
        got = (await c.get(f"/v1/responses/{response_id}")).json()
        if got["status"] not in ("queued", "in_progress"):
            return got  # type: ignore[no-any-return]
        await asyncio.sleep(0.1)
    raise AssertionError(f"{response_id} still running")


async def test_a_background_response_is_queued_then_polled_to_its_end(
        engine: Any, counter: PromptTokenCounter, sqlite_store: SQLStore) -> None:
    gw = gateway(engine, sqlite_store, counter)
    async with client_for(gw, new_key(sqlite_store)) as c:
        foreground = (await c.post("/v1/responses", json=TURN)).json()
        r = await c.post("/v1/responses", json={**TURN, "background": True})
        assert r.status_code == 200, r.text
        queued = r.json()
        assert queued["status"] == "queued" and queued["background"] is True
        assert queued["store"] is True and queued["output"] == [] and queued["usage"] is None
        done = await until_ended(c, queued["id"])
        assert done["id"] == queued["id"] and done["background"] is True
        assert done["status"] == foreground["status"] == "incomplete"  # 6 tokens
        assert done["output"][0]["content"][0]["text"] == \
            foreground["output"][0]["content"][0]["text"]
        assert [done["usage"][k] for k in ("input_tokens", "output_tokens")] == \
            [foreground["usage"][k] for k in ("input_tokens", "output_tokens")]
        await gw.state.flush()
        records = [x for x in sqlite_store.query_usage(UsageQuery())
                   if x.endpoint == "/v1/responses"]
        assert len(records) == 2 and records[1].record_id == queued["id"]  # (Turn.record_id)
        assert records[0].record_id != foreground["id"]
        # cancelling one that has ended answers it as it is
        r = await c.post(f"/v1/responses/{queued['id']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "incomplete"
        # a foreground one cannot be cancelled
        r = await c.post(f"/v1/responses/{foreground['id']}/cancel")
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    await gw.state.flush()
    records = [x for x in sqlite_store.query_usage(UsageQuery()) if x.endpoint == "/v1/responses"]
    assert [x.status for x in records] == ["ok", "ok"]
    assert records[1].completion_tokens == done["usage"]["output_tokens"]


async def test_a_background_response_is_cancelled(engine: Any, counter: PromptTokenCounter,
                                                  sqlite_store: SQLStore) -> None:
    """A long background response, cancelled: its run stops (the ledger records it
    `aborted`, short of its max_output_tokens), and it is kept `cancelled`; through the
    OpenAI SDK's `responses.create(background=True)`, `.retrieve` and `.cancel`."""
    gw = gateway(engine, sqlite_store, counter)
    key = new_key(sqlite_store)
    client = openai.AsyncOpenAI(
        base_url="http://gateway/v1", api_key=key, max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=gw), timeout=30))
    queued = await client.responses.create(**{**TURN, "max_output_tokens": 900},
                                           background=True)
    assert queued.status == "queued"
    await asyncio.sleep(0.2)
    metrics = gw.state.metrics.render().decode()
    assert "sluice_gateway_background_responses 1.0" in metrics
    assert (await client.responses.retrieve(queued.id)).status == "in_progress"  # begun
    cancelled = await client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.id == queued.id, cancelled.error
    assert (await client.responses.retrieve(queued.id)).status == "cancelled"
    await gw.state.flush()
    [record] = [x for x in sqlite_store.query_usage(UsageQuery())
                if x.endpoint == "/v1/responses"]
    assert record.status == "aborted" and 0 < record.completion_tokens < 900  # as streamed
    assert gw.state.responses.running == {}
    assert "sluice_gateway_background_responses 0.0" in gw.state.metrics.render().decode()


async def test_background_is_refused_where_it_cannot_be_kept(
        engine: Any, counter: PromptTokenCounter, sqlite_store: SQLStore) -> None:
    gw = gateway(engine, sqlite_store, counter)
    mine, theirs = new_key(sqlite_store, "acme"), new_key(sqlite_store, "other")
    async with client_for(gw, mine) as c:
        for extra, param in (({"store": False}, "background"),
                             ({"background": "yes"}, "background"),
                             ({"max_output_tokens": 0}, "max_output_tokens"),
                             ({"include": ["x"]}, "include"), ({"ignore_eos": True}, "ignore_eos")):
            r = await c.post("/v1/responses", json={**TURN, "background": True, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        queued = (await c.post("/v1/responses", json={**TURN, "background": True})).json()
    async with client_for(gw, theirs) as c:  # another tenant's: not found, not cancelled
        assert (await c.post(f"/v1/responses/{queued['id']}/cancel")).status_code == 404
    async with client_for(gw, mine) as c:
        assert (await until_ended(c, queued["id"]))["status"] == "incomplete"
        # what only the worker finds wrong (here: longer than the context) fails the
        # response, with the worker's error
        r = await c.post("/v1/responses", json={**TURN, "max_output_tokens": 5000,
                                                "background": True})
        assert r.status_code == 200 and r.json()["status"] == "queued"
        failed = await until_ended(c, r.json()["id"])
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "context_length_exceeded"


async def test_a_gateway_that_stops_fails_its_background_responses(
        engine: Any, counter: PromptTokenCounter, sqlite_store: SQLStore) -> None:
    gw = gateway(engine, sqlite_store, counter)
    async with client_for(gw, new_key(sqlite_store)) as c:
        queued = (await c.post("/v1/responses", json={
            **TURN, "max_output_tokens": 900, "background": True})).json()
        await asyncio.sleep(0.2)
        await gw.state.responses.stop()
        failed = (await c.get(f"/v1/responses/{queued['id']}")).json()
    assert failed["status"] == "failed" and "stopped" in failed["error"]["message"]
    await gw.state.flush()
    [record] = [x for x in sqlite_store.query_usage(UsageQuery())
                if x.endpoint == "/v1/responses"]
    assert record.status == "aborted"


def test_the_store_keeps_a_runs_replica_and_lease(any_store: SQLStore) -> None:
    """A running background response names its replica (`owner`) and lease; the replica
    renews it and hears of a cancel asked elsewhere; a lapsed one is ended only as it
    was read (a renewal or an end meanwhile wins)."""
    new_key(any_store, "acme")
    now = time.time()
    running = StoredResponse("resp_1", "acme", "k", None, [], {"status": "in_progress"},
                             created_at=now, expires_at=now + 60, owner="gw-a",
                             lease_until=now + 10)
    any_store.save_response(running)
    assert any_store.get_response("resp_1", "acme") == running
    assert any_store.renew_runs("gw-a", now + 20) == []
    assert any_store.get_response("resp_1", "acme").lease_until == now + 20  # type: ignore[union-attr]
    assert not any_store.ask_cancel("resp_1", "other")  # another tenant's
    assert not any_store.ask_cancel("resp_nope", "acme")
    assert any_store.ask_cancel("resp_1", "acme")
    assert any_store.renew_runs("gw-b", now + 20) == []  # another replica's runs
    assert any_store.renew_runs("gw-a", now + 30) == ["resp_1"]
    ended = {"status": "failed", "error": {"code": "server_error", "message": "gone"}}
    assert not any_store.end_orphan(running, ended)  # renewed since it was read
    read = any_store.get_response("resp_1", "acme")
    assert read is not None and any_store.end_orphan(read, ended)
    after = any_store.get_response("resp_1", "acme")
    assert after is not None and after.response == ended
    assert after.owner is None and after.lease_until is None
    assert not any_store.ask_cancel("resp_1", "acme")  # no replica runs it now
    assert not any_store.end_orphan(read, {"status": "cancelled"})
    assert any_store.renew_runs("gw-a", now + 40) == []


def test_the_store_finds_the_runs_whose_lease_has_lapsed(any_store: SQLStore) -> None:
    """`lapsed_runs`: running responses of any tenant whose lease ended, oldest lease
    first, up to a limit; not the caller's own, not one renewed, ended or expired; each
    with what its ledger row needs (`admission`)."""
    new_key(any_store, "acme")
    new_key(any_store, "umbrella")
    now = time.time()

    def run(response_id: str, tenant: str, lease_until: float, owner: str | None = "gw-a",
            expires_at: float = now + 60) -> StoredResponse:
        stored = StoredResponse(response_id, any_store.get_tenant(tenant).id, "k", None, [],
                                {"status": "in_progress"}, created_at=now,
                                expires_at=expires_at, owner=owner, lease_until=lease_until,
                                admission=RunAdmission("req-" + response_id, 7, "rsv_1"))
        any_store.save_response(stored)
        return stored

    older = run("resp_older", "umbrella", now - 10)
    old = run("resp_old", "acme", now - 5)
    run("resp_renewed", "acme", now + 10)
    run("resp_mine", "acme", now - 20, owner="gw-me")
    run("resp_expired", "acme", now - 20, expires_at=now - 1)
    ended = run("resp_ended", "acme", now - 20)
    assert any_store.end_orphan(ended, {"status": "failed"})
    assert any_store.lapsed_runs(now, 10, "gw-me") == [older, old]
    assert any_store.lapsed_runs(now, 1, "gw-me") == [older]
    assert any_store.lapsed_runs(now - 30, 10, "gw-me") == []


def test_the_store_keeps_a_runs_events_until_its_response_goes(any_store: SQLStore) -> None:
    """Events of several runs in one write; one written again is skipped; expired ones
    are purged as a response is saved."""
    now = time.time()
    any_store.add_response_events([("resp_1", 0, "a"), ("resp_1", 1, "b"),
                                   ("resp_2", 0, "x")], now + 60)
    any_store.add_response_events([("resp_1", 1, "b"), ("resp_1", 2, "c")], now + 60)
    any_store.add_response_events([("resp_2", 1, "y")], now - 1)
    assert any_store.response_events("resp_1", -1, 10) == [(0, "a"), (1, "b"), (2, "c")]
    assert any_store.response_events("resp_1", 0, 1) == [(1, "b")]
    assert any_store.response_events("resp_1", 2, 10) == []
    assert any_store.last_response_event("resp_1") == 2
    assert any_store.last_response_event("resp_nope") == -1
    new_key(any_store, "acme")
    any_store.save_response(StoredResponse("resp_3", "acme", "k", None, [], {},
                                           created_at=now, expires_at=now + 60))
    assert any_store.response_events("resp_2", -1, 10) == [(0, "x")]
    assert any_store.response_events("resp_1", -1, 10) != []


@pytest.fixture
def second_store(any_store: SQLStore) -> Any:
    """Another connection to `any_store`'s database, as a second gateway replica has."""
    if any_store.engine.dialect.name == "sqlite":
        other = SQLStore(any_store.engine.url.render_as_string(hide_password=False))
    else:
        other = SQLStore(PG_URL, table_prefix=any_store.tenants.name.removesuffix("tenants"))
    yield other
    other.close()


async def test_a_background_response_is_cancelled_through_another_replica(
        engine: Any, counter: PromptTokenCounter, any_store: SQLStore,
        second_store: SQLStore) -> None:
    """Two gateway replicas on one database: a run on one is seen running through the
    other (its lease renewed, not lapsed), and cancelled through it: the owner hears of
    it at its next renewal, stops the run (the ledger records it `aborted`, short of
    its max_output_tokens) and keeps it `cancelled`, which the other answers."""
    a, b = gateway(engine, any_store, counter), gateway(engine, second_store, counter)
    for gw in (a, b):
        gw.state.responses.lease_s, gw.state.responses.renew_s = 0.4, 0.1
    key = new_key(any_store)
    async with client_for(a, key) as on_a, client_for(b, key) as on_b:
        queued = (await on_a.post("/v1/responses", json={
            **TURN, "max_output_tokens": 900, "background": True})).json()
        await asyncio.sleep(0.5)  # past its first lease: renewed meanwhile
        assert (await on_b.get(f"/v1/responses/{queued['id']}")).json()["status"] \
            == "in_progress"
        asked = time.monotonic()
        r = await on_b.post(f"/v1/responses/{queued['id']}/cancel")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "cancelled" and r.json()["id"] == queued["id"]
        assert time.monotonic() - asked < 1.0
        assert (await on_a.get(f"/v1/responses/{queued['id']}")).json()["status"] \
            == "cancelled"
    assert a.state.responses.running == {}
    await a.state.flush()
    [record] = [x for x in any_store.query_usage(UsageQuery())
                if x.endpoint == "/v1/responses"]
    assert record.status == "aborted" and 0 < record.completion_tokens < 900
    assert record.record_id == queued["id"]  # (a row written for it elsewhere is this one)


async def test_a_background_responses_stream_is_followed_through_another_replica(
        engine: Any, counter: PromptTokenCounter, any_store: SQLStore,
        second_store: SQLStore) -> None:
    """A streamed run on one replica is taken up through the other, from the events its
    replica keeps in the store (every FLUSH_S): the same events, in order, to its end;
    and a foreground response has no stream to take up."""
    from .conftest import serve

    a, b = gateway(engine, any_store, counter), gateway(engine, second_store, counter)
    key = new_key(any_store)
    headers = {"Authorization": f"Bearer {key}"}
    body = {**TURN, "max_output_tokens": 300, "background": True, "stream": True}
    async with serve(a) as url, httpx.AsyncClient(base_url=url, headers=headers,
                                                  timeout=30) as on_a, \
            client_for(b, key) as on_b:
        seen = await three_events(on_a, body)
        run_id = seen[0]["response"]["id"]
        rest = await taken_up(on_b, seen)
        assert (await on_b.get(f"/v1/responses/{run_id}")).json() == rest[-1]["response"]
        foreground = (await on_b.post("/v1/responses", json=TURN)).json()
        r = await on_b.get(f"/v1/responses/{foreground['id']}", params={"stream": "true"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        # deleted with its response
        assert (await on_b.delete(f"/v1/responses/{run_id}")).status_code == 200
    assert any_store.response_events(run_id, -1, 10) == []


def leave_run(store: SQLStore, response_id: str, lease_until: float, *,
              status: str = "in_progress", owner: str = "gw-killed",
              deltas: tuple[str, ...] = (), admission: RunAdmission | None = None) -> None:
    """A running background response as a killed replica leaves it in the store: named
    its replica's (`owner`), its lease until `lease_until`, its stream kept as far as
    `response.created` and the text `deltas`."""
    now, tenant = time.time(), store.get_tenant("acme").id
    response = {"id": response_id, "object": "response", "status": status,
                "background": True, "model": "tiny", "usage": None}
    store.save_response(StoredResponse(
        response_id, tenant, "k", None, [], response, created_at=now, expires_at=now + 60,
        owner=owner, lease_until=lease_until,
        admission=admission or RunAdmission(f"req-{response_id}", 12)))
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": response},
        *({"type": "response.output_text.delta", "delta": d} for d in deltas)]
    store.add_response_events([(response_id, n, sse({**e, "sequence_number": n}))
                               for n, e in enumerate(events)], now + 60)


def words(model: str | None, body: dict[str, Any]) -> int:
    """A tokenizer of whole words: a count these tests can read off the text."""
    return len(str(body.get("prompt", "")).split())


def rows_of(store: SQLStore, response_id: str) -> list[UsageRecord]:
    return [x for x in store.query_usage(UsageQuery()) if x.record_id == response_id]


async def test_a_background_response_whose_replica_is_gone_is_ended_by_the_next_read(
        engine: Any, counter: PromptTokenCounter, sqlite_store: SQLStore) -> None:
    """Runs as a killed replica leaves them (running, their lease lapsed): the next GET
    ends one `failed`, saying why, and a cancel ends another `cancelled`, each with the
    ledger row its replica did not write; one whose lease is still renewed stays as it
    is. (tests/reliability kills a real replica.)"""
    gw = gateway(engine, sqlite_store, counter)
    key = new_key(sqlite_store)
    tenant, now = sqlite_store.get_tenant("acme").id, time.time()
    leave_run(sqlite_store, "resp_lapsed", now - 1)
    leave_run(sqlite_store, "resp_queued", now - 1, status="queued")
    leave_run(sqlite_store, "resp_renewed", now + 60)
    async with client_for(gw, key) as c:
        failed = (await c.get("/v1/responses/resp_lapsed")).json()
        assert failed["status"] == "failed", failed
        assert "stopped before it ended" in failed["error"]["message"]
        assert (await c.get("/v1/responses/resp_lapsed")).json() == failed  # kept
        r = await c.get("/v1/responses/resp_lapsed", params={"stream": "true"})
        assert r.status_code == 200  # its kept stream ends saying so
        assert events_of(r.text)[1:] == [{"type": "response.failed", "sequence_number": 1,
                                          "response": failed}]
        r = await c.post("/v1/responses/resp_queued/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        assert r.json()["error"] is None
        assert (await c.get("/v1/responses/resp_renewed")).json()["status"] == "in_progress"
    assert "sluice_gateway_background_responses_lost_total 2.0" in \
        gw.state.metrics.render().decode()
    [lapsed] = rows_of(sqlite_store, "resp_lapsed")
    [cancelled] = rows_of(sqlite_store, "resp_queued")
    assert (lapsed.status, lapsed.http_status, cancelled.status, cancelled.http_status) \
        == ("error", 200, "aborted", 499)
    assert (lapsed.request_id, lapsed.endpoint, lapsed.model, lapsed.prompt_tokens,
            lapsed.completion_tokens) == ("req-resp_lapsed", "/v1/responses", "tiny", 12, 0)
    assert rows_of(sqlite_store, "resp_renewed") == []

    def down(*_: Any) -> list[tuple[int, str]]:
        raise ConnectionError("the database is down")

    sqlite_store.response_events = down  # type: ignore[method-assign]
    async with client_for(gw, key) as c:  # a kept stream the store stops answering
        r = await c.get("/v1/responses/resp_lapsed", params={"stream": "true"})
    [error] = events_of(r.text)
    assert r.status_code == 200 and "unreachable" in error.pop("message")
    assert error == {"type": "error", "code": "response_store_unavailable", "param": None,
                     "sequence_number": 0}
    stored = sqlite_store.get_response("resp_lapsed", tenant)
    assert stored is not None and stored.owner is None


async def until(condition: Any, what: str) -> None:
    for _ in range(200):  # bounded: 10 s
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not {what} in 10 s")


async def sweeper(store: SQLStore, lease_s: float = 0.4) -> GatewayState:
    """A started gateway (no request reaches it) sweeping every `lease_s`, its prices
    $1 a million tokens in and $2 out, its tokenizer `words`."""
    from .conftest import make_state

    prices = PriceTable(default=Price(input_per_million=1.0, output_per_million=2.0))
    state = make_state(store, prices=prices, count=words)
    state.responses.lease_s, state.responses.renew_s = lease_s, lease_s / 4
    state.start()
    return state


async def test_a_run_nobody_reads_is_ended_by_another_replicas_sweep(
        any_store: SQLStore) -> None:
    """A run whose replica is gone and which nobody reads is ended `failed` by another
    replica's sweep (every lease) once its lease lapses: its kept stream ends with
    `response.failed`, and its ledger row is written as its replica would have (the
    request's id, its prompt as counted at admission, its kept output counted with the
    gateway's tokenizer, priced, its budget reservation given back in the same
    commit). A run whose lease is still renewed, and the sweeping replica's own, stay."""
    new_key(any_store)
    tenant = any_store.get_tenant("acme").id
    [reservation] = any_store.reserve_spend_many([(tenant, 0.5, 10.0)], 3600)
    state = await sweeper(any_store)
    try:
        now = time.time()  # (lapses after the first sweep, at start: a later one ends it)
        leave_run(any_store, "resp_gone", now + 0.3, deltas=("One, two,", " three four"),
                  admission=RunAdmission("req-7", 12, reservation))
        leave_run(any_store, "resp_renewed", now + 60)
        leave_run(any_store, "resp_own", now - 1, owner=state.responses.replica)
        # (the row is committed first, then the kept stream's last event: wait for both)
        await until(lambda: rows_of(any_store, "resp_gone")
                    and any_store.response_events("resp_gone", 2, 10), "swept")
        stored = any_store.get_response("resp_gone", tenant)
        assert stored is not None and stored.owner is None
        assert stored.response["status"] == "failed"
        assert "stopped before it ended" in stored.response["error"]["message"]
        [(number, last)] = any_store.response_events("resp_gone", 2, 10)
        assert number == 3 and json.loads(last.split("data: ")[1])["type"] == "response.failed"
        [row] = rows_of(any_store, "resp_gone")
        assert (row.request_id, row.tenant_id, row.key_id, row.endpoint, row.model) == \
            ("req-7", tenant, "k", "/v1/responses", "tiny")
        assert (row.status, row.http_status, row.prompt_tokens, row.completion_tokens) == \
            ("error", 200, 12, 4)
        assert row.cost_usd == pytest.approx((12 * 1.0 + 4 * 2.0) / 1e6)
        after = any_store.get_tenant(tenant)
        assert after.spend_usd == pytest.approx(row.cost_usd) and after.reserved_usd == 0
        for other in ("resp_renewed", "resp_own"):
            kept = any_store.get_response(other, tenant)
            assert kept is not None and kept.response["status"] == "in_progress"
        assert "sluice_gateway_background_responses_lost_total 1.0" in \
            state.metrics.render().decode()
    finally:
        await state.responses.stop()


async def test_a_lapsed_runs_row_lands_once_whoever_writes_it_first(
        any_store: SQLStore) -> None:
    """The race of a replica that wrote its run's ledger row, but not yet its end, as
    its lease lapsed: the sweep that ends the run writes its row under the same record
    id (the response's), and the ledger keeps the first, the owner's; an owner's row
    that comes after the sweep's (its spool, at its next start) is dropped the same
    way. Either way one row, whose cost the tenant's spend counts once."""
    new_key(any_store)
    tenant = any_store.get_tenant("acme").id

    def owners_row(response_id: str) -> UsageRecord:
        return UsageRecord(request_id=f"req-{response_id}", tenant_id=tenant, key_id="k",
                           endpoint="/v1/responses", model="tiny", status="ok",
                           http_status=200, prompt_tokens=12, completion_tokens=30,
                           cost_usd=0.25, record_id=response_id)

    now = time.time()
    leave_run(any_store, "resp_written", now - 1, deltas=("a b",))
    any_store.record_usage_many([owners_row("resp_written")])  # then its replica died
    leave_run(any_store, "resp_late", now - 1, deltas=("a b",))
    state = await sweeper(any_store)
    try:
        await until(lambda: all(rows_of(any_store, r) and any_store.get_response(r, tenant)
                                .response["status"] == "failed"  # type: ignore[union-attr]
                                for r in ("resp_written", "resp_late")), "swept")
        any_store.record_usage_many([owners_row("resp_late")])  # after the sweep's
        [written] = rows_of(any_store, "resp_written")
        [late] = rows_of(any_store, "resp_late")
        assert (written.status, written.completion_tokens) == ("ok", 30)  # the owner's
        assert (late.status, late.completion_tokens) == ("error", 2)  # the sweep's
        assert any_store.get_tenant(tenant).spend_usd == \
            pytest.approx(0.25 + late.cost_usd)
        assert "sluice_gateway_background_responses_lost_total 2.0" in \
            state.metrics.render().decode()
    finally:
        await state.responses.stop()


def events_of(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def three_events(c: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed background request's first three events (the client then leaves)."""
    seen: list[dict[str, Any]] = []
    async with c.stream("POST", "/v1/responses", json=body) as s:
        async for line in s.aiter_lines():
            if line.startswith("data: {"):
                seen.append(json.loads(line[6:]))
            if len(seen) == 3:
                break
    return seen


async def taken_up(c: httpx.AsyncClient, seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rest of the run's stream, taken up after the second event `seen`: it goes on
    with the third, numbered on, to its end event."""
    r = await c.get(f"/v1/responses/{seen[0]['response']['id']}",
                    params={"stream": "true", "starting_after": seen[1]["sequence_number"]})
    assert r.status_code == 200, r.text
    rest = events_of(r.text)
    assert rest[0] == seen[2]
    numbers = [e["sequence_number"] for e in seen[:2] + rest]
    assert numbers == list(range(len(numbers)))
    assert rest[-1]["type"] in ("response.completed", "response.incomplete")
    return rest


async def test_a_streamed_background_response_is_followed_and_taken_up_again(
        engine: Any, counter: PromptTokenCounter, sqlite_store: SQLStore) -> None:
    """`background` with `stream`: the client follows the run's events; one that leaves
    takes the stream up again with `GET ...?stream=true&starting_after=N`, from the
    next event on; the run never waits for either (a real server, so a client can
    leave mid-stream)."""
    from .conftest import serve

    gw = gateway(engine, sqlite_store, counter)
    key = new_key(sqlite_store)
    async with serve(gw) as url, httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        r = await c.post("/v1/responses", json={**TURN, "background": True, "stream": True})
        whole = events_of(r.text)
        assert whole[-1]["type"] == "response.incomplete"
        final = whole[-1]["response"]
        assert final["background"] is True and final["id"].startswith("resp_")
        assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
        assert (await c.get(f"/v1/responses/{final['id']}")).json()["status"] == "incomplete"
        await asyncio.sleep(0.1)  # (its last events to the store)
        r = await c.get(f"/v1/responses/{final['id']}", params={"stream": "true"})
        assert r.status_code == 200, r.text  # it ended: the store's events, all of them
        assert events_of(r.text) == whole
        r = await c.get(f"/v1/responses/{final['id']}",
                        params={"stream": "true", "starting_after": len(whole) - 3})
        assert events_of(r.text) == whole[-2:]

        # a long one: leave after three events, take it up after the second
        body = {**TURN, "max_output_tokens": 300, "background": True, "stream": True}
        seen = await three_events(c, body)
        run_id = seen[0]["response"]["id"]
        rest = await taken_up(c, seen)
        kept = (await c.get(f"/v1/responses/{run_id}")).json()
        assert kept["status"] == rest[-1]["response"]["status"]
        for params, status in (({"stream": "true", "starting_after": "x"}, 400),
                               ({"stream": "true"}, 404)):
            r = await c.get("/v1/responses/resp_nope" if status == 404 else
                            f"/v1/responses/{run_id}", params=params)
            assert r.status_code == status, r.text
        # a run the worker refuses: its stream ends with response.failed
        r = await c.post("/v1/responses", json={**body, "max_output_tokens": 5000})
        failed = events_of(r.text)
        assert failed[-1]["type"] == "response.failed"
        assert failed[-1]["response"]["error"]["code"] == "context_length_exceeded"
