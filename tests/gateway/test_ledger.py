"""The usage ledger's writes: group commit, idempotent re-writes, records kept and retried
while the database is down, the bounded buffer, and shutdown. On SQLite and PostgreSQL.

An outage is made where SQLAlchemy meets the driver: a hook raises the driver's own
`OperationalError` before each statement, which is what a refused or broken connection
raises, so the store's classification of it is exercised too (and the admin API's).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sluice.gateway.config import GatewayConfig
from sluice.gateway.ledger import LedgerWriter
from sluice.gateway.limits import LocalLimiter
from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.spool import LedgerSpool
from sluice.gateway.state import GatewayState
from sluice.gateway.store import (
    RunAdmission,
    SQLStore,
    StoredResponse,
    TenantSettings,
    UsageQuery,
    UsageRecord,
)
from sluice.protocol.errors import ServiceUnavailableError

from .conftest import CHAT, PG_URL, client_for, new_key
from .stub import StubUpstream


def rec(tenant_id: str, i: int, cost: float = 0.5, **changes: Any) -> UsageRecord:
    return UsageRecord(**{"request_id": f"r{i}", "tenant_id": tenant_id, "key_id": "k",
                          "endpoint": "/v1/completions", "model": "m", "status": "ok",
                          "http_status": 200, "cost_usd": cost, **changes})


class Outage:
    """Makes `store`'s database unreachable while `down` is set (every statement fails
    as a refused connection does): through SQLAlchemy, and on the ledger's own DBAPI
    connection (`SQLStore._record_on_ledger_connection`), dropped as a broken one is,
    whose reconnection is refused."""

    def __init__(self, store: SQLStore) -> None:
        self._down = False
        self.store = store
        self.error = store.engine.dialect.dbapi.OperationalError  # type: ignore[union-attr]
        sa.event.listen(store.engine, "before_cursor_execute", self._check)
        connect = store.engine.raw_connection

        def raw_connection() -> Any:
            self._check()
            return connect()

        store.engine.raw_connection = raw_connection  # type: ignore[method-assign]

    @property
    def down(self) -> bool:
        return self._down

    @down.setter
    def down(self, down: bool) -> None:
        self._down = down
        if down:  # as if it broke: the next batch connects again (refused)
            self.store._drop_ledger_conn()

    def _check(self, *_: Any) -> None:
        if self._down:
            raise self.error("connection refused (test outage)")


async def until(condition: Any, timeout_s: float = 10.0) -> None:
    """Poll `condition()` every 10 ms; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def rows(store: SQLStore) -> list[UsageRecord]:
    return store.query_usage(UsageQuery())


def dropped(writer: LedgerWriter) -> float | None:
    return writer.metrics.registry.get_sample_value("sluice_gateway_ledger_errors_total")


def waiting(writer: LedgerWriter) -> float | None:
    return writer.metrics.registry.get_sample_value("sluice_gateway_ledger_waiting")


class CountingStore(SQLStore):
    """Counts transactions (an observation hook, not a fake: rows go to SQLite)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.batches: list[int] = []

    def record_usage_many(self, records: list[UsageRecord],
                          released: Sequence[str] = ()) -> None:
        self.batches.append(len(records))
        time.sleep(0.01)  # a slow commit, so that writers pile up behind it
        super().record_usage_many(records, released)


async def test_ledger_writer_group_commits(tmp_path: Path) -> None:
    store = CountingStore(f"sqlite:///{tmp_path / 'l.db'}")
    tenant = store.create_tenant("t", TenantSettings())
    writer = LedgerWriter(store)
    await asyncio.gather(*(writer.write(rec(tenant.id, i)) for i in range(40)))
    assert sum(store.batches) == 40 and len(store.batches) < 40
    assert len(rows(store)) == 40
    assert store.get_tenant("t").spend_usd == pytest.approx(20.0)
    store.close()


async def test_rows_after_their_responses_are_committed_in_spaced_batches(
        tmp_path: Path) -> None:
    """Records nobody awaits go in one commit per `batch_interval_s` at most (the first
    at once); a record a request awaits (`write`) is committed at once, with those
    waiting, instead of waiting out the interval."""
    store = CountingStore(f"sqlite:///{tmp_path / 'l.db'}")
    tenant = store.create_tenant("t", TenantSettings())
    writer = LedgerWriter(store, batch_interval_s=2.0)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await writer.submit(rec(tenant.id, 0))  # the first commit: at once
    later = [writer.submit(rec(tenant.id, i)) for i in range(1, 4)]
    await asyncio.sleep(0.1)
    assert not any(f.done() for f in later)  # waiting for the interval
    await writer.write(rec(tenant.id, 4))  # awaited on a request's path: no wait
    assert all(f.done() for f in later) and loop.time() - start < 1.8
    assert store.batches == [1, 4] and len(rows(store)) == 5
    spaced = [writer.submit(rec(tenant.id, i)) for i in range(5, 7)]
    await asyncio.gather(*spaced)
    assert loop.time() - start >= 1.95 and store.batches == [1, 4, 2]  # after the interval
    store.close()


def test_writing_a_batch_again_adds_no_row_and_no_spend(any_store: SQLStore) -> None:
    t = any_store.create_tenant("acme", TenantSettings(budget_usd=10.0))
    reservation = any_store.reserve_spend(t.id, 2.0, 10.0, 60)
    assert reservation
    batch = [rec(t.id, i) for i in range(3)]
    any_store.record_usage_many(batch, [reservation])
    any_store.record_usage_many(batch, [reservation])  # a retry after a lost reply
    any_store.record_usage_many([batch[1], rec(t.id, 3)])  # one old, one new
    assert sorted(r.request_id for r in rows(any_store)) == ["r0", "r1", "r2", "r3"]
    assert len({r.record_id for r in rows(any_store)}) == 4
    tenant = any_store.get_tenant(t.id)
    assert (tenant.spend_usd, tenant.reserved_usd) == pytest.approx((2.0, 0.0), abs=1e-9)


def test_a_batch_past_one_statement_writes_each_record_once(any_store: SQLStore) -> None:
    """SQLite takes a batch in statements of 64 rows: a batch of 140 whose records
    repeat across those statements, some already written, adds each record once and
    charges each once."""
    t = any_store.create_tenant("acme", TenantSettings())
    old = [rec(t.id, i) for i in range(10)]
    any_store.record_usage_many(old)
    new = [rec(t.id, i) for i in range(10, 120)]
    batch = new[:70] + old + new[:5] + new[70:] + new[60:75]
    assert len(batch) == 140
    any_store.record_usage_many(batch)
    got = rows(any_store)
    assert sorted(r.record_id for r in got) == sorted(r.record_id for r in old + new)
    assert any_store.get_tenant(t.id).spend_usd == pytest.approx(0.5 * 120)


def test_two_requests_may_share_a_client_request_id(any_store: SQLStore) -> None:
    """`x-request-id` is the client's: a second request with the same one is a new row
    (and is charged), only the gateway's `record_id` is unique."""
    t = any_store.create_tenant("acme", TenantSettings())
    any_store.record_usage_many([rec(t.id, 1), rec(t.id, 1)])
    assert [r.request_id for r in rows(any_store)] == ["r1", "r1"]
    assert any_store.get_tenant(t.id).spend_usd == pytest.approx(1.0)


def test_an_unreachable_database_is_reported_as_unavailable(any_store: SQLStore) -> None:
    t = any_store.create_tenant("acme", TenantSettings())
    outage = Outage(any_store)
    outage.down = True
    with pytest.raises(ServiceUnavailableError):
        any_store.record_usage_many([rec(t.id, 1)])
    outage.down = False
    assert rows(any_store) == []


async def test_the_admin_api_answers_503_while_the_database_is_down(
        any_store: SQLStore, stub: StubUpstream) -> None:
    """The gateway's admin routes and /v1/usage, like the request path: a lost database is
    a 503 the client may retry (OpenAI's error JSON, `store_unavailable`, Retry-After),
    not a driver error's 500; they answer again once it is back."""
    from .conftest import ADMIN_KEY, make_state

    key = new_key(any_store)
    gw = GatewayMiddleware(stub, make_state(any_store))
    outage = Outage(any_store)
    calls = [("GET", "/admin/tenants", None), ("POST", "/admin/tenants", {"name": "b"}),
             ("GET", "/admin/keys", None), ("GET", "/admin/usage", None),
             ("POST", "/admin/purge", {"older_than_days": 30})]
    async with client_for(gw, ADMIN_KEY) as admin, client_for(gw, key) as tenant:
        outage.down = True
        for method, path, body in calls:
            r = await admin.request(method, path, json=body)
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"]["code"] == "store_unavailable"
            assert r.headers["retry-after"] == "1"
        r = await tenant.get("/v1/usage")
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        outage.down = False
        for method, path, body in calls:
            r = await admin.request(method, path, json=body)
            assert r.status_code in (200, 201), (path, r.text)
        assert (await tenant.get("/v1/usage")).status_code == 200


class LostReplyStore(SQLStore):
    """Commits the first batch, then reports the connection lost (the reply to COMMIT
    never arrived): the writer cannot tell it was written."""

    def __init__(self, url: str, table_prefix: str = "sluice_") -> None:
        super().__init__(url, table_prefix)
        self.calls = 0

    def record_usage_many(self, records: list[UsageRecord],
                          released: Sequence[str] = ()) -> None:
        super().record_usage_many(records, released)
        self.calls += 1
        if self.calls == 1:
            raise ServiceUnavailableError("server closed the connection unexpectedly")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def lost_reply_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        store = LostReplyStore(f"sqlite:///{tmp_path / 'l.db'}")
    else:
        store = LostReplyStore(PG_URL, table_prefix=f"t{uuid.uuid4().hex[:10]}_")
    yield store
    if request.param == "postgres":
        store.drop_all()
    store.close()


async def test_a_commit_whose_reply_was_lost_is_retried_and_counted_once(
        lost_reply_store: LostReplyStore) -> None:
    store = lost_reply_store
    t = store.create_tenant("acme", TenantSettings(budget_usd=10.0))
    reservation = store.reserve_spend(t.id, 3.0, 10.0, 60)
    writer = LedgerWriter(store, retry_s=(0.01, 0.05))
    await writer.write(rec(t.id, 1, cost=1.25), reservation)
    assert len(writer.waiting) == 1  # the caller is not held up by the retry
    await until(lambda: not writer.waiting)
    assert store.calls == 2 and [r.request_id for r in rows(store)] == ["r1"]
    tenant = store.get_tenant(t.id)
    assert (tenant.spend_usd, tenant.reserved_usd) == pytest.approx((1.25, 0.0), abs=1e-9)
    assert dropped(writer) == 0


async def test_records_wait_while_the_database_is_down_and_are_written_after(
        any_store: SQLStore) -> None:
    t = any_store.create_tenant("acme", TenantSettings())
    outage = Outage(any_store)
    writer = LedgerWriter(any_store, retry_s=(0.01, 0.1))
    await writer.write(rec(t.id, 0))
    outage.down = True
    await asyncio.gather(*(writer.write(rec(t.id, i)) for i in range(1, 6)))
    await writer.write(rec(t.id, 6))  # joins the queue without trying the database
    assert [r.request_id for r, _ in writer.waiting] == [f"r{i}" for i in range(1, 7)]
    assert waiting(writer) == 6
    await asyncio.sleep(0.3)  # several retries fail meanwhile
    assert len(writer.waiting) == 6
    outage.down = False
    await until(lambda: not writer.waiting)
    assert [r.request_id for r in rows(any_store)] == [f"r{i}" for i in range(7)]
    assert any_store.get_tenant(t.id).spend_usd == pytest.approx(3.5)
    assert waiting(writer) == 0 and dropped(writer) == 0


async def test_a_full_buffer_drops_and_counts_what_does_not_fit(sqlite_store: SQLStore,
                                                               caplog: Any) -> None:
    t = sqlite_store.create_tenant("acme", TenantSettings())
    Outage(sqlite_store).down = True
    writer = LedgerWriter(sqlite_store, max_waiting=2, retry_s=(10.0, 10.0))
    for i in range(3):
        await writer.write(rec(t.id, i))
    assert writer.full and [r.request_id for r, _ in writer.waiting] == ["r0", "r1"]
    assert dropped(writer) == 1
    assert "usage record for request r2 not written" in caplog.text
    await writer.close(0)


async def test_a_record_the_store_refuses_does_not_take_its_batch_down(
        sqlite_store: SQLStore) -> None:
    t = sqlite_store.create_tenant("acme", TenantSettings())
    writer = LedgerWriter(sqlite_store)
    bad = rec(t.id, 1, endpoint=None)  # NOT NULL: refused, not an outage
    await asyncio.gather(writer.write(rec(t.id, 0)), writer.write(bad), writer.write(rec(t.id, 2)))
    assert [r.request_id for r in rows(sqlite_store)] == ["r0", "r2"]
    assert not writer.waiting and dropped(writer) == 1


async def test_close_writes_what_waits_once_the_database_is_back(sqlite_store: SQLStore) -> None:
    t = sqlite_store.create_tenant("acme", TenantSettings())
    outage = Outage(sqlite_store)
    outage.down = True
    writer = LedgerWriter(sqlite_store, retry_s=(0.01, 0.05))
    await asyncio.gather(*(writer.write(rec(t.id, i)) for i in range(2)))
    asyncio.get_running_loop().call_later(0.2, setattr, outage, "down", False)
    await writer.close(10)
    assert len(rows(sqlite_store)) == 2 and dropped(writer) == 0


async def test_close_counts_what_it_could_not_write(sqlite_store: SQLStore, caplog: Any) -> None:
    t = sqlite_store.create_tenant("acme", TenantSettings())
    Outage(sqlite_store).down = True
    writer = LedgerWriter(sqlite_store, retry_s=(0.01, 0.05))
    await asyncio.gather(*(writer.write(rec(t.id, i)) for i in range(2)))
    with caplog.at_level(logging.ERROR):
        await writer.close(0.2)
    assert "2 usage records not written" in caplog.text
    assert not writer.waiting and dropped(writer) == 2


async def test_a_writer_that_dies_during_an_outage_leaves_its_records_to_the_next(
        any_store: SQLStore, tmp_path: Path) -> None:
    """With a spool, the records waiting for the database are also in a local file: a
    gateway that dies before the database is back (here: its writer dropped, no close)
    loses none; the next one on the same spool writes them, each once, also the one
    the first had committed just before it died (still in the spool)."""
    t = any_store.create_tenant("acme", TenantSettings(budget_usd=10.0))
    reservation = any_store.reserve_spend(t.id, 2.0, 10.0, 60)
    path = tmp_path / "spool.db"
    outage = Outage(any_store)
    outage.down = True
    first = LedgerWriter(any_store, retry_s=(10.0, 10.0), spool=LedgerSpool(path))
    await first.write(rec(t.id, 1, cost=1.25), reservation)
    await asyncio.gather(*(first.write(rec(t.id, i)) for i in (2, 3)))
    assert [r.request_id for r, _ in LedgerSpool(path).load()] == ["r1", "r2", "r3"]
    assert first._retry is not None
    first._retry.cancel()  # it dies: nothing more from it
    outage.down = False
    any_store.record_usage_many([first.waiting[1][0]])  # r2 made it before the end
    second = LedgerWriter(any_store, retry_s=(0.01, 0.05), spool=LedgerSpool(path))
    second.recover()
    assert waiting(second) == 3
    await until(lambda: not second.waiting)
    assert sorted(r.request_id for r in rows(any_store)) == ["r1", "r2", "r3"]
    tenant = any_store.get_tenant(t.id)
    assert (tenant.spend_usd, tenant.reserved_usd) == pytest.approx((2.25, 0.0), abs=1e-9)
    assert len(LedgerSpool(path)) == 0 and dropped(second) == 0
    await second.close(1)


async def test_close_leaves_what_it_could_not_write_in_the_spool(
        sqlite_store: SQLStore, tmp_path: Path, caplog: Any) -> None:
    t = sqlite_store.create_tenant("acme", TenantSettings())
    outage = Outage(sqlite_store)
    outage.down = True
    writer = LedgerWriter(sqlite_store, retry_s=(0.01, 0.05),
                          spool=LedgerSpool(tmp_path / "spool.db"))
    await asyncio.gather(*(writer.write(rec(t.id, i)) for i in range(2)))
    with caplog.at_level(logging.ERROR):
        await writer.close(0.2)
    assert "kept in" in caplog.text and not dropped(writer)
    outage.down = False
    after = LedgerWriter(sqlite_store, spool=LedgerSpool(tmp_path / "spool.db"))
    after.recover()
    await until(lambda: not after.waiting)
    assert sorted(r.request_id for r in rows(sqlite_store)) == ["r0", "r1"]
    await after.close(1)


def test_no_spool_file_without_an_outage(sqlite_store: SQLStore, tmp_path: Path) -> None:
    spool = LedgerSpool(tmp_path / "spool" / "s.db")
    assert spool.load() == [] and len(spool) == 0
    spool.remove(["x"])
    assert not (tmp_path / "spool").exists()


async def test_the_gateway_refuses_requests_while_the_buffer_is_full(
        sqlite_store: SQLStore) -> None:
    """Requests already admitted keep their records in memory; once `ledger_max_waiting`
    wait, new requests get 503 (no row: refused before authentication) until the
    database is back."""
    key = new_key(sqlite_store)
    config = GatewayConfig(await_ledger=True, ledger_max_waiting=1)
    state = GatewayState(config=config, store=sqlite_store, limiter=LocalLimiter())
    state.ledger.first_retry_s = state.ledger.max_retry_s = 0.05
    outage = Outage(sqlite_store)
    gw = GatewayMiddleware(StubUpstream(), state)
    async with client_for(gw, key) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        outage.down = True  # the key stays cached: SQLite's auth check is its own read
        r1 = await c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "kept"})
        r2 = await c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "no"})
        assert r1.status_code == 200 and state.ledger.full
        assert r2.status_code == 503 and r2.json()["error"]["code"] == "ledger_full"
        assert "retry-after" in r2.headers
        outage.down = False
        await until(lambda: not state.ledger.waiting)
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    ids = [r.request_id for r in rows(sqlite_store)]
    assert len(ids) == 3 and "kept" in ids and "no" not in ids
    await state.aclose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """(url, table prefix) of an empty database; the tables are dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'old.db'}", "sluice_"
        return
    prefix = f"t{uuid.uuid4().hex[:10]}_"
    yield PG_URL, prefix
    store = SQLStore(PG_URL, prefix)
    store.drop_all()
    store.close()


def test_an_old_usage_table_gains_record_id_and_its_unique_index(database: Any) -> None:
    url, prefix = database
    store = SQLStore(url, prefix)
    t = store.create_tenant("acme", TenantSettings())
    with store.engine.begin() as conn:  # back to the table as it was before record_id
        conn.execute(sa.text(f"DROP INDEX {prefix}usage_record_id"))
        conn.execute(sa.text(f"ALTER TABLE {prefix}usage DROP COLUMN record_id"))
        conn.execute(store.usage.insert().values(
            request_id="old", ts=0.0, tenant_id=t.id, key_id="k", endpoint="/v1/completions",
            status="ok", http_status=200, prompt_tokens=1, completion_tokens=1, cost_usd=0.0,
            latency_ms=1.0))
    store.close()
    store = SQLStore(url, prefix)
    try:
        assert [(r.request_id, r.record_id) for r in rows(store)] == [("old", None)]
        new = rec(t.id, 1)
        store.record_usage_many([new])
        store.record_usage_many([new])
        assert [r.request_id for r in rows(store)] == ["old", "r1"]
        assert store.get_tenant(t.id).spend_usd == pytest.approx(0.5)
        indexes = sa.inspect(store.engine).get_indexes(f"{prefix}usage")
        assert [bool(i["unique"]) for i in indexes if i["name"] == f"{prefix}usage_record_id"] \
            == [True]
    finally:
        store.close()


def test_an_old_responses_table_gains_the_background_runs_columns(database: Any) -> None:
    """A responses table from before background runs had replicas (no owner, lease or
    cancel ask, nor what a lapsed run's ledger row needs) gains them, and the owner's
    index, which each renewal reads."""
    url, prefix = database
    store = SQLStore(url, prefix)
    t = store.create_tenant("acme", TenantSettings())
    with store.engine.begin() as conn:  # back to the table as it was before
        conn.execute(sa.text(f"DROP INDEX ix_{prefix}responses_owner"))
        for column in ("owner", "lease_until", "cancel_at", "request_id", "prompt_tokens",
                       "reservation_id"):
            conn.execute(sa.text(f"ALTER TABLE {prefix}responses DROP COLUMN {column}"))
    store.close()
    store = SQLStore(url, prefix)
    try:
        admission = RunAdmission("req-1", 12, "rsv_1")
        store.save_response(StoredResponse("resp_1", t.id, "k", None, [],
                                           {"status": "in_progress"}, owner="gw",
                                           lease_until=time.time() + 60, admission=admission))
        assert store.ask_cancel("resp_1", t.id)
        assert store.renew_runs("gw", time.time() + 60) == ["resp_1"]
        kept = store.get_response("resp_1", t.id)
        assert kept is not None and kept.admission == admission
        [lapsed] = store.lapsed_runs(time.time() + 120, 10, "gw-other")
        assert lapsed.admission == admission
        indexes = sa.inspect(store.engine).get_indexes(f"{prefix}responses")
        assert [i["column_names"] for i in indexes
                if i["name"] == f"ix_{prefix}responses_owner"] == [["owner"]]
    finally:
        store.close()


def test_an_old_tenants_table_gains_deleted_at(database: Any) -> None:
    url, prefix = database
    store = SQLStore(url, prefix)
    t = store.create_tenant("acme", TenantSettings())
    with store.engine.begin() as conn:  # back to the table as it was before deleted_at
        conn.execute(sa.text(f"ALTER TABLE {prefix}tenants DROP COLUMN deleted_at"))
    store.close()
    store = SQLStore(url, prefix)
    try:
        assert [x.id for x in store.list_tenants()] == [t.id]
        assert store.delete_tenant("acme")[0].deleted_at is not None
        assert store.list_tenants() == []
    finally:
        store.close()


def test_a_batch_with_duplicates_and_nulls_writes_each_record_once(any_store: SQLStore) -> None:
    """Nullable columns null in some rows and set in others, a record twice in one
    batch, a record with no record_id (rows from before it existed), then the batch
    again with one new record: each record is one row with its values, in batch order,
    and its cost is counted once. (Before, a record twice in one batch was one row but
    its cost was added twice.)"""
    t = any_store.create_tenant("acme", TenantSettings())
    plain = rec(t.id, 0, model=None)
    bodies = rec(t.id, 1, cost=0.25, request_body="q", response_body=None, latency_ms=3.5)
    legacy = rec(t.id, 2, cost=0.0, record_id=None, response_body="a")
    any_store.record_usage_many([plain, bodies, plain, legacy])
    any_store.record_usage_many([bodies, rec(t.id, 3, prompt_tokens=7, completion_tokens=9)])
    written = rows(any_store)
    assert [r.request_id for r in written] == ["r0", "r1", "r2", "r3"]
    assert written[:3] == [plain, bodies, legacy]
    assert (written[3].prompt_tokens, written[3].completion_tokens) == (7, 9)
    assert any_store.get_tenant(t.id).spend_usd == pytest.approx(0.5 + 0.25 + 0.5)


@pytest.mark.services
def test_postgres_batch_insert_is_one_constant_statement(pg_store: SQLStore) -> None:
    """Batches of any size send the same INSERT text (arrays unnested), so psycopg and
    the server prepare it once; before, each batch size was its own multi-row VALUES
    statement."""
    t = pg_store.create_tenant("acme", TenantSettings())
    inserts: list[str] = []

    insert = pg_store._insert_records

    def seen(run: Any, records: Any) -> set[str]:  # the statements sent, whatever the path
        def noted(statement: str, params: Any) -> Any:
            inserts.append(statement)
            return run(statement, params)
        return insert(noted, records)

    pg_store._insert_records = seen  # type: ignore[method-assign]
    n = 0
    for size in (1, 3, 8, 2):
        pg_store.record_usage_many([rec(t.id, n + i) for i in range(size)])
        n += size
    assert len(inserts) == 4 and len(set(inserts)) == 1 and "unnest(" in inserts[0]
    assert [r.request_id for r in rows(pg_store)] == [f"r{i}" for i in range(n)]
