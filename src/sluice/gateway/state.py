"""`GatewayState`: every collaborator of one gateway, created in one factory.

No module-level state: the middleware, the admin API and the CLI all receive one of
these. Tests and `sluice serve` inject their own pieces (a store on a test prefix, a
Redis limiter with a unique key prefix, a token counter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.gateway.budget import BudgetReservations
from sluice.gateway.config import GatewayConfig, LimiterConfig
from sluice.gateway.ledger import LedgerWriter
from sluice.gateway.limits import Limiter, LocalLimiter, RedisLimiter
from sluice.gateway.metrics import GatewayMetrics
from sluice.gateway.pricing import PriceTable
from sluice.gateway.redact import Redactor, default_redactor
from sluice.gateway.store import SQLStore, Store
from sluice.gateway.tokens import CountPromptTokens, PromptTokenCounter


def build_limiter(config: LimiterConfig) -> Limiter:
    """Redis when a URL is configured (exact across replicas), else in process."""
    if config.redis_url:
        return RedisLimiter(config.redis_url, prefix=config.key_prefix, window_s=config.window_s,
                            lease_s=config.concurrency_lease_s)
    return LocalLimiter(window_s=config.window_s, lease_s=config.concurrency_lease_s)


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

    def __post_init__(self) -> None:
        self.ledger = LedgerWriter(self.store)
        self.budgets = BudgetReservations(self.store, self.config.budget_lease_s)

    @classmethod
    def from_config(cls, config: GatewayConfig, *, store: Store | None = None,
                    limiter: Limiter | None = None,
                    count_prompt_tokens: CountPromptTokens | None = None,
                    redactor: Redactor | None = None) -> GatewayState:
        prices = PriceTable.load(config.prices_file) if config.prices_file else PriceTable()
        return cls(
            config=config,
            store=store or SQLStore(config.database_url, config.table_prefix),
            limiter=limiter or build_limiter(config.limiter),
            prices=prices,
            count_prompt_tokens=count_prompt_tokens or PromptTokenCounter(),
            redactor=redactor or default_redactor,
        )

    async def aclose(self) -> None:
        await self.limiter.close()
        self.store.close()
