"""Local worker processes: `sluice worker` subprocesses on free ports of this machine.

Two faces over one launcher (`launch_worker`):

`LocalBackend`, the `local` cluster backend (`sluice serve`): workers started and
stopped one at a time at runtime, from the event loop, as the controller asks:

    backend = LocalBackend(["--model", path])
    worker = await backend.start()              # launched, then /health 200
    worker = await backend.start(ModelSpec(p2))  # the same flags, another model
    await backend.health(worker)                # READY; DEAD once its process exited
    await backend.stop(worker, drain=True)      # SIGTERM (it drains), SIGKILL later

`health` polls the process, so a worker that died (`kill -9`, out of memory) is reaped
at once, not left a zombie, and reported DEAD; the controller then replaces it.

`LocalWorkerPool`, a fixed set for tests and benchmarks:

    with LocalWorkerPool(2, ["--model", path], kv_events=True) as pool:
        pool.urls          # ["http://127.0.0.1:41233", "http://127.0.0.1:41235"]
        pool.kv_endpoints  # ["tcp://127.0.0.1:41234", ...] (None without kv_events)

`start()` launches every worker at once (their model loads overlap), then waits until each
answers 200 on /health; a worker that exits first raises with the tail of its log.
`stop()` sends SIGTERM (the worker drains), then SIGKILL after `stop_timeout_s`.

Workers die with their parent, even when it is SIGKILLed and `stop()` never runs. Each
worker is started through this module (`python -m sluice.control.local --parent-pid P --
worker ...`), which before running `sluice worker`:

* starts a watcher thread that polls `os.getppid()`: once the parent is gone (the
  worker was re-parented) it sends the worker SIGTERM, so it drains as on `stop()`,
  and exits it hard `ORPHAN_GRACE_S` later if the drain has not finished;
* on Linux, when the pool was started from the main thread, also sets
  `prctl(PR_SET_PDEATHSIG, SIGTERM)`, which delivers the SIGTERM at once. The kernel
  fires it when the *thread* that forked the child exits, so it is only armed for
  children of the main thread (which lives as long as the process); a pool started
  from a short-lived thread relies on the watcher alone, which sees the process, not
  the thread.

The parent pid is passed explicitly, so a parent that died before the child got this
far is noticed too (`getppid()` already differs at the first check).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from sluice.control.backend import Backend, ModelSpec, WorkerHandle, WorkerHealth

if TYPE_CHECKING:
    from sluice.control.zygote import ForkedProcess, Zygote

log = logging.getLogger(__name__)

ORPHAN_POLL_S = 0.25   # how often a worker checks that its parent is alive
ORPHAN_GRACE_S = 30.0  # after the SIGTERM, how long an orphan may drain before exiting
PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class LocalWorker:
    url: str
    port: int
    kv_events: str | None
    process: subprocess.Popen[bytes] | ForkedProcess
    log_path: Path
    index: int = 0

    @property
    def handle(self) -> WorkerHandle:
        return WorkerHandle(f"local-{self.index}-{self.port}", self.url, self.kv_events)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def launch_worker(index: int, worker_args: Sequence[str], host: str, kv_events: bool,
                  log_dir: Path, env: Mapping[str, str], zygote: Zygote | None = None
                  ) -> LocalWorker:
    """Start one `sluice worker` on a free port (tied to this process), its output in a
    log file under `log_dir`; returns at once (the model loads in the background).
    Forked from `zygote` when given (see `sluice.control.zygote`)."""
    port = free_port(host)
    kv = f"tcp://{host}:{free_port(host)}" if kv_events else None
    args = ["worker", *worker_args, "--host", host, "--port", str(port)]
    if kv:
        args += ["--kv-events-endpoint", kv]
    log_path = log_dir / f"worker-{index}-{port}.log"
    proc: subprocess.Popen[bytes] | ForkedProcess
    if zygote is not None:
        proc = zygote.fork(args, log_path, env)
    else:
        with open(log_path, "wb") as out:
            proc = subprocess.Popen([*child_command(), *args], stdout=out,
                                    stderr=subprocess.STDOUT, env=dict(env),
                                    start_new_session=True)
    return LocalWorker(f"http://{host}:{port}", port, kv, proc, log_path, index)


def stop_process(proc: subprocess.Popen[Any] | ForkedProcess, drain: bool,
                 timeout_s: float) -> None:
    """SIGTERM (drain) and wait up to `timeout_s`, then SIGKILL; or SIGKILL now. Reaps it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM if drain else signal.SIGKILL)
    try:
        proc.wait(timeout=timeout_s if drain else None)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class LocalBackend(Backend):
    """The `local` backend: one `sluice worker` subprocess per replica, on this machine.

    `worker_args` are `sluice worker` flags (model, engine options); host and port are
    chosen here. Workers die with this process (see the module docstring's last part).
    With `zygote` (Linux), the first start launches a pre-imported template process and
    every worker is forked from it (`sluice.control.zygote`): no interpreter start and
    no imports on a scale-up.
    """

    name = "local"

    def __init__(self, worker_args: Sequence[str] = (), *, host: str = "127.0.0.1",
                 kv_events: bool = True, startup_timeout_s: float = 180.0,
                 stop_timeout_s: float = 30.0, log_dir: str | Path | None = None,
                 env: Mapping[str, str] | None = None, poll_s: float = 0.2,
                 zygote: bool = True) -> None:
        self.worker_args = list(worker_args)
        self.host = host
        self.kv_events = kv_events
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="sluice-workers-"))
        self.env = {**os.environ, **(env or {})}
        self.poll_s = poll_s
        self.workers: dict[str, LocalWorker] = {}
        self._index = itertools.count()
        self.use_zygote = zygote
        self.zygote: Zygote | None = None

    def list(self) -> list[WorkerHandle]:
        return [w.handle for w in self.workers.values()]

    def check_model(self, model: ModelSpec) -> None:
        """A model the workers would read as a path of this machine must exist here."""
        check_model_path(model.model)

    async def start(self, model: ModelSpec | None = None) -> WorkerHandle:
        zygote = await self._ready_zygote()
        args = self.worker_args + (model.flags() if model is not None else [])
        worker = launch_worker(next(self._index), args, self.host, self.kv_events,
                               self.log_dir, self.env, zygote)
        handle = worker.handle
        self.workers[handle.id] = worker
        try:
            await self._wait_ready(worker)
        except BaseException:
            self.workers.pop(handle.id, None)
            await asyncio.to_thread(stop_process, worker.process, False, 0)
            raise
        return handle

    async def _ready_zygote(self) -> Zygote | None:
        """The zygote, launched on first use from this (the event loop's) thread, for
        PDEATHSIG's sake, and waited for; None where there is none."""
        from sluice.control import zygote

        if not self.use_zygote or not zygote.supported():
            return None
        if self.zygote is None or not self.zygote.alive:
            self.zygote = zygote.Zygote(self.env, self.log_dir / "zygote.log")
        current = self.zygote
        try:
            await asyncio.to_thread(current.wait_ready, self.startup_timeout_s)
        except zygote.ZygoteError as exc:  # start workers as fresh processes instead
            log.warning("worker zygote unusable, starting fresh processes: %s", exc)
            self.use_zygote = False
            # on a thread: close() waits for the zygote's lock, which another start's
            # wait_ready can hold for its whole timeout (it blocked the router's loop)
            await asyncio.to_thread(current.close)
            return None
        return current

    async def _wait_ready(self, worker: LocalWorker) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while not await health_ok(client, worker.url):
                if worker.process.poll() is not None:
                    raise RuntimeError(f"worker {worker.url} exited with "
                                       f"{worker.process.returncode}:\n{worker.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {worker.url} not healthy after "
                                       f"{self.startup_timeout_s}s\n{worker.log_tail()}")
                await asyncio.sleep(self.poll_s)

    async def stop(self, worker: WorkerHandle, drain: bool = True) -> None:
        local = self.workers.pop(worker.id, None)
        if local is not None:
            await asyncio.to_thread(stop_process, local.process, drain, self.stop_timeout_s)

    async def health(self, worker: WorkerHandle) -> WorkerHealth:
        local = self.workers.get(worker.id)
        if local is None or local.process.poll() is not None:  # poll() reaps a dead child
            self.workers.pop(worker.id, None)
            return WorkerHealth.DEAD
        async with httpx.AsyncClient(timeout=2.0) as client:
            ok = await health_ok(client, local.url)
        return WorkerHealth.READY if ok else WorkerHealth.STARTING

    async def close(self) -> None:
        workers, self.workers = list(self.workers.values()), {}
        await asyncio.gather(*(asyncio.to_thread(stop_process, w.process, True,
                                                 self.stop_timeout_s) for w in workers))
        if self.zygote is not None:
            await asyncio.to_thread(self.zygote.close)


def check_model_path(model: str) -> None:
    """Raise `ModelNotFoundError` (400, `param: model`) where `sluice worker --model MODEL`
    would not find a local path: the worker's own `local_model_path`, called for every
    name but a hub id (`org/name`: the worker downloads it; so would the call)."""
    from sluice.engine.tokenizer import is_hub_id, local_model_path

    if not is_hub_id(model):
        local_model_path(model)


async def health_ok(client: httpx.AsyncClient, url: str) -> bool:
    """Whether `url`/health answers 200 now (any transport error: no)."""
    try:
        return (await client.get(url + "/health")).status_code == 200
    except httpx.HTTPError:
        return False


class LocalWorkerPool:
    """Starts, watches and stops `n` local `sluice worker` processes."""

    def __init__(self, n: int, worker_args: Sequence[str] = (), *, host: str = "127.0.0.1",
                 kv_events: bool = False, startup_timeout_s: float = 180.0,
                 stop_timeout_s: float = 15.0, log_dir: str | Path | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        if n < 1:
            raise ValueError("a pool needs at least one worker")
        self.n = n
        self.worker_args = list(worker_args)
        self.host = host
        self.kv_events = kv_events
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="sluice-workers-"))
        self.env = {**os.environ, **(env or {})}
        self.workers: list[LocalWorker] = []

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    @property
    def kv_endpoints(self) -> list[str | None]:
        return [w.kv_events for w in self.workers]

    def _launch(self, index: int) -> LocalWorker:
        return launch_worker(index, self.worker_args, self.host, self.kv_events, self.log_dir,
                             self.env)

    def start(self) -> list[LocalWorker]:
        """Launch all workers and wait until each is healthy; stops them all on failure."""
        self.workers = [self._launch(i) for i in range(self.n)]
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.workers

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = list(self.workers)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for w in list(pending):
                    if w.process.poll() is not None:
                        raise RuntimeError(f"worker {w.url} exited with {w.process.returncode}:\n"
                                           f"{w.log_tail()}")
                    try:
                        if client.get(w.url + "/health").status_code == 200:
                            pending.remove(w)
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    raise TimeoutError(f"workers not healthy after {self.startup_timeout_s}s: "
                                       f"{[w.url for w in pending]}\n{pending[0].log_tail()}")
                if pending:
                    time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM every worker, wait, SIGKILL stragglers. Safe to call twice."""
        for w in self.workers:
            if w.process.poll() is None:
                w.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for w in self.workers:
            try:
                w.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait()

    def __enter__(self) -> LocalWorkerPool:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# -- the worker's side: die with the parent --------------------------------------------------


def child_command() -> list[str]:
    """The command prefix that runs `sluice ARGS` as a child tied to this process."""
    cmd = [sys.executable, "-m", "sluice.control.local", "--parent-pid", str(os.getpid())]
    if threading.current_thread() is threading.main_thread():
        cmd.append("--pdeathsig")
    return [*cmd, "--"]


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send `sig` to this process when its parent thread exits; False if the
    platform has no prctl (the watcher still covers it)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0


def watch_parent(parent_pid: int, poll_s: float = ORPHAN_POLL_S,
                 grace_s: float = ORPHAN_GRACE_S) -> threading.Thread:
    """Start a daemon thread that SIGTERMs this process once `parent_pid` stops being its
    parent, then exits it with status 1 if it is still alive `grace_s` later."""
    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    thread = threading.Thread(target=run, name="sluice-parent-watch", daemon=True)
    thread.start()
    return thread


def child_main(argv: Sequence[str] | None = None) -> int:
    """`python -m sluice.control.local --parent-pid P [--pdeathsig] -- ARGS`: tie this
    process to P, then run `sluice ARGS` in it."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sluice.control.local")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--pdeathsig", action="store_true")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.pdeathsig:
        set_parent_death_signal()
    if os.getppid() != ns.parent_pid:
        return 1  # the parent died before we got here
    watch_parent(ns.parent_pid)
    from sluice.cli import main

    rest = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    return main(rest)


if __name__ == "__main__":
    raise SystemExit(child_main())
