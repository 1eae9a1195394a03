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
        blocks, counts = self._blocks, self._counts
        get, touch = blocks.get, blocks.move_to_end  # (every block of every dispatch)
        for h in hashes:
            holders = get(h)
            if holders is None:
                holders = blocks[h] = {}
            else:
                touch(h)
            held = holders.get(url)
            if held is None:
                counts[url] = counts.get(url, 0) + 1
                held = 0.0
            if held < expiry:
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

    def holds(self, url: str, h: int) -> bool:
        """Whether `url` holds block `h` (an unexpired entry); touches it if so."""
        holders = self._blocks.get(h)
        if holders is None or holders.get(url, 0.0) <= self._clock():
            return False
        self._blocks.move_to_end(h)
        return True

    def match(self, hashes: Sequence[int], urls: Iterable[str]) -> dict[str, int]:
        """For each of `urls`, how many leading `hashes` it holds (expired entries miss).

        Touches matched hashes so that hot prefixes stay in the LRU.
        """
        counts = dict.fromkeys(urls, 0)
        now = self._clock()
        get, touch = self._blocks.get, self._blocks.move_to_end
        alive: set[str] | None = None  # None: every one of `urls` (before the first hash)
        depth = 0  # leading hashes that every one of `alive` holds
        for h in hashes:
            holders = get(h)
            if holders is None:
                break
            if alive is None:  # from the block's holders, not from all of `urls` (O(workers))
                alive = {u for u, expiry in holders.items() if expiry > now and u in counts}
            else:
                for u in alive:
                    if holders.get(u, 0.0) <= now:  # one drops out here: its count is depth
                        held = {u for u in alive if holders.get(u, 0.0) > now}
                        for gone in alive - held:
                            counts[gone] = depth
                        alive = held
                        break
            if not alive:
                break
            touch(h)
            depth += 1
        for u in alive or ():
            counts[u] = depth
        return counts


# -- KV offload tiers (the `medium` of KV events) ------------------------------------------
# What loading one block from a tier costs, as a fraction of prefilling it. Rounded up
# from the engine's measurements on the 2-core dev machine (docs/engine.md, KV offload:
# one block's prefill 25-31 ms; a load 0.10-0.14 ms from the host tier, 0.30-0.47 ms
# from disk, 0.56-0.76 ms from Redis on localhost: recompute/load 200x, 63x, 42x), with
# room for the wait of an asynchronous fetch (disk and store): constants, not learned.
LOAD_COST_RATIO: dict[str, float] = {"CPU": 0.02, "DISK": 0.05, "REDIS": 0.05}
LOCAL_TIERS = ("CPU", "DISK")  # below one worker's pool, reachable by that worker only
SHARED_STORE = "REDIS"  # shared by every worker that publishes blocks to it
_STORE_KEY = "<store>"


class TieredKVIndex:
    """The precise index, by the `medium` of each KV event:

    - device pool (`GPU`, `None`, anything unknown): `device`, a `BlockIndex` by worker,
      which also holds the predicted entries written at dispatch;
    - a worker's own lower tiers (`CPU` host memory, `DISK`): `lower`, keyed
      `url|MEDIUM` (a block can sit in both; each tier removes its own copy);
    - the shared store (`REDIS`): `shared`, one holder for the whole pool, reachable by
      every worker that has published a `REDIS` event (workers write through to the
      store, so a worker configured with it publishes from its first cached block).
      One store per pool is assumed; Redis evicts silently (no `BlockRemoved`), so its
      entries leave by the index's LRU bound, and a stale one costs a recompute.

    `match` answers the device pool only (the drop-in for `BlockIndex`); `match_tiers`
    adds, per worker, how many more leading blocks it could load and what loading them
    costs in prefill-equivalent blocks (`LOAD_COST_RATIO` of the cheapest holder).
    """

    def __init__(self, max_blocks: int = 200_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.device = BlockIndex(max_blocks, clock)
        self.lower = BlockIndex(max_blocks, clock)
        self.shared = BlockIndex(max_blocks, clock)
        self.store_members: set[str] = set()

    def __len__(self) -> int:
        return len(self.device)

    def footprint(self, url: str) -> int:
        return self.device.footprint(url)

    def store(self, url: str, hashes: Iterable[int], ttl: float | None = None,
              medium: str | None = None) -> None:
        if medium in LOCAL_TIERS:
            self.lower.store(f"{url}|{medium}", hashes, ttl)
        elif medium == SHARED_STORE:
            self.store_members.add(url)
            self.shared.store(_STORE_KEY, hashes, ttl)
        else:
            self.device.store(url, hashes, ttl)

    def remove(self, url: str, hashes: Iterable[int], medium: str | None = None) -> None:
        if medium in LOCAL_TIERS:
            self.lower.remove(f"{url}|{medium}", hashes)
        elif medium == SHARED_STORE:
            self.shared.remove(_STORE_KEY, hashes)
        else:
            self.device.remove(url, hashes)

    def clear(self, url: str, tiers: bool = True) -> None:
        """Forget `url`'s pool (`AllBlocksCleared`: `tiers=False`) and, unless told
        otherwise, its lower tiers too (worker removed or restarted). The shared store
        outlives any one worker."""
        self.device.clear(url)
        if tiers:
            for medium in LOCAL_TIERS:
                self.lower.clear(f"{url}|{medium}")
            self.store_members.discard(url)

    def match(self, hashes: Sequence[int], urls: Iterable[str]) -> dict[str, int]:
        return self.device.match(hashes, urls)

    def match_tiers(self, hashes: Sequence[int], urls: Iterable[str]
                    ) -> dict[str, tuple[int, int, float]]:
        """Per worker: (leading blocks in its pool, leading blocks it can have from its
        pool or by loading, load cost of the loaded ones in prefill-equivalent blocks).

        The engine looks the chain up in its pool, then from the first pool miss on asks
        its tiers block by block until one has none: so a block counts as loadable when
        the worker's pool, one of its tiers or the shared store holds it."""
        url_list = list(urls)
        device = self.device.match(hashes, url_list)
        if not len(self.lower) and not self.store_members:  # no tier holds anything:
            return {url: (d, d, 0.0) for url, d in device.items()}  # (the loop's answer)
        out: dict[str, tuple[int, int, float]] = {}
        store_run: list[bool] = []  # whether the store holds block i (asked once)
        for url in url_list:
            d = total = device[url]
            load = 0.0
            while total < len(hashes):
                h = hashes[total]
                ratios = [LOAD_COST_RATIO[m] for m in LOCAL_TIERS
                          if self.lower.holds(f"{url}|{m}", h)]
                if url in self.store_members:
                    while len(store_run) <= total:
                        store_run.append(self.shared.holds(_STORE_KEY, hashes[len(store_run)]))
                    if store_run[total]:
                        ratios.append(LOAD_COST_RATIO[SHARED_STORE])
                if not ratios:
                    break
                load += min(ratios)
                total += 1
            out[url] = (d, total, load)
        return out
