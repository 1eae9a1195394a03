"""Local worker processes: N `sluice worker` subprocesses on free ports of this machine.

The smallest cluster backend, used by `sluice serve --workers N` and by tests:

    with LocalWorkerPool(2, ["--model", path], kv_events=True) as pool:
        pool.urls          # ["http://127.0.0.1:41233", "http://127.0.0.1:41235"]
        pool.kv_endpoints  # ["tcp://127.0.0.1:41234", ...] (None without kv_events)

`start()` launches every worker at once (their model loads overlap), then waits until each
answers 200 on /health; a worker that exits first raises with the tail of its log.
`stop()` sends SIGTERM (the worker drains), then SIGKILL after `stop_timeout_s`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class LocalWorker:
    url: str
    port: int
    kv_events: str | None
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


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
        port = free_port(self.host)
        kv = f"tcp://{self.host}:{free_port(self.host)}" if self.kv_events else None
        cmd = [sys.executable, "-m", "sluice.cli", "worker", *self.worker_args,
               "--host", self.host, "--port", str(port)]
        if kv:
            cmd += ["--kv-events-endpoint", kv]
        log_path = self.log_dir / f"worker-{index}-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                    start_new_session=True)
        return LocalWorker(f"http://{self.host}:{port}", port, kv, proc, log_path)

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
