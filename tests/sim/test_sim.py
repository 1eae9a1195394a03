"""The simulator: production classes inside, determinism, cache and planner behaviour, CLI."""

from __future__ import annotations

import ast
import gc
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sluice.bench.load import LoadConfig
from sluice.bench.workloads import BlockSynthesizer, WorkloadConfig
from sluice.cli import main
from sluice.engine.block_manager import BlockManager
from sluice.engine.scheduler import Scheduler
from sluice.protocol.block_hash import hash_blocks
from sluice.protocol.errors import InvalidRequestError
from sluice.router.policies import POLICIES
from sluice.router.pool import Pool
from sluice.sim.cluster import SimConfig, Simulation
from sluice.sim.loop import EventLoop
from sluice.sim.planner import FixedPlanner, PoolObservation
from sluice.sim.profile import StepProfile
from sluice.sim.router import RouterSimConfig
from sluice.sim.workload import (
    KeyedSegment,
    SharedIdsSynthesizer,
    synthetic_sessions,
    trace_sessions,
    turn_prompt,
)

SIM_DIR = Path(__file__).resolve().parents[2] / "src" / "sluice" / "sim"
PROFILE = StepProfile(step_overhead_s=2e-3, s_per_token=2e-4, s_per_seq=1e-3, s_per_kpair=1e-6,
                      num_kv_blocks=4096)


def shared_prefix(n: int = 120, rate: float = 20.0, seed: int = 0) -> list[Any]:
    cfg = WorkloadConfig(seed=seed, input_len=64, output_len=16, num_groups=6,
                         system_prompt_len=512)
    return synthetic_sessions("shared-prefix", cfg, LoadConfig(request_rate=rate, seed=seed), n)


def config(policy: str, workers: int = 4, **kw: Any) -> SimConfig:
    return SimConfig(workers=workers, profile=kw.pop("profile", PROFILE),
                     router=RouterSimConfig(policy=policy, seed=kw.pop("seed", 0)), **kw)


def stable(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("wall_s", "events_per_s")}


# -- the production classes run inside ---------------------------------------------------

def test_workers_and_router_are_the_production_classes() -> None:
    sim = Simulation(config("kv"))
    sim.run(shared_prefix(20))
    assert sim.workers
    for worker in sim.workers.values():
        assert type(worker.scheduler) is Scheduler
        assert type(worker.block_manager) is BlockManager
        assert worker.scheduler.block_manager is worker.block_manager
    assert type(sim.router.pool) is Pool
    assert type(sim.router.pool.policy) is POLICIES["kv"]


def test_every_decision_and_step_goes_through_production_code(monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    calls = {"schedule": 0, "choose": 0}
    real_schedule, real_choose = Scheduler.schedule, POLICIES["cost"].choose

    def schedule(self: Scheduler) -> Any:
        calls["schedule"] += 1
        return real_schedule(self)

    def choose(self: Any, request: Any, endpoints: Any) -> Any:
        calls["choose"] += 1
        return real_choose(self, request, endpoints)

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    monkeypatch.setattr(POLICIES["cost"], "choose", choose)
    result = Simulation(config("cost")).run(shared_prefix(30))
    assert calls["choose"] == 30 == result.summary["completed"]
    assert calls["schedule"] >= result.summary["engine_steps"] > 0


def test_sim_package_reimplements_no_policy_or_scheduler() -> None:
    """No routing, scheduling or block-allocation logic of its own in sluice/sim/ (the one
    scheduler subclass, calibrate's recorder, calls the real schedule())."""
    banned = {"choose", "schedule", "_schedule_running", "_admit_waiting", "allocate",
              "can_allocate", "lookup", "cache_full_blocks", "match", "decide"}
    found = []
    for path in SIM_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in banned:
                body = ast.unparse(node)
                if "super()." + node.name not in body:
                    found.append(f"{path.name}:{node.name}")
    assert found == []


# -- determinism ---------------------------------------------------------------------------

def test_same_seed_same_result() -> None:
    a = Simulation(config("cost")).run(shared_prefix())
    b = Simulation(config("cost")).run(shared_prefix())
    assert stable(a.summary) == stable(b.summary)
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]


def test_a_run_leaves_the_collector_on_and_others_frozen_objects_frozen() -> None:
    """The run turns the cyclic GC off and back on (its survivors counted as old); a
    process's own frozen objects (`sluice router` freezes its startup) stay frozen."""
    sim = Simulation(config("cost"))
    sim.run(shared_prefix(5))
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        Simulation(config("cost")).run(shared_prefix(5))
        assert gc.isenabled() and 0 < gc.get_freeze_count() <= frozen  # (some died)
    finally:
        gc.unfreeze()


def test_another_seed_another_result() -> None:
    a = Simulation(config("cost")).run(shared_prefix(seed=0))
    b = Simulation(config("cost")).run(shared_prefix(seed=1))
    assert a.summary["mean_ttft_ms"] != b.summary["mean_ttft_ms"]


# -- behaviour -----------------------------------------------------------------------------

def test_prefix_aware_policies_beat_round_robin_on_hit_rate_and_stay_under_the_oracle() -> None:
    results = {p: Simulation(config(p)).run(shared_prefix()).summary
               for p in ("round_robin", "kv", "cost")}
    oracle = results["cost"]["oracle_prefix_cache_hit_rate"]
    for s in results.values():
        assert s["completed"] == 120 and s["failed"] == 0
        assert s["oracle_prefix_cache_hit_rate"] == oracle
        assert 0 < s["server_prefix_cache_hit_rate"] <= oracle + 1e-9
    rr = results["round_robin"]["server_prefix_cache_hit_rate"]
    assert results["kv"]["server_prefix_cache_hit_rate"] > rr
    assert results["cost"]["server_prefix_cache_hit_rate"] > rr
    assert results["cost"]["p90_ttft_ms"] < results["round_robin"]["p90_ttft_ms"]


def test_multi_turn_reuses_its_answers_within_the_oracle() -> None:
    """The next turn resends the answer: the engine hits it, and the oracle (which caches
    answers too) still bounds every policy."""
    cfg = WorkloadConfig(seed=0, input_len=100, output_len=40, num_turns=3)
    sessions = synthetic_sessions("multi-turn", cfg, LoadConfig(request_rate=2.0), 8)
    runs = {p: Simulation(config(p, workers=3)).run(sessions).summary
            for p in ("session", "round_robin")}
    for s in runs.values():
        assert s["completed"] == 24
        assert s["server_prefix_cache_hit_rate"] <= s["oracle_prefix_cache_hit_rate"]
    # one turn at a time per session: round robin sends each turn to the next worker
    assert runs["session"]["server_prefix_cache_hit_rate"] > 0.5
    assert runs["round_robin"]["server_prefix_cache_hit_rate"] == 0.0


def test_step_time_model_sets_latency() -> None:
    """One request alone on one worker: TTFT is one prefill step, TPOT one decode step."""
    cfg = WorkloadConfig(seed=0, input_len=100, output_len=5)
    sessions = synthetic_sessions("random", cfg, LoadConfig(), 1)
    s = Simulation(config("round_robin", workers=1)).run(sessions).summary
    prefill = PROFILE.step_overhead_s + 100 * PROFILE.s_per_token + PROFILE.s_per_seq \
        + PROFILE.s_per_kpair * 100 * 50.5 / 1000
    assert s["p50_ttft_ms"] == pytest.approx(prefill * 1000)
    decode_ctx = [101, 102, 103, 104]  # keys read by decodes 2..5 (start = ctx - 1)
    decodes = [PROFILE.step_overhead_s + PROFILE.s_per_token + PROFILE.s_per_seq
               + PROFILE.s_per_kpair * c / 1000 for c in decode_ctx]
    assert s["mean_tpot_ms"] == pytest.approx(sum(decodes) / 4 * 1000)


def test_host_contention_stretches_steps_only_while_another_worker_is_busy() -> None:
    """Two requests at once on two workers of one CPU host: each step takes (1 + c) x the
    model while both are busy; alone (one request) the model's time, contention or not."""
    cfg = WorkloadConfig(seed=0, input_len=100, output_len=5)
    two = synthetic_sessions("random", cfg, LoadConfig(), 2)
    shared = PROFILE.with_overrides(host_contention=1.0)
    alone = Simulation(config("round_robin", workers=1)).run(two[:1]).summary
    alone_shared = Simulation(config("round_robin", workers=1, profile=shared)).run(two[:1])
    assert stable(alone_shared.summary) | {"model": 0} == stable(alone) | {"model": 0}
    free = Simulation(config("round_robin", workers=2)).run(two).summary
    contended = Simulation(config("round_robin", workers=2, profile=shared)).run(two).summary
    # a step is stretched when it starts with the other worker busy: most are, but not
    # the first request's prefill nor the later one's last decodes (the other is done)
    for key in ("mean_tpot_ms", "p50_ttft_ms"):
        assert 1.4 * free[key] < contended[key] <= 2 * free[key] + 1e-9
    with pytest.raises(InvalidRequestError) as err:
        PROFILE.with_overrides(host_contention=-1.0)
    assert err.value.param == "host_contention"


def test_prompt_larger_than_the_kv_pool_fails_without_hanging() -> None:
    small = PROFILE.with_overrides(num_kv_blocks=8)
    cfg = WorkloadConfig(seed=0, input_len=400, output_len=4)
    sessions = synthetic_sessions("random", cfg, LoadConfig(), 3)
    s = Simulation(config("least_load", workers=1, profile=small)).run(sessions).summary
    assert s["failed"] == 3 and s["errors"] == {"kv_capacity": 3}


class StepUpPlanner:
    """Four workers from t = 1 s on."""

    def __init__(self) -> None:
        self.seen: list[PoolObservation] = []

    def desired_replicas(self, obs: PoolObservation) -> int:
        self.seen.append(obs)
        return 4 if obs.now >= 1.0 else 1


def test_planner_hook_scales_after_cold_start_and_counts_worker_hours() -> None:
    planner = StepUpPlanner()
    cfg = config("least_load", workers=1, planner_interval_s=1.0, cold_start_s=2.0)
    result = Simulation(cfg, planner).run(shared_prefix(200, rate=20.0))
    replicas = {p["t"]: p["replicas"] for p in result.summary["replicas_over_time"]}
    assert replicas[0.0] == 1 and replicas[1.0] == 1 and replicas[2.0] == 1
    assert replicas[3.0] == 4  # asked at 1 s, ready at 3 s
    assert planner.seen[1].starting == 0 and planner.seen[2].starting == 3
    end = result.duration
    assert result.summary["worker_hours"] == pytest.approx((end + 3 * (end - 1.0)) / 3600)
    assert len(result.summary["per_worker_requests"]) == 4


def test_fixed_planner_holds_the_pool() -> None:
    result = Simulation(config("cost", workers=3), FixedPlanner(3)).run(shared_prefix(30))
    assert {p["replicas"] for p in result.summary["replicas_over_time"]} == {3}
    assert result.summary["worker_hours"] == pytest.approx(3 * result.duration / 3600)


def test_config_errors_name_the_parameter() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        RouterSimConfig(policy="nope")
    assert exc.value.param == "policy"
    with pytest.raises(InvalidRequestError) as exc:
        SimConfig(workers=0)
    assert exc.value.param == "workers"


# -- the command ---------------------------------------------------------------------------

def _trace(path: Path, rows: int = 40) -> None:
    lines = []
    for i in range(rows):
        hashes = [0, 1, 2 + i % 3] + [100 + i]  # three shared prefixes, a unique tail
        lines.append(json.dumps({"timestamp": i * 50, "input_length": 4 * 512 - 100,
                                 "output_length": 8, "hash_ids": hashes}))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("block_size", [128, 64])
def test_trace_prompts_hash_the_same_with_their_block_keys(tmp_path: Path, block_size: int
                                                           ) -> None:
    """A trace row's keyed blocks are hashed once per (parent, key), with the trace: the
    same chained hashes as hashing every prompt's tokens, at the trace's block length; at
    any other block size the keys are not used."""
    trace = tmp_path / "t.jsonl"
    _trace(trace)
    built = trace_sessions(str(trace), WorkloadConfig(token_scale=0.25))
    sessions = [s for s, _ in built.timed()]
    profile = replace(PROFILE, block_size=block_size)
    sim = Simulation(SimConfig(workers=1, profile=profile,
                               router=RouterSimConfig(block_size=block_size)))
    for session in sessions:
        prompt = turn_prompt(session, 0, [])
        user = session.turns[0].user
        assert isinstance(user, KeyedSegment) and user.block_len == 128
        assert sim._prompt_hashes(prompt, user) == tuple(hash_blocks(prompt, block_size))
    # blocks 0, 1 and 2 + i % 3 are shared: 3 keyed blocks of 128 tokens per row (the
    # fourth is cut), 2 + 3 distinct (parent, key) pairs
    assert len(built.hashes) == 5


def test_cli_trace_compare_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    trace, out, png = tmp_path / "t.jsonl", tmp_path / "out.json", tmp_path / "p.png"
    _trace(trace)
    rc = main(["sim", "--trace", str(trace), "--workers", "3", "--policy", "cost",
               "--compare", "kv,round_robin", "--slo", "ttft=2s,tpot=100ms", "--token-scale",
               "0.25", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(lines[-1])
    assert [r["base_url"] for r in doc["results"]] == ["sim:cost", "sim:kv", "sim:round_robin"]
    assert all(r["completed"] == 40 and r["goodput"] is not None for r in doc["results"])
    assert any("Simulation Result" in line for line in lines)
    assert len(json.loads(out.read_text())["results"][0]["requests"]) == 40
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--num-prompts", "2", "--compare", "bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_cli_loads_a_profile_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"name": "slow", "s_per_token": 0.01, "step_overhead_s": 0.0,
                                "s_per_seq": 0.0, "s_per_kpair": 0.0}))
    assert main(["sim", "--num-prompts", "1", "--input-len", "50", "--output-len", "1",
                 "--workers", "1", "--profile", str(prof)]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["results"][0]["p50_ttft_ms"] == pytest.approx(500.0)
    assert math.isclose(doc["config"]["profile"]["s_per_token"], 0.01)


def test_cli_speedup_divides_the_profiles_step_times(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"name": "slow", "s_per_token": 0.01, "step_overhead_s": 0.0,
                                "s_per_seq": 0.0, "s_per_kpair": 0.0}))
    assert main(["sim", "--num-prompts", "1", "--input-len", "50", "--output-len", "1",
                 "--workers", "1", "--profile", str(prof), "--speedup", "10"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["results"][0]["p50_ttft_ms"] == pytest.approx(50.0)
    assert main(["sim", "--num-prompts", "1", "--speedup", "0"]) == 2
    assert "--speedup" in capsys.readouterr().err


def test_same_seed_same_result_across_processes(tmp_path: Path) -> None:
    """Nothing depends on Python's per-process string hashing (set order, hash())."""
    import os
    import subprocess
    import sys

    def run(hash_seed: str) -> dict[str, Any]:
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "SLUICE_HOME": str(tmp_path),
               "PYTHONPATH": str(SIM_DIR.parents[1])}
        out = subprocess.run(
            [sys.executable, "-m", "sluice.cli", "sim", "--workload", "shared-prefix",
             "--num-prompts", "60", "--request-rate", "8", "--workers", "4", "--policy", "kv",
             "--compare", "cost"], env=env, capture_output=True, text=True, check=True).stdout
        doc = json.loads(out.strip().splitlines()[-1])
        for r in doc["results"]:
            r.pop("wall_s"), r.pop("events_per_s")
        return doc

    assert run("1") == run("2")


# -- speed devices that must not change a run ---------------------------------------------

def test_at_each_runs_as_the_same_at_calls() -> None:
    """Arrivals fed to the heap one at a time run in the order (and with the tie-breaks)
    they would have had scheduled all up front."""
    def trace(feed: bool) -> list[tuple[float, str]]:
        loop, seen = EventLoop(), []

        def arrive(name: str) -> None:
            seen.append((loop.now, name))
            loop.after(0.0, lambda: seen.append((loop.now, name + "'")))

        timed = [(2.0, "a"), (1.0, "b"), (1.0, "c"), (-1.0, "d"), (2.0, "e")]
        if feed:
            loop.at_each(arrive, timed)
        else:
            for when, name in timed:
                loop.at(when, arrive, name)
        loop.at(1.0, lambda: seen.append((loop.now, "tick")))
        loop.run()
        return seen

    assert trace(feed=True) == trace(feed=False)


def test_events_run_in_time_then_scheduling_order() -> None:
    """`after` keeps its latest event out of the heap; events still run by (time, the
    order they were scheduled in), `run(until)` stops before later ones and counts them
    as pending, and every event run is counted."""
    loop, seen = EventLoop(), []

    def step(name: str, left: int, delay: float) -> None:
        seen.append((loop.now, name))
        if left:
            loop.after(delay, start, (name, left - 1, delay))

    def start(args: tuple[str, int, float]) -> None:
        step(*args)

    loop.at(0.0, start, ("a", 3, 1.0))
    loop.at(0.0, start, ("b", 2, 1.0))  # the same times as a's: after a's, each time
    loop.at(0.5, start, ("c", 1, 2.0))
    loop.run(until=1.0)
    assert seen == [(0.0, "a"), (0.0, "b"), (0.5, "c"), (1.0, "a"), (1.0, "b")]
    assert len(loop) == 3 and loop.now == 1.0
    loop.run()
    assert seen[5:] == [(2.0, "a"), (2.0, "b"), (2.5, "c"), (3.0, "a")]
    assert loop.events_run == 9 and len(loop) == 0


def test_shared_ids_synthesizer_makes_the_same_blocks() -> None:
    plain = BlockSynthesizer(32_000, 64, 500, seed=3)
    shared = SharedIdsSynthesizer(32_000, 64, 500, seed=3)
    for h in (0, 7, 499, 7):
        assert shared.block(h) == plain.block(h)
    assert all(x is shared._ids[x] for x in shared.block(11))  # one int object per id
