"""Redis and PostgreSQL cut and restored while requests flow through `sluice gateway`.

The machine's shared PostgreSQL and Redis are not ours to stop, so each sits behind a
`FaultProxy` (asyncio TCP, in this process): `cut()` resets every open connection and
closes new ones at once, which is what a gateway sees when a store restarts or the
network drops; `restore()` lets connections through again.

    load threads ─▶ sluice gateway (process) ─▶ stub upstream (uvicorn, in process)
                        │            │
                   FaultProxy    FaultProxy
                        ▼            ▼
                   Redis :6379   PostgreSQL :5432 (db test, a schema of our own)

Checked, after the gateway stopped (shutdown flushes the ledger):
- limits fail closed (503 + Retry-After, OpenAI's error shape) or open (200) as
  configured, and come back within a few seconds of the restore;
- no 5xx other than those 503s, nothing in another shape;
- the ledger: one row per request id, never two; every request answered 200 has its row.
  When PostgreSQL is cut, the records of requests in flight wait in the gateway's memory
  and are written once it is back: checked while the gateway still runs (a bounded
  wait), then again after its shutdown; requests refused during the cut have no row.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from gateway.stub import StubUpstream
from worker.worker_helpers import ServerThread

from .checks import error_shape
from .conftest import ADMIN_KEY, Process, metric, start, stop, wait_healthy

pytestmark = pytest.mark.services

PG = ("127.0.0.1", 5432)
REDIS = ("127.0.0.1", 6379)


class FaultProxy:
    """A TCP proxy to `target` on a free 127.0.0.1 port, on its own thread and loop."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.down = False
        self.port = 0
        self.connections: set[asyncio.StreamWriter] = set()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.connections |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self.connections -= {writer, up_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()

    def cut(self) -> None:
        def cut_now() -> None:
            self.down = True
            for writer in list(self.connections):
                writer.transport.abort()  # RST: the client's next read or write fails
        self.loop.call_soon_threadsafe(cut_now)

    def restore(self) -> None:
        self.down = False


@dataclass
class Outcome:
    request_id: str
    phase: str
    status: int  # 0: the connection failed
    stream: bool
    shape_ok: bool = True


@dataclass
class Load:
    """`threads` clients sending chat requests (every other one streamed) in a loop,
    each with its own x-request-id; `phase` labels what the stores were doing."""

    url: str
    key: str
    threads: int = 4
    phase: str = "before"
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        self._workers = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(self.threads)]
        for thread in self._workers:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._workers:
            thread.join(30)

    def _run(self, index: int) -> None:
        headers = {"authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=15) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                self.outcomes.append(self._one(client, stream=(n + index) % 2 == 0))
                time.sleep(0.01)

    def _one(self, client: httpx.Client, stream: bool) -> Outcome:
        rid, phase = uuid.uuid4().hex, self.phase
        body = {"model": "stub-model", "max_tokens": 5, "stream": stream,
                "messages": [{"role": "user", "content": "hello"}]}
        try:
            with client.stream("POST", "/v1/chat/completions", json=body,
                               headers={"x-request-id": rid}) as r:
                data = r.read()
        except httpx.HTTPError:
            return Outcome(rid, phase, 0, stream)
        outcome = Outcome(rid, phase, r.status_code, stream)
        if r.status_code >= 400:
            try:
                error_shape("/v1/chat/completions", r.status_code, data)
                outcome.shape_ok = r.status_code != 503 or "retry-after" in r.headers
            except (AssertionError, ValueError, KeyError):
                outcome.shape_ok = False
        return outcome

    def statuses(self, phase: str) -> list[int]:
        return [o.status for o in self.outcomes if o.phase == phase]


@pytest.fixture
def stub_url() -> Iterator[str]:
    server = ServerThread(StubUpstream(chunk_delay=0.03)).start()
    yield server.url
    server.stop()


@pytest.fixture
def pg_schema() -> Iterator[str]:
    """A schema of our own in the shared `test` database, dropped afterwards."""
    import psycopg

    name = f"reliab_{uuid.uuid4().hex[:10]}"
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    yield name
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as conn:
        with contextlib.suppress(psycopg.errors.UndefinedTable):  # the gateway's auth mirror
            mirrors = conn.execute(f"SELECT redis_key FROM {name}.sluice_auth_mirrors").fetchall()
            if mirrors:
                import redis

                redis.Redis.from_url("redis://127.0.0.1:6379/0").delete(*[m[0] for m in mirrors])
        conn.execute(f"DROP SCHEMA {name} CASCADE")


@contextlib.contextmanager
def gateway(stub_url: str, pg: FaultProxy, redis: FaultProxy, schema: str, mode: str,
            home: Path) -> Iterator[tuple[Process, str, str]]:
    """`sluice gateway` through both proxies; yields (process, API key, tenant id)."""
    database = (f"postgresql://postgres@127.0.0.1:{pg.port}/test"
                f"?options=-csearch_path%3D{schema}")
    process = start("gateway", ["gateway", "--upstream", stub_url, "--database-url", database,
                                "--redis-url", f"redis://127.0.0.1:{redis.port}/0",
                                "--on-redis-error", mode, "--admin-key", ADMIN_KEY], home)
    tenant_id = None
    try:
        wait_healthy(process, 60)
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        tenant = httpx.post(process.url + "/admin/tenants", headers=admin, timeout=10, json={
            "name": f"t{uuid.uuid4().hex[:8]}", "rpm": 100_000, "max_concurrent": 8}).json()
        tenant_id = tenant["id"]
        key = httpx.post(process.url + "/admin/keys", headers=admin, timeout=10,
                         json={"tenant": tenant["name"]}).json()
        yield process, key["key"], tenant_id
    finally:
        stop(process)
        clean_redis(tenant_id)


def clean_redis(tenant_id: str | None) -> None:
    import redis

    if tenant_id is None:
        return
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    for key in client.scan_iter(match=f"sluice:rl:tenant:{tenant_id}:*"):
        client.delete(key)
    client.close()


def ledger_rows(schema: str) -> dict[str, list[str]]:
    """request id -> the statuses of its ledger rows."""
    import psycopg

    rows: dict[str, list[str]] = {}
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test") as conn:
        for rid, status in conn.execute(f"SELECT request_id, status FROM {schema}.sluice_usage"):
            rows.setdefault(rid, []).append(status)
    return rows


def run_phases(load: Load, proxy: FaultProxy, cut_s: float = 3.0) -> None:
    time.sleep(1.5)
    load.phase = "cut"
    proxy.cut()
    time.sleep(cut_s)
    load.phase = "recovering"
    proxy.restore()
    time.sleep(3.0)
    load.phase = "after"
    time.sleep(2.0)


def lost_rows(load: Load, schema: str) -> list[Outcome]:
    """Asserts no request id has two ledger rows; returns the requests answered 200
    that have none."""
    rows = ledger_rows(schema)
    duplicated = {rid: s for rid, s in rows.items() if len(s) > 1}
    assert not duplicated, duplicated
    return [o for o in load.outcomes if o.status == 200 and o.request_id not in rows]


def wait_for_rows(load: Load, schema: str, timeout_s: float = 30.0) -> list[Outcome]:
    """Poll the ledger until every request answered 200 has its row, for at most
    `timeout_s`; returns those still without one."""
    deadline = time.monotonic() + timeout_s
    while (lost := lost_rows(load, schema)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return lost


def bad_answers(load: Load) -> list[Outcome]:
    """Connection failures, 5xx other than 503, errors in the wrong shape."""
    return [o for o in load.outcomes if o.status == 0 or not o.shape_ok
            or (o.status >= 500 and o.status != 503)]


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_redis_cut_under_load(stub_url: str, pg_schema: str, tmp_path: Path, mode: str) -> None:
    with FaultProxy(PG) as pg, FaultProxy(REDIS) as redis, \
            gateway(stub_url, pg, redis, pg_schema, mode, tmp_path) as (gw, key, tenant):
        with Load(gw.url, key) as load:
            run_phases(load, redis)
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        during = load.statuses("cut")
        assert during and not bad_answers(load), (bad_answers(load)[:5], gw.text())
        if mode == "closed":
            assert during.count(503) >= len(during) // 2, during  # in-flight ones finish 200
        else:
            assert set(during) == {200}, during
        assert f'sluice_gateway_limiter_errors_total{{mode="{mode}"}}' in metrics
        assert load.statuses("after") and set(load.statuses("after")) == {200}, \
            load.statuses("after")
        burst = concurrent_burst(gw.url, key, 8)  # the tenant's whole concurrency limit
        assert burst == [200] * 8, f"concurrency slots leaked by the outage: {burst}"
    lost = lost_rows(load, pg_schema)
    assert not lost, (len(lost), lost[:5])
    rows = ledger_rows(pg_schema)  # a limiter refusal is audited: one `rejected` row
    assert all(rows.get(o.request_id) == ["rejected"] for o in load.outcomes
               if o.status == 503), [rows.get(o.request_id) for o in load.outcomes
                                     if o.status == 503][:5]


def concurrent_burst(url: str, key: str, n: int) -> list[int]:
    body = {"model": "stub-model", "max_tokens": 5, "stream": True,
            "messages": [{"role": "user", "content": "hello"}]}

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=15,
                                     headers={"authorization": f"Bearer {key}"}) as client:
            replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=body)
                                             for _ in range(n)))
        return sorted(r.status_code for r in replies)

    return asyncio.run(main())


def test_postgres_cut_under_load(stub_url: str, pg_schema: str, tmp_path: Path) -> None:
    with FaultProxy(PG) as pg, FaultProxy(REDIS) as redis, \
            gateway(stub_url, pg, redis, pg_schema, "closed", tmp_path) as (gw, key, _):
        with Load(gw.url, key) as load:
            run_phases(load, pg)
        assert not bad_answers(load), (len(bad_answers(load)), bad_answers(load)[:5], gw.text())
        # the key is cached and the Redis limiter's step confirms it (the auth version's
        # mirror): served through the cut, its records waiting for the database
        during = load.statuses("cut")
        assert during and set(during) == {200}, during
        assert load.statuses("after") and set(load.statuses("after")) == {200}, \
            load.statuses("after")
        lost = wait_for_rows(load, pg_schema)  # written by the retry, not by the shutdown
        assert not lost, (len(lost), lost[:5], gw.text())
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        assert "sluice_gateway_ledger_waiting" in metrics
        assert metric(metrics, "sluice_gateway_ledger_waiting") == 0
        assert metric(metrics, "sluice_gateway_ledger_errors_total") == 0, gw.text()
    rows = ledger_rows(pg_schema)  # refused before the key could be checked: no row
    assert not [o for o in load.outcomes if o.status == 503 and o.request_id in rows]
    lost = lost_rows(load, pg_schema)  # and exactly one row each (no duplicate)
    assert not lost, (len(lost), lost[:5])


def test_records_outlive_a_gateway_killed_while_postgres_is_down(
        stub_url: str, pg_schema: str, tmp_path: Path) -> None:
    """The records of requests served during a PostgreSQL cut wait in the gateway's
    memory and in its spool file (SLUICE_HOME/ledger-spool): a gateway killed with
    SIGKILL before the database is back loses none; the next one started on the same
    database and home writes them, each once."""
    with FaultProxy(PG) as pg, FaultProxy(REDIS) as redis:
        with gateway(stub_url, pg, redis, pg_schema, "closed", tmp_path) as (gw, key, _):
            with Load(gw.url, key, threads=2) as load:
                time.sleep(1.0)
                load.phase = "cut"
                pg.cut()
                time.sleep(2.0)
            served = [o for o in load.outcomes if o.phase == "cut" and o.status == 200]
            assert served, load.statuses("cut")
            metrics = httpx.get(gw.url + "/metrics", timeout=10).text
            assert metric(metrics, "sluice_gateway_ledger_waiting") > 0
            gw.proc.kill()
            gw.proc.wait(10)
        assert lost_rows(load, pg_schema), "the cut's records were written before the kill"
        pg.restore()
        again = start("gateway", ["gateway", "--upstream", stub_url, "--database-url",
                                  f"postgresql://postgres@127.0.0.1:{pg.port}/test"
                                  f"?options=-csearch_path%3D{pg_schema}",
                                  "--redis-url", f"redis://127.0.0.1:{redis.port}/0",
                                  "--admin-key", ADMIN_KEY], tmp_path)
        try:
            wait_healthy(again, 60)
            lost = wait_for_rows(load, pg_schema)
            assert not lost, (len(lost), lost[:5], again.text())
        finally:
            stop(again)
    assert not lost_rows(load, pg_schema)  # one row each: no duplicate either
    assert all(_spool_empty(p) for p in (tmp_path / "ledger-spool").glob("*.db"))


def _spool_empty(path: Path) -> bool:
    from sluice.gateway.spool import LedgerSpool

    spool = LedgerSpool(path)
    try:
        return len(spool) == 0
    finally:
        spool.close()
