"""Block manager: exact block ids, prefix hits, eviction order, reference counts, events."""

from __future__ import annotations

from sluice.engine.block_manager import BlockManager
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence
from sluice.protocol.block_hash import hash_blocks
from sluice.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def make_seq(tokens: list[int], seq_id: int = 1) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), len(tokens), SamplingParams(), 16)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Allocate, 'run' every remaining token, cache the full blocks."""
    hits = bm.lookup(seq)
    n = seq.num_tokens - len(hits) * BS
    assert bm.can_allocate(seq, n, hits)
    bm.allocate(seq, n, hits)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def test_fresh_allocation_takes_lowest_ids_and_caches_full_blocks() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(10, 20))  # 10 tokens: 2 full blocks + 2
    seq = make_seq(tokens)
    compute_all(bm, seq)
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    assert seq.block_hashes == hash_blocks(tokens, BS)
    events = bm.drain_events()
    assert events == [BlockStored(hash_blocks(tokens, BS), None, tokens[:8], BS)]
    assert bm.drain_events() == []


def test_free_list_order_is_eviction_order_last_block_first() -> None:
    bm = BlockManager(5, BS)
    seq = make_seq(list(range(12)))  # 3 full blocks -> [0, 1, 2]
    compute_all(bm, seq)
    bm.free(seq)
    assert list(bm.free_ids) == [3, 4, 2, 1, 0]
    assert bm.usage == 0.0


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    bm = BlockManager(8, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], seq_id=1)
    compute_all(bm, a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 50, 51], seq_id=2)
    assert bm.lookup(b) == [0, 1]
    compute_all(bm, b)
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert bm.blocks[0].ref_count == 2 and bm.blocks[1].ref_count == 2
    assert (bm.prefix_queries, bm.prefix_hits) == (9 + 10, 8)
    bm.free(a)
    assert bm.blocks[0].ref_count == 1 and 0 not in bm.free_ids
    assert list(bm.free_ids) == [4, 5, 6, 7, 2]


def test_never_hits_the_whole_prompt() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(list(range(8)), seq_id=1)
    compute_all(bm, a)
    b = make_seq(list(range(8)), seq_id=2)
    assert bm.lookup(b) == [0]  # the second block holds the last token: recomputed


def test_freed_cached_block_is_revived_until_evicted() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(list(range(8)) + [99], seq_id=1)  # blocks [0, 1, 2]; 0 and 1 cached
    compute_all(bm, a)
    h0, h1 = a.block_hashes
    bm.free(a)
    assert list(bm.free_ids) == [3, 2, 1, 0]
    bm.drain_events()
    c = make_seq([70, 71, 72, 73, 74, 75, 76, 77, 78], seq_id=3)  # needs 3 fresh blocks
    compute_all(bm, c)
    assert c.block_table == [3, 2, 1]  # block 1 (a's second block) evicted, 0 survives
    events = bm.drain_events()
    assert events[0] == BlockRemoved([h1])
    assert isinstance(events[1], BlockStored)
    bm.free(c)
    b = make_seq(list(range(8)) + [5], seq_id=2)
    assert bm.lookup(b) == [0]  # h0 still cached, h1 gone
    assert bm.cached.get(h0) == 0 and h1 not in bm.cached


def test_hit_is_verified_against_tokens() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)), seq_id=1)
    compute_all(bm, a)
    bm.blocks[0].token_ids = (9, 9, 9, 9)  # a hash collision in disguise
    assert bm.lookup(make_seq(list(range(9)), seq_id=2)) == []


def test_can_allocate_counts_revived_free_hits() -> None:
    bm = BlockManager(3, BS)
    a = make_seq(list(range(9)), seq_id=1)  # [0, 1, 2]
    compute_all(bm, a)
    bm.free(a)  # all three free; 0 and 1 cached
    b = make_seq(list(range(8)) + [40, 41, 42, 43, 44], seq_id=2)
    hits = bm.lookup(b)
    assert hits == [0, 1]
    assert bm.can_allocate(b, 4, hits)  # 2 revived + 1 fresh = 3
    assert not bm.can_allocate(b, 5, hits)  # 2 revived + 2 fresh = 4 > 3


def test_reset_prefix_cache_only_when_idle() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)), seq_id=1)
    compute_all(bm, a)
    assert bm.reset_prefix_cache() is False
    bm.free(a)
    bm.drain_events()
    assert bm.reset_prefix_cache() is True
    assert bm.drain_events() == [AllBlocksCleared()]
    assert bm.lookup(make_seq(list(range(9)), seq_id=2)) == []


def test_prefix_caching_disabled_never_hits_or_emits() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    a = make_seq(list(range(9)), seq_id=1)
    compute_all(bm, a)
    bm.free(a)
    assert bm.lookup(make_seq(list(range(9)), seq_id=2)) == []
    assert bm.drain_events() == []


def test_duplicate_content_is_not_registered_twice() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(list(range(5)), seq_id=1)
    b = make_seq(list(range(5)), seq_id=2)
    for seq in (a, b):  # both computed in the same step: no hit for b
        bm.allocate(seq, 5)
    for seq in (a, b):
        seq.num_computed_tokens = 5
        bm.cache_full_blocks(seq)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    assert bm.cached == {a.block_hashes[0]: 0}
    assert b.block_hashes == a.block_hashes
    assert len(bm.drain_events()) == 1


def test_known_block_hashes_are_taken_instead_of_hashing_again(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A prompt's hashes handed in (the simulator's router computed them) give the same
    hits, block hashes and events as hashing, and only the blocks past them are hashed."""
    import sluice.engine.block_manager as bm_module

    tokens = list(range(10, 21))  # 11 tokens: 2 full prompt blocks + 3
    plain, known = BlockManager(8, BS), BlockManager(8, BS)
    first = make_seq(tokens)
    compute_all(plain, first)
    compute_all(known, make_seq(tokens))
    hashed: list[tuple[int, ...]] = []
    real = bm_module.hash_block

    def counting(parent, chunk, extra=b""):  # type: ignore[no-untyped-def]
        hashed.append(tuple(chunk))
        return real(parent, chunk, extra)

    monkeypatch.setattr(bm_module, "hash_block", counting)
    longer = [*tokens, 99, 98, 97, 96, 95]  # 16 tokens: blocks 0-1 hit, 2-3 new
    a = make_seq(longer, 2)
    b = make_seq(longer, 2)
    b.known_block_hashes = tuple(hash_blocks(tokens, BS))  # the prompt's first 2 blocks
    plain.drain_events()
    known.drain_events()
    compute_all(plain, a)
    hashed_plain, hashed[:] = list(hashed), []
    compute_all(known, b)
    assert b.block_table == a.block_table and b.block_hashes == a.block_hashes
    assert known.drain_events() == plain.drain_events()
    block2, block3 = tuple(longer[8:12]), tuple(longer[12:16])
    # lookup: the miss past the known blocks; caching: blocks 2 and 3
    assert hashed == [block2, block2, block3]
    assert hashed_plain == [tuple(tokens[:4]), tuple(tokens[4:8]), block2, block2, block3]
