"""Speculative decoding is lossless: the same outputs as plain decoding, token for token at
temperature 0 (drafts accepted and rejected, stops, max_tokens mid-draft, n = 2,
preemption, chunked prefill, prefix caching), the same distribution at temperature > 0;
rejected drafts' KV rolled back (the paged fake runner reads every token's K/V back from
its slot); counters and metrics; config errors that name the field."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from sluice.engine.config import EngineConfig, SpeculativeConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.messages import CoreOutputs, decode, encode
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence as Sequence_
from sluice.engine.spec_decode import (
    EXPLORE_EVERY,
    NgramProposer,
    Proposer,
    SpecDecoder,
    SpecPlanner,
    StepCost,
    SuffixProposer,
    _Candidate,
    expected_accepted,
)
from sluice.engine.stats import EngineStats
from sluice.protocol.errors import InvalidRequestError
from sluice.worker.metrics import EngineStatsCollector

from .fakes import VOCAB, FakeTokenizer, PagedFakeRunner, fake_logits, run_all

METHODS = [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "adaptive": False},
           {"method": "suffix", "num_speculative_tokens": 5, "adaptive": False}]


def cycling_logits(context: Sequence[int]) -> torch.Tensor:
    """Predictable text for prompts starting with an even token (a cycle of 7 tokens
    picked by the last one: drafts get accepted), random for odd ones (rejected)."""
    logits = fake_logits(context)
    if context[0] % 2 == 0:
        logits[(context[-1] * 3) % 7 + 1] += 12.0
    return logits


def soft_logits(context: Sequence[int]) -> torch.Tensor:
    """Like cycling_logits, but the cycle token only likely (sampling tests)."""
    logits = fake_logits(context) * 0.5
    logits[(context[-1] * 3) % 7 + 1] += 4.0
    return logits


def make_engine(spec: dict | None, num_kv_blocks: int = 64, budget: int = 64,
                caching: bool = True, logits=cycling_logits, **opts: object) -> LLMEngine:
    config = EngineConfig.from_options(None, block_size=4, max_num_batched_tokens=budget,
                                       enable_prefix_caching=caching, speculative_config=spec,
                                       **opts)
    runner = PagedFakeRunner(num_kv_blocks, 4, 128, FakeTokenizer())
    runner.logits_fn = logits
    return LLMEngine(config, runner)


PROMPTS = [[2, 5, 9, 13, 2, 7], [3, 17, 4, 9], [4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2],
           list(range(1, 31)), [6] * 9, [8, 40, 41, 42, 8, 40, 41]]


def generate(spec: dict | None, requests: list[tuple[list[int] | str, SamplingParams]],
             **kw: object) -> tuple[list[tuple], EngineStats, LLMEngine]:
    engine = make_engine(spec, **kw)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    final = run_all(engine)
    outs = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs,
              c.cumulative_logprob) for c in final[f"r{i}"].outputs]
            for i in range(len(requests))]
    return outs, engine.stats(), engine


@pytest.mark.parametrize("spec", METHODS, ids=["ngram", "suffix"])
@pytest.mark.parametrize("num_blocks,budget,caching", [
    (64, 64, True), (64, 7, True), (20, 9, False), (14, 64, True)])
def test_greedy_equals_plain(spec: dict, num_blocks: int, budget: int, caching: bool) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)
    requests = [(p, greedy) for p in PROMPTS]
    kw = dict(num_kv_blocks=num_blocks, budget=budget, caching=caching, max_num_seqs=4)
    plain, _, _ = generate(None, requests, **kw)
    got, stats, engine = generate(spec, requests, **kw)
    assert got == plain
    sd = stats.spec_decode
    assert 0 < sd["num_accepted_tokens"] < sd["num_draft_tokens"]  # accepted and rejected
    assert sd["accepted_per_pos"][0] >= sd["accepted_per_pos"][-1]
    assert engine.block_manager.num_free_blocks == num_blocks  # nothing leaked
    if num_blocks == 14:
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("spec", METHODS, ids=["ngram", "suffix"])
def test_stops_penalties_logprobs_n2_equal_plain(spec: dict) -> None:
    """Stop strings and stop ids inside a draft, max_tokens in the middle of one, n = 2,
    a repetition penalty, logprobs, min_tokens: all exactly as plain decoding."""
    cycle_prompt = [2, 5, 9, 13, 2, 7]
    plain_out, _, _ = generate(None, [(cycle_prompt, SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True))])
    tokens = plain_out[0][0][0]
    text = plain_out[0][0][1]
    requests = [
        (cycle_prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                      stop=[text[14:16]])),
        (cycle_prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                      stop_token_ids=[tokens[11]])),
        (cycle_prompt, SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)),
        (cycle_prompt, SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, n=2,
                                      logprobs=2)),
        ([4, 1, 2, 3, 4, 1, 2], SamplingParams(temperature=0.0, max_tokens=25,
                                               ignore_eos=True, repetition_penalty=1.3)),
        ([6, 1, 2, 6, 1], SamplingParams(temperature=0.0, max_tokens=20, min_tokens=15,
                                         stop_token_ids=[tokens[3]])),
    ]
    plain, _, _ = generate(None, requests)
    got, stats, _ = generate(spec, requests)
    assert got == plain
    assert got[0][0][2] == "stop" and got[1][0][2:4] == ("stop", tokens[11])
    assert len(got[2][0][0]) == 13
    assert stats.spec_decode["num_accepted_tokens"] > 0


def test_seeded_sampling_equals_plain() -> None:
    """Temperature > 0 with seeds: the same tokens as plain decoding, not only the same
    distribution (each position sampled as plain decoding would, the draft accepted iff
    it is that sample)."""
    requests = [(p, SamplingParams(temperature=0.9, top_k=6, max_tokens=20, seed=s,
                                   ignore_eos=True, n=2, logprobs=1))
                for s, p in enumerate(PROMPTS[:4])]
    plain, _, _ = generate(None, requests, logits=soft_logits)
    got, stats, _ = generate(METHODS[0], requests, logits=soft_logits)
    assert got == plain
    assert 0 < stats.spec_decode["num_accepted_tokens"] < stats.spec_decode["num_draft_tokens"]


TOP_K = 4


def exact_marginals(prompt: list[int], temperature: float, depth: int) -> list[dict[int, float]]:
    """P(output token i = t) for i < depth under soft_logits, by summing over paths."""
    paths = {(): 1.0}
    margins = []
    for _ in range(depth):
        nxt: dict[tuple[int, ...], float] = {}
        margin: Counter[int] = Counter()
        for path, p in paths.items():
            logits = soft_logits(prompt + list(path)) / temperature
            kth = logits.topk(TOP_K).values[-1]
            probs = logits.masked_fill(logits < kth, float("-inf")).softmax(-1).tolist()
            for t, q in enumerate(probs):
                if p * q > 1e-5:
                    nxt[path + (t,)] = p * q
                    margin[t] += p * q
        paths = nxt if len(margins) < depth - 1 else {}
        margins.append(dict(margin))
    return margins


@pytest.mark.parametrize("spec", METHODS, ids=["ngram", "suffix"])
def test_sampled_distribution_equals_plain(spec: dict) -> None:
    """Temperature 0.8, top_k 4: many unseeded requests (the engine's shared generator, so
    not the tokens plain decoding draws); the empirical distribution of the
    second to fourth output tokens (verified from drafts) is within a TV bound of the
    exact one (summed over paths); drafts were accepted and rejected."""
    prompt, n, temp = [2, 7, 1, 4, 6, 5, 2, 7, 1], 3000, 0.8  # the model's likely cycle
    exact = exact_marginals(prompt, temp, 4)
    engine = make_engine(spec, num_kv_blocks=4096, budget=4096, logits=soft_logits,
                         max_num_seqs=256)
    for i in range(n):
        engine.add_request(f"s{i}", prompt, SamplingParams(temperature=temp, max_tokens=4,
                                                           top_k=TOP_K, seed=i,
                                                           ignore_eos=True))
    final = run_all(engine)
    sd = engine.stats().spec_decode
    assert 0 < sd["num_accepted_tokens"] < sd["num_draft_tokens"]
    for pos in (1, 2, 3):
        counts = Counter(final[f"s{i}"].outputs[0].token_ids[pos] for i in range(n))
        tv = 0.5 * sum(abs(counts.get(t, 0) / n - exact[pos].get(t, 0.0))
                       for t in range(VOCAB))
        assert tv < 0.06, (pos, tv)  # sampling noise at n = 3000: ~0.04 at position 3


def test_proposers() -> None:
    config = SpeculativeConfig(method="ngram", prompt_lookup_min=2, prompt_lookup_max=3)
    engine = make_engine(None)
    engine.add_request("a", [1, 2, 3, 4, 5, 9, 2, 3], SamplingParams(max_tokens=1))
    seq = engine.core.requests["a"].seqs[0]
    ngram = NgramProposer(config)
    assert ngram.propose(seq, 3) == [4, 5, 9]  # "2 3" seen before, followed by 4 5 9
    seq.token_ids.append(7)
    assert ngram.propose(seq, 3) == []  # "3 7" never seen
    suffix = SuffixProposer(SpeculativeConfig(method="suffix",
                                              suffix_decoding_max_spec_factor=2.0))
    seq.token_ids[:] = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert suffix.propose(seq, 8) == [3, 4, 1, 2, 3, 4, 1, 2]
    suffix.forget(seq)  # its output (the last 2 tokens: "1 2") now feeds everyone's drafts
    seq.token_ids[:] = [5, 1, 6, 1, 6, 1, 7, 1]  # after "1": 6 6 7 here, 2 in shared counts
    assert suffix.propose(seq, 4) == [6, 1]  # match length 1, factor 2: depth 2; p 1/2, 1
    own = SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=0,
                            suffix_decoding_min_token_prob=0.6)
    assert SuffixProposer(own).propose(seq, 4) == [6]  # factor 1: depth 1; p = 2/3
    strict = dataclasses.replace(own, suffix_decoding_min_token_prob=0.7)
    assert SuffixProposer(strict).propose(seq, 4) == []


def brute_force_suffix(tokens: list[int], cached: list[tuple[list[int], int]], k: int,
                       depth: int, factor: float, min_prob: float) -> list[int]:
    """Suffix decoding by counting occurrences directly: after a context, the next-token
    counts are its occurrences in `tokens` (every position) and in each cached sequence
    (output positions only), ties to the token seen first (cached sequences in order,
    then `tokens`); the match is the longest context, each shorter one seen too."""
    def counts(ctx: list[int]) -> dict[int, int]:
        found: dict[int, int] = {}
        n = len(ctx)
        for seq, first in [*cached, (tokens, 1)]:
            for end in range(max(first, n, 1), len(seq)):
                if seq[end - n:end] == ctx:
                    found[seq[end]] = found.get(seq[end], 0) + 1
        return found

    def longest(ctx: list[int]) -> tuple[int, dict[int, int]]:
        n, found = 0, {}
        while n < min(depth, len(ctx)) and (more := counts(ctx[len(ctx) - n - 1:])):
            n, found = n + 1, more
        return n, found

    ctx, out, prob = list(tokens), [], 1.0
    match, found = longest(ctx)
    limit = min(k, int(factor * match))  # from the match before drafting
    while len(out) < limit and found:
        token = max(found, key=found.__getitem__)
        prob *= found[token] / sum(found.values())
        if prob < min_prob:
            break
        out.append(token)
        ctx.append(token)
        match, found = longest(ctx)
    return out


def test_suffix_proposer_drafts_what_counting_occurrences_gives() -> None:
    """The proposer's tables (context keys, incremental indexing, shared outputs) against
    a direct count over the texts, on random small-vocabulary texts that repeat."""
    rng = random.Random(0)
    drafted = 0
    for trial in range(60):
        depth, factor = rng.choice((2, 3, 24)), rng.choice((1.0, 2.0))
        min_prob = rng.choice((0.1, 0.4))
        config = SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=depth,
                                   suffix_decoding_max_spec_factor=factor,
                                   suffix_decoding_min_token_prob=min_prob)
        proposer, cached = SuffixProposer(config), []
        vocab = rng.choice((2, 3, 5))
        for i in range(rng.randrange(0, 3)):  # finished sequences: their outputs shared
            text = [rng.randrange(vocab) for _ in range(rng.randrange(2, 30))]
            first = rng.randrange(1, len(text))
            done = Sequence_(i, f"done{i}", 0, text, first, SamplingParams(), 64)
            proposer.forget(done)
            cached.append((text, first))
        text = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        seq = Sequence_(99, "live", 0, text, len(text), SamplingParams(), 64)
        for _ in range(rng.randrange(1, 25)):  # proposals as the sequence grows
            k = rng.randrange(1, 9)
            expected = brute_force_suffix(seq.token_ids, cached, k, depth, factor, min_prob)
            assert proposer.propose(seq, k) == expected, trial
            drafted += len(expected)
            seq.token_ids.append(rng.randrange(vocab))
    assert drafted > 100  # the texts repeat: most proposals draft


def plain_seq() -> Sequence_:
    """A sequence as the planner sees it: no prediction."""
    return Sequence_(0, "r", 0, [1], 1, SamplingParams(), 64)


def test_step_cost_keeps_a_point_per_size_where_steps_jump() -> None:
    """Rows past a multiple of 16 start a new AMX tile: 32 decodes 23.4 ms, 33-40 rows
    27-29 ms (measured). Each size keeps its own point up to EXACT_TOKENS, so the planner
    sees that 8 draft rows on 32 decodes cost 5.6 ms and does not take them; where the
    same rows cost 0.6 ms it does."""
    for cost_40, chosen in ((0.029, False), (0.024, True)):
        planner = SpecPlanner(adaptive=True, disable_by_batch_size=None)
        for tokens, seconds in ((1, 0.010), (32, 0.0234), (33, cost_40 - 0.0009),
                                (40, cost_40), (64, 0.045)):
            planner.cost.observe(tokens, seconds, weight=1.0)
        assert planner.cost.seconds(32) == pytest.approx(0.0234)
        assert planner.cost.seconds(33) == pytest.approx(cost_40 - 0.0009)
        seq = plain_seq()
        for _ in range(20):
            planner.record(seq, drafted=8, accepted=8)
        draft = _Candidate(seq, 8, expected_accepted(planner.rate(seq), 8))
        assert bool(planner.choose([draft], 32, 32)) == chosen


def test_step_cost_interpolates() -> None:
    cost = StepCost()
    for tokens, seconds in ((1, 0.010), (8, 0.012), (64, 0.050)):
        cost.observe(tokens, seconds, weight=1.0)
    assert cost.seconds(1) == pytest.approx(0.010)
    assert cost.seconds(36) == pytest.approx(0.031)
    assert cost.seconds(128) == pytest.approx(0.100)


def test_calibrated_sizes_follow_the_real_steps_drift() -> None:
    """Calibrated while the host was twice as slow: real one-token steps at half the time
    pull the sizes no real step has met down with them (else a verify that looked dear
    at start never runs again), and a size a real step meets goes on from there."""
    cost = StepCost()
    for tokens, seconds in ((1, 0.020), (8, 0.024), (16, 0.040)):
        cost.observe(tokens, seconds, weight=1.0)
    for _ in range(80):
        cost.observe(1, 0.010)
    assert cost.seconds(1) == pytest.approx(0.010, rel=0.01)
    assert cost.seconds(8) == pytest.approx(0.012, rel=0.01)
    assert cost.seconds(12) == pytest.approx(0.016, rel=0.01)
    cost.observe(8, 0.013)  # met: from the drifted 0.012, not the calibrated 0.024
    assert cost.seconds(8) == pytest.approx(0.0121, rel=0.01)
    planner = SpecPlanner(adaptive=True, disable_by_batch_size=None)
    planner.cost = cost
    assert planner.may_pay(1, 1, 8)  # 1 + 7.2 tokens for 1.6x a step's time
    for tokens, seconds in ((1, 0.020), (9, 0.2)):  # a steep curve stays steep
        planner.cost.observe(tokens, seconds, weight=1.0)
    assert not planner.may_pay(1, 1, 8)


def test_proposers_are_skipped_exactly_where_no_draft_could_be_chosen() -> None:
    """`worth_drafting` against `choose` itself over every draft size of every sequence,
    on a flat and a steep step-time curve, with sequences that drafted well or badly."""
    outcomes = set()
    for slope in (0.0002, 0.004):  # seconds a token
        for good in (0, 1, 3):
            planner = SpecPlanner(adaptive=True, disable_by_batch_size=None)
            for tokens in (1, 8, 32, 40, 48, 64):
                planner.cost.observe(tokens, 0.1 + slope * tokens, weight=1.0)
            seqs = [plain_seq() for _ in range(4)]
            for i, seq in enumerate(seqs):  # the first `good` accept every draft
                for _ in range(20):
                    planner.record(seq, drafted=4, accepted=4 if i < good else 0)
            worth = planner.worth_drafting([(seq, 8) for seq in seqs], 32, 32)
            chosen = any(planner.choose([_Candidate(seq, n, expected_accepted(planner.rate(seq), n))],
                                        32, 32)
                         for seq in seqs for n in range(1, 9))
            assert worth == chosen, (slope, good)
            outcomes.add(worth)
    assert outcomes == {True, False}


def test_a_fallen_acceptance_rate_is_measured_again() -> None:
    """After every draft failed (the sequence's rate and the prior near 0), a sequence
    still drafts one token every EXPLORE_EVERY steps, and drafts deeper once those pay."""
    planner = SpecPlanner(adaptive=True, disable_by_batch_size=None)
    seq = plain_seq()
    for _ in range(40):
        planner.record(seq, drafted=3, accepted=0)
    depths = [planner.depth(seq, 4) for _ in range(2 * EXPLORE_EVERY)]
    assert depths.count(1) == 2 and set(depths) == {0, 1}
    for _ in range(10):
        planner.record(seq, drafted=1, accepted=1)
    assert planner.depth(seq, 4) >= 2


def test_adaptive_planner_turns_off_when_verification_costs() -> None:
    """A step-time curve where tokens cost in proportion (compute-bound): no drafts;
    one that is flat (bandwidth-bound): drafts."""
    requests = [([2, 5, 9, 13, 2, 7], SamplingParams(temperature=0.0, max_tokens=20,
                                                     ignore_eos=True))]
    for slope, drafted in ((1.0, False), (0.0, True)):
        engine = make_engine({"method": "ngram", "prompt_lookup_min": 1})
        spec = engine.core.spec
        assert spec is not None
        for n in (1, 2, 4, 8, 16, 32, 64):
            spec.planner.cost.observe(n, 0.01 + slope * 0.01 * n, weight=1.0)
        spec.observe_step = lambda tokens, seconds: None  # keep the curve as set
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(f"r{i}", prompt, params)
        run_all(engine)
        assert (engine.stats().spec_decode["num_drafts"] > 0) == drafted


def test_metrics_and_wire() -> None:
    _, stats, _ = generate(METHODS[0], [([2, 5, 9, 13, 2, 7], SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True))])
    sd = stats.spec_decode
    assert sd["num_drafts"] > 0
    wired = decode(encode(CoreOutputs([], stats, [])))
    assert isinstance(wired, CoreOutputs) and wired.stats.spec_decode == sd
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats, lambda: "m"))
    text = generate_latest(registry).decode()
    assert f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {float(sd["num_drafts"])}' \
        in text
    assert (f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} '
            f'{float(sd["num_draft_tokens"])}') in text
    assert (f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} '
            f'{float(sd["num_accepted_tokens"])}') in text
    assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}}'
            f' {float(sd["accepted_per_pos"][0])}') in text
    assert sum(sd["accepted_per_pos"]) == sd["num_accepted_tokens"]


@pytest.mark.parametrize("value,param", [
    ('{"method": "eagle"}', "speculative_config.method"),
    ('{"method": "draft_model"}', "speculative_config.model"),
    ('{"method": "ngram", "model": "x"}', "speculative_config.model"),
    ('{"method": "draft_model", "model": "x", "draft_num_kv_blocks": 0}',
     "speculative_config.draft_num_kv_blocks"),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "speculative_config.prompt_lookup_max"),
    ('{"method": "ngram", "lookahead": 2}', "speculative_config.lookahead"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}',
     "speculative_config.suffix_decoding_min_token_prob"),
    ("{not json", "speculative_config"),
    ("[1, 2]", "speculative_config"),
    # found by a new-user pass: a wrong type leaked Python's TypeError ("'<=' not
    # supported between instances of 'int' and 'str'"), a float count passed and failed
    # the engine core's start (can't multiply sequence by non-int), "no" was a true bool
    ('{"method": "ngram", "num_speculative_tokens": "4"}',
     "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 4.0}',
     "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_max": true}', "speculative_config.prompt_lookup_max"),
    ('{"method": "ngram", "adaptive": "no"}', "speculative_config.adaptive"),
    ('{"method": 3}', "speculative_config.method"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": "2"}',
     "speculative_config.suffix_decoding_max_spec_factor"),
    # and another method's field was ignored: ngram's lookup under suffix decoding
    ('{"method": "suffix", "prompt_lookup_min": 2}', "speculative_config.prompt_lookup_min"),
    ('{"suffix_decoding_max_tree_depth": 8}', "speculative_config.suffix_decoding_max_tree_depth"),
    ('{"method": "ngram", "draft_num_kv_blocks": 8}', "speculative_config.draft_num_kv_blocks"),
])
def test_bad_config_names_the_field(value: str, param: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        EngineConfig.from_options(None, speculative_config=value)
    assert exc.value.param == param


def test_config_parses_vllm_json() -> None:
    config = EngineConfig.from_options(None, speculative_config=(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4}'))
    assert config.speculative == SpeculativeConfig("ngram", 3, 2, 4)
    suffix = EngineConfig.from_options(None, speculative_config=(  # an int for a float
        '{"method": "suffix", "suffix_decoding_max_spec_factor": 2, "adaptive": false, '
        '"disable_by_batch_size": null}')).speculative
    assert suffix is not None and suffix.suffix_decoding_max_spec_factor == 2
    assert math.isclose(SpeculativeConfig(method="suffix").suffix_decoding_min_token_prob, 0.1)


class OracleProposer(Proposer):
    """Drafts the plain output it was told (a random tiny model repeats nothing, so no
    n-gram would match), with every third drafted position wrong: real forwards verify
    drafts that are accepted and drafts that are rejected."""

    def __init__(self, config: SpeculativeConfig | None = None,
                 answers: dict[tuple[int, ...], list[int]] | None = None) -> None:
        self.answers = answers or {}
        self.calls = 0

    def propose(self, seq: Sequence_, k: int) -> list[int]:
        answer = self.answers[tuple(seq.token_ids[:seq.num_prompt_tokens])]
        draft = list(answer[seq.num_output_tokens:seq.num_output_tokens + k])
        for i in range(len(draft)):
            self.calls += 1
            if self.calls % 3 == 0:
                draft[i] = (draft[i] + 1) % 40000
        return draft

    def forget(self, seq: Sequence_) -> None:
        pass


def test_tiny_model_outputs_equal_plain(tiny_llama_dir: Path) -> None:
    """The real forward: k+1 logit rows per drafted sequence over the paged cache, KV of
    rejected drafts rolled back. Random prompts, n = 2, max_tokens mid-draft, a stop
    string, chunked prefill and preemption (a small pool): greedy outputs equal to the
    same engine's with speculation detached, for ngram, suffix and an oracle proposer
    (drafts partly right, so verification accepts and rejects on the real model)."""
    from sluice.engine.llm import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=14, block_size=8,
              max_num_batched_tokens=24, max_num_seqs=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                  "prompt_lookup_min": 1, "adaptive": False})
    core = llm.engine.core
    rng = random.Random(0)
    cycle = [rng.randrange(300, 40000) for _ in range(5)]
    prompts: list[list[int]] = [cycle * 5, [rng.randrange(300, 40000) for _ in range(19)],
                                cycle * 3 + [77, 78], [rng.randrange(300, 40000) for _ in range(7)]]
    greedy = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, n=n)
              for m, n in ((31, 1), (22, 2), (13, 1), (26, 1))]
    ngram, core.spec = core.spec, None
    plain = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, greedy)]
    text = llm.generate([prompts[0]], greedy[0])[0].outputs[0].text
    stop = [dataclasses.replace(greedy[0], stop=[text[len(text) // 2:len(text) // 2 + 3]])]
    plain_stop = llm.generate([prompts[0]], stop)[0].outputs[0]
    assert plain_stop.finish_reason == "stop"
    assert core.scheduler.num_preemptions > 0

    def decoder(method: str) -> SpecDecoder:
        return SpecDecoder(SpeculativeConfig(method=method, num_speculative_tokens=5,
                                             adaptive=False), core.sampler,
                           core.block_manager, core.info.max_model_len)

    oracle = decoder("ngram")
    oracle.proposer = OracleProposer(answers={tuple(p): o[0] for p, o in zip(prompts, plain,
                                                                              strict=True)})
    for spec in (ngram, decoder("suffix"), oracle):
        core.spec = spec
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, greedy)]
        assert got == plain
        got_stop = llm.generate([prompts[0]], stop)[0].outputs[0]
        assert (got_stop.token_ids, got_stop.text) == (plain_stop.token_ids, plain_stop.text)
    counts = oracle.stats()
    assert 0 < counts["num_accepted_tokens"] < counts["num_draft_tokens"]
    assert counts["accepted_per_pos"][1] > 0  # several drafts accepted in one forward
    assert core.block_manager.num_free_blocks == 14


def test_worker_and_serve_flag() -> None:
    from sluice.cli import build_parser
    from sluice.serve import worker_flags
    from sluice.worker.cli import engine_config

    value = '{"method": "suffix", "num_speculative_tokens": 6}'
    for cmd in ("worker", "serve"):
        args = build_parser([cmd]).parse_args([cmd, "--speculative-config", value])
        config = engine_config(args)
        assert config.speculative == SpeculativeConfig(method="suffix", num_speculative_tokens=6)
    assert worker_flags(args)[-2:] == ["--speculative-config", value]  # serve -> its workers
    bad = build_parser(["worker"]).parse_args(["worker", "--speculative-config", '{"k": 1}'])
    with pytest.raises(InvalidRequestError) as exc:
        engine_config(bad)
    assert exc.value.param == "speculative_config.k"
