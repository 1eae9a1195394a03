"""The production planner in the simulator, and the daily-shaped trace."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.bench.load import LoadConfig
from sluice.bench.workloads import WorkloadConfig
from sluice.cli import main
from sluice.control.planner import SLO, Planner, PlannerConfig, PoolSignals
from sluice.control.signals import histogram_quantile
from sluice.sim.cluster import SimConfig, Simulation
from sluice.sim.planner import ControlPlanner, PoolObservation, WorkerLatency, make_planner
from sluice.sim.profile import StepProfile
from sluice.sim.router import RouterSimConfig
from sluice.sim.workload import DailyShape, synthetic_sessions, trace_sessions

# a 200-token prefill takes ~0.2 s, a decode step ~5 ms
PROFILE = StepProfile(step_overhead_s=4e-3, s_per_token=1e-3, s_per_seq=1e-3, s_per_kpair=0.0,
                      num_kv_blocks=4096)


def burst_then_trickle(burst: int = 40, burst_s: float = 2.0, trickle_every: float = 5.0,
                       until: float = 240.0) -> list[Any]:
    """`burst` requests spread over `burst_s`, then one every `trickle_every` s."""
    times = [i * burst_s / burst for i in range(burst)]
    times += list(np.arange(burst_s + trickle_every, until, trickle_every))
    cfg = WorkloadConfig(seed=0, input_len=200, output_len=20)
    sessions = synthetic_sessions("random", cfg, LoadConfig(), len(times))
    return [(s, float(t)) for (s, _), t in zip(sessions, times, strict=True)]


def autoscaled(max_workers: int = 4, cold_start_s: float = 2.0) -> tuple[Simulation, Any]:
    planning = PlannerConfig(min_replicas=1, max_replicas=max_workers,
                             slo=SLO(ttft_s=1.0, itl_s=0.2), history=1000)
    cfg = SimConfig(workers=1, profile=PROFILE, router=RouterSimConfig(policy="least_load"),
                    cold_start_s=cold_start_s, slos={"ttft": 1.0, "tpot": 0.2})
    sim = Simulation(cfg, make_planner("slo", 1, planning))
    return sim, sim.run(burst_then_trickle())


def test_the_production_planner_drives_the_simulated_pool() -> None:
    sim, result = autoscaled()
    assert isinstance(sim.planner, ControlPlanner) and type(sim.planner.planner) is Planner
    ticks = result.summary["replicas_over_time"]
    assert len(sim.planner.planner.decisions) == len(ticks)  # one decide() per tick
    serving = [(p["t"], p["replicas"]) for p in ticks]
    changes = [(t, n) for (_, m), (t, n) in zip(serving, serving[1:], strict=False) if n != m]
    # The burst is over the SLO from the tick at 1 s: after the 5 s up delay, one more
    # worker per decision (6 s, 7 s; recommended up to 4, but the burst is served by
    # 10 s), each serving after its 2 s cold start. Below 0.6 x SLO from 10 s on: after
    # the 60 s down delay, one fewer (least in flight, then oldest url), and the delay
    # starts again: the next one leaves 61 s later.
    assert changes == [(8.0, 2), (9.0, 3), (70.0, 2), (131.0, 1)]
    assert [(p["t"], p["starting"]) for p in ticks if p["starting"]] == [(6.0, 1), (7.0, 2),
                                                                      (8.0, 1)]
    assert result.summary["scale_events"] == 4
    assert result.summary["worker_seconds"] == pytest.approx(70 + (131 - 6) + result.duration - 7)
    assert result.summary["failed"] == 0


class Schedule:
    """Answers from a timetable: {from_t: count}."""

    def __init__(self, table: dict[float, int]) -> None:
        self.table = table

    def desired_replicas(self, obs: PoolObservation) -> int:
        return self.table[max(t for t in self.table if t <= obs.now)]


def test_resizing_starts_cancels_and_drains_as_the_controller_reconciles() -> None:
    cfg = SimConfig(workers=2, profile=PROFILE, router=RouterSimConfig(policy="least_load"),
                    cold_start_s=3.0)
    # 2 -> 4 at 1 s (2 start); 4 -> 3 at 2 s (the newest starting one is cancelled);
    # 3 -> 4 at 6 s (one starts, none drains); 4 -> 1 at 10 s (the idle serving workers
    # drain, lowest url first)
    sim = Simulation(cfg, Schedule({0.0: 2, 1.0: 4, 2.0: 3, 6.0: 4, 10.0: 1}))
    result = sim.run(burst_then_trickle(burst=4, until=30.0))
    ticks = {p["t"]: (p["replicas"], p["starting"], p["draining"])
             for p in result.summary["replicas_over_time"]}
    assert [ticks[t] for t in (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0, 10.0, 11.0)] == [
        (2, 0, 0), (2, 2, 0), (2, 1, 0), (2, 1, 0), (3, 0, 0), (3, 1, 0), (3, 1, 0),
        (4, 0, 0), (1, 0, 0), (1, 0, 0)]
    assert result.summary["scale_events"] == 4
    end = pytest.approx(result.duration)
    assert sim.lifetimes == {"http://sim-worker-00000": [0.0, 10.0],
                             "http://sim-worker-00001": [0.0, 10.0],
                             "http://sim-worker-00002": [1.0, 10.0],
                             "http://sim-worker-00003": [1.0, 2.0],  # cancelled
                             "http://sim-worker-00004": [6.0, end]}


def test_worker_latency_is_the_cumulative_histogram_a_worker_exports() -> None:
    lat = WorkerLatency(bounds=(0.1, 0.5, 1.0))
    for seconds in (0.05, 0.1, 0.3, 0.7, 2.0):
        lat.observe_ttft(seconds)
    lat.observe_itl(0.02)
    lat.observe_itl(0.04)
    snap = lat.snapshot()
    assert snap.ttft_buckets == ((0.1, 2.0), (0.5, 3.0), (1.0, 4.0), (math.inf, 5.0))
    assert (snap.itl_sum, snap.itl_count) == (pytest.approx(0.06), 2.0)
    assert histogram_quantile(0.5, snap.ttft_buckets) == pytest.approx(0.3)


class Recorder:
    """A fixed pool that reads the production planner's signals at every tick."""

    def __init__(self) -> None:
        self.seen: list[tuple[PoolObservation, PoolSignals]] = []

    def desired_replicas(self, obs: PoolObservation) -> int:
        self.seen.append((obs, obs.signals))
        return 2


def test_signals_are_the_pools_and_the_workers_latencies() -> None:
    rec = Recorder()
    cfg = SimConfig(workers=2, profile=PROFILE, router=RouterSimConfig(policy="least_load"))
    result = Simulation(cfg, rec).run(burst_then_trickle(until=20.0))
    s = next(sig for obs, sig in rec.seen if obs.now == 1.0)
    assert (s.ready, s.starting, s.queued) == (2, 0, 0)
    assert s.inflight == 20  # 20 of the burst sent by 1 s, none finished yet
    assert s.ttft_p90_s is not None and s.seconds_per_token > 0
    last, later = rec.seen[-1]  # the 30 s window holds every request of the run so far
    served = WorkerLatency()
    gaps = []
    for r in result.records:  # no request overhead: the worker's times are the client's
        times = [t for t in r.token_times if t <= last.now]
        if times:
            served.observe_ttft(times[0] - r.start)
            gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    assert later.ttft_p90_s == pytest.approx(histogram_quantile(0.9, served.snapshot()
                                                                .ttft_buckets))
    assert later.itl_s == pytest.approx(sum(gaps) / len(gaps))


# -- the daily shape ------------------------------------------------------------------------

def test_daily_shape_rates() -> None:
    shape = DailyShape(duration_s=1000.0, trough_ratio=0.25)
    assert shape.relative_rate(0.0) == pytest.approx(0.4)
    assert shape.relative_rate(500.0) == pytest.approx(1.6)
    assert shape.relative_rate(0.0) / shape.relative_rate(500.0) == pytest.approx(0.25)
    t = np.array([0.0, 250.0, 500.0, 750.0, 1000.0])
    assert shape.demand(t) == pytest.approx([0.0, 0.25 - 0.6 / (2 * math.pi), 0.5,
                                             0.75 + 0.6 / (2 * math.pi), 1.0])
    assert shape.times(shape.demand(t)) == pytest.approx(t, abs=1e-3)


def _uniform_trace(path: Path, rows: int) -> None:
    path.write_text("".join(json.dumps({"timestamp": i * 10, "input_length": 100 + i % 7,
                                        "output_length": 1 + i % 5, "hash_ids": [i % 3, i]})
                            + "\n" for i in range(rows)))


def test_a_trace_reshaped_to_a_day_keeps_its_rows_and_follows_the_rate(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _uniform_trace(path, 4001)
    shape = DailyShape(duration_s=600.0, trough_ratio=0.25)
    wl = WorkloadConfig(token_scale=1 / 32)
    day = trace_sessions(str(path), wl, shape=shape)
    own = trace_sessions(str(path), wl)
    times = day.arrivals
    assert times[0] == 0.0 and times[-1] == pytest.approx(600.0)
    assert np.all(np.diff(times) >= 0)
    counts, _ = np.histogram(times, bins=np.arange(0.0, 601.0, 60.0))
    expected = [4001 * (shape.demand(np.array(b + 60.0)) - shape.demand(np.array(b)))
                for b in np.arange(0.0, 600.0, 60.0)]
    assert counts == pytest.approx(expected, abs=1.5)
    peak = counts[4:6].sum() / 120.0  # around 300 s
    trough = (counts[0] + counts[-1]) / 120.0
    assert 3.2 < peak / trough < 4.0  # 1:4 at the instants, a bit less over 60 s bins
    for i in (0, 1234, 4000):
        (a, _), (b, _) = day.session(i), own.session(i)
        assert a.turns == b.turns  # same prompt ids (hash ids) and output length


# -- the command ---------------------------------------------------------------------------

def test_cli_slo_planner_on_a_daily_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    path, out = tmp_path / "t.jsonl", tmp_path / "out.json"
    _uniform_trace(path, 300)
    rc = main(["sim", "--trace", str(path), "--rate-shape", "daily", "--duration", "120",
               "--planner", "slo", "--min-workers", "1", "--max-workers", "3",
               "--slo", "ttft=2s,itl=200ms", "--cold-start", "5", "--json", str(out)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["config"]["planner"] == "slo"
    assert doc["config"]["planner_config"]["slo"] == {"ttft_s": 2.0, "itl_s": 0.2}
    assert doc["config"]["cold_start_s"] == 5.0
    r = doc["results"][0]
    assert r["completed"] == 300 and r["slos_ms"] == {"ttft": 2000.0, "tpot": 200.0}
    assert r["goodput_per_worker_s"] == pytest.approx(r["good_requests"] / r["worker_seconds"])
    assert r["scale_events"] >= 0


@pytest.mark.parametrize(("argv", "param"), [
    (["--planner", "fixed", "--min-workers", "1"], "--planner"),
    (["--planner", "slo", "--min-workers", "1"], "--max-workers"),
    (["--planner", "slo", "--min-workers", "0", "--max-workers", "2"], "--min-workers must be >= 1"),
    (["--planner", "bogus"], "bogus"),
    (["--rate-shape", "daily"], "--duration"),
    (["--duration", "60"], "--rate-shape daily"),
    (["--slo", "itl=1s,tpot=1s"], "itl or tpot"),
    # the planner's own checks, with the flag in place of its field
    (["--planner", "slo", "--min-workers", "3", "--max-workers", "2"],
     "--min-workers must be <= --max-workers (2), got 3"),
    (["--planner", "slo", "--min-workers", "1", "--max-workers", "2", "--scale-down-delay",
      "-1"], "--scale-down-delay must be >= 0, got -1"),
    (["--planner", "queue", "--min-workers", "1", "--max-workers", "2", "--lookahead", "nan"],
     "--lookahead must be a finite number, got nan"),
    (["--planner", "queue", "--min-workers", "1", "--max-workers", "2",
      "--target-ongoing-requests", "inf"], "--target-ongoing-requests must be a finite number"),
])
def test_cli_errors_name_the_flag(argv: list[str], param: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--num-prompts", "2", *argv]) == 2
    assert param in capsys.readouterr().err
