"""A pool: the workers serving one model, its policy, its prefix indexes.

`Pool.decide` is the router's hot path, on one screen:

    candidates (group for the prompt length, available, not yet tried)
      -> stats (+ cached-prefix blocks per worker when the policy uses them)
      -> policy.choose
      -> dispatch: count it in flight, predict its blocks in the indexes

Everything here runs on the event loop; nothing locks.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sluice.protocol.errors import InvalidRequestError, NotFoundError
from sluice.router.config import BASELINE, LONG, SHORT, PoolConfig, WorkerSpec
from sluice.router.endpoints import Endpoint, EndpointStats, Ticket, TTFTFit, work_units
from sluice.router.policies import Choice, RequestMeta, RoutingPolicy, make_policy
from sluice.router.policies.cost import uncached_tokens
from sluice.router.prefix_index import BlockIndex, TieredKVIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    endpoint: Endpoint
    choice: Choice
    stats: EndpointStats


class Pool:
    """Owns its endpoints, its policy instance and its two block indexes."""

    def __init__(self, config: PoolConfig, rng: random.Random, max_blocks: int = 200_000,
                 predicted_ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock` times predicted index entries and TTFTs (a simulation passes its own)."""
        self.config = config
        self.policy: RoutingPolicy = make_policy(config.policy, rng, config.policy_options)
        self.clock = clock
        self.fit = TTFTFit()  # TTFT against work, learned from all of the pool's workers
        self.approx = BlockIndex(max_blocks, clock)
        self.precise = TieredKVIndex(max_blocks, clock)
        self.predicted_ttl_s = predicted_ttl_s
        self.endpoints: dict[str, Endpoint] = {}
        self.on_finish: Callable[[], None] | None = None  # the admission queue's wake-up
        self.release_workers = 0  # canary and shadow workers: the pool has a release if > 0
        for spec in config.workers:
            self.add(spec)

    # --- membership -----------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def names(self) -> list[str]:
        """Model ids this pool answers to: configured names first, then discovered ones."""
        found = [m for e in self.endpoints.values() for m in e.models]
        return list(dict.fromkeys([*self.config.names, *found]))

    def serves(self, model: str) -> bool:
        return model in self.config.names or any(model in e.models for e in self.endpoints.values())

    def foreign(self, endpoint: Endpoint, *names: str | None) -> bool:
        """Whether `endpoint` serves another model: it lists models and none of those the
        pool's other workers list (nor `names`), while they list some. A pool's only
        worker is never foreign."""
        others = {m for e in self.endpoints.values() if e is not endpoint for m in e.models}
        return bool(endpoint.models and others) \
            and others.union(n for n in names if n).isdisjoint(endpoint.models)

    def add(self, spec: WorkerSpec) -> Endpoint:
        if spec.url in self.endpoints:
            raise InvalidRequestError(f"worker {spec.url} is already in the pool", param="url")
        self.config.check_group(spec)
        endpoint = self.endpoints[spec.url] = Endpoint(spec, fit=self.fit, clock=self.clock,
                                                       on_finish=self._finished)
        self.release_workers += spec.version != BASELINE
        return endpoint

    def _finished(self) -> None:
        """A request on one of the pool's workers ended: room for a waiting one."""
        if self.on_finish is not None:
            self.on_finish()

    def remove(self, url: str) -> Endpoint:
        endpoint = self.get(url)
        del self.endpoints[url]
        self.release_workers -= endpoint.spec.version != BASELINE
        self.fit.forget(url)
        self.approx.clear(url)
        self.precise.clear(url)
        return endpoint

    def get(self, url: str) -> Endpoint:
        endpoint = self.endpoints.get(url.rstrip("/"))
        if endpoint is None:
            raise NotFoundError(f"no worker {url} in this pool", param="url", code="worker_not_found")
        return endpoint

    # --- routing --------------------------------------------------------------------------

    def upstream_model(self, requested: str, endpoint: Endpoint) -> str:
        """The model id to send to `endpoint`: a name of the pool (its model, an alias,
        what another of its workers lists) is rewritten to what this worker serves; any
        other (an adapter no worker lists) goes as it is, so a worker without it answers
        404 instead of its base model answering in its place."""
        if not endpoint.models or requested in endpoint.models or not self.serves(requested):
            return requested
        return self.worker_model(endpoint)

    def tokenizer_model(self, requested: str, endpoint: Endpoint) -> str:
        """The model id to ask `endpoint`'s /tokenize for `requested`'s prompt: what the
        worker serves, whatever the name (an adapter shares its base model's tokenizer,
        and a worker refuses a model it does not hold)."""
        if not endpoint.models or requested in endpoint.models:
            return requested
        return self.worker_model(endpoint)

    def worker_model(self, endpoint: Endpoint) -> str:
        """The pool's model under the name `endpoint` serves it (it lists some)."""
        return self.config.model if self.config.model in endpoint.models else endpoint.models[0]

    def candidates(self, num_prompt_tokens: int, exclude: Iterable[str] = (),
                   version: str = BASELINE) -> list[Endpoint]:
        """Available workers of `version` and of the group for this prompt length (the
        other group if none)."""
        skip = set(exclude)
        # `available` and `url` spelled out: this runs over every worker on every decision.
        avail = [e for e in self.endpoints.values()
                 if e.healthy and not e.draining and e.spec.version == version
                 and e.spec.url not in skip]
        threshold = self.config.long_prompt_tokens
        wanted = LONG if threshold is not None and num_prompt_tokens > threshold else SHORT
        group = [e for e in avail if e.spec.group == wanted]
        return group or avail

    def decide(self, request: RequestMeta, exclude: Iterable[str] = ()) -> Decision | None:
        """Choose a worker for `request`, or None if no worker is available."""
        endpoints = self.candidates(request.num_prompt_tokens, exclude, request.version)
        if not endpoints:
            return None
        stats = self._stats(request, endpoints)
        choice = self.policy.choose(request, stats)
        url = choice.url
        chosen = next(s for s in stats if s.url == url)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %d tokens (%x) -> %s score %.4f | %s", request.num_prompt_tokens,
                      request.block_hashes[-1] if request.block_hashes else 0, choice.url,
                      choice.score, " | ".join(map(_describe, stats)))
        return Decision(self.endpoints[choice.url], choice, chosen)

    def _stats(self, request: RequestMeta, endpoints: list[Endpoint]) -> list[EndpointStats]:
        line = self.fit.line()  # the pool's, shared by its endpoints: fitted once
        if not (self.policy.uses_prefix and request.block_hashes):
            return [e.stats(0, None, 0, line) for e in endpoints]
        urls = [e.spec.url for e in endpoints]
        approx = self.approx.match(request.block_hashes, urls)
        precise = self.precise.match_tiers(request.block_hashes, [e.spec.url for e in endpoints
                                                                  if e.spec.kv_events])
        footprints = self.approx.footprints
        out = []
        for e, u in zip(endpoints, urls, strict=True):
            hit = precise.get(u)
            if hit is None:
                out.append(e.stats(approx[u], None, footprints.get(u, 0), line))
            else:
                device, total, load = hit
                out.append(e.stats(approx[u], device, footprints.get(u, 0), line,
                                   (total - device, load)))
        return out

    def dispatch(self, request: RequestMeta, decision: Decision) -> Ticket:
        """Count the request in flight on the chosen worker and predict its cached blocks."""
        endpoint, stats = decision.endpoint, decision.stats
        cached_blocks = decision.choice.cached_blocks
        uncached = uncached_tokens(request, cached_blocks)
        ticket = endpoint.begin(request.num_prompt_tokens, uncached, work_units(stats, uncached))
        if request.block_hashes:
            self.approx.store(endpoint.url, request.block_hashes)
            if endpoint.spec.kv_events:
                self.precise.store(endpoint.url, request.block_hashes, ttl=self.predicted_ttl_s)
        return ticket


def _describe(s: EndpointStats) -> str:
    """One candidate's view, for the debug log of each decision."""
    return (f"{s.url} cached {s.cached_blocks}/{s.kv_cached_blocks} queued "
            f"{s.queued_prefill_tokens:.0f} run {s.running:.0f} wait {s.waiting:.0f} "
            f"ext {s.external_waiting:.0f} spt {s.seconds_per_token * 1e3:.2f}ms "
            f"ovh {s.overhead_s * 1e3:.0f}ms")
