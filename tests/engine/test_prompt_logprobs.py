"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`) over the paged fake runner:
each prompt position's logprob given the tokens before it, exactly the reference model's,
under chunked prefill, a prefix the cache holds, preemption, n > 1, a stream and beside
requests that do not ask; and the offline `LLM`'s vLLM shape."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.sampling_params import RequestOutputKind, SamplingParams
from sluice.protocol.errors import InvalidRequestError

from .fakes import fake_logits, reference_greedy, run_all
from .test_llm_engine import SHARED, make_engine


def reference(prompt: list[int], top: int) -> list[dict[int, float] | None]:
    """Position i's entry from the reference model over prompt[:i]: the prompt token's
    logprob and the `top` likeliest."""
    out: list[dict[int, float] | None] = [None]
    for i in range(1, len(prompt)):
        lp = fake_logits(prompt[:i]).log_softmax(-1)
        entry = {prompt[i]: float(lp[prompt[i]])}
        values, indices = lp.topk(top) if top else (torch.empty(0), torch.empty(0))
        for t, v in zip(indices.tolist(), values.tolist(), strict=True):
            entry.setdefault(int(t), float(v))
        out.append(entry)
    return out


def assert_same(got: list[dict[int, float] | None] | None,
                want: list[dict[int, float] | None]) -> None:
    assert got is not None and len(got) == len(want)
    assert got[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g is not None and w is not None
        assert list(g) == list(w)  # the prompt token first, then the likeliest in order
        assert list(g.values()) == pytest.approx(list(w.values()), abs=1e-5)


PROMPT = SHARED + list(range(20, 40))  # 31 tokens


@pytest.mark.parametrize("budget", [64, 7, 3])
def test_prompt_logprobs_match_the_reference_under_chunking(budget: int) -> None:
    engine = make_engine(budget=budget)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    engine.add_request("a", PROMPT, params)
    engine.add_request("b", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=6,
                                                             ignore_eos=True))
    final = run_all(engine)
    assert_same(final["a"].prompt_logprobs, reference(PROMPT, 3))
    assert final["a"].outputs[0].token_ids == reference_greedy(PROMPT, 4)
    assert final["b"].prompt_logprobs is None  # a neighbour that did not ask
    assert final["b"].outputs[0].token_ids == reference_greedy([5, 6, 7, 8, 9], 6)


def test_a_cached_prefix_is_computed_again_for_its_logprobs() -> None:
    engine = make_engine()
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("warm", PROMPT, greedy)
    run_all(engine)
    engine.add_request("again", PROMPT, greedy)
    assert run_all(engine)["again"].num_cached_tokens == 28  # the cache holds the prefix
    engine.add_request("scored", PROMPT, SamplingParams(temperature=0.0, max_tokens=2,
                                                        prompt_logprobs=0))
    out = run_all(engine)["scored"]
    assert out.num_cached_tokens == 0
    assert_same(out.prompt_logprobs, reference(PROMPT, 0))


def test_preemption_does_not_repeat_or_lose_positions() -> None:
    # 12 blocks of 4 tokens: three 20-token prompts growing to 30 cannot all stay
    engine = make_engine(num_kv_blocks=12, budget=8, max_num_seqs=3)
    prompts = [list(range(1 + k, 21 + k)) for k in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    final = run_all(engine)
    assert engine.stats().num_preemptions > 0
    for i, p in enumerate(prompts):
        assert_same(final[f"r{i}"].prompt_logprobs, reference(p, 1))
        assert final[f"r{i}"].outputs[0].token_ids == reference_greedy(p, 10)


def test_n_choices_share_one_prompt_logprobs() -> None:
    engine = make_engine()
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=3, ignore_eos=True,
                            prompt_logprobs=2)
    engine.add_request("n", PROMPT, params)
    out = run_all(engine)["n"]
    assert len(out.outputs) == 3
    assert_same(out.prompt_logprobs, reference(PROMPT, 2))


def test_a_delta_stream_carries_them_once() -> None:
    engine = make_engine(budget=8)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=0,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("s", PROMPT, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step()]
    assert len(seen) == 5
    assert_same(seen[0], reference(PROMPT, 0))
    assert seen[1:] == [None] * 4


def test_a_one_token_prompt_has_only_the_leading_none() -> None:
    engine = make_engine()
    engine.add_request("one", [9], SamplingParams(temperature=0.0, max_tokens=2,
                                                  prompt_logprobs=5))
    assert run_all(engine)["one"].prompt_logprobs == [None]


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_is_refused(value: object) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
    assert err.value.param == "prompt_logprobs"
