"""Where the engine core runs, and the one loop it runs there.

    front end (AsyncEngine)                   core (thread, or child process)
      send(Add | Abort | Finish | Shutdown) ──►  run_core():
                                                   commands = inbox.get(block=idle)
                                                   apply them to EngineCore
                                                   updates = core.step()
      recv() ◄── CoreOutputs(updates, stats) ◄──   emit one message per step
                                                   publish KV events (vLLM's ZMQ)

Two places for the same loop, behind `CoreClient`:

- `ThreadCore`: a thread of this process, objects passed through queues. For tests
  and embedding; the core's Python shares the GIL with the caller.
- `ProcessCore`: a child process (spawned, or forked from a caller that has no
  threads yet), msgpack over two ZMQ sockets on a private ipc:// path. The core's step loop and the HTTP
  front end (parsing, detokenizing, SSE) then run on different cores with no GIL
  between them: vLLM V1's `EngineCore` split. The child leaves when told, when its
  parent goes away, or when killed; the front end sees its death at once (the
  process sentinel is polled beside the socket) and fails every open stream.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from sluice.engine.config import EngineConfig
from sluice.engine.malloc import keep_freed_memory
from sluice.engine.messages import (
    Abort,
    Add,
    Command,
    CoreInfo,
    CoreOutputs,
    Event,
    Failed,
    Finish,
    Ready,
    Shutdown,
    decode,
    encode,
)
from sluice.engine.openmp import set_wait_policy
from sluice.protocol.errors import InvalidRequestError, SluiceError

if TYPE_CHECKING:
    from sluice.engine.core import EngineCore
    from sluice.engine.kv_events import KVEventPublisher
    from sluice.engine.model_runner import ModelRunner
    from sluice.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

IDLE_POLL_S = 1.0  # how often an idle core checks that its parent is still there
SHUTDOWN_GRACE_S = 5.0  # after Shutdown, how long the child may take before it is killed
START_METHODS = ("spawn", "fork")


class CoreDied(SluiceError):
    """The engine core stopped (crashed, killed, or failed to load)."""

    status_code = 503
    error_type = "service_unavailable"


# --------------------------------------------------------------------------- the loop


class Inbox(abc.ABC):
    @abc.abstractmethod
    def get(self, block: bool) -> list[Command]:
        """Every command queued now; if `block`, wait up to IDLE_POLL_S for the first."""


def open_publisher(endpoint: str | None) -> KVEventPublisher | None:
    """The KV event publisher bound to `endpoint` (None: no events); one that does not
    bind is an error naming kv_events_endpoint, raised before the core says Ready."""
    from sluice.engine.kv_events import KVEventPublisher

    if not endpoint:
        return None
    try:
        return KVEventPublisher(endpoint)
    except zmq.ZMQError as exc:
        raise InvalidRequestError(f"cannot publish KV events on {endpoint!r}: {exc}",
                                  param="kv_events_endpoint") from None


def run_core(core: EngineCore, inbox: Inbox, emit: Callable[[Event], None],
             publisher: KVEventPublisher | None = None, kv_events_interval: float = 0.02,
             parent_alive: Callable[[], bool] = lambda: True) -> None:
    """Serve `core` until Shutdown (or the parent is gone); see the module docstring."""
    published = time.monotonic()
    steps = core.step_log
    try:
        while parent_alive():
            commands = inbox.get(block=not core.has_work())
            if any(isinstance(c, Shutdown) for c in commands):
                return
            errors = _apply(core, commands)
            if core.tick() and not (commands or core.has_work()):
                emit(CoreOutputs([], core.stats(), []))  # e.g. a P/D lease released blocks
            if not (commands or core.has_work()):
                continue
            start = time.perf_counter()
            updates = _step(core, errors)
            if updates or errors or commands:  # (a core waiting on a grammar has nothing)
                emit(CoreOutputs(updates, core.stats(), errors))
            if steps is not None and core.last_chunks:
                steps.record([(c.start_pos, c.num_tokens) for c in core.last_chunks],
                             time.perf_counter() - start)
            if publisher is not None and (not core.has_work()
                                          or time.monotonic() - published >= kv_events_interval):
                publisher.publish(core.drain_kv_events())
                published = time.monotonic()
    finally:
        core.close()
        if publisher is not None:
            publisher.close()


def _apply(core: EngineCore, commands: list[Command]) -> list[tuple[str, SluiceError]]:
    errors: list[tuple[str, SluiceError]] = []
    for command in commands:
        if isinstance(command, Add):
            try:
                core.add(command.request)
            except SluiceError as exc:
                errors.append((command.request.request_id, exc))
        elif isinstance(command, Abort):
            core.abort(command.request_id)
        elif isinstance(command, Finish):
            core.finish(command.request_id, command.index)
    return errors


def _step(core: EngineCore, errors: list[tuple[str, SluiceError]]) -> list[Any]:
    if not core.has_work():
        return []
    try:
        updates = core.step()
        errors.extend(core.drain_failed())
        return updates
    except Exception as exc:  # a failed step must not kill the loop: fail its requests
        log.exception("engine step failed")
        for request_id in list(core.requests):
            core.abort(request_id)
            errors.append((request_id, SluiceError(f"engine step failed: {exc}")))
        return []


# --------------------------------------------------------------------------- clients


class CoreClient(abc.ABC):
    """The front end's handle on one running core.

    Contract: `info` and `tokenizer` are set once the model is loaded: when the
    constructor returns (`ThreadCore`) or `wait_ready()` does (`ProcessCore`). `send` may be called from any thread and never blocks on the core.
    `recv` is called from one thread only (the front end's output thread); it returns
    the next event, None after `timeout` seconds, and raises `CoreDied` once the core
    is gone. `close` stops the core and frees its resources; it is idempotent.
    """

    info: CoreInfo
    tokenizer: Tokenizer

    @abc.abstractmethod
    def send(self, command: Command) -> None: ...

    @abc.abstractmethod
    def recv(self, timeout: float) -> Event | None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class _QueueInbox(Inbox):
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Command] = queue.SimpleQueue()

    def get(self, block: bool) -> list[Command]:
        commands: list[Command] = []
        try:
            if block:
                commands.append(self.queue.get(timeout=IDLE_POLL_S))
            while True:
                commands.append(self.queue.get_nowait())
        except queue.Empty:
            return commands


class ThreadCore(CoreClient):
    """The core on a daemon thread of this process (loads the model in the caller)."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None,
                 kv_events_endpoint: str | None = None) -> None:
        from sluice.engine.core import EngineCore

        self.core = EngineCore(config, runner)
        self.info, self.tokenizer = self.core.info, self.core.tokenizer
        self._inbox = _QueueInbox()
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(
            open_publisher(kv_events_endpoint),), name="sluice-engine", daemon=True)
        self._thread.start()

    def _run(self, publisher: KVEventPublisher | None) -> None:
        try:
            run_core(self.core, self._inbox, self._events.put, publisher)
        except BaseException as exc:  # noqa: BLE001 - reported to the front end as a death
            log.exception("engine core thread failed")
            self._events.put(Failed(f"engine core thread failed: {exc}"))

    def send(self, command: Command) -> None:
        self._inbox.queue.put(command)

    def recv(self, timeout: float) -> Event | None:
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            if not self._thread.is_alive():
                raise CoreDied("the engine core thread stopped") from None
            return None
        if isinstance(event, Failed):
            raise CoreDied(event.message, param=event.param)
        return event

    def close(self) -> None:
        self.send(Shutdown())
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=SHUTDOWN_GRACE_S)


class ProcessCore(CoreClient):
    """The core in a child process, in two steps:

        core = ProcessCore(config, start_method="fork")  # the child starts loading now
        core.wait_ready()   # the tokenizer loads here meanwhile; then blocks until ready

    so the child can be started before the caller has threads (a fork is safe only
    then) and load while the caller starts its server. `start_method`: "spawn" (a fresh
    interpreter) or "fork" (a copy of this process: no interpreter start, and no imports
    where the caller already holds them, as a worker forked from a pre-imported template
    does); "fork" falls back to "spawn", with a warning, once this process has threads.
    """

    def __init__(self, config: EngineConfig, kv_events_endpoint: str | None = None,
                 start_method: str = "spawn") -> None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}")
        if start_method == "fork" and not single_threaded():
            log.warning("this process has threads: spawning the engine core, not forking it")
            start_method = "spawn"
        self.config = config
        base = os.path.join(tempfile.gettempdir(), f"sluice-core-{uuid.uuid4().hex[:12]}")
        self._paths = (base + "-in", base + "-out")
        # the child first: a fork must not copy the ZMQ context's I/O threads
        context: Any = multiprocessing.get_context(start_method)
        self.process = context.Process(
            target=_core_main, name="sluice-engine-core", daemon=True,
            args=(config, f"ipc://{self._paths[0]}", f"ipc://{self._paths[1]}",
                  kv_events_endpoint, os.getpid()))
        self.process.start()
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PUSH)  # commands to the core
        self._in = self._ctx.socket(zmq.PULL)  # events from the core
        self._out.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a busy core
        try:
            for sock, path in zip((self._out, self._in), self._paths, strict=True):
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(f"ipc://{path}")
        except BaseException:
            self.process.kill()
            raise
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe
        self._closed = False
        self._poller = zmq.Poller()
        self._poller.register(self._in, zmq.POLLIN)
        self._poller.register(self.process.sentinel, zmq.POLLIN)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Load the tokenizer (a bad --model raises its own error here), then block until
        the core's model is loaded and warmed up. Raises `CoreDied` with the child's own
        message if it fails or exits first, and closes the child on any failure."""
        from sluice.engine.tokenizer import load_tokenizer

        try:
            self.tokenizer = load_tokenizer(self.config.model.tokenizer or self.config.model.model,
                                            self.config.model.revision)
            self.info = self._wait_ready(timeout)
        except BaseException:
            self.process.kill()  # no use waiting for a core nobody will talk to
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _wait_ready(self, timeout: float | None) -> CoreInfo:
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            event = self.recv(IDLE_POLL_S)
            if isinstance(event, Ready):
                return event.info
        raise CoreDied(f"the engine core was not ready within {timeout} s")

    def send(self, command: Command) -> None:
        """Queue `command` for the core; dropped if the core is gone (no peer to take it)."""
        data = encode(command)
        with self._send_lock:
            if not self._closed:
                with contextlib.suppress(zmq.Again):
                    self._out.send(data, zmq.NOBLOCK, copy=False)

    def recv(self, timeout: float) -> Event | None:
        ready = dict(self._poller.poll(int(timeout * 1000)))
        if self._in in ready:
            event = decode(self._in.recv(copy=False).bytes)
            if isinstance(event, Failed):
                raise CoreDied(event.message, param=event.param)
            return event  # type: ignore[return-value]
        if ready:  # the sentinel: the child has exited
            self.process.join(timeout=1)
            raise CoreDied(f"the engine core process exited (exit code {self.process.exitcode})")
        return None

    def close(self) -> None:
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(zmq.Again):
                self._out.send(encode(Shutdown()), zmq.NOBLOCK)
        self.process.join(timeout=SHUTDOWN_GRACE_S)
        if self.process.is_alive():
            log.warning("engine core did not stop in %.0f s; killing it", SHUTDOWN_GRACE_S)
            self.process.kill()
            self.process.join(timeout=SHUTDOWN_GRACE_S)
        self._out.close(0)
        self._in.close(0)
        self._ctx.term()
        for path in self._paths:
            if os.path.exists(path):
                os.unlink(path)


# --------------------------------------------------------------------------- the child


def single_threaded() -> bool:
    """Whether this process runs one OS thread (Linux's /proc/self/task; False where
    unknown): the only state in which a fork copies no other thread's locks."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


class _SocketInbox(Inbox):
    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock

    def get(self, block: bool) -> list[Command]:
        commands: list[Command] = []
        if block and not self.sock.poll(int(IDLE_POLL_S * 1000)):
            return commands
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return commands
            commands.append(decode(data.bytes))  # type: ignore[arg-type]


def _core_main(config: EngineConfig, commands_addr: str, events_addr: str,
               kv_events_endpoint: str | None, parent_pid: int) -> None:
    """The child process: load the model, say Ready (or Failed), run the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    set_wait_policy()  # before torch loads OpenMP (a zygote sets it before its imports)
    keep_freed_memory()  # glibc reuses a step's freed activations (sluice.engine.malloc)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    events, commands = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    events.setsockopt(zmq.LINGER, 2000)
    events.connect(events_addr)
    commands.connect(commands_addr)

    def emit(event: Event) -> None:
        events.send(encode(event), copy=False)

    try:
        from sluice.engine.core import EngineCore

        core = EngineCore(config)
        publisher = open_publisher(kv_events_endpoint)
    except Exception as exc:  # a setting's error keeps its name across the process boundary
        emit(Failed(str(exc), exc.param) if isinstance(exc, SluiceError)
             else Failed(f"{type(exc).__name__}: {exc}"))
        events.close()
        ctx.term()
        raise SystemExit(1) from None
    emit(Ready(core.info))
    run_core(core, _SocketInbox(commands), emit, publisher,
             parent_alive=lambda: os.getppid() == parent_pid)
    events.close()
    commands.close(0)
    ctx.term()
