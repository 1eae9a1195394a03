"""LLMEngine over a paged fake runner: exact greedy outputs under chunking, prefix caching
and preemption; stops, n > 1, seeds, output kinds, errors, abort, KV events."""

from __future__ import annotations

import pytest

from sluice.engine.config import EngineConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.outputs import RequestOutput
from sluice.engine.sampling_params import RequestOutputKind, SamplingParams
from sluice.protocol.block_hash import hash_blocks
from sluice.protocol.errors import ContextLengthError, InvalidRequestError
from sluice.protocol.kv_events import BlockStored

from .fakes import FakeTokenizer, PagedFakeRunner, reference_greedy, run_all

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SHARED = [5, 9, 13, 2, 7, 7, 30, 41, 3, 8, 22]


def make_engine(num_kv_blocks: int = 64, budget: int = 64, caching: bool = True,
                max_model_len: int = 128, tokenizer: FakeTokenizer | None = None,
                **opts: object) -> LLMEngine:
    config = EngineConfig.from_options(None, block_size=4, max_num_batched_tokens=budget,
                                       enable_prefix_caching=caching, **opts)
    return LLMEngine(config, PagedFakeRunner(num_kv_blocks, 4, max_model_len, tokenizer))


def prompts() -> list[list[int]]:
    return [SHARED + [1, 2, 3, 4, 5, 6], [17, 4], SHARED + [60], list(range(1, 31)),
            SHARED[:8], [33] * 9]


@pytest.mark.parametrize("num_blocks,budget,caching", [
    (64, 64, True), (64, 8, True), (64, 8, False), (12, 8, True), (12, 5, False)])
def test_greedy_matches_reference(num_blocks: int, budget: int, caching: bool) -> None:
    engine = make_engine(num_blocks, budget, caching, max_num_seqs=4)
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, GREEDY)
    final = run_all(engine)
    for i, p in enumerate(prompts()):
        out = final[f"r{i}"].outputs[0]
        assert out.token_ids == reference_greedy(p, 12), f"request {i}"
        assert out.finish_reason == "length"
    stats = engine.stats()
    assert stats.generation_tokens == 12 * len(prompts())
    assert (stats.prefix_cache_hits > 0) == caching
    assert (stats.num_preemptions > 0) == (num_blocks == 12)
    assert engine.block_manager.num_free_blocks == num_blocks
    # each request's own counts, as its trace shows them (observe/tracing.py)
    metrics = [final[f"r{i}"].metrics for i in range(len(prompts()))]
    assert sum(m.num_preemptions for m in metrics if m) == stats.num_preemptions
    longest = final["r3"].metrics  # 30 prompt tokens
    assert longest is not None
    assert (longest.num_prefill_chunks == 1) if budget >= 30 else (
        longest.num_prefill_chunks >= -(-30 // budget))  # the budget is shared per step


def test_prefix_hit_reported_as_cached_tokens() -> None:
    engine = make_engine()
    engine.add_request("a", SHARED + [1], GREEDY)
    run_all(engine)
    engine.add_request("b", SHARED + [2, 3], GREEDY)
    out = run_all(engine)["b"]
    assert out.num_cached_tokens == 8  # two full blocks of the shared 11 tokens
    assert out.outputs[0].token_ids == reference_greedy(SHARED + [2, 3], 12)


def test_abort_frees_blocks_at_once() -> None:
    engine = make_engine(num_kv_blocks=16)
    engine.add_request("a", list(range(1, 20)), GREEDY)
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < 16
    engine.abort_request("a")
    assert engine.block_manager.num_free_blocks == 16
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_admission_errors_name_the_parameter() -> None:
    engine = make_engine(num_kv_blocks=4, max_model_len=40)
    with pytest.raises(ContextLengthError) as exc:
        engine.add_request("a", [1] * 30, SamplingParams(max_tokens=20))
    assert exc.value.param == "max_tokens"
    assert "maximum context length is 40 tokens" in exc.value.message
    assert "30 in the messages, 20 in the completion" in exc.value.message
    with pytest.raises(ContextLengthError) as exc:
        engine.add_request("a", [1] * 40, SamplingParams())
    assert exc.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as exc:  # 10 + 10 tokens > 4 blocks of 4
        engine.add_request("a", [1] * 10, SamplingParams(max_tokens=10))
    assert exc.value.param == "max_tokens" and "KV cache" in exc.value.message
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="out of vocabulary"):
        engine.add_request("a", [1, 999], SamplingParams())
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.add_request("a", [1, 2], SamplingParams(max_tokens=2))


def test_max_tokens_none_runs_to_max_model_len() -> None:
    engine = make_engine(max_model_len=24)
    engine.add_request("a", [3] * 10, SamplingParams(temperature=0.0, max_tokens=None,
                                                     ignore_eos=True))
    out = run_all(engine)["a"].outputs[0]
    assert len(out.token_ids) == 14 and out.finish_reason == "length"


def test_stop_token_id_eos_and_min_tokens() -> None:
    prompt = [4, 8, 15, 16, 23, 42]
    ref = reference_greedy(prompt, 12)
    target = ref[3]
    first = ref.index(target)
    engine = make_engine()
    engine.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                   stop_token_ids=[target], ignore_eos=True))
    out = run_all(engine)["s"].outputs[0]
    assert out.token_ids == ref[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", target)
    eos_engine = make_engine(tokenizer=FakeTokenizer(eos_token_ids={target}))
    eos_engine.add_request("e", prompt, SamplingParams(temperature=0.0, max_tokens=12))
    out = run_all(eos_engine)["e"].outputs[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None
    eos_engine.add_request("m", prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                       min_tokens=first + 2))
    out = run_all(eos_engine)["m"].outputs[0]
    assert len(out.token_ids) >= first + 2 and target not in out.token_ids[:first + 2]


def test_stop_string_cuts_text() -> None:
    prompt = [9, 9, 1, 2]
    tok = FakeTokenizer()
    full = tok.decode(reference_greedy(prompt, 12))
    stop = full[4:6]
    engine = make_engine()
    engine.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                   stop=[stop], ignore_eos=True))
    out = run_all(engine)["s"].outputs[0]
    assert out.text == full[:full.find(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_n_siblings_share_prompt_blocks_and_seeds_reproduce() -> None:
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks

    def run() -> RequestOutput:
        engine = make_engine()
        engine.add_request("n", prompt, SamplingParams(n=3, temperature=1.0, seed=11,
                                                       max_tokens=8, ignore_eos=True))
        out = run_all(engine)["n"]
        assert engine.stats().prefix_cache_hits == 2 * 16  # both siblings hit 4 blocks
        return out

    a, b = run(), run()
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3


def test_sibling_i_of_a_seeded_request_is_the_request_seeded_seed_plus_i() -> None:
    """vLLM gives the i-th of n children the seed `seed + i`
    (ParentRequest._get_child_sampling_params), so sibling i is what a single request
    with that seed gets; the same here, whatever else shares the batch."""
    prompt = list(range(1, 18))
    kw = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    engine = make_engine()
    engine.add_request("n", prompt, SamplingParams(n=3, seed=11, **kw))
    engine.add_request("other", [5, 6], SamplingParams(n=2, seed=3, **kw))
    siblings = [c.token_ids for c in run_all(engine)["n"].outputs]
    singles = []
    for i in range(3):
        alone = make_engine()
        alone.add_request("one", prompt, SamplingParams(seed=11 + i, **kw))
        singles.append(run_all(alone)["one"].outputs[0].token_ids)
    assert siblings == singles


def test_delta_outputs_join_to_the_cumulative_result() -> None:
    prompt = [7, 1, 7, 1]
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("d", prompt, params)
    texts, tokens, logprobs = [], [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
            tokens += out.outputs[0].token_ids
            logprobs += out.outputs[0].logprobs or []
    assert tokens == reference_greedy(prompt, 10)
    assert "".join(texts) == FakeTokenizer().decode(tokens)
    assert len(logprobs) == 10 and all(tok in lp for tok, lp in zip(tokens, logprobs, strict=True))
    assert all(len(lp) <= 3 for lp in logprobs)


def test_final_only_emits_once_with_cumulative_logprob() -> None:
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("f", [2, 3], params)
    outs = [o for _ in range(20) for o in engine.step()]
    assert len(outs) == 1 and outs[0].finished
    c = outs[0].outputs[0]
    assert c.logprobs is not None
    assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs, strict=True)))


def test_kv_events_describe_cached_prompt_blocks() -> None:
    engine = make_engine()
    prompt = list(range(1, 11))  # 2 full blocks
    engine.add_request("k", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    run_all(engine)
    events = engine.drain_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[0].block_hashes == hash_blocks(prompt, 4)
    assert stored[0].parent_block_hash is None and stored[0].token_ids == prompt[:8]
    assert engine.drain_kv_events() == []


def test_priority_runs_first_when_slots_are_scarce() -> None:
    engine = make_engine(max_num_seqs=1)
    engine.add_request("low", [1, 2], SamplingParams(max_tokens=3), priority=5, arrival_time=1.0)
    engine.add_request("high", [3, 4], SamplingParams(max_tokens=3), priority=0, arrival_time=2.0)
    order = [o.request_id for _ in range(10) for o in engine.step() if o.finished]
    assert order == ["high", "low"]


def test_iteration_tokens_counts_each_step_with_output() -> None:
    """vLLM's vllm:iteration_tokens_total (missing from /metrics): one observation per
    step that produced tokens, of its generated tokens plus the whole prompt of each
    request it gave a first token; a step of prompt chunks only is not observed."""
    engine = make_engine(budget=8)
    three = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(1, 18)), three)  # 17 prompt tokens: 3 chunks
    engine.add_request("b", [4, 5], three)
    run_all(engine)
    stats = engine.stats()
    # steps: a 8 | a 8 | a 1 + b 2 (first tokens: 17 + 2 + 2) | 2 | 2
    expected = [0] * 14
    expected[1], expected[3] = 2, 1  # le=8: two steps of 2 tokens; le=32: 21 tokens
    assert stats.iteration_tokens == expected and stats.iteration_tokens_sum == 25
    assert stats.iteration_tokens_sum == stats.prompt_tokens + stats.generation_tokens


def test_a_priority_under_fcfs_is_refused_naming_it() -> None:
    """fcfs never reads a priority: one other than 0 was accepted and ignored. vLLM
    refuses it ("Got priority 5 but Priority scheduling is not enabled")."""
    engine = make_engine(scheduling_policy="fcfs")
    with pytest.raises(InvalidRequestError, match="Priority scheduling is not enabled") as info:
        engine.add_request("r", [1, 2], SamplingParams(max_tokens=3), priority=5)
    assert info.value.param == "priority" and not engine.has_unfinished_requests()
    engine.add_request("r", [1, 2], SamplingParams(max_tokens=3), priority=0)  # the default
