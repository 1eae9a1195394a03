"""Draft-model speculation is lossless and keeps its own KV right: with a paged fake
draft (every context token read back from the draft pool's slots) and with tiny random
models. A draft equal to the target is accepted everywhere at temperature 0 (so the
draft's catch-up and rollback rebuilt exactly the target's context); a different draft
gives plain decoding's tokens, greedy and seeded at temperature > 0, through chunked
prefill, the prefix cache, preemption, n = 2 and a draft pool too small for everyone.
The planner counts the draft's forward time. Config errors name the field."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.engine.config import EngineConfig, SpeculativeConfig
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode import SpecDecoder
from sluice.engine.spec_draft import DraftModelProposer
from sluice.protocol.errors import InvalidRequestError

from .fakes import FakeTokenizer, PagedFakeRunner, fake_logits, run_all
from .test_spec_decode import PROMPTS, cycling_logits, make_engine, soft_logits


def half_right(context: Sequence[int]) -> torch.Tensor:
    """A draft that agrees with cycling_logits' cycle on contexts of even length only."""
    return cycling_logits(context) if len(context) % 2 == 0 else fake_logits([99, *context])


def draft_config(k: int = 4, adaptive: bool = False, blocks: int | None = None
                 ) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model="fake", num_speculative_tokens=k,
                             adaptive=adaptive, draft_num_kv_blocks=blocks)


def attach_draft(engine: Any, draft_logits: Any, draft_blocks: int = 64,
                 k: int = 4, adaptive: bool = False) -> DraftModelProposer:
    """Speculation with a paged fake draft model on an engine built without it."""
    core = engine.core
    config = draft_config(k, adaptive, draft_blocks)
    runner = PagedFakeRunner(draft_blocks, 4, 128, FakeTokenizer())
    runner.logits_fn = draft_logits
    proposer = DraftModelProposer(config, runner)
    core.spec = SpecDecoder(config, core.sampler, core.block_manager, core.info.max_model_len,
                            proposer)
    return proposer


def outputs(engine: Any, requests: list[tuple[list[int], SamplingParams]]) -> list[Any]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    final = run_all(engine)
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in final[f"r{i}"].outputs]
            for i in range(len(requests))]


GREEDY = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)


@pytest.mark.parametrize("num_blocks,budget,caching,draft_blocks", [
    (64, 64, True, 64), (64, 7, True, 64), (20, 9, False, 64), (14, 64, True, 64),
    (64, 64, True, 6)])
def test_fake_draft_greedy_equals_plain(num_blocks: int, budget: int, caching: bool,
                                        draft_blocks: int) -> None:
    """Chunked prefill (budget 7, 9), no prefix cache, preemption (14 blocks), a draft
    pool of 6 blocks (draft state evicted and rebuilt): plain decoding's tokens; a draft
    that is the target accepts every token; nothing leaks in either pool."""
    requests = [(p, GREEDY) for p in PROMPTS] + [(PROMPTS[0], dataclasses.replace(GREEDY, n=2))]
    kw: dict[str, Any] = dict(num_kv_blocks=num_blocks, budget=budget, caching=caching,
                              max_num_seqs=4)
    plain = outputs(make_engine(None, **kw), requests)
    for draft_logits, exact in ((cycling_logits, True), (half_right, False)):
        engine = make_engine(None, **kw)
        proposer = attach_draft(engine, draft_logits, draft_blocks)
        assert outputs(engine, requests) == plain
        sd = engine.stats().spec_decode
        assert sd["num_draft_tokens"] > 0
        if exact:
            assert sd["num_accepted_tokens"] == sd["num_draft_tokens"]
        else:
            assert 0 < sd["num_accepted_tokens"] < sd["num_draft_tokens"]
        engine.core.spec.propose([], budget)  # the next step forgets finished sequences
        assert not proposer.states and sorted(proposer.free) == list(range(draft_blocks))
        assert engine.core.block_manager.num_free_blocks == num_blocks
        if num_blocks == 14:
            assert engine.stats().num_preemptions > 0


def test_fake_draft_seeded_sampling_equals_plain() -> None:
    """Temperature > 0, top_k, seeds, n = 2, logprobs, a repetition penalty: the same
    tokens as plain decoding (greedy drafts are point masses: exact rejection sampling)."""
    requests = [(p, SamplingParams(temperature=0.9, top_k=6, max_tokens=20, seed=s,
                                   ignore_eos=True, n=2, logprobs=1,
                                   repetition_penalty=1.1 if s % 2 else 1.0))
                for s, p in enumerate(PROMPTS[:4])]
    plain = outputs(make_engine(None, logits=soft_logits), requests)
    engine = make_engine(None, logits=soft_logits)
    attach_draft(engine, soft_logits)
    assert outputs(engine, requests) == plain
    sd = engine.stats().spec_decode
    assert 0 < sd["num_accepted_tokens"] < sd["num_draft_tokens"]


def test_draft_rolls_back_to_the_accepted_prefix() -> None:
    """After a verify the draft keeps the verified tokens and the accepted drafts: each
    later catch-up is one token (the correction), two after a fully accepted draft."""
    for draft_logits, exact in ((cycling_logits, True), (half_right, False)):
        engine = make_engine(None)
        proposer = attach_draft(engine, draft_logits, k=4)
        engine.add_request("a", PROMPTS[0], GREEDY)
        catch_ups: list[int] = []
        first = [False]
        real_greedy, real_batch = proposer._greedy, proposer.propose_batch

        def greedy(chunks: list[Any], real: Any = real_greedy, first: list[bool] = first,
                   out: list[int] = catch_ups) -> list[int]:
            if first[0]:  # a batch's first forward is its catch-up
                out.extend(len(c.token_ids) for c in chunks if c.start_pos > 0)
                first[0] = False
            return real(chunks)

        def batch(wants: list[Any], real: Any = real_batch,
                  first: list[bool] = first) -> list[list[int]]:
            first[0] = True
            return real(wants)

        proposer._greedy = greedy  # type: ignore[method-assign]
        proposer.propose_batch = batch  # type: ignore[method-assign]
        run_all(engine)
        if exact:
            assert set(catch_ups) == {2}
        else:
            assert set(catch_ups) <= {1, 2} and 1 in catch_ups


def test_planner_counts_the_draft_model_time() -> None:
    """A flat verify curve (bandwidth-bound): a cheap draft model drafts, one whose
    forward costs as much as the target's step does not."""
    requests = [([2, 5, 9, 13, 2, 7], SamplingParams(temperature=0.0, max_tokens=20,
                                                     ignore_eos=True))]
    for draft_step, drafted in ((0.0002, True), (0.01, False)):
        engine = make_engine(None)
        proposer = attach_draft(engine, cycling_logits, adaptive=True)
        spec = engine.core.spec
        for n in (1, 2, 4, 8, 16, 32, 64):
            spec.planner.cost.observe(n, 0.01, weight=1.0)
            proposer.cost.observe(n, draft_step, weight=1.0)
        spec.observe_step = lambda tokens, seconds: None  # type: ignore[method-assign]
        proposer.cost.observe = lambda *a, **kw: None  # type: ignore[method-assign]
        assert proposer.draft_seconds([(object(), 3)]) == pytest.approx(3 * draft_step)  # type: ignore[list-item]
        engine.add_request("a", *requests[0])
        run_all(engine)
        assert (engine.stats().spec_decode["num_drafts"] > 0) == drafted


@pytest.mark.parametrize("value,param", [
    ({"method": "draft_model"}, "speculative_config.model"),
    ({"method": "suffix", "model": "x"}, "speculative_config.model"),
    ({"method": "draft_model", "model": "x", "draft_num_kv_blocks": 0},
     "speculative_config.draft_num_kv_blocks"),
])
def test_bad_draft_config_names_the_field(value: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        EngineConfig.from_options(None, speculative_config=value)
    assert exc.value.param == param
    assert isinstance(exc.value, ValueError)


def test_vllm_json_with_a_model_is_a_draft() -> None:
    config = EngineConfig.from_options(None, speculative_config=(
        '{"model": "/m", "num_speculative_tokens": 3}'))
    assert config.speculative == SpeculativeConfig(method="draft_model", model="/m",
                                                   num_speculative_tokens=3)
    config = EngineConfig.from_options(None, speculative_config=(
        '{"method": "draft_model", "model": "/m", "num_speculative_tokens": 5}'))
    assert config.speculative is not None and config.speculative.method == "draft_model"


# -- tiny random models ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-draft"), "llama", seed=1)


def test_bad_draft_model_is_refused(tiny_llama_dir: Path,
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """A missing draft, a draft with another vocabulary size, one with another
    tokenizer: InvalidRequestError naming speculative_config.model."""
    from sluice.engine.llm import LLM
    from tiny_models import make_tiny_checkpoint

    small = make_tiny_checkpoint(tmp_path_factory.mktemp("small-vocab"), "llama",
                                 vocab_size=1000)
    other_tok = make_tiny_checkpoint(tmp_path_factory.mktemp("other-tok"), "llama", seed=2)
    tok = other_tok / "tokenizer.json"
    data = json.loads(tok.read_text())
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two ids swapped
    tok.write_text(json.dumps(data))
    for draft, words in ((tiny_llama_dir / "missing", "did not load"),
                         (small, "vocabulary of 1000"), (other_tok, "different tokenizer")):
        with pytest.raises(InvalidRequestError) as exc:
            LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16,
                speculative_config={"method": "draft_model", "model": str(draft)})
        assert exc.value.param == "speculative_config.model"
        assert words in str(exc.value)


def test_tiny_models_equal_plain(tiny_llama_dir: Path, tiny_draft_dir: Path) -> None:
    """Real forwards: the target as its own draft accepts every greedy token; a different
    random draft gives plain decoding's tokens greedy and with seeded sampling, through
    chunked prefill, preemption (a 14-block pool), the prefix cache and n = 2."""
    from sluice.engine.llm import LLM
    from sluice.engine.spec_decode import PROPOSERS

    spec = {"method": "draft_model", "model": str(tiny_draft_dir),
            "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=14, block_size=8,
              max_num_batched_tokens=24, max_num_seqs=4, speculative_config=spec)
    core = llm.engine.core
    rng = random.Random(0)
    prompts = [[rng.randrange(300, 40000) for _ in range(n)] for n in (21, 9, 14, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, n=n)
              for m, n in ((29, 1), (22, 2), (13, 1), (26, 1))]
    sampled = [dataclasses.replace(p, temperature=0.8, top_k=20, seed=7 + i)
               for i, p in enumerate(params)]
    drafted, core.spec = core.spec, None
    plain = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    plain_sampled = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sampled)]
    assert core.scheduler.num_preemptions > 0
    assert drafted is not None
    config = drafted.config
    selfish = SpecDecoder(config, core.sampler, core.block_manager, core.info.max_model_len,
                          PROPOSERS["draft_model"]().from_engine(
                              dataclasses.replace(config, model=str(tiny_llama_dir)),
                              llm.config, core.runner))
    for spec_decoder, all_accepted in ((selfish, True), (drafted, False)):
        core.spec = spec_decoder
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        assert got == plain
        counts = spec_decoder.stats()
        assert counts["num_draft_tokens"] > 0
        assert (counts["num_accepted_tokens"] == counts["num_draft_tokens"]) == all_accepted
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sampled)]
        assert got == plain_sampled
    assert core.block_manager.num_free_blocks == 14
