"""The router's precise index reads the `medium` of KV events: a block a worker holds only
in a lower tier (host memory, disk), or one in the shared store (Redis), counts as cached
but priced at its load cost, by the `cost` and `kv` policies. Constructed events only."""

from __future__ import annotations

import random

import pytest

from sluice.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from sluice.router.config import PoolConfig, WorkerSpec
from sluice.router.kv_subscriber import apply_event
from sluice.router.policies import RequestMeta
from sluice.router.pool import Pool
from sluice.router.prefix_index import LOAD_COST_RATIO, TieredKVIndex

A, B = "http://a", "http://b"
HASHES = (11, 12, 13, 14, 15, 16, 17, 18)  # 8 blocks of 16 tokens: a 128-token prompt
REQ = RequestMeta(model="m", num_prompt_tokens=128, block_hashes=HASHES)


def stored(hashes: tuple[int, ...], medium: str | None = "GPU") -> BlockStored:
    return BlockStored(list(hashes), None, [], 16, medium=medium)


def pool(policy: str = "cost") -> Pool:
    specs = tuple(WorkerSpec(u, kv_events=f"tcp://127.0.0.1:{i + 1}") for i, u in enumerate((A, B)))
    return Pool(PoolConfig(workers=specs, policy=policy), random.Random(0))


def stats(p: Pool, request: RequestMeta = REQ) -> dict[str, tuple[int | None, int, float]]:
    out = p._stats(request, list(p.endpoints.values()))
    return {s.url: (s.kv_cached_blocks, s.kv_tier_blocks, s.kv_tier_cost) for s in out}


def test_pool_events_alone_behave_as_before() -> None:
    p = pool()
    apply_event(p.precise, A, stored(HASHES[:4]))
    apply_event(p.precise, A, stored(HASHES[4:6], medium=None))  # vLLM before the medium
    assert stats(p) == {A: (6, 0, 0.0), B: (0, 0, 0.0)}
    apply_event(p.precise, A, BlockRemoved([HASHES[1]], medium="GPU"))
    assert stats(p)[A] == (1, 0, 0.0)  # the chain breaks at the removed block


def test_host_and_disk_blocks_extend_only_their_own_workers_prefix() -> None:
    p = pool()
    apply_event(p.precise, A, stored(HASHES[:2]))
    apply_event(p.precise, A, stored(HASHES[2:5], medium="CPU"))  # evicted to the host tier
    apply_event(p.precise, A, stored(HASHES[5:6], medium="DISK"))
    got = stats(p)
    assert got[A][:2] == (2, 4) and got[A][2] == pytest.approx(
        3 * LOAD_COST_RATIO["CPU"] + LOAD_COST_RATIO["DISK"])
    assert got[B] == (0, 0, 0.0)  # B cannot read A's host memory or disk
    # a block in both host and disk is priced at the cheaper; dropping one copy keeps it
    apply_event(p.precise, A, stored(HASHES[2:5], medium="DISK"))
    apply_event(p.precise, A, BlockRemoved(list(HASHES[2:5]), medium="CPU"))
    assert stats(p)[A][:2] == (2, 4)
    assert stats(p)[A][2] == pytest.approx(4 * LOAD_COST_RATIO["DISK"])
    # a pool block evicted down to the host tier: the pool's BlockRemoved leaves the copy
    apply_event(p.precise, A, stored(HASHES[1:2], medium="CPU"))
    apply_event(p.precise, A, BlockRemoved([HASHES[1]], medium="GPU"))
    assert stats(p)[A][:2] == (1, 5)
    apply_event(p.precise, A, BlockRemoved([HASHES[1]], medium="CPU"))
    assert stats(p)[A][:2] == (1, 0)  # gone from every tier: the chain stops there


def test_a_block_in_the_shared_store_counts_for_every_worker_that_uses_the_store() -> None:
    p = pool()
    apply_event(p.precise, A, stored(HASHES[:6]))
    apply_event(p.precise, A, stored(HASHES[:6], medium="REDIS"))  # A wrote through
    assert stats(p)[B] == (0, 0, 0.0)  # B has shown no sign of using a store yet
    apply_event(p.precise, B, stored((99,), medium="REDIS"))  # B writes to the store too
    got = stats(p)
    assert got[A] == (6, 0, 0.0)  # its own pool first: nothing to load
    assert got[B][:2] == (0, 6) and got[B][2] == pytest.approx(6 * LOAD_COST_RATIO["REDIS"])
    # AllBlocksCleared empties A's pool, not the store: A can load what it wrote
    apply_event(p.precise, A, AllBlocksCleared())
    assert stats(p)[A][:2] == (0, 6)
    # a worker leaving the pool takes its tiers along, never the store
    p.remove(A)
    assert stats(p)[B][:2] == (0, 6)


def test_publisher_restart_forgets_its_host_tier() -> None:
    from sluice.router.kv_subscriber import KVEventSubscriber

    p = pool()
    sub = KVEventSubscriber.__new__(KVEventSubscriber)  # no socket: apply() and seq only
    sub.url, sub.index, sub.on_event, sub.last_seq, sub.gaps = A, p.precise, lambda _t: None, None, 0
    sub.block_size_seen = None
    sub._check_seq(5)
    sub.apply(EventBatch(0.0, [stored(HASHES[:2], "CPU"), stored(HASHES[:2], "REDIS")]))
    assert stats(p)[A][:2] == (0, 2)
    sub._check_seq(1)  # sequence went back: a new process, an empty host tier
    assert stats(p)[A][:2] == (0, 0)


def test_cost_policy_sends_a_store_prefix_to_the_idle_worker_and_a_pool_prefix_home() -> None:
    """A is busy and holds the prefix in its pool; B is idle. Without the store, B would
    recompute 128 tokens; with the prefix in the store, B only loads it and wins."""
    p = pool("cost")
    a = p.endpoints[A]
    a.begin(128, 128, units=128.0)  # A has a 128-token prefill queued ahead
    apply_event(p.precise, A, stored(HASHES))
    d = p.decide(REQ)
    assert d is not None and d.endpoint.url == A  # recomputing on B costs more than waiting
    assert d.choice.cached_blocks == 8
    apply_event(p.precise, A, stored(HASHES, "REDIS"))
    apply_event(p.precise, B, stored((99,), "REDIS"))
    d = p.decide(REQ)
    assert d is not None and d.endpoint.url == B and d.choice.cached_blocks == 8
    # the dispatch predicts the whole chain in B's pool and counts only the loads as work
    p.dispatch(REQ, d)
    assert stats(p)[B] == (8, 0, 0.0)


def test_cost_prefers_a_pool_hit_over_the_same_prefix_in_the_store_when_both_are_idle() -> None:
    p = pool("cost")
    apply_event(p.precise, A, stored(HASHES))
    apply_event(p.precise, A, stored(HASHES, "REDIS"))
    apply_event(p.precise, B, stored((99,), "REDIS"))
    d = p.decide(REQ)
    assert d is not None and d.endpoint.url == A


def test_kv_policy_scores_tier_blocks_between_a_pool_hit_and_a_miss() -> None:
    p = pool("kv")
    apply_event(p.precise, A, stored(HASHES[:4], "CPU"))  # A: half the prompt in its host tier
    d = p.decide(REQ)
    assert d is not None and d.endpoint.url == A and d.choice.cached_blocks == 4
    apply_event(p.precise, B, stored(HASHES[:4]))  # B: the same half in its pool
    d = p.decide(REQ)
    assert d is not None and d.endpoint.url == B


def test_index_match_stays_pool_only_for_existing_callers() -> None:
    idx = TieredKVIndex()
    idx.store(A, HASHES[:3])
    idx.store(A, HASHES[3:5], medium="DISK")
    assert idx.match(HASHES, [A, B]) == {A: 3, B: 0}
    assert idx.match_tiers(HASHES, [A])[A][:2] == (3, 5)
    assert len(idx) == 3 and idx.footprint(A) == 3
