"""Blue/green model swap of one pool: workers of the new model first, then traffic moves.

    POST /admin/pools/{pool}/model  {"model": PATH, <sluice worker flags>...}   202
      start   as many workers of the new model as the pool counts now (at least one),
              all at once, through the pool's backend, each until /health 200; the
              pool's own starts still in flight (old model) are cancelled
      join    each joins the router held back (draining) and is probed as any new
              worker (`Controller.join`): healthy, listing the pool's model or what its
              other workers list
      move    in one event-loop turn the new workers become routable and the old ones
              draining: the router picks only new workers from then on
      drain   the old workers' in-flight streams finish (up to the drain timeout), they
              leave the router and the backend stops them
    a failure in start or join: the new workers are stopped (they never got a request),
    the old ones were never touched; the swap ends `failed` with the reason. A model the
backend can tell is missing (a local path not on this machine: `Backend.check_model`)
is a 400 before any of this.

The controller holds its reconcile step while a swap runs (the planner goes on deciding;
the count it wants is applied once the swap ends) and starts every later worker on the
new model. Kubernetes does the same with a Deployment rollout at maxSurge 100 %,
maxUnavailable 0. One swap per pool at a time (409 otherwise).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from sluice.control.backend import ModelSpec, WorkerHandle
from sluice.protocol.edge import load_json_object
from sluice.protocol.errors import InvalidRequestError
from sluice.router.endpoints import Endpoint

if TYPE_CHECKING:
    from sluice.control.controller import Controller

log = logging.getLogger(__name__)

RUNNING = ("starting", "joining", "draining")  # then done or failed


def _body_model() -> type[BaseModel]:
    """The request body: `model` plus the `sluice worker` flags a model version may set
    (engine options, chat template, tool-call and reasoning parsers), by their flag dest
    names."""
    from sluice.worker.cli import ENGINE_FLAGS, ENGINE_SWITCHES

    fields: dict[str, Any] = {"model": (str, ...)}
    fields |= {dest: (kind | None, None) for dest, (kind, _) in ENGINE_FLAGS.items()}
    fields |= {dest: (bool | None, None) for dest in ENGINE_SWITCHES}
    fields |= {"chat_template": (str | None, None), "tool_call_parser": (str | None, None),
               "reasoning_parser": (str | None, None)}
    return create_model("ModelSwapBody", __config__=ConfigDict(extra="forbid"), **fields)


def parse_model_spec(raw: bytes) -> ModelSpec:
    """The body of POST /admin/pools/{pool}/model as a `ModelSpec` (400 naming the field)."""
    data = load_json_object(raw or b"{}")
    if "served_model_name" in data:
        raise InvalidRequestError("the served model name is the pool's and does not change "
                                  "in a swap", param="served_model_name")
    try:
        body = _body_model().model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(x) for x in error["loc"]) or None
        raise InvalidRequestError(f"invalid model swap: {param}: {error['msg']}",
                                  param=param) from exc
    options = body.model_dump(exclude_none=True)
    options["model"] = options["model"].strip()
    _check_values(options)
    return ModelSpec(options.pop("model"), options)


def _check_values(options: dict[str, Any]) -> None:
    """Choices as `sluice worker` has them; no empty model, no NUL in a command line."""
    from sluice.worker.cli import CHOICES
    from sluice.worker.reasoning import REASONING_PARSERS
    from sluice.worker.tool_parsers import TOOL_PARSERS

    choices = {**CHOICES, "tool_call_parser": sorted(TOOL_PARSERS),
               "reasoning_parser": sorted(REASONING_PARSERS)}
    for dest, value in options.items():
        if dest in choices and value not in choices[dest]:
            raise InvalidRequestError(f"{dest} must be one of {choices[dest]}, got {value!r}",
                                      param=dest)
        if isinstance(value, str) and (not value or "\0" in value):
            raise InvalidRequestError(f"{dest} must be a non-empty string without NUL",
                                      param=dest)


def describe_spec(spec: ModelSpec | None) -> dict[str, Any] | None:
    return None if spec is None else {"model": spec.model, "options": dict(spec.options)}


class Swap:
    """One swap of a pool to `model` (revision `revision`): its state and its steps."""

    def __init__(self, ctl: Controller, model: ModelSpec, revision: int, workers: int) -> None:
        self.ctl, self.model, self.revision, self.workers = ctl, model, revision, workers
        self.previous = ctl.revision
        self.state = "starting"
        self.error: str | None = None
        self.started_at = ctl.clock()
        self.finished_at: float | None = None
        self.handles: list[WorkerHandle] = []  # the new workers, once started
        self.new: list[str] = []
        self.old: list[str] = []

    @property
    def running(self) -> bool:
        return self.state in RUNNING

    async def run(self) -> None:
        """The steps; a swap that breaks before traffic moved rolls back, and none is
        left running (it would hold the pool's reconcile for good)."""
        self.ctl.event("swap_start", revision=self.revision, model=self.model.model,
                       workers=self.workers)
        try:
            await self._steps()
        except asyncio.CancelledError:
            self._finish("failed", "cancelled: the router is stopping")
            raise
        except Exception as exc:
            log.exception("pool %s: swap to revision %d broke", self.ctl.name, self.revision)
            reason = f"{type(exc).__name__}: {exc}"
            if self.state == "draining":  # traffic has moved: the new workers stay
                self._finish("failed", reason)
            else:
                await self._fail(self.handles, reason)

    async def _steps(self) -> None:
        """start -> join -> move -> drain (module docstring)."""
        ctl = self.ctl
        await ctl.cancel_starts()
        if not await self._start():
            return
        self.state = "joining"
        joined = [await ctl.join(h, self.revision, self.started_at) for h in self.handles]
        self.new = [h.url for h in self.handles]
        refused = [url for url, e in zip(self.new, joined, strict=True) if e is None]
        if refused:  # `join` stopped those; the others are stopped here
            await self._fail([h for h, e in zip(self.handles, joined, strict=True) if e],
                             f"not healthy or not serving {ctl.pool.config.model!r}: "
                             f"{refused}")
            return
        self._move([e for e in joined if e is not None])
        await asyncio.gather(*(ctl.draining[url] for url in self.old if url in ctl.draining),
                             return_exceptions=True)
        self._finish("done")

    async def _start(self) -> bool:
        """Start the new workers at once (`handles`); on any failure stop the others."""
        results = await asyncio.gather(
            *(self.ctl.boot(self.model, self.revision) for _ in range(self.workers)),
            return_exceptions=True)
        self.handles = [r for r in results if isinstance(r, WorkerHandle)]
        errors = [r for r in results if not isinstance(r, WorkerHandle)]
        if errors:
            await self._fail(self.handles, f"a worker of the new model failed to start: "
                                           f"{str(errors[0])[:500]}")
        return not errors

    def _move(self, joined: list[Endpoint]) -> None:
        """Traffic moves, in one event-loop turn: new workers routable, old ones draining."""
        ctl = self.ctl
        old = [e for e in ctl.drain_order() if e.url not in self.new]
        for endpoint in joined:
            endpoint.draining = False
        ctl.model, ctl.revision = self.model, self.revision
        ctl.planner.forget_itl()  # the new model's decode step: its own ITL floor
        self.old = [e.url for e in old]
        self.state = "draining"
        ctl.event("swap_moved", revision=self.revision, new=self.new, old=self.old)
        for endpoint in old:
            ctl.drain(endpoint)

    async def _fail(self, handles: list[WorkerHandle], reason: str) -> None:
        """Roll back: stop the new workers (never routed to); the old ones stay."""
        await asyncio.gather(*(self.ctl.discard(h) for h in handles))
        self._finish("failed", reason)

    def _finish(self, state: str, error: str | None = None) -> None:
        self.state, self.error, self.finished_at = state, error, self.ctl.clock()
        seconds = round(self.finished_at - self.started_at, 3)
        if error is None:
            self.ctl.event("swap_done", revision=self.revision, seconds=seconds)
        else:
            self.ctl.event("swap_failed", revision=self.revision, seconds=seconds, error=error)

    def describe(self) -> dict[str, Any]:
        end = self.finished_at if self.finished_at is not None else self.ctl.clock()
        return {"revision": self.revision, "previous_revision": self.previous,
                "model": describe_spec(self.model), "state": self.state, "error": self.error,
                "workers": self.workers, "new": self.new, "old": self.old,
                "started_at": self.started_at, "finished_at": self.finished_at,
                "seconds": round(end - self.started_at, 3)}
