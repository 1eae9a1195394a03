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
def engine(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Iterator[Any]:
    """The module's `ENGINE_DTYPE` (e.g. float32, to compare with transformers), if it
    sets one; else the engine's default (auto)."""
    from sluice.engine.async_engine import AsyncEngine

    dtype = getattr(request.module, "ENGINE_DTYPE", "auto")
    eng = AsyncEngine(EngineConfig.from_options(str(tiny_llama_dir), dtype=dtype,
                                                **TINY_OPTIONS))
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
