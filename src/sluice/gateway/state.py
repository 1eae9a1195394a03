"""`GatewayState`: every collaborator of one gateway, created in one factory.

No module-level state: the middleware, the admin API and the CLI all receive one of
these. Tests and `sluice serve` inject their own pieces (a store on a test prefix, a
Redis limiter with a unique key prefix, a token counter).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from sluice.gateway.budget import BudgetReservations
from sluice.gateway.config import GatewayConfig, LimiterConfig
from sluice.gateway.keycache import KeyCache
from sluice.gateway.ledger import LedgerWriter
from sluice.gateway.limits import Limiter, LocalLimiter, RedisLimiter
from sluice.gateway.metrics import GatewayMetrics
from sluice.gateway.pricing import PriceTable
from sluice.gateway.redact import Redactor, default_redactor
from sluice.gateway.responses import RunLedger, StoredResponses
from sluice.gateway.spool import LedgerSpool
from sluice.gateway.store import SQLStore, Store
from sluice.gateway.tokens import CountPromptTokens, PromptTokenCounter
from sluice.observe.buckets import LatencyBuckets

logger = logging.getLogger(__name__)


def build_limiter(config: LimiterConfig) -> Limiter:
    """Redis when a URL is configured (exact across replicas), else in process."""
    if config.redis_url:
        return RedisLimiter(config.redis_url, prefix=config.key_prefix, window_s=config.window_s,
                            lease_s=config.concurrency_lease_s)
    return LocalLimiter(window_s=config.window_s)  # its slots die with the process


@dataclass
class GatewayState:
    config: GatewayConfig
    store: Store
    limiter: Limiter
    prices: PriceTable = field(default_factory=PriceTable)
    count_prompt_tokens: CountPromptTokens = field(default_factory=PromptTokenCounter)
    redactor: Redactor = default_redactor
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    ledger: LedgerWriter = field(init=False)
    budgets: BudgetReservations = field(init=False)
    keys: KeyCache = field(init=False)
    responses: StoredResponses = field(init=False)  # the Responses API's `store`
    background: set[asyncio.Future[Any]] = field(init=False)
    unpriced_models: set[str | None] = field(init=False)  # budgets warned of: priced 0

    def __post_init__(self) -> None:
        spool = self.config.ledger_spool
        self.ledger = LedgerWriter(self.store, self.metrics,
                                   max_waiting=self.config.ledger_max_waiting,
                                   batch_interval_s=self.config.ledger_batch_interval_s,
                                   spool=LedgerSpool(spool) if spool is not None else None)
        self.budgets = BudgetReservations(self.store, self.config.budget_lease_s)
        self.keys = KeyCache(self.store)
        self.responses = StoredResponses(
            self.store, self.config.response_retention_s,
            RunLedger(self.ledger, self.prices, self.count_prompt_tokens),
            self.config.background_lease_s, on_lost=self.metrics.background_lost.inc)
        self.background = set()
        self.unpriced_models = set()
        if isinstance(self.limiter, RedisLimiter):  # the auth version rides its steps
            key = self.keys.use_mirror(self.limiter.url)
            if key is not None:
                self.limiter.mirror_auth_version(key)

    def later(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` off the request's critical path; `flush` (and `aclose`) wait for it.
        Its failure is logged (the work itself counts its own errors)."""
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self._done)

    def after(self, work: asyncio.Future[Any], then: Callable[[], None]) -> None:
        """`later` for work already under way: `then` runs once it is done, unless it
        failed (logged); `flush` waits for both."""
        self.background.add(work)

        def done(future: asyncio.Future[Any]) -> None:
            self._done(future)
            if not future.cancelled() and future.exception() is None:
                then()

        work.add_done_callback(done)

    def _done(self, task: asyncio.Future[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background settlement failed", exc_info=task.exception())

    async def flush(self) -> None:
        """Wait until every settlement started so far is written (or, while the database
        is unreachable, kept by the ledger to retry: `ledger.waiting`)."""
        while self.background:
            await asyncio.gather(*list(self.background), return_exceptions=True)

    @classmethod
    def from_config(cls, config: GatewayConfig, *, store: Store | None = None,
                    limiter: Limiter | None = None,
                    count_prompt_tokens: CountPromptTokens | None = None,
                    redactor: Redactor | None = None,
                    buckets: LatencyBuckets | None = None) -> GatewayState:
        prices = PriceTable.load(config.prices_file) if config.prices_file else PriceTable()
        return cls(
            config=config,
            store=store or SQLStore(config.database_url, config.table_prefix),
            limiter=limiter or build_limiter(config.limiter),
            prices=prices,
            count_prompt_tokens=count_prompt_tokens or PromptTokenCounter(),
            redactor=redactor or default_redactor,
            metrics=GatewayMetrics(buckets),
        )

    def start(self) -> None:
        """At startup, on the serving loop: take up the usage records an earlier gateway
        on this database left waiting in the spool, and begin sweeping the background
        responses of replicas that are gone."""
        self.ledger.recover()
        self.responses.start()

    async def aclose(self) -> None:
        await self.responses.stop()  # background responses: cancelled, settled, kept failed
        await self.flush()  # every ledger row is written exactly once, also at shutdown
        await self.ledger.close(self.config.ledger_close_s)  # and those kept while it was down
        await self.limiter.close()
        self.store.close()
