"""Durable gateway state: tenants, API keys, the usage ledger / audit log, the Responses
API's stored responses (`StoredResponse`, gateway/responses.py) and OpenAI's
conversations (`StoredConversation`, gateway/conversations.py).

`Store` is the contract; `SQLStore` implements it on SQLAlchemy Core, SQLite (WAL) by
default and PostgreSQL when given a URL. Two properties matter for exactness:

* a usage record and the tenant's spend change commit in **one transaction**
  (`record_usage`), so spend always equals the sum of the ledger's costs, and a crash
  never leaves one without the other;
* writing a record is idempotent: each has a `record_id` (unique in the table), the
  insert skips a record already there (`ON CONFLICT DO NOTHING`), and only the rows it
  inserted add to spend, each once (also a record that appears twice in one batch).
  On PostgreSQL the batch is one constant statement over column arrays (`unnest`), so
  it is prepared once per connection instead of parsed per batch. A commit whose reply
  was lost (the connection broke during `COMMIT`) may or may not have been applied; `LedgerWriter` writes the batch again
  and neither the row nor its cost is counted twice;
* a budget holds under concurrency: admission reserves a request's worst-case cost
  with one conditional UPDATE (`reserve_spend`: reserved += cost only where
  spend + reserved + cost <= budget) plus a row in `reservations` (a lease), and the
  same transaction that writes the request's record deletes that row and takes its
  cost off `reserved_usd`. PostgreSQL re-checks the WHERE clause on the row's newest
  version after a concurrent UPDATE, and SQLite runs one writer at a time, so no two
  requests (on any replica) can both take the last of a budget. A replica that dies
  with requests in flight leaves their rows behind; `expire_reservations` gives back
  the ones past their lease. Whoever deletes a reservation row (settlement or sweep)
  is the one that subtracts it, so it is released exactly once;
* every change that matters for admission (`revoke_key`, `update_key`, `update_tenant`,
  `delete_tenant`) also bumps
  one counter row (`auth_version`) in the same transaction; gateways cache
  authenticated keys (`gateway/keycache.py`) and read only that row per request, so
  a revoked key is refused by every replica sharing the database from the next
  request on, without a join or settings parse per request. Redis mirrors of that
  row (`gateway/auth_mirror.py`) are registered in `auth_mirrors`; a change tells
  each of them its new version after it commits, before it returns.

All methods are synchronous (SQLAlchemy Core); the middleware calls them through
`asyncio.to_thread`. Timestamps are float seconds since the epoch.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import mmap
import operator
import re
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from sluice import env
from sluice.gateway import auth_mirror
from sluice.gateway.config import priority_value
from sluice.gateway.keys import generate_key, hash_key, new_id
from sluice.protocol.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from sluice.protocol.ids import unique_hex

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TenantSettings:
    """What an operator sets on a tenant. `None` limits mean unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    budget_usd: float | None = None
    soft_budget_usd: float | None = None
    priority_class: str = "standard"
    allowed_models: tuple[str, ...] | None = None
    store_bodies: bool = False

    def __post_init__(self) -> None:
        _check_limits(self.rpm, self.tpm, self.max_concurrent)
        priority_value(self.priority_class)
        for name in ("budget_usd", "soft_budget_usd"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidRequestError(f"{name} must be >= 0", param=name)


@dataclass(frozen=True)
class KeySettings:
    """What a key may narrow below its tenant: limits, models, priority class."""

    name: str = ""
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    allowed_models: tuple[str, ...] | None = None
    priority_class: str | None = None

    def __post_init__(self) -> None:
        _check_limits(self.rpm, self.tpm, self.max_concurrent)
        if self.priority_class is not None:
            priority_value(self.priority_class)


def _check_limits(*values: int | None) -> None:
    for name, value in zip(("rpm", "tpm", "max_concurrent"), values, strict=True):
        if value is not None and value < 0:
            raise InvalidRequestError(f"{name} must be >= 0", param=name)


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    settings: TenantSettings
    spend_usd: float
    created_at: float
    reserved_usd: float = 0.0  # worst-case cost of this tenant's requests in flight
    deleted_at: float | None = None  # `delete_tenant`: its keys revoked, its row kept


@dataclass(frozen=True)
class ApiKey:
    id: str
    tenant_id: str
    display: str
    settings: KeySettings
    created_at: float
    revoked_at: float | None


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key and its tenant, as read at the start of this request."""

    key: ApiKey
    tenant: Tenant


def new_record_id() -> str:
    """Unique (protocol/ids.py): two records never share one, so a duplicate is a retry."""
    return unique_hex()


@dataclass(frozen=True)
class UsageRecord:
    """One line of the ledger / audit log: exactly one per request that got past auth.

    `request_id` is the client's `x-request-id` when it sent one (two requests may share
    it); `record_id` is the gateway's own key for the row, which makes a retried write a
    no-op (None on rows written before it existed)."""

    request_id: str
    tenant_id: str
    key_id: str
    endpoint: str
    model: str | None
    status: str  # ok | error | aborted | rejected
    http_status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    latency_ms: float = 0.0
    ts: float = field(default_factory=time.time)
    request_body: str | None = None
    response_body: str | None = None
    record_id: str | None = field(default_factory=new_record_id)


MAX_USAGE_ROWS = 100_000  # one usage query's `limit` at most


@dataclass(frozen=True)
class StoredConversation:
    """OpenAI's Conversations API: a tenant's conversation (its items are rows of their
    own, in order; gateway/conversations.py). Kept until deleted, as OpenAI keeps them."""

    id: str
    tenant_id: str
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class RunAdmission:
    """What admission decided for a background response that its ledger row needs: kept
    with the run while it runs, so that whoever ends it once its replica is gone writes
    the row that replica would have (gateway/responses.py `StoredResponses.end_lapsed`)."""

    request_id: str
    prompt_tokens: int  # as counted at admission
    reservation: str | None = None  # its budget reservation, given back with the row


@dataclass(frozen=True)
class StoredResponse:
    """A Responses API response kept for its tenant (`store`, the default: gateway/
    responses.py): the Response object as the client got it, the input items of its own
    request (ids given), and the response it continued (`previous_response_id`), so a
    conversation is its chain. Found until `expires_at` (None: kept until deleted).
    A background response still running names the gateway replica that runs it
    (`owner`), which renews `lease_until` while it lives, and what its ledger row needs
    (`admission`; None on rows kept by an older sluice)."""

    id: str
    tenant_id: str
    key_id: str
    previous_id: str | None
    input_items: list[dict[str, Any]]
    response: dict[str, Any]
    created_at: float = field(default_factory=time.time)
    expires_at: float | None = None
    owner: str | None = None
    lease_until: float | None = None
    admission: RunAdmission | None = None


@dataclass(frozen=True)
class UsageTotals:
    """Sums over every record a `UsageQuery` matches, whatever its `limit`."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0


def parse_time(text: str | None, now: float | None = None) -> float | None:
    """Epoch seconds, ISO 8601, or an age (`30m`, `24h`, `7d`) before now. Anything
    else, or a time that is not finite, is a ValueError that says which forms work.
    The one parser of `since`/`until`: `sluice usage` and `/v1/usage`, `/admin/usage`."""
    if text is None:
        return None
    now = time.time() if now is None else now
    age = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if age:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}[age.group(2)]
        return now - float(age.group(1)) * unit
    try:
        value = float(text)
    except ValueError:
        try:
            value = datetime.fromisoformat(text).timestamp()
        except (ValueError, OverflowError, OSError):
            value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a time: give epoch seconds, an ISO 8601 time "
                         "(2026-01-31T12:00:00) or an age like 30m, 24h or 7d")
    return value


@dataclass(frozen=True)
class UsageQuery:
    tenant_id: str | None = None
    key_id: str | None = None
    since: float | None = None
    until: float | None = None
    limit: int = 1000

    def __post_init__(self) -> None:
        """A 400 naming the parameter for what no database column can hold (a `limit`
        past 64 bits was a 500 from SQLite) or that means nothing (NaN, infinity)."""
        if not 1 <= self.limit <= MAX_USAGE_ROWS:
            raise InvalidRequestError(f"limit must be between 1 and {MAX_USAGE_ROWS}, got "
                                      f"{self.limit}", param="limit")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite timestamp", param=name)


class Store(ABC):
    """Contract for gateway state. Implementations must make `record_usage` atomic
    (ledger row + spend in one transaction), must not cache `authenticate`, and must
    change `auth_version` in the transaction of every change that can refuse a key
    that authenticated before (revocation, tenant settings)."""

    local_reads: bool = False  # auth_version is a local read (no network): may run inline

    @abstractmethod
    def create_tenant(self, name: str, settings: TenantSettings) -> Tenant: ...

    @abstractmethod
    def update_tenant(self, ref: str, changes: dict[str, Any]) -> Tenant: ...

    @abstractmethod
    def get_tenant(self, ref: str, *, deleted: bool = False) -> Tenant:
        """By id or name; raises NotFoundError. A deleted tenant is found only with
        `deleted=True` (its usage records are still read by it)."""

    @abstractmethod
    def delete_tenant(self, ref: str) -> tuple[Tenant, list[str]]:
        """Mark the tenant deleted and revoke every live key of it in one transaction
        that bumps the auth version (as `revoke_key`), so every replica refuses them
        from its next request; returns the tenant and the ids of the keys revoked.
        Its usage records stay (the ledger is an audit record), its row too (the
        records name it, and its requests in flight still settle their spend into it);
        its name stays taken. Raises NotFoundError (also for one already deleted)."""

    @abstractmethod
    def reset_spend(self, ref: str) -> Tenant:
        """Set the tenant's spend to 0 (a new budget period), atomically against the
        settlements adding to it; its requests in flight keep their reservations."""

    @abstractmethod
    def list_tenants(self) -> list[Tenant]: ...

    @abstractmethod
    def create_key(self, tenant_ref: str, settings: KeySettings) -> tuple[ApiKey, str]:
        """Returns the key record and its plaintext (shown once, never stored)."""

    @abstractmethod
    def list_keys(self, tenant_id: str | None = None) -> list[ApiKey]: ...

    @abstractmethod
    def get_key(self, key_id: str) -> ApiKey:
        """One key's settings and state (never its secret); raises NotFoundError."""

    @abstractmethod
    def update_key(self, key_id: str, changes: dict[str, Any]) -> ApiKey:
        """Change a key's settings (its limits, models, class, name); bumps the auth
        version as a tenant change does. Raises NotFoundError."""

    @abstractmethod
    def revoke_key(self, key_id: str) -> ApiKey: ...

    @abstractmethod
    def authenticate(self, plaintext: str) -> Principal | None:
        """The live key and tenant for a plaintext key; None if unknown or revoked."""

    @abstractmethod
    def auth_version(self) -> int:
        """A counter that changes with every revocation or tenant change (on any
        replica sharing this store): a cached `authenticate` answer read at version v
        is still the store's answer while `auth_version()` returns v."""

    def reserve_spend(self, tenant_id: str, cost_usd: float, budget_usd: float,
                      lease_s: float) -> str | None:
        """Add `cost_usd` to the tenant's reserved spend iff spend + reserved + cost stays
        within `budget_usd` (to a nano-dollar), atomically against every other
        reservation and settlement on any replica; returns the reservation's id, which
        expires `lease_s` from now. None (nothing reserved) if it does not fit."""
        return self.reserve_spend_many([(tenant_id, cost_usd, budget_usd)], lease_s)[0]

    @abstractmethod
    def reserve_spend_many(self, requests: Sequence[tuple[str, float, float]],
                           lease_s: float) -> list[str | None]:
        """`reserve_spend` for several (tenant id, cost, budget) in one transaction (group
        commit), each seeing the ones before it; one id or None per request, in order."""

    @abstractmethod
    def expire_reservations(self, now: float | None = None) -> int:
        """Give back reservations whose lease ended before `now` (their gateway died or
        the request outlived the lease); returns how many."""

    def record_usage(self, record: UsageRecord) -> None:
        """Append to the ledger and add its cost to the tenant's spend, atomically."""
        self.record_usage_many([record])

    @abstractmethod
    def record_usage_many(self, records: list[UsageRecord],
                          released: Sequence[str] = ()) -> None:
        """Several records in one transaction (group commit), each atomically with its
        tenant's spend; the reservations `released` (ids from `reserve_spend`) are
        given back in that same transaction (those already expired: nothing to do).
        Idempotent: a record whose `record_id` is already written, and a reservation
        already given back, change nothing, so a batch may be written again.
        Raises `ServiceUnavailableError` when the database cannot be reached (the
        batch may or may not have been committed: write it again later); any other
        error means the store refused these records."""

    @abstractmethod
    def query_usage(self, query: UsageQuery) -> list[UsageRecord]:
        """The first `query.limit` matching records, oldest first."""

    @abstractmethod
    def usage_totals(self, query: UsageQuery) -> UsageTotals:
        """Totals over every record `query` matches, not only the first `limit`."""

    @abstractmethod
    def purge(self, older_than: float) -> int:
        """Delete ledger rows with ts < older_than; returns how many."""

    @abstractmethod
    def save_response(self, stored: StoredResponse) -> None:
        """Keep a response (its id is new: a second save of one id replaces it), and
        delete the responses past their `expires_at` while at it."""

    @abstractmethod
    def get_response(self, response_id: str, tenant_id: str) -> StoredResponse | None:
        """The tenant's response by id; None if there is none, it expired, or it is
        another tenant's (a tenant never learns that another's id exists)."""

    @abstractmethod
    def delete_response(self, response_id: str, tenant_id: str) -> bool:
        """Delete the tenant's response; False if `get_response` would not find it."""

    @abstractmethod
    def add_response_events(self, events: list[tuple[str, int, str]],
                            expires_at: float | None) -> None:
        """Keep more of background responses' streams: (response id, sequence number, the
        SSE event), found by `response_events` until `expires_at`, or until the response
        is deleted; one already kept is skipped (writing it again is harmless)."""

    @abstractmethod
    def response_events(self, response_id: str, after: int,
                        limit: int) -> list[tuple[int, str]]:
        """Up to `limit` of a response's kept events numbered after `after`, in order."""

    @abstractmethod
    def last_response_event(self, response_id: str) -> int:
        """The number of a response's last kept event; -1 without any."""

    @abstractmethod
    def renew_runs(self, owner: str, lease_until: float) -> list[str]:
        """Extend to `lease_until` the lease of the background responses `owner` runs;
        the ids of those another replica asked to cancel (`ask_cancel`)."""

    @abstractmethod
    def lapsed_runs(self, now: float, limit: int, but: str) -> list[StoredResponse]:
        """Up to `limit` running background responses whose lease ended before `now`
        (their replica is gone), of any tenant, oldest lease first; none that replica
        `but` runs (the caller's own)."""

    @abstractmethod
    def ask_cancel(self, response_id: str, tenant_id: str) -> bool:
        """Ask the replica that runs the tenant's background response to cancel it (its
        next `renew_runs` says so); False if no replica runs it."""

    @abstractmethod
    def end_orphan(self, stored: StoredResponse, response: dict[str, Any]) -> bool:
        """Replace a running background response whose lease has ended (as `stored` was
        read) by `response`, its end; False if its owner renewed or ended it since."""

    @abstractmethod
    def create_conversation(self, conversation: StoredConversation,
                            items: list[dict[str, Any]]) -> None:
        """A new conversation and its first items, in one transaction."""

    @abstractmethod
    def get_conversation(self, conversation_id: str,
                         tenant_id: str) -> StoredConversation | None:
        """The tenant's conversation; None if there is none (or it is another tenant's)."""

    @abstractmethod
    def update_conversation(self, conversation_id: str, tenant_id: str,
                            metadata: dict[str, str]) -> StoredConversation | None:
        """Replace its metadata; None if `get_conversation` would not find it."""

    @abstractmethod
    def delete_conversation(self, conversation_id: str, tenant_id: str) -> bool:
        """Delete the conversation and its items; False if not found."""

    @abstractmethod
    def add_conversation_items(self, conversation_id: str, tenant_id: str,
                               items: list[dict[str, Any]]) -> bool:
        """Append items (each with its `id`), in order, after those already there, in
        one transaction; False if the conversation is not found."""

    @abstractmethod
    def conversation_items(self, conversation_id: str,
                           tenant_id: str) -> list[dict[str, Any]] | None:
        """Its items, oldest first; None if the conversation is not found."""

    @abstractmethod
    def delete_conversation_item(self, conversation_id: str, tenant_id: str,
                                 item_id: str) -> bool:
        """Delete one item; False if the conversation or the item is not found."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


# What a lost database looks like through SQLAlchemy: refused or broken connections
# (OperationalError, also SQLite's "database is locked"), a closed one, an exhausted pool.
OUTAGES = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError)

# Rounding slack when a reservation is compared with a budget: float sums of costs
# that fit a budget exactly must not be refused for the last bit.
BUDGET_SLACK_USD = 1e-9


def default_database_url() -> str:
    """SQLite under `sluice.env.home()`."""
    path = env.home() / "sluice.db"
    return f"sqlite:///{path}"


AUTH_VERSION_ROW = "auth"
MAX_TENANT_NAME = 200  # characters: the tenants.name column


def _tables(prefix: str) -> tuple[sa.MetaData, sa.Table, sa.Table, sa.Table, sa.Table,
                                  sa.Table, sa.Table, sa.Table, sa.Table, sa.Table, sa.Table]:
    md = sa.MetaData()
    tenants = sa.Table(
        f"{prefix}tenants", md,
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(MAX_TENANT_NAME), nullable=False, unique=True),
        sa.Column("settings", sa.Text, nullable=False),
        sa.Column("spend_usd", sa.Float, nullable=False, default=0.0),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("reserved_usd", sa.Float, nullable=False, default=0.0, server_default="0"),
        sa.Column("deleted_at", sa.Float, nullable=True),
    )
    keys = sa.Table(
        f"{prefix}keys", md,
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey(tenants.c.id), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False, unique=True),
        sa.Column("display", sa.String(40), nullable=False),
        sa.Column("settings", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("revoked_at", sa.Float, nullable=True),
    )
    usage = sa.Table(
        f"{prefix}usage", md,
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("ts", sa.Float, nullable=False, index=True),
        sa.Column("tenant_id", sa.String(40), nullable=False, index=True),
        sa.Column("key_id", sa.String(40), nullable=False),
        sa.Column("endpoint", sa.String(100), nullable=False),
        sa.Column("model", sa.String(200), nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("http_status", sa.Integer, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("cost_usd", sa.Float, nullable=False),
        sa.Column("latency_ms", sa.Float, nullable=False),
        sa.Column("request_body", sa.Text, nullable=True),
        sa.Column("response_body", sa.Text, nullable=True),
        sa.Column("record_id", sa.String(40), nullable=True),
        sa.Index(f"{prefix}usage_record_id", "record_id", unique=True),
    )
    reservations = sa.Table(
        f"{prefix}reservations", md,
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("cost_usd", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False, index=True),
    )
    versions = sa.Table(  # one row per counter; `auth` guards cached keys
        f"{prefix}versions", md,
        sa.Column("name", sa.String(40), primary_key=True),
        sa.Column("version", sa.BigInteger, nullable=False),
    )
    mirrors = sa.Table(  # Redis copies of the auth version (gateway/auth_mirror.py)
        f"{prefix}auth_mirrors", md,
        sa.Column("url", sa.String(500), primary_key=True),
        sa.Column("redis_key", sa.String(100), nullable=False),
        sa.Column("seen_at", sa.Float, nullable=False),  # a gateway used it (touch)
    )
    responses = sa.Table(  # the Responses API's stored responses (StoredResponse)
        f"{prefix}responses", md,
        sa.Column("id", sa.String(100), primary_key=True),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("key_id", sa.String(40), nullable=False),
        sa.Column("previous_id", sa.String(100), nullable=True),
        sa.Column("input_items", sa.Text, nullable=False),
        sa.Column("response", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=True, index=True),
        # a running background response: the replica that runs it, until when it said
        # so last, and when another replica asked it to cancel the run
        sa.Column("owner", sa.String(40), nullable=True, index=True),
        sa.Column("lease_until", sa.Float, nullable=True),
        sa.Column("cancel_at", sa.Float, nullable=True),
        # and what its ledger row needs if that replica dies (RunAdmission)
        sa.Column("request_id", sa.String(64), nullable=True),
        sa.Column("prompt_tokens", sa.Integer, nullable=True),
        sa.Column("reservation_id", sa.String(40), nullable=True),
    )
    events = sa.Table(  # a background response's stream, for any replica to follow
        f"{prefix}response_events", md,
        sa.Column("response_id", sa.String(100), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("event", sa.Text, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=True, index=True),
    )
    conversations = sa.Table(  # OpenAI's Conversations API (StoredConversation)
        f"{prefix}conversations", md,
        sa.Column("id", sa.String(100), primary_key=True),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("metadata", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    items = sa.Table(  # a conversation's items, in `seq` order
        f"{prefix}conversation_items", md,
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("conversation_id", sa.String(100), nullable=False, index=True),
        sa.Column("item_id", sa.String(100), nullable=False),
        sa.Column("item", sa.Text, nullable=False),
    )
    return (md, tenants, keys, usage, reservations, versions, mirrors, responses,
            events, conversations, items)


def _dump(settings: TenantSettings | KeySettings) -> str:
    return json.dumps(asdict(settings))


def _tenant_settings(text: str) -> TenantSettings:
    data = json.loads(text)
    if data.get("allowed_models") is not None:
        data["allowed_models"] = tuple(data["allowed_models"])
    return TenantSettings(**data)


def _key_settings(text: str) -> KeySettings:
    data = json.loads(text)
    if data.get("allowed_models") is not None:
        data["allowed_models"] = tuple(data["allowed_models"])
    return KeySettings(**data)


def _unnest_insert(engine: sa.Engine, usage: sa.Table) -> tuple[str, list[str]] | None:
    """PostgreSQL's batch insert as one constant statement: one array parameter per
    column, unnested into rows in batch order. The multi-row VALUES statement it replaces
    had a different text for every batch size, so psycopg split and the server parsed
    and planned it per batch (20% of the commit thread's samples under load); this text
    never changes, so psycopg prepares it once per connection. Returns the statement and
    its columns (the table's, but its own `seq`); None on SQLite. Strings travel as
    `text[]`: a cast to `varchar(n)[]` would cut a long value where the insert refuses it."""
    if engine.dialect.name != "postgresql":
        return None
    columns = [c for c in usage.columns if not c.primary_key]
    quote = engine.dialect.identifier_preparer.quote
    names = ", ".join(quote(c.name) for c in columns)
    arrays = ", ".join(
        f"%({c.name})s::{'text' if isinstance(c.type, sa.String) else c.type.compile(engine.dialect)}[]"
        for c in columns)
    return (f"INSERT INTO {quote(usage.name)} ({names}) "
            f"SELECT {names} FROM unnest({arrays}) WITH ORDINALITY AS batch({names}, n) "
            f"ORDER BY n ON CONFLICT DO NOTHING RETURNING record_id",
            [c.name for c in columns])


_ROWS_A_STATEMENT = 64  # x 15 columns: under SQLite's oldest limit of 999 parameters


def _rows_insert(engine: sa.Engine, usage: sa.Table
                 ) -> tuple[Callable[[int], str], Callable[[list[UsageRecord]], tuple[Any, ...]]]:
    """SQLite's batch insert: a multi-row VALUES statement for n rows (its text, cached
    per n) and the function that lays records out as its parameters. Run below
    SQLAlchemy's insert construct (its `insertmanyvalues` bound and sorted each row in
    Python: ~20 us a record against ~5 here, the commit thread's GIL taken from the
    requests it serves). Strings are cut to their column's width by the statement
    (`substr`), as `SQLStore._fit` cuts them for PostgreSQL, without a Python pass."""
    columns = [c for c in usage.columns if not c.primary_key]
    quote = engine.dialect.identifier_preparer.quote
    head = (f"INSERT INTO {quote(usage.name)} ({', '.join(quote(c.name) for c in columns)}) "
            "VALUES ")
    row = "(" + ", ".join(f"substr(?, 1, {c.type.length})"
                          if isinstance(c.type, sa.String) and c.type.length else "?"
                          for c in columns) + ")"
    fields_of = operator.attrgetter(*(c.name for c in columns))

    @functools.cache
    def statement_for(n: int) -> str:
        return head + ", ".join([row] * n) + " ON CONFLICT DO NOTHING RETURNING record_id"

    def values(records: list[UsageRecord]) -> tuple[Any, ...]:
        return tuple(itertools.chain.from_iterable(map(fields_of, records)))

    return statement_for, values


def _admission_row(admission: RunAdmission | None) -> dict[str, Any]:
    """A `RunAdmission` as the responses table's columns (all None without one)."""
    if admission is None:
        return {"request_id": None, "prompt_tokens": None, "reservation_id": None}
    return {"request_id": admission.request_id[:64],  # (as the ledger cuts it: `_fit`)
            "prompt_tokens": admission.prompt_tokens, "reservation_id": admission.reservation}


def _stored_response(row: Any) -> StoredResponse:
    """A row of the responses table as the `StoredResponse` it keeps."""
    admission = None if row.request_id is None else RunAdmission(
        row.request_id, int(row.prompt_tokens or 0), row.reservation_id)
    return StoredResponse(row.id, row.tenant_id, row.key_id, row.previous_id,
                          json.loads(row.input_items), json.loads(row.response),
                          row.created_at, row.expires_at, row.owner, row.lease_until,
                          admission)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def _spend(records: list[UsageRecord], inserted: set[str]) -> dict[str, float]:
    """Per tenant, the cost of the records just inserted (a record twice in one batch,
    or one already in the ledger, counts once or not at all)."""
    inserted = set(inserted)
    spend: dict[str, float] = {}
    for r in records:
        if r.record_id not in inserted:
            continue
        if r.record_id is not None:
            inserted.discard(r.record_id)
        if r.cost_usd:
            spend[r.tenant_id] = spend.get(r.tenant_id, 0.0) + r.cost_usd
    return spend


class WalCommits:
    """Whether any connection committed to a SQLite database in WAL mode since the last
    look, without a query: every transaction changes the wal-index header, the first 96
    bytes of the `<database>-shm` file (two copies of a header whose `iChange` counter
    each transaction increments; https://www.sqlite.org/walformat.html), which every
    connection on the machine maps. A header that differs in any byte, a torn read
    included, counts as a commit, so the answer errs only towards a query."""

    def __init__(self, shm: Path) -> None:
        with open(shm, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 96, access=mmap.ACCESS_READ)
        self._seen = b""

    @classmethod
    def of(cls, engine: sa.Engine) -> WalCommits | None:
        """For a SQLite file database whose -shm file exists (a connection is open in
        WAL mode); None otherwise (a query each time, as before)."""
        path = engine.url.database if engine.dialect.name == "sqlite" else None
        if not path or path == ":memory:" or path.startswith("file:"):
            return None
        try:
            return cls(Path(path + "-shm"))
        except (OSError, ValueError):  # no -shm yet (not WAL), or shorter than a header
            return None

    def since_last_look(self) -> bool:
        header = self._map[:96]
        if header == self._seen:
            return False
        self._seen = header
        return True


class SQLStore(Store):
    """`Store` on SQLAlchemy Core. `url=None` means SQLite at `sluice.env.home()/sluice.db`.

    `table_prefix` lets several deployments (or test runs) share one database.
    Tables are created on construction if missing.
    """

    def __init__(self, url: str | None = None, table_prefix: str = "sluice_") -> None:
        url = url or default_database_url()
        if url.startswith("postgresql://"):
            url = "postgresql+psycopg://" + url[len("postgresql://"):]
        self.url = url
        self.engine = self._make_engine(url)
        self.local_reads = self.engine.dialect.name == "sqlite"
        (self.metadata, self.tenants, self.keys, self.usage,
         self.reservations, self.versions, self.mirrors, self.responses,
         self.stream_events, self.conversations, self.items) = _tables(table_prefix)
        self._create_schema(table_prefix)
        self._add_version_row()
        self._prepare()

    def _create_schema(self, prefix: str) -> None:
        """The tables, and the columns a table made by an older sluice lacks, in one
        transaction; on PostgreSQL under an advisory lock named after the prefix, so
        replicas starting together on a new database make them once (each ran CREATE
        TABLE, and all but one failed at start on a duplicate `pg_type` row)."""
        with self.engine.begin() as conn:
            if self.engine.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext(:name))"),
                             {"name": f"sluice schema {prefix}"})
            self.metadata.create_all(conn)
            self._add_column(conn, self.tenants, "reserved_usd", "FLOAT NOT NULL DEFAULT 0")
            self._add_column(conn, self.tenants, "deleted_at", "FLOAT")
            if self._add_column(conn, self.usage, "record_id", "VARCHAR(40)"):
                self._add_index(conn, self.usage, "record_id")
            if self._add_column(conn, self.responses, "owner", "VARCHAR(40)"):
                self._add_index(conn, self.responses, "owner")  # (each renewal reads it)
            self._add_column(conn, self.responses, "lease_until", "FLOAT")
            self._add_column(conn, self.responses, "cancel_at", "FLOAT")
            self._add_column(conn, self.responses, "request_id", "VARCHAR(64)")
            self._add_column(conn, self.responses, "prompt_tokens", "INTEGER")
            self._add_column(conn, self.responses, "reservation_id", "VARCHAR(40)")

    def _add_version_row(self) -> None:
        """The `auth` counter row, once (replicas starting together may race: fine)."""
        v = self.versions
        with self.engine.begin() as conn:
            if conn.execute(sa.select(v.c.version).where(v.c.name == AUTH_VERSION_ROW)).first():
                return
        with contextlib.suppress(sa.exc.IntegrityError), self.engine.begin() as conn:
            conn.execute(v.insert().values(name=AUTH_VERSION_ROW, version=0))

    def _add_column(self, conn: sa.Connection, table: sa.Table, column: str, ddl: str) -> bool:
        """Tables created by an older sluice lack later columns (`tenants.reserved_usd`,
        `usage.record_id`): add `column` if missing; True if it was."""
        if column in {c["name"] for c in sa.inspect(conn).get_columns(table.name)}:
            return False
        quoted = self.engine.dialect.identifier_preparer.quote(table.name)
        guard = "IF NOT EXISTS " if self.engine.dialect.name == "postgresql" else ""
        conn.execute(sa.text(f"ALTER TABLE {quoted} ADD COLUMN {guard}{column} {ddl}"))
        return True

    def _add_index(self, conn: sa.Connection, table: sa.Table, column: str) -> None:
        """The index `create_all` makes on a new table's `column`, on an old one (its rows
        keep NULL there, which a unique index allows any number of)."""
        quote = self.engine.dialect.identifier_preparer.quote
        index = next(i for i in table.indexes if column in i.columns)
        unique = "UNIQUE " if index.unique else ""
        conn.execute(sa.text(f"CREATE {unique}INDEX IF NOT EXISTS {quote(str(index.name))} "
                             f"ON {quote(table.name)} ({column})"))

    def _prepare(self) -> None:
        """Build the per-request statements once (they run on every request)."""
        k, t, u = self.keys, self.tenants, self.usage
        self._auth_stmt = (
            sa.select(k, t.c.name, t.c.settings.label("t_settings"), t.c.spend_usd,
                      t.c.created_at.label("t_created"), t.c.reserved_usd)
            .join(t, t.c.id == k.c.tenant_id)
            .where(k.c.digest == sa.bindparam("digest"), k.c.revoked_at.is_(None),
                   t.c.deleted_at.is_(None)))
        self._insert_rows = _rows_insert(self.engine, u)
        self._widths = {c.name: c.type.length for c in u.columns
                        if isinstance(c.type, sa.String) and c.type.length}
        self._insert_unnest = _unnest_insert(self.engine, u)
        v = self.versions
        self._version_sql = str(sa.select(v.c.version).where(v.c.name == AUTH_VERSION_ROW)
                                .compile(self.engine, compile_kwargs={"literal_binds": True}))
        self._version_conn: Any = None
        self._version: int | None = None  # as last read (SQLite: while `_commits` says so)
        self._commits: WalCommits | None = None
        self._version_lock = threading.Lock()
        self._mirror_clients: dict[str, Any] = {}  # Redis URL -> client (auth mirrors)
        self._mirror_lock = threading.Lock()
        self._bump_stmt = (v.update().where(v.c.name == AUTH_VERSION_ROW)
                           .values(version=v.c.version + 1).returning(v.c.version))
        settle = (t.update().where(t.c.id == sa.bindparam("tid"))
                  .values(spend_usd=t.c.spend_usd + sa.bindparam("cost"),
                          reserved_usd=t.c.reserved_usd - sa.bindparam("released"))
                  .compile(dialect=self.engine.dialect))  # the DBAPI's own text
        self._settle_sql, self._settle_order = str(settle), settle.positiontup
        self._ledger_conn: Any = None
        self._ledger_lock = threading.Lock()
        dbapi: Any = self.engine.dialect.dbapi
        self._driver_outages = (dbapi.OperationalError, dbapi.InterfaceError)
        self._reserve = (t.update()
                         .where(t.c.id == sa.bindparam("tid"),
                                t.c.spend_usd + t.c.reserved_usd + sa.bindparam("cost")
                                <= sa.bindparam("budget") + BUDGET_SLACK_USD)
                         .values(reserved_usd=t.c.reserved_usd + sa.bindparam("cost")))

    @staticmethod
    def _make_engine(url: str) -> sa.Engine:
        if not url.startswith("sqlite"):
            return sa.create_engine(url, pool_pre_ping=True, pool_size=10)
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"check_same_thread": False})
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine

    # -- tenants ---------------------------------------------------------------------

    def create_tenant(self, name: str, settings: TenantSettings) -> Tenant:
        if not name:
            raise InvalidRequestError("tenant name must not be empty", param="name")
        if len(name) > MAX_TENANT_NAME:  # PostgreSQL refused it: a traceback, a 500
            raise InvalidRequestError(f"tenant name is longer than {MAX_TENANT_NAME} "
                                      "characters", param="name")
        tenant = Tenant(new_id("tn"), name, settings, 0.0, time.time())
        try:
            with self.engine.begin() as conn:
                conn.execute(self.tenants.insert().values(
                    id=tenant.id, name=name, settings=_dump(settings),
                    spend_usd=0.0, created_at=tenant.created_at))
        except sa.exc.IntegrityError:
            raise InvalidRequestError(f"tenant {name!r} already exists (a deleted tenant's "
                                      "name stays with its usage records)",
                                      param="name") from None
        return tenant

    def update_tenant(self, ref: str, changes: dict[str, Any]) -> Tenant:
        known = {f.name for f in fields(TenantSettings)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InvalidRequestError(f"unknown tenant setting(s): {unknown}", param=unknown[0])
        with self.engine.begin() as conn:
            tenant = self._tenant_row(conn, ref)
            settings = replace(tenant.settings, **changes)
            conn.execute(self.tenants.update().where(self.tenants.c.id == tenant.id)
                         .values(settings=_dump(settings)))
            announced = self._bump(conn)
        self._tell_mirrors(*announced)
        return replace(tenant, settings=settings)

    def get_tenant(self, ref: str, *, deleted: bool = False) -> Tenant:
        with self.engine.connect() as conn:
            return self._tenant_row(conn, ref, deleted=deleted)

    def delete_tenant(self, ref: str) -> tuple[Tenant, list[str]]:
        t, k, now = self.tenants, self.keys, time.time()
        with self.engine.begin() as conn:
            tenant = self._tenant_row(conn, ref)
            conn.execute(t.update().where(t.c.id == tenant.id).values(deleted_at=now))
            revoked = conn.execute(k.update().where(k.c.tenant_id == tenant.id,
                                                    k.c.revoked_at.is_(None))
                                   .values(revoked_at=now).returning(k.c.id)).scalars().all()
            announced = self._bump(conn)
        self._tell_mirrors(*announced)
        return replace(tenant, deleted_at=now), sorted(revoked)

    def reset_spend(self, ref: str) -> Tenant:
        with self.engine.begin() as conn:
            tenant = self._tenant_row(conn, ref)
            t = self.tenants
            row = conn.execute(t.update().where(t.c.id == tenant.id).values(spend_usd=0.0)
                               .returning(*t.c)).one()
        return self._tenant(row)

    def _tenant_row(self, conn: sa.Connection, ref: str, *, deleted: bool = False) -> Tenant:
        """A live tenant by id or name (with `deleted`, a deleted one too)."""
        t = self.tenants
        stmt = t.select().where(sa.or_(t.c.id == ref, t.c.name == ref))
        if not deleted:
            stmt = stmt.where(t.c.deleted_at.is_(None))
        row = conn.execute(stmt).first()
        if row is None:
            raise NotFoundError(f"tenant {ref!r} not found", param="tenant", code="tenant_not_found")
        return self._tenant(row)

    @staticmethod
    def _tenant(row: Any) -> Tenant:
        return Tenant(row.id, row.name, _tenant_settings(row.settings), row.spend_usd,
                      row.created_at, row.reserved_usd, row.deleted_at)

    def list_tenants(self) -> list[Tenant]:
        with self.engine.connect() as conn:
            t = self.tenants
            rows = conn.execute(t.select().where(t.c.deleted_at.is_(None))
                                .order_by(t.c.created_at))
            return [self._tenant(r) for r in rows]

    # -- keys ------------------------------------------------------------------------

    def create_key(self, tenant_ref: str, settings: KeySettings) -> tuple[ApiKey, str]:
        new = generate_key()
        with self.engine.begin() as conn:
            tenant = self._tenant_row(conn, tenant_ref)
            key = ApiKey(new_id("key"), tenant.id, new.display, settings, time.time(), None)
            conn.execute(self.keys.insert().values(
                id=key.id, tenant_id=tenant.id, digest=new.digest, display=new.display,
                settings=_dump(settings), created_at=key.created_at, revoked_at=None))
        return key, new.plaintext

    @staticmethod
    def _key(row: Any) -> ApiKey:
        return ApiKey(row.id, row.tenant_id, row.display, _key_settings(row.settings),
                      row.created_at, row.revoked_at)

    def list_keys(self, tenant_id: str | None = None) -> list[ApiKey]:
        stmt = self.keys.select().order_by(self.keys.c.created_at)
        if tenant_id is not None:
            stmt = stmt.where(self.keys.c.tenant_id == tenant_id)
        with self.engine.connect() as conn:
            return [self._key(r) for r in conn.execute(stmt)]

    def get_key(self, key_id: str) -> ApiKey:
        with self.engine.connect() as conn:
            row = conn.execute(self.keys.select().where(self.keys.c.id == key_id)).first()
        if row is None:
            raise NotFoundError(f"key {key_id!r} not found", param="key_id", code="key_not_found")
        return self._key(row)

    def update_key(self, key_id: str, changes: dict[str, Any]) -> ApiKey:
        known = {f.name for f in fields(KeySettings)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InvalidRequestError(f"unknown key setting(s): {unknown}", param=unknown[0])
        k = self.keys
        with self.engine.begin() as conn:
            row = conn.execute(k.select().where(k.c.id == key_id)).first()
            if row is None:
                raise NotFoundError(f"key {key_id!r} not found", param="key_id",
                                    code="key_not_found")
            key = self._key(row)
            settings = replace(key.settings, **changes)
            conn.execute(k.update().where(k.c.id == key_id).values(settings=_dump(settings)))
            announced = self._bump(conn)
        self._tell_mirrors(*announced)
        return replace(key, settings=settings)

    def revoke_key(self, key_id: str) -> ApiKey:
        with self.engine.begin() as conn:
            k = self.keys
            conn.execute(k.update().where(k.c.id == key_id, k.c.revoked_at.is_(None))
                         .values(revoked_at=time.time()))
            announced = self._bump(conn)
            row = conn.execute(k.select().where(k.c.id == key_id)).first()
        if row is None:
            raise NotFoundError(f"key {key_id!r} not found", param="key_id", code="key_not_found")
        self._tell_mirrors(*announced)
        return self._key(row)

    # -- the auth version and its Redis mirrors (gateway/auth_mirror.py) --------------

    def _bump(self, conn: sa.Connection) -> tuple[int, list[tuple[str, str, float]]]:
        """Bump the auth version (taking its row lock) and read the registered mirrors
        after it, in the change's transaction: (new version, [(url, key, seen at)])."""
        version = int(conn.execute(self._bump_stmt).scalar_one())
        m = self.mirrors
        mirrors = conn.execute(sa.select(m.c.url, m.c.redis_key, m.c.seen_at))
        return version, [(r.url, r.redis_key, r.seen_at) for r in mirrors]

    def _tell_mirrors(self, version: int, mirrors: list[tuple[str, str, float]]) -> None:
        """After the change committed: raise every mirror to its version, so that every
        gateway applies it from its next request on. One that cannot be told: 503 (the
        change stands; gateways catch up within `auth_mirror.CHECK_EVERY_S`), unless no
        gateway has used it for `auth_mirror.STALE_S` (Redis moved, say): then it is
        dropped from the registry (a gateway still using it registers it again when it
        next checks, and raises it to the store's version then)."""
        failed, now = [], time.time()
        for url, key, seen_at in mirrors:
            try:
                self.tell_auth_mirror(url, key, version)
            except Exception as exc:
                if seen_at < now - auth_mirror.STALE_S:
                    logger.warning("auth mirror %s unused since %.0f s and unreachable (%s): "
                                   "dropped", url, now - seen_at, exc)
                    with self.engine.begin() as conn:
                        conn.execute(self.mirrors.delete().where(self.mirrors.c.url == url))
                    continue
                logger.error("auth mirror %s not told of version %d: %s", url, version, exc)
                failed.append(url)
        if failed:
            raise ServiceUnavailableError(
                f"the change is saved, but the gateways' key cache in Redis ({', '.join(failed)})"
                f" could not be told: gateways apply it within {auth_mirror.CHECK_EVERY_S:g} s",
                code="auth_mirror_unreachable")

    def register_auth_mirror(self, url: str, key: str | None = None) -> tuple[str, int]:
        """Register Redis at `url` as a mirror of the auth version: (its key, the version
        to seed it with). Takes the version's row lock like every change, so a change
        either commits before (the seed covers it) or sees this registration. `key`: the
        one a gateway already reads (registering again after its row was dropped)."""
        m = self.mirrors
        with self.engine.begin() as conn:
            version = int(conn.execute(self._bump_stmt).scalar_one())
            row = conn.execute(sa.select(m.c.redis_key).where(m.c.url == url)).first()
            if row is not None:
                key = str(row.redis_key)
                conn.execute(m.update().where(m.c.url == url).values(seen_at=time.time()))
            else:
                key = key or f"sluice:auth-version:{secrets.token_hex(8)}"
                conn.execute(m.insert().values(url=url, redis_key=key, seen_at=time.time()))
        return key, version

    def tell_auth_mirror(self, url: str, key: str, version: int) -> None:
        """Raise the mirror `key` at `url` to `version` (`auth_mirror.tell`)."""
        auth_mirror.tell(self._mirror_client(url), key, version)

    def _mirror_client(self, url: str) -> Any:
        """The Redis client for the mirror at `url`: one per URL, closed with the store."""
        with self._mirror_lock:
            client = self._mirror_clients.get(url)
            if client is None:
                client = self._mirror_clients[url] = auth_mirror.connect(url)
            return client

    def touch_auth_mirror(self, url: str, key: str) -> None:
        """A gateway still reads the mirror at `url`: mark it seen; register it again
        (with `key`) if it was dropped as stale."""
        m = self.mirrors
        with self.engine.begin() as conn:
            seen = conn.execute(m.update().where(m.c.url == url).values(seen_at=time.time()))
        if not seen.rowcount:
            self.register_auth_mirror(url, key)

    def auth_version(self) -> int:
        """One primary-key read on a connection of its own, below SQLAlchemy's pool and
        result layers (~5 us on SQLite against ~120 us through them): it runs on every
        request. On SQLite the read is skipped while no connection has committed since
        the last one (`WalCommits`): a read releases the GIL, and under load the ledger's
        writer thread took it each time (~30 us a request). Thread-safe (a lock); a
        broken connection is replaced once."""
        with self._version_lock:
            for attempt in (0, 1):
                try:
                    if self._commits is not None and not self._commits.since_last_look() \
                            and self._version is not None:
                        return self._version
                    self._version = self._read_version()
                    return self._version
                except Exception as exc:
                    self._drop_version_conn()
                    if attempt:
                        raise self._unavailable(exc) from exc
        raise AssertionError("unreachable")

    def _unavailable(self, exc: Exception) -> Exception:
        """A database that cannot be reached as a 503 (the client may retry), instead of
        an unhandled driver error (a 500); anything else unchanged."""
        if isinstance(exc, sa.exc.DBAPIError | self.engine.dialect.dbapi.Error):  # type: ignore[union-attr]
            logger.debug("gateway database unreachable: %s", exc)  # counted as 503 refusals
            return ServiceUnavailableError("gateway database unreachable; retry shortly",
                                           code="store_unavailable")
        return exc

    def _read_version(self) -> int:
        if self._version_conn is None:
            conn = self.engine.raw_connection()
            if self.engine.dialect.name == "postgresql":
                conn.driver_connection.autocommit = True  # type: ignore[union-attr]
            self._version_conn = conn
            self._commits = WalCommits.of(self.engine)  # its -shm lives while conn is open
        cursor = self._version_conn.cursor()
        try:
            cursor.execute(self._version_sql)
            return int(cursor.fetchone()[0])
        finally:
            cursor.close()

    def _drop_version_conn(self) -> None:
        self._version, self._commits = None, None
        if self._version_conn is not None:
            with contextlib.suppress(Exception):
                self._version_conn.invalidate()
            self._version_conn = None

    def authenticate(self, plaintext: str) -> Principal | None:
        try:
            with self.engine.connect() as conn:
                row = conn.execute(self._auth_stmt, {"digest": hash_key(plaintext)}).first()
        except sa.exc.DBAPIError as exc:
            raise self._unavailable(exc) from exc
        if row is None:
            return None
        tenant = Tenant(row.tenant_id, row.name, _tenant_settings(row.t_settings),
                        row.spend_usd, row.t_created, row.reserved_usd)
        return Principal(self._key(row), tenant)

    # -- ledger ----------------------------------------------------------------------

    def reserve_spend_many(self, requests: Sequence[tuple[str, float, float]],
                           lease_s: float) -> list[str | None]:
        ids: list[str | None] = [None] * len(requests)
        rows = []
        # tenants in sorted order (arrival order within one): the lock order settlements use
        order = sorted(range(len(requests)), key=lambda i: requests[i][0])
        with self.engine.begin() as conn:
            expires_at = time.time() + lease_s
            for i in order:
                tenant_id, cost, budget = requests[i]
                result = conn.execute(self._reserve, {"tid": tenant_id, "cost": cost,
                                                      "budget": budget})
                if result.rowcount == 1:
                    ids[i] = new_id("rsv")
                    rows.append({"id": ids[i], "tenant_id": tenant_id, "cost_usd": cost,
                                 "expires_at": expires_at})
            if rows:
                conn.execute(self.reservations.insert(), rows)
        return ids

    def expire_reservations(self, now: float | None = None) -> int:
        r = self.reservations
        # SKIP LOCKED (PostgreSQL): rows a settlement is deleting right now are its own
        expired = (sa.select(r.c.id).where(r.c.expires_at < (time.time() if now is None else now))
                   .with_for_update(skip_locked=True).scalar_subquery())
        with self.engine.begin() as conn:
            freed = self._delete_reservations(conn, r.c.id.in_(expired))
            self._settle_tenants(conn.exec_driver_sql, {}, freed)
        return sum(n for _, n in freed.values())

    def _delete_reservations(self, conn: sa.Connection,
                             where: Any) -> dict[str, tuple[float, int]]:
        """Delete reservation rows; per tenant, the USD and count this call deleted."""
        r = self.reservations
        freed: dict[str, tuple[float, int]] = {}
        for tenant_id, cost in conn.execute(r.delete().where(where)
                                            .returning(r.c.tenant_id, r.c.cost_usd)):
            usd, n = freed.get(tenant_id, (0.0, 0))
            freed[tenant_id] = (usd + cost, n + 1)
        return freed

    def _settle_tenants(self, run: Callable[[str, Any], Any], spend: dict[str, float],
                        freed: dict[str, tuple[float, int]]) -> None:
        """Add `spend` to the tenants and take `freed` off their reservations, by
        `run(sql, params)` in the caller's transaction (SQLAlchemy's or the ledger's own
        connection: the statement is the DBAPI's text)."""
        for tenant_id in sorted(spend.keys() | freed.keys()):  # fixed order: no deadlock
            values = {"tid": tenant_id, "cost": spend.get(tenant_id, 0.0),
                      "released": freed.get(tenant_id, (0.0, 0))[0]}
            run(self._settle_sql, values if self._settle_order is None
                else tuple(values[name] for name in self._settle_order))

    def record_usage_many(self, records: list[UsageRecord],
                          released: Sequence[str] = ()) -> None:
        if not records and not released:
            return
        if not released:  # the common batch: no budget reservation to give back
            return self._record_on_ledger_connection(records)
        try:
            with self.engine.begin() as conn:
                # reservations first: a concurrent sweep holds only reservation rows it
                # locked itself, and takes tenants in the same sorted order
                freed = self._delete_reservations(conn, self.reservations.c.id.in_(released))
                inserted = self._insert_records(
                    lambda sql, params: list(conn.exec_driver_sql(sql, params)), records)
                self._settle_tenants(conn.exec_driver_sql, _spend(records, inserted), freed)
        except OUTAGES as exc:
            raise ServiceUnavailableError("gateway database unreachable",
                                          code="store_unavailable") from exc

    def _record_on_ledger_connection(self, records: list[UsageRecord]) -> None:
        """`record_usage_many` without reservations, on a DBAPI connection of the ledger's
        own, below SQLAlchemy: its transaction, pool checkout (a ping on PostgreSQL) and
        reset on return cost ~250 us of the commit thread's CPU a batch, over the ~150 of
        the statements themselves (PostgreSQL, 2026-12-06), the GIL taken from the
        requests. One batch at a time (a lock); the connection is replaced after an error."""
        with self._ledger_lock:
            try:
                if self._ledger_conn is None:
                    self._ledger_conn = self.engine.raw_connection()
                conn = self._ledger_conn
                cursor = conn.cursor()
                try:
                    def run(sql: str, params: Any) -> list[Any]:
                        cursor.execute(sql, params)
                        return cursor.fetchall()

                    inserted = self._insert_records(run, records)
                    self._settle_tenants(cursor.execute, _spend(records, inserted), {})
                    conn.commit()
                finally:
                    cursor.close()
            except Exception as exc:
                self._drop_ledger_conn()
                if isinstance(exc, OUTAGES + self._driver_outages):
                    raise ServiceUnavailableError("gateway database unreachable",
                                                  code="store_unavailable") from exc
                raise

    def _drop_ledger_conn(self) -> None:
        if self._ledger_conn is not None:
            with contextlib.suppress(Exception):
                self._ledger_conn.invalidate()  # rolls back; the pool opens a new one
            self._ledger_conn = None

    def _insert_records(self, run: Callable[[str, Any], list[Any]],
                        records: list[UsageRecord]) -> set[str]:
        """Insert the records not already in the ledger (`run(sql, params)`: the rows a
        statement returns, in the caller's transaction); the `record_id`s inserted.
        PostgreSQL: one constant statement over arrays (`_unnest_insert`); SQLite: one
        multi-row insert per `_ROWS_A_STATEMENT` records (`_rows_insert`)."""
        if not records:
            return set()
        if self._insert_unnest is not None:
            statement, names = self._insert_unnest
            records = [self._fit(r) for r in records]
            columns = {name: [getattr(r, name) for r in records] for name in names}
            return {row[0] for row in run(statement, columns)}
        statement_for, values = self._insert_rows
        inserted: set[str] = set()
        for at in range(0, len(records), _ROWS_A_STATEMENT):
            part = records[at: at + _ROWS_A_STATEMENT]
            inserted.update(row[0] for row in run(statement_for(len(part)), values(part)))
        return inserted

    def _fit(self, record: UsageRecord) -> UsageRecord:
        """`record` with each string cut to its column's width: a client's 100-character
        `x-request-id`, a long model name or path, made PostgreSQL refuse the row (SQLite
        keeps any length), so the request went unrecorded and unbilled."""
        long: dict[str, Any] = {name: value[:width] for name, width in self._widths.items()
                if isinstance(value := getattr(record, name), str) and len(value) > width}
        return replace(record, **long) if long else record

    def query_usage(self, query: UsageQuery) -> list[UsageRecord]:
        u = self.usage
        stmt = sa.select(*[u.c[f.name] for f in fields(UsageRecord)])
        for condition in self._filters(query):
            stmt = stmt.where(condition)
        stmt = stmt.order_by(u.c.seq).limit(query.limit)
        with self.engine.connect() as conn:
            return [UsageRecord(**row._asdict()) for row in conn.execute(stmt)]

    def usage_totals(self, query: UsageQuery) -> UsageTotals:
        u = self.usage
        stmt = sa.select(sa.func.count(), *[sa.func.coalesce(sa.func.sum(c), 0) for c in (
            u.c.prompt_tokens, u.c.completion_tokens, u.c.cost_usd)])
        for condition in self._filters(query):
            stmt = stmt.where(condition)
        with self.engine.connect() as conn:
            requests, prompt, completion, cost = conn.execute(stmt).one()
        return UsageTotals(int(requests), int(prompt), int(completion), float(cost))

    def _filters(self, q: UsageQuery) -> Iterator[Any]:
        u = self.usage
        if q.tenant_id is not None:
            yield u.c.tenant_id == q.tenant_id
        if q.key_id is not None:
            yield u.c.key_id == q.key_id
        if q.since is not None:
            yield u.c.ts >= q.since
        if q.until is not None:
            yield u.c.ts < q.until

    def purge(self, older_than: float) -> int:
        with self.engine.begin() as conn:
            result = conn.execute(self.usage.delete().where(self.usage.c.ts < older_than))
        return int(result.rowcount or 0)

    # -- stored responses (the Responses API's `store`) ------------------------------

    def save_response(self, stored: StoredResponse) -> None:
        r, now = self.responses, time.time()
        row = {"id": stored.id, "tenant_id": stored.tenant_id, "key_id": stored.key_id,
               "previous_id": stored.previous_id, "input_items": json.dumps(stored.input_items),
               "response": json.dumps(stored.response), "created_at": stored.created_at,
               "expires_at": stored.expires_at, "owner": stored.owner,
               "lease_until": stored.lease_until, **_admission_row(stored.admission)}
        e = self.stream_events
        with self.engine.begin() as conn:
            conn.execute(r.delete().where(sa.or_(r.c.id == stored.id, r.c.expires_at < now)))
            conn.execute(r.insert().values(**row))
            conn.execute(e.delete().where(e.c.expires_at < now))

    def get_response(self, response_id: str, tenant_id: str) -> StoredResponse | None:
        r = self.responses
        with self.engine.connect() as conn:
            row = conn.execute(r.select().where(*self._response_is(response_id, tenant_id))
                               ).first()
        return None if row is None else _stored_response(row)

    def delete_response(self, response_id: str, tenant_id: str) -> bool:
        e = self.stream_events
        with self.engine.begin() as conn:
            result = conn.execute(self.responses.delete().where(
                *self._response_is(response_id, tenant_id)))
            if result.rowcount:
                conn.execute(e.delete().where(e.c.response_id == response_id))
        return bool(result.rowcount)

    def add_response_events(self, events: list[tuple[str, int, str]],
                            expires_at: float | None) -> None:
        if not events:
            return
        insert = (sqlite_insert if self.engine.dialect.name == "sqlite" else pg_insert)(
            self.stream_events).on_conflict_do_nothing()
        with self.engine.begin() as conn:
            conn.execute(insert, [{"response_id": response_id, "seq": seq, "event": event,
                                   "expires_at": expires_at}
                                  for response_id, seq, event in events])

    def response_events(self, response_id: str, after: int,
                        limit: int) -> list[tuple[int, str]]:
        e = self.stream_events
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(e.c.seq, e.c.event).where(
                e.c.response_id == response_id, e.c.seq > after).order_by(e.c.seq).limit(limit))
            return [(row.seq, row.event) for row in rows]

    def last_response_event(self, response_id: str) -> int:
        e = self.stream_events
        with self.engine.connect() as conn:
            last = conn.execute(sa.select(sa.func.max(e.c.seq)).where(
                e.c.response_id == response_id)).scalar()
        return -1 if last is None else int(last)

    def renew_runs(self, owner: str, lease_until: float) -> list[str]:
        r = self.responses
        with self.engine.begin() as conn:
            conn.execute(r.update().where(r.c.owner == owner).values(lease_until=lease_until))
            rows = conn.execute(sa.select(r.c.id).where(r.c.owner == owner,
                                                        r.c.cancel_at.is_not(None)))
            return [row.id for row in rows]

    def lapsed_runs(self, now: float, limit: int, but: str) -> list[StoredResponse]:
        r = self.responses  # (`owner` is indexed, and set only on running rows)
        with self.engine.connect() as conn:
            rows = conn.execute(r.select().where(
                r.c.owner.is_not(None), r.c.owner != but, r.c.lease_until < now,
                sa.or_(r.c.expires_at.is_(None), r.c.expires_at >= now),
            ).order_by(r.c.lease_until).limit(limit))
            return [_stored_response(row) for row in rows]

    def ask_cancel(self, response_id: str, tenant_id: str) -> bool:
        r = self.responses
        with self.engine.begin() as conn:
            result = conn.execute(r.update().where(
                *self._response_is(response_id, tenant_id), r.c.owner.is_not(None)
            ).values(cancel_at=time.time()))
        return bool(result.rowcount)

    def end_orphan(self, stored: StoredResponse, response: dict[str, Any]) -> bool:
        r = self.responses
        same = [r.c.owner.is_(None) if stored.owner is None else r.c.owner == stored.owner,
                r.c.lease_until.is_(None) if stored.lease_until is None
                else r.c.lease_until == stored.lease_until]
        with self.engine.begin() as conn:
            result = conn.execute(r.update().where(
                *self._response_is(stored.id, stored.tenant_id), *same
            ).values(response=json.dumps(response), owner=None, lease_until=None,
                     cancel_at=None))
        return bool(result.rowcount)

    def _response_is(self, response_id: str, tenant_id: str) -> list[Any]:
        r = self.responses
        return [r.c.id == response_id, r.c.tenant_id == tenant_id,
                sa.or_(r.c.expires_at.is_(None), r.c.expires_at >= time.time())]

    # -- conversations (OpenAI's Conversations API) ----------------------------------

    def create_conversation(self, conversation: StoredConversation,
                            items: list[dict[str, Any]]) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.conversations.insert().values(
                id=conversation.id, tenant_id=conversation.tenant_id,
                metadata=json.dumps(conversation.metadata), created_at=conversation.created_at))
            self._insert_items(conn, conversation.id, items)

    def get_conversation(self, conversation_id: str,
                         tenant_id: str) -> StoredConversation | None:
        with self.engine.connect() as conn:
            return self._conversation(conn, conversation_id, tenant_id)

    def update_conversation(self, conversation_id: str, tenant_id: str,
                            metadata: dict[str, str]) -> StoredConversation | None:
        c = self.conversations
        with self.engine.begin() as conn:
            conn.execute(c.update().where(c.c.id == conversation_id, c.c.tenant_id == tenant_id)
                         .values(metadata=json.dumps(metadata)))
            return self._conversation(conn, conversation_id, tenant_id)

    def delete_conversation(self, conversation_id: str, tenant_id: str) -> bool:
        c, i = self.conversations, self.items
        with self.engine.begin() as conn:
            gone = conn.execute(c.delete().where(c.c.id == conversation_id,
                                                 c.c.tenant_id == tenant_id)).rowcount
            if gone:
                conn.execute(i.delete().where(i.c.conversation_id == conversation_id))
        return bool(gone)

    def add_conversation_items(self, conversation_id: str, tenant_id: str,
                               items: list[dict[str, Any]]) -> bool:
        with self.engine.begin() as conn:
            if self._conversation(conn, conversation_id, tenant_id) is None:
                return False
            self._insert_items(conn, conversation_id, items)
        return True

    def conversation_items(self, conversation_id: str,
                           tenant_id: str) -> list[dict[str, Any]] | None:
        i = self.items
        with self.engine.connect() as conn:
            if self._conversation(conn, conversation_id, tenant_id) is None:
                return None
            rows = conn.execute(sa.select(i.c.item).where(i.c.conversation_id == conversation_id)
                                .order_by(i.c.seq))
            return [json.loads(row.item) for row in rows]

    def delete_conversation_item(self, conversation_id: str, tenant_id: str,
                                 item_id: str) -> bool:
        i = self.items
        with self.engine.begin() as conn:
            if self._conversation(conn, conversation_id, tenant_id) is None:
                return False
            return bool(conn.execute(i.delete().where(i.c.conversation_id == conversation_id,
                                                      i.c.item_id == item_id)).rowcount)

    def _conversation(self, conn: sa.Connection, conversation_id: str,
                      tenant_id: str) -> StoredConversation | None:
        c = self.conversations
        row = conn.execute(c.select().where(c.c.id == conversation_id,
                                            c.c.tenant_id == tenant_id)).first()
        if row is None:
            return None
        return StoredConversation(row.id, row.tenant_id, json.loads(row.metadata),
                                  row.created_at)

    def _insert_items(self, conn: sa.Connection, conversation_id: str,
                      items: list[dict[str, Any]]) -> None:
        if items:
            conn.execute(self.items.insert(), [
                {"conversation_id": conversation_id, "item_id": str(item["id"]),
                 "item": json.dumps(item)} for item in items])

    def drop_all(self) -> None:
        """Drop this store's tables (tests use it to clean up a per-run prefix), and the
        Redis keys of its auth version's mirrors where Redis answers."""
        with contextlib.suppress(sa.exc.DBAPIError), self.engine.connect() as conn:
            for url, key in conn.execute(sa.select(self.mirrors.c.url, self.mirrors.c.redis_key)):
                with contextlib.suppress(Exception):
                    self._mirror_client(url).delete(key)
        self.metadata.drop_all(self.engine)

    def close(self) -> None:
        with self._version_lock:
            self._drop_version_conn()
        with self._ledger_lock:
            self._drop_ledger_conn()
        with self._mirror_lock:
            for client in self._mirror_clients.values():
                client.close()
            self._mirror_clients.clear()
        self.engine.dispose()
