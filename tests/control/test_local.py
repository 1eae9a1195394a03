"""LocalWorkerPool: workers die with their parent, even one that is SIGKILLed.

The pool runs in a child process the test spawns (its "parent" is what gets killed);
the child starts one worker on the tiny model, prints the worker pids and urls, and
waits. Both ways of starting a pool are covered: from the main thread (PDEATHSIG plus
the watcher) and from a short-lived thread (the watcher alone; the workers must
survive that thread's exit).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from worker.worker_helpers import wait_until

POOL_SCRIPT = """
import json, sys, threading
from sluice.control.local import LocalWorkerPool

model, mode = sys.argv[1], sys.argv[2]
pool = LocalWorkerPool(1, ["--model", model, "--max-model-len", "256",
                           "--num-kv-blocks", "64"], startup_timeout_s=150)
if mode == "thread":
    starter = threading.Thread(target=pool.start)
    starter.start()
    starter.join()
else:
    pool.start()
print(json.dumps({"pids": [w.process.pid for w in pool.workers], "urls": pool.urls}),
      flush=True)
sys.stdin.read()  # until the test kills this process
"""


def gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for a reaper that may not reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return state in ("Z", "X")


@pytest.mark.parametrize("mode", ["main", "thread"])
def test_workers_die_when_the_parent_is_sigkilled(tiny_llama_dir: Path, mode: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", POOL_SCRIPT, str(tiny_llama_dir), mode],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = parent.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the pool did not start (exit {parent.wait(10)})"
        started = json.loads(line)
        pids = started["pids"]
        for url in started["urls"]:  # alive after the starting thread has exited
            assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert not any(gone(pid) for pid in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_until(lambda: all(gone(pid) for pid in pids), timeout=30, interval=0.1), \
            f"workers {pids} outlived their SIGKILLed parent"
    finally:
        parent.kill()
        for pid in pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


TINY_ARGS = ["--max-model-len", "256", "--num-kv-blocks", "64"]


async def test_a_killed_worker_is_reaped_and_replaced_through_the_router(
        tiny_llama_dir: Path) -> None:
    """`kill -9` one real worker of `sluice serve`'s stack (LocalBackend + controller +
    router): its process is reaped (no zombie), a new worker takes its place and serves."""
    import asyncio
    import random

    from router.router_stubs import serve_router
    from sluice.control.backend import WorkerHealth
    from sluice.control.controller import Controller, ControllerConfig, attach
    from sluice.control.local import LocalBackend
    from sluice.control.planner import Planner, PlannerConfig
    from sluice.router.app import build_app
    from sluice.router.config import PoolConfig, RouterConfig

    backend = LocalBackend(["--model", str(tiny_llama_dir), *TINY_ARGS], kv_events=False,
                           startup_timeout_s=150)
    app = build_app(RouterConfig(pools=(PoolConfig(model="tiny", policy="least_load"),),
                                 health_interval_s=0.2), rng=random.Random(0))
    made: list[Controller] = []
    attach(app, lambda state: made.append(Controller(
        "tiny", state, state.pools[0], backend,
        Planner(PlannerConfig(min_replicas=1, max_replicas=1), initial=1),
        ControllerConfig(interval_s=0.2))) or made)
    async with serve_router(app) as url:
        (ctl,) = made
        (old,) = backend.workers.values()
        pid = old.process.pid
        os.kill(pid, signal.SIGKILL)
        for _ in range(1500):
            if ctl.workers and old.url not in ctl.workers:
                break
            await asyncio.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists(), "the killed worker was left a zombie"
        (new,) = backend.workers.values()
        assert new.url != old.url and await backend.health(new.handle) is WorkerHealth.READY
        assert [e["event"] for e in ctl.events] == ["start", "ready", "dead", "start", "ready"]
        async with httpx.AsyncClient(timeout=60) as client:
            resp = await client.post(url + "/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": 3})
        assert resp.status_code == 200, resp.text
    assert not backend.workers and new.process.poll() is not None
