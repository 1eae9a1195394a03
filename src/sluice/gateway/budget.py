"""Budgets: a tenant's spend plus its requests in flight never pass its budget.

Spend comes from the ledger (it is updated in the same transaction as each usage row,
see `SQLStore.record_usage`), so the number checked here is the sum of what was
charged, not a counter kept beside it. Checking spend alone at admission would let N
concurrent requests each pass and overrun the budget by N requests' cost, so each
request also **reserves** its worst-case cost before it is forwarded:

    worst case = price(prompt tokens as the gateway counted them,
                       max_tokens x n, or the default reserve when not given)
    admitted  iff  spend + reserved + worst case <= budget   (one conditional UPDATE)

and settlement (finished, upstream error, client hang-up, refusal) releases exactly
that reservation in the transaction that adds the real cost to spend. What is left of
the overrun: a request whose real prompt is longer than the gateway's count (a chars/4
estimate when no tokenizer loads). A tenant without a budget, or whose model costs
nothing, reserves nothing (no extra write). A soft budget only counts a metric, so
operators can alert before the hard stop.
"""

from __future__ import annotations

from sluice.gateway.metrics import GatewayMetrics
from sluice.gateway.store import Tenant
from sluice.protocol.errors import InsufficientQuotaError


def check_budget(tenant: Tenant, metrics: GatewayMetrics) -> None:
    """Raise InsufficientQuotaError (429 insufficient_quota) if the tenant has spent its
    budget (every request refused, priced or not); what is reserved by requests in
    flight only refuses priced requests that do not fit (`Store.reserve_spend`)."""
    s = tenant.settings
    if s.budget_usd is not None and tenant.spend_usd >= s.budget_usd:
        raise InsufficientQuotaError(
            f"You exceeded your current quota: tenant {tenant.name!r} spent "
            f"${tenant.spend_usd:.6f} of its ${s.budget_usd:.6f} budget.")
    if s.soft_budget_usd is not None and tenant.spend_usd >= s.soft_budget_usd:
        metrics.soft_budget.labels(tenant=tenant.id).inc()


def over_budget_error(tenant: Tenant, worst_case_usd: float) -> InsufficientQuotaError:
    """The refusal when a request's worst case does not fit what is left of the budget."""
    return InsufficientQuotaError(
        f"You exceeded your current quota: tenant {tenant.name!r} has less than "
        f"${worst_case_usd:.6f} left of its ${tenant.settings.budget_usd:.6f} budget once "
        "its spend and its requests in flight are counted; this request's worst case "
        "(prompt + max_tokens) costs that much. Lower max_tokens or raise the budget.")
