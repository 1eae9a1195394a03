"""The reliability suite's stack: real sluice processes on 127.0.0.1, started once for
the whole directory.

    worker   `sluice worker --model TINY`                          (uvicorn front end)
    router   `sluice router --worker WORKER --admin-key ADMIN`     (the router's own server)
    serve    `sluice serve --backend external --worker-url WORKER` (gateway + router in one
             process, as `sluice serve --workers N` runs them; SQLite store, dev key)

Processes rather than in-process apps, so that "still answering /health afterwards"
means the process survived, and each front end (uvicorn, the router's httptools
server) is the one users run. The worker's context is short (MAX_MODEL_LEN) so a fuzzed
request can never generate for long; two sequences run at a time, so a third waits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from sluice.control.local import free_port

ADMIN_KEY = "reliability-admin-secret"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 2


@dataclass
class Process:
    """One `sluice ...` subprocess: its URL, its stderr lines (for failure messages)."""

    name: str
    url: str
    proc: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def text(self) -> str:
        return "".join(self.log[-60:])


def start(name: str, args: list[str], home: Path) -> Process:
    """Start `python -m sluice.cli ARGS --port P` with SLUICE_HOME=home (not waiting)."""
    port = free_port()
    env = {**os.environ, "SLUICE_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", *args, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    process = Process(name, f"http://127.0.0.1:{port}", proc)
    threading.Thread(target=lambda: process.log.extend(iter(proc.stderr.readline, "")),  # type: ignore[union-attr]
                     daemon=True).start()
    return process


def wait_healthy(process: Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not process.healthy():
        assert process.alive(), f"{process.name} exited:\n{process.text()}"
        assert time.monotonic() < deadline, f"{process.name} not healthy:\n{process.text()}"
        time.sleep(0.2)


def stop(process: Process) -> None:
    process.proc.terminate()
    try:
        process.proc.wait(30)
    except subprocess.TimeoutExpired:
        process.proc.kill()
        process.proc.wait(10)


@dataclass
class Stack:
    worker: Process
    router: Process
    serve: Process
    key: str  # the dev tenant's key, printed by `sluice serve`
    model: str

    def all(self) -> list[Process]:
        return [self.worker, self.router, self.serve]


@pytest.fixture(scope="session")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("sluice-home")
    worker = start("worker", ["worker", "--model", str(tiny_llama_dir),
                              "--max-model-len", str(MAX_MODEL_LEN),
                              "--max-num-seqs", str(MAX_NUM_SEQS), "--num-kv-blocks", "256",
                              "--log-level", "warning"], home)
    started: list[Process] = [worker]
    try:
        wait_healthy(worker, 120)
        router = start("router", ["router", "--worker", worker.url, "--admin-key", ADMIN_KEY,
                                  "--log-level", "warning"], home)
        started.append(router)
        serve = start("serve", ["serve", "--backend", "external", "--worker-url", worker.url,
                                "--model", str(tiny_llama_dir), "--admin-key", ADMIN_KEY,
                                "--log-level", "warning"], home)
        started.append(serve)
        wait_healthy(router, 60)
        wait_healthy(serve, 60)
        model = httpx.get(worker.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        key = (home / "dev-key").read_text().strip()
        yield Stack(worker, router, serve, key, model)
    finally:
        for process in reversed(started):
            stop(process)


def metric(text: str, name: str) -> float:
    """The sum of every sample of `name` in Prometheus text."""
    from sluice.observe.prometheus import sum_samples

    return sum_samples(text).get(name, 0.0)
