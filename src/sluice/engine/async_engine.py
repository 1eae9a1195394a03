"""The engine for servers: asyncio streams in front, an engine core behind.

    event loop(s)                    output thread                  core (CoreClient)
    generate() ── prepare (raises) ── Add ─────────────────────────► thread | process
               ◄─ queue ◄─ call_soon_threadsafe ◄─ OutputProcessor ◄─ CoreOutputs per step
    aclose / abort ──────────────────────────────── Abort ─────────►
                                     stop string ─── Finish ────────►

Requests are tokenized and checked in the caller (`InputProcessor`), so admission
errors raise before the first yield. One output thread receives the core's per-step
messages, detokenizes (`OutputProcessor`) and hands each stream its outputs on the
stream's own event loop (several loops may share one engine, as tests do). A consumer
that stops iterating (client disconnect, `aclose()`, cancellation) aborts its request
in the core, which frees its KV blocks before the next step. If the core dies, every
open stream gets `CoreDied` (503) and `dead` is set; `on_death` callbacks run on the
output thread.

`AsyncEngine(config)` runs the core on a thread of this process (tests, embedding);
`AsyncEngine.spawn(config)` runs it in its own process (the worker's default).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.engine.config import EngineConfig
from sluice.engine.core_client import (
    SHUTDOWN_GRACE_S,
    CoreClient,
    CoreDied,
    ProcessCore,
    ThreadCore,
)
from sluice.engine.input_processor import InputProcessor
from sluice.engine.lora import LoRARequest
from sluice.engine.messages import Abort, Add, CoreOutputs, Finish, SeqUpdate, Shutdown
from sluice.engine.output_processor import OutputProcessor
from sluice.engine.outputs import EmbeddingRequestOutput, RequestOutput
from sluice.engine.pooling_params import PoolingParams
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.stats import EngineStats
from sluice.protocol.errors import InvalidRequestError, ServiceUnavailableError

if TYPE_CHECKING:
    from sluice.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

_Item = RequestOutput | SeqUpdate | BaseException  # (a SeqUpdate: an embedding's)


@dataclass(frozen=True, slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Item]


class AsyncEngine:
    """Thread-safe async front of one engine core; see the module docstring."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None, *,
                 kv_events_endpoint: str | None = None, client: CoreClient | None = None
                 ) -> None:
        self.client = client or ThreadCore(config, runner, kv_events_endpoint)
        self.tokenizer = self.client.tokenizer
        self.info = info = self.client.info
        self.model_name, self.max_model_len = info.model_name, info.max_model_len
        self.inputs = InputProcessor(info, self.tokenizer)
        self._outputs = OutputProcessor(self.tokenizer)
        self._lock = threading.Lock()  # guards _outputs, _streams, _stopped, dead
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self.dead: CoreDied | None = None
        self.on_death: list[Callable[[CoreDied], None]] = []
        self._stats = EngineStats(0, 0, 0.0, info.num_kv_blocks, 0, 0, 0, 0, 0, 0,
                                  max_lora=info.max_loras)
        self._thread = threading.Thread(target=self._receive, name="sluice-engine-output",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def spawn(cls, config: EngineConfig, *, kv_events_endpoint: str | None = None,
              core: ProcessCore | None = None) -> AsyncEngine:
        """The engine core in its own process (blocks until the model is loaded); `core`:
        one already started (`ProcessCore(config, ...)`), else spawned now."""
        client = core or ProcessCore(config, kv_events_endpoint)
        client.wait_ready()
        return cls(config, client=client)

    # -- asyncio side ---------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0, resumed: Sequence[int] = (),
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; admission errors raise before the first yield.

        `resumed`: tokens this request already generated on another worker (a migrated
        stream): the engine continues after them and the outputs hold only new ones."""
        request = self.inputs.prepare(request_id, prompt, params, priority, resumed=resumed,
                                      lora=lora_request)
        with self._lock:
            stream = self._open(request_id)
            self._outputs.add(request_id, prompt if isinstance(prompt, str) else None,
                              request.prompt_token_ids, params, request.arrival_time,
                              request.num_output_tokens)
        self.client.send(Add(request))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                assert isinstance(item, RequestOutput)  # (a SeqUpdate is an embedding's)
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._forget(request_id)

    async def embed(self, prompt: str | list[int], request_id: str, priority: int = 0,
                    param: str = "input", pooling: PoolingParams | None = None
                    ) -> EmbeddingRequestOutput:
        """One prompt's embedding (`EngineCore._embed`), as `pooling` asks; admission
        errors name `param`. Cancelling the caller aborts it in the core."""
        request = self.inputs.prepare_pooling(request_id, prompt, priority, param, pooling)
        with self._lock:
            stream = self._open(request_id)
        self.client.send(Add(request))
        try:
            item = await stream.queue.get()
        except BaseException:
            self._forget(request_id)
            raise
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, SeqUpdate) and item.embedding is not None
        return EmbeddingRequestOutput(request_id, request.prompt_token_ids, item.embedding,
                                      item.num_cached_tokens)

    def _open(self, request_id: str) -> _Stream:
        """A new request's stream, on the caller's loop (the lock held); raises if the
        engine is dead or shut down, or the id is in use."""
        self._check_open()
        if request_id in self._streams:
            raise InvalidRequestError(f"duplicate request id {request_id!r}",
                                      param="request_id")
        stream = self._streams[request_id] = _Stream(asyncio.get_running_loop(),
                                                     asyncio.Queue())
        return stream

    def _check_open(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self._stopped:
            raise ServiceUnavailableError("engine is shut down")

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self._outputs.abort(request_id)
        self.client.send(Abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort the request; its stream ends with a finish_reason "abort" output."""
        with self._lock:
            output = self._outputs.abort(request_id)
            stream = self._streams.pop(request_id, None)
        self.client.send(Abort(request_id))
        if output is not None and stream is not None:
            _deliver_soon({stream.loop: [(stream.queue, output)]})

    def stats(self) -> EngineStats:
        """The snapshot the core sent after its latest step."""
        return self._stats

    def shutdown(self) -> None:
        """Stop the core (it finishes its current step); pending streams get
        ServiceUnavailableError. Returns within a few seconds: a core that does not stop
        is killed."""
        with self._lock:
            self._stopped = True
        self.client.send(Shutdown())
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=SHUTDOWN_GRACE_S)
        self.client.close()
        self._fail_all(ServiceUnavailableError("engine is shut down"))

    # -- output thread --------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            try:
                event = self.client.recv(timeout=0.5)
            except CoreDied as exc:
                if not self._stopped:
                    self._died(exc)
                return
            except Exception:  # the client is closed under us: shutting down
                if not self._stopped:
                    log.exception("engine output thread failed")
                return
            if isinstance(event, CoreOutputs):
                self._handle(event)
            elif event is None and self._stopped:
                return

    def _handle(self, event: CoreOutputs) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]]
        batches = defaultdict(list)
        with self._lock:
            self._stats = event.stats  # before the outputs: a reader sees them counted
            updates = event.updates
            items: list[tuple[str, _Item]] = []
            if any(u.embedding is not None for u in updates):
                items += [(u.request_id, u) for u in updates if u.embedding is not None]
                updates = [u for u in updates if u.embedding is None]
            outputs, stops = self._outputs.process(updates)
            items += [(o.request_id, o) for o in outputs]
            for request_id, error in event.errors:
                self._outputs.abort(request_id)
                items.append((request_id, error))
            for request_id, item in items:
                finished = not isinstance(item, RequestOutput) or item.finished  # (or an
                # embedding's SeqUpdate: its only item)
                stream = (self._streams.pop if finished else self._streams.get)(request_id, None)
                if stream is not None:
                    batches[stream.loop].append((stream.queue, item))
        for request_id, index in stops:
            self.client.send(Finish(request_id, index))
        _deliver_soon(batches)

    def _died(self, exc: CoreDied) -> None:
        log.error("engine core died: %s", exc)
        with self._lock:
            self.dead = exc
        self._fail_all(exc)
        for callback in self.on_death:
            callback(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]]
        batches = defaultdict(list)
        for stream in streams:
            batches[stream.loop].append((stream.queue, exc))
        _deliver_soon(batches)


def _deliver_soon(batches: dict[asyncio.AbstractEventLoop,
                                list[tuple[asyncio.Queue[_Item], _Item]]]) -> None:
    """One wake-up per event loop, however many of its streams got an item."""
    for loop, items in batches.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that loop is closed: nobody is listening
            pass


def _put_all(items: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    for q, item in items:
        q.put_nowait(item)
