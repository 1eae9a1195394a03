"""Worker fixtures: one engine on the tiny random model per module, served by a real
uvicorn on a free 127.0.0.1 port in a thread (so SDK clients, streaming and client
disconnects behave exactly as over the network)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.engine.config import EngineConfig
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

from .worker_helpers import ServerThread

TINY_OPTIONS: dict[str, Any] = dict(num_kv_blocks=512, block_size=16, max_model_len=1024,
                                    max_num_seqs=16, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Any]:
    from sluice.engine.async_engine import AsyncEngine

    eng = AsyncEngine(EngineConfig.from_options(str(tiny_llama_dir), **TINY_OPTIONS))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[ServerThread]:
    app = build_app(engine, WorkerConfig(served_model_names=("tiny", "tiny-alias")))
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


@pytest.fixture()
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client
