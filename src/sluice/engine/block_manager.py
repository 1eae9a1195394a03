"""Paged KV blocks: allocation, reference counts and the automatic prefix cache.

The KV pool is `num_blocks` fixed-size blocks; a sequence's block table maps its token
positions to blocks (the model runner turns that into slots):

    block_size = 4          token positions   0 1 2 3 | 4 5 6 7 | 8 9
    block_table = [7, 2, 5]                   block 7 | block 2 | block 5 (partial)
    slot(pos) = block_table[pos // 4] * 4 + pos % 4            e.g. pos 9 -> 5*4+1 = 21

Prefix cache (as nano-vllm): a block becomes *cached* once all its tokens are computed;
it is keyed by the chained hash of `sluice.protocol.block_hash.hash_block` and remembers
its token ids, so a hit is verified against the tokens, never trusted on the hash alone.
A block whose reference count drops to zero goes to the tail of the free list but keeps
its hash: it can still be hit (and is then taken back out of the free list) until it is
reallocated. Allocation takes from the head, so free-list order is eviction order (least
recently freed first). A sequence frees its blocks last-first, so a prompt's tail blocks
are evicted before its shared head.

Every change to the cached set is recorded as a vLLM-format KV event
(`BlockStored` / `BlockRemoved` / `AllBlocksCleared`) in a thread-safe deque that
`drain_events()` empties; the worker publishes them to routers.

Offload tiers (`sluice.engine.kv_offload`, when `offload` is set): a cached block that
is evicted is recorded in `evicted` and copied down to the host tier before anything
overwrites it (`flush_evicted`, which the core calls before each forward pass); blocks
that become cached are recorded in `newly_cached` for the write-through tiers. A lookup
that misses in the pool asks the tiers for the rest of the chain and loads what they
hold into free blocks, which then hit like any cached block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from sluice.engine.sequence import Sequence
from sluice.protocol.block_hash import hash_block
from sluice.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    from sluice.engine.kv_offload import Evicted, KVOffloadManager, KVTier, StoredBlock


class Block:
    """One KV block: a reference count and, once full and cached, its hash and tokens."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class _Blocks(dict[int, Block]):
    """Block id -> Block, each made on first use: a pool's blocks are not all touched
    (the simulator holds 1,000 pools of ~7,000 blocks; making them up front took 5 s)."""

    def __missing__(self, block_id: int) -> Block:
        block = self[block_id] = Block(block_id)
        return block


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    """Owns the free list, the hash -> block map and the counters. Not thread-safe:
    only the engine loop calls it (except `drain_events`, which is)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = _Blocks()
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.events: deque[KVEvent] = deque()
        self.prefix_queries = 0  # prompt tokens looked up (cumulative)
        self.prefix_hits = 0  # of those, tokens found cached
        self.offload: KVOffloadManager | None = None  # tiers below the pool (attach_offload)
        self.evicted: list[Evicted] = []  # cached blocks evicted, not yet copied down
        self.newly_cached: list[Evicted] = []  # blocks cached since the last drain
        # set by `lookup`: a lower tier is fetching the next block; the request should wait
        self.load_pending = False

    # -- queries ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (cached free blocks count free)."""
        return 1.0 - len(self.free_ids) / self.num_blocks if self.num_blocks else 0.0

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq.token_ids`; pure (no counters, no refs).

        Never the whole sequence: the last token is always left to compute, since its
        logits are what the step is for. Nothing for a sequence that computes its whole
        prompt (its prompt's logprobs, or a MEAN or CLS embedding: every position's output).
        """
        self.load_pending = False
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.computes_whole_prompt:
            return []
        bs, tokens, known = self.block_size, seq.token_ids, seq.known_block_hashes
        hits: list[int] = []
        parent: int | None = None
        for i in range((len(tokens) - 1) // bs):
            chunk = tokens[i * bs : (i + 1) * bs]
            h = known[i] if i < len(known) else hash_block(parent, chunk, seq.cache_salt)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
                if self.offload is not None and block_id is None:
                    hits.extend(self._load_from_tiers(seq, i, parent, hits))
                break
            hits.append(block_id)
            parent = h
        return hits

    def _load_from_tiers(self, seq: Sequence, first: int, parent: int | None,
                         hits: Seq[int]) -> list[int]:
        """Blocks `first`.. of `seq`'s chain that the offload tiers hold, loaded into free
        pool blocks (never one of `hits`) and cached there with no reference: the caller
        hits them like any cached block. Stops at the first block no tier has (or pays
        for). The chain is salted like the pool's (an adapter's KV is never a base's)."""
        assert self.offload is not None
        bs, tokens, salt = self.block_size, seq.token_ids, seq.cache_salt
        found: list[tuple[int, tuple[int, ...], tuple[KVTier, StoredBlock]]] = []
        h, room = parent, len(self.free_ids) - sum(1 for b in hits if b in self.free_ids)
        end = min((len(tokens) - 1) // bs, first + room)
        if first < end and self.offload.fetching(self._chain(seq, first, parent, end)):
            self.load_pending = True  # wait, and load the whole chain at once when fetched:
            return []  # blocks loaded meanwhile could be evicted before the request runs
        for i in range(first, end):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = hash_block(h, chunk, salt)
            got = None if h in self.cached else self.offload.find(h, chunk)
            if got is None:
                if h not in self.cached:
                    prev = found[-1][0] if found else parent
                    self.load_pending = self.offload.prefetch(self._chain(seq, i, prev, end))
                break
            found.append((h, chunk, got))
        targets = self._free_blocks_except(set(hits), len(found))
        if not targets:
            return []
        found = found[:len(targets)]
        for block_id in targets:
            del self.free_ids[block_id]
            self._evict(self.blocks[block_id])
        self.flush_evicted()  # the targets' old contents go down first
        self.offload.load(targets, [got for _, _, got in found])
        for block_id, (h, chunk, _) in zip(targets, found, strict=True):
            block = self.blocks[block_id]
            block.hash, block.token_ids = h, chunk
            self.cached[h] = block_id
            self.free_ids[block_id] = None  # cached, unreferenced, most recently used
        self.events.append(BlockStored([h for h, _, _ in found], parent,
                                       [t for _, chunk, _ in found for t in chunk], bs,
                                       seq.lora_id))
        return targets

    def _chain(self, seq: Sequence, first: int, parent: int | None,
               end: int) -> list[tuple[int, tuple[int, ...]]]:
        """(hash, tokens) of `seq`'s blocks `first`..`end` - 1, chained on `parent`."""
        bs, tokens = self.block_size, seq.token_ids
        chain: list[tuple[int, tuple[int, ...]]] = []
        for i in range(first, end):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            parent = hash_block(parent, chunk, seq.cache_salt)
            chain.append((parent, chunk))
        return chain

    def _free_blocks_except(self, exclude: set[int], limit: int) -> list[int]:
        out: list[int] = []
        for block_id in self.free_ids:
            if len(out) == limit:
                break
            if block_id not in exclude:
                out.append(block_id)
        return out

    def attach_offload(self, offload: KVOffloadManager | None) -> None:
        """Put offload tiers under this pool; their KV events join this pool's."""
        self.offload = offload
        if offload is not None:
            offload.events = self.events

    def flush_evicted(self) -> None:
        """Copy evicted cached blocks down to the offload tiers; call before their pool
        blocks are written (each forward pass, each load from a tier)."""
        if self.offload is None or not self.evicted:
            return
        evicted, self.evicted = self.evicted, []
        self.offload.save_evicted(evicted)

    def drain_newly_cached(self) -> list[Evicted]:
        out, self.newly_cached = self.newly_cached, []
        return out

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: Seq[int] = ()) -> bool:
        """Whether `allocate(seq, num_new_tokens, hits)` would succeed."""
        if not hits:  # every running sequence, every step: blocks_needed spelled out
            bs = self.block_size
            fresh = ((seq.num_computed_tokens + num_new_tokens + bs - 1) // bs
                     - len(seq.block_table))
            return fresh <= len(self.free_ids)
        computed = seq.num_computed_tokens + len(hits) * self.block_size
        have = len(seq.block_table) + len(hits)
        fresh = blocks_needed(computed + num_new_tokens, self.block_size) - have
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return max(fresh, 0) + revived <= len(self.free_ids)

    # -- mutations ----------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, hits: Seq[int] = ()) -> None:
        """Take the prefix-cache `hits` (first schedule only) and enough fresh blocks for
        `num_new_tokens` more tokens. Mutates `seq.block_table`, `block_hashes`,
        `num_computed_tokens` (advanced past the hits) and the counters."""
        if not seq.block_table and seq.num_computed_tokens == 0:
            self._take_hits(seq, hits)
        bs = self.block_size
        target = (seq.num_computed_tokens + num_new_tokens + bs - 1) // bs  # blocks_needed
        table = seq.block_table
        while len(table) < target:
            table.append(self._allocate_fresh())

    def _take_hits(self, seq: Sequence, hits: Seq[int]) -> None:
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            assert block.hash is not None
            seq.block_hashes.append(block.hash)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    def _allocate_fresh(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        self._evict(block)
        block.ref_count = 1
        return block_id

    def _evict(self, block: Block) -> None:
        """Take a free block out of the prefix cache (recorded for the offload tiers)."""
        if block.hash is None:
            return
        if self.cached.get(block.hash) == block.block_id:
            del self.cached[block.hash]
            self.events.append(BlockRemoved([block.hash]))
            if self.offload is not None:
                from sluice.engine.kv_offload import Evicted

                self.evicted.append(Evicted(block.block_id, block.hash, block.token_ids))
        block.hash, block.token_ids = None, ()

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed tokens; emit BlockStored."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first = len(seq.block_hashes)
        full = seq.num_computed_tokens // bs
        if full <= first:  # no block became full (a decode step, mostly)
            return
        run: list[int] = []
        run_parent: int | None = None
        known = seq.known_block_hashes
        for i in range(first, full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            chunk = seq.token_ids[i * bs : (i + 1) * bs]
            h = known[i] if i < len(known) else hash_block(parent, chunk, seq.cache_salt)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h in self.cached or block.hash is not None:
                self._emit_stored(run, run_parent, seq)
                run = []
                continue
            block.hash, block.token_ids = h, tuple(chunk)
            self.cached[h] = block.block_id
            if self.offload is not None:
                from sluice.engine.kv_offload import Evicted

                self.newly_cached.append(Evicted(block.block_id, h, block.token_ids))
            if not run:
                run_parent = parent
            run.append(i)
        self._emit_stored(run, run_parent, seq)

    def _emit_stored(self, run: list[int], parent: int | None, seq: Sequence) -> None:
        if not run:
            return
        bs = self.block_size
        tokens = seq.token_ids[run[0] * bs : (run[-1] + 1) * bs]  # a new list
        hashes = [seq.block_hashes[i] for i in run]
        self.events.append(BlockStored(hashes, parent, tokens, bs, seq.lora_id))

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references, last block first; blocks reaching zero join the tail of
        the free list (cached ones stay hittable). Resets the sequence's cache state."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Drop `seq`'s blocks past those its tokens need (speculative decoding: slots
        allocated for rejected drafts). Never a cached block: those are all computed."""
        keep = blocks_needed(len(seq.token_ids), self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[block_id] = None
        del seq.block_table[keep:]

    def scratch_block(self) -> int | None:
        """A free block taken for the caller's own writes (a timing forward), or None
        when none is free; give it back with `release([block])`."""
        return self._allocate_fresh() if self.free_ids else None

    # -- P/D hand-off (sluice.engine.kv_transfer) --------------------------------------
    def hold(self, block_ids: Seq[int]) -> None:
        """Take one more reference on each block (a lease: kept while a decode engine
        pulls them). Mutates ref counts and the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_ids[block_id]
            block.ref_count += 1

    def release(self, block_ids: Seq[int]) -> None:
        """Drop a `hold`: blocks reaching zero join the free list's tail (cached ones stay
        hittable), last block first, as `free` does."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[block_id] = None

    def install(self, chain: Seq[tuple[int, tuple[int, ...]]], parent: int | None,
                write: Callable[[list[int], list[int]], None], lora_id: int | None = None,
                keep: Seq[int] = ()) -> list[int]:
        """Cache `chain` ((hash, tokens) of consecutive full blocks chained on `parent`) in
        free pool blocks whose K/V `write(block_ids, chain_indices)` fills (imported from
        another engine): unreferenced, most recently used, announced by BlockStored, so
        the next lookup hits them like any cached block. Blocks already cached here are
        skipped, blocks `keep` (cached parents) are never evicted for them; fewer are
        installed when the pool has fewer free blocks. Returns the blocks written."""
        todo = [(i, h, chunk) for i, (h, chunk) in enumerate(chain) if h not in self.cached]
        exclude = set(keep) | {self.cached[h] for h, _ in chain if h in self.cached}
        targets = self._free_blocks_except(exclude, len(todo))
        todo = todo[:len(targets)]
        if not targets:
            return []
        for block_id in targets:
            del self.free_ids[block_id]
            self._evict(self.blocks[block_id])
        self.flush_evicted()  # the targets' old contents go down a tier first
        write(targets, [i for i, _, _ in todo])
        run: list[tuple[int, tuple[int, ...]]] = []
        run_parent, prev = parent, -2
        for block_id, (i, h, chunk) in zip(targets, todo, strict=True):
            block = self.blocks[block_id]
            block.hash, block.token_ids = h, chunk
            self.cached[h] = block_id
            self.free_ids[block_id] = None
            if run and i != prev + 1:  # a block cached here already splits the run
                self._emit_installed(run, run_parent, lora_id)
                run = []
            if not run:
                run_parent = chain[i - 1][0] if i else parent
            run.append((h, chunk))
            prev = i
        self._emit_installed(run, run_parent, lora_id)
        return targets

    def _emit_installed(self, run: list[tuple[int, tuple[int, ...]]], parent: int | None,
                        lora_id: int | None) -> None:
        if run:
            self.events.append(BlockStored([h for h, _ in run], parent,
                                           [t for _, chunk in run for t in chunk],
                                           self.block_size, lora_id))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (only when no block is in use); emits AllBlocksCleared."""
        if len(self.free_ids) != self.num_blocks:
            return False
        for block in self.blocks.values():  # blocks never made are clean already
            block.hash, block.token_ids = None, ()
        self.cached.clear()
        self.events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        """Pop every recorded event (safe to call from another thread)."""
        if not self.events:
            return []
        out: list[KVEvent] = []
        while True:
            try:
                out.append(self.events.popleft())
            except IndexError:
                return out
