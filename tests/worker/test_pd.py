"""P/D disaggregation between real `sluice worker` processes on 127.0.0.1 (tiny model):
vLLM's two-step flow (prefill with kv_transfer_params, then decode with the params the
prefill returned) gives the same greedy text as one worker, streamed or not; a failed
pull recomputes (or is a 503 kv_transfer_failed under --kv-load-failure-policy fail);
bad params are 400s naming the field; /v1/pd_role switches roles with epoch fencing."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_kv_offload_worker import start, stop
from .worker_helpers import wait_until

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}
FIELDS = {"do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_block_ids",
          "remote_host", "remote_port", "remote_request_id", "tp_size"}
TEXTS = ["hi", "Tell me a story about a lighthouse keeper and the sea",
         "Rivers carry sediment down to their deltas, where it settles. " * 4,
         "Compilers translate source code into machine code in several passes. " * 6]

# float32: a prefix hit computes exactly what a cold prefill does (docs/pd.md: bfloat16)
FP32 = ("--dtype", "float32")


@pytest.fixture(scope="module")
def workers(tiny_llama_dir: Path) -> Iterator[dict[str, str]]:
    """prefill (role prefill), decode (role decode, recompute), strict (policy fail)."""
    flags = {"prefill": ("--role", "prefill"), "decode": ("--role", "decode"),
             "strict": ("--role", "decode", "--kv-load-failure-policy", "fail")}
    with ThreadPoolExecutor(3) as pool:
        started = dict(zip(flags, pool.map(lambda f: start(tiny_llama_dir, *FP32, *f),
                                           flags.values()), strict=True))
    yield {name: url for name, (_, url, _) in started.items()}
    for proc, _, _ in started.values():
        stop(proc)


def completion(url: str, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def prefill(url: str, body: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
    """What a router sends a prefill worker, and the params it answers with."""
    step = {**body, "kv_transfer_params": dict(PREFILL), "max_tokens": 1, "stream": False}
    if "max_completion_tokens" in body:
        step["max_completion_tokens"] = 1
    resp = httpx.post(url + path, json=step, timeout=60)
    assert resp.status_code == 200, resp.text
    params = resp.json()["kv_transfer_params"]
    assert set(params) == FIELDS
    return params


def streamed_text(url: str, body: dict[str, Any]) -> str:
    parts = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(parts)


def listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def metric(url: str, name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ " and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not on /metrics")


def test_completions_handoff_matches_one_worker(workers: dict[str, str]) -> None:
    p, d = workers["prefill"], workers["decode"]
    received = metric(d, "sluice:kv_transfer_blocks_total", direction="received")
    expected_blocks = 0
    for text in TEXTS + [TEXTS[3] + " And then?"]:  # the last: a prefix hit on both sides
        body = {"model": "tiny", "prompt": text, "max_tokens": 10, "temperature": 0,
                "ignore_eos": True}
        alone = completion(p, text).json()["choices"][0]["text"]
        params = prefill(p, body)
        assert params["remote_host"] == "127.0.0.1" and params["do_remote_prefill"] is True
        expected_blocks += len(params["remote_block_ids"])
        resp = httpx.post(d + "/v1/completions", json={**body, "kv_transfer_params": params},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == alone
        assert "kv_transfer_params" not in resp.json()
    assert expected_blocks > 0
    pulled = metric(d, "sluice:kv_transfer_blocks_total", direction="received") - received
    assert 0 < pulled <= expected_blocks  # the prefix hit pulled only what was missing
    assert metric(p, "sluice:kv_transfer_bytes_total", direction="sent") > 0
    assert metric(d, "sluice:kv_transfer_seconds_count") >= 1
    assert metric(p, "sluice:pd_role", role="prefill") == 1.0


def test_chat_and_streamed_decode_match(workers: dict[str, str]) -> None:
    p, d = workers["prefill"], workers["decode"]
    messages = [{"role": "user", "content": "Describe a harbour at dawn, in detail. " * 5}]
    body = {"model": "tiny", "messages": messages, "max_completion_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    alone = httpx.post(p + "/v1/chat/completions", json=body, timeout=60).json()
    params = prefill(p, body, "/v1/chat/completions")
    resp = httpx.post(d + "/v1/chat/completions", json={**body, "kv_transfer_params": params},
                      timeout=60).json()
    assert resp["choices"][0]["message"] == alone["choices"][0]["message"]
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        len(params["remote_block_ids"]) * 16 > 0
    text = TEXTS[2] + " Next:"
    plain = {"model": "tiny", "prompt": text, "max_tokens": 10, "temperature": 0,
             "ignore_eos": True}
    params = prefill(p, plain)
    streamed = streamed_text(d, {**plain, "kv_transfer_params": params})
    assert streamed == completion(p, text).json()["choices"][0]["text"]


def test_failed_pulls_recompute_or_fail(workers: dict[str, str], tiny_llama_dir: Path
                                        ) -> None:
    p, d, strict = workers["prefill"], workers["decode"], workers["strict"]
    text = "Bees build hexagonal cells of wax to store honey and raise brood. " * 5
    body = {"model": "tiny", "prompt": text, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}
    alone = completion(p, text).json()["choices"][0]["text"]
    wrong = {**prefill(p, body), "remote_port": 9}  # nothing listens there
    before = metric(d, "sluice:kv_transfer_failures_total", reason="connect")
    resp = httpx.post(d + "/v1/completions", json={**body, "kv_transfer_params": wrong},
                      timeout=60)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == alone
    assert metric(d, "sluice:kv_transfer_failures_total", reason="connect") == before + 1
    resp = httpx.post(strict + "/v1/completions", json={**body, "kv_transfer_params": wrong},
                      timeout=60)
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]
    assert (err["code"], err["param"]) == ("kv_transfer_failed", "kv_transfer_params")
    # a prefill worker killed after its prefill: the decode recomputes, or 503s
    proc, url, _ = start(tiny_llama_dir, *FP32, "--role", "prefill")
    try:
        params = prefill(url, body)
    finally:
        proc.kill()
        proc.wait()
    # its engine core process (which serves the KV) leaves within a second of its parent
    assert wait_until(lambda: not listening(params["remote_host"], params["remote_port"]), 10)
    for target, status in ((d, 200), (strict, 503), (d, 200)):
        resp = httpx.post(target + "/v1/completions",
                          json={**body, "kv_transfer_params": params}, timeout=60)
        assert resp.status_code == status, resp.text
        if status == 200:
            assert resp.json()["choices"][0]["text"] == alone
        else:
            assert resp.json()["error"]["code"] == "kv_transfer_failed"


@pytest.mark.parametrize(("params", "extra", "param"), [
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1],
      "remote_host": "127.0.0.1", "remote_port": "8000", "remote_request_id": "r"}, {},
     "kv_transfer_params.remote_port"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1],
      "remote_host": "not a host!", "remote_port": 8000, "remote_request_id": "r"}, {},
     "kv_transfer_params.remote_host"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1],
      "remote_host": "127.0.0.1", "remote_port": 0, "remote_request_id": "r"}, {},
     "kv_transfer_params.remote_port"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1],
      "remote_host": "127.0.0.1", "remote_port": 8000}, {},
     "kv_transfer_params.remote_request_id"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [-1],
      "remote_host": "127.0.0.1", "remote_port": 8000, "remote_request_id": "r"}, {},
     "kv_transfer_params.remote_block_ids.0"),
    ({"do_remote_prefill": True, "do_remote_decode": True}, {}, "kv_transfer_params"),
    ({"do_remote_decode": "yes"}, {}, "kv_transfer_params.do_remote_decode"),
    ({"do_remote_decode": True, "bootstrap_room": 1}, {}, "kv_transfer_params.bootstrap_room"),
    (PREFILL, {"n": 2}, "n"),
    (PREFILL, {"stream": True}, "stream"),
])
def test_bad_kv_transfer_params_are_400s(workers: dict[str, str], params: dict[str, Any],
                                         extra: dict[str, Any], param: str) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "kv_transfer_params": params,
            **extra}
    resp = httpx.post(workers["decode"] + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_pd_role_switch_drains_and_fences(workers: dict[str, str]) -> None:
    url = workers["strict"]
    state = httpx.get(url + "/v1/pd_role", timeout=5).json()
    assert state == {"role": "decode", "epoch": 0, "draining": False}
    stale = httpx.post(url + "/v1/pd_role", json={"role": "prefill", "expected_epoch": 7},
                       timeout=5)
    assert stale.status_code == 409 and stale.json()["error"]["param"] == "expected_epoch"
    bad = httpx.post(url + "/v1/pd_role", json={"role": "mixer", "expected_epoch": 0},
                     timeout=5)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "role"
    # a switch waits for the request in flight
    done = threading.Event()

    def in_flight() -> None:
        completion(url, "count slowly", max_tokens=120)
        done.set()

    worker = threading.Thread(target=in_flight)
    worker.start()
    deadline = time.monotonic() + 30
    while metric(url, "sluice:http_requests_pending") < 1:
        assert time.monotonic() < deadline
    switched = httpx.post(url + "/v1/pd_role", json={"role": "prefill", "expected_epoch": 0,
                                                     "drain_timeout": 60}, timeout=90)
    # it answered only after the stream finished at the server (the client's thread may
    # read the stream's last bytes a moment after this thread reads the switch's answer)
    assert metric(url, "sluice:http_requests_pending") == 0
    assert done.wait(30)
    worker.join()
    assert switched.json() == {"role": "prefill", "epoch": 1, "draining": False}
    assert metric(url, "sluice:pd_role", role="prefill") == 1.0
    assert metric(url, "sluice:pd_role", role="decode") == 0.0
    assert metric(url, "sluice:pd_epoch") == 1.0
    # fencing: the old epoch is refused, the current one and no header are served
    old = completion(url, "hi", max_tokens=1, **{})
    assert old.status_code == 200
    fenced = httpx.post(url + "/v1/completions", headers={"x-sluice-pd-epoch": "0"},
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 1}, timeout=30)
    assert fenced.status_code == 409
    assert fenced.json()["error"]["code"] == "stale_pd_epoch"
    current = httpx.post(url + "/v1/chat/completions", headers={"x-sluice-pd-epoch": "1"},
                         json={"model": "tiny", "max_tokens": 1,
                               "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert current.status_code == 200
    back = httpx.post(url + "/v1/pd_role", json={"role": "decode", "expected_epoch": 1},
                      timeout=30)
    assert back.json() == {"role": "decode", "epoch": 2, "draining": False}
