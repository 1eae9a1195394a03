"""Authenticated keys kept in process, checked against the store's auth version.

Looking a key up costs a join and two settings parses (~140 us on SQLite, a round trip
on PostgreSQL) on every request. The answer only changes when a key is revoked or a
tenant's settings change, and the store bumps one counter row (`Store.auth_version`)
in the same transaction as each such change, on whichever replica or CLI made it. So:

    version = store.auth_version()          # one primary-key read, ~5 us on SQLite
    entry   = cache[sha256(key)]
    entry.version == version  ->  entry.principal           (no join, no parse)
    otherwise                 ->  store.authenticate(key), cached at `version`

The version is read *before* the lookup, so a change that commits between the two
leaves the entry stale-tagged and the next request reads the store again. A revoked
key is refused on every replica sharing the store from the next request on.

Where the version read is a network round trip (PostgreSQL), requests share reads
(`VersionReads`): a request waits for the next read that *starts after it arrived*, so
it sees every change committed before it arrived, exactly as a read of its own would;
the requests that arrive while one read runs are all answered by the next one. At
1,000 req/s that is one round trip on a worker thread per read in flight, not one per
request.

With a Redis limiter the version is not read from the store at all: it is mirrored in
Redis and read by the step that admits the request (`auth_mirror.py`). The cached
answer is used at once and confirmed by that step (`Mirror`); an answer found stale
there is dropped, its admission undone, and the request admitted again on a fresh one.

Not cached: unknown or revoked keys (nothing to reuse), and tenants with a budget or a
soft budget, whose `spend_usd` changes with every request and is read at admission.
Any change bumps the one counter, so it empties every replica's cache at once; changes
are rare next to requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sluice.gateway import auth_mirror
from sluice.gateway.keys import hash_key
from sluice.gateway.store import Principal, SQLStore, Store

logger = logging.getLogger(__name__)

MAX_ENTRIES = 10_000


@dataclass(frozen=True, slots=True)
class _Entry:
    version: int
    principal: Principal


class KeyCache:
    """`authenticate` with a cache (see the module docstring). Synchronous: call it on
    a worker thread unless `inline` (the version read is a local file read), in which
    case `cached` may run on the event loop. Mutates only its own dict."""

    def __init__(self, store: Store, max_entries: int = MAX_ENTRIES) -> None:
        self.store = store
        self.max_entries = max_entries
        self.inline = store.local_reads
        self.versions = VersionReads(store.auth_version)
        self.mirror: Mirror | None = None  # `use_mirror`
        self._entries: dict[str, _Entry] = {}

    def use_mirror(self, url: str) -> str | None:
        """Mirror the store's auth version in Redis at `url` (`auth_mirror.py`): returns
        the key the limiter's step reads, or None where the store has no version to
        mirror (SQLite reads it locally; other stores keep their reads) or Redis does
        not answer now: a registration nobody can reach made every change, from any
        process, fail with a 503 for an hour (`auth_mirror.STALE_S`), so this gateway
        reads the store's version instead, for its life."""
        if self.inline or not isinstance(self.store, SQLStore):
            return None
        if not auth_mirror.reachable(url):
            logger.warning("auth mirror not used: Redis at %s does not answer; the auth "
                           "version is read from the database per request (restart the "
                           "gateway once Redis is up)", url)
            return None
        key, version = self.store.register_auth_mirror(url)
        try:
            self.store.tell_auth_mirror(url, key, version)
        except Exception as exc:  # requests read the store's version until a check seeds it
            logger.warning("auth mirror %s not seeded: %s", url, exc)
        self.mirror = Mirror(url, key, self.store)
        return key

    def entry(self, plaintext: str) -> tuple[Principal, int] | None:
        """The cached (principal, version it was read at), whatever the version now."""
        entry = self._entries.get(hash_key(plaintext))
        return None if entry is None else (entry.principal, entry.version)

    def cached(self, plaintext: str, version: int | None = None) -> Principal | None:
        """The cached principal if still current at the store's version (`version`: one
        read for this request, `VersionReads`; None: read it now), else None (a miss:
        ask `authenticate`)."""
        entry = self._entries.get(hash_key(plaintext))
        if entry is None:
            return None
        if entry.version == (self.store.auth_version() if version is None else version):
            return entry.principal
        return None

    def authenticate(self, plaintext: str) -> Principal | None:
        """`Store.authenticate`, answered from the cache while the version holds."""
        digest = hash_key(plaintext)
        version = self.store.auth_version()
        entry = self._entries.get(digest)
        if entry is not None and entry.version == version:
            return entry.principal
        principal = self.store.authenticate(plaintext)
        if principal is None or reads_spend(principal):
            self._entries.pop(digest, None)
            return principal
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[digest] = _Entry(version, principal)
        return principal


class VersionReads:
    """`read()` (blocking: a worker thread runs it) shared by the requests waiting for it.

    `await current()` returns the result of a read that started after the call: one read
    runs at a time; callers that arrive meanwhile wait together for the next. Mutates
    only its own waiters list; one event loop at a time (a new loop starts afresh)."""

    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read
        self._waiting: list[asyncio.Future[int]] = []
        self._task: asyncio.Task[None] | None = None

    async def current(self) -> int:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[int] = loop.create_future()
        self._waiting.append(waiter)
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._run())
        return await waiter

    async def _run(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []  # all arrived before this read starts
            try:
                version = await asyncio.to_thread(self.read)
            except Exception as exc:
                for waiter in batch:
                    if not waiter.done():
                        waiter.set_exception(exc)
                continue
            for waiter in batch:
                if not waiter.done():
                    waiter.set_result(version)


def reads_spend(principal: Principal) -> bool:
    """Admission reads this tenant's spend, which changes with every request."""
    s = principal.tenant.settings
    return s.budget_usd is not None or s.soft_budget_usd is not None


class Mirror:
    """The auth version's Redis mirror as one gateway uses it: the key its limiter reads,
    and `check`, which raises the mirror to the store's version at most every
    `auth_mirror.CHECK_EVERY_S` (a change whose process could not reach Redis, a key lost
    with a Redis restart) and marks the registration in use every
    `auth_mirror.TOUCH_EVERY_S`, off the requests' path."""

    def __init__(self, url: str, key: str, store: SQLStore,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url, self.key, self.store = url, key, store
        self.clock = clock
        self._last = self._touched = clock()
        self._task: asyncio.Task[None] | None = None

    def check(self) -> None:
        now = self.clock()
        if now - self._last < auth_mirror.CHECK_EVERY_S or (
                self._task is not None and not self._task.done()):
            return
        self._last = now
        touch = now - self._touched >= auth_mirror.TOUCH_EVERY_S
        if touch:
            self._touched = now
        self._task = asyncio.get_running_loop().create_task(self._raise(touch))

    async def _raise(self, touch: bool) -> None:
        try:
            if touch:  # before the version read: a re-registration is then covered by it
                await asyncio.to_thread(self.store.touch_auth_mirror, self.url, self.key)
            version = await asyncio.to_thread(self.store.auth_version)
            await asyncio.to_thread(self.store.tell_auth_mirror, self.url, self.key, version)
        except Exception as exc:  # the store or Redis down: requests fail on their own
            logger.debug("auth mirror check failed: %s", exc)
