"""Routing policies on plain data: exact choices for constructed states."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from sluice.protocol.errors import InvalidRequestError
from sluice.router.endpoints import EndpointStats, work_units
from sluice.router.policies import POLICIES, RequestMeta, make_policy
from sluice.router.policies.cost import cost_seconds, estimate_seconds

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
    with pytest.raises(InvalidRequestError) as err:  # it read "CostModel.__init__() got
        make_policy("cost", options={"no_such": 1})  # an unexpected keyword argument"
    assert err.value.param == "policy_options.no_such"
    assert str(err.value) == ("policy 'cost' has no option 'no_such'; its options: "
                              "decode_equiv_tokens")
    with pytest.raises(InvalidRequestError, match="its options: none"):
        make_policy("round_robin", options={"balance_abs": 4})
    assert make_policy("prefix", options={"balance_abs": 4}).balance_abs == 4  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_an_option_that_is_not_finite_is_refused(value: float) -> None:
    """A NaN or infinite weight made every score NaN, and picking among them failed the
    request (`min` of NaNs keeps none within its tie limit: random.choice([]))."""
    with pytest.raises(InvalidRequestError) as err:
        make_policy("kv", options={"prefix_weight": value})
    assert err.value.param == "policy_options.prefix_weight"


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
    # A has 3,000 uncached tokens queued ahead: its TTFT there is worse than B's...
    a_busy = replace(a, queued_prefill_tokens=3000, waiting=4)
    assert estimate_seconds(r, a_busy) == pytest.approx((3000 + 32) * spt)  # + fixed 32 units
    assert estimate_seconds(r, b) == pytest.approx((2048 + 32) * spt)
    # ...but B's 2048-token recomputation would also delay B's next request by as much
    assert cost_seconds(r, a_busy) == pytest.approx((3000 + 32) * spt)
    assert cost_seconds(r, b) == pytest.approx((2 * 2048 + 32) * spt)
    assert p.choose(r, [a_busy, b]).url == A
    # A has 5,000 queued: more than twice the saving, the hot worker is shed
    assert p.choose(r, [replace(a, queued_prefill_tokens=5000, waiting=6), b]).url == B
    # running decodes count too: 300 running × 16 = 4800 token-equivalents
    assert p.choose(r, [replace(a, running=200), b]).url == A
    assert p.choose(r, [replace(a, running=300), b]).url == B


def dispatch(state: dict[str, EndpointStats], url: str, r: RequestMeta, cached_blocks: int,
             holders: dict[tuple[int, ...], set[str]]) -> None:
    """What the pool does at dispatch: count the uncached tokens as queued prefill there and
    write the predicted index entry (the prompt's blocks are cached there from now on)."""
    e = state[url]
    uncached = r.num_prompt_tokens - cached_blocks * r.block_size
    state[url] = replace(e, waiting=e.waiting + 1, inflight=e.inflight + 1,
                         inflight_tokens=e.inflight_tokens + r.num_prompt_tokens,
                         queued_prefill_tokens=e.queued_prefill_tokens + uncached)
    holders.setdefault(r.block_hashes, set()).add(url)


def route_burst(prompts: list[RequestMeta], n_workers: int = 4) -> list[str]:
    """Route requests arriving together (nothing finishes meanwhile) through `cost`."""
    p = make_policy("cost", random.Random(0))
    urls = [f"http://w{i}" for i in range(n_workers)]
    state = {u: EndpointStats(u, seconds_per_token=1e-3) for u in urls}
    holders: dict[tuple[int, ...], set[str]] = {}
    picks = []
    for r in prompts:
        held = holders.get(r.block_hashes, set())
        view = [replace(s, kv_cached_blocks=len(r.block_hashes) if u in held else 0)
                for u, s in state.items()]
        choice = p.choose(r, view)
        dispatch(state, choice.url, r, choice.cached_blocks, holders)
        picks.append(choice.url)
    return picks


def prefixed(prefix: int, tokens: int = 660, blocks: int = 40) -> RequestMeta:
    """A prompt whose first `blocks` blocks are prefix `prefix`, then a short question."""
    return RequestMeta(model="m", num_prompt_tokens=tokens,
                       block_hashes=tuple(prefix * 1000 + i for i in range(blocks)))


def test_burst_sharing_a_new_prefix_waits_for_its_prefill_instead_of_recomputing() -> None:
    burst = [prefixed(7) for _ in range(8)]
    picks = route_burst(burst)
    assert len(set(picks)) == 1  # computed once; the other 7 wait behind it (20 tokens each)
    # TTFT alone is the trap: for the second request, an idle worker looks (slightly) faster
    # than waiting behind the first one's 660-token prefill on the same worker
    hot = EndpointStats(picks[0], seconds_per_token=1e-3, kv_cached_blocks=40,
                        queued_prefill_tokens=660, waiting=1)
    idle = EndpointStats("http://idle", seconds_per_token=1e-3, kv_cached_blocks=0)
    assert estimate_seconds(burst[1], idle) < estimate_seconds(burst[1], hot)
    assert cost_seconds(burst[1], hot) < cost_seconds(burst[1], idle)


def test_burst_of_several_new_prefixes_spreads_them_and_groups_their_followers() -> None:
    order = [1, 2, 1, 3, 2, 4, 1, 3, 4, 2, 1, 4, 3, 2, 3, 4]
    picks = route_burst([prefixed(g) for g in order])
    home = {g: picks[order.index(g)] for g in set(order)}
    assert len(set(home.values())) == 4  # each new prefix computed once, on its own worker
    assert picks == [home[g] for g in order]  # and every follower waits for it there


def test_burst_on_one_prefix_spills_once_the_queue_outweighs_a_recomputation() -> None:
    # 665-token prompts, 640 of them a shared prefix: a follower costs 25 + 25 tokens where
    # the prefix is, behind its queue; a copy elsewhere costs 665 + 665. The first worker
    # takes followers until its queue (665 + 25 k) passes that, then one more copy is made.
    picks = route_burst([prefixed(9, tokens=665) for _ in range(40)])
    first, second = picks[0], picks[26]
    assert first != second
    assert picks == [first] * 26 + [second] * 14


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


def test_cost_of_a_pool_in_one_loop_is_each_workers_estimate_plus_its_own_prefill() -> None:
    """`costs` (the policy's one loop over the pool) spells out `estimate_seconds`: it must
    give exactly the same floats, precise or approximate cached blocks alike."""
    from sluice.router.policies.cost import costs

    rng = random.Random(7)
    pool = [EndpointStats(url=f"http://w{i}", running=rng.randint(0, 9),
                          waiting=rng.randint(0, 4), queued_prefill_tokens=rng.random() * 5000,
                          external_waiting=rng.randint(0, 3) * 1.0,
                          mean_prompt_tokens=rng.random() * 900,
                          seconds_per_token=rng.random() * 1e-3, overhead_s=rng.random() * 0.2,
                          cached_blocks=rng.randint(0, 40),
                          kv_cached_blocks=rng.choice([None, rng.randint(0, 40)]))
            for i in range(200)]
    for tokens in (0, 100, 640, 5000):
        request = meta(tokens, blocks=tokens // 16)
        expected = [estimate_seconds(request, e, 12.0) + e.seconds_per_token * max(
            0, tokens - (e.cached_blocks if e.kv_cached_blocks is None else e.kv_cached_blocks)
            * 16) for e in pool]
        assert costs(request, pool, 12.0) == expected
        assert [cost_seconds(request, e, 12.0) for e in pool] == expected
