"""Workers SIGKILLed under streaming load through gateway + router: no client stream fails,
and the usage ledger holds exactly one row per request, with the tokens the client got.

A short run of `benchmarks/migration.py`'s migration phase (its own functions, loaded
from the file) on the tiny model: 3 real `sluice worker`s, `sluice serve`'s gateway
(dev key, SQLite ledger in a temporary SLUICE_HOME) over the router's server, 4 clients
streaming chat, completions and Responses (usage, token ids or both) for 8 s, a worker killed
at 3 s and at 6 s. The ledger is read through the store's query API after the server
stopped, and matched with the clients' requests by x-request-id.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from benchmark_module import load_benchmark
from sluice.control.local import LocalWorkerPool

WORKER_ARGS = ["--max-model-len", "1024", "--num-kv-blocks", "512", "--dtype", "float32"]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("migration", monkeypatch)


async def test_kills_under_streaming_load_fail_no_stream_and_lose_no_ledger_row(
        bench: ModuleType, tiny_llama_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    args = ["--model", str(tiny_llama_dir), "--served-model-name", "tiny", *WORKER_ARGS]
    with LocalWorkerPool(3, args, startup_timeout_s=150) as pool:
        cluster = bench.Cluster(pool, args, str(tiny_llama_dir),
                                f"sqlite:///{tmp_path / 'sluice.db'}")
        load = bench.Workload("tiny", seconds=8, kill_every_s=3, concurrency=4,
                              max_tokens=200)
        phase = await bench.run_phase(cluster, load, bench.Phase(0, limit=3))
    result = phase.summary()
    assert result["failed"] == 0, result["reasons"]
    assert result["kills"] == 2 and result["hit_streams"] > 0 and result["migrations"] >= 1
    assert result["chat"] > 0 and result["responses"] > 0
    assert result["requests"] - result["chat"] - result["responses"] > 0
    assert result["usage_records"] == result["requests"], result
    problems = ("lost", "duplicated", "token_mismatches", "prompt_mismatches", "rows_not_ok",
                "rows_without_request")
    assert {k: result[k] for k in problems} == dict.fromkeys(problems, 0), result["examples"]
