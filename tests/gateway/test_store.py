"""Keys, tenants and the ledger on SQLite and PostgreSQL."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from sluice.gateway.keys import KEY_PREFIX, generate_key, hash_key
from sluice.gateway.store import (
    KeySettings,
    SQLStore,
    TenantSettings,
    UsageQuery,
    UsageRecord,
    UsageTotals,
)
from sluice.protocol.errors import InvalidRequestError, NotFoundError


def test_generated_keys_have_256_bits_and_only_the_hash_is_kept() -> None:
    keys = {generate_key().plaintext for _ in range(50)}
    assert len(keys) == 50
    for k in keys:
        assert k.startswith(KEY_PREFIX) and len(k) - len(KEY_PREFIX) >= 43
    new = generate_key()
    assert new.digest == hash_key(new.plaintext) and len(new.digest) == 64
    assert new.plaintext not in new.display


def test_store_never_holds_the_plaintext(any_store: SQLStore) -> None:
    any_store.create_tenant("acme", TenantSettings())
    key, plaintext = any_store.create_key("acme", KeySettings(name="ci"))
    with any_store.engine.connect() as conn:
        rows = [tuple(r) for r in conn.execute(sa.select(any_store.keys))]
    dumped = repr(rows)
    assert plaintext not in dumped and plaintext[len(KEY_PREFIX):] not in dumped
    assert hash_key(plaintext) in dumped
    principal = any_store.authenticate(plaintext)
    assert principal is not None and principal.key.id == key.id
    assert principal.tenant.name == "acme"
    assert any_store.authenticate(plaintext + "x") is None


def test_revoked_key_no_longer_authenticates(any_store: SQLStore) -> None:
    any_store.create_tenant("acme", TenantSettings())
    key, plaintext = any_store.create_key("acme", KeySettings())
    revoked = any_store.revoke_key(key.id)
    assert revoked.revoked_at is not None
    assert any_store.authenticate(plaintext) is None
    with pytest.raises(NotFoundError):
        any_store.revoke_key("key_missing")


def test_tenant_create_update_and_errors(any_store: SQLStore) -> None:
    t = any_store.create_tenant("acme", TenantSettings(rpm=10, allowed_models=("a",)))
    with pytest.raises(InvalidRequestError) as exc:
        any_store.create_tenant("acme", TenantSettings())
    assert exc.value.param == "name"
    updated = any_store.update_tenant("acme", {"rpm": 20, "priority_class": "batch"})
    assert updated.settings.rpm == 20 and updated.settings.priority_class == "batch"
    assert any_store.get_tenant(t.id).settings.allowed_models == ("a",)
    with pytest.raises(InvalidRequestError) as exc:
        any_store.update_tenant("acme", {"colour": "red"})
    assert exc.value.param == "colour"
    with pytest.raises(InvalidRequestError) as exc:
        any_store.update_tenant("acme", {"priority_class": "vip"})
    assert exc.value.param == "priority_class"
    with pytest.raises(NotFoundError):
        any_store.get_tenant("nobody")


def test_ledger_spend_equals_sum_of_records_and_purge(any_store: SQLStore) -> None:
    a = any_store.create_tenant("a", TenantSettings())
    b = any_store.create_tenant("b", TenantSettings())
    now = time.time()
    for i in range(5):
        any_store.record_usage(UsageRecord(
            request_id=f"r{i}", tenant_id=(a if i % 2 == 0 else b).id, key_id="k",
            endpoint="/v1/chat/completions", model="m", status="ok", http_status=200,
            prompt_tokens=10, completion_tokens=i, cost_usd=0.25, ts=now - 86400 * i))
    assert any_store.get_tenant("a").spend_usd == pytest.approx(0.75)
    assert any_store.get_tenant("b").spend_usd == pytest.approx(0.5)
    rows = any_store.query_usage(UsageQuery(tenant_id=a.id))
    assert [r.request_id for r in rows] == ["r0", "r2", "r4"]
    recent = any_store.query_usage(UsageQuery(since=now - 86400 * 1.5))
    assert [r.request_id for r in recent] == ["r0", "r1"]
    assert any_store.purge(now - 86400 * 2.5) == 2  # r3, r4
    assert len(any_store.query_usage(UsageQuery())) == 3
    assert any_store.get_tenant("a").spend_usd == pytest.approx(0.75)  # spend is not refunded


def test_usage_totals_cover_every_matching_record_not_only_the_limit(
        any_store: SQLStore) -> None:
    """The HTTP and CLI totals summed the rows a query returned (the oldest 1,000 by
    default), so a busy tenant's day was under-reported; `usage_totals` sums them all."""
    a = any_store.create_tenant("a", TenantSettings())
    for i in range(5):
        any_store.record_usage(UsageRecord(
            request_id=f"r{i}", tenant_id=a.id, key_id="k", endpoint="/v1/completions",
            model="m", status="ok", http_status=200, prompt_tokens=10, completion_tokens=i,
            cost_usd=0.25, ts=1000.0 + i))
    query = UsageQuery(tenant_id=a.id, limit=2)
    assert [r.request_id for r in any_store.query_usage(query)] == ["r0", "r1"]
    assert any_store.usage_totals(query) == UsageTotals(5, 50, 10, 1.25)
    assert any_store.usage_totals(UsageQuery(since=1003.0)) == UsageTotals(2, 20, 7, 0.5)
    assert any_store.usage_totals(UsageQuery(key_id="other")) == UsageTotals()


def test_a_record_with_strings_longer_than_their_columns_is_written_cut(
        any_store: SQLStore) -> None:
    """A client's 100-character `x-request-id` made PostgreSQL refuse the record (value too
    long for varchar(64)): the request was neither audited nor billed. Each string is cut
    to its column instead, and the spend is added."""
    a = any_store.create_tenant("a", TenantSettings())
    any_store.record_usage(UsageRecord(
        request_id="r" * 100, tenant_id=a.id, key_id="k", endpoint="/v1/" + "p" * 200,
        model="m" * 300, status="ok", http_status=200, prompt_tokens=1, cost_usd=0.5))
    [row] = any_store.query_usage(UsageQuery(tenant_id=a.id))
    assert (row.request_id, row.model) == ("r" * 64, "m" * 200)
    assert len(row.endpoint) == 100 and row.prompt_tokens == 1
    assert any_store.get_tenant("a").spend_usd == pytest.approx(0.5)


def test_a_tenant_name_longer_than_its_column_is_a_400_naming_name(any_store: SQLStore) -> None:
    """`sluice tenants create <300 characters>` was a traceback on PostgreSQL (and took
    the name on SQLite, which the admin API refuses past 200)."""
    with pytest.raises(InvalidRequestError) as exc:
        any_store.create_tenant("a" * 201, TenantSettings())
    assert exc.value.param == "name"
    assert any_store.create_tenant("a" * 200, TenantSettings()).name == "a" * 200


def test_reset_spend_keeps_reservations_and_the_ledger(any_store: SQLStore) -> None:
    a = any_store.create_tenant("a", TenantSettings(budget_usd=1.0))
    any_store.record_usage(UsageRecord(
        request_id="r", tenant_id=a.id, key_id="k", endpoint="/v1/completions", model="m",
        status="ok", http_status=200, cost_usd=0.75))
    rid = any_store.reserve_spend(a.id, 0.25, 1.0, lease_s=60)
    assert rid is not None and any_store.reserve_spend(a.id, 0.01, 1.0, lease_s=60) is None
    tenant = any_store.reset_spend("a")
    assert (tenant.spend_usd, tenant.reserved_usd) == (0.0, pytest.approx(0.25))
    assert any_store.reserve_spend(a.id, 0.75, 1.0, lease_s=60) is not None
    assert len(any_store.query_usage(UsageQuery(tenant_id=a.id))) == 1
    with pytest.raises(NotFoundError):
        any_store.reset_spend("nobody")



def test_delete_tenant_revokes_its_keys_with_a_version_bump_and_keeps_its_ledger(
        any_store: SQLStore) -> None:
    """One transaction marks the tenant deleted, revokes its live keys and bumps the
    auth version; a request in flight still settles (record, spend, its reservation
    given back); the records stay; a deleted tenant is found only with deleted=True."""
    a = any_store.create_tenant("a", TenantSettings(budget_usd=1.0))
    b = any_store.create_tenant("b", TenantSettings())
    (k1, p1), (k2, _) = (any_store.create_key("a", KeySettings()) for _ in range(2))
    any_store.revoke_key(k2.id)
    _, other = any_store.create_key("b", KeySettings())
    rid = any_store.reserve_spend(a.id, 0.25, 1.0, lease_s=60)
    assert rid is not None
    version = any_store.auth_version()
    tenant, revoked = any_store.delete_tenant("a")
    assert tenant.deleted_at is not None and revoked == [k1.id]  # k2 was revoked already
    assert any_store.auth_version() > version
    assert any_store.authenticate(p1) is None and any_store.authenticate(other) is not None
    any_store.record_usage_many([UsageRecord(
        request_id="in-flight", tenant_id=a.id, key_id=k1.id, endpoint="/v1/completions",
        model="m", status="ok", http_status=200, cost_usd=0.1)], released=[rid])
    kept = any_store.get_tenant(a.id, deleted=True)
    assert (kept.spend_usd, kept.reserved_usd) == (pytest.approx(0.1), pytest.approx(0.0))
    assert [r.request_id for r in any_store.query_usage(UsageQuery(tenant_id=a.id))] == [
        "in-flight"]
    assert [t.id for t in any_store.list_tenants()] == [b.id]
    for call in (lambda: any_store.get_tenant("a"), lambda: any_store.delete_tenant(a.id),
                 lambda: any_store.create_key("a", KeySettings()),
                 lambda: any_store.update_tenant("a", {"rpm": 1}),
                 lambda: any_store.reset_spend("a")):
        with pytest.raises(NotFoundError):
            call()
    with pytest.raises(InvalidRequestError) as exc:
        any_store.create_tenant("a", TenantSettings())
    assert exc.value.param == "name"


def start_together(url: str, prefix: str, n: int) -> tuple[list[SQLStore], list[Exception]]:
    """`n` stores on `prefix` constructed at the same moment, one thread each."""
    import threading

    barrier = threading.Barrier(n)
    stores: list[SQLStore] = []
    errors: list[Exception] = []

    def start() -> None:
        barrier.wait()
        try:
            stores.append(SQLStore(url, table_prefix=prefix))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return stores, errors


@pytest.mark.services
def test_replicas_starting_together_on_a_new_postgres_database_all_start() -> None:
    """Two gateways started at once on a database without the tables (a first deploy
    of two replicas) both ran CREATE TABLE; the loser failed at start with "duplicate
    key value violates unique constraint pg_type_typname_nsp_index". The schema is made
    under an advisory lock; each round here starts four stores at once on fresh tables."""
    import uuid

    from .conftest import PG_URL

    for _ in range(3):
        prefix = f"t{uuid.uuid4().hex[:10]}_"
        stores, errors = start_together(PG_URL, prefix, 4)
        try:
            assert errors == [] and len(stores) == 4
            stores[0].create_tenant("acme", TenantSettings())
            assert stores[3].get_tenant("acme").name == "acme"
        finally:
            cleanup = stores[0] if stores else SQLStore(PG_URL, table_prefix=prefix)
            cleanup.drop_all()
            for store in stores or [cleanup]:
                store.close()
