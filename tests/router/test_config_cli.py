"""Router config from files and flags, and `sluice router` as a real process."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from router_stubs import StubState, free_port, make_stub, serve

from sluice.cli import build_parser, main
from sluice.protocol.errors import InvalidRequestError
from sluice.router.cli import config_from_args
from sluice.router.config import (
    AdapterSpec,
    PoolConfig,
    RouterConfig,
    WorkerSpec,
    load_config_file,
)


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


def test_help_states_each_default_once_and_never_none(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """`sluice router --help` said "(default 127.0.0.1) (default: None)" for --host (and
    so for every flag whose default lives in RouterConfig), "(default: None)" for --seed
    (it is random), and "(default: True)" for --no-canary-auto (a switch, off)."""
    with pytest.raises(SystemExit):
        parse("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: [])" not in text
    assert "(default 127.0.0.1) --port" in text and "(default: True)" not in text
    assert "seed of the tie-breaking RNG (default: random)" in text
    assert "routing policy of the --worker pool (default: cost)" in text


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


def test_an_adapter_base_is_checked_against_the_pools_that_name_their_model() -> None:
    """A base is one of the pools' names (a model or a pool alias); a pool with no model
    serves what its workers list, and a config with no pools gets them from the flags:
    those are checked by the config that has them (above)."""
    sql = AdapterSpec("sql", "/adapters/sql", base="gpt-4o")
    named = PoolConfig(model="llama", aliases=("gpt-4o",))
    assert RouterConfig(pools=(named,), adapters=(sql,)).adapters == (sql,)
    assert RouterConfig(adapters=(sql,)).adapters == (sql,)
    assert RouterConfig(pools=(PoolConfig(model="qwen"), PoolConfig()),
                        adapters=(sql,)).adapters == (sql,)
    with pytest.raises(InvalidRequestError) as err:
        RouterConfig(pools=(PoolConfig(model="qwen"), PoolConfig(model="mistral")),
                     adapters=(AdapterSpec("free", "/adapters/free"), sql))
    assert err.value.param == "base"
    assert err.value.message == ("adapter 'sql': no pool serves its base model 'gpt-4o' "
                                 "(the pools serve mistral, qwen)")


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


@pytest.mark.parametrize("argv, text, message", [
    (["--config", "{dir}/missing.yaml"], None, "No such file or directory"),
    (["--config", "{dir}/r.yaml"], "[1, 2]\n", "the settings must be a mapping, got list"),
    (["--config", "{dir}/r.yaml"], "pools: [{workerz: []}\n", "r.yaml: while parsing"),
    (["--config", "{dir}/r.json"], "{bad", "r.json: Expecting property name"),
    (["--config", "{dir}/r.yaml"], "pools: 5\n", "r.yaml: 'int' object is not iterable"),
    (["--config", "{dir}/r.yaml"], "port: abc\n", "port must be an integer in 0..65535"),
    (["--config", "{dir}/r.yaml"], "buffer_timeout_s: .nan\n",
     "buffer_timeout_s must be a finite number, got nan"),
    (["--worker", "http://a:1", "--max-retries", "-1"], None, "max_retries must be >= 0"),
    (["--worker", "notaurl"], None, "worker url must start with http://"),
    (["--worker", "http://a:1", "--port", "70000"], None, "port must be an integer in 0..65535"),
    # aliases that lead back to themselves were accepted, and each request for one was
    # routed as the next until Python's recursion limit: a 500 (a new-user pass)
    (["--worker", "http://a:1", "--alias", "a=b", "--alias", "b=a"], None,
     "aliases form a cycle: a -> b -> a"),
    (["--config", "{dir}/r.yaml"],
     "aliases: {auto: {policy: cascade, small: auto, large: big}}\n",
     "aliases form a cycle: auto -> auto"),
    # an empty name was listed by /v1/models as ""; an empty target answered 400 "'model'
    # is required" to a request that had named one
    (["--worker", "http://a:1", "--alias", "=x"], None, "an alias needs a name and a target"),
    (["--worker", "http://a:1", "--alias", "c="], None, "an alias needs a name and a target"),
    # settings that were accepted and never used: a long worker with no threshold got
    # requests only when every short worker was down; the events of a URL that is no
    # worker were never read
    (["--worker", "http://a:1", "--long-worker", "http://b:1"], None,
     "worker http://b:1 is in group 'long', but the pool has no long_prompt_tokens"),
    (["--worker", "http://a:1", "--worker-kv-events", "http://b:1=tcp://127.0.0.1:5557"],
     None, "--worker-kv-events names no worker: http://b:1"),
    # a role in a pool that is not disaggregated was ignored: the prefill worker got
    # whole requests
    (["--config", "{dir}/r.yaml"],
     "pools: [{workers: [{url: 'http://a:1', role: prefill}, 'http://b:1']}]\n",
     "worker http://a:1 has role 'prefill', but the pool is not disaggregated"),
    # the conditional mode's tuning without a disaggregated pool was taken and never read
    (["--worker", "http://a:1", "--pd-min-uncached-tokens", "10"], None,
     "--pd-min-uncached-tokens needs a disaggregated pool"),
    (["--worker", "http://a:1", "--pd-max-prefill-wait-ratio", "2"], None,
     "--pd-max-prefill-wait-ratio needs a disaggregated pool"),
    # two endpoints for one worker: the last was taken, the first dropped unsaid
    (["--worker", "http://a:1", "--worker-kv-events", "http://a:1=tcp://127.0.0.1:5557",
      "--worker-kv-events", "http://a:1/=tcp://127.0.0.1:5558"], None,
     "--worker-kv-events gives http://a:1/ twice"),
    # an adapter's base that no pool serves (a typo) was accepted, and each request for
    # the adapter was a 404 naming the base
    (["--config", "{dir}/r.yaml"],
     "pools: [{model: llama, workers: ['http://a:1']}]\n"
     "adapters: [{name: sql, path: /adapters/sql, base: lama}]\n",
     "adapter 'sql': no pool serves its base model 'lama' (the pools serve llama)"),
    (["--config", "{dir}/r.yaml", "--worker", "http://a:1", "--model", "llama"],
     "adapters: [{name: sql, path: /adapters/sql, base: lama}]\n",
     "adapter 'sql': no pool serves its base model 'lama'"),
    # read after the others, each was a traceback and exit 1
    (["--worker", "http://a:1", "--metrics-buckets", "bogus"], None,
     "bad metrics bucket spec 'bogus'"),
    (["--worker", "http://a:1", "--tokenizer", "{dir}/none"], None, "none' not found"),
    (["--worker", "http://a:1", "--otlp-traces-endpoint", "notaurl"], None,
     "--otlp-traces-endpoint must be a URL"),
])
def test_a_bad_flag_or_config_file_exits_2_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], text: str | None,
        message: str) -> None:
    """`sluice router` with a bad flag value or config file: exit 2 and one line naming
    what is wrong, as argparse's errors (it was a traceback and exit 1)."""
    argv = [a.format(dir=tmp_path) for a in argv]
    if text is not None:
        Path(argv[1]).write_text(text)
    assert main(["router", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sluice router: error: ") and message in err, err
    assert "Traceback" not in err


def test_a_port_in_use_is_one_line_and_exit_2() -> None:
    """The router cannot listen (the port is taken): one line and exit 2 before anything
    starts (as serve and worker say it), not a traceback and the lifespan's 'shutdown
    failed' noise."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "sluice.cli", "router", "--worker", "http://127.0.0.1:1",
             "--port", str(port), "--log-level", "warning"],
            capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"sluice router: error: cannot listen on 127.0.0.1:{port}: "
                                  "Address already in use"), done.stderr
    assert "Traceback" not in done.stderr and "lifespan" not in done.stderr, done.stderr


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


def test_the_gateway_on_a_port_in_use_exits_2_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """As the router, `sluice serve` and `sluice worker` say it: the gateway exited 3 with
    uvicorn's bind error (found by the docs pass)."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["gateway", "--upstream", "http://127.0.0.1:9", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in err
