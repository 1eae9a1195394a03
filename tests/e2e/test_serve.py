"""`sluice serve` end to end on the real default model (SmolLM2-135M-Instruct GGUF)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx
import pytest


@pytest.mark.model
def test_serve_answers_a_chat_question() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "serve", "--port", str(port)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")),  # type: ignore[union-attr]
                     daemon=True).start()
    try:
        assert wait_until(lambda: _healthy(url), 120, 0.2), "".join(log)
        assert any(f"listening on {url}" in line for line in log), "".join(log)
        resp = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 12})
        assert resp.status_code == 200, resp.text
        answer = resp.json()["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, "".join(log)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
