"""Budgets: a tenant whose recorded spend reached its budget is refused.

Spend comes from the ledger (it is updated in the same transaction as each usage row,
see `SQLStore.record_usage`), so the number checked here is the sum of what was
charged, not a counter kept beside it. Requests already in flight when the budget is
reached still finish and are charged: a budget can be overrun by at most the cost of
the tenant's concurrent requests, which `max_concurrent` bounds. A soft budget only
counts a metric, so operators can alert before the hard stop.
"""

from __future__ import annotations

from sluice.gateway.metrics import GatewayMetrics
from sluice.gateway.store import Tenant
from sluice.protocol.errors import InsufficientQuotaError


def check_budget(tenant: Tenant, metrics: GatewayMetrics) -> None:
    """Raise InsufficientQuotaError (429 insufficient_quota) if the tenant is out of budget."""
    s = tenant.settings
    if s.budget_usd is not None and tenant.spend_usd >= s.budget_usd:
        raise InsufficientQuotaError(
            f"You exceeded your current quota: tenant {tenant.name!r} spent "
            f"${tenant.spend_usd:.6f} of its ${s.budget_usd:.6f} budget.")
    if s.soft_budget_usd is not None and tenant.spend_usd >= s.soft_budget_usd:
        metrics.soft_budget.labels(tenant=tenant.id).inc()
