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

Not cached: unknown or revoked keys (nothing to reuse), and tenants with a budget or a
soft budget, whose `spend_usd` changes with every request and is read at admission.
Any change bumps the one counter, so it empties every replica's cache at once; changes
are rare next to requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.gateway.keys import hash_key
from sluice.gateway.store import Principal, Store

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
        self._entries: dict[str, _Entry] = {}

    def cached(self, plaintext: str) -> Principal | None:
        """The cached principal if still current at the store's version, else None (a
        miss: ask `authenticate`)."""
        entry = self._entries.get(hash_key(plaintext))
        if entry is not None and entry.version == self.store.auth_version():
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


def reads_spend(principal: Principal) -> bool:
    """Admission reads this tenant's spend, which changes with every request."""
    s = principal.tenant.settings
    return s.budget_usd is not None or s.soft_budget_usd is not None
