"""Spans leave the process that made them: encoded and exported by the OpenTelemetry SDK
in a child process, so that no request's process pays for either.

    request path              sender thread              export process
    span.end() ─► deque ───► pickled batch ─(pipe)─► ReadableSpan ─► BatchSpanProcessor
    (one append)            (every 100 ms or 64)      (SDK)          ─► OTLP exporter

`SpanPipe` is the parent side (`Tracing`'s sink when tracing is on); `main` is the
child, started as `python -m sluice.observe.span_export CONFIG` with the pipe on its
stdin and acknowledgements of flushes on its stdout. The queue holds at most
OTEL_BSP_MAX_QUEUE_SIZE spans (2048): past that new spans are dropped and counted, as
the SDK's own batch processor does. The child reads OTEL_BSP_*, OTEL_RESOURCE_ATTRIBUTES
and OTEL_EXPORTER_OTLP_TRACES_* itself (it inherits the environment). If the parent
dies, the pipe closes: the child exports what it has and exits. If the child dies, the
parent logs it once and drops spans from then on; requests never wait for tracing.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
from collections import deque
from typing import IO, Any

from sluice import env
from sluice.observe.tracing import SpanRecord, TracingConfig

log = logging.getLogger(__name__)

HANDOVER_SPANS = 64  # a batch this size goes at once; fewer wait for the next tick
HANDOVER_S = 0.1
ACK_TIMEOUT_S = 30.0


def _max_queue() -> int:
    value = env.otel("BSP_MAX_QUEUE_SIZE")
    return int(value) if value and value.isdigit() and int(value) > 0 else 2048


class SpanPipe:
    """Queues finished spans and hands them to the export process in batches."""

    def __init__(self, config: TracingConfig) -> None:
        self.resource: dict[str, Any] = {"service.name": config.service_name, "process.pid": os.getpid()}
        self.dropped = 0
        self._queue: deque[SpanRecord] = deque()
        self._max_queue = _max_queue()
        self._wake = threading.Event()
        self._flushes: list[threading.Event] = []
        self._lock = threading.Lock()
        self._closing = self._dead = False
        child_config = {"endpoint": config.endpoint, "protocol": config.protocol,
                        "resource": self.resource}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.observe.span_export", json.dumps(child_config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self._thread = threading.Thread(target=self._run, name="sluice-span-pipe", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)  # as the SDK's provider does: queued spans go out

    # -- the request path ---------------------------------------------------------
    def emit(self, record: SpanRecord) -> None:
        if self._dead or len(self._queue) >= self._max_queue:
            self.dropped += 1
            return
        self._queue.append(record)
        if len(self._queue) >= HANDOVER_SPANS:
            self._wake.set()

    # -- control ------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """True once every span emitted before the call has been exported."""
        if self._dead:
            return False
        done = threading.Event()
        with self._lock:
            self._flushes.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def shutdown(self) -> None:
        """Send what is queued, close the pipe and let the child export and exit."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        self._thread.join(10)
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self.dropped:
            log.warning("tracing dropped %d spans (queue full or export process gone)",
                        self.dropped)

    # -- the sender thread --------------------------------------------------------
    def _run(self) -> None:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        try:
            while not self._closing:
                self._wake.wait(HANDOVER_S)
                self._wake.clear()
                self._send(stdin)
                with self._lock:
                    waiting, self._flushes = self._flushes, []
                if waiting:
                    self._ask_flush(stdin, stdout)
                    for done in waiting:
                        done.set()
            self._send(stdin)
            stdin.close()
        except (BrokenPipeError, OSError, EOFError, TimeoutError) as exc:
            self._dead = True
            log.warning("the span export process is gone (%s); tracing stops", exc)

    def _send(self, stdin: IO[bytes]) -> None:
        while self._queue:
            n = min(len(self._queue), 512)
            batch = [self._queue.popleft() for _ in range(n)]
            pickle.dump(("spans", batch), stdin, protocol=pickle.HIGHEST_PROTOCOL)
        stdin.flush()

    def _ask_flush(self, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        pickle.dump(("flush", None), stdin, protocol=pickle.HIGHEST_PROTOCOL)
        stdin.flush()
        ready, _, _ = select.select([stdout], [], [], ACK_TIMEOUT_S)
        if not ready or not stdout.readline():
            raise TimeoutError("no flush acknowledgement from the span export process")


class MemorySink:
    """Keeps finished spans in a list (tests, and embedding code that reads its own)."""

    def __init__(self, service_name: str = "sluice") -> None:
        self.resource: dict[str, Any] = {"service.name": service_name, "process.pid": os.getpid()}
        self.records: list[SpanRecord] = []

    def emit(self, record: SpanRecord) -> None:
        self.records.append(record)

    def flush(self, timeout_s: float) -> bool:
        return True

    def shutdown(self) -> None:
        pass

    def finished(self) -> list[Any]:
        """The spans as the SDK's `ReadableSpan`s, converted as the export process does."""
        from opentelemetry.sdk.resources import Resource

        resource = Resource.create(self.resource)
        return [to_readable(r, resource) for r in self.records]


# --------------------------------------------------------------------------- the child


def to_readable(r: SpanRecord, resource: Any) -> Any:
    """A `SpanRecord` as the SDK's `ReadableSpan` (attributes cleaned as the SDK's own
    spans clean them: invalid values dropped, lists made tuples)."""
    from opentelemetry.attributes import BoundedAttributes
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
    from opentelemetry.trace.span import TraceState

    state = TraceState.from_header([r.state]) if r.state else None
    flags = TraceFlags(r.flags & 0xFF)
    context = SpanContext(r.trace_id, r.span_id, False, flags, state)
    parent = (SpanContext(r.trace_id, r.parent_id, r.parent_remote, flags, state)
              if r.parent_id else None)
    code, description = r.status
    return ReadableSpan(
        name=r.name, context=context, parent=parent, resource=resource,
        attributes=BoundedAttributes(attributes=r.attributes, immutable=True, maxlen=None),
        events=[Event(name, BoundedAttributes(attributes=attrs, immutable=True, maxlen=None),
                      ts) for name, ts, attrs in r.events],
        kind=SpanKind[r.kind], status=Status(StatusCode(code), description or None),
        start_time=r.start_ns, end_time=r.end_ns,
        instrumentation_scope=InstrumentationScope("sluice"))


def _exporter(endpoint: str, protocol: str) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )
    return HttpExporter(endpoint=endpoint)


def main(argv: list[str]) -> int:
    """The export process: batches of spans on stdin until EOF; a flush is answered with
    a line on stdout once everything before it is exported."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    config = json.loads(argv[0])
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create(config["resource"])
    processor = BatchSpanProcessor(_exporter(config["endpoint"], config["protocol"]))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            kind, payload = pickle.load(stdin)
        except EOFError:
            break
        if kind == "spans":
            for record in payload:
                processor.on_end(to_readable(record, resource))
        elif kind == "flush":
            processor.force_flush()
            stdout.write(b"ok\n")
            stdout.flush()
    processor.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
