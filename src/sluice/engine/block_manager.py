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
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq

from sluice.engine.sequence import Sequence
from sluice.protocol.block_hash import hash_block
from sluice.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


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
        logits are what the step is for.
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens:
            return []
        bs, tokens, hits = self.block_size, seq.token_ids, []
        parent: int | None = None
        for i in range((len(tokens) - 1) // bs):
            chunk = tokens[i * bs : (i + 1) * bs]
            parent = hash_block(parent, chunk, seq.cache_salt)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: Seq[int] = ()) -> bool:
        """Whether `allocate(seq, num_new_tokens, hits)` would succeed."""
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
        target = blocks_needed(seq.num_computed_tokens + num_new_tokens, self.block_size)
        while len(seq.block_table) < target:
            seq.block_table.append(self._allocate_fresh())

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
        if block.hash is not None:  # evict: it leaves the prefix cache
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                self.events.append(BlockRemoved([block.hash]))
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed tokens; emit BlockStored."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first = len(seq.block_hashes)
        run: list[int] = []
        run_parent: int | None = None
        for i in range(first, seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            chunk = seq.token_ids[i * bs : (i + 1) * bs]
            h = hash_block(parent, chunk, seq.cache_salt)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h in self.cached or block.hash is not None:
                self._emit_stored(run, run_parent, seq)
                run = []
                continue
            block.hash, block.token_ids = h, tuple(chunk)
            self.cached[h] = block.block_id
            if not run:
                run_parent = parent
            run.append(i)
        self._emit_stored(run, run_parent, seq)

    def _emit_stored(self, run: list[int], parent: int | None, seq: Sequence) -> None:
        if not run:
            return
        bs = self.block_size
        tokens = seq.token_ids[run[0] * bs : (run[-1] + 1) * bs]
        hashes = [seq.block_hashes[i] for i in run]
        self.events.append(BlockStored(hashes, parent, list(tokens), bs, seq.lora_id))

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
        out: list[KVEvent] = []
        while True:
            try:
                out.append(self.events.popleft())
            except IndexError:
                return out
