"""Grafana dashboards for the whole path, generated from code (grafanalib).

    python -m sluice.observe.dashboards deploy/grafana     # rewrites the JSON files

Four dashboards, one per layer an operator asks about:

    overview   requests/s, errors, TTFT and inter-token latency p50/p99, tokens/s, queue,
               KV, hit rate
    engine     per worker: running/waiting, KV usage, preemptions, queue/prefill/decode
               time, e2e latency, prompt and generation tokens, engine steps
    router     decisions per worker (share), decision latency, first byte latency,
               estimated vs observed prefix hits, retries, migrations, ejections, worker
               health
    gateway    per tenant: requests, tokens, spend; refusals by reason, limiter errors,
               admission latency, budget used

Every query reads only metrics sluice exports (`tests/observe/test_stack.py` scrapes
each process of `sluice serve --workers 2` and checks every name used here), with
vLLM's names for the worker's, so the engine dashboard also fits vLLM workers. The
generated JSON is committed beside the Prometheus rules; a test keeps it in sync.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafanalib._gen import DashboardEncoder
from grafanalib.core import Dashboard, GridPos, Target, Template, Templating, TimeSeries

DS = "${datasource}"


@dataclass(frozen=True)
class Panel:
    """One time-series panel: title, unit (Grafana's), (PromQL, legend) pairs."""

    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]


def _q(quantile: float, metric: str, by: str = "model_name") -> str:
    return (f"histogram_quantile({quantile}, sum by ({by}, le) "
            f"(rate({metric}_bucket[$__rate_interval])))")


def _rate(metric: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}[$__rate_interval]))"


OVERVIEW = (
    Panel("Requests/s by status (router)", "reqps",
          ((_rate("sluice_router_requests_total", "status"), "{{status}}"),)),
    Panel("5xx ratio", "percentunit",  # 0, not "No data", while no 5xx series exists
          (('(sum(rate(sluice_router_requests_total{status=~"5.."}[$__rate_interval])) '
            "or vector(0)) / sum(rate(sluice_router_requests_total[$__rate_interval]))",
            "5xx"),)),
    Panel("Time to first token", "s",
          ((_q(0.5, "vllm:time_to_first_token_seconds"), "p50 {{model_name}}"),
           (_q(0.99, "vllm:time_to_first_token_seconds"), "p99 {{model_name}}"))),
    Panel("Inter-token latency", "s",
          ((_q(0.5, "vllm:inter_token_latency_seconds"), "p50 {{model_name}}"),
           (_q(0.99, "vllm:inter_token_latency_seconds"), "p99 {{model_name}}"))),
    Panel("Output tokens/s", "short",
          ((_rate("vllm:generation_tokens_total", "model_name"), "{{model_name}}"),)),
    Panel("Queue and batch", "short",
          (("sum by (model_name) (vllm:num_requests_waiting)", "waiting {{model_name}}"),
           ("sum by (model_name) (vllm:num_requests_running)", "running {{model_name}}"))),
    Panel("KV cache usage (max over workers)", "percentunit",
          (("max by (model_name) (vllm:kv_cache_usage_perc)", "{{model_name}}"),)),
    Panel("Prefix cache hit rate", "percentunit",
          ((f"{_rate('vllm:prefix_cache_hits_total', 'model_name')} / "
            f"{_rate('vllm:prefix_cache_queries_total', 'model_name')}", "{{model_name}}"),)),
)

ENGINE = (
    Panel("Running / waiting per worker", "short",
          (("vllm:num_requests_running", "running {{instance}}"),
           ("vllm:num_requests_waiting", "waiting {{instance}}"))),
    Panel("KV cache usage per worker", "percentunit",
          (("vllm:kv_cache_usage_perc", "{{instance}}"),)),
    Panel("Queue / prefill / decode time p99", "s",
          ((_q(0.99, "vllm:request_queue_time_seconds"), "queue"),
           (_q(0.99, "vllm:request_prefill_time_seconds"), "prefill"),
           (_q(0.99, "vllm:request_decode_time_seconds"), "decode"))),
    Panel("End-to-end latency", "s",
          ((_q(0.5, "vllm:e2e_request_latency_seconds"), "p50"),
           (_q(0.99, "vllm:e2e_request_latency_seconds"), "p99"))),
    Panel("Time per output token per request p99", "s",
          ((_q(0.99, "vllm:request_time_per_output_token_seconds"), "p99"),)),
    Panel("Preemptions/s", "short",
          ((_rate("vllm:num_preemptions_total", "instance"), "{{instance}}"),)),
    Panel("Prompt and generation tokens/s", "short",
          ((_rate("vllm:prompt_tokens_total", "instance"), "prompt {{instance}}"),
           (_rate("vllm:generation_tokens_total", "instance"), "generation {{instance}}"))),
    Panel("Finished requests/s by reason", "reqps",
          ((_rate("vllm:request_success_total", "finished_reason"), "{{finished_reason}}"),)),
    Panel("Engine steps/s", "short",
          ((_rate("sluice:engine_steps_total", "instance"), "{{instance}}"),)),
    Panel("HTTP generation requests in flight per worker", "short",
          (("sluice:http_requests_pending", "{{instance}}"),)),
    Panel("Generation requests refused by the worker/s, by reason", "reqps",
          ((_rate("sluice:requests_rejected_total", "reason"), "{{reason}}"),)),
)

ROUTER = (
    Panel("Decisions/s per worker (share)", "reqps",
          ((_rate("sluice_router_decisions_total", "worker"), "{{worker}}"),)),
    Panel("Decision latency", "s",
          ((_q(0.5, "sluice_router_decision_seconds", "policy"), "p50 {{policy}}"),
           (_q(0.99, "sluice_router_decision_seconds", "policy"), "p99 {{policy}}"))),
    Panel("Time to first byte through the router", "s",
          ((_q(0.5, "sluice_router_first_byte_seconds", "model"), "p50 {{model}}"),
           (_q(0.99, "sluice_router_first_byte_seconds", "model"), "p99 {{model}}"))),
    Panel("Prefix hits: router's estimate vs engines' count", "percentunit",
          (("sum(rate(sluice_router_estimated_prefix_hit_tokens_total[$__rate_interval])) / "
            "sum(rate(sluice_router_prompt_tokens_total[$__rate_interval]))", "estimated"),
           ("sum(rate(vllm:prefix_cache_hits_total[$__rate_interval])) / "
            "sum(rate(vllm:prefix_cache_queries_total[$__rate_interval]))", "observed"))),
    Panel("Retries, mid-stream migrations and ejections", "short",
          ((_rate("sluice_router_retries_total", "reason"), "retry {{reason}}"),
           (_rate("sluice_router_migrations_total", "reason"), "migrated {{reason}}"),
           (_rate("sluice_router_ejections_total", "worker"), "ejected {{worker}}"))),
    Panel("Worker health and in flight", "short",
          (("sluice_router_worker_healthy", "healthy {{worker}}"),
           ("sluice_router_worker_inflight", "in flight {{worker}}"))),
    Panel("Router's load estimate per worker", "short",
          (("sluice_router_worker_running", "running {{worker}}"),
           ("sluice_router_worker_waiting", "waiting {{worker}}"))),
    Panel("KV events applied/s", "short",
          ((_rate("sluice_router_kv_events_total", "type"), "{{type}}"),)),
)

GATEWAY = (
    Panel("Requests/s per tenant", "reqps",
          ((_rate("sluice_gateway_requests_total", "tenant, status"), "{{tenant}} {{status}}"),)),
    Panel("Tokens/s per tenant", "short",
          ((_rate("sluice_gateway_tokens_total", "tenant, kind"), "{{tenant}} {{kind}}"),)),
    Panel("Spend per tenant (USD/h)", "currencyUSD",
          (("sum by (tenant) (rate(sluice_gateway_spend_usd_total[$__rate_interval])) * 3600",
            "{{tenant}}"),)),
    Panel("Refusals/s by reason (429s and others)", "reqps",
          ((_rate("sluice_gateway_rejections_total", "reason"), "{{reason}}"),)),
    Panel("Rate-limiter errors/s", "short",
          ((_rate("sluice_gateway_limiter_errors_total", "mode"), "{{mode}}"),)),
    Panel("Admission latency", "s",
          (("histogram_quantile(0.99, sum by (le) "
            "(rate(sluice_gateway_admission_seconds_bucket[$__rate_interval])))", "p99"),)),
    Panel("In flight", "short", (("sluice_gateway_requests_in_flight", "in flight"),
                                 ("sluice_gateway_background_responses", "background"))),
    Panel("Background responses lost with their replica/s", "short",
          (("sum(rate(sluice_gateway_background_responses_lost_total[$__rate_interval]))",
            "lost"),)),
    Panel("Budget used per tenant", "percentunit",
          (("sluice_gateway_budget_used_ratio", "{{tenant}}"),)),
)

DASHBOARDS: dict[str, tuple[str, tuple[Panel, ...]]] = {
    "sluice-overview": ("sluice / overview", OVERVIEW),
    "sluice-engine": ("sluice / engine", ENGINE),
    "sluice-router": ("sluice / router", ROUTER),
    "sluice-gateway": ("sluice / gateway and tenants", GATEWAY),
}


def _panel(panel: Panel, index: int) -> TimeSeries:
    targets = [Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + i), datasource=DS)
               for i, (expr, legend) in enumerate(panel.queries)]
    return TimeSeries(title=panel.title, dataSource=DS, targets=targets, unit=panel.unit,
                      gridPos=GridPos(h=8, w=12, x=12 * (index % 2), y=8 * (index // 2)))


def dashboard(uid: str) -> Dashboard:
    title, panels = DASHBOARDS[uid]
    datasource = Template(name="datasource", query="prometheus", type="datasource",
                          label="Prometheus", default="Prometheus")
    return Dashboard(title=title, uid=uid, tags=["sluice"], refresh="10s",
                     templating=Templating(list=[datasource]),
                     panels=[_panel(p, i) for i, p in enumerate(panels)]).auto_panel_ids()


def render(uid: str) -> str:
    """The dashboard's JSON, as committed under deploy/grafana."""
    data: Any = dashboard(uid).to_json_data()
    return json.dumps(data, cls=DashboardEncoder, indent=2, sort_keys=True) + "\n"


def queries() -> list[str]:
    """Every PromQL expression of every dashboard."""
    return [expr for _, panels in DASHBOARDS.values() for p in panels for expr, _ in p.queries]


def write_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for uid in DASHBOARDS:
        path = out_dir / f"{uid}.json"
        path.write_text(render(uid))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.observe.dashboards",
                                     description="Write the Grafana dashboards' JSON.")
    parser.add_argument("out_dir", nargs="?", default="deploy/grafana",
                        help="directory to write sluice-*.json into (default %(default)s)")
    args = parser.parse_args(argv)
    for written in write_all(Path(args.out_dir)):
        print(written)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
