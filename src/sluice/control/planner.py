"""The planner: how many workers a pool should have, decided on plain data, explained.

    PoolSignals (queue, in flight, KV usage, observed TTFT/ITL, learned prefill cost)
      -> policy.recommend(signals, n) for each n    `slo` | `queue` | `kv`  (POLICIES)
      -> recommendation r (>= 1 while there is any load; 0 after `scale_to_zero_after_s` idle)
      -> delays: up only once every recommendation for `scale_up_delay_s` was above the
         current count (to the smallest of them); down once every one for
         `scale_down_delay_s` was below it (to the largest of them)
      -> clamp to [min, max], to `max_step` workers added per decision and
         `max_step_down` removed (default: `max_step`)
      -> Decision: desired count, the reason, the inputs and the predictions behind it

`Planner.decide(signals, now)` is a pure step in the caller's time (no clock is read
inside), so the router's control loop calls it every second in wall time and the
simulator every tick in virtual time, with the same results for the same inputs.

Hysteresis comes from two places, so the count never flaps under oscillating load:
the `slo` policy scales up when its prediction misses the SLO but down only when the
smaller count is predicted to meet it with the load grown by 1 / `scale_down_margin`
(headroom in load, not in latency: an ITL floor close to the SLO leaves no latency band
to shrink into, while the load a step down adds is known); and the delays take the
max (down) or min (up) of the recommendations over their window, as Kubernetes' HPA
stabilization window does, so a dip shorter than the down delay never shrinks the pool.

The `slo` policy predicts with the router's own cost model
(`router.policies.cost.estimate_seconds` over the pool's learned TTFT line): the
TTFT of a request joining the back of the queue on an average worker when the pool's
queued and running work is spread over n workers (its own prefill less the pool's
prefix-hit share), calibrated upward by the observed p90 TTFT when the model
under-predicts it. ITL: a decode step has a fixed cost that more workers do not
lower (the floor: the least ITL seen over `itl_floor_window_s`, or `itl_floor_s` from
a profile when that is lower), and the time above it is work the load brings, which
is the same per request at any count. A worker busy the share `1 - floor / ITL_obs`
of its time with that work puts the pool's load at `busy = n_now × (1 - floor /
ITL_obs)` workers' worth; at n workers each is busy `busy / n`, and
ITL(n) = floor / (1 - busy / n): it grows faster than the load per worker, because a
slower step keeps each request longer. (In the simulator's fixed pools of 4 to 9
workers over a day, `n × (1 - floor / ITL)` per 30 s agrees within ~5 % across n.)
Before the floor is known, the ITL scales as if the step time grew by one request's
share per request, ITL(n) = ITL_obs × (1 + running/n) / (1 + running/n_now), which
over-provisions a pool whose fixed step cost dominates.
Dynamo's planner maps forecast load through profiled curves; sluice fits its lines
online and takes at most the floor from a profile.

Look-ahead: a worker started now serves only after its cold start, so the `slo` policy
also predicts the pool at `lookahead_s` from now, with the demand (requests in flight
and queued) extrapolated along its growth over the last `trend_window_s` (a
least-squares slope; growth only). Under a load step the backlog grows linearly long
before today's TTFT misses: scaling on the forecast starts the worker that much
earlier; the forecast's ITL load grows in the same proportion (`PoolSignals.grown`).
At a steady load the slope is noise around zero, and a forecast that merely stays
inside the SLO changes nothing.
"""

from __future__ import annotations

import logging
import math
import re
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar

from sluice.protocol.errors import InvalidRequestError, check_number
from sluice.router.endpoints import PRIOR_SECONDS_PER_TOKEN, EndpointStats
from sluice.router.policies.base import RequestMeta
from sluice.router.policies.cost import estimate_seconds

log = logging.getLogger(__name__)

MIN_ITL_POINTS = 20  # ITL observations before the floor is trusted

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m)?\s*$")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}


def parse_duration(text: str, param: str) -> float:
    """`2s`, `200ms`, `1.5`, `1m` -> seconds."""
    m = _DURATION.match(text)
    if m is None:
        raise InvalidRequestError(f"{param}: expected a duration like 2s or 200ms, got {text!r}",
                                  param=param)
    return float(m.group(1)) * _UNIT_S[m.group(2)]


@dataclass(frozen=True)
class SLO:
    """Service-level objectives: p90 time to first token and mean inter-token latency."""

    ttft_s: float = 2.0
    itl_s: float = 0.2

    def __post_init__(self) -> None:
        for name, value in (("ttft", self.ttft_s), ("itl", self.itl_s)):
            if not (math.isfinite(value) and value > 0):
                raise InvalidRequestError(f"slo: {name} must be a finite number > 0, got "
                                          f"{value}", param="slo")

    @classmethod
    def parse(cls, text: str) -> SLO:
        """`ttft=2s,itl=200ms` (either part may be left out)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in ("ttft", "itl"):
                raise InvalidRequestError(f"slo: expected ttft=..,itl=.., got {part!r}",
                                          param="slo")
            values[key.strip() + "_s"] = parse_duration(value, "slo")
        return cls(**values)


@dataclass(frozen=True)
class PlannerConfig:
    """One pool's scaling bounds, delays and policy.

    `scale_to_zero_after_s`: with `min_replicas=0`, go to zero workers after the pool
    has been idle (nothing queued, in flight or waiting) this long; None never does.
    """

    policy: str = "slo"
    min_replicas: int = 1
    max_replicas: int = 4
    slo: SLO = field(default_factory=SLO)
    scale_up_delay_s: float = 5.0
    scale_down_delay_s: float = 60.0
    max_step: int = 1  # most workers added per decision
    max_step_down: int | None = None  # most removed per decision (None: max_step)
    scale_to_zero_after_s: float | None = None
    scale_down_margin: float = 0.6  # slo: a smaller count must meet the SLO at load / margin
    target_ongoing_requests: float = 8.0  # queue: in flight + queued per worker
    target_kv_usage: float = 0.8  # kv: mean KV-cache usage per worker
    target_queue_length: float = 5.0  # kv: requests waiting for prefill per worker
    tolerance: float = 0.1  # queue, kv: no change while the ratio is within 1 ± this
    lookahead_s: float = 30.0  # slo: also meet the SLO for the demand forecast this far ahead
    trend_window_s: float = 20.0  # the demand growth is fitted over this much history
    itl_floor_window_s: float = 3600.0  # slo: the ITL floor is the least ITL this long
    itl_floor_s: float | None = None  # slo: a decode step's fixed cost, profiled (optional)
    history: int = 120  # decisions kept for /admin/planner

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidRequestError(f"unknown planner policy {self.policy!r}; choose from "
                                      f"{sorted(POLICIES)}", param="planner_policy")
        for name, (rule, ok) in _RULES.items():
            check_number(name, getattr(self, name), rule, ok)
        if self.min_replicas > self.max_replicas:
            raise InvalidRequestError(f"min_replicas must be <= max_replicas "
                                      f"({self.max_replicas}), got {self.min_replicas}",
                                      param="min_replicas")
        if self.scale_to_zero_after_s is not None and self.min_replicas > 0:
            raise InvalidRequestError(f"scale_to_zero_after_s needs min_replicas 0, got "
                                      f"min_replicas {self.min_replicas}",
                                      param="scale_to_zero_after_s")


_AT_LEAST_0 = ("must be >= 0", lambda v: v >= 0)
_AT_LEAST_1 = ("must be >= 1", lambda v: v >= 1)
_ABOVE_0 = ("must be > 0", lambda v: v > 0)
_SHARE = ("must be in (0, 1]", lambda v: 0 < v <= 1)
_RULES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "min_replicas": _AT_LEAST_0, "max_replicas": _AT_LEAST_1,
    "scale_up_delay_s": _AT_LEAST_0, "scale_down_delay_s": _AT_LEAST_0,
    "max_step": _AT_LEAST_1, "max_step_down": _AT_LEAST_1,
    "scale_to_zero_after_s": _AT_LEAST_0, "scale_down_margin": _SHARE,
    "target_ongoing_requests": _ABOVE_0, "target_kv_usage": _SHARE,
    "target_queue_length": _ABOVE_0, "tolerance": ("must be in [0, 1)", lambda v: 0 <= v < 1),
    "lookahead_s": _AT_LEAST_0, "trend_window_s": _ABOVE_0,
    "itl_floor_window_s": _ABOVE_0, "itl_floor_s": _ABOVE_0, "history": _AT_LEAST_1,
}  # PlannerConfig's numbers: field -> (what it must be, the test)


@dataclass(frozen=True)
class PoolSignals:
    """What the planner knows about one pool at one moment (plain data; sums over workers).

    `ready`: workers taking requests; `starting`: launched, not yet ready. `queued`:
    requests the router holds because no worker is ready. `waiting`/`running`: the
    router's estimate of requests waiting for prefill / decoding on the workers.
    `seconds_per_token`/`overhead_s`: the pool's learned TTFT line (the cost model).
    `ttft_p90_s`/`itl_s`: observed over the last window; None when nothing was served.
    `itl_floor_s`: the lowest ITL the planner has seen over its recent history (a decode
    step's fixed cost, `Planner.itl_floor`); None until it has seen enough.
    """

    pool: str
    ready: int = 0
    starting: int = 0
    queued: int = 0
    inflight: int = 0
    waiting: float = 0.0
    running: float = 0.0
    queued_prefill_tokens: float = 0.0
    kv_usage: float = 0.0
    mean_prompt_tokens: float = 0.0
    seconds_per_token: float = PRIOR_SECONDS_PER_TOKEN
    overhead_s: float = 0.0
    ttft_p90_s: float | None = None
    itl_s: float | None = None
    prefix_hit_rate: float | None = None
    itl_floor_s: float | None = None  # the least ITL seen lately (the planner's history)
    load_scale: float = 1.0  # the load these signals stand for over the observed one

    @property
    def idle(self) -> bool:
        return self.queued == 0 and self.inflight == 0 and self.waiting <= 0 and self.running <= 0

    @property
    def demand(self) -> float:
        """Requests the pool holds: in flight (or estimated on the workers) plus queued."""
        return max(float(self.inflight), self.waiting + self.running) + self.queued

    def grown(self, extra: float) -> PoolSignals:
        """These signals with `extra` more requests held, in today's proportions of
        waiting, running, queued and queued prefill tokens (a backlog that keeps growing
        as it grew)."""
        if extra <= 0:
            return self
        if self.demand <= 0:  # nothing to scale: the new requests wait for prefill
            return replace(self, waiting=self.waiting + extra,
                           queued_prefill_tokens=self.queued_prefill_tokens
                           + extra * self.mean_prompt_tokens)
        f = (self.demand + extra) / self.demand
        return replace(self, inflight=round(self.inflight * f), queued=round(self.queued * f),
                       waiting=self.waiting * f, running=self.running * f,
                       queued_prefill_tokens=self.queued_prefill_tokens * f,
                       load_scale=self.load_scale * f)


@dataclass(frozen=True)
class Prediction:
    """A policy's view of the pool at `replicas` workers (None: the policy has no model)."""

    replicas: int
    ttft_s: float | None = None
    itl_s: float | None = None
    per_replica: float | None = None  # queue: ongoing per worker; kv: usage per worker


@dataclass(frozen=True)
class Recommendation:
    replicas: int
    reason: str
    current: Prediction
    chosen: Prediction


class PlannerPolicy(ABC):
    """Recommends a replica count for `signals` with `current` workers (never below 1;
    scale-to-zero is the planner's rule, not a policy's). Pure: no state, no I/O."""

    name: ClassVar[str]

    @abstractmethod
    def recommend(self, s: PoolSignals, current: int, config: PlannerConfig,
                  ahead: PoolSignals | None = None) -> Recommendation:
        """The count this policy wants now, with its predictions at `current` and at it.
        `ahead`: the signals forecast `config.lookahead_s` from now (None: no forecast)."""

    @abstractmethod
    def predict(self, s: PoolSignals, current: int, n: int) -> Prediction:
        """What this policy expects of the pool at `n` workers (it has `current` now)."""


def _calibration(s: PoolSignals, model_now: float) -> float:
    """Observed p90 TTFT over the model's prediction at today's count (>= 1: the model
    is only ever corrected upward, so a quiet window cannot talk the pool down)."""
    if s.ttft_p90_s is None or model_now <= 0:
        return 1.0
    return min(10.0, max(1.0, s.ttft_p90_s / model_now))


def model_ttft(s: PoolSignals, n: int) -> float:
    """The cost model's TTFT for a request joining the back of the queue on an average
    worker, with the pool's queued and running work spread over `n` workers. The
    request's own prefill is its prompt less the pool's prefix-hit share (a pool that
    serves most prompts from its cache must not be sized as if it recomputed them)."""
    if n <= 0:
        return math.inf
    avg = EndpointStats(
        url="", running=s.running / n, waiting=(s.waiting + s.queued) / n,
        queued_prefill_tokens=(s.queued_prefill_tokens + s.queued * s.mean_prompt_tokens) / n,
        seconds_per_token=s.seconds_per_token, overhead_s=s.overhead_s,
        mean_prompt_tokens=s.mean_prompt_tokens)
    own = s.mean_prompt_tokens * (1.0 - (s.prefix_hit_rate or 0.0))
    return estimate_seconds(RequestMeta(model="", num_prompt_tokens=int(own)), avg)


def predict_itl(s: PoolSignals, now: int, n: int) -> float | None:
    """The ITL at `n` workers from the one observed at `now` workers.

    With a known floor (the least ITL seen: a decode step's fixed cost, which more
    workers do not lower), the step time above the floor is work the load brings: new
    tokens and prefill chunks, in proportion to the requests arriving per worker. A
    worker spends the share `1 - floor / ITL` of its time on that work, so the pool holds
    `busy = now × (1 - floor / ITL)` workers' worth of it, and at `n` workers each spends
    `busy / n`; the rest of its time goes to steps' fixed costs, so one step takes
    `ITL(n) = floor / (1 - busy / n)` (infinite once `busy >= n`: the pool cannot keep
    up). The work per request is the same at any count, so the share scales with the
    load per worker alone; the ITL grows faster than it (a slower step keeps each
    request longer, so each step carries more of them). `s.load_scale` scales the load
    for a forecast or a headroom check (`PoolSignals.grown`).

    Without a floor: as if the step time grew by one request's share per request
    (over-provisions a pool whose fixed step cost dominates)."""
    if s.itl_s is None or n <= 0:
        return None if n > 0 else math.inf
    if s.itl_floor_s is not None and s.itl_s > 0:
        floor = min(s.itl_floor_s, s.itl_s)
        busy = (1.0 - floor / s.itl_s) * max(1, now) * s.load_scale
        return floor / (1.0 - busy / n) if busy < n else math.inf
    return s.itl_s * (1 + s.running / n) / (1 + s.running / max(1, now))


class SLOPolicy(PlannerPolicy):
    """The smallest count whose predicted TTFT and ITL meet the SLO (scale up), and
    that meets it with the load grown by 1 / `scale_down_margin` to go below today's
    count (scale down)."""

    name = "slo"

    def predict(self, s: PoolSignals, current: int, n: int) -> Prediction:
        # the observations come from the workers that served them: the ready ones, not
        # those still starting (counting these would read one worker's ITL as two's, and
        # start a third while the second loads)
        ref = s.ready if s.ready > 0 else max(1, current)
        ttft = model_ttft(s, n) * _calibration(s, model_ttft(s, ref))
        return Prediction(n, ttft, predict_itl(s, ref, n))

    def _meets(self, p: Prediction, slo: SLO) -> bool:
        ttft_ok = p.ttft_s is None or p.ttft_s <= slo.ttft_s
        itl_ok = p.itl_s is None or p.itl_s <= slo.itl_s
        return ttft_ok and itl_ok

    def recommend(self, s: PoolSignals, current: int, config: PlannerConfig,
                  ahead: PoolSignals | None = None) -> Recommendation:
        counts = range(1, config.max_replicas + 1)
        preds = [self.predict(s, current, n) for n in counts]
        now = self.predict(s, current, max(1, current))
        best = _best(preds)  # when no count meets it: the fewest that do best

        def first(today: list[Prediction], later: PoolSignals | None) -> Prediction:
            """The fewest workers meeting the SLO in `today`'s predictions and, with a
            forecast, in `later`'s."""
            forecast = [self.predict(later, current, n) for n in counts] \
                if later is not None else today
            return next((p for p, q in zip(today, forecast, strict=True)
                         if self._meets(p, config.slo) and self._meets(q, config.slo)), best)

        up = first(preds, ahead)
        # down: the smaller count must meet the SLO with the load grown by 1/margin (now
        # and forecast): headroom in load, which a step down changes, not in latency
        grow = 1.0 / config.scale_down_margin - 1.0
        heavy = s.grown(s.demand * grow)
        down = first([self.predict(heavy, current, n) for n in counts],
                     ahead.grown(ahead.demand * grow) if ahead is not None else None)
        if current < 1 or up.replicas > current:
            today = next((p for p in preds if self._meets(p, config.slo)), best)
            reason = ("predicted to miss the SLO with fewer" if today.replicas >= up.replicas
                      else f"forecast to miss the SLO with fewer in {config.lookahead_s:g}s")
            return Recommendation(up.replicas, reason if up.replicas > 1
                                  else "smallest count meeting the SLO", now, up)
        if down.replicas < current:
            return Recommendation(down.replicas, f"meets the SLO with fewer at "
                                  f"{1 / config.scale_down_margin:.3g}x the load",
                                  now, self.predict(s, current, down.replicas))
        return Recommendation(current, "within the SLO band", now, now)


def _best(preds: list[Prediction]) -> Prediction:
    """The fewest workers whose predicted TTFT and ITL are within 1 % of the best: more
    workers than that do not help (a slow TTFT at no load is not cured by scaling)."""
    def worst(p: Prediction) -> tuple[float, float]:  # NaN (a degenerate signal) is worst
        t, i = p.ttft_s or 0.0, p.itl_s or 0.0
        return (t if t == t else math.inf, i if i == i else math.inf)
    low_t = min(worst(p)[0] for p in preds)
    low_i = min(worst(p)[1] for p in preds)
    return next((p for p in preds if worst(p)[0] <= low_t * 1.01
                 and worst(p)[1] <= low_i * 1.01), preds[-1])


class _RatioPolicy(PlannerPolicy):
    """HPA's rule: desired = ceil(current × metric / target), held within the tolerance;
    with several metrics, the largest count any of them asks for (as HPA does)."""

    def metrics(self, s: PoolSignals, n: int) -> list[tuple[str, float]]:
        """Each metric's name and value per worker at `n` workers; the first is the one
        `Prediction.per_replica` reports."""
        raise NotImplementedError

    def targets(self, config: PlannerConfig) -> list[float]:
        """The metrics' targets, in their order."""
        raise NotImplementedError

    def predict(self, s: PoolSignals, current: int, n: int) -> Prediction:
        return Prediction(n, per_replica=self.metrics(s, n)[0][1])

    def recommend(self, s: PoolSignals, current: int, config: PlannerConfig,
                  ahead: PoolSignals | None = None) -> Recommendation:
        ref = max(1, current)
        (name, metric), target = max(zip(self.metrics(s, ref), self.targets(config),
                                         strict=True), key=lambda m: m[0][1] / m[1])
        ratio = metric / target
        if current >= 1 and abs(ratio - 1.0) <= config.tolerance:
            n, reason = current, f"{name} within {config.tolerance:g} of the target"
        else:
            n = max(1, math.ceil(ref * ratio - 1e-9))
            reason = f"{name} {metric:.3g} per worker vs target {target:g}"
        return Recommendation(n, reason, self.predict(s, current, ref),
                              self.predict(s, current, n))


class QueuePolicy(_RatioPolicy):
    """Requests in flight or queued per worker against `target_ongoing_requests` (Ray
    Serve's name; KServe + KEDA scale on `vllm:num_requests_waiting` alike)."""

    name = "queue"

    def metrics(self, s: PoolSignals, n: int) -> list[tuple[str, float]]:
        return [("ongoing requests", s.demand / max(1, n))]

    def targets(self, config: PlannerConfig) -> list[float]:
        return [config.target_ongoing_requests]


class KVPolicy(_RatioPolicy):
    """llm-d's saturation signals, as an HPA with two metrics: mean KV-cache usage against
    `target_kv_usage` (WVA's kvCacheThreshold, 0.8; requests the router holds count as a
    full worker's worth, so that a cold pool activates) and requests waiting for prefill
    (on the workers or held by the router) per worker against `target_queue_length` (its
    queueLengthThreshold, 5). The KV metric alone never fires where the cache outlasts
    the compute: a CPU worker with a large pool slows every stream long before its cache
    fills, and then only the engines' queues show it (docs/control.md)."""

    name = "kv"

    def metrics(self, s: PoolSignals, n: int) -> list[tuple[str, float]]:
        kv = s.kv_usage * max(1, s.ready) + (1.0 if s.queued else 0.0)
        return [("kv usage", kv / max(1, n)), ("waiting", (s.waiting + s.queued) / max(1, n))]

    def targets(self, config: PlannerConfig) -> list[float]:
        return [config.target_kv_usage, config.target_queue_length]


POLICIES: Mapping[str, type[PlannerPolicy]] = MappingProxyType({
    cls.name: cls for cls in (SLOPolicy, QueuePolicy, KVPolicy)})


@dataclass(frozen=True)
class Decision:
    """One planner step for one pool: the count it wants and everything behind it."""

    pool: str
    at: float
    previous: int
    desired: int
    recommended: int
    policy: str
    reason: str
    signals: PoolSignals
    current: Prediction
    predicted: Prediction
    demand_growth: float = 0.0  # requests/s, fitted over the trend window

    @property
    def changed(self) -> bool:
        return self.desired != self.previous

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (an infinite prediction, at zero workers, becomes null)."""
        out = _finite(asdict(self))
        out["changed"] = self.changed
        return out  # type: ignore[no-any-return]

    def describe(self) -> str:
        s, p = self.signals, self.predicted
        return (f"pool {self.pool}: {self.previous} -> {self.desired} ({self.policy}: "
                f"{self.reason}; recommended {self.recommended}) | ready {s.ready} starting "
                f"{s.starting} queued {s.queued} inflight {s.inflight} waiting {s.waiting:.1f} "
                f"running {s.running:.1f} kv {s.kv_usage:.2f} ttft_p90 {_fmt(s.ttft_p90_s)} "
                f"itl {_fmt(s.itl_s)} growth {self.demand_growth:.2f}/s | predicted at "
                f"{p.replicas}: ttft {_fmt(p.ttft_s)} itl {_fmt(p.itl_s)}")


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    return x


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


@dataclass
class _Trend:
    """Recommendations since they first went above (or below) the current count."""

    since: float | None = None
    values: list[int] = field(default_factory=list)

    def add(self, now: float, value: int) -> None:
        if self.since is None:
            self.since = now
        self.values.append(value)

    def reset(self) -> None:
        self.since, self.values = None, []

    def held(self, now: float, delay: float) -> bool:
        return self.since is not None and now - self.since >= delay


class Planner:
    """Decides one pool's replica count; owns only its own history (not thread-safe:
    one caller, the control loop or the simulator, drives it)."""

    def __init__(self, config: PlannerConfig, initial: int | None = None) -> None:
        self.config = config
        self.policy: PlannerPolicy = POLICIES[config.policy]()
        self.desired = config.min_replicas if initial is None else initial
        self.idle_since: float | None = None
        self.up, self.down = _Trend(), _Trend()
        self.decisions: deque[Decision] = deque(maxlen=config.history)
        self.itl_points: deque[tuple[float, float]] = deque()  # (at, itl), rising itl
        self.itl_seen = 0

    def decide(self, signals: PoolSignals, now: float) -> Decision:
        """One step at time `now` (seconds, any origin, never decreasing). Mutates the
        planner's history and `desired`; reads no clock."""
        cfg, previous = self.config, self.desired
        signals = replace(signals, itl_floor_s=self.itl_floor(signals, now))
        growth = self.demand_growth(signals, now)
        ahead = signals.grown(growth * cfg.lookahead_s) if growth > 0 else None
        rec = self.policy.recommend(signals, previous, cfg, ahead)
        target = min(cfg.max_replicas, max(cfg.min_replicas, rec.replicas))
        stable, reason = self._zero_rule(signals, now)
        if stable is None:
            stable, reason = self._stabilize(now, previous, target, rec.reason)
        down = cfg.max_step if cfg.max_step_down is None else cfg.max_step_down
        desired = max(previous - down, min(previous + cfg.max_step, stable))
        if desired < previous or (desired > previous and desired == stable):
            # a step down, or all the way up: the delays restart, so the pool shrinks at
            # most once per scale-down delay and sees each step's effect first
            self.up.reset()
            self.down.reset()
        self.desired = desired
        decision = Decision(signals.pool, now, previous, desired, target, cfg.policy, reason,
                            signals, rec.current, self.policy.predict(signals, previous, desired),
                            growth)
        self.decisions.append(decision)
        log.log(logging.INFO if decision.changed else logging.DEBUG, "%s", decision.describe())
        return decision

    def demand_growth(self, signals: PoolSignals, now: float) -> float:
        """Requests/s the demand grew by over the last `trend_window_s` (least-squares
        slope over this and the earlier decisions in the window; 0 with under half a
        window of history)."""
        lo = now - self.config.trend_window_s
        points = [(d.at, d.signals.demand) for d in self.decisions if d.at >= lo]
        points.append((now, signals.demand))
        if now - points[0][0] < self.config.trend_window_s / 2:
            return 0.0
        mt = sum(t for t, _ in points) / len(points)
        md = sum(d for _, d in points) / len(points)
        var = sum((t - mt) ** 2 for t, _ in points)
        return sum((t - mt) * (d - md) for t, d in points) / var if var > 0 else 0.0

    def forget_itl(self) -> None:
        """Drop the ITL history: the pool now serves another model (a blue/green swap),
        whose decode step has a floor of its own (a lower or a higher one); it is learned
        afresh, the profiled `itl_floor_s` standing in until then."""
        self.itl_points.clear()
        self.itl_seen = 0

    def itl_floor(self, signals: PoolSignals, now: float) -> float | None:
        """The lowest ITL observed over the last `itl_floor_window_s`: the decode step's
        cost at the lightest load seen, which more workers cannot lower (None before
        MIN_ITL_POINTS observations)."""
        if signals.itl_s is not None and signals.ready > 0:
            while self.itl_points and self.itl_points[-1][1] >= signals.itl_s:
                self.itl_points.pop()  # a monotonic queue: the front is the window's min
            self.itl_points.append((now, signals.itl_s))
            self.itl_seen += 1
        while self.itl_points and self.itl_points[0][0] < now - self.config.itl_floor_window_s:
            self.itl_points.popleft()
        profiled = self.config.itl_floor_s
        if self.itl_seen < MIN_ITL_POINTS or not self.itl_points:
            return profiled
        seen = self.itl_points[0][1]
        return seen if profiled is None else min(profiled, seen)

    def _zero_rule(self, s: PoolSignals, now: float) -> tuple[int | None, str]:
        """Zero after `scale_to_zero_after_s` idle (its own delay: the scale-down delay does
        not apply on top); at zero, stay there while idle. None: the policy decides."""
        if not s.idle:
            self.idle_since = None
            return None, ""
        if self.idle_since is None:
            self.idle_since = now
        after = self.config.scale_to_zero_after_s
        if after is not None and now - self.idle_since >= after:
            return 0, f"idle for {now - self.idle_since:g}s (scale to zero after {after:g}s)"
        if self.desired == 0:
            return 0, "idle at zero"
        return None, ""

    def _stabilize(self, now: float, current: int, target: int, reason: str
                   ) -> tuple[int, str]:
        """Apply the up/down delays: act only on a recommendation held for the delay, to
        the least (up) or greatest (down) count recommended since it first differed."""
        cfg = self.config
        if current == 0 and target > 0:
            return target, reason + " (activation from zero: no delay)"
        if target > current:
            self.down.reset()
            self.up.add(now, target)
            if self.up.held(now, cfg.scale_up_delay_s):
                return min(self.up.values), reason
            return current, f"{reason}; held for the scale-up delay ({cfg.scale_up_delay_s:g}s)"
        if target < current:
            self.up.reset()
            self.down.add(now, target)
            if self.down.held(now, cfg.scale_down_delay_s):
                return max(self.down.values), reason
            return current, (f"{reason}; held for the scale-down delay "
                             f"({cfg.scale_down_delay_s:g}s)")
        self.up.reset()
        self.down.reset()
        return current, reason

    def describe(self) -> dict[str, Any]:
        """The config, the current count and the recent decisions (for /admin/planner)."""
        return {"config": asdict(self.config), "desired": self.desired,
                "idle_since": self.idle_since,
                "decisions": [d.to_dict() for d in self.decisions]}


# --- prefill/decode disaggregation: the P:D ratio ------------------------------------------


@dataclass(frozen=True)
class PDSignals:
    """A disaggregated pool's two sides at one moment (router/pd.py; plain data).

    Prefill side: workers, the router's requests in prefill there, the uncached prompt
    tokens queued on them and their learned seconds per token. Decode side (decode and
    `both` workers): workers, running and waiting sequences, mean KV-cache usage.
    """

    pool: str
    prefill_workers: int = 0
    decode_workers: int = 0
    prefill_inflight: int = 0
    prefill_queued_tokens: float = 0.0
    prefill_seconds_per_token: float = PRIOR_SECONDS_PER_TOKEN
    decode_running: float = 0.0
    decode_waiting: float = 0.0
    decode_kv_usage: float = 0.0


@dataclass(frozen=True)
class PDRatioConfig:
    """When to move a worker from one side to the other. A side's utilisation is its
    load per worker over its target (1.0: at target): prefill, the queued prefill
    seconds per prefill worker over `target_prefill_wait_s`; decode, the larger of the
    sequences per decode worker over `target_decode_running` and the KV usage over
    `target_kv_usage`. A move must be wanted for `delay_s` before it is made."""

    target_prefill_wait_s: float = 1.0
    target_decode_running: float = 16.0
    target_kv_usage: float = 0.8
    delay_s: float = 10.0
    min_prefill: int = 1
    min_decode: int = 1

    def __post_init__(self) -> None:
        if min(self.target_prefill_wait_s, self.target_decode_running) <= 0 \
                or not 0 < self.target_kv_usage <= 1:
            raise InvalidRequestError("P:D targets must be positive (kv <= 1)",
                                      param="target_prefill_wait_s")
        if self.delay_s < 0 or self.min_prefill < 0 or self.min_decode < 1:
            raise InvalidRequestError("need delay_s >= 0, min_prefill >= 0, min_decode >= 1",
                                      param="min_decode")


def prefill_utilisation(s: PDSignals, n: int, config: PDRatioConfig) -> float:
    if n <= 0:
        return math.inf if s.prefill_queued_tokens > 0 else 0.0
    return s.prefill_queued_tokens * s.prefill_seconds_per_token / n / config.target_prefill_wait_s


def decode_utilisation(s: PDSignals, n: int, config: PDRatioConfig) -> float:
    if n <= 0:
        return math.inf
    running = (s.decode_running + s.decode_waiting) / n / config.target_decode_running
    kv = s.decode_kv_usage * s.decode_workers / n / config.target_kv_usage
    return max(running, kv)


@dataclass(frozen=True)
class PDMove:
    """One P:D step: the role a worker should move to (None: stay), and why."""

    pool: str
    at: float
    to_role: str | None
    reason: str
    prefill_utilisation: float
    decode_utilisation: float
    signals: PDSignals

    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self))  # type: ignore[no-any-return]


class PDRatioPlanner:
    """Moves one worker at a time between the sides of a disaggregated pool, toward the
    side over its target when the other side stays within its own with one worker
    fewer (so a move never just shifts the overload). Pure in the caller's time, as
    `Planner`; owns only the pending move."""

    def __init__(self, config: PDRatioConfig | None = None) -> None:
        self.config = config or PDRatioConfig()
        self.pending: tuple[str, float] | None = None  # (role, wanted since)
        self.moves: deque[PDMove] = deque(maxlen=50)

    def want(self, s: PDSignals) -> tuple[str | None, str, float, float]:
        cfg, p, d = self.config, s.prefill_workers, s.decode_workers
        up, ud = prefill_utilisation(s, p, cfg), decode_utilisation(s, d, cfg)
        if up > 1 and d > cfg.min_decode and decode_utilisation(s, d - 1, cfg) <= 1:
            return "prefill", f"prefill at {up:.2f} of target, decode holds with {d - 1}", up, ud
        if ud > 1 and p > cfg.min_prefill and prefill_utilisation(s, p - 1, cfg) <= 1:
            return "decode", f"decode at {ud:.2f} of target, prefill holds with {p - 1}", up, ud
        return None, "both sides within target or neither can spare a worker", up, ud

    def decide(self, s: PDSignals, now: float) -> PDMove:
        """The move to make now (after it was wanted for `delay_s`). Mutates `pending`."""
        role, reason, up, ud = self.want(s)
        if role is None or (self.pending is not None and self.pending[0] != role):
            self.pending = (role, now) if role is not None else None
        elif self.pending is None:
            self.pending = (role, now)
        act = role is not None and self.pending is not None \
            and now - self.pending[1] >= self.config.delay_s
        if role is not None and not act:
            reason += f"; held for the delay ({self.config.delay_s:g}s)"
        if act:
            self.pending = None
        move = PDMove(s.pool, now, role if act else None, reason, up, ud, s)
        if act:
            self.moves.append(move)
            log.info("pool %s: move a worker to %s (%s)", s.pool, role, reason)
        return move
