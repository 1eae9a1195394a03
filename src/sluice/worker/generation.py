"""One HTTP request's engine work: admission, context check, priming, metrics, abort.

A handler builds a `Run` from one or more prompts (completions accept a batch) and
uses it as an async context manager:

    async with Run.start(state, prompts, params, request_id, priority) as run:
        async for prompt_index, output in run.outputs():
            ...

`Run.start` admits the request (503 past `max_pending_requests`), gives a prompt
without max_tokens the model's default one (`default_max_tokens`), checks every
prompt against the context length, and pulls each engine stream's first output, so
admission errors from the engine surface before any HTTP status is sent. Leaving the
block (normally, by an error, or by cancellation when the client disconnects) closes
every engine stream, which aborts unfinished requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from sluice.engine.outputs import RequestOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.observe.tracing import OPERATIONS, REQUEST_PARENT, WorkerSpan
from sluice.protocol.errors import ContextLengthError, ServiceUnavailableError
from sluice.worker.metrics import RequestTimer

if TYPE_CHECKING:
    from sluice.engine.lora import LoRARequest
    from sluice.worker.state import WorkerState


class Admission:
    """Counts HTTP generation requests in flight and refuses those past the cap."""

    def __init__(self, limit: int, retry_after: float) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self.active = 0

    def acquire(self) -> None:
        if self.active >= self.limit:
            raise ServiceUnavailableError(
                f"server overloaded: {self.active} requests in flight "
                f"(max_pending_requests={self.limit}); retry later",
                retry_after=self.retry_after, code="overloaded")
        self.active += 1

    def release(self) -> None:
        self.active -= 1


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  param: str) -> None:
    """Raise ContextLengthError if the prompt plus max_tokens cannot fit (OpenAI's wording)."""
    wanted = prompt_len + (max_tokens or 0)
    if prompt_len >= max_model_len or wanted > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {wanted} tokens ({prompt_len} in the {param}, {max_tokens or 0} in the "
            f"completion). Please reduce the length of the {param} or completion.",
            param=param)


def default_max_tokens(params: SamplingParams, default: int | None, prompt_len: int,
                       max_model_len: int) -> SamplingParams:
    """`params` for one prompt: a request without max_tokens takes the model's `default`
    (generation_config.json's max_new_tokens) up to what the context leaves, as vLLM
    caps it; an explicit max_tokens, or no default, stays as it is."""
    room = max_model_len - prompt_len
    if params.max_tokens is not None or default is None or room < 1:  # room: the 400's
        return params
    return dataclasses.replace(params, max_tokens=min(default, room))


@dataclass
class Stream:
    """One engine request's output stream, primed with its first output."""

    source: AsyncIterator[RequestOutput]
    first: RequestOutput | None = None

    async def prime(self) -> None:
        try:
            self.first = await anext(self.source)
        except StopAsyncIteration:
            self.first = None

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        if self.first is not None:
            yield self.first
        async for out in self.source:
            yield out

    async def close(self) -> None:
        aclose = getattr(self.source, "aclose", None)
        if aclose is not None:
            await aclose()


@dataclass
class Run(AbstractAsyncContextManager["Run"]):
    """The engine streams of one HTTP request (one per prompt); see the module docstring."""

    state: WorkerState
    streams: list[Stream]
    timer: RequestTimer
    prompt_lens: list[int]
    reasons: list[str] = field(default_factory=list)
    admitted: bool = False
    trace: WorkerSpan | None = None  # when tracing is on
    generated: list[int] = field(default_factory=list)  # output tokens per prompt
    ended: set[int] = field(default_factory=set)  # prompts whose engine request finished

    @classmethod
    async def start(cls, state: WorkerState, prompts: Sequence[list[int]],
                    params: SamplingParams, request_id: str, priority: int = 0,
                    param: str = "prompt", resumed: Sequence[int] = (),
                    lora: LoRARequest | None = None) -> Run:
        """`resumed`: output ids a migrated request already generated (one prompt only):
        the engine continues after them. `lora`: the adapter to run with. Each prompt is
        cut to `params.truncate_prompt_tokens` first (vLLM's left truncation)."""
        engine = state.require_engine()
        prompts = [engine.inputs.truncate(ids, params.truncate_prompt_tokens) for ids in prompts]
        default = state.config.generation_defaults.get("max_tokens")
        each = [default_max_tokens(params, default, len(ids), engine.max_model_len)
                for ids in prompts]
        for ids, p in zip(prompts, each, strict=True):
            check_context(len(ids), p.max_tokens, engine.max_model_len, param)
        state.admission.acquire()
        run = cls(state, [], state.metrics.timer(), [len(p) for p in prompts], admitted=True,
                  generated=[0] * len(prompts))
        if state.tracing is not None:
            run.trace = WorkerSpan(state.tracing, REQUEST_PARENT.get(),
                                   OPERATIONS.get(param, param), state.model_name, request_id,
                                   each[0], len(prompts))
        state.metrics.pending.labels(state.model_name).inc()
        try:
            for i, (ids, p) in enumerate(zip(prompts, each, strict=True)):
                engine_id = f"{request_id}-{i}-{uuid.uuid4().hex[:8]}"
                run.streams.append(Stream(engine.generate(ids, p, engine_id, priority,
                                                          resumed, lora_request=lora)))
                run.timer.params(p.n, p.max_tokens)
            for stream in run.streams:
                await stream.prime()
        except BaseException:
            await run.close()
            raise
        return run

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every engine stream (aborting unfinished ones); shielded from cancellation."""
        with anyio.CancelScope(shield=True):
            for stream in self.streams:
                await stream.close()
            if self.admitted:
                self.admitted = False
                self.state.admission.release()
                self.state.metrics.pending.labels(self.state.model_name).dec()
                if self.reasons:
                    self.timer.finished(self.reasons)
            if self.trace is not None:
                for i, prompt_len in enumerate(self.prompt_lens):
                    if i not in self.ended:  # aborted: the client went away, or a failure
                        self.trace.aborted(prompt_len, self.generated[i])
                self.trace.end()
                self.trace = None

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs from every stream, as they come; records metrics."""
        async for index, out in _merge([s.outputs() for s in self.streams]):
            count = sum(len(c.token_ids) for c in out.outputs)
            self.timer.tokens(count)
            self.generated[index] += count
            self.reasons += [c.finish_reason for c in out.outputs if c.finish_reason]
            if out.finished:
                self._finished(index, out)
            yield index, out

    def _finished(self, index: int, out: RequestOutput) -> None:
        """One prompt's engine request ended: its engine-phase histograms and spans."""
        self.ended.add(index)
        self.timer.engine_times(out.metrics, self.generated[index])
        self.timer.request_tokens(self.prompt_lens[index], self.generated[index])
        if self.trace is not None:
            self.trace.finished(out, self.generated[index])


async def _merge(sources: list[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several async iterators; the common single-source case adds no task."""
    if len(sources) == 1:
        async for out in sources[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, source: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in source:
                await queue.put((i, out))
            await queue.put((i, done))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
