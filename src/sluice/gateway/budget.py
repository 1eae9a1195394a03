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
that reservation in the transaction that adds the real cost to spend. A reservation is
a lease (`GatewayConfig.budget_lease_s`, 1 h): if its gateway died before settling,
the first request that finds the budget full sweeps expired leases (at most every
`SWEEP_EVERY_S` per replica) and tries once more. What is left of the overrun: a
request whose real prompt is longer than the gateway's count (a chars/4 estimate when
no tokenizer loads), and one without `max_tokens` that generates more than the default
reserve (`GatewayConfig.default_reserve_tokens`, 256). A tenant without a budget, or
whose model costs nothing, reserves nothing (no extra write). A soft budget only counts a metric, so
operators can alert before the hard stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sluice.gateway.group_commit import GroupCommit
from sluice.gateway.metrics import GatewayMetrics
from sluice.gateway.store import BUDGET_SLACK_USD, Store, Tenant
from sluice.protocol.errors import InsufficientQuotaError

logger = logging.getLogger(__name__)

SWEEP_EVERY_S = 10.0


def check_budget(tenant: Tenant, metrics: GatewayMetrics) -> None:
    """Raise InsufficientQuotaError (429 insufficient_quota) if the tenant has spent its
    budget (every request refused, priced or not); what is reserved by requests in
    flight only refuses priced requests that do not fit (`Store.reserve_spend`)."""
    s = tenant.settings
    if s.budget_usd:
        metrics.child(metrics.budget_used, tenant.id).set(tenant.spend_usd / s.budget_usd)
    if s.budget_usd is not None and tenant.spend_usd >= s.budget_usd:
        # no wait helps (until a reset): `x-should-retry: false`, which the OpenAI and
        # Anthropic SDKs obey (they retried it twice, three refused records per call)
        raise InsufficientQuotaError(
            f"You exceeded your current quota: tenant {tenant.name!r} spent "
            f"${tenant.spend_usd:.6f} of its ${s.budget_usd:.6f} budget.",
            headers={"x-should-retry": "false"})
    if s.soft_budget_usd is not None and tenant.spend_usd >= s.soft_budget_usd:
        metrics.child(metrics.soft_budget, tenant.id).inc()


def over_budget_error(tenant: Tenant, worst_case_usd: float) -> InsufficientQuotaError:
    """The refusal when a request's worst case does not fit what is left of the budget.
    Where its spend alone (as read at admission) leaves too little, nothing in flight
    can give enough back and only a reset or a larger budget helps: `x-should-retry:
    false`, as for a spent budget (the SDKs retried it twice). Else requests in flight
    hold the rest, and a retry after they end may pass."""
    budget = tenant.settings.budget_usd
    assert budget is not None
    final = tenant.spend_usd + worst_case_usd > budget + BUDGET_SLACK_USD
    return InsufficientQuotaError(
        f"You exceeded your current quota: tenant {tenant.name!r} has less than "
        f"${worst_case_usd:.6f} left of its ${budget:.6f} budget once "
        "its spend and its requests in flight are counted; this request's worst case "
        "(prompt + max_tokens) costs that much. Lower max_tokens or raise the budget.",
        headers={"x-should-retry": "false"} if final else {})


class BudgetReservations:
    """Reserves requests' worst-case costs against budgets (one per GatewayState and
    event loop). Reservations that arrive while one is being committed share the next
    transaction (`GroupCommit`, as the ledger's records do), so a budgeted tenant's admission
    does not cap at the database's commit rate. Owns when this replica last swept
    expired leases. The store does the atomic part."""

    def __init__(self, store: Store, lease_s: float, sweep_every_s: float = SWEEP_EVERY_S,
                 clock: Callable[[], float] = time.monotonic, max_batch: int = 256) -> None:
        self.store = store
        self.lease_s = lease_s
        self.sweep_every_s = sweep_every_s
        self.clock = clock
        self._last_sweep = -float("inf")
        self._queue: GroupCommit[tuple[str, float, float], str | None] = GroupCommit(
            lambda requests: store.reserve_spend_many(requests, lease_s), max_batch)

    async def reserve(self, tenant: Tenant, worst_case_usd: float) -> str:
        """The reservation's id; raises InsufficientQuotaError if it does not fit.
        Cancelling the caller does not cancel a reservation being committed: shield the
        call and await it again to learn the id that must be given back."""
        budget = tenant.settings.budget_usd
        assert budget is not None
        request = (tenant.id, worst_case_usd, budget)
        rid = await self._reserve(request)
        if rid is None and await self.sweep():
            rid = await self._reserve(request)
        if rid is None:
            raise over_budget_error(tenant, worst_case_usd)
        return rid

    async def _reserve(self, request: tuple[str, float, float]) -> str | None:
        return await self._queue.submit(request)

    async def sweep(self) -> int:
        """Give back expired reservations, at most once per `sweep_every_s`."""
        now = self.clock()
        if now - self._last_sweep < self.sweep_every_s:
            return 0
        self._last_sweep = now
        expired = await asyncio.to_thread(self.store.expire_reservations)
        if expired:
            logger.warning("gave back %d budget reservations past their %.0f s lease "
                           "(a gateway stopped before settling them)", expired, self.lease_s)
        return expired
