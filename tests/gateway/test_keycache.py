"""The key cache: keys are looked up once, yet a revocation or a tenant change made on
any replica (or by the CLI) is seen by every gateway on its next request: through the
store's auth version, or (PostgreSQL + a Redis limiter) its mirror in Redis."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import sqlalchemy as sa

from sluice.gateway import auth_mirror
from sluice.gateway.keycache import KeyCache, VersionReads
from sluice.gateway.limits import RedisLimiter
from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.store import KeySettings, SQLStore, TenantSettings
from sluice.protocol.errors import ServiceUnavailableError

from .conftest import ADMIN_KEY, CHAT, REDIS_URL, client_for, make_state, new_key
from .stub import StubUpstream


class CountingStore(SQLStore):
    """Counts the full lookups (the join) the cache lets through."""

    lookups = 0

    def authenticate(self, plaintext: str):  # type: ignore[no-untyped-def]
        self.lookups += 1
        return super().authenticate(plaintext)


def twin(store: SQLStore) -> SQLStore:
    """A second replica's (or the CLI's) own store on the same database and tables."""
    return SQLStore(store.url, table_prefix=store.tenants.name.removesuffix("tenants"))


@pytest.fixture
def counting(any_store: SQLStore) -> Iterator[CountingStore]:
    store = CountingStore(any_store.url,
                          table_prefix=any_store.tenants.name.removesuffix("tenants"))
    yield store
    store.close()


def test_auth_version_moves_with_revocations_and_tenant_changes(any_store: SQLStore) -> None:
    other = twin(any_store)
    try:
        v0 = other.auth_version()
        any_store.create_tenant("acme", TenantSettings())
        key, _ = any_store.create_key("acme", KeySettings())
        assert other.auth_version() == v0  # a new key changes nothing cached
        any_store.update_tenant("acme", {"rpm": 10})
        assert other.auth_version() == v0 + 1
        any_store.revoke_key(key.id)
        assert other.auth_version() == v0 + 2
    finally:
        other.close()


def test_cache_answers_without_the_join_until_something_changes(counting: CountingStore) -> None:
    cache = KeyCache(counting)
    key = new_key(counting)
    for _ in range(5):
        principal = cache.authenticate(key)
        assert principal is not None and principal.tenant.name == "acme"
    assert counting.lookups == 1
    assert cache.cached(key) is not None
    counting.update_tenant("acme", {"allowed_models": ("other",)})
    assert cache.cached(key) is None  # stale: the version moved
    principal = cache.authenticate(key)
    assert principal is not None and principal.tenant.settings.allowed_models == ("other",)
    assert counting.lookups == 2
    assert cache.authenticate(key + "x") is None


def test_budgeted_tenants_are_read_fresh(counting: CountingStore) -> None:
    cache = KeyCache(counting)
    key = new_key(counting, budget_usd=5.0)
    for _ in range(3):
        assert cache.authenticate(key) is not None
    assert counting.lookups == 3  # spend changes with every request: never cached
    assert cache.cached(key) is None


async def test_revoked_key_is_refused_on_the_next_request_by_every_replica(
        any_store: SQLStore) -> None:
    key = new_key(any_store)
    stub = StubUpstream()
    stores = [twin(any_store), twin(any_store)]
    replicas = [GatewayMiddleware(stub, make_state(s)) for s in stores]
    clients = [client_for(gw, key) for gw in replicas]
    try:
        for c in clients:  # both replicas now hold the key in their cache
            for _ in range(2):
                assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        key_id = any_store.list_keys()[0].id
        stores[0].revoke_key(key_id)  # revoked through replica 0's store
        for c in clients:
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 401, r.text
    finally:
        for c in clients:
            await c.aclose()
        for gw in replicas:
            await gw.state.aclose()
    assert len(stub.received) == 4


class ReadCountingStore(SQLStore):
    """Counts the auth version's queries."""

    reads = 0

    def _read_version(self) -> int:
        self.reads += 1
        return super()._read_version()


def test_sqlite_auth_version_is_read_again_only_after_a_commit(sqlite_store: SQLStore) -> None:
    """The version is queried again only once some connection has committed (the WAL
    header changed): by this process's other store, or by another process."""
    new_key(sqlite_store)
    store = ReadCountingStore(sqlite_store.url)
    try:
        first = store.auth_version()
        for _ in range(5):
            assert store.auth_version() == first
        assert store.reads == 2  # the first, and the one that took the header's snapshot
        sqlite_store.revoke_key(sqlite_store.list_keys()[0].id)  # a version bump
        assert store.auth_version() == first + 1 and store.reads == 3
        assert store.auth_version() == first + 1 and store.reads == 3
        path = sqlite_store.url.split("///", 1)[1]
        table = sqlite_store.versions.name
        subprocess.run([sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]);"
                        f" c.execute('UPDATE {table} SET version = version + 5'); c.commit()",
                        path], check=True, timeout=60)
        assert store.auth_version() == first + 6 and store.reads == 4
    finally:
        store.close()


async def test_tenant_change_is_seen_on_the_next_request(any_store: SQLStore) -> None:
    key = new_key(any_store)
    gw = GatewayMiddleware(StubUpstream(), make_state(twin(any_store)))
    async with client_for(gw, key) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        any_store.update_tenant("acme", {"allowed_models": ("another-model",)})
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    await gw.state.aclose()


async def test_shared_version_reads_start_after_each_caller_arrived() -> None:
    """Callers arriving while a read runs wait for the next read (which sees what
    committed before they arrived); all of them share that one."""
    started, release = threading.Event(), threading.Event()
    reads: list[int] = []

    def read() -> int:
        reads.append(len(reads) + 1)
        started.set()
        release.wait(10)
        return reads[-1]

    versions = VersionReads(read)
    first = asyncio.ensure_future(versions.current())
    assert await asyncio.to_thread(started.wait, 10)  # read 1 is running
    started.clear()
    later = [asyncio.ensure_future(versions.current()) for _ in range(5)]
    await asyncio.sleep(0)  # they are queued behind read 1
    release.set()
    assert await first == 1
    assert await asyncio.gather(*later) == [2] * 5  # one read, started after they came
    assert reads == [1, 2]


async def test_a_failed_shared_read_fails_its_callers_only() -> None:
    calls = []

    def read() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("database down")
        return 7

    versions = VersionReads(read)
    with pytest.raises(RuntimeError):
        await versions.current()
    assert await versions.current() == 7


# -- the auth version's Redis mirror (gateway/auth_mirror.py) ----------------------------
class VersionCountingStore(SQLStore):
    """Counts the store's auth-version reads (a round trip each on PostgreSQL)."""

    version_reads = 0

    def auth_version(self) -> int:
        self.version_reads += 1
        return super().auth_version()


@pytest.fixture
def mirrored(pg_store: SQLStore, redis_prefix: str,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[list[GatewayMiddleware]]:
    """Two replicas on PostgreSQL + the Redis limiter, so with the mirror; no periodic
    check unless a test asks (CHECK_EVERY_S)."""
    monkeypatch.setattr(auth_mirror, "CHECK_EVERY_S", 3600.0)
    prefix = pg_store.tenants.name.removesuffix("tenants")
    stub = StubUpstream()
    replicas = [GatewayMiddleware(stub, make_state(
        VersionCountingStore(pg_store.url, table_prefix=prefix),
        RedisLimiter(REDIS_URL, prefix=redis_prefix))) for _ in range(2)]
    yield replicas  # pg_store.drop_all deletes the mirror's Redis key


async def chat(client: httpx.AsyncClient) -> int:
    return (await client.post("/v1/chat/completions", json=CHAT)).status_code


@pytest.mark.services
@pytest.mark.parametrize("change", ["revoke_key", "delete_tenant"])
async def test_mirror_a_revocation_by_another_process_is_refused_on_the_next_request(
        pg_store: SQLStore, mirrored: list[GatewayMiddleware], change: str) -> None:
    """With the mirror a warm replica reads no version from the store per request; a key
    revoked by another process (the CLI's own store), itself or with its whole tenant
    (`delete_tenant`), is still refused by every replica on its next request."""
    key = new_key(pg_store)
    clients = [client_for(gw, key) for gw in mirrored]
    stores = [gw.state.store for gw in mirrored]
    assert all(gw.state.keys.mirror is not None for gw in mirrored)
    try:
        for c in clients:
            assert [await chat(c) for _ in range(2)] == [200, 200]
        reads = [s.version_reads for s in stores]  # type: ignore[attr-defined]
        for c in clients:
            assert [await chat(c) for _ in range(5)] == [200] * 5
        assert [s.version_reads for s in stores] == reads  # type: ignore[attr-defined]
        cli = twin(pg_store)
        if change == "revoke_key":
            cli.revoke_key(pg_store.list_keys()[0].id)
        else:
            cli.delete_tenant("acme")
        cli.close()
        for c in clients:
            assert await chat(c) == 401
    finally:
        for c in clients:
            await c.aclose()
        for gw in mirrored:
            await gw.state.aclose()


@pytest.mark.services
async def test_mirror_a_tenant_change_is_applied_also_where_the_stale_answer_refused(
        pg_store: SQLStore, mirrored: list[GatewayMiddleware]) -> None:
    """A cached answer is used before the step confirms it; a refusal it caused stands
    only if the store confirms it too: a tenant allowed a model again is served at once."""
    key = new_key(pg_store, allowed_models=("another-model",))
    gw = mirrored[0]
    other = twin(pg_store)
    async with client_for(gw, key) as client:
        assert await chat(client) == 404
        assert await chat(client) == 404  # now from the cache
        other.update_tenant("acme", {"allowed_models": None})
        assert await chat(client) == 200
        other.update_tenant("acme", {"allowed_models": ("another-model",)})
        assert await chat(client) == 404
    other.close()
    for replica in mirrored:
        await replica.state.aclose()


@pytest.mark.services
def test_mirror_a_change_is_saved_when_one_mirror_cannot_be_told(
        pg_store: SQLStore, mirrored: list[GatewayMiddleware]) -> None:
    """One unreachable mirror: the change commits, the reachable mirror is told, and the
    caller gets a 503 that says so."""
    import redis

    key = new_key(pg_store)
    pg_store.register_auth_mirror("redis://127.0.0.1:1/0")
    with pytest.raises(ServiceUnavailableError) as exc:
        pg_store.revoke_key(pg_store.list_keys()[0].id)
    assert exc.value.code == "auth_mirror_unreachable" and "saved" in exc.value.message
    assert pg_store.authenticate(key) is None
    mirror = mirrored[0].state.keys.mirror
    assert mirror is not None
    told = redis.Redis.from_url(REDIS_URL).get(mirror.key)
    assert told is not None and int(told) == pg_store.auth_version()


@pytest.mark.services
async def test_mirror_a_stale_registration_is_dropped_and_a_gateway_registers_again(
        pg_store: SQLStore, mirrored: list[GatewayMiddleware],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror unreachable and unused for `STALE_S` (Redis moved) no longer fails every
    change: it is dropped. A gateway still reading its mirror marks it in use, and
    registers it again (same key) if it was dropped."""
    import redis

    key = new_key(pg_store)
    pg_store.register_auth_mirror("redis://127.0.0.1:1/0")
    m = pg_store.mirrors
    with pg_store.engine.begin() as conn:  # nobody used it for longer than STALE_S
        conn.execute(m.update().where(m.c.url == "redis://127.0.0.1:1/0")
                     .values(seen_at=time.time() - auth_mirror.STALE_S - 1))
    pg_store.update_tenant("acme", {"rpm": 1000})  # no 503: the stale one is dropped
    with pg_store.engine.connect() as conn:
        urls = {r.url for r in conn.execute(sa.select(m.c.url))}
    assert urls == {REDIS_URL}
    gw = mirrored[0]
    mirror = gw.state.keys.mirror
    assert mirror is not None
    with pg_store.engine.begin() as conn:  # the live one dropped too (a long Redis outage)
        conn.execute(m.delete())
    monkeypatch.setattr(auth_mirror, "CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(auth_mirror, "TOUCH_EVERY_S", 0.0)
    async with client_for(gw, key) as http:
        assert await chat(http) == 200
        assert mirror._task is not None
        await mirror._task  # the check registered it again, under the key the steps read
    with pg_store.engine.connect() as conn:
        rows = [(r.url, r.redis_key) for r in conn.execute(sa.select(m.c.url, m.c.redis_key))]
    assert rows == [(REDIS_URL, mirror.key)]
    assert int(redis.Redis.from_url(REDIS_URL).get(mirror.key)) == pg_store.auth_version()
    for replica in mirrored:
        await replica.state.aclose()


@pytest.mark.services
async def test_mirror_gateways_catch_up_with_a_change_redis_was_not_told_of(
        pg_store: SQLStore, mirrored: list[GatewayMiddleware],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A revocation whose process could not reach Redis (made here by raising nothing in
    Redis), and a mirror key lost with a Redis restart: requests read the store's version
    while the key is missing, and the periodic check brings the mirror up to the store."""
    import redis

    key = new_key(pg_store)
    gw = mirrored[0]
    mirror = gw.state.keys.mirror
    assert mirror is not None
    client = redis.Redis.from_url(REDIS_URL)
    async with client_for(gw, key) as http:
        assert await chat(http) == 200
        monkeypatch.setattr(auth_mirror, "tell", lambda *args: None)  # Redis unreachable
        other = twin(pg_store)
        other.revoke_key(pg_store.list_keys()[0].id)
        other.close()
        monkeypatch.undo()
        monkeypatch.setattr(auth_mirror, "CHECK_EVERY_S", 0.0)
        assert await chat(http) in (200, 401)  # within the check's bound
        assert mirror._task is not None
        await mirror._task  # the check raised the mirror to the store's version
        assert int(client.get(mirror.key)) == pg_store.auth_version()
        assert await chat(http) == 401
        client.delete(mirror.key)  # Redis lost it: the store's version is read instead
        monkeypatch.setattr(auth_mirror, "CHECK_EVERY_S", 3600.0)
        reads = gw.state.store.version_reads  # type: ignore[attr-defined]
        assert await chat(http) == 401
        assert gw.state.store.version_reads > reads  # type: ignore[attr-defined]
    client.close()
    for replica in mirrored:
        await replica.state.aclose()


@pytest.mark.services
async def test_mirror_a_key_changed_on_one_replica_is_applied_by_the_other_at_once(
        pg_store: SQLStore, mirrored: list[GatewayMiddleware]) -> None:
    """A key's limits, models and class could not be changed (LiteLLM's /key/update): an
    operator had to mint a key and hand it out again. `PATCH /admin/keys/{id}` (and
    `sluice keys update`) changes them and bumps the auth version, so every replica
    applies the change from its next request."""
    key = new_key(pg_store)
    key_id = pg_store.list_keys()[0].id
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    first, second = (client_for(gw, key) for gw in mirrored)
    try:
        assert [await chat(first), await chat(second)] == [200, 200]
        r = await first.patch(f"/admin/keys/{key_id}", headers=admin,
                              json={"allowed_models": ["another-model"], "rpm": 7})
        assert r.status_code == 200
        assert (r.json()["allowed_models"], r.json()["rpm"], "key" in r.json()) == (
            ["another-model"], 7, False)
        assert await chat(second) == 404
        r = await second.patch(f"/admin/keys/{key_id}", headers=admin,
                               json={"allowed_models": None})
        assert r.status_code == 200 and await chat(first) == 200
        assert (await first.post(
            "/v1/chat/completions", json=CHAT)).headers["x-ratelimit-limit-requests"] == "7"
        bad = await first.patch(f"/admin/keys/{key_id}", headers=admin, json={"rpm": "5"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "rpm"
        gone = await first.patch("/admin/keys/key_nope", headers=admin, json={"rpm": 1})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "key_not_found"
        tenant = await first.patch(f"/admin/keys/{key_id}", headers=admin,
                                   json={"tenant": "other"})
        assert tenant.status_code == 400 and tenant.json()["error"]["param"] == "tenant"
    finally:
        for c in (first, second):
            await c.aclose()
        for gw in mirrored:
            await gw.state.aclose()


@pytest.mark.services
def test_mirror_a_gateway_whose_redis_is_unreachable_at_start_registers_none(
        pg_store: SQLStore) -> None:
    """A gateway started once with a Redis URL that answered nothing (a typo, a Redis not
    up yet) registered it as a mirror, and every change after, from any process (the
    CLI, the admin API), failed with 503 `auth_mirror_unreachable` (exit status 1) for
    the hour a registration takes to go stale. It registers nothing now and reads the
    store's version, as without a mirror (logged)."""
    cache = KeyCache(SQLStore(pg_store.url, table_prefix=pg_store.tenants.name.removesuffix(
        "tenants")))
    assert cache.use_mirror("redis://127.0.0.1:1/0") is None and cache.mirror is None
    with pg_store.engine.connect() as conn:
        assert conn.execute(sa.select(pg_store.mirrors)).all() == []
    pg_store.create_tenant("acme", TenantSettings())
    pg_store.update_tenant("acme", {"rpm": 5})  # no 503: nothing to tell
    cache.store.close()
