"""Which worker holds which KV blocks: an LRU-bounded map from block hash to workers.

One class serves both of the router's indexes:

- approximate (`prefix` policy): entries written when the router dispatches a request,
  with no expiry; the LRU bound forgets cold prefixes as the engines would;
- precise (`kv` and `cost` policies): entries written from the engines' KV events
  (`BlockStored` / `BlockRemoved` / `AllBlocksCleared`), plus *predicted* entries
  written at dispatch with a short TTL, which cover the lag between dispatch and the
  engine's event; a later `BlockStored` confirms them, a `BlockRemoved` drops them.

Block hashes are chained (`sluice.protocol.block_hash`), so a request's hit length on a
worker is the number of leading hashes that worker holds:

    request:   h0   h1   h2   h3
    worker A:  ✓    ✓    ✓    ·      -> 3 blocks cached
    worker B:  ✓    ·    ✓    ·      -> 1 (h2 without h1 cannot be reused)

Not thread-safe: the router touches it from its event loop only.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

CONFIRMED = math.inf  # expiry of an entry backed by a KV event or an approximate record


class BlockIndex:
    """block hash -> {worker url: expiry time}, least-recently-used hashes evicted first."""

    def __init__(self, max_blocks: int = 200_000, clock: Callable[[], float] = time.monotonic) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self._clock = clock
        self._blocks: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._counts: dict[str, int] = {}

    def footprint(self, url: str) -> int:
        """How many blocks `url` holds in the index (its share of the cached working set)."""
        return self._counts.get(url, 0)

    @property
    def footprints(self) -> Mapping[str, int]:
        """Every url's `footprint` (read-only; absent: 0), for a lookup per worker."""
        return self._counts

    def __len__(self) -> int:
        return len(self._blocks)

    def store(self, url: str, hashes: Iterable[int], ttl: float | None = None) -> None:
        """Record that `url` holds `hashes` (for `ttl` seconds if given, else until removed).

        A predicted entry never shortens a confirmed one.
        """
        expiry = CONFIRMED if ttl is None else self._clock() + ttl
        for h in hashes:
            holders = self._blocks.get(h)
            if holders is None:
                holders = self._blocks[h] = {}
            else:
                self._blocks.move_to_end(h)
            if url not in holders:
                self._counts[url] = self._counts.get(url, 0) + 1
            if holders.get(url, 0.0) < expiry:
                holders[url] = expiry
        while len(self._blocks) > self.max_blocks:
            _, evicted = self._blocks.popitem(last=False)
            for u in evicted:
                self._counts[u] -= 1

    def remove(self, url: str, hashes: Iterable[int]) -> None:
        """Forget that `url` holds `hashes` (a `BlockRemoved` event)."""
        for h in hashes:
            holders = self._blocks.get(h)
            if holders is None or holders.pop(url, None) is None:
                continue
            self._counts[url] -= 1
            if not holders:
                del self._blocks[h]

    def clear(self, url: str) -> None:
        """Forget everything about `url` (`AllBlocksCleared`, worker removed or restarted)."""
        for h in [h for h, holders in self._blocks.items() if url in holders]:
            holders = self._blocks[h]
            del holders[url]
            if not holders:
                del self._blocks[h]
        self._counts.pop(url, None)

    def match(self, hashes: Sequence[int], urls: Iterable[str]) -> dict[str, int]:
        """For each of `urls`, how many leading `hashes` it holds (expired entries miss).

        Touches matched hashes so that hot prefixes stay in the LRU.
        """
        counts = dict.fromkeys(urls, 0)
        now = self._clock()
        blocks = self._blocks
        alive: set[str] | None = None  # None: every one of `urls` (before the first hash)
        for i, h in enumerate(hashes):
            holders = blocks.get(h)
            if holders is None:
                break
            if alive is None:  # from the block's holders, not from all of `urls` (O(workers))
                alive = {u for u, expiry in holders.items() if expiry > now and u in counts}
            else:
                alive = {u for u in alive if holders.get(u, 0.0) > now}
            if not alive:
                break
            blocks.move_to_end(h)
            for u in alive:
                counts[u] = i + 1
        return counts
