"""The planner's decisions as Prometheus gauges on the router's /metrics.

    sluice:desired_replicas{pool}                the count the planner wants (KEDA's input)
    sluice:planner_ready_replicas{pool}          workers taking requests
    sluice:planner_starting_replicas{pool}       launched, not yet ready
    sluice:planner_queued_requests{pool}         held by the router for want of a worker
    sluice:planner_inflight_requests{pool}
    sluice:planner_kv_usage_perc{pool}           mean over ready workers (0-1)
    sluice:planner_observed_ttft_p90_seconds{pool}, ..._observed_itl_seconds{pool}
    sluice:planner_predicted_ttft_seconds{pool}, ..._predicted_itl_seconds{pool}
                                                 at the desired count (`slo` policy)

Read from each controller's last decision when scraped (a custom collector), so a gauge
never outlives its pool. A value the planner does not have (no ITL observed yet, or a
prediction at zero workers) is left out rather than exported as NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.control.planner import Decision

if TYPE_CHECKING:
    from sluice.control.controller import Controller

GAUGES: dict[str, tuple[str, Callable[[Decision], float | None]]] = {
    "sluice:desired_replicas": ("replicas the planner wants", lambda d: d.desired),
    "sluice:planner_ready_replicas": ("workers taking requests", lambda d: d.signals.ready),
    "sluice:planner_starting_replicas": ("workers starting", lambda d: d.signals.starting),
    "sluice:planner_queued_requests": ("requests held by the router for a ready worker",
                                       lambda d: d.signals.queued),
    "sluice:planner_inflight_requests": ("requests in flight", lambda d: d.signals.inflight),
    "sluice:planner_kv_usage_perc": ("mean KV-cache usage of ready workers",
                                     lambda d: d.signals.kv_usage),
    "sluice:planner_observed_ttft_p90_seconds": ("p90 TTFT over the latency window",
                                                 lambda d: d.signals.ttft_p90_s),
    "sluice:planner_observed_itl_seconds": ("mean ITL over the latency window",
                                            lambda d: d.signals.itl_s),
    "sluice:planner_predicted_ttft_seconds": ("predicted TTFT at the desired count",
                                              lambda d: d.predicted.ttft_s),
    "sluice:planner_predicted_itl_seconds": ("predicted ITL at the desired count",
                                             lambda d: d.predicted.itl_s),
}


class PlannerCollector(Collector):
    def __init__(self, controllers: Callable[[], Sequence[Controller]]) -> None:
        self._controllers = controllers

    def collect(self) -> Iterator[Metric]:
        decisions = [(c.name, c.last) for c in self._controllers()]
        for name, (doc, read) in GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["pool"])
            for pool, decision in decisions:
                value = read(decision) if decision is not None else None
                if value is not None and math.isfinite(value):
                    family.add_metric([pool], float(value))
            yield family
