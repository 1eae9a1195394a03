"""BlockIndex: chained-prefix matching, LRU bound, predicted entries with TTL, events."""

from __future__ import annotations

from sluice.protocol.block_hash import hash_blocks
from sluice.router.prefix_index import BlockIndex
from sluice.router.scrape import parse_load


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_match_counts_leading_blocks_only() -> None:
    idx = BlockIndex()
    idx.store("a", [1, 2, 3])
    idx.store("b", [1, 3])
    assert idx.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    idx.remove("a", [2])
    assert idx.match([1, 2, 3], ["a"]) == {"a": 1}
    idx.clear("a")
    assert idx.match([1, 2, 3], ["a", "b"]) == {"a": 0, "b": 1}


def test_real_token_hashes_share_prefix() -> None:
    sys_prompt = list(range(100, 164))  # 4 blocks
    h1 = hash_blocks(sys_prompt + [1] * 20, 16)
    h2 = hash_blocks(sys_prompt + [2] * 20, 16)
    idx = BlockIndex()
    idx.store("a", h1)
    assert idx.match(h2, ["a"]) == {"a": 4}


def test_lru_evicts_least_recently_used_hash() -> None:
    idx = BlockIndex(max_blocks=3)
    idx.store("a", [1, 2, 3])
    idx.match([1], ["a"])  # touch 1
    idx.store("a", [4])  # evicts 2 (least recently used)
    assert len(idx) == 3
    assert idx.match([1, 2], ["a"]) == {"a": 1}
    assert idx.match([3], ["a"]) == {"a": 1}


def test_predicted_entries_expire_unless_confirmed() -> None:
    clock = Clock()
    idx = BlockIndex(clock=clock)
    idx.store("a", [1, 2], ttl=5.0)  # predicted at dispatch
    idx.store("b", [1, 2], ttl=5.0)
    idx.store("a", [1, 2])  # BlockStored confirms a's
    clock.now += 6
    assert idx.match([1, 2], ["a", "b"]) == {"a": 2, "b": 0}
    idx.store("a", [1], ttl=1.0)  # a prediction never shortens a confirmed entry
    clock.now += 2
    assert idx.match([1, 2], ["a"]) == {"a": 2}


def test_parse_load_sums_labelled_samples_and_accepts_sglang_names() -> None:
    text = """# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:num_requests_running{model_name="m",engine="1"} 2.0
vllm:num_requests_waiting{model_name="m"} 4
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:prefix_cache_hits_total{model_name="m"} 10
"""
    load = parse_load(text)
    assert (load.running, load.waiting, load.kv_usage, load.prefix_hits) == (5.0, 4.0, 0.25, 10.0)
    sg = parse_load('sglang:num_running_reqs{a="b"} 7\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n')
    assert (sg.running, sg.waiting, sg.kv_usage) == (7.0, 1.0, 0.5)


def test_footprint_counts_blocks_per_worker_through_store_remove_evict_clear() -> None:
    idx = BlockIndex(max_blocks=4)
    idx.store("a", [1, 2, 3])
    idx.store("b", [1])
    assert (idx.footprint("a"), idx.footprint("b")) == (3, 1)
    idx.remove("a", [3, 99])
    assert idx.footprint("a") == 2
    idx.store("b", [4, 5, 6])  # 5 hashes > 4: evicts 2 (b's store of 1 refreshed 1)
    assert (idx.footprint("a"), idx.footprint("b")) == (1, 4)
    idx.clear("b")
    assert idx.footprint("b") == 0 and idx.match([1], ["a", "b"]) == {"a": 1, "b": 0}


def test_match_starts_from_the_first_blocks_live_holders_among_the_candidates() -> None:
    """Only candidates count, an expired predicted entry misses, a confirmed one stays."""
    clock = Clock()
    idx = BlockIndex(clock=clock)
    idx.store("a", [1, 2, 3])
    idx.store("b", [1, 2], ttl=5.0)
    idx.store("outside", [1, 2, 3])  # holds everything, but is not a candidate
    urls = ["a", "b", "c"]
    assert idx.match([1, 2, 3], urls) == {"a": 3, "b": 2, "c": 0}
    clock.now += 10.0
    assert idx.match([1, 2, 3], urls) == {"a": 3, "b": 0, "c": 0}
    assert idx.match([1, 2, 3], []) == {}
    assert idx.match([9, 1], urls) == {"a": 0, "b": 0, "c": 0}
