"""A client that leaves aborts its request at every stage: while it waits for a slot
(before its first token), and mid-stream. One running slot makes the stages exact: the
second request can only wait while the first decodes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.config import EngineConfig
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

from .conftest import TINY_OPTIONS
from .worker_helpers import ServerThread, wait_until

LONG = 1000  # tokens of the request that holds the only slot


@pytest.fixture()
def one_slot(tiny_llama_dir: Path) -> Iterator[tuple[AsyncEngine, str]]:
    engine = AsyncEngine(EngineConfig.from_options(
        str(tiny_llama_dir), **{**TINY_OPTIONS, "max_num_seqs": 1, "max_model_len": 1100}))
    srv = ServerThread(build_app(engine, WorkerConfig())).start()
    yield engine, srv.url
    srv.stop()
    engine.shutdown()


def body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


@pytest.mark.parametrize("stream", [True, False])
def test_waiting_request_is_aborted_when_its_client_leaves(one_slot: tuple[AsyncEngine, str],
                                                           stream: bool) -> None:
    engine, url = one_slot
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body(LONG, True)) as holder:
            lines = holder.iter_lines()
            assert next(lines).startswith("data:")  # the slot is taken and decoding
            with pytest.raises(httpx.ReadTimeout):  # waits behind it; its client gives up
                http.post("/v1/completions", json=body(50, stream), timeout=0.5)
            assert wait_until(lambda: engine.stats().num_waiting == 0, 10)
            assert engine.stats().generation_tokens < LONG  # the holder is still running
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
    assert wait_until(lambda: engine.stats().num_running == 0, 10)
    assert engine.stats().generation_tokens == LONG  # the waiting one never ran


def test_streaming_request_is_aborted_when_its_client_leaves_mid_stream(
        one_slot: tuple[AsyncEngine, str]) -> None:
    engine, url = one_slot
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body(LONG, True)) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i == 5:
                    break
    assert wait_until(lambda: engine.stats().num_running == 0, 10)
    assert engine.stats().generation_tokens < LONG
