"""Router config from files and flags, and `sluice router` as a real process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from router_stubs import StubState, free_port, make_stub, serve

from sluice.cli import build_parser
from sluice.protocol.errors import InvalidRequestError
from sluice.router.cli import config_from_args
from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec, load_config_file


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser(["router", *argv]).parse_args(["router", *argv])


def test_flags_make_one_pool_with_kv_events_and_long_group() -> None:
    cfg = config_from_args(parse(
        "--worker", "http://h:1/", "--worker", "http://h:2", "--long-worker", "http://h:3",
        "--worker-kv-events", "http://h:1=tcp://h:5557", "--policy", "prefix",
        "--long-prompt-tokens", "4000", "--model", "m", "--alias", "gpt", "--port", "9000"))
    (pool,) = cfg.pools
    assert [w.url for w in pool.workers] == ["http://h:1", "http://h:2", "http://h:3"]
    assert pool.workers[0].kv_events == "tcp://h:5557" and pool.workers[1].kv_events is None
    assert pool.workers[2].group == "long" and pool.long_prompt_tokens == 4000
    assert (pool.policy, pool.names, cfg.port) == ("prefix", ("m", "gpt"), 9000)


def test_config_file_yaml_and_flag_overrides(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("""
port: 8100
max_retries: 1
pools:
  - model: llama
    aliases: [gpt-4o]
    policy: session
    workers:
      - http://a:8001
      - {url: "http://b:8001", kv_events: "tcp://b:5557"}
""")
    cfg = load_config_file(path)
    assert cfg.port == 8100 and cfg.pools[0].workers[1].kv_events == "tcp://b:5557"
    cfg2 = config_from_args(parse("--config", str(path), "--port", "8200"))
    assert cfg2.port == 8200 and cfg2.max_retries == 1 and cfg2.pools == cfg.pools


def test_bad_config_is_rejected_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text('{"pools": [{"model": "m", "workerz": []}]}')
    with pytest.raises(InvalidRequestError) as err:
        load_config_file(path)
    assert err.value.param == "workerz"
    with pytest.raises(InvalidRequestError):
        WorkerSpec("ftp://x")
    with pytest.raises(InvalidRequestError):
        PoolConfig(workers=(WorkerSpec("http://a"), WorkerSpec("http://a/")))
    with pytest.raises(InvalidRequestError):
        config_from_args(parse("--worker", "http://a", "--worker-kv-events", "http://a"))


YAML_NUMBERS = {"nan": ".nan", "inf": ".inf"}


@pytest.mark.parametrize("value, message", [
    ("nan", "buffer_timeout_s must be a finite number, got nan"),
    ("inf", "buffer_timeout_s must be a finite number, got inf"),
    ("-1", "buffer_timeout_s must be >= 0, got -1"),
])
def test_buffer_timeout_is_checked_by_the_router_config(tmp_path: Path, value: str,
                                                        message: str) -> None:
    """RouterConfig itself refuses a NaN, infinite or negative buffer timeout (it took NaN:
    `sluice serve` checked its --buffer-timeout beside it), so `sluice router --config`
    refuses it as `sluice serve` does."""
    with pytest.raises(InvalidRequestError) as err:
        RouterConfig(buffer_timeout_s=float(value))
    assert err.value.param == "buffer_timeout_s" and err.value.message == message
    path = tmp_path / "r.yaml"
    path.write_text(f"buffer_timeout_s: {YAML_NUMBERS.get(value, value)}\n")
    with pytest.raises(InvalidRequestError) as err:
        load_config_file(path)
    assert err.value.message == message
    path.write_text("buffer_timeout_s: 2.5\n")
    assert config_from_args(parse("--config", str(path))).buffer_timeout_s == 2.5


async def test_sluice_router_process_routes_to_a_worker() -> None:
    stub = StubState("a")
    port = free_port()
    async with serve(make_stub(stub)) as worker_url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sluice.cli", "router", "--worker", worker_url,
            "--port", str(port), "--log-level", "warning",
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                for _ in range(150):
                    try:
                        if (await c.get("/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await asyncio.sleep(0.1)
                models = (await c.get("/v1/models")).json()
                assert [m["id"] for m in models["data"]] == ["stub-model"]  # discovered
                r = await c.post("/v1/chat/completions", json={
                    "model": "stub-model", "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200 and r.json()["worker"] == "a"
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)


def test_release_flags_add_canary_and_shadow_to_the_worker_pool() -> None:
    cfg = config_from_args(parse(
        "--worker", "http://h:1", "--canary-worker", "http://h:2", "--shadow-worker",
        "http://h:3", "--canary-weight", "10", "--canary-steps", "10,40,100",
        "--canary-window", "30", "--canary-min-samples", "20", "--no-canary-auto",
        "--pin-tenant", "acme=canary", "--shadow-percent", "5", "--shadow-max-concurrency",
        "3"))
    (pool,) = cfg.pools
    assert [(w.url, w.version) for w in pool.workers] == [
        ("http://h:1", "baseline"), ("http://h:2", "canary"), ("http://h:3", "shadow")]
    r = pool.release
    assert (r.canary_weight, r.steps, r.window_s, r.min_samples, r.auto) == (
        10, (10, 40, 100), 30, 20, False)
    assert (dict(r.pin_tenants), r.shadow_percent, r.shadow_max_concurrency) == (
        {"acme": "canary"}, 5, 3)
    with pytest.raises(InvalidRequestError) as err:
        config_from_args(parse("--worker", "http://h:1", "--pin-tenant", "acme"))
    assert err.value.param == "pin-tenant"
    with pytest.raises(InvalidRequestError) as err:
        config_from_args(parse("--worker", "http://h:1", "--canary-steps", "5,x"))
    assert err.value.param == "canary-steps"


def test_release_block_in_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("""
pools:
  - model: llama
    workers:
      - http://a:8001
      - {url: "http://b:8001", version: canary}
    release:
      canary_weight: 5
      steps: [5, 50, 100]
      pin_tenants: {acme: canary}
""")
    (pool,) = load_config_file(path).pools
    assert pool.workers[1].version == "canary" and pool.release.steps == (5, 50, 100)
    path.write_text('{"pools": [{"model": "m", "release": {"canary_wieght": 5}}]}')
    with pytest.raises(InvalidRequestError) as err:
        load_config_file(path)
    assert err.value.param == "canary_wieght"
