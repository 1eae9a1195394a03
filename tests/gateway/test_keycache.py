"""The key cache: keys are looked up once, yet a revocation or a tenant change made on
any replica (or by the CLI) is seen by every gateway on its next request."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from sluice.gateway.keycache import KeyCache, VersionReads
from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.store import KeySettings, SQLStore, TenantSettings

from .conftest import CHAT, client_for, make_state, new_key
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
