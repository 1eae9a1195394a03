"""OpenTelemetry traces across gateway -> router -> worker -> engine; off by default.

One trace per request, linked hop to hop by W3C `traceparent` headers:

    gateway  "POST /v1/chat/completions"   SERVER  tenant, key, priority, status
     └ router "route {model}"              CLIENT  policy, worker, estimated cached tokens
        └ worker "chat {model}"            SERVER  gen_ai.* request/usage/latency attributes
           ├ "engine queue"                 arrival -> first scheduled   (engine timestamps)
           ├ "engine prefill"               first scheduled -> first token
           └ "engine decode"                first token -> finished

Each hop extracts its parent from the incoming `traceparent`, starts its span, and
forwards its own span's `traceparent` (the gateway rewrites the ASGI scope's header,
the router the header block it sends the worker). The engine core process does not
import OpenTelemetry: its spans are made by its worker front end from the timestamps
the core already sends (first scheduled in `SeqUpdate`, first token and finish as the
outputs arrive), which is how vLLM emits its `llm_request` span too. The worker span
carries vLLM's `gen_ai.latency.*` attributes beside the current `gen_ai.*` semantic
conventions (`gen_ai.operation.name`, `gen_ai.request.*`, `gen_ai.response.*`,
`gen_ai.usage.input_tokens` / `output_tokens`).

Off (the default) costs nothing: `start_tracing` returns None, holders keep that None
and test it once per request; nothing imports `opentelemetry` then. On: the flag
`--otlp-traces-endpoint URL` (vLLM's name) or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`;
the SDK honours the standard `OTEL_*` variables itself (`OTEL_SERVICE_NAME`,
`OTEL_TRACES_SAMPLER` / `_ARG`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_BSP_*`,
`OTEL_EXPORTER_OTLP_TRACES_HEADERS` / `_TIMEOUT`). The protocol is OTLP/HTTP protobuf
(the OTel default; `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc` needs the grpc exporter
package installed). Spans leave through a batch processor, off the request path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice import env
from sluice.protocol.errors import InvalidRequestError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from sluice.engine.outputs import RequestOutput

TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"
PROTOCOLS = ("http/protobuf", "grpc")

Headers = Iterable[tuple[bytes, bytes]]


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go. `endpoint` None: tracing off."""

    endpoint: str | None = None
    service_name: str = "sluice"
    protocol: str = "http/protobuf"

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise InvalidRequestError(f"OTLP protocol must be one of {PROTOCOLS}, "
                                      f"got {self.protocol!r}", param="otlp_traces_protocol")
        if self.endpoint is not None and "://" not in self.endpoint:
            raise InvalidRequestError(f"--otlp-traces-endpoint must be a URL, got "
                                      f"{self.endpoint!r}", param="otlp_traces_endpoint")

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    @classmethod
    def resolve(cls, flag: str | None, service_name: str) -> TracingConfig:
        """The flag, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; OTEL_SDK_DISABLED=true wins."""
        if (env.otel("SDK_DISABLED") or "").lower() == "true":
            return cls(None, service_name)
        endpoint = flag or env.otel("EXPORTER_OTLP_TRACES_ENDPOINT") or None
        protocol = env.otel("EXPORTER_OTLP_TRACES_PROTOCOL") or "http/protobuf"
        return cls(endpoint, env.otel("SERVICE_NAME") or service_name, protocol)


def start_tracing(config: TracingConfig) -> Tracing | None:
    """A Tracing exporting to `config.endpoint`, or None when tracing is off."""
    if not config.enabled:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name,
                                                        "process.pid": os.getpid()}))
    batch, delay = _batching()
    provider.add_span_processor(BatchSpanProcessor(_exporter(config), max_export_batch_size=batch,
                                                   schedule_delay_millis=delay))
    return Tracing(provider)


def _batching() -> tuple[int | None, int | None]:
    """Small, frequent export batches unless OTEL_BSP_* say otherwise: encoding a batch
    holds the GIL, and the SDK's default 512 spans at once stalls a busy router's event
    loop for tens of milliseconds (its p99), where 64 every 200 ms spreads the same work."""
    batch = None if env.otel("BSP_MAX_EXPORT_BATCH_SIZE") else 64  # None: the SDK reads env
    delay = None if env.otel("BSP_SCHEDULE_DELAY") else 200
    return batch, delay


def _exporter(config: TracingConfig) -> Any:
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=config.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )
    return HttpExporter(endpoint=config.endpoint)


class Tracing:
    """One process's tracer (its own provider: no global state) and W3C propagation."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("sluice")
        self.propagator = TraceContextTextMapPropagator()
        self._kinds = SpanKind
        self._in_context = set_span_in_context

    def extract(self, headers: Headers) -> Context:
        """The parent context in `headers` (an empty context when there is none)."""
        carrier = {n.decode("latin-1"): v.decode("latin-1") for n, v in headers
                   if n in (TRACEPARENT, TRACESTATE)}
        return self.propagator.extract(carrier)

    def start(self, name: str, parent: Context | None, kind: str = "INTERNAL",
              attributes: Mapping[str, Any] | None = None,
              start_ns: int | None = None) -> Span:
        return self.tracer.start_span(name, context=parent, kind=self._kinds[kind],
                                      attributes=dict(attributes or {}), start_time=start_ns)

    def child_context(self, span: Span) -> Context:
        context: Context = self._in_context(span)
        return context

    def headers(self, span: Span) -> list[tuple[bytes, bytes]]:
        """`traceparent` (and `tracestate`) naming `span` as the parent: W3C's
        `00-{trace id}-{span id}-{flags}`, written directly (the propagator's `inject`
        costs ~30 us a call, on the router's path)."""
        c = span.get_span_context()
        out = [(TRACEPARENT, b"00-%032x-%016x-%02x" % (c.trace_id, c.span_id, c.trace_flags))]
        if c.trace_state:
            out.append((TRACESTATE, c.trace_state.to_header().encode("latin-1")))
        return out

    def flush(self, timeout_ms: int = 5000) -> bool:
        return bool(self.provider.force_flush(timeout_ms))

    def shutdown(self) -> None:
        self.provider.shutdown()


def replace_trace_headers(headers: Headers, tracing: Tracing,
                          span: Span) -> list[tuple[bytes, bytes]]:
    """`headers` with any traceparent/tracestate replaced by `span`'s."""
    kept = [(n, v) for n, v in headers if n not in (TRACEPARENT, TRACESTATE)]
    return kept + tracing.headers(span)


def set_error(span: Span, status: int, attributes: dict[str, Any] | None = None) -> None:
    """Record an HTTP status (with `attributes`, in one call) on a span; 5xx marks it an
    error (4xx is the client's)."""
    span.set_attributes({**(attributes or {}), "http.response.status_code": status})
    if status >= 500:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))


def ns(wall_seconds: float) -> int:
    return int(wall_seconds * 1e9)


# --------------------------------------------------------------------------- worker


OPERATIONS = {"messages": "chat", "prompt": "text_completion"}


class WorkerSpan:
    """The worker's span of one HTTP generation request, and its engine child spans.

    Created by `Run.start` when tracing is on; `finished(out)` for each prompt's final
    output adds the engine's queue/prefill/decode spans and usage; `end()` closes it.
    """

    def __init__(self, tracing: Tracing, parent: Context | None, operation: str, model: str,
                 request_id: str, params: Any, num_prompts: int) -> None:
        self.tracing = tracing
        self.span = tracing.start(f"{operation} {model}", parent, "SERVER", {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "sluice",
            "gen_ai.request.model": model,
            "gen_ai.response.model": model,
            "gen_ai.response.id": request_id,
            **_request_attributes(params, num_prompts),
        })
        self.input_tokens = self.output_tokens = self.cached_tokens = 0
        self.reasons: list[str] = []

    def finished(self, out: RequestOutput, output_tokens: int) -> None:
        """One engine request (one prompt) ended: its usage and its engine spans."""
        self.input_tokens += len(out.prompt_token_ids)
        self.output_tokens += output_tokens
        self.cached_tokens += out.num_cached_tokens
        self.reasons += [c.finish_reason for c in out.outputs if c.finish_reason]
        times = out.metrics
        if times is None or times.first_scheduled_time is None:
            return
        parent = self.tracing.child_context(self.span)
        phases = [("engine queue", times.arrival_time, times.first_scheduled_time),
                  ("engine prefill", times.first_scheduled_time, times.first_token_time),
                  ("engine decode", times.first_token_time, times.finished_time)]
        for name, start, end in phases:
            if start is not None and end is not None:
                span = self.tracing.start(name, parent, "INTERNAL",
                                          {"sluice.engine.request_id": out.request_id},
                                          start_ns=ns(start))
                span.end(end_time=ns(max(end, start)))
        self._latency(times.arrival_time, times.first_scheduled_time, times.first_token_time,
                      times.finished_time)

    def _latency(self, arrival: float, scheduled: float, first: float | None,
                 done: float | None) -> None:
        set_ = self.span.set_attribute
        set_("gen_ai.latency.time_in_queue", max(scheduled - arrival, 0.0))
        if first is not None:
            set_("gen_ai.latency.time_to_first_token", max(first - arrival, 0.0))
            set_("gen_ai.latency.time_in_model_prefill", max(first - scheduled, 0.0))
            if done is not None:
                set_("gen_ai.latency.time_in_model_decode", max(done - first, 0.0))
                set_("gen_ai.latency.e2e", max(done - arrival, 0.0))

    def end(self, error: BaseException | None = None) -> None:
        set_ = self.span.set_attribute
        set_("gen_ai.usage.input_tokens", self.input_tokens)
        set_("gen_ai.usage.output_tokens", self.output_tokens)
        set_("sluice.usage.cached_input_tokens", self.cached_tokens)
        if self.reasons:
            set_("gen_ai.response.finish_reasons", self.reasons)
        if error is not None:
            self.span.record_exception(error)
        self.span.end(time.time_ns())


def _request_attributes(params: Any, num_prompts: int) -> dict[str, Any]:
    names = {"max_tokens": "gen_ai.request.max_tokens", "temperature":
             "gen_ai.request.temperature", "top_p": "gen_ai.request.top_p", "top_k":
             "gen_ai.request.top_k", "seed": "gen_ai.request.seed", "n":
             "gen_ai.request.choice.count", "presence_penalty":
             "gen_ai.request.presence_penalty", "frequency_penalty":
             "gen_ai.request.frequency_penalty"}
    attrs = {key: getattr(params, field) for field, key in names.items()
             if isinstance(getattr(params, field, None), int | float)}
    if num_prompts > 1:
        attrs["sluice.request.num_prompts"] = num_prompts
    return attrs
