"""Tracing: off imports nothing; on, each hop parents the next through `traceparent`.

The router runs over real HTTP (stub workers, both front ends' shared `route`) with an
in-memory span exporter at the edge; the worker's generation span is checked against
the engine's own timestamps.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest

from router.router_stubs import StubState, make_stub, serve, serve_router
from sluice.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.observe.asgi import AdmittedMark, GatewaySpan
from sluice.observe.span_export import MemorySink
from sluice.observe.tracing import (
    Sampler,
    Tracing,
    TracingConfig,
    WorkerSpan,
    parse_traceparent,
    set_error,
    start_tracing,
)
from sluice.protocol.errors import InvalidRequestError
from sluice.router.app import build_app
from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec

from .otlp_receiver import OTLPReceiver

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"


@pytest.fixture()
def traced() -> tuple[Tracing, MemorySink]:
    """Spans kept in a list and read back as the SDK's ReadableSpans, through the same
    conversion the export process uses."""
    sink = MemorySink()
    return Tracing(sink), sink


def test_off_by_default_loads_no_opentelemetry_sdk() -> None:
    """(FastAPI itself imports the OpenTelemetry *API* where it is installed; sluice adds
    neither the SDK nor an exporter, nor any span work, while tracing is off.)"""
    code = (
        "import sys\n"
        "import sluice.serve, sluice.router.routed, sluice.gateway.middleware\n"
        "from sluice.worker.app import build_app\n"
        "from sluice.worker.config import WorkerConfig\n"
        "from sluice.router.app import build_app as router_app\n"
        "from sluice.router.config import RouterConfig\n"
        "from sluice.observe.tracing import TracingConfig, start_tracing\n"
        "build_app(None, WorkerConfig()); router_app(RouterConfig(), local_tokenizers={})\n"
        "assert start_tracing(TracingConfig.resolve(None, 'x')) is None\n"
        "loaded = [m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.exporter', 'opentelemetry.proto'))]\n"
        "assert not loaded, loaded\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr


def test_config_from_flag_and_standard_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert not TracingConfig.resolve(None, "svc").enabled
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "mine")
    on = TracingConfig.resolve(None, "svc")
    assert on.enabled and on.service_name == "mine"
    assert TracingConfig.resolve("http://h:1/v1/traces", "svc").endpoint == "http://h:1/v1/traces"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not TracingConfig.resolve("http://h:1/v1/traces", "svc").enabled
    with pytest.raises(InvalidRequestError):
        TracingConfig("not-a-url")


async def test_router_span_parents_the_worker_request(
        traced: tuple[Tracing, MemorySink]) -> None:
    tracing, sink = traced
    stub = StubState("a")
    async with serve(make_stub(stub)) as worker_url:
        config = RouterConfig(pools=(PoolConfig(workers=(WorkerSpec(worker_url),)),),
                              health_interval_s=60, scrape_interval_s=60)
        app = build_app(config, local_tokenizers={}, tracing=tracing)
        async with serve_router(app) as url, httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/chat/completions", headers={
                "traceparent": TRACEPARENT}, json={
                    "model": "stub-model", "stream": True,
                    "messages": [{"role": "user", "content": "one two three"}]})
            assert resp.status_code == 200
    (span,) = [s for s in sink.finished() if s.name.startswith("route")]
    ctx = span.context
    assert span.name == "route stub-model"
    assert f"{ctx.trace_id:032x}" == CLIENT_TRACE
    assert span.parent is not None and f"{span.parent.span_id:016x}" == CLIENT_PARENT
    attrs = dict(span.attributes or {})
    host, port = worker_url.removeprefix("http://").rsplit(":", 1)
    # OpenTelemetry's server.address is a host (no scheme), server.port its port
    assert (attrs["server.address"], attrs["server.port"]) == (host, int(port))
    assert attrs["sluice.router.worker"] == worker_url and attrs["sluice.router.policy"] == "cost"
    assert attrs["http.response.status_code"] == 200 and attrs["sluice.router.prompt_tokens"] > 0
    assert attrs["sluice.router.retries"] == 0
    sent = stub.headers[-1]["traceparent"]
    assert sent == f"00-{CLIENT_TRACE}-{ctx.span_id:016x}-01"  # the worker's parent: the router
    assert span.end_time is not None and span.end_time >= span.start_time


async def test_gateway_span_rewrites_traceparent_and_records_the_tenant(
        traced: tuple[Tracing, MemorySink]) -> None:
    tracing, sink = traced
    seen: list[dict[bytes, bytes]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(dict(scope["headers"]))
        await send({"type": "http.response.start", "status": 429, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def gateway(scope: Any, receive: Any, send: Any) -> None:  # adds what ours adds
        headers = [*scope["headers"], (b"x-sluice-tenant", b"tn_1"), (b"x-sluice-priority", b"2")]
        await AdmittedMark(app)({**scope, "headers": headers}, receive, send)

    transport = httpx.ASGITransport(app=GatewaySpan(gateway, tracing))  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        resp = await client.post("/v1/completions", headers={"traceparent": TRACEPARENT},
                                 json={})
        assert resp.status_code == 429
        await client.get("/health")  # not /v1: untraced
    (span,) = sink.finished()
    assert span.name == "POST /v1/completions"
    assert span.attributes is not None and span.attributes["sluice.tenant"] == "tn_1"
    assert span.attributes["http.response.status_code"] == 429
    assert [e.name for e in span.events] == ["admitted"]
    assert seen[0][b"traceparent"] == f"00-{CLIENT_TRACE}-{span.context.span_id:016x}-01".encode()
    assert len(seen) == 2 and b"traceparent" not in seen[1]


def test_worker_span_has_gen_ai_attributes_and_engine_phases(
        traced: tuple[Tracing, MemorySink]) -> None:
    tracing, sink = traced
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9)
    span = WorkerSpan(tracing, None, "chat", "m", "req-1", params, 1)
    out = RequestOutput("req-1-0", None, [1, 2, 3, 4], [CompletionOutput(0, "x", [9, 9],
                        finish_reason="length")], True, num_cached_tokens=2,
                        metrics=RequestMetrics(100.0, 100.5, 101.0, 103.0,
                                                               num_preemptions=1,
                                                               num_prefill_chunks=3))
    span.finished(out, output_tokens=2)
    span.end()
    spans = {s.name: s for s in sink.finished()}
    assert set(spans) == {"chat m", "engine queue", "engine prefill", "engine decode"}
    main = spans["chat m"]
    a = dict(main.attributes or {})
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "m"
    assert a["gen_ai.request.max_tokens"] == 7 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.usage.input_tokens"] == 4 and a["gen_ai.usage.output_tokens"] == 2
    assert a["gen_ai.usage.cache_read.input_tokens"] == 2 and a["sluice.engine.preemptions"] == 1
    assert a["sluice.usage.cached_input_tokens"] == 2
    assert a["gen_ai.response.id"] == "chatcmpl-req-1"  # the id the client's response carries
    assert "gen_ai.request.top_k" not in a  # -1: top-k off, not a setting
    assert spans["engine prefill"].attributes["sluice.engine.prefill_chunks"] == 3
    assert spans["engine decode"].attributes["sluice.engine.preemptions"] == 1
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.latency.time_in_queue"] == 0.5 and a["gen_ai.latency.e2e"] == 3.0
    assert a["gen_ai.latency.time_to_first_token"] == 1.0
    for name, (start, end) in {"engine queue": (100.0, 100.5), "engine prefill": (100.5, 101.0),
                               "engine decode": (101.0, 103.0)}.items():
        child = spans[name]
        assert child.parent is not None and child.parent.span_id == main.context.span_id
        assert (child.start_time, child.end_time) == (int(start * 1e9), int(end * 1e9))


def test_spans_leave_through_the_export_process_to_an_otlp_receiver() -> None:
    """start_tracing's sink: a child process that encodes with the SDK and posts OTLP."""
    with OTLPReceiver() as receiver:
        tracing = start_tracing(TracingConfig(receiver.endpoint, "svc"))
        assert tracing is not None
        try:
            parent = tracing.extract([(b"traceparent", TRACEPARENT.encode()),
                                      (b"tracestate", b"vendor=x")])
            span = tracing.start("outer", parent, "SERVER", {"a": 1, "list": [1, 2]})
            span.add_event("admitted")
            span.set_status(2, "HTTP 503")
            child = tracing.start("inner", tracing.child_context(span))
            child.end()
            span.end()
            assert tracing.flush(30_000)
        finally:
            tracing.shutdown()
        spans = {s.name: s for s in receiver.spans()}
    assert set(spans) == {"outer", "inner"}
    outer, inner = spans["outer"], spans["inner"]
    assert outer.service == "svc" and outer.trace_id == CLIENT_TRACE
    assert outer.parent_id == CLIENT_PARENT and inner.parent_id == outer.span_id
    assert outer.attributes == {"a": 1, "list": [1, 2]} and outer.events == ["admitted"]
    assert outer.kind == 2 and outer.end_ns >= outer.start_ns  # SPAN_KIND_SERVER


def test_traceparent_parsing_follows_w3c() -> None:
    good = parse_traceparent(TRACEPARENT.encode())
    assert good is not None and f"{good.trace_id:032x}" == CLIENT_TRACE and good.sampled
    future = parse_traceparent(f"01-{CLIENT_TRACE}-{CLIENT_PARENT}-00-extra".encode())
    assert future is not None and not future.sampled  # a later version may append fields
    for bad in (f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01-extra", f"ff-{CLIENT_TRACE}-{CLIENT_PARENT}-01",
                f"00-{'0' * 32}-{CLIENT_PARENT}-01", f"00-{CLIENT_TRACE}-{'0' * 16}-01",
                f"00-{CLIENT_TRACE.upper()}-{CLIENT_PARENT}-01", f"00-{CLIENT_TRACE}-{CLIENT_PARENT}",
                "garbage", ""):
        assert parse_traceparent(bad.encode()) is None, bad


async def test_router_span_counts_retries_on_other_workers(
        traced: tuple[Tracing, MemorySink]) -> None:
    tracing, sink = traced
    broken, fine = StubState("a", fail_status=500), StubState("b")
    async with serve(make_stub(broken)) as a, serve(make_stub(fine)) as b:
        pool = PoolConfig(workers=(WorkerSpec(a), WorkerSpec(b)), policy="round_robin")
        config = RouterConfig(pools=(pool,), health_interval_s=60, scrape_interval_s=60)
        app = build_app(config, local_tokenizers={}, tracing=tracing)
        async with serve_router(app) as url, httpx.AsyncClient(timeout=10) as client:
            for _ in range(2):
                resp = await client.post(url + "/v1/completions", json={
                    "model": "stub-model", "prompt": "one two"})
                assert resp.status_code == 200
    spans = [s for s in sink.finished() if s.name.startswith("route")]
    assert len(spans) == 2
    assert all(s.attributes is not None and s.attributes["sluice.router.worker"] == b
               for s in spans)
    assert max(int((s.attributes or {})["sluice.router.retries"]) for s in spans) == 1


def test_standard_sampler_variables_are_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    sink = MemorySink()
    tracing = Tracing(sink, Sampler.from_env())
    root = tracing.start("root", None)
    assert not root.is_recording()  # a new trace: ratio 0
    assert tracing.headers(root)[0][1].endswith(b"-00")  # propagated, not sampled
    sampled_parent = tracing.extract([(b"traceparent", TRACEPARENT.encode())])
    child = tracing.start("child", sampled_parent)
    assert child.is_recording()  # the parent decided
    root.end()
    child.end()
    assert [s.name for s in sink.finished()] == ["child"]
    half = Sampler("traceidratio", 0.5)
    assert half.sample(None, (1 << 63) - 1) and not half.sample(None, 1 << 63)
    assert not Sampler("always_off").sample(sampled_parent, 1)
    with pytest.raises(InvalidRequestError):
        Sampler("jaeger_remote")


@pytest.mark.parametrize("arg", ["half", "nan"])
def test_a_sampler_ratio_that_is_not_a_number_is_refused(
        arg: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`nan` parsed as a float and failed later in `round()` with a ValueError traceback
    from `sluice serve`, instead of the InvalidRequestError its CLI prints as an error."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    with pytest.raises(InvalidRequestError, match="OTEL_TRACES_SAMPLER_ARG must be a number"):
        Sampler.from_env()


def test_grpc_without_its_exporter_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The export process died on the import at the first span (a ModuleNotFoundError
    traceback, then "tracing stops"), after the server had started as if tracing."""
    import importlib.util

    from sluice.observe.tracing import GRPC_EXPORTER, TracingConfig, start_tracing

    try:
        installed = importlib.util.find_spec(GRPC_EXPORTER) is not None
    except ModuleNotFoundError:
        installed = False
    if installed:
        pytest.skip("the grpc exporter is installed here")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    with pytest.raises(InvalidRequestError, match="opentelemetry-exporter-otlp-proto-grpc"):
        start_tracing(TracingConfig.resolve("http://127.0.0.1:4317", "sluice-test"))


def test_a_5xx_is_an_error_with_its_error_type(traced: tuple[Tracing, MemorySink]) -> None:
    """OpenTelemetry's HTTP conventions: a failed request's span has `error.type` (the
    status code) beside the Error status; a 4xx is the client's and is neither."""
    tracing, sink = traced
    for status in (503, 429):
        span = tracing.start(f"s{status}", None, "SERVER")
        set_error(span, status)
        span.end()
    spans = {s.name: s for s in sink.finished()}
    failed, refused = dict(spans["s503"].attributes or {}), dict(spans["s429"].attributes or {})
    assert failed["error.type"] == "503" and not spans["s503"].status.is_ok
    assert "error.type" not in refused and refused["http.response.status_code"] == 429


async def test_a_migrated_stream_names_the_worker_that_finished_it(
        traced: tuple[Tracing, MemorySink]) -> None:
    """A stream whose worker died mid-way and that another worker resumed (migrate.py)
    ended with a route span naming only the dead worker and nothing of the move (seen
    killing a worker of sluice serve --workers 2 under streams)."""
    from types import SimpleNamespace

    from sluice.observe.route_span import traced_route

    tracing, sink = traced

    def ticket(url: str) -> Any:
        return SimpleNamespace(endpoint=SimpleNamespace(url=url), prompt_tokens=8,
                               uncached_tokens=8)

    reply = SimpleNamespace(status=200, retries=0, migrations=0, on_close=None,
                            ticket=ticket("http://10.0.0.1:8001"))

    async def inner(*args: Any) -> Any:
        args[-1].update(model="m", policy="cost")
        return reply

    assert await traced_route(tracing, inner, None, "chat", "/v1/chat/completions", b"",
                              []) is reply
    reply.migrations, reply.ticket = 1, ticket("http://10.0.0.2:8002")  # as _migrate does
    reply.on_close(reply)
    (span,) = sink.finished()
    a = dict(span.attributes or {})
    assert (a["server.address"], a["server.port"]) == ("10.0.0.2", 8002)
    assert a["sluice.router.worker"] == "http://10.0.0.2:8002"
    assert a["sluice.router.first_worker"] == "http://10.0.0.1:8001"
    assert a["sluice.router.migrations"] == 1
