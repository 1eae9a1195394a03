"""The cluster-backend contract: start, stop (with drain), list and check workers.

A backend owns worker *placement* only: where a worker runs and whether its process is
alive. It knows nothing of routing; the controller (`control/controller.py`) tells the
router to stop sending to a worker before it asks the backend to stop it, and adds a
new worker to the router once the backend reports it ready.

    backend = make_backend("local", worker_args=[...])
    worker = await backend.start()            # launched and answering /health 200
    worker = await backend.start(ModelSpec("/models/v2"))   # another model (a swap)
    backend.list()                            # [WorkerHandle(...), ...] it still owns
    backend.check_model(ModelSpec("/nope"))   # InvalidRequestError where it cannot be found
    await backend.health(worker)              # READY | STARTING | DEAD
    await backend.stop(worker, drain=True)    # SIGTERM: its streams finish (bounded)
    await backend.close()                     # stop every worker

Implementations are picked by name from `BACKENDS` (`local` here; `ray` when Ray is
installed); Kubernetes is not a runtime backend: `sluice deploy k8s` renders manifests
and KEDA acts on the planner's `sluice:desired_replicas` instead.
"""

from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from sluice.protocol.errors import InvalidRequestError


class WorkerHealth(enum.Enum):
    STARTING = "starting"  # alive, /health not 200 yet
    READY = "ready"        # /health answers 200
    DEAD = "dead"          # its process (actor, pod) is gone; the backend forgets it


@dataclass(frozen=True)
class ModelSpec:
    """What a worker loads: a model (HF directory, hub name or .gguf file) and `sluice
    worker` flags that go with this model (`options`: flag dest -> value, e.g.
    {"max_model_len": 2048, "enable_prefix_caching": False}). A pool's served model name
    is the pool's own and is not part of it."""

    model: str
    options: Mapping[str, str | int | float | bool] = field(default_factory=dict)

    def flags(self) -> list[str]:
        """As `sluice worker` arguments: `--model M`, `--dtype X`, `--no-enable-...`."""
        out = ["--model", self.model]
        for dest, value in self.options.items():
            name = dest.replace("_", "-")
            if isinstance(value, bool):
                out.append(f"--{name}" if value else f"--no-{name}")
            else:
                out += [f"--{name}", str(value)]
        return out


@dataclass(frozen=True)
class WorkerHandle:
    """One worker a backend started: its id, base URL, KV-events endpoint, where it runs."""

    id: str
    url: str
    kv_events: str | None = None
    node: str = "local"


class Backend(ABC):
    """Starts and stops workers of one model. Methods run on the caller's event loop;
    a backend is driven by one controller (no locking)."""

    name: ClassVar[str]

    @abstractmethod
    async def start(self, model: ModelSpec | None = None) -> WorkerHandle:
        """Launch one worker and wait until it is ready. On failure (it exited, or the
        startup timeout passed) nothing is left running and the error says why.

        `model`: load this instead of the backend's own model (a blue/green swap): its
        flags follow the backend's worker arguments, so they win (the last flag counts);
        the others (served name, ports, engine defaults) stay."""

    @abstractmethod
    async def stop(self, worker: WorkerHandle, drain: bool = True) -> None:
        """Stop `worker`: with `drain`, ask it to finish its in-flight streams first
        (bounded by the backend's stop timeout, then killed); without, kill it now.
        The worker is forgotten either way. Idempotent."""

    @abstractmethod
    def list(self) -> list[WorkerHandle]:
        """The workers this backend started and has not stopped or found dead."""

    @abstractmethod
    async def health(self, worker: WorkerHandle) -> WorkerHealth:
        """Where `worker` stands now. A DEAD worker is reaped and forgotten."""

    def check_model(self, model: ModelSpec) -> None:
        """Refuse a model its workers could not find, before any of them starts (a swap's
        400): raises `InvalidRequestError` naming `model`. Here nothing is checked: the
        workers read the model on their own machines."""
        return None

    async def close(self) -> None:
        """Stop every worker (drained)."""
        for worker in self.list():
            await self.stop(worker, drain=True)


BACKENDS: Mapping[str, str] = MappingProxyType({
    "local": "sluice.control.local:LocalBackend",
    "ray": "sluice.control.ray:RayBackend",
})


def make_backend(name: str, **options: Any) -> Backend:
    """A backend by name; its module is imported only when chosen (Ray is optional)."""
    target = BACKENDS.get(name)
    if target is None:
        raise InvalidRequestError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}",
                                  param="backend")
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise InvalidRequestError(f"backend {name!r} is not available here: {exc}",
                                  param="backend") from exc
    backend: Backend = cls(**options)
    return backend
