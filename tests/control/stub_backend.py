"""A cluster backend of in-process stub workers (uvicorn on free ports), for fast tests of
the controller: real HTTP, real router, the worker contract of `router_stubs`, and a
start delay to stand in for a model load.

`start(ModelSpec("v2"))` starts a stub named `v2-N` (its tokens read `v2-N-i`), so a test
sees which model answered; a model in `broken` fails to start after the delay, as a
worker whose model does not load."""

from __future__ import annotations

import asyncio
import itertools
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from router.router_stubs import StubState, make_stub, serve
from sluice.control.backend import Backend, ModelSpec, WorkerHandle, WorkerHealth


@dataclass
class StubWorker:
    handle: WorkerHandle
    state: StubState
    stack: AsyncExitStack
    dead: bool = False
    stopped_with_drain: bool | None = None


@dataclass
class StubBackend(Backend):
    name = "stub"
    start_delay_s: float = 0.0
    token_delay_s: float = 0.0
    num_tokens: int = 3
    model: str = "stub-model"
    broken: frozenset[str] = frozenset()  # models whose workers fail to start
    workers: dict[str, StubWorker] = field(default_factory=dict)
    gone: list[StubWorker] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    async def start(self, model: ModelSpec | None = None) -> WorkerHandle:
        await asyncio.sleep(self.start_delay_s)
        if model is not None and model.model in self.broken:
            raise RuntimeError(f"worker exited with 1: cannot load {model.model}")
        prefix = f"{model.model}-" if model is not None else "s"
        state = StubState(f"{prefix}{next(self._ids)}", model=self.model,
                          num_tokens=self.num_tokens, token_delay_s=self.token_delay_s)
        stack = AsyncExitStack()
        url = await stack.enter_async_context(serve(make_stub(state)))
        handle = WorkerHandle(state.name, url)
        self.workers[handle.id] = StubWorker(handle, state, stack)
        return handle

    async def stop(self, worker: WorkerHandle, drain: bool = True) -> None:
        stub = self.workers.pop(worker.id, None)
        if stub is not None:
            stub.stopped_with_drain = drain
            self.gone.append(stub)
            await stub.stack.aclose()

    def list(self) -> list[WorkerHandle]:
        return [w.handle for w in self.workers.values()]

    async def health(self, worker: WorkerHandle) -> WorkerHealth:
        stub = self.workers.get(worker.id)
        if stub is None or stub.dead:
            self.workers.pop(worker.id, None)
            return WorkerHealth.DEAD
        return WorkerHealth.READY if stub.state.healthy else WorkerHealth.STARTING

    async def kill(self, worker_id: str) -> None:
        """Stand-in for kill -9: the server goes away, `health` says DEAD."""
        stub = self.workers[worker_id]
        stub.dead = True
        await stub.stack.aclose()
