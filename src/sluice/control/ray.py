"""The `ray` backend: one Ray actor per worker, placed by Ray on a cluster's nodes.

    RayBackend(worker_args, address=None | "ray://..." | "127.0.0.1:6379", num_cpus=1)
      start()  -> WorkerActor.options(num_cpus, num_gpus).remote(args)
                    (args: worker_args, then a ModelSpec's flags when one is given)
                    the actor, on whichever node Ray picked, launches `sluice worker`
                    as its child (the local backend's launcher: it dies with the actor)
                    and reports its URL and node id; then /health 200 over HTTP
      health() -> the actor answers and its worker process is alive, else DEAD
                  (a removed node, a killed actor or worker); then /health
      stop()   -> the actor SIGTERMs its worker (drain) and is killed

The router reaches workers over HTTP at the node's address, as with any backend, so
the cluster's nodes must be reachable from the router (loopback for a local cluster).
Resources are declared per actor (`num_cpus`, `num_gpus`: 1 when the node has a GPU
unless set), so Ray's scheduler spreads workers over the nodes that have room. A start
that no node could hold even idle (more CPUs or GPUs than any node has) fails at once,
naming the resource (Ray would keep the actor pending: the start waited out its whole
timeout); one that only waits for busy nodes waits, up to `startup_timeout_s`.
With no `address`, a local Ray instance is started (and shut down by `close`).
Ray Serve's own replicas are actors the same way; sluice keeps its router and
planner and uses Ray only for placement.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import ray

from sluice.control.backend import Backend, ModelSpec, WorkerHandle, WorkerHealth
from sluice.control.local import health_ok, launch_worker, stop_process
from sluice.protocol.errors import InvalidRequestError

CONNECT_TIMEOUT_S = 5.0


def join(address: str | None) -> None:
    """`ray.init(address)`: a local instance for None, else the cluster there. An
    address where nothing answers is refused at once (Ray itself retries for minutes:
    `sluice serve --ray-address 127.0.0.1:1` hung), as is `auto` with no cluster
    running; the errors name `address`."""
    if address not in (None, "auto"):
        host, _, port = address.removeprefix("ray://").rpartition(":")
        if not host or not port.isdigit():
            raise InvalidRequestError(f"address must be HOST:PORT or ray://HOST:PORT, got "
                                      f"{address!r}", param="address")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise InvalidRequestError(f"address {address!r}: no Ray cluster answers there "
                                      f"({exc.strerror or exc})", param="address") from exc
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise InvalidRequestError(f"address {address!r}: cannot join a Ray cluster: "
                                  f"{str(exc).split('. ')[0]}", param="address") from exc


def unplaceable(need: Mapping[str, float], nodes: Sequence[Mapping[str, Any]]) -> str | None:
    """Why an actor asking `need` (resource -> amount) can never be placed on these
    nodes (`ray.nodes()`): no alive node has that much of each in all, however idle. None
    when one has (busy now or not: Ray then places it once room frees up)."""
    totals = [node["Resources"] for node in nodes if node.get("Alive")]
    asked = {name: amount for name, amount in need.items() if amount > 0}
    if any(all(t.get(name, 0.0) >= amount for name, amount in asked.items()) for t in totals):
        return None
    for name, amount in asked.items():
        most = max((t.get(name, 0.0) for t in totals), default=0.0)
        if most < amount:
            return (f"a worker asks {amount:g} {name}: no node of the Ray cluster has "
                    f"that many (its {len(totals)} nodes have at most {most:g} each)")
    return (f"a worker asks {' and '.join(f'{a:g} {n}' for n, a in asked.items())}: no "
            f"node of the Ray cluster has them together (its {len(totals)} nodes)")


@ray.remote
class WorkerActor:
    """Runs one `sluice worker` process on its node; owns it (it dies with the actor)."""

    def __init__(self, index: int, worker_args: Sequence[str], host: str) -> None:
        log_dir = Path(tempfile.mkdtemp(prefix="sluice-ray-worker-"))
        self.worker = launch_worker(index, worker_args, host, False, log_dir, dict(os.environ))
        self.node = ray.get_runtime_context().get_node_id()

    def describe(self) -> tuple[str, str]:
        return self.worker.url, self.node

    def alive(self) -> bool:
        return self.worker.process.poll() is None

    def log_tail(self) -> str:
        return self.worker.log_tail()

    def stop(self, drain: bool, timeout_s: float) -> None:
        stop_process(self.worker.process, drain, timeout_s)


class RayBackend(Backend):
    name = "ray"

    def __init__(self, worker_args: Sequence[str] = (), *, address: str | None = None,
                 num_cpus: float = 1.0, num_gpus: float | None = None,
                 host: str = "127.0.0.1", startup_timeout_s: float = 300.0,
                 stop_timeout_s: float = 30.0, poll_s: float = 0.2) -> None:
        self.worker_args = list(worker_args)
        self.owns_ray = address is None and not ray.is_initialized()
        if not ray.is_initialized():
            join(address)
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus if num_gpus is not None else (
            1.0 if ray.cluster_resources().get("GPU", 0) else 0.0)
        if not self.num_gpus and "--cpu-threads" not in self.worker_args:
            # the actor's CPUs, not every core of its node (docs/worker.md, CPU threads)
            self.worker_args += ["--cpu-threads", str(max(1, int(num_cpus)))]
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        self.actors: dict[str, tuple[WorkerHandle, Any]] = {}
        self._index = 0

    def list(self) -> list[WorkerHandle]:
        return [handle for handle, _ in self.actors.values()]

    async def start(self, model: ModelSpec | None = None) -> WorkerHandle:
        need = {"CPU": self.num_cpus, "GPU": self.num_gpus}
        error = unplaceable(need, await asyncio.to_thread(ray.nodes))
        if error is not None:
            raise RuntimeError(error)
        self._index += 1
        args = self.worker_args + (model.flags() if model is not None else [])
        actor = WorkerActor.options(num_cpus=self.num_cpus,  # type: ignore[attr-defined]
                                    num_gpus=self.num_gpus).remote(self._index, args, self.host)
        try:
            url, node = await asyncio.wait_for(actor.describe.remote(), self.startup_timeout_s)
            handle = WorkerHandle(f"ray-{self._index}", url, None, node)
            self.actors[handle.id] = (handle, actor)
            await self._wait_ready(handle, actor)
        except BaseException:
            self.actors.pop(f"ray-{self._index}", None)
            ray.kill(actor)
            raise
        return handle

    async def _wait_ready(self, handle: WorkerHandle, actor: Any) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while not await health_ok(client, handle.url):
                if not await actor.alive.remote():
                    raise RuntimeError(f"worker {handle.url} on node {handle.node} exited:\n"
                                       f"{await actor.log_tail.remote()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {handle.url} not healthy after "
                                       f"{self.startup_timeout_s}s")
                await asyncio.sleep(self.poll_s)

    async def stop(self, worker: WorkerHandle, drain: bool = True) -> None:
        entry = self.actors.pop(worker.id, None)
        if entry is None:
            return
        _, actor = entry
        try:
            await asyncio.wait_for(actor.stop.remote(drain, self.stop_timeout_s),
                                   self.stop_timeout_s + 10)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # the actor (or its node) is already gone; killing it below is all
        ray.kill(actor)

    async def health(self, worker: WorkerHandle) -> WorkerHealth:
        entry = self.actors.get(worker.id)
        alive = False
        if entry is not None:
            try:
                alive = await asyncio.wait_for(entry[1].alive.remote(), 10)
            except (ray.exceptions.RayError, TimeoutError):
                alive = False
        if not alive:
            self.actors.pop(worker.id, None)
            if entry is not None:
                ray.kill(entry[1])
            return WorkerHealth.DEAD
        async with httpx.AsyncClient(timeout=2.0) as client:
            ok = await health_ok(client, worker.url)
        return WorkerHealth.READY if ok else WorkerHealth.STARTING

    async def close(self) -> None:
        await super().close()
        if self.owns_ray:
            ray.shutdown()
