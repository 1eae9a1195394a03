"""All of one router's state, created in the app's lifespan and passed down (no globals).

    RouterState
     ├── pools            model name → Pool (endpoints, policy, prefix indexes)
     ├── upstream         raw keep-alive worker connections: the one upstream client
     ├── client           httpx over `upstream` (probes, scrapes, /tokenize)
     ├── proxy            retries, streaming relay, passive health
     ├── monitor          active health probes, /metrics scraping
     ├── tokenizer        prompt → token ids (local or worker /tokenize), cached
     ├── subscribers      one KV-event task per publishing worker
     ├── buffer           requests held while a pool has no ready worker
     ├── admission        per-pool admission queues (priority bands, tenant fairness)
     ├── breakers         per-worker circuit breakers, retry backoff and budget
 ├── releases         each pool's canary weight, pins, shadow and judge (release.py)
     ├── pd               prefill/decode disaggregation: roles, the two-step flow (pd.py)
     ├── adapters         which worker holds which LoRA adapter, loads/unloads (adapters.py)
     ├── aliases          model aliases and cascades (cascade.py)
     ├── metrics          the router's own Prometheus registry
     └── tracing          OpenTelemetry tracer, or None (off)
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
import zmq.asyncio

from sluice.observe.buckets import LatencyBuckets
from sluice.observe.tracing import Tracing
from sluice.protocol.errors import (
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
    SluiceError,
)
from sluice.protocol.prompt import IdsHint, TokenCache
from sluice.router.adapters import Adapters
from sluice.router.admission import Admission, AdmissionCollector, pool_label
from sluice.router.breaker import BreakerCollector, Breakers
from sluice.router.buffer import RequestBuffer
from sluice.router.cascade import Aliases
from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec
from sluice.router.endpoints import Endpoint
from sluice.router.kv_subscriber import KVEventSubscriber
from sluice.router.metrics import RouterMetrics
from sluice.router.monitor import Monitor
from sluice.router.parse import ParsedRequest
from sluice.router.pd import PD
from sluice.router.policies import RequestMeta
from sluice.router.pool import Pool
from sluice.router.proxy import Proxy
from sluice.router.release import Releases
from sluice.router.tokens import LocalTokenizer, PromptTokenizer, Tokenized
from sluice.router.transport import UpstreamTransport
from sluice.router.upstream import UpstreamPool

CHARS_PER_TOKEN = 4  # prompt-length estimate when no tokenizer answers


@dataclass
class RouterState:
    config: RouterConfig
    rng: random.Random
    local_tokenizers: Mapping[str, LocalTokenizer] = field(default_factory=dict)
    pools: list[Pool] = field(default_factory=list)
    transient: set[Pool] = field(default_factory=set)  # made by the admin API: see
    # `pool_for_admin`; dropped when empty
    subscribers: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    token_cache: TokenCache | None = None  # shared with the gateway in one process
    transport: httpx.AsyncBaseTransport | None = None  # tests: a mock for probes/scrapes
    tracing: Tracing | None = None  # OpenTelemetry, when on (observe/tracing.py)
    buckets: LatencyBuckets = field(default_factory=LatencyBuckets)

    def __post_init__(self) -> None:
        self.metrics = RouterMetrics(lambda: self.pools, self.buckets)
        self.upstream = UpstreamPool(self.config.connect_timeout_s, self.config.read_timeout_s,
                                     max_idle_per_host=self.config.max_connections)
        # the one upstream client: probes, scrapes and /tokenize share the proxy's pool
        self.client = make_client(self.config, self.transport or UpstreamTransport(self.upstream))
        transitions = self.metrics.breaker_transitions
        self.breakers = Breakers(self.config.breaker,
                                 lambda url, a, b: transitions.labels(url, a, b).inc(),
                                 rng=random.Random(self.config.seed))  # jitter: not the policy's
        self.admission = Admission(self.config.admission, self.breakers.blocked,
                                   self.metrics.admission_wait_seconds,
                                   self.metrics.admission_shed)
        self.metrics.registry.register(AdmissionCollector(self.admission))
        self.metrics.registry.register(BreakerCollector(self.breakers, lambda: self.pools))
        self.proxy = Proxy(self.upstream, self.metrics, self.config.max_retries,
                           self.config.eject_after_failures, self.breakers)
        self.monitor = Monitor(self.client, lambda: self.pools, self.metrics,
                               timeout_s=self.config.connect_timeout_s,
                               eject_after=self.config.eject_after_failures,
                               readmit_after=self.config.readmit_after_successes,
                               on_hung=lambda endpoint: self.proxy.cut_stalled(
                                   endpoint, self.config.stalled_stream_timeout_s))
        self.tokenizer = PromptTokenizer(
            self.client, self.token_cache or TokenCache(self.config.tokenize_cache_size),
            timeout_s=self.config.connect_timeout_s)
        self.zmq_ctx = zmq.asyncio.Context()
        self.buffer = RequestBuffer(self.config.buffer_max_requests, self.config.buffer_timeout_s)
        self.releases = Releases(lambda: self.pools, self.upstream, self.breakers,
                                 self.metrics.registry, self.rng)
        self.pd = PD(self.client, self.upstream, self.metrics, self.config.max_retries,
                     self.config.eject_after_failures, self.breakers, self.buckets)
        self.adapters = Adapters(self.config.adapters, self.config.adapter_placement,
                                 self.client, lambda: self.pools, self.metrics.registry,
                                 read_timeout_s=self.config.connect_timeout_s)
        self.aliases = Aliases(self.config.aliases)
        for pool_config in self.config.pools:
            self.add_pool(pool_config)

    # --- pools and workers ----------------------------------------------------------------

    def add_pool(self, pool_config: PoolConfig) -> Pool:
        pool = Pool(pool_config, self.rng, self.config.prefix_index_blocks,
                    self.config.predicted_block_ttl_s)
        self.pools.append(pool)
        return pool

    def resolve(self, model: str) -> Pool:
        """The pool serving `model` (404 naming it if none)."""
        for pool in self.pools:
            if pool.serves(model):
                return pool
        holders = self.adapters.holders(model)  # an adapter loaded since discovery
        for pool in self.pools:
            if holders and holders[0] in pool.endpoints:
                return pool
        if model in self.adapters.specs:  # a registered adapter no worker holds yet
            base = self.adapters.base_of(model)
            if base is not None:
                return self.resolve(base)
            if len(self.pools) == 1:
                return self.pools[0]
        raise NotFoundError(f"The model `{model}` does not exist.", param="model")

    def pool_for_admin(self, model: str | None) -> Pool:
        """The pool a worker added at runtime joins: the one serving `model` (the only
        one, when `model` is None), else a new one, which lasts only while it has workers
        (`add_worker`, `remove_worker`)."""
        if model is not None:
            for pool in self.pools:
                if pool.serves(model):
                    return pool
            return self._add_transient_pool(PoolConfig(model=model,
                                                       policy=self._default_policy()))
        if len(self.pools) == 1:
            return self.pools[0]
        if not self.pools:
            return self._add_transient_pool(PoolConfig(policy=self._default_policy()))
        raise InvalidRequestError("several pools exist: name the worker's 'model'", param="model")

    def _add_transient_pool(self, pool_config: PoolConfig) -> Pool:
        pool = self.add_pool(pool_config)
        self.transient.add(pool)
        return pool

    def _drop_if_empty(self, pool: Pool) -> None:
        """Forget a pool the admin API made once its last worker is gone (or its first
        could not join): its name is no model anyone configured, and an empty pool kept
        answering to it (listed by /v1/models, requests held, then 503) after a mistyped
        `model`. Configured pools stay, empty or not (scale from zero)."""
        if pool.endpoints or pool not in self.transient:
            return
        self.transient.discard(pool)
        self.pools.remove(pool)
        self.admission.queues.pop(id(pool), None)
        self.breakers.budgets.pop(id(pool), None)
        self.releases.by_pool.pop(pool, None)

    def _default_policy(self) -> str:
        return self.pools[0].config.policy if self.pools else "cost"

    def pd_role(self, pool: Pool, endpoint: Endpoint) -> str | None:
        """A worker's P/D role in a disaggregated pool, as the router last read it; None
        in a plain pool, where roles route nothing."""
        return self.pd.roles.get(endpoint).role if pool.config.pd is not None else None

    def find_endpoint(self, url: str) -> tuple[Pool, Endpoint]:
        for pool in self.pools:
            if url.rstrip("/") in pool.endpoints:
                return pool, pool.endpoints[url.rstrip("/")]
        raise NotFoundError(f"no worker {url}", param="url", code="worker_not_found")

    async def add_worker(self, spec: WorkerSpec, model: str | None,
                         pool: Pool | None = None) -> Endpoint:
        """Add a worker at runtime (POST /admin/workers); it takes requests once a health
        probe has answered (this one, else a later round). A worker is in one pool: a URL
        already in one is refused (400), whatever `model` names; so is one that serves
        none of the models its pool's other workers serve (without `model` it joins the
        only pool: another model's worker answered that pool's requests, under its own
        model's name)."""
        for other in self.pools:
            if spec.url in other.endpoints:
                raise InvalidRequestError(f"worker {spec.url} is already in the pool of "
                                          f"{pool_label(other)!r}", param="url")
        if pool is None:  # (given: DNS discovery's own)
            pool = self.pool_for_admin(model)
        try:
            endpoint = pool.add(spec)
        except SluiceError:
            self._drop_if_empty(pool)
            raise
        endpoint.hold_until_probed()
        self.start_subscriber(pool, endpoint)
        await self.monitor.probe(endpoint)
        if pool.foreign(endpoint):
            endpoint.draining = True  # (no request reaches it before it is gone)
            await self.remove_worker(endpoint.url)
            raise InvalidRequestError(
                f"worker {spec.url} serves {', '.join(endpoint.models)}, none of what the "
                f"pool of {pool_label(pool)!r} serves: name its 'model'", param="model")
        return endpoint

    async def remove_worker(self, url: str) -> Endpoint:
        pool, endpoint = self.find_endpoint(url)
        await self.stop_subscriber(endpoint.url)
        self.breakers.forget(endpoint.url)
        self.proxy.forget(endpoint.url)
        removed = pool.remove(endpoint.url)
        self._drop_if_empty(pool)
        return removed

    # --- KV events ------------------------------------------------------------------------

    def start_subscriber(self, pool: Pool, endpoint: Endpoint) -> None:
        if not endpoint.spec.kv_events or endpoint.url in self.subscribers:
            return
        counter = self.metrics.kv_events
        sub = KVEventSubscriber(self.zmq_ctx, endpoint.url, endpoint.spec.kv_events, pool.precise,
                                lambda kind: counter.labels(endpoint.url, kind).inc())
        self.subscribers[endpoint.url] = asyncio.create_task(sub.run())

    async def stop_subscriber(self, url: str) -> None:
        task = self.subscribers.pop(url, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # --- per request ----------------------------------------------------------------------

    async def request_meta(self, pool: Pool, req: ParsedRequest, hint: IdsHint | None = None
                           ) -> tuple[RequestMeta, IdsHint | None]:
        """Count (and, for prefix-aware policies, hash) the prompt's real tokens; also the
        hint that passes them on to the worker. `hint`: the previous hop's ids."""
        needs_tokens = pool.policy.uses_prefix or pool.config.long_prompt_tokens is not None
        found = await self._tokens(pool, req, hint) if needs_tokens else None
        tokens = found.tokens if found is not None else None
        salt = self.adapters.cache_salt(req.model)  # an adapter's KV is never the base's
        hashes = tokens.block_hashes(pool.block_size, salt) \
            if tokens and pool.policy.uses_prefix else ()
        if tokens is not None:
            n = len(tokens.ids)
        elif req.prompt_ids is not None:
            n = len(req.prompt_ids)
        else:
            n = req.approx_chars // CHARS_PER_TOKEN
        meta = RequestMeta(model=req.model, num_prompt_tokens=n, block_hashes=hashes,
                           session_key=req.session_key, max_tokens=req.max_tokens,
                           block_size=pool.block_size)
        return meta, found.hint if found is not None else None

    async def _tokens(self, pool: Pool, req: ParsedRequest, hint: IdsHint | None
                      ) -> Tokenized | None:
        local = self.local_tokenizers.get(pool.config.tokenizer or "")
        avail = [e for e in pool.endpoints.values() if e.available]
        worker = min(avail, key=lambda e: e.inflight) if avail else None
        model = pool.tokenizer_model(req.model, worker) if worker else req.model
        return await self.tokenizer.tokens(req, model, local, worker.url if worker else None,
                                           hint)

    def any_worker(self, model: str | None) -> tuple[Pool, Endpoint]:
        """A healthy worker for a pass-through call (/tokenize, /detokenize)."""
        if model is None and len(self.pools) != 1:
            raise InvalidRequestError("'model' is required: several models are served",
                                      param="model")
        pool = self.resolve(model) if model is not None else self.pools[0]
        avail = [e for e in pool.endpoints.values() if e.available]
        if not avail:
            raise ServiceUnavailableError(f"no healthy worker for model {model!r}",
                                          code="no_healthy_worker")
        return pool, min(avail, key=lambda e: e.inflight)

    async def close(self) -> None:
        await self.releases.close()
        for url in list(self.subscribers):
            await self.stop_subscriber(url)
        await self.client.aclose()
        self.upstream.close()
        self.zmq_ctx.term()


def make_client(config: RouterConfig, transport: httpx.AsyncBaseTransport) -> httpx.AsyncClient:
    """httpx over the router's upstream pool (`UpstreamTransport`), for control traffic."""
    timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s, pool=None)
    return httpx.AsyncClient(timeout=timeout, transport=transport)
