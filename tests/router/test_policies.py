"""Routing policies on plain data: exact choices for constructed states."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from sluice.protocol.errors import InvalidRequestError
from sluice.router.endpoints import EndpointStats, work_units
from sluice.router.policies import POLICIES, RequestMeta, make_policy
from sluice.router.policies.cost import estimate_seconds

A, B, C = "http://a", "http://b", "http://c"


def eps(*urls: str, **common: float) -> list[EndpointStats]:
    return [EndpointStats(url=u, **common) for u in urls]  # type: ignore[arg-type]


def meta(tokens: int = 0, blocks: int = 0, session: str | None = None) -> RequestMeta:
    return RequestMeta(model="m", num_prompt_tokens=tokens, block_hashes=tuple(range(blocks)),
                       session_key=session)


def test_registry_lists_all_policies_and_rejects_unknown() -> None:
    assert set(POLICIES) == {"round_robin", "least_load", "session", "prefix", "kv", "cost"}
    with pytest.raises(InvalidRequestError) as err:
        make_policy("fastest")
    assert err.value.param == "policy"
    with pytest.raises(InvalidRequestError):
        make_policy("prefix", options={"no_such": 1})
    assert make_policy("prefix", options={"balance_abs": 4}).balance_abs == 4  # type: ignore[attr-defined]


def test_round_robin_cycles_in_url_order() -> None:
    p = make_policy("round_robin", random.Random(0))
    picks = [p.choose(meta(), eps(C, A, B)).url for _ in range(6)]
    assert picks == [A, B, C, A, B, C]


def test_least_load_uses_larger_of_scraped_and_own_counts() -> None:
    p = make_policy("least_load", random.Random(0))
    state = [EndpointStats(A, running=3), EndpointStats(B, waiting=1), EndpointStats(C, running=2)]
    assert p.choose(meta(), state).url == B


def test_ties_break_randomly_but_reproducibly_with_seed() -> None:
    picks1 = [make_policy("least_load", random.Random(7)).choose(meta(), eps(A, B, C)).url
              for _ in range(1)]
    p1, p2 = make_policy("least_load", random.Random(7)), make_policy("least_load", random.Random(7))
    seq1 = [p1.choose(meta(), eps(A, B, C)).url for _ in range(30)]
    seq2 = [p2.choose(meta(), eps(A, B, C)).url for _ in range(30)]
    assert seq1 == seq2 and picks1[0] == seq1[0]
    assert set(seq1) == {A, B, C}


def test_session_is_sticky_and_moves_only_when_its_worker_leaves() -> None:
    p = make_policy("session", random.Random(0))
    homes = {f"s{i}": p.choose(meta(session=f"s{i}"), eps(A, B, C)).url for i in range(60)}
    assert set(homes.values()) == {A, B, C}  # sessions spread
    for s, home in homes.items():  # sticky regardless of load
        busy = [EndpointStats(u, running=50 if u == home else 0) for u in (A, B, C)]
        assert p.choose(meta(session=s), busy).url == home
    for s, home in homes.items():  # B leaves: only B's sessions move
        now = p.choose(meta(session=s), eps(A, C)).url
        assert now == home if home != B else now in (A, C)
    # no session key: least loaded
    assert p.choose(meta(), [EndpointStats(A, running=2), EndpointStats(B)]).url == B


def spread(policy: str, n_workers: int = 4, n_requests: int = 40) -> Counter[str]:
    """Simulate cold (no-hit) requests arriving back to back: the router counts each at once."""
    p = make_policy(policy, random.Random(1))
    urls = [f"http://w{i}" for i in range(n_workers)]
    state = {u: EndpointStats(u) for u in urls}
    picks: Counter[str] = Counter()
    for _ in range(n_requests):
        r = meta(tokens=200, blocks=12)
        u = p.choose(r, list(state.values())).url
        picks[u] += 1
        e = state[u]
        state[u] = replace(e, waiting=e.waiting + 1, inflight=e.inflight + 1,
                           inflight_tokens=e.inflight_tokens + 200,
                           queued_prefill_tokens=e.queued_prefill_tokens + 200)
    return picks


@pytest.mark.parametrize("policy", ["least_load", "prefix", "kv", "cost"])
def test_cold_misses_spread_evenly(policy: str) -> None:
    picks = spread(policy)
    assert sorted(picks.values()) == [10, 10, 10, 10]


def test_prefix_prefers_longest_match_then_sheds_hot_worker_under_imbalance() -> None:
    p = make_policy("prefix", random.Random(0))
    r = meta(tokens=320, blocks=20)
    state = [EndpointStats(A, cached_blocks=20, running=4), EndpointStats(B, cached_blocks=5),
             EndpointStats(C)]
    assert p.choose(r, state).url == A
    hot = [replace(state[0], running=60), state[1], state[2]]  # 60 - 0 > 32 and 60 > 1.5 × 0
    choice = p.choose(r, hot)
    assert choice.url in (B, C) and choice.url != A
    # equal matches: the less loaded one
    assert p.choose(r, [EndpointStats(A, cached_blocks=9, running=2),
                        EndpointStats(B, cached_blocks=9, running=1)]).url == B


def test_kv_policy_prefers_precise_hits_and_ignores_approximate_when_events_exist() -> None:
    p = make_policy("kv", random.Random(0))
    r = meta(tokens=320, blocks=20)
    # A's approximate record claims a hit, but its KV events say the blocks were evicted.
    state = [EndpointStats(A, cached_blocks=20, kv_cached_blocks=0),
             EndpointStats(B, cached_blocks=0, kv_cached_blocks=20)]
    assert p.choose(r, state).url == B
    # full KV cache and a long queue outweigh a 25% hit (0.5 < 1 + 1)
    state = [EndpointStats(A, kv_cached_blocks=5, kv_usage=1.0, waiting=10),
             EndpointStats(B, kv_cached_blocks=0, kv_usage=0.0, waiting=0)]
    assert p.choose(r, state).url == B


def test_cost_trades_cached_prefix_against_queue_depth() -> None:
    p = make_policy("cost", random.Random(0))
    r = meta(tokens=2048, blocks=128)  # 2048 tokens, all cached on A
    spt = 1e-3
    a = EndpointStats(A, kv_cached_blocks=128, seconds_per_token=spt)
    b = EndpointStats(B, kv_cached_blocks=0, seconds_per_token=spt)
    # A idle: the cached prefix saves 2048 tokens of prefill -> A
    assert p.choose(r, [a, b]).url == A
    # A has 1,000 uncached tokens queued ahead: 1000 < 2048 still cheaper than B's full prefill
    a_busy = replace(a, queued_prefill_tokens=1000, waiting=2)
    assert estimate_seconds(r, a_busy) == pytest.approx((1000 + 32) * spt)  # + fixed 32 units
    assert estimate_seconds(r, b) == pytest.approx((2048 + 32) * spt)
    assert p.choose(r, [a_busy, b]).url == A
    # A has 3,000 queued: waiting there costs more than recomputing the prefix on B
    a_deep = replace(a, queued_prefill_tokens=3000, waiting=4)
    assert p.choose(r, [a_deep, b]).url == B
    # running decodes count too: 200 running × 16 = 3200 token-equivalents
    assert p.choose(r, [replace(a, running=200), b]).url == B


def test_cost_uses_each_workers_learned_speed() -> None:
    p = make_policy("cost", random.Random(0))
    r = meta(tokens=1000, blocks=0)
    slow = EndpointStats(A, seconds_per_token=4e-3)
    fast_busy = EndpointStats(B, seconds_per_token=1e-3, queued_prefill_tokens=2000)
    # slow: 4e-3 × 1000 = 4 s; fast: 1e-3 × 3000 = 3 s
    assert p.choose(r, [slow, fast_busy]).url == B


def test_cost_falls_back_to_approximate_hits_without_kv_events() -> None:
    r = meta(tokens=512, blocks=32)
    e = EndpointStats(A, cached_blocks=16, kv_cached_blocks=None)
    assert work_units(e, 512 - 16 * 16) == 256
    assert estimate_seconds(r, e) == pytest.approx((256 + 32) * e.seconds_per_token)


def test_cost_adds_each_workers_fixed_overhead() -> None:
    p = make_policy("cost", random.Random(0))
    r = meta(tokens=100, blocks=0)
    # same speed, but A has 200 ms of fixed overhead per request: B wins despite a queue
    a = EndpointStats(A, seconds_per_token=1e-3, overhead_s=0.2)
    b = EndpointStats(B, seconds_per_token=1e-3, queued_prefill_tokens=150)
    assert estimate_seconds(r, a) == pytest.approx(0.2 + 0.132)
    assert p.choose(r, [a, b]).url == B


def test_cold_tie_goes_to_the_worker_with_the_smallest_cache_footprint() -> None:
    for name in ("cost", "prefix"):
        p = make_policy(name, random.Random(0))
        state = [EndpointStats(A, cache_footprint=40), EndpointStats(B, cache_footprint=3),
                 EndpointStats(C, cache_footprint=12)]
        assert {p.choose(meta(tokens=100, blocks=6), state).url for _ in range(10)} == {B}
