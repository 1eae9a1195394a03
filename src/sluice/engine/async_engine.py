"""The engine loop on its own thread, for servers: asyncio in front, `step()` behind.

    event loop (worker)                          engine thread
    generate() ── validate (raises here) ──┐
               ── command queue + notify ──┼──► apply adds/aborts, step(), outputs
    await queue.get() ◄── call_soon_threadsafe ◄┘      idle: wait on the condition

The model's forward pass runs outside the event loop, so HTTP stays responsive while
the engine computes. All engine state is touched only by the engine thread; other
threads talk to it through the command list, guarded by one condition variable.
A consumer that stops iterating (client disconnect, `aclose()`, cancellation) aborts
its request, which frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.engine.config import EngineConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.outputs import RequestOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Request
from sluice.engine.stats import EngineStats
from sluice.protocol.errors import InvalidRequestError, ServiceUnavailableError, SluiceError
from sluice.protocol.kv_events import KVEvent

if TYPE_CHECKING:
    from sluice.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

_Item = RequestOutput | BaseException


@dataclass(frozen=True, slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Item]

    def put(self, item: _Item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


class AsyncEngine:
    """Thread-safe front of one `LLMEngine`; see the module docstring for the threads."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.engine = LLMEngine(config, runner)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self._cond = threading.Condition()
        self._adds: list[Request] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()

    # -- asyncio side ---------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; admission errors raise before the first yield."""
        request = self.engine.prepare_request(request_id, prompt, params, priority)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            if self._stopped:
                raise ServiceUnavailableError("engine is shut down")
            if request_id in self._streams:
                raise InvalidRequestError(f"duplicate request id {request_id!r}",
                                          param="request_id")
            self._streams[request_id] = stream
            self._adds.append(request)
            self._cond.notify()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._cond:
                self._streams.pop(request_id, None)
                if not finished:
                    self._aborts.append(request_id)
                    self._cond.notify()

    async def abort(self, request_id: str) -> None:
        """Abort the request; its stream ends with a finish_reason "abort" output."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def stats(self) -> EngineStats:
        """The snapshot taken after the engine thread's latest iteration."""
        return self._stats

    def drain_kv_events(self) -> list[KVEvent]:
        return self.engine.drain_kv_events()

    def shutdown(self) -> None:
        """Stop the engine thread; pending streams get ServiceUnavailableError."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        with self._cond:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.put(ServiceUnavailableError("engine is shut down"))

    # -- engine thread --------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopped or self._adds or self._aborts
                           or self.engine.has_unfinished_requests()):
                    self._cond.wait()
                if self._stopped:
                    return
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            self._apply(adds, aborts)
            if self.engine.has_unfinished_requests():
                self._step()
            else:
                self._stats = self.engine.stats()

    def _apply(self, adds: list[Request], aborts: list[str]) -> None:
        for request in adds:
            try:
                self.engine.submit(request)
            except SluiceError as exc:
                self._send(request.request_id, exc)
        for request_id in aborts:
            output = self.engine.abort_with_output(request_id)
            if output is not None:
                self._send(request_id, output)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a failed step must not kill the loop: fail its requests
            log.exception("engine step failed")
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)
                self._send(request_id, SluiceError(f"engine step failed: {exc}"))
            return
        self._stats = self.engine.stats()  # before the outputs: a reader sees them counted
        for output in outputs:
            self._send(output.request_id, output)

    def _send(self, request_id: str, item: _Item) -> None:
        with self._cond:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)
