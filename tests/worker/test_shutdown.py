"""`sluice worker` as a real process: startup line, /health, a graceful SIGTERM that
finishes the in-flight stream, refuses new connections, and exits 0; and a killed
engine core process, which ends open streams with a 503 error and stops the worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from .worker_helpers import free_port, healthy, wait_until


def _collect(stream: object, sink: list[str]) -> None:
    for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
        sink.append(line)


def _accepts(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
        return True
    except httpx.ConnectError:
        return False


def _start_worker(model: Path, port: int, *flags: str) -> tuple[subprocess.Popen[str], list[str]]:
    """`sluice worker` on the tiny model; its stderr lines collect in the returned list."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "worker", "--model", str(model),
         "--port", str(port), "--num-kv-blocks", "256", "--max-model-len", "1024",
         "--served-model-name", "tiny", "--log-level", "warning", *flags],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log: list[str] = []
    threading.Thread(target=_collect, args=(proc.stderr, log), daemon=True).start()
    return proc, log


def test_sigterm_drains_in_flight_stream_and_exits_zero(tiny_llama_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, log = _start_worker(tiny_llama_dir, port, "--shutdown-timeout", "30")
    try:
        assert wait_until(lambda: healthy(url), 90, 0.1), "".join(log)
        assert wait_until(lambda: any(f"listening on {url} (model: tiny)" in x for x in log), 5)

        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 300, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                              timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line[5:].strip())
                        first.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        refused = wait_until(lambda: not _accepts(url), 10, 0.02)
        still_streaming = client.is_alive()
        client.join(60)
        assert proc.wait(60) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert still_streaming and refused  # new connections refused while the stream drains
    assert lines[-1] == "[DONE]"
    usage = json.loads(lines[-2])["usage"]
    assert usage["completion_tokens"] == 300
    reasons = [c["finish_reason"] for x in lines[:-1] for c in json.loads(x)["choices"]
               if c.get("finish_reason")]
    assert reasons == ["length"]
    assert any("stopped" in x for x in log)


def test_a_model_that_cannot_load_exits_1_with_a_message(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "worker", "--model", str(tmp_path / "missing"),
         "--port", str(free_port()), "--log-level", "warning"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "failed to load the model" in proc.stderr and "not found" in proc.stderr
    assert "Traceback" not in proc.stderr


def _engine_core(pid: int) -> int:
    """The worker's engine core process (not multiprocessing's resource tracker)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmd:
                found.append(int(child))
    core, = found
    return core


def test_engine_core_death_ends_streams_with_503_and_exits(tiny_llama_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, log = _start_worker(tiny_llama_dir, port)
    try:
        assert wait_until(lambda: any("listening on" in x for x in log), 90, 0.1), "".join(log)
        core = _engine_core(proc.pid)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 900, "ignore_eos": True,
                "stream": True}
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    if len(events) == 3:
                        os.kill(core, signal.SIGKILL)
        assert proc.wait(30) == 1, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and "engine core" in error["message"]
    assert any("engine core died" in x for x in log)
