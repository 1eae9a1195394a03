"""Helpers for the worker tests: a uvicorn server on a thread, a bounded wait, texts
embedded by an engine."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import numpy as np
import uvicorn

from sluice.control.local import free_port
from sluice.engine.async_engine import AsyncEngine
from sluice.engine.config import EngineConfig


class ServerThread:
    """A uvicorn server for `app` on its own thread and loop; `stop()` joins it."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()),
                                       daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def healthy(url: str) -> bool:
    """Whether a server at `url` answers 200 on /health now."""
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def embed_texts(model: Any, texts: list[str], **options: Any) -> list[np.ndarray]:
    """Each text's embedding from an engine on `model` (float32, `options`), all sent at
    once (one step where they fit); the engine is shut down after."""
    engine = AsyncEngine(EngineConfig.from_options(str(model), dtype="float32", **options))

    async def run() -> list[Any]:
        return list(await asyncio.gather(*(engine.embed(t, f"e{i}")
                                           for i, t in enumerate(texts))))
    try:
        return [np.asarray(o.outputs.embedding) for o in asyncio.run(run())]
    finally:
        engine.shutdown()
