"""Workers found by DNS: one worker per address a name resolves to.

A Kubernetes headless Service (`clusterIP: None`) resolves to one A record per ready
pod; behind an ordinary Service's one virtual IP, kube-proxy spreads connections over
the pods, so the router could neither route a prompt to the pod that holds its prefix
nor read each pod's load. `DnsDiscovery` re-resolves the name every `interval_s` and
keeps the pool's discovered workers equal to the addresses (vllm-router's and
sglang-router's `--service-discovery` do the same through the Kubernetes API; DNS needs
no RBAC and works with any resolver, Consul's and docker compose's included):

- a new address joins as `scheme://ADDRESS:PORT` (`RouterState.add_worker`: it takes
  requests once a health probe answered); an IPv6 one as `scheme://[ADDRESS]:PORT`, a
  link-local one with its zone, `http://[fe80::1%eth0]:8000` (the form the probes'
  httpx and upstream.Target connect to; RFC 6874's `%25eth0` neither resolves);
- an address that is gone (its pod not ready, or terminating) stops getting requests
  at once (draining) and leaves the pool when its in-flight requests have finished, or
  after `grace_s`; one that comes back within that time is routed to again;
- a name with no addresses (NXDOMAIN: a headless Service with no ready pod) empties the
  discovered set, a pool at zero that the router's buffer holds requests for; a resolver
  that fails (timeout, SERVFAIL) changes nothing until it answers again.

Workers configured by URL are not touched.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sluice.protocol.errors import SluiceError
from sluice.router.config import DnsTarget, WorkerSpec
from sluice.router.pool import Pool
from sluice.router.state import RouterState

log = logging.getLogger("sluice.router.discovery")

Resolve = Callable[[str, int], Awaitable[list[str]]]
NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (IPv4 and IPv6); [] when the name has none. An
    IPv6 address with a scope (link-local) keeps its zone, `fe80::1%eth0`: without it
    the address cannot be reached."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in NO_SUCH_NAME:
            return []
        raise
    return sorted({_with_zone(info[4]) for info in infos})


def _with_zone(sockaddr: tuple[Any, ...]) -> str:
    """`getaddrinfo`'s address; for IPv6 with a scope id, `ADDRESS%ZONE` (the interface's
    name, else the id: RFC 4007)."""
    address = str(sockaddr[0])
    scope = sockaddr[3] if len(sockaddr) == 4 else 0
    if not scope or "%" in address:
        return address
    try:
        return f"{address}%{socket.if_indextoname(scope)}"
    except OSError:  # no interface of that index here: the number is a zone too
        return f"{address}%{scope}"


class DnsDiscovery:
    """Keeps `pool`'s discovered workers equal to `target`'s addresses (module doc)."""

    def __init__(self, state: RouterState, pool: Pool, target: DnsTarget, *,
                 interval_s: float = 5.0, grace_s: float = 60.0,
                 resolve: Resolve = resolve_addresses,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state, self.pool, self.target = state, pool, target
        self.interval_s, self.grace_s = interval_s, grace_s
        self.resolve, self.clock = resolve, clock
        self.found: set[str] = set()  # URLs this discovery added, still in the pool
        self.gone_at: dict[str, float] = {}  # URL -> when its address disappeared

    async def sync(self) -> None:
        """One round: resolve, add the new addresses, drain the vanished, remove the
        drained. A resolver error is raised and changes nothing."""
        addresses = await self.resolve(self.target.host, self.target.port)
        self.found &= self.pool.endpoints.keys()  # removed by someone else (admin API)
        wanted = {self.target.url(a) for a in addresses}
        for url in sorted(wanted - self.found):
            await self._add(url)
        self.found &= self.pool.endpoints.keys()  # (again: the adds awaited probes)
        for url in sorted(self.found & wanted):
            if self.gone_at.pop(url, None) is not None:  # came back
                self.pool.endpoints[url].draining = False
                log.info("discovered worker %s is back", url)
        now = self.clock()
        for url in sorted(self.found - wanted):
            endpoint = self.pool.endpoints.get(url)
            if endpoint is None:  # removed elsewhere while this round awaited
                self.found.discard(url)
                self.gone_at.pop(url, None)
                continue
            if url not in self.gone_at:
                self.gone_at[url] = now
                endpoint.draining = True
                log.info("discovered worker %s is gone from %s: draining", url, self.target.host)
            if endpoint.inflight == 0 or now - self.gone_at[url] >= self.grace_s:
                await self.state.remove_worker(url)
                self.found.discard(url)
                self.gone_at.pop(url, None)
                log.info("discovered worker %s removed", url)

    async def _add(self, url: str) -> None:
        if url in self.pool.endpoints:  # configured by URL as well: not ours to manage
            return
        try:
            await self.state.add_worker(WorkerSpec(url), self.pool.config.model, self.pool)
        except SluiceError as exc:  # e.g. it serves another model: try again next round
            log.warning("discovered worker %s not added: %s", url, exc)
            return
        self.found.add(url)
        log.info("discovered worker %s (%s)", url, self.target.host)

    async def first_sync(self) -> None:
        """The first round, before the router listens; a failure is logged (the name may
        not resolve until the first pod is ready) and `run` tries again."""
        try:
            await self.sync()
        except (OSError, SluiceError) as exc:
            log.warning("discovering workers at %s failed: %s", self.target.host, exc)

    async def run(self) -> None:
        """`sync` every `interval_s` until cancelled; a failed round is logged and keeps
        the last set."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.first_sync()
