"""Router configuration: frozen dataclasses layered router → pool → worker.

The CLI (`sluice router --worker URL ...`), a YAML/JSON file (`--config`) and the admin
endpoint all end up here, validated once in `__post_init__`. Runtime state (health,
load, learned costs) lives in `endpoints.py`, never in these objects.

    RouterConfig
     ├── pools: PoolConfig (model name + aliases, policy, long/short split)
     │     ├── workers: WorkerSpec (url, optional KV-events endpoint, group, version)
     │     ├── admission: AdmissionConfig | None (None: the router's)
     │     └── release: ReleaseConfig (canary weight and steps, pins, shadow, thresholds)
     ├── admission: AdmissionConfig (when to hold requests, band limits, tenant weights)
     ├── breaker: BreakerConfig (per-worker circuit breaker, retry backoff and budget)
     ├── adapters: AdapterSpec (LoRA adapters the router places: name, path, base)
     ├── adapter_placement: AdapterPlacement (replica cap, residency, idle unload)
     ├── aliases: AliasSpec (NAME -> TARGET model, or a cascade: small, large, rules)
     └── timings: scrape / health intervals, retry and ejection counts
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sluice.protocol.edge import DEFAULT_MAX_BODY_BYTES
from sluice.protocol.errors import InvalidRequestError, check_number

# what a 403 from a router /admin route tells the operator to set (`sluice serve` passes
# its own --admin-key / SLUICE_ADMIN_KEY to the router it runs)
ADMIN_KEY_SETTING = ("--admin-key (SLUICE_ROUTER_ADMIN_KEY for `sluice router`, SLUICE_ADMIN_KEY "
                     "for `sluice serve`)")
SHORT = "short"
LONG = "long"
GROUPS = (SHORT, LONG)
# release versions of a pool's workers (router/release.py): the baseline serves by default,
# the canary a weighted share, the shadow only copies of requests
BASELINE = "baseline"
CANARY = "canary"
SHADOW = "shadow"
VERSIONS = (BASELINE, CANARY, SHADOW)
# prefill/decode disaggregation (router/pd.py): a worker's role, as `sluice worker --role`
PREFILL = "prefill"
DECODE = "decode"
BOTH = "both"
PD_ROLES = (PREFILL, DECODE, BOTH)
PD_MODES = ("conditional", "always", "never")


@dataclass(frozen=True)
class DnsTarget:
    """`http(s)://NAME[:PORT]` whose every address is a worker on PORT (a Kubernetes
    headless Service's name: one address per ready pod; router/discovery.py)."""

    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> DnsTarget:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequestError(f"a discovered worker URL is http(s)://NAME[:PORT], got "
                                      f"{url!r}", param="discover")
        if parts.path.strip("/") or parts.query or parts.username:
            raise InvalidRequestError(f"a discovered worker URL has no path, query or user: "
                                      f"{url!r}", param="discover")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise InvalidRequestError(f"{url!r}: {exc}", param="discover") from None
        return cls(parts.scheme, parts.hostname, port)

    def url(self, address: str) -> str:
        """IPv6 in brackets, a link-local zone as the resolver gave it, `[fe80::1%eth0]`
        (not RFC 6874's `%25eth0`, which neither httpx nor upstream.Target resolves)."""
        host = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{host}:{self.port}"


@dataclass(frozen=True)
class WorkerSpec:
    """One worker: its base URL, its KV-events ZMQ endpoint (if it publishes), its group,
    its release version (baseline, canary or shadow), its prefill/decode role in a
    disaggregated pool (None: as the worker's `GET /v1/pd_role` says, else `both`)."""

    url: str
    kv_events: str | None = None
    group: str = SHORT
    version: str = BASELINE
    role: str | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise InvalidRequestError(f"worker url must start with http:// or https://: {self.url!r}",
                                      param="url")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if self.group not in GROUPS:
            raise InvalidRequestError(f"worker group must be one of {GROUPS}, got {self.group!r}",
                                      param="group")
        if self.version not in VERSIONS:
            raise InvalidRequestError(f"worker version must be one of {VERSIONS}, "
                                      f"got {self.version!r}", param="version")
        if self.kv_events is not None and "://" not in self.kv_events:
            raise InvalidRequestError(f"kv_events must be a ZMQ endpoint like tcp://host:port, "
                                      f"got {self.kv_events!r}", param="kv_events")
        if self.role is not None and self.role not in PD_ROLES:
            raise InvalidRequestError(f"worker role must be one of {PD_ROLES}, got {self.role!r}",
                                      param="role")


@dataclass(frozen=True)
class PDConfig:
    """A disaggregated pool's rules (router/pd.py): when a request's prompt is prefilled
    on a prefill worker and its KV handed to a decode worker (vLLM's `kv_transfer_params`).

    `mode`: `conditional` (Dynamo's rule, on the router's cost model): disaggregate when
    the prompt's tokens not cached on the chosen decode worker are at least
    `min_uncached_tokens` and the best prefill worker's predicted queueing is at most
    `max_prefill_wait_ratio` x the local prefill's predicted seconds; `always`; `never`
    (every request prefills on its decode worker). `role_refresh_s`: how often each
    worker's `GET /v1/pd_role` is read.
    """

    mode: str = "conditional"
    min_uncached_tokens: int = 2048
    max_prefill_wait_ratio: float = 1.0
    role_refresh_s: float = 2.0

    def __post_init__(self) -> None:
        check_finite(self)
        if self.mode not in PD_MODES:
            raise InvalidRequestError(f"pd mode must be one of {PD_MODES}, got {self.mode!r}",
                                      param="pd_mode")
        if self.min_uncached_tokens < 0 or self.max_prefill_wait_ratio < 0:
            raise InvalidRequestError("min_uncached_tokens and max_prefill_wait_ratio must be "
                                      ">= 0", param="pd_min_uncached_tokens")
        if self.role_refresh_s <= 0:
            raise InvalidRequestError("role_refresh_s must be positive", param="role_refresh_s")


def check_finite(config: object) -> None:
    """Every float setting of the dataclass `config` finite: a NaN passes every `<`
    test and an infinity breaks arithmetic later (an infinite queue timeout made the
    429's Retry-After an OverflowError, a 500), so neither is a setting; the error names
    the field."""
    for f in fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise InvalidRequestError(f"{f.name} must be a finite number, got {value}",
                                      param=f.name)


# --- flow control (router/admission.py, router/breaker.py) --------------------------------


@dataclass(frozen=True)
class BandLimits:
    """One priority band's queue: how many may wait, and for how long."""

    capacity: int = 1000
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_finite(self)
        if self.capacity < 0 or self.timeout_s <= 0:
            raise InvalidRequestError("a band's capacity must be >= 0 and timeout_s > 0",
                                      param="bands")


@dataclass(frozen=True)
class AdmissionConfig:
    """When a pool's requests wait in the router's admission queue (router/admission.py).

    A worker has room while the router's in-flight requests there are below
    `max_inflight_per_worker` and its predicted queueing delay (the cost model's seconds
    of work ahead of a new request) is below `max_predicted_wait_s`; 0 turns either test
    off, both 0 turns the queue off. A request is sent at once while some worker has
    room, else it waits in its priority band (`x-sluice-priority`, lower first), tenants
    (`x-sluice-tenant`) sharing a band by `tenant_weights` (default 1 each).
    `bands`: limits per priority value; other priorities get `default_band`.
    """

    max_inflight_per_worker: int = 256
    max_predicted_wait_s: float = 0.0
    default_band: BandLimits = field(default_factory=BandLimits)
    bands: Mapping[int, BandLimits] = field(default_factory=dict)
    tenant_weights: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_finite(self)
        if self.max_inflight_per_worker < 0 or self.max_predicted_wait_s < 0:
            raise InvalidRequestError("admission limits must be >= 0 (0: off)",
                                      param="max_inflight_per_worker")
        if any(not (0 < w < math.inf) for w in self.tenant_weights.values()):
            raise InvalidRequestError("tenant weights must be positive and finite",
                                      param="tenant_weights")

    @property
    def enabled(self) -> bool:
        return self.max_inflight_per_worker > 0 or self.max_predicted_wait_s > 0

    def band(self, priority: int) -> BandLimits:
        return self.bands.get(priority, self.default_band)

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)


@dataclass(frozen=True)
class BreakerConfig:
    """Per-worker circuit breaker on the request path, retry backoff and retry budget.

    Closed -> open after `failures` consecutive request failures, each within `window_s`
    of the one before; open for `open_s`; then half-open: up to `successes` trial requests
    at once, closed after `successes` of them succeed, open again on a failure. A breaker
    never opens when fewer than `min_closed` other available workers of its pool would be
    left closed. `failures` 0 turns breakers off (request failures then count toward
    ejection, as probes do). Retries wait `backoff_s` x 2^n (capped at `backoff_max_s`,
    jittered by up to half); retries may reach `budget_ratio` x the pool's requests in
    the last `budget_window_s`, plus `budget_min` (so a quiet pool can still retry).
    """

    failures: int = 5
    successes: int = 2
    open_s: float = 30.0
    window_s: float = 60.0
    min_closed: int = 1
    backoff_s: float = 0.05
    backoff_max_s: float = 1.0
    budget_ratio: float = 0.2
    budget_window_s: float = 10.0
    budget_min: int = 10

    def __post_init__(self) -> None:
        check_finite(self)
        if self.failures < 0 or self.successes < 1 or self.min_closed < 0:
            raise InvalidRequestError("breaker failures must be >= 0, successes >= 1, "
                                      "min_closed >= 0", param="breaker")
        if min(self.open_s, self.window_s, self.budget_window_s) <= 0:
            raise InvalidRequestError("breaker times must be positive", param="breaker")
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise InvalidRequestError("need 0 <= backoff_s <= backoff_max_s", param="breaker")
        if self.budget_ratio < 0 or self.budget_min < 0:
            raise InvalidRequestError("retry budget must be >= 0", param="breaker")


@dataclass(frozen=True)
class ReleaseConfig:
    """A pool's canary, pins and shadow, and when to roll the canary back or promote it.

    Weights and shares are percentages. `steps`: the canary weights automatic promotion
    walks through. A metric regresses when the canary is worse than the baseline by a
    one-sided test at `alpha` *and* by more than its margin (errors: `error_margin`
    absolute; TTFT and TPOT p90: `latency_margin` relative; prefix-hit rate:
    `prefix_hit_margin` absolute), each side having `min_samples` in the last
    `window_s` seconds. See docs/router.md, Releases.
    """

    canary_weight: float = 0.0
    steps: tuple[float, ...] = (5.0, 25.0, 50.0, 100.0)
    auto: bool = True  # roll back and promote by itself (else only by hand)
    window_s: float = 120.0
    min_samples: int = 50
    alpha: float = 0.001
    error_margin: float = 0.02
    latency_margin: float = 0.2
    prefix_hit_margin: float = 0.1
    pin_tenants: Mapping[str, str] = field(default_factory=dict)  # tenant -> version
    shadow_percent: float = 0.0
    shadow_max_concurrency: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(float(s) for s in self.steps))
        check_finite(self)
        percentages = {"canary_weight": self.canary_weight, "shadow_percent": self.shadow_percent,
                       **{f"steps.{i}": step for i, step in enumerate(self.steps)}}
        for name, value in percentages.items():
            if not 0.0 <= value <= 100.0:
                raise InvalidRequestError(f"{name} must be a percentage in [0, 100], got {value}",
                                          param=name)
        if list(self.steps) != sorted(set(self.steps)) or not self.steps or self.steps[0] <= 0:
            raise InvalidRequestError("steps must be increasing percentages above 0",
                                      param="steps")
        if self.window_s <= 0 or self.min_samples < 2 or not 0.0 < self.alpha < 1.0:
            raise InvalidRequestError("window_s > 0, min_samples >= 2 and 0 < alpha < 1 needed",
                                      param="window_s")
        if min(self.error_margin, self.latency_margin, self.prefix_hit_margin) < 0:
            raise InvalidRequestError("margins must be >= 0", param="error_margin")
        if self.shadow_max_concurrency < 0:
            raise InvalidRequestError("shadow_max_concurrency must be >= 0",
                                      param="shadow_max_concurrency")
        for tenant, version in self.pin_tenants.items():
            if version not in (BASELINE, CANARY):
                raise InvalidRequestError(f"tenant {tenant!r} pinned to {version!r}: pin to "
                                          f"{BASELINE!r} or {CANARY!r}", param="pin_tenants")


@dataclass(frozen=True)
class PoolConfig:
    """The workers serving one model.

    `model=None` means "whatever the workers serve": the pool answers to every model id
    its workers list in /v1/models (discovered by the health probe) plus `aliases`.
    `long_prompt_tokens`: prompts with more tokens go to the workers of group "long".
    `tokenizer`: a local tokenizer (HF dir or .gguf) to count and hash prompt tokens;
    None asks a worker's /tokenize (cached).
    """

    model: str | None = None
    aliases: tuple[str, ...] = ()
    workers: tuple[WorkerSpec, ...] = ()
    policy: str = "cost"
    long_prompt_tokens: int | None = None
    tokenizer: str | None = None
    block_size: int = 16
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    admission: AdmissionConfig | None = None  # None: the router's `admission`
    release: ReleaseConfig = field(default_factory=ReleaseConfig)
    pd: PDConfig | None = None  # prefill/decode disaggregation (router/pd.py); None: off
    # DNS names whose addresses are workers of this pool (router/discovery.py)
    discover: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise InvalidRequestError("block_size must be positive", param="block_size")
        if self.long_prompt_tokens is not None and self.long_prompt_tokens <= 0:
            raise InvalidRequestError("long_prompt_tokens must be positive",
                                      param="long_prompt_tokens")
        urls = [w.url for w in self.workers]
        if len(set(urls)) != len(urls):
            raise InvalidRequestError("a worker is listed twice in a pool", param="workers")
        for worker in self.workers:
            self.check_group(worker)
        for url in self.discover:
            DnsTarget.parse(url)

    def check_group(self, worker: WorkerSpec) -> None:
        """A `long` worker needs `long_prompt_tokens`: without it no prompt is long, and
        the worker got requests only when every short worker was down. A `prefill` or
        `decode` worker needs a disaggregated pool (`pd`): without it the role was
        ignored, and a prefill worker got whole requests."""
        if worker.group == LONG and self.long_prompt_tokens is None:
            raise InvalidRequestError(f"worker {worker.url} is in group 'long', but the pool "
                                      "has no long_prompt_tokens (--long-prompt-tokens)",
                                      param="long_prompt_tokens")
        if worker.role in (PREFILL, DECODE) and self.pd is None:
            raise InvalidRequestError(f"worker {worker.url} has role {worker.role!r}, but the "
                                      "pool is not disaggregated (pd, --pd-mode)", param="role")

    @property
    def names(self) -> tuple[str, ...]:
        return ((self.model,) if self.model else ()) + self.aliases


# --- multi-LoRA placement and model aliases (router/adapters.py, router/cascade.py) ------


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter the router may load on workers (POST /v1/load_lora_adapter).

    `base`: the model (pool) it applies to; None: the only pool. `pinned`: loaded on
    every worker of the pool (else on demand, up to `max_adapter_replicas`)."""

    name: str
    path: str
    base: str | None = None
    pinned: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.path:
            raise InvalidRequestError("an adapter needs a 'name' and a 'path'", param="name")


@dataclass(frozen=True)
class AdapterPlacement:
    """How the router spreads adapters over a pool's workers (router/adapters.py).

    `max_adapter_replicas`: workers one adapter may be loaded on (pinned ones: all).
    `adapters_per_worker`: adapters the router keeps on one worker; None: the worker's
    `max_lora` (from `vllm:lora_requests_info`). `load_s`: prior for the seconds a load
    costs (then learned from the loads' durations). A replica stays at least
    `min_residency_s` before it may be evicted for another adapter, and an extra replica
    idle for `idle_unload_s` is unloaded. `sync_interval_s`: how often the workers'
    adapters are read back (restarts and new workers are noticed then).
    """

    max_adapter_replicas: int = 2
    adapters_per_worker: int | None = None
    load_s: float = 0.5
    min_residency_s: float = 30.0
    idle_unload_s: float = 300.0
    sync_interval_s: float = 2.0

    def __post_init__(self) -> None:
        check_finite(self)
        if self.max_adapter_replicas < 1:
            raise InvalidRequestError("max_adapter_replicas must be >= 1",
                                      param="max_adapter_replicas")
        if self.adapters_per_worker is not None and self.adapters_per_worker < 1:
            raise InvalidRequestError("adapters_per_worker must be >= 1",
                                      param="adapters_per_worker")
        if min(self.load_s, self.min_residency_s, self.idle_unload_s) < 0 \
                or self.sync_interval_s <= 0:
            raise InvalidRequestError("adapter placement times must be >= 0 "
                                      "(sync_interval_s > 0)", param="adapter_placement")


@dataclass(frozen=True)
class CascadeSpec:
    """`policy: cascade`: the small model first, the large one when a rule says so.

    Before the small model (prompt features): more than `max_prompt_tokens` (estimated
    at 4 characters a token), any of `keywords` (case-insensitive), or the offline
    `classifier` (a JSON logistic regression on hashed words, router/cascade.py;
    "builtin": the one shipped) giving P(hard) >= `classifier_threshold`. After it:
    the mean token logprob of its answer (non-streamed) or of its first `hold_tokens`
    tokens (streamed, held back meanwhile) below `min_mean_logprob`."""

    small: str
    large: str
    max_prompt_tokens: int | None = None
    keywords: tuple[str, ...] = ()
    classifier: str | None = None
    classifier_threshold: float = 0.5
    min_mean_logprob: float | None = None
    hold_tokens: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "keywords", tuple(k.lower() for k in self.keywords))
        if not self.small or not self.large:
            raise InvalidRequestError("a cascade needs 'small' and 'large'", param="small")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 0:
            raise InvalidRequestError("max_prompt_tokens must be >= 0", param="max_prompt_tokens")
        if not 0.0 <= self.classifier_threshold <= 1.0:
            raise InvalidRequestError("classifier_threshold must be in [0, 1]",
                                      param="classifier_threshold")
        if self.hold_tokens < 1:
            raise InvalidRequestError("hold_tokens must be >= 1", param="hold_tokens")


@dataclass(frozen=True)
class AliasSpec:
    """A model name the router answers to: another model's (`target`, which may be an
    adapter or another pool's model), or a cascade (`cascade`)."""

    name: str
    target: str | None = None
    cascade: CascadeSpec | None = None

    def __post_init__(self) -> None:
        if (self.target is None) == (self.cascade is None):
            raise InvalidRequestError(f"alias {self.name!r} needs a target or a cascade, "
                                      "not both", param="aliases")
        if not self.name or self.target == "":
            raise InvalidRequestError(f"an alias needs a name and a target, got "
                                      f"{self.name!r} -> {self.target!r}", param="aliases")

    @property
    def targets(self) -> tuple[str, ...]:
        """The model names a request for this alias is routed as."""
        if self.cascade is not None:
            return (self.cascade.small, self.cascade.large)
        return (self.target,) if self.target is not None else ()


def check_alias_cycles(aliases: Sequence[AliasSpec]) -> None:
    """Refuse aliases that lead back to themselves (`a -> b -> a`, a cascade whose small
    or large model is itself): a request for one was routed as the next, forever, and
    answered 500 after Python's recursion limit."""
    by_name = {a.name: a.targets for a in aliases}

    def walk(name: str, path: tuple[str, ...]) -> None:
        for target in by_name.get(name, ()):
            if target in path:
                cycle = " -> ".join((*path[path.index(target):], target))
                raise InvalidRequestError(f"aliases form a cycle: {cycle}", param="aliases")
            walk(target, (*path, target))

    for name in by_name:
        walk(name, (name,))


def check_adapter_bases(adapters: Sequence[AdapterSpec], pools: Sequence[PoolConfig]) -> None:
    """Refuse an adapter whose `base` no pool serves (a typo): it was accepted, listed in
    /v1/models, never loaded, and each request for it was a 404 naming the base. Checked
    where every pool names its model; one with `model: null` serves what its workers
    list, known only once they answer, and no pools yet (the --worker flags add one)
    leaves the check to the config that has them."""
    if not pools or any(not p.model for p in pools):
        return
    served = {name for p in pools for name in p.names}
    for spec in adapters:
        if spec.base is not None and spec.base not in served:
            raise InvalidRequestError(f"adapter {spec.name!r}: no pool serves its base model "
                                      f"{spec.base!r} (the pools serve "
                                      f"{', '.join(sorted(served))})", param="base")


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router process needs; `build_app(config)` reads nothing else."""

    pools: tuple[PoolConfig, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    admin_key: str | None = None  # None: /admin answers 403 (closed by default)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    scrape_interval_s: float = 0.5
    health_interval_s: float = 1.0
    discovery_interval_s: float = 5.0  # pools' `discover` names re-resolved this often
    eject_after_failures: int = 3
    readmit_after_successes: int = 1
    max_retries: int = 2
    migration_limit: int = 3  # mid-stream resumes per request on other workers; 0: off
    # requests silent this long on a worker whose probes time out are cut (monitor.py)
    stalled_stream_timeout_s: float = 10.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    max_connections: int = 1024
    tokenize_cache_size: int = 4096
    prefix_index_blocks: int = 200_000
    predicted_block_ttl_s: float = 10.0
    seed: int | None = None
    # requests held while a pool has no ready worker (scale from zero); 0 s: answer 503
    buffer_timeout_s: float = 0.0
    buffer_max_requests: int = 256
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    adapters: tuple[AdapterSpec, ...] = ()
    adapter_placement: AdapterPlacement = field(default_factory=AdapterPlacement)
    aliases: tuple[AliasSpec, ...] = ()

    def __post_init__(self) -> None:
        check_finite(self)
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be an integer in 0..65535, got {self.port!r}",
                                      param="port")
        if self.max_retries < 0:
            raise InvalidRequestError("max_retries must be >= 0", param="max_retries")
        if self.migration_limit < 0:
            raise InvalidRequestError("migration_limit must be >= 0", param="migration_limit")
        if self.eject_after_failures < 1 or self.readmit_after_successes < 1:
            raise InvalidRequestError("eject/readmit counts must be >= 1",
                                      param="eject_after_failures")
        if self.max_body_bytes < 1:
            raise InvalidRequestError("max_body_bytes must be positive", param="max_body_bytes")
        if self.scrape_interval_s <= 0 or self.health_interval_s <= 0:
            raise InvalidRequestError("intervals must be positive", param="scrape_interval_s")
        check_number("discovery_interval_s", self.discovery_interval_s, "must be > 0",
                     lambda v: v > 0)
        check_number("buffer_timeout_s", self.buffer_timeout_s, "must be >= 0", lambda v: v >= 0)
        check_number("stalled_stream_timeout_s", self.stalled_stream_timeout_s, "must be > 0",
                     lambda v: v > 0)
        check_alias_cycles(self.aliases)
        check_adapter_bases(self.adapters, self.pools)
        if self.buffer_max_requests < 0:
            raise InvalidRequestError("buffer_max_requests must be >= 0",
                                      param="buffer_max_requests")

    def with_overrides(self, **changes: Any) -> RouterConfig:
        """A copy with the non-None `changes` applied (CLI flags over a config file)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def _worker_from(raw: str | Mapping[str, Any]) -> WorkerSpec:
    if isinstance(raw, str):
        return WorkerSpec(url=raw)
    return WorkerSpec(**_known(WorkerSpec, raw, "worker"))


def _known(cls: type, raw: Mapping[str, Any], what: str) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise InvalidRequestError(f"unknown {what} option(s): {', '.join(unknown)}",
                                  param=unknown[0])
    return dict(raw)


def admission_from_dict(raw: Mapping[str, Any]) -> AdmissionConfig:
    """An AdmissionConfig from YAML/JSON (band keys may be strings: JSON has no int keys)."""
    data = _known(AdmissionConfig, raw, "admission")
    if "default_band" in data:
        data["default_band"] = BandLimits(**_known(BandLimits, data["default_band"], "band"))
    try:
        data["bands"] = {int(k): BandLimits(**_known(BandLimits, v, "band"))
                         for k, v in data.get("bands", {}).items()}
    except (TypeError, ValueError, AttributeError):
        raise InvalidRequestError("bands maps integer priorities to {capacity, timeout_s}",
                                  param="bands") from None
    return AdmissionConfig(**data)


def pool_from_dict(raw: Mapping[str, Any]) -> PoolConfig:
    data = _known(PoolConfig, raw, "pool")
    data["workers"] = tuple(_worker_from(w) for w in data.get("workers", ()))
    data["aliases"] = tuple(data.get("aliases", ()))
    data["discover"] = tuple(data.get("discover", ()))
    if data.get("admission") is not None:
        data["admission"] = admission_from_dict(data["admission"])
    if "release" in data:
        data["release"] = ReleaseConfig(**_known(ReleaseConfig, data["release"] or {}, "release"))
    if data.get("pd") is not None:
        data["pd"] = PDConfig(**_known(PDConfig, data["pd"], "pd"))
    return PoolConfig(**data)


def router_from_dict(raw: Mapping[str, Any]) -> RouterConfig:
    data = _known(RouterConfig, raw, "router")
    data["pools"] = tuple(pool_from_dict(p) for p in data.get("pools", ()))
    if "admission" in data:
        data["admission"] = admission_from_dict(data["admission"])
    if "breaker" in data:
        data["breaker"] = BreakerConfig(**_known(BreakerConfig, data["breaker"], "breaker"))
    if "adapters" in data:
        data["adapters"] = tuple(AdapterSpec(**_known(AdapterSpec, a, "adapter"))
                                 for a in data["adapters"] or ())
    if "adapter_placement" in data:
        data["adapter_placement"] = AdapterPlacement(
            **_known(AdapterPlacement, data["adapter_placement"] or {}, "adapter_placement"))
    if "aliases" in data:
        data["aliases"] = aliases_from(data["aliases"] or {})
    return RouterConfig(**data)


def aliases_from(raw: Mapping[str, Any]) -> tuple[AliasSpec, ...]:
    """`{NAME: TARGET}` or `{NAME: {policy: cascade, small, large, ...rules}}`."""
    out = []
    for name, spec in raw.items():
        if isinstance(spec, str):
            out.append(AliasSpec(name, target=spec))
            continue
        if not isinstance(spec, Mapping) or spec.get("policy") != "cascade":
            raise InvalidRequestError(f"alias {name!r}: a model name or "
                                      "{policy: cascade, small, large, ...}", param="aliases")
        rules = {k: v for k, v in spec.items() if k != "policy"}
        if "keywords" in rules:
            rules["keywords"] = tuple(rules["keywords"])
        out.append(AliasSpec(name, cascade=CascadeSpec(**_known(CascadeSpec, rules, "cascade"))))
    return tuple(out)


def parse_alias_flags(items: Sequence[str]) -> tuple[AliasSpec, ...]:
    """`NAME=TARGET` pairs from `--alias` (a bare NAME names the --worker pool instead)."""
    return tuple(AliasSpec(name, target=target)
                 for name, _, target in (i.partition("=") for i in items if "=" in i))


def load_config_file(path: str | Path) -> RouterConfig:
    """Read a YAML (.yaml/.yml) or JSON router config file. Every way it can be wrong
    (unreadable, not YAML/JSON, not a mapping, a value of the wrong shape) is an
    InvalidRequestError, so `sluice router` says so in one line."""
    import yaml

    try:
        text = Path(path).read_text()
        raw = (yaml.safe_load(text) or {}) if str(path).endswith((".yaml", ".yml")) \
            else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise InvalidRequestError(f"config file {path}: {exc}", param="config") from exc
    if not isinstance(raw, Mapping):
        raise InvalidRequestError(f"config file {path}: the settings must be a mapping, got "
                                  f"{type(raw).__name__}", param="config")
    try:
        return router_from_dict(raw)
    except InvalidRequestError:  # names the setting
        raise
    except (TypeError, AttributeError, ValueError) as exc:  # a value of the wrong shape
        raise InvalidRequestError(f"config file {path}: {exc}", param="config") from exc


def parse_kv_event_flags(items: Sequence[str]) -> dict[str, str]:
    """`URL=tcp://host:port` pairs from `--worker-kv-events` into {url: endpoint}."""
    out: dict[str, str] = {}
    for item in items:
        url, sep, endpoint = item.partition("=")
        if not sep or not endpoint:
            raise InvalidRequestError(f"--worker-kv-events wants URL=tcp://host:port, got {item!r}",
                                      param="worker-kv-events")
        if url.rstrip("/") in out:  # the last one was taken, the others dropped unsaid
            raise InvalidRequestError(f"--worker-kv-events gives {url} twice",
                                      param="worker-kv-events")
        out[url.rstrip("/")] = endpoint
    return out


def parse_tenant_pins(items: Sequence[str]) -> dict[str, str]:
    """`TENANT=VERSION` pairs from `--pin-tenant` into {tenant: version}."""
    out: dict[str, str] = {}
    for item in items:
        tenant, sep, version = item.partition("=")
        if not sep or not tenant or not version:
            raise InvalidRequestError(f"--pin-tenant wants TENANT=VERSION, got {item!r}",
                                      param="pin-tenant")
        out[tenant] = version
    return out
