"""`sluice worker --kv-offload disk=... --kv-store redis://...` as real processes: a second
worker's first request on a prefix the first computed is a hit (through Redis), a
restarted worker resumes the conversation with a hit (from its disk tier), and /metrics
counts the hits per medium."""

from __future__ import annotations

import signal
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from .test_shutdown import _start_worker
from .worker_helpers import free_port, wait_until

REDIS_URL = "redis://127.0.0.1:6379/0"
# The workers' store: redis-py's URL options override the tier's 0.5 s timeouts. One
# round trip over 0.5 s (a busy 2-core host at the end of a CI run) drops the write of
# the prompt's blocks, the only blocks this test's request makes, and nothing is stored.
STORE_URL = REDIS_URL + "?socket_timeout=5&socket_connect_timeout=5"
# A prompt of this run's own: the store skips a block Redis already holds (SET NX after
# EXISTS), so blocks left by an earlier run (one killed before its clean-up, or another
# checkout's run) would keep this run's first worker from storing anything.
MESSAGES = [{"role": "user",
             "content": f"run {uuid.uuid4().hex}: " + "tell me about rivers and their deltas " * 20}]


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def start(model: Path, *flags: str) -> tuple[subprocess.Popen[str], str, list[str]]:
    port = free_port()
    proc, log = _start_worker(model, port, *flags)
    url = f"http://127.0.0.1:{port}"
    assert wait_until(lambda: healthy(url), 90, 0.1), "".join(log)
    return proc, url, log


def cached_tokens(url: str) -> int:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def metric(url: str, name: str, medium: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and f'medium="{medium}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{medium={medium}}} not on /metrics")


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.services
def test_store_shares_a_prefix_and_disk_survives_a_restart(tiny_llama_dir: Path,
                                                           tmp_path: Path) -> None:
    disk = f"disk={tmp_path}:64MiB"
    client = redis.Redis.from_url(REDIS_URL)
    before = set(client.scan_iter(match="sluice:kv:*"))
    first, url, log = start(tiny_llama_dir, "--kv-offload", disk, "--kv-store", STORE_URL)
    try:
        assert cached_tokens(url) == 0
        assert wait_until(lambda: metric(url, "sluice:kv_offload_bytes_stored_total",
                                         "REDIS") > 0, 30), "".join(log)
        second, url2, _ = start(tiny_llama_dir, "--kv-store", STORE_URL)
        try:
            assert cached_tokens(url2) > 0  # the first worker's blocks, through Redis
            assert metric(url2, "vllm:external_prefix_cache_hits_total", "REDIS") > 0
        finally:
            stop(second)
    finally:
        stop(first)
    again, url3, _ = start(tiny_llama_dir, "--kv-offload", disk)  # restarted, no store
    try:
        assert cached_tokens(url3) > 0
        assert metric(url3, "vllm:external_prefix_cache_hits_total", "DISK") > 0
        assert metric(url3, "sluice:kv_offload_errors_total", "DISK") == 0
    finally:
        stop(again)
        ours = set(client.scan_iter(match="sluice:kv:*")) - before  # this test's blocks
        if ours:
            client.delete(*ours)
