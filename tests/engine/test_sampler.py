"""Sampler: exact masks and penalties on small tensors; seeds independent of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from sluice.engine.sampler import (
    Sampler,
    apply_frequency_presence,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    greedy,
)
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence

INF = float("-inf")
PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def make_seq(params: SamplingParams, seq_id: int = 1, prompt: list[int] | None = None) -> Sequence:
    prompt = prompt or [0, 1]
    gen = torch.Generator() if params.seed is not None else None
    return Sequence(seq_id, f"r{seq_id}", 0, list(prompt), len(prompt), params, 64,
                    generator=gen, seed=params.seed)


def test_top_k_keeps_exactly_k_largest() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    out = apply_top_k(logits, torch.tensor([2, -1]))
    assert out.tolist() == [[INF, 3.0, 2.0, INF], [1.0, 3.0, 2.0, 0.0]]


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = PROBS.log().repeat(3, 1)
    out = apply_top_p(logits, torch.tensor([0.75, 0.85, 1.0]))
    kept = (out > INF).tolist()
    assert kept == [[True, True, False, False], [True, True, True, False], [True] * 4]


def test_min_p_drops_below_fraction_of_top() -> None:
    out = apply_min_p(PROBS.log(), torch.tensor([0.2]))
    assert (out > INF).tolist() == [[True, True, True, False]]


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    assert apply_repetition_penalty(logits, seen, torch.tensor([2.0])).tolist() == [[1.0, -4.0, 1.0]]


def test_frequency_and_presence_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    counts = torch.tensor([[2.0, 0.0, 1.0]])
    out = apply_frequency_presence(logits, counts, torch.tensor([0.5]), torch.tensor([1.0]))
    assert out.tolist() == [[0.0, -2.0, -0.5]]


def test_penalties_use_prompt_for_repetition_and_output_for_frequency() -> None:
    sampler = Sampler(eos_token_ids=set())
    seq = make_seq(SamplingParams(temperature=0.0, repetition_penalty=4.0), prompt=[0])
    logits = torch.tensor([[4.0, 3.0, 2.0]])
    assert sampler(logits, [seq])[0].token_id == 1  # token 0 (in prompt): 4/4 = 1 < 3
    seq2 = make_seq(SamplingParams(temperature=0.0, frequency_penalty=2.0), prompt=[0])
    seq2.token_ids += [1, 1]  # token 1 generated twice: 3 - 4 = -1
    assert sampler(torch.tensor([[1.5, 3.0, 2.0]]), [seq2])[0].token_id == 2


def test_greedy_picks_the_first_of_tied_maxima_as_argmax() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0], [-1.0, -5.0, -1.0, -2.0]])
    assert greedy(logits).tolist() == [1, 0, 0] == logits.argmax(dim=-1).tolist()


def test_greedy_is_argmax_and_min_tokens_masks_eos() -> None:
    sampler = Sampler(eos_token_ids={2})
    logits = torch.tensor([[0.0, 1.0, 5.0]])
    assert sampler(logits, [make_seq(SamplingParams(temperature=0.0))])[0].token_id == 2
    early = make_seq(SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[1]))
    assert sampler(logits, [early])[0].token_id == 0  # eos 2 and stop id 1 masked
    ignoring = make_seq(SamplingParams(temperature=0.0, min_tokens=1, ignore_eos=True))
    assert sampler(logits, [ignoring])[0].token_id == 2


def test_seeded_requests_reproduce_regardless_of_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = SamplingParams(temperature=1.0, seed=1234)

    def draws(batch_size: int) -> list[int]:
        seqs = [make_seq(params, 1)] + [make_seq(SamplingParams(temperature=0.7), i)
                                         for i in range(2, batch_size + 1)]
        sampler = Sampler(eos_token_ids=set(), seed=batch_size)
        out = []
        for _ in range(20):
            tokens = [r.token_id for r in sampler(logits[:batch_size], seqs)]
            for seq, token in zip(seqs, tokens, strict=True):
                seq.token_ids.append(token)
            out.append(tokens[0])
        return out

    alone, batched = draws(1), draws(6)
    assert alone == batched
    assert len(set(alone)) > 3  # really sampling, not argmax


def test_a_seeded_sequence_resumed_mid_output_draws_what_it_would_have() -> None:
    """A migrated request arrives with its output so far: its next draws are the
    uninterrupted run's (each token's noise comes from (seed, position))."""
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.0, seed=7)
    sampler = Sampler(eos_token_ids=set())
    whole = make_seq(params)
    for _ in range(12):
        whole.token_ids.append(sampler(logits, [whole])[0].token_id)
    resumed = make_seq(params, prompt=whole.token_ids[:2 + 5])
    resumed.num_prompt_tokens = 2  # the last 5 ids were generated elsewhere
    for _ in range(7):
        resumed.token_ids.append(sampler(logits, [resumed])[0].token_id)
    assert resumed.token_ids == whole.token_ids
    assert len(set(whole.output_token_ids)) > 3


def test_top_k_sampling_stays_in_top_k() -> None:
    sampler = Sampler(eos_token_ids=set(), seed=0)
    logits = torch.tensor([[0.0, 1.0, 0.9, 0.1, 0.2]])
    seq = make_seq(SamplingParams(temperature=1.5, top_k=2, seed=3))
    for _ in range(100):  # each draw at the next position, as the engine appends
        seq.token_ids.append(sampler(logits, [seq])[0].token_id)
    assert set(seq.output_token_ids) == {1, 2}


def test_logprobs_are_raw_log_softmax_with_sampled_first() -> None:
    sampler = Sampler(eos_token_ids=set())
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    seq = make_seq(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=100.0),
                   prompt=[1])
    result = sampler(logits, [seq])[0]
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert result.token_id == 2  # 3/100 < 2: penalty changes the choice ...
    assert result.top_logprobs is not None
    assert list(result.top_logprobs) == [2, 1]  # ... sampled first, then the top-2
    assert math.isclose(result.top_logprobs[1], float(raw[1]), rel_tol=1e-6)
    assert math.isclose(result.logprob or 0.0, float(raw[2]), rel_tol=1e-6)  # raw, not penalized


def test_logit_bias_moves_the_choice_and_leaves_logprobs_raw() -> None:
    """+100 on a token makes greedy pick it, -100 on the argmax makes it the runner-up;
    the logprobs are the model's own (vLLM's default `raw_logprobs`)."""
    sampler = Sampler(eos_token_ids=set())
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    assert sampler(logits, [make_seq(SamplingParams(temperature=0.0,
                                                    logit_bias={0: 100.0}))])[0].token_id == 0
    banned = sampler(logits, [make_seq(SamplingParams(temperature=0.0, logprobs=0,
                                                      logit_bias={2: -100.0}))])[0]
    assert banned.token_id == 3
    assert banned.logprob == pytest.approx(float(logits.log_softmax(-1)[0, 3]))
    # a row without a bias beside one with it: only the biased row moves
    rows = sampler(logits.repeat(2, 1), [make_seq(SamplingParams(temperature=0.0), 1),
                                         make_seq(SamplingParams(temperature=0.0,
                                                                 logit_bias={1: 50.0}), 2)])
    assert [r.token_id for r in rows] == [2, 1]
    sampled = make_seq(SamplingParams(temperature=1.0, seed=3, logit_bias={0: 100.0}))
    assert all(sampler(logits, [sampled])[0].token_id == 0 for _ in range(5))
