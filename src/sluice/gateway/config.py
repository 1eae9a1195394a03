"""Gateway configuration: frozen dataclasses, validated once, read everywhere.

The gateway is configured at its edge (CLI flags, `SLUICE_*` variables read in
`sluice.gateway.cli` through `sluice.env`) into one `GatewayConfig`; nothing below it
reads the environment. Priority classes live here because they are policy the operator
picks, not code: vLLM's convention is "lower value runs first" and 0 is the default of
a request that names no priority, so `interactive` is 0 and the others sit below it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from sluice import env
from sluice.protocol.edge import DEFAULT_MAX_BODY_BYTES, Headers, check_admin_key
from sluice.protocol.errors import InvalidRequestError

# vLLM-compatible priorities: lower runs first; a request without `priority` is 0.
PRIORITY_CLASSES: dict[str, int] = {"interactive": 0, "standard": 1, "batch": 2}

FAILURE_MODES = ("closed", "open")


def priority_value(name: str) -> int:
    """The integer of a priority class; raises InvalidRequestError naming the class."""
    try:
        return PRIORITY_CLASSES[name]
    except KeyError:
        raise InvalidRequestError(
            f"unknown priority class {name!r}; choose one of {sorted(PRIORITY_CLASSES)}",
            param="priority_class",
        ) from None


@dataclass(frozen=True)
class LimiterConfig:
    """Where the counters live and what to do when that place is unreachable.

    `redis_url=None` keeps counters in this process (one gateway replica). With a URL,
    every replica shares exact counters through atomic Lua scripts. `on_redis_error`:
    "closed" answers 503 while Redis is down, "open" admits without limits.
    """

    redis_url: str | None = None
    on_redis_error: str = "closed"
    key_prefix: str = "sluice:rl:"
    window_s: float = 60.0
    concurrency_lease_s: float = 60.0  # Redis: renewed while the request runs

    def __post_init__(self) -> None:
        if self.on_redis_error not in FAILURE_MODES:
            raise InvalidRequestError(
                f"on_redis_error must be one of {FAILURE_MODES}, got {self.on_redis_error!r}",
                param="on_redis_error",
            )
        if self.window_s <= 0:
            raise InvalidRequestError("window_s must be > 0", param="window_s")
        if self.concurrency_lease_s <= 0:
            raise InvalidRequestError("concurrency_lease_s must be > 0",
                                      param="concurrency_lease_s")


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway middleware needs besides its injected collaborators.

    `database_url=None` means SQLite (WAL) at `sluice.env.home()/sluice.db`.
    `default_reserve_tokens` is what a request without `max_tokens` reserves against
    its tokens-per-minute limit (and its budget) until its real completion tokens are
    known. `budget_lease_s`: how long a budget reservation outlives a gateway that died
    before settling it. Tenants get their priority class from their own settings
    (default `standard`). `await_ledger=False` takes the ledger commit off the critical
    path for requests whose tenant has no budget (nothing at admission reads those rows;
    each is still written exactly once, `GatewayState.flush` waits for them), and the
    limiter's reconciliation for requests no concurrency or TPM limit counts.
    While the database is unreachable, up to `ledger_max_waiting` usage records wait in
    memory and are retried (new requests are refused while that many wait); shutdown
    waits up to `ledger_close_s` for them (`gateway/ledger.py`). `ledger_spool`: a local
    file that also keeps them until the database has them, so a gateway killed or
    stopped during an outage loses none (`gateway/spool.py`; None: memory only;
    `sluice serve` and `sluice gateway` use `ledger_spool_path`).
    """

    database_url: str | None = None
    table_prefix: str = "sluice_"
    admin_key: str | None = None
    limiter: LimiterConfig = field(default_factory=LimiterConfig)
    prices_file: Path | None = None
    default_reserve_tokens: int = 256
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies: 413
    budget_lease_s: float = 3600.0
    # Wait for every request's ledger commit before its last bytes (True), or only where
    # admission reads what it writes: a budgeted tenant's spend (False, the default).
    await_ledger: bool = False
    ledger_max_waiting: int = 10_000
    ledger_close_s: float = 10.0
    # the least time between two ledger commits of rows written after their responses
    # (LiteLLM's `proxy_batch_write_at`, 10 s there): fewer, larger commits
    ledger_batch_interval_s: float = 0.02
    ledger_spool: Path | None = None
    # how long a stored Responses API response is kept (OpenAI keeps them 30 days); 0:
    # the gateway stores none, and `store` must be false (gateway/responses.py)
    response_retention_s: float = 30 * 86400.0
    # a background response whose gateway replica has not renewed it this long is ended
    # `failed`, with its ledger row, by the next read or another replica's sweep (its
    # replica was killed; gateway/responses.py)
    background_lease_s: float = 15.0

    def __post_init__(self) -> None:
        if self.default_reserve_tokens < 0:
            raise InvalidRequestError(
                "default_reserve_tokens must be >= 0", param="default_reserve_tokens"
            )
        if self.budget_lease_s <= 0:
            raise InvalidRequestError("budget_lease_s must be > 0", param="budget_lease_s")
        if self.ledger_max_waiting < 1:
            raise InvalidRequestError("ledger_max_waiting must be >= 1",
                                      param="ledger_max_waiting")
        if self.ledger_close_s < 0:
            raise InvalidRequestError("ledger_close_s must be >= 0", param="ledger_close_s")
        if not self.response_retention_s >= 0:
            raise InvalidRequestError("response_retention_s must be >= 0",
                                      param="response_retention_s")
        if not self.background_lease_s > 0:
            raise InvalidRequestError("background_lease_s must be > 0",
                                      param="background_lease_s")
        if not 0 <= self.ledger_batch_interval_s <= 10:
            raise InvalidRequestError("ledger_batch_interval_s must be in [0, 10] seconds",
                                      param="ledger_batch_interval_s")

    def with_spool(self) -> GatewayConfig:
        """This config with `ledger_spool` at its default place, `ledger_spool_path`."""
        return replace(self, ledger_spool=ledger_spool_path(self.database_url,
                                                            self.table_prefix))

    def check_admin(self, headers: Headers) -> None:
        """The gateway's admin routes and the worker control routes it passes on: 403
        without an admin key configured, 401 for a missing or wrong one."""
        check_admin_key(self.admin_key, headers, setting="SLUICE_ADMIN_KEY or --admin-key")


def ledger_spool_path(database_url: str | None, table_prefix: str = "sluice_") -> Path:
    """Where a gateway keeps the usage records waiting for this database: under
    SLUICE_HOME, one file per database URL and table prefix, so gateways on other stores
    never take up each other's records."""
    store = f"{database_url or 'sqlite (default)'}|{table_prefix}"
    return env.home() / "ledger-spool" / f"{hashlib.sha256(store.encode()).hexdigest()[:16]}.db"
