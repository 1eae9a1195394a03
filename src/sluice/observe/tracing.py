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
trace: its spans are made by its worker front end from the timestamps the core already
sends (first scheduled in `SeqUpdate`, first token and finish as the outputs arrive),
which is how vLLM emits its `llm_request` span too. The worker span carries vLLM's
`gen_ai.latency.*` attributes beside the current `gen_ai.*` semantic conventions.

Where the work happens. A span here is a small plain object (`Span`): ids from
`random.getrandbits`, times from `time.time_ns`, attributes in a dict; ending it appends
one tuple to a queue. The OpenTelemetry SDK, its protobuf encoding and the OTLP export
run in a child process (`observe/span_export.py`), which gets the tuples in batches over
a pipe. Why not the SDK's spans in-process, as vLLM does: on the router's path an SDK
span cost ~50-100 us to create and end and ~50 us more to encode, all holding the GIL
of the process that relays every request (measured: +0.27 ms p50 at 300 req/s, and the
saturation ceiling halved; docs/observe.md). The wire format is still the SDK's.

Off (the default) costs nothing: `start_tracing` returns None, holders keep that None
and test it once per request; nothing imports `opentelemetry` then. On: the flag
`--otlp-traces-endpoint URL` (vLLM's name) or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`.
The standard variables keep their meaning: `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER` /
`_ARG` (the six standard samplers, decided here, at the span's start),
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_BSP_*` and `OTEL_EXPORTER_OTLP_TRACES_HEADERS` /
`_TIMEOUT` (read by the SDK in the export process). The protocol is OTLP/HTTP protobuf
(the OTel default; `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc` needs the grpc exporter
package installed).
"""

from __future__ import annotations

import contextvars
import importlib.util
import logging
import math
import random
import re
import time
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from sluice import env
from sluice.protocol.errors import InvalidRequestError

if TYPE_CHECKING:
    from sluice.engine.outputs import RequestOutput

log = logging.getLogger(__name__)

TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"
PROTOCOLS = ("http/protobuf", "grpc")
KINDS = ("INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
UNSET, OK, ERROR = 0, 1, 2  # OpenTelemetry's status codes

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


GRPC_EXPORTER = "opentelemetry.exporter.otlp.proto.grpc"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def start_tracing(config: TracingConfig) -> Tracing | None:
    """A Tracing exporting to `config.endpoint` through a child process, or None when
    tracing is off."""
    if not config.enabled:
        return None
    if config.protocol == "grpc" and not _installed(GRPC_EXPORTER):
        # else the export process dies on its import at the first span, tracing stops
        raise InvalidRequestError("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc needs the "
                                  "opentelemetry-exporter-otlp-proto-grpc package; install "
                                  "it or use http/protobuf",
                                  param="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    from sluice.observe.span_export import SpanPipe

    return Tracing(SpanPipe(config), Sampler.from_env())


# --------------------------------------------------------------------------- spans


@dataclass(frozen=True, slots=True)
class SpanContext:
    """W3C trace context: ids as ints, `flags` bit 0 = sampled, `state` the raw
    `tracestate` header (passed on unchanged)."""

    trace_id: int
    span_id: int
    flags: int = 1
    state: str = ""
    remote: bool = False

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)


class SpanRecord(NamedTuple):
    """A finished span as it crosses to the export process (a plain tuple to pickle)."""

    name: str
    trace_id: int
    span_id: int
    parent_id: int  # 0: a root span
    parent_remote: bool
    flags: int
    state: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    status: tuple[int, str]


class SpanSink(Protocol):
    """Where finished spans go: the export process (`span_export.SpanPipe`) or a test's
    list."""

    resource: dict[str, Any]

    def emit(self, record: SpanRecord) -> None: ...
    def flush(self, timeout_s: float) -> bool: ...
    def shutdown(self) -> None: ...


class Span:
    """One span; the subset of OpenTelemetry's Span API that sluice uses. A span that
    is not sampled records nothing (its context still propagates, flags 00)."""

    __slots__ = ("name", "context", "parent", "kind", "start_ns", "attributes", "events",
                 "status", "_sink", "_ended")

    def __init__(self, name: str, context: SpanContext, parent: SpanContext | None,
                 kind: str, start_ns: int, attributes: dict[str, Any],
                 sink: SpanSink | None) -> None:
        self.name, self.context, self.parent, self.kind = name, context, parent, kind
        self.start_ns, self.attributes = start_ns, attributes
        self.events: list[tuple[str, int, dict[str, Any]]] = []
        self.status: tuple[int, str] = (UNSET, "")
        self._sink = sink  # None: not sampled
        self._ended = False

    def is_recording(self) -> bool:
        return self._sink is not None and not self._ended

    def get_span_context(self) -> SpanContext:
        return self.context

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def update_name(self, name: str) -> None:
        self.name = name

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        if self._sink is not None:
            self.events.append((name, time.time_ns(), dict(attributes or {})))

    def set_status(self, code: int, description: str = "") -> None:
        self.status = (code, description if code == ERROR else "")

    def record_exception(self, exc: BaseException) -> None:
        """OpenTelemetry's `exception` event (type, message, stack trace)."""
        self.add_event("exception", {
            "exception.type": type(exc).__qualname__, "exception.message": str(exc),
            "exception.stacktrace": "".join(traceback.format_exception(exc)),
            "exception.escaped": "False"})

    def end(self, end_time: int | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        if self._sink is None:
            return
        c, p = self.context, self.parent
        self._sink.emit(SpanRecord(
            self.name, c.trace_id, c.span_id, p.span_id if p else 0, bool(p and p.remote),
            c.flags, c.state, self.kind, self.start_ns,
            end_time if end_time is not None else time.time_ns(), self.attributes,
            self.events, self.status))


class Sampler:
    """OTEL_TRACES_SAMPLER's six standard samplers, decided at a span's start:
    always_on, always_off, traceidratio (OTEL_TRACES_SAMPLER_ARG, the lower 64 bits of
    the trace id against the ratio, as the SDK does), and parentbased_* of each (a span
    with a parent follows the parent's sampled flag). Default: parentbased_always_on."""

    NAMES = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
             "parentbased_always_off", "parentbased_traceidratio")

    def __init__(self, name: str = "parentbased_always_on", ratio: float = 1.0) -> None:
        if name not in self.NAMES:
            raise InvalidRequestError(f"OTEL_TRACES_SAMPLER must be one of {self.NAMES}, "
                                      f"got {name!r}", param="OTEL_TRACES_SAMPLER")
        self.parent_based = name.startswith("parentbased_")
        root = name.removeprefix("parentbased_")
        self.bound = {"always_on": 1 << 64, "always_off": 0}.get(
            root, round(min(max(ratio, 0.0), 1.0) * (1 << 64)))

    @classmethod
    def from_env(cls) -> Sampler:
        name = (env.otel("TRACES_SAMPLER") or "parentbased_always_on").strip().lower()
        arg = env.otel("TRACES_SAMPLER_ARG")
        try:
            ratio = float(arg) if arg else 1.0
        except ValueError:
            ratio = math.nan
        if math.isnan(ratio):
            raise InvalidRequestError(f"OTEL_TRACES_SAMPLER_ARG must be a number, got "
                                      f"{arg!r}", param="OTEL_TRACES_SAMPLER_ARG")
        return cls(name, ratio)

    def sample(self, parent: SpanContext | None, trace_id: int) -> bool:
        if self.parent_based and parent is not None:
            return parent.sampled
        return (trace_id & 0xFFFFFFFFFFFFFFFF) < self.bound


# The incoming request's trace parent, where a layer sets it for code below (the
# worker's TraceContext for its generation span).
REQUEST_PARENT: contextvars.ContextVar[SpanContext | None] = contextvars.ContextVar(
    "sluice_trace_parent", default=None)


class Tracing:
    """One process's tracer: makes spans, reads and writes W3C `traceparent`."""

    def __init__(self, sink: SpanSink, sampler: Sampler | None = None) -> None:
        self.sink = sink
        self.sampler = sampler or Sampler()
        self.resource = sink.resource

    def extract(self, headers: Headers) -> SpanContext | None:
        """The parent in `headers`' traceparent (and tracestate), None when there is none
        or it is malformed (W3C: then start a new trace)."""
        parent, state = None, ""
        for name, value in headers:
            if name == TRACEPARENT:
                parent = parse_traceparent(value)
            elif name == TRACESTATE:
                state = value.decode("latin-1")
        if parent is not None and state:
            parent = SpanContext(parent.trace_id, parent.span_id, parent.flags, state, True)
        return parent

    def start(self, name: str, parent: SpanContext | None, kind: str = "INTERNAL",
              attributes: Mapping[str, Any] | None = None,
              start_ns: int | None = None) -> Span:
        trace_id = parent.trace_id if parent is not None else _new_id(128)
        sampled = self.sampler.sample(parent, trace_id)
        context = SpanContext(trace_id, _new_id(64), 1 if sampled else 0,
                              parent.state if parent is not None else "")
        return Span(name, context, parent, kind,
                    start_ns if start_ns is not None else time.time_ns(),
                    dict(attributes or {}), self.sink if sampled else None)

    def child_context(self, span: Span) -> SpanContext:
        return span.context

    def headers(self, span: Span) -> list[tuple[bytes, bytes]]:
        """`traceparent` (and `tracestate`) naming `span` as the parent: W3C's
        `00-{trace id}-{span id}-{flags}`."""
        c = span.context
        out = [(TRACEPARENT, b"00-%032x-%016x-%02x" % (c.trace_id, c.span_id, c.flags))]
        if c.state:
            out.append((TRACESTATE, c.state.encode("latin-1")))
        return out

    def flush(self, timeout_ms: int = 5000) -> bool:
        """Every span ended so far exported (or the timeout passed: False)."""
        return self.sink.flush(timeout_ms / 1000)

    def shutdown(self) -> None:
        self.sink.shutdown()


def parse_traceparent(value: bytes) -> SpanContext | None:
    """W3C `version-traceid-parentid-flags`; None for anything malformed (all-zero ids,
    version ff, wrong lengths, upper-case or non-hex), as the spec says to ignore it."""
    m = _TRACEPARENT_RE.fullmatch(value.strip())
    if m is None or m[1] == b"ff" or (m[1] == b"00" and m[5]):
        return None
    trace_id, span_id = int(m[2], 16), int(m[3], 16)
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, int(m[4], 16), "", True)


_TRACEPARENT_RE = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def _new_id(bits: int) -> int:
    while True:
        value = random.getrandbits(bits)
        if value:
            return value


def replace_trace_headers(headers: Headers, tracing: Tracing,
                          span: Span) -> list[tuple[bytes, bytes]]:
    """`headers` with any traceparent/tracestate replaced by `span`'s."""
    kept = [(n, v) for n, v in headers if n not in (TRACEPARENT, TRACESTATE)]
    return kept + tracing.headers(span)


def set_error(span: Span, status: int, attributes: dict[str, Any] | None = None) -> None:
    """Record an HTTP status (with `attributes`, in one call) on a span; 5xx marks it an
    error, with `error.type` the status code as OpenTelemetry's HTTP conventions say (4xx
    is the client's)."""
    span.set_attributes({**(attributes or {}), "http.response.status_code": status})
    if status >= 500:
        span.set_attribute("error.type", str(status))
        span.set_status(ERROR, f"HTTP {status}")


def ns(wall_seconds: float) -> int:
    return int(wall_seconds * 1e9)


# --------------------------------------------------------------------------- worker


OPERATIONS = {"messages": "chat", "prompt": "text_completion"}
# the id the client's response carries (`chatcmpl-{request id}`, `cmpl-{request id}`)
RESPONSE_ID_PREFIXES = {"chat": "chatcmpl-", "text_completion": "cmpl-"}


class WorkerSpan:
    """The worker's span of one HTTP generation request, and its engine child spans.

    Created by `Run.start` when tracing is on; `finished(out)` for each prompt's final
    output adds the engine's queue/prefill/decode spans and usage, `aborted` a prompt's
    usage so far when it ends unfinished; `end()` closes it.
    """

    def __init__(self, tracing: Tracing, parent: SpanContext | None, operation: str, model: str,
                 request_id: str, params: Any, num_prompts: int) -> None:
        self.tracing = tracing
        self.span = tracing.start(f"{operation} {model}", parent, "SERVER", {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "sluice",
            "gen_ai.request.model": model,
            "gen_ai.response.model": model,
            "gen_ai.response.id": RESPONSE_ID_PREFIXES.get(operation, "") + request_id,
            **_request_attributes(params, num_prompts),
        })
        self.input_tokens = self.output_tokens = self.cached_tokens = self.preemptions = 0
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
        self.preemptions += times.num_preemptions
        parent = self.tracing.child_context(self.span)
        own: dict[str, Any] = {"sluice.engine.request_id": out.request_id}
        phases: list[tuple[str, float | None, float | None, dict[str, Any]]] = [("engine queue", times.arrival_time, times.first_scheduled_time, own),
                  ("engine prefill", times.first_scheduled_time, times.first_token_time,
                   {**own, "sluice.engine.prefill_chunks": times.num_prefill_chunks}),
                  ("engine decode", times.first_token_time, times.finished_time,
                   {**own, "sluice.engine.preemptions": times.num_preemptions})]
        for name, start, end, attributes in phases:
            if start is not None and end is not None:
                span = self.tracing.start(name, parent, "INTERNAL", attributes,
                                          start_ns=ns(start))
                span.end(end_time=ns(max(end, start)))
        self._latency(times.arrival_time, times.first_scheduled_time, times.first_token_time,
                      times.finished_time)

    def aborted(self, input_tokens: int, output_tokens: int) -> None:
        """One prompt's engine request was aborted before its end (the client went away,
        or the request failed): its usage so far and vLLM's finish reason `abort`."""
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.reasons.append("abort")
        self.span.set_attribute("sluice.request.aborted", True)

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
        set_("gen_ai.usage.cache_read.input_tokens", self.cached_tokens)
        set_("sluice.usage.cached_input_tokens", self.cached_tokens)  # its name before
        set_("sluice.engine.preemptions", self.preemptions)
        if self.reasons:
            set_("gen_ai.response.finish_reasons", self.reasons)
        if error is not None:
            self.span.record_exception(error)
            set_("error.type", type(error).__qualname__)
            self.span.set_status(ERROR, str(error)[:200])
        self.span.end()


def _request_attributes(params: Any, num_prompts: int) -> dict[str, Any]:
    names = {"max_tokens": "gen_ai.request.max_tokens", "temperature":
             "gen_ai.request.temperature", "top_p": "gen_ai.request.top_p", "top_k":
             "gen_ai.request.top_k", "seed": "gen_ai.request.seed", "n":
             "gen_ai.request.choice.count", "presence_penalty":
             "gen_ai.request.presence_penalty", "frequency_penalty":
             "gen_ai.request.frequency_penalty"}
    attrs = {key: getattr(params, field) for field, key in names.items()
             if isinstance(getattr(params, field, None), int | float)}
    if attrs.get("gen_ai.request.top_k", 1) < 1:  # -1 (or 0): top-k off, not a setting
        del attrs["gen_ai.request.top_k"]
    if num_prompts > 1:
        attrs["sluice.request.num_prompts"] = num_prompts
    return attrs
