"""The observability flags every serving command shares (`sluice worker`, `router`, `serve`).

    --otlp-traces-endpoint URL   export OpenTelemetry traces (OTLP/HTTP), vLLM's flag name;
                                 default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off
    --metrics-buckets SPEC       histogram buckets, e.g. 'itl=0.001,0.002;ttft=0.01,0.1'
                                 (over SLUICE_METRICS_BUCKETS; see observe/buckets.py)
"""

from __future__ import annotations

import argparse

from sluice.observe.buckets import LatencyBuckets
from sluice.observe.tracing import TracingConfig


def add_observe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces here (OTLP/HTTP protobuf, e.g. "
                        "http://127.0.0.1:4318/v1/traces); default: "
                        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else tracing is off")
    p.add_argument("--metrics-buckets", default=None, metavar="SPEC",
                   help="latency histogram buckets in seconds, NAME=b1,b2,... joined by ';' "
                        "(names: ttft itl tpot e2e queue prefill decode inference decision "
                        "first_byte admission); default: $SLUICE_METRICS_BUCKETS, else "
                        "sluice's fine defaults")


def tracing_config(args: argparse.Namespace, service_name: str) -> TracingConfig:
    return TracingConfig.resolve(getattr(args, "otlp_traces_endpoint", None), service_name)


def buckets(args: argparse.Namespace) -> LatencyBuckets:
    return LatencyBuckets.from_env(getattr(args, "metrics_buckets", None))


def observe_flags(args: argparse.Namespace) -> list[str]:
    """The observability flags given, as command-line arguments for a child process."""
    flags: list[str] = []
    if getattr(args, "otlp_traces_endpoint", None):
        flags += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    if getattr(args, "metrics_buckets", None):
        flags += ["--metrics-buckets", args.metrics_buckets]
    return flags
