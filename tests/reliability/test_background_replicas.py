"""Background responses across gateway replicas: two real `sluice serve` processes on
one SQLite database in front of a worker of their own (a context of 2,048 tokens, so
that a run lasts seconds on the tiny model). A run on one replica is cancelled
through the other; a replica SIGKILLed while it runs one leaves it to the other, whose
sweep ends it `failed` once its lease lapses (`--background-lease`), with nobody reading
it, and writes the ledger row the killed replica did not (where before it answered
`in_progress` for good, and had no row)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from sluice.gateway.store import SQLStore, UsageQuery, UsageRecord

from .conftest import ADMIN_KEY, Process, start, stop, wait_healthy

LEASE_S = 2.0


def replica(name: str, worker: Process, model_dir: Path, home: Path) -> Process:
    return start(name, ["serve", "--backend", "external", "--worker-url", worker.url,
                        "--model", str(model_dir), "--admin-key", ADMIN_KEY,
                        "--background-lease", str(LEASE_S), "--log-level", "warning"], home)


def status_of(c: httpx.Client, response_id: str) -> dict[str, Any]:
    r = c.get(f"/v1/responses/{response_id}")
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def until(c: httpx.Client, response_id: str, leaves: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (got := status_of(c, response_id))["status"] == leaves:
        assert time.monotonic() < deadline, f"{response_id} still {leaves}"
        time.sleep(0.1)
    return got


def rows_of(ledger: SQLStore, response_id: str) -> list[UsageRecord]:
    """The ledger rows of a background run (their record id is its response's)."""
    return [r for r in ledger.query_usage(UsageQuery()) if r.record_id == response_id]


def swept(ledger: SQLStore, response_id: str, timeout: float) -> UsageRecord:
    """The one ledger row of a run nobody reads, once a sweep has ended it."""
    deadline = time.monotonic() + timeout
    while not (rows := rows_of(ledger, response_id)):
        assert time.monotonic() < deadline, f"{response_id} has no ledger row"
        time.sleep(0.1)
    [row] = rows
    return row


def test_a_killed_replicas_background_response_is_ended_by_the_other(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    worker = start("worker-2k", ["worker", "--model", str(tiny_llama_dir), "--max-model-len",
                                 "2048", "--num-kv-blocks", "256", "--log-level", "warning"],
                   tmp_path)
    started = [worker]
    try:
        wait_healthy(worker, 120)
        a = replica("serve-a", worker, tiny_llama_dir, tmp_path)
        started.append(a)
        wait_healthy(a, 60)
        b = replica("serve-b", worker, tiny_llama_dir, tmp_path)
        started.append(b)
        wait_healthy(b, 60)
        model = httpx.get(worker.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        headers = {"Authorization": f"Bearer {(tmp_path / 'dev-key').read_text().strip()}"}
        body = {"model": model, "input": "Count to ten.", "temperature": 0,
                "max_output_tokens": 1900, "background": True}
        with httpx.Client(base_url=a.url, headers=headers, timeout=30) as on_a, \
                httpx.Client(base_url=b.url, headers=headers, timeout=30) as on_b, \
                contextlib.closing(SQLStore(f"sqlite:///{tmp_path / 'sluice.db'}")) as ledger:
            # a run on A, cancelled through B
            first = on_a.post("/v1/responses", json=body).json()
            until(on_a, first["id"], "queued", 30)
            r = on_b.post(f"/v1/responses/{first['id']}/cancel")
            assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
            assert status_of(on_a, first["id"])["status"] == "cancelled"

            # a run on A, A killed while it runs: B's sweep ends it once its lease
            # lapses (nobody reads it meanwhile), and writes its ledger row
            second = on_a.post("/v1/responses", json=body).json()
            assert until(on_a, second["id"], "queued", 30)["status"] == "in_progress"
            os.kill(a.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            a.proc.wait(10)
            row = swept(ledger, second["id"], 2 * LEASE_S + 10)  # (a sweep every lease)
            assert time.monotonic() - killed > LEASE_S / 2  # (not ended while renewed)
            failed = status_of(on_b, second["id"])
            assert failed["status"] == "failed", failed
            assert "stopped before it ended" in failed["error"]["message"]
            assert b.healthy()
            [cancelled] = rows_of(ledger, first["id"])  # A's own row, under the same kind
            assert (cancelled.status, row.status) == ("aborted", "error")  # of record id
            assert row.prompt_tokens == cancelled.prompt_tokens > 0  # counted at admission
            assert row.completion_tokens >= 0 and row.endpoint == "/v1/responses"
            assert rows_of(ledger, second["id"]) == [row]  # (once)
    finally:
        for process in reversed(started):
            if process.alive():
                stop(process)
