"""`sluice sim calibrate`: time the real engine's steps on this machine, fit the profile.

The engine is the production `EngineCore` on the default model (or `--model`), prefix
caching off so every repeat computes its prompt. Its scheduler is the production one,
subclassed only to remember what each step ran; every timed `core.step()` (schedule,
forward, sample, postprocess) becomes one `(chunks, seconds)` point:

    prefill points   one request of n tokens, max_tokens 1      n in 32 .. 2048
    decode points    B requests of L-token prompts, then decode B in 1 .. 32, L in 128, 1024
                     steps (their prefill steps count as points too)

`sluice.sim.profile.fit_profile` fits the step-time model to the fastest point of each
step shape (non-negative least squares, relative error); the engine's block size, KV pool and scheduler limits
are written with it. The table printed compares each point with the fitted model.

`--from-steps DIR` fits the same model to the steps real workers logged while serving
(`--step-log DIR`, sluice.engine.step_log), each shape's mean instead of its fastest.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from sluice.engine.scheduler import ScheduledChunk, Scheduler
from sluice.protocol.errors import InvalidRequestError
from sluice.sim.profile import StepProfile, fit_profile, save_profile

Point = tuple[list[tuple[int, int]], float]


class RecordingScheduler(Scheduler):
    """The production scheduler; remembers the chunks of its last `schedule()`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last: list[ScheduledChunk] = []

    def schedule(self) -> list[ScheduledChunk]:
        self.last = super().schedule()
        return self.last


def _plan(quick: bool) -> tuple[list[int], list[tuple[int, int]]]:
    if quick:
        return [64, 512], [(1, 128), (8, 128)]
    prefills = [32, 128, 256, 512, 1024, 2048]
    decodes = [(b, ctx) for ctx in (128, 1024) for b in (1, 4, 16, 32)]
    return prefills, decodes


class Calibrator:
    """Drives one `EngineCore` through the plan, timing every step."""

    def __init__(self, model: str | None, num_kv_blocks: int | None,
                 cpu_threads: int | None = None) -> None:
        from sluice.engine.config import EngineConfig
        from sluice.engine.core import EngineCore

        options: dict[str, Any] = {"enable_prefix_caching": False}
        if num_kv_blocks is not None:
            options["num_kv_blocks"] = num_kv_blocks
        if cpu_threads is not None:
            options["cpu_threads"] = cpu_threads
        self.config = EngineConfig.from_options(model, **options)
        self.core = EngineCore(self.config)
        self.scheduler = RecordingScheduler(self.config.scheduler, self.core.block_manager)
        self.core.scheduler = self.scheduler
        self.rng = random.Random(0)
        self.points: list[Point] = []
        self._next = 0

    def _add(self, n_prompt: int, max_tokens: int) -> None:
        from sluice.engine.messages import CoreRequest
        from sluice.engine.sampling_params import SamplingParams

        self._next += 1
        vocab = self.core.info.vocab_size
        ids = [self.rng.randrange(10, vocab - 10) for _ in range(n_prompt)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.core.add(CoreRequest(f"cal-{self._next}", ids, params, max_tokens=max_tokens))

    def _drain(self, record: bool) -> None:
        while self.core.has_work():
            start = time.perf_counter()
            self.core.step()
            seconds = time.perf_counter() - start
            if record and self.scheduler.last:
                self.points.append(([(c.start_pos, c.num_tokens) for c in self.scheduler.last],
                                    seconds))

    def warm_up(self) -> None:
        self._add(64, 4)
        self._drain(record=False)

    def prefill(self, n: int, repeats: int) -> None:
        for _ in range(repeats):
            self._add(n, 1)
            self._drain(record=True)

    def decode(self, batch: int, ctx: int, steps: int) -> None:
        for _ in range(batch):
            self._add(ctx, steps)
        self._drain(record=True)


def calibrate(model: str | None, quick: bool, repeats: int, num_kv_blocks: int | None,
              cpu_threads: int | None = None) -> tuple[StepProfile, list[Point]]:
    cal = Calibrator(model, num_kv_blocks, cpu_threads)
    cal.warm_up()
    prefills, decodes = _plan(quick)
    for n in prefills:
        cal.prefill(n, repeats)
        print(f"  prefill {n}: done", file=sys.stderr)
    for batch, ctx in decodes:
        cal.decode(batch, ctx, steps=4 * repeats)
        print(f"  decode batch {batch} ctx {ctx}: done", file=sys.stderr)
    sched, bm = cal.config.scheduler, cal.core.block_manager
    base = StepProfile(block_size=bm.block_size, num_kv_blocks=bm.num_blocks,
                       max_num_seqs=sched.max_num_seqs,
                       max_num_batched_tokens=sched.max_num_batched_tokens)
    source = (f"sluice sim calibrate on {_cpu()}, {len(cal.points)} steps, "
              f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    profile = fit_profile(base, fastest_per_shape(cal.points),
                          f"{cal.core.info.model_name}@{_host()}", source)
    return profile, cal.points


def _shape(chunks: list[tuple[int, int]]) -> tuple[int, int, int]:
    """Steps of one shape: sequences, new tokens, longest context (to 64 tokens)."""
    return (len(chunks), sum(n for _, n in chunks), max(s + n for s, n in chunks) // 64 * 64)


def fastest_per_shape(points: list[Point]) -> list[Point]:
    """The fastest step of each shape. On a shared machine other processes only ever add
    time (a step waits for a core), so the minimum of the repeats is the engine's own
    cost, as `timeit` takes it; a mean or a fit through all points chases the noise."""
    best: dict[tuple[int, int, int], Point] = {}
    for chunks, seconds in points:
        key = _shape(chunks)
        if key not in best or seconds < best[key][1]:
            best[key] = (chunks, seconds)
    return list(best.values())


def mean_per_shape(points: list[Point]) -> list[Point]:
    """Each shape's mean step: for steps logged while serving (`--from-steps`), where the
    time what else runs on the host takes is part of what a request sees, not noise to
    reject (served steps' means run 4-6% above their medians on a shared 2-core host)."""
    groups: dict[tuple[int, int, int], list[Point]] = {}
    for point in points:
        groups.setdefault(_shape(point[0]), []).append(point)
    return [(group[0][0], statistics.fmean(s for _, s in group)) for group in groups.values()]


def from_steps(paths: list[str]) -> tuple[StepProfile, list[Point]]:
    """A profile fitted to the steps real engines logged while serving (`--step-log`)."""
    from sluice.engine.step_log import read_step_logs

    header, points = read_step_logs(paths)
    base = StepProfile(block_size=int(header["block_size"]),
                       num_kv_blocks=int(header["num_kv_blocks"]),
                       max_num_seqs=int(header["max_num_seqs"]),
                       max_num_batched_tokens=int(header["max_num_batched_tokens"]))
    source = (f"sluice sim calibrate --from-steps on {_cpu()}, {len(points)} served steps, "
              f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    profile = fit_profile(base, mean_per_shape(points), f"{header['model']}@{_host()}",
                          source)
    return profile, points


def workers_metrics(urls: list[str]) -> dict[str, float]:
    """The workers' /metrics, each metric summed over them (`sum_samples`): what
    `outside_engine_s` reads before and after a run (the router does not re-export the
    engines' histograms)."""
    import httpx

    from sluice.observe.prometheus import sum_samples

    total: dict[str, float] = {}
    for url in urls:
        for key, value in sum_samples(httpx.get(url + "/metrics", timeout=10).text).items():
            total[key] = total.get(key, 0.0) + value
    return total


def outside_engine_s(client_ttft_s: float, before: dict[str, float],
                     after: dict[str, float]) -> float:
    """Seconds of a request's TTFT spent outside the engines (HTTP, router, tokenizing,
    IPC, detokenizing), the profile's `request_overhead_s`: the clients' TTFT (their mean,
    or their median where a few slow requests should not set every request's overhead)
    less the engines' own mean queue + prefill time, from their /metrics summed over the
    workers (`workers_metrics`) before and after the run."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    count = delta("vllm:request_queue_time_seconds_count")
    inside = (delta("vllm:request_queue_time_seconds_sum")
              + delta("vllm:request_prefill_time_seconds_sum"))
    return client_ttft_s - inside / count if count else 0.0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _host() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def fit_report(profile: StepProfile, points: list[Point],
               typical: str = "fastest") -> tuple[str, float]:
    """A table of measured vs fitted step times (grouped by shape) and the median error
    against each shape's `typical` step ("fastest" or "mean", what the fit used)."""
    from sluice.sim.profile import chunk_features

    groups: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
    for chunks, seconds in points:
        pred = sum(c * f for c, f in zip(profile.coefficients, chunk_features(chunks),
                                          strict=True))
        groups.setdefault(_shape(chunks), []).append((seconds, pred))
    lines = [f"{'seqs':>5} {'tokens':>7} {'ctx~':>6} {'n':>4} {typical + ' ms':>11} "
             f"{'median ms':>10} {'model ms':>9} {'error':>7}"]
    errors = []
    for (seqs, tokens, ctx), vals in sorted(groups.items()):
        median = statistics.median(v for v, _ in vals)
        meas = statistics.fmean(v for v, _ in vals) if typical == "mean" \
            else min(v for v, _ in vals)
        pred = statistics.median(p for _, p in vals)
        errors.append(abs(pred - meas) / meas)
        lines.append(f"{seqs:5d} {tokens:7d} {ctx:6d} {len(vals):4d} {meas * 1e3:11.2f} "
                     f"{median * 1e3:10.2f} {pred * 1e3:9.2f} {100 * (pred - meas) / meas:6.1f}%")
    return "\n".join(lines), statistics.median(errors) if errors else 0.0


def calibrate_from_args(args: argparse.Namespace, out: str) -> int:
    if not Path(out).resolve().parent.is_dir():  # before minutes of timing, not after
        raise InvalidRequestError(f"cannot write the profile to {out}: no such directory",
                                  param="out")
    if args.from_steps:
        timing = [f for f in ("model", "quick", "num_kv_blocks", "cpu_threads")
                  if getattr(args, f) not in (None, False)]
        if timing:
            raise InvalidRequestError(f"--{timing[0].replace('_', '-')} sets up an engine to "
                                      "time; --from-steps fits steps already logged",
                                      param=timing[0])
        profile, points = from_steps(args.from_steps)
        typical = "mean"
    else:
        profile, points = calibrate(args.model, args.quick, max(1, args.repeats),
                                    args.num_kv_blocks, args.cpu_threads)
        typical = "fastest"
    text, err = fit_report(profile, points, typical)
    print(text)
    print(f"median |error| (model vs {typical}) over shapes: {100 * err:.1f}%")
    try:
        save_profile(profile, out)
    except OSError as exc:
        raise InvalidRequestError(f"cannot write the profile to {out}: {exc}", param="out") from exc
    print(f"wrote {out}: " + ", ".join(f"{k}={getattr(profile, k):.3g}" for k in
                                        ("step_overhead_s", "s_per_token", "s_per_seq",
                                         "s_per_kpair", "s_per_decode_kpair")))
    return 0
