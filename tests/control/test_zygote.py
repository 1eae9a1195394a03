"""LocalBackend's zygote: workers forked from a pre-imported template, each forking its
engine core, serve the same tokens as an in-process engine; the zygote has one thread
when it forks; a killed worker is reaped and reported, a drained one exits 0; the zygote
and its workers die with a SIGKILLed controller (started from the main thread, or from
a short-lived one)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from control.test_local import gone
from sluice.control.backend import WorkerHealth
from sluice.control.local import LocalBackend
from sluice.control.zygote import ForkedProcess
from worker.worker_helpers import wait_until

TINY_ARGS = ["--max-model-len", "256", "--num-kv-blocks", "64"]
PROMPT = "The quick brown fox"


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if parent_of(int(entry.name)) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                pass
    return found


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


async def complete(url: str) -> str:
    async with httpx.AsyncClient(timeout=60) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        resp = await client.post(url + "/v1/completions", json={
            "model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def in_process_text(model: Path) -> str:
    from sluice import LLM, SamplingParams

    llm = LLM(str(model), max_model_len=256, num_kv_blocks=64)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12,
                                                ignore_eos=True))
    return out[0].outputs[0].text


async def test_forked_workers_serve_the_same_tokens_and_are_reaped(
        tiny_llama_dir: Path) -> None:
    backend = LocalBackend(["--model", str(tiny_llama_dir), *TINY_ARGS], kv_events=False,
                           startup_timeout_s=150, poll_s=0.05)
    try:
        first, second = await backend.start(), await backend.start()
        zygote = backend.zygote
        assert zygote is not None and zygote.single_threaded
        workers = [backend.workers[first.id], backend.workers[second.id]]
        for w in workers:
            assert isinstance(w.process, ForkedProcess)
            assert parent_of(w.process.pid) == zygote.process.pid
            (core,) = children_of(w.process.pid)
            assert "sluice.control.zygote" in cmdline(core)  # forked too, not spawned
        expected = in_process_text(tiny_llama_dir)
        assert [await complete(first.url), await complete(second.url)] == [expected] * 2

        killed = workers[1].process
        os.kill(killed.pid, signal.SIGKILL)
        for _ in range(200):
            if await backend.health(second) is WorkerHealth.DEAD:
                break
            await asyncio.sleep(0.05)
        assert killed.returncode == -signal.SIGKILL and not Path(f"/proc/{killed.pid}").exists()

        await backend.stop(first, drain=True)
        assert workers[0].process.returncode == 0
    finally:
        await backend.close()
    assert zygote.process.poll() is not None


CONTROLLER_SCRIPT = """
import asyncio, json, sys, threading
from sluice.control.local import LocalBackend

model, mode = sys.argv[1], sys.argv[2]
backend = LocalBackend(["--model", model, "--max-model-len", "256", "--num-kv-blocks", "64"],
                       kv_events=False, startup_timeout_s=150)
if mode == "thread":
    starter = threading.Thread(target=lambda: asyncio.run(backend.start()))
    starter.start()
    starter.join()
else:
    asyncio.run(backend.start())
(worker,) = backend.workers.values()
print(json.dumps({"zygote": backend.zygote.process.pid, "worker": worker.process.pid,
                  "url": worker.url}), flush=True)
sys.stdin.read()  # until the test kills this process
"""


@pytest.mark.parametrize("mode", ["main", "thread"])
def test_the_zygote_and_its_workers_die_with_a_sigkilled_controller(
        tiny_llama_dir: Path, mode: str) -> None:
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER_SCRIPT,
                                   str(tiny_llama_dir), mode],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = controller.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the controller did not start (exit {controller.wait(10)})"
        started = json.loads(line)
        pids = [started["zygote"], started["worker"], *children_of(started["worker"])]
        assert len(pids) == 3  # the zygote, the worker, its engine core
        assert httpx.get(started["url"] + "/health", timeout=5).status_code == 200
        controller.send_signal(signal.SIGKILL)
        controller.wait(10)
        assert wait_until(lambda: all(gone(pid) for pid in pids), timeout=40, interval=0.1), \
            f"{[p for p in pids if not gone(p)]} outlived their SIGKILLed controller"
    finally:
        controller.kill()
        for pid in pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
