"""Gateway fixtures: stores (SQLite, PostgreSQL on a per-run table prefix), Redis key
prefixes that are cleaned up, the stub upstream, and a builder for gateways."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.gateway.config import GatewayConfig, LimiterConfig
from sluice.gateway.limits import Limiter, LocalLimiter
from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.pricing import PriceTable
from sluice.gateway.state import GatewayState
from sluice.gateway.store import KeySettings, SQLStore, TenantSettings
from sluice.gateway.tokens import PromptTokenCounter, estimate_prompt_tokens

from .stub import StubUpstream

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"
ADMIN_KEY = "admin-test-secret"


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[SQLStore]:
    store = SQLStore(f"sqlite:///{tmp_path / 'gw.db'}")
    yield store
    store.close()


@pytest.fixture
def pg_store() -> Iterator[SQLStore]:
    store = SQLStore(PG_URL, table_prefix=f"t{uuid.uuid4().hex[:10]}_")
    yield store
    store.drop_all()
    store.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def any_store(request: pytest.FixtureRequest) -> SQLStore:
    name = "sqlite_store" if request.param == "sqlite" else "pg_store"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    import redis.asyncio as aioredis

    prefix = f"sluice-test:{uuid.uuid4().hex}:"
    yield prefix
    client = aioredis.Redis.from_url(REDIS_URL)
    keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture
def stub() -> StubUpstream:
    return StubUpstream()


def make_state(store: SQLStore, limiter: Limiter | None = None, *,
               prices: PriceTable | None = None, on_redis_error: str = "closed",
               count=estimate_prompt_tokens, await_ledger: bool = True) -> GatewayState:
    """A state on `store`; `await_ledger` (default here) makes every record readable as
    soon as its response has arrived."""
    config = GatewayConfig(admin_key=ADMIN_KEY, await_ledger=await_ledger,
                           limiter=LimiterConfig(on_redis_error=on_redis_error))
    return GatewayState(config=config, store=store, limiter=limiter or LocalLimiter(),
                        prices=prices or PriceTable(), count_prompt_tokens=count)


def client_for(app: object, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app),  # type: ignore[arg-type]
                             base_url="http://gateway", headers=headers, timeout=30)


def new_key(store: SQLStore, tenant: str = "acme", key_settings: KeySettings | None = None,
            **tenant_settings: object) -> str:
    try:
        store.get_tenant(tenant)
    except Exception:
        store.create_tenant(tenant, TenantSettings(**tenant_settings))  # type: ignore[arg-type]
    _, plaintext = store.create_key(tenant, key_settings or KeySettings())
    return plaintext


@pytest.fixture
def gateway(sqlite_store: SQLStore, stub: StubUpstream) -> GatewayMiddleware:
    return GatewayMiddleware(stub, make_state(sqlite_store))


CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 5}


@asynccontextmanager
async def serve(app: object, lifespan: str = "off") -> AsyncIterator[str]:
    """Run `app` under a real uvicorn server on a free 127.0.0.1 port, in this loop."""
    import socket

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,  # type: ignore[arg-type]
                                           log_level="warning", lifespan=lifespan))
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Any]:
    """A real engine on the tiny random Llama (SmolLM2's tokenizer), for a gateway in
    front of a real sluice worker."""
    from sluice.engine.async_engine import AsyncEngine
    from sluice.engine.config import EngineConfig

    eng = AsyncEngine(EngineConfig.from_options(
        str(tiny_llama_dir), num_kv_blocks=256, block_size=16, max_model_len=1024,
        max_num_seqs=8, max_num_batched_tokens=256))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def counter(tiny_llama_dir: Path) -> PromptTokenCounter:
    return PromptTokenCounter(default_source=str(tiny_llama_dir))
