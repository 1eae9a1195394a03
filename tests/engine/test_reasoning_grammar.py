"""A reasoning model's constrained output thinks first (`reasoning_parser`, vLLM's
structured outputs with a reasoning parser): the grammar waits until `</think>` and
holds from the next token. On a tiny random model whose tokenizer has `<think>` and
`</think>` as one token each (as Qwen3's and DeepSeek-R1's do); `logit_bias` picks the
tags where the test needs them, since a random model writes them by chance only."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams, StructuredOutputsParams
from sluice.engine.structured_output import ThinkingMarkers

from .test_spec_structured import FixedProposer, decoder

CHOICE = StructuredOutputsParams(choice=("yes", "no"))
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "adaptive": False}


def make(model: Path, parser: str = "", **options: Any) -> LLM:
    return LLM(str(model), dtype="float32", num_kv_blocks=64, block_size=16,
               max_model_len=512, max_num_seqs=4, reasoning_parser=parser, **options)


@pytest.fixture(scope="module")
def r1(thinker_dir: Path) -> Any:
    llm = make(thinker_dir, "deepseek_r1")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tags(r1: LLM) -> tuple[int, int]:
    start, end = (r1.get_tokenizer().encode(t, add_special_tokens=False)
                  for t in ("<think>", "</think>"))
    assert len(start) == len(end) == 1
    return start[0], end[0]


def run(llm: LLM, prompt: str | list[int], **params: Any) -> Any:
    return llm.generate([prompt], SamplingParams(temperature=0, **params))[0].outputs[0]


def test_the_grammar_starts_after_the_thinking(r1: LLM, thinker_dir: Path,
                                               tags: tuple[int, int]) -> None:
    _, end = tags
    # the end tag as the first token (a strong bias on it): thinking allows it, and the
    # answer after it is the grammar's
    out = run(r1, "Is it raining?", max_tokens=16, structured_outputs=CHOICE,
              logit_bias={end: 100.0})
    assert out.token_ids[0] == end and out.text in ("</think>yes", "</think>no")
    assert out.finish_reason == "stop"  # the grammar completed
    # while it thinks, nothing is masked: a model that never closes the block writes
    # what it writes unconstrained, token for token
    plain = run(r1, "Is it raining?", max_tokens=12)
    thought = run(r1, "Is it raining?", max_tokens=12, structured_outputs=CHOICE)
    assert end not in plain.token_ids and thought.token_ids == plain.token_ids
    assert thought.finish_reason == "length"
    # a prompt that closed the block already (an empty one, as Qwen3's template writes
    # for enable_thinking false): the grammar from the first token, the tag masked
    closed = run(r1, "Is it raining?<think>\n\n</think>\n\n", max_tokens=16,
                 structured_outputs=CHOICE, logit_bias={end: 100.0})
    assert closed.text in ("yes", "no")
    # without a reasoning parser the grammar holds from the first token, as before
    llm = make(thinker_dir)
    try:
        out = run(llm, "Is it raining?", max_tokens=16, structured_outputs=CHOICE,
                  logit_bias={end: 100.0})
        assert out.text in ("yes", "no") and end not in out.token_ids
    finally:
        llm.shutdown()


def test_qwen3_the_first_token_opens_the_thinking_or_starts_the_answer(
        thinker_dir: Path, tags: tuple[int, int]) -> None:
    start, _ = tags
    llm = make(thinker_dir, "qwen3")
    try:
        # no opening tag: the first token is the grammar's, as is every one after
        out = run(llm, "Is it raining?", max_tokens=16, structured_outputs=CHOICE,
                  logit_bias={start: -100.0})
        assert out.text in ("yes", "no")
        # the opening tag first (allowed beside the grammar's tokens): then it thinks,
        # unmasked (the bias keeps writing the tag, which no grammar state here allows)
        out = run(llm, "Is it raining?", max_tokens=6, structured_outputs=CHOICE,
                  logit_bias={start: 100.0})
        assert out.token_ids == [start] * 6 and out.finish_reason == "length"
    finally:
        llm.shutdown()


def thinker_engine(model: Path, parser: str, **options: Any) -> Any:
    from sluice.engine.async_engine import AsyncEngine
    from sluice.engine.config import EngineConfig

    return AsyncEngine(EngineConfig.from_options(
        str(model), dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=512,
        max_num_seqs=4, reasoning_parser=parser, **options))


def resume(engine: Any, prompt: list[int], resumed: list[int], params: SamplingParams) -> Any:
    """The output of a migrated request (tokens generated elsewhere; the output holds
    them first)."""
    async def go() -> Any:
        last = None
        async for out in engine.generate(prompt, params, "resumed", resumed=resumed):
            last = out
        return last

    return asyncio.run(go()).outputs[0]


def test_a_resumed_output_past_the_thinking_continues_in_the_grammar(
        thinker_dir: Path, tags: tuple[int, int]) -> None:
    """A migrated stream is replayed through the thinking state: what follows the end
    tag is the grammar's."""
    start, end = tags
    engine = thinker_engine(thinker_dir, "qwen3")
    try:
        tok = engine.tokenizer
        prompt = tok.encode("Is it raining?", add_special_tokens=False)
        resumed = [start, *tok.encode(" Let me see.", add_special_tokens=False), end]
        out = resume(engine, prompt, resumed, SamplingParams(
            temperature=0, max_tokens=20, structured_outputs=CHOICE, logit_bias={end: 100.0}))
        assert out.token_ids[:len(resumed)] == resumed
        assert tok.decode(out.token_ids[len(resumed):]) in ("yes", "no"), out
    finally:
        engine.shutdown()


def test_speculative_decoding_drafts_through_the_end_tag(thinker_dir: Path,
                                                         tags: tuple[int, int]) -> None:
    """qwen3, biased to open the thinking and close it at once: a draft `</think> yes no`
    after the opening tag runs past the end tag; its rows after the tag are the
    grammar's, so the output is the one plain decoding gives, token for token (rows left
    unmasked there would take the biased end tag again, which the grammar refuses)."""
    start, end = tags
    llm = make(thinker_dir, "qwen3", speculative_config=NGRAM)
    try:
        core = llm.engine.core
        yes, no = (llm.get_tokenizer().encode(w, add_special_tokens=False)[0]
                   for w in ("yes", "no"))
        params: dict[str, Any] = {"max_tokens": 16, "structured_outputs": CHOICE,
                                  "logit_bias": {start: 90.0, end: 100.0}}
        spec, core.spec = core.spec, None
        want = run(llm, "Is it raining?", **params)
        proposer = FixedProposer([end, yes, no])
        core.spec = decoder(core, "ngram", proposer, k=3)
        got = run(llm, "Is it raining?", **params)
        assert want.token_ids[:2] == [start, end]
        assert want.text in ("<think></think>yes", "<think></think>no")
        assert got.token_ids == want.token_ids
        assert proposer.calls >= 1 and core.spec.num_accepted_tokens >= 1
        core.spec = spec
    finally:
        llm.shutdown()


class _Tok:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return {"<think>": [7], "</think>": [8, 9]}[text]


@pytest.mark.parametrize(("parser", "prompt", "phase"), [
    ("deepseek_r1", [1, 2, 7, 3], "think"),  # the template opened the block
    ("deepseek_r1", [1, 7, 3, 8, 9, 4], None),  # ... and closed it: the answer
    ("deepseek_r1", [8, 9, 1, 2, 3, 4, 5, 6, 7, 11, 12], "think"),  # the last tag opens
    ("qwen3", [1, 2, 3], "start"),  # the model decides with its first token
    ("qwen3", [7, 5, 8, 9, 5], None),  # enable_thinking false: an empty block
])
def test_where_the_thinking_starts(parser: str, prompt: list[int], phase: str | None) -> None:
    markers = ThinkingMarkers.of(_Tok(), parser)
    assert markers is not None and markers.end == (8, 9)
    state = markers.at_start(prompt)
    assert (state.phase if state is not None else None) == phase


def test_the_end_tag_is_found_across_a_draft() -> None:
    markers = ThinkingMarkers((7,), (8, 9), True)
    assert markers.closes([1, 2, 8, 9], 4) == 0
    assert markers.closes([1, 2, 8], 3, [9, 4, 5]) == 1
    assert markers.closes([1, 2], 2, [4, 8, 9, 5]) == 3
    assert markers.closes([1, 2], 2, [4, 8, 5, 9]) is None
    assert ThinkingMarkers.of(_Tok(), "") is None


def test_a_thinking_budget_writes_the_end_tag_when_it_is_spent(
        r1: LLM, thinker_dir: Path, tags: tuple[int, int]) -> None:
    """`thinking_token_budget` (vLLM's): after that many thinking tokens the end tag is
    written for the model; then its answer (the grammar's, for a constrained one)."""
    start, end = tags
    free = run(r1, "Why?", max_tokens=10)
    assert end not in free.token_ids  # the tiny model never closes the block itself
    for budget in (0, 3):
        out = run(r1, "Why?", max_tokens=10, thinking_token_budget=budget)
        assert out.token_ids[:budget] == free.token_ids[:budget]
        assert out.token_ids[budget] == end and end not in out.token_ids[budget + 1:]
    out = run(r1, "Why?", max_tokens=10, thinking_token_budget=2, structured_outputs=CHOICE)
    assert out.token_ids[:2] == free.token_ids[:2] and out.token_ids[2] == end
    assert r1.get_tokenizer().decode(out.token_ids[3:]) in ("yes", "no")
    assert run(r1, "Why?", max_tokens=10, thinking_token_budget=-1).token_ids == free.token_ids
    # qwen3: counted from after the opening tag (a bias writes the tag, and then again
    # as thinking, until the budget closes it)
    llm = make(thinker_dir, "qwen3")
    try:
        out = run(llm, "Why?", max_tokens=10, thinking_token_budget=2,
                  structured_outputs=CHOICE, logit_bias={start: 90.0})
        assert out.token_ids[:4] == [start, start, start, end]
        assert llm.get_tokenizer().decode(out.token_ids[4:]) in ("yes", "no")
    finally:
        llm.shutdown()


def test_a_budget_needs_a_reasoning_parser(thinker_dir: Path) -> None:
    from sluice.protocol.errors import InvalidRequestError

    llm = make(thinker_dir)
    try:
        with pytest.raises(InvalidRequestError) as err:
            run(llm, "Why?", thinking_token_budget=4)
        assert err.value.param == "thinking_token_budget"
    finally:
        llm.shutdown()
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(thinking_token_budget=-2)
    assert err.value.param == "thinking_token_budget"


def test_a_budget_holds_under_speculation_and_resumption(thinker_dir: Path,
                                                         tags: tuple[int, int]) -> None:
    """Drafts stop short of the budget (the row where it is spent writes the end tag),
    so speculation gives plain decoding's tokens; a resumed request counts the thinking
    it already did."""
    _, end = tags
    llm = make(thinker_dir, "deepseek_r1", speculative_config=NGRAM)
    try:
        core = llm.engine.core
        spec, core.spec = core.spec, None
        free = run(llm, "Why?", max_tokens=12)
        want = run(llm, "Why?", max_tokens=12, thinking_token_budget=5)
        assert want.token_ids[:5] == free.token_ids[:5] and want.token_ids[5] == end
        proposer = FixedProposer(free.token_ids[1:8])  # right for a while, then wrong
        core.spec = decoder(core, "ngram", proposer, k=4)
        got = run(llm, "Why?", max_tokens=12, thinking_token_budget=5)
        assert got.token_ids == want.token_ids
        assert proposer.calls >= 1 and core.spec.num_accepted_tokens >= 1
        core.spec = spec
    finally:
        llm.shutdown()
    engine = thinker_engine(thinker_dir, "deepseek_r1")
    try:
        out = resume(engine, engine.tokenizer.encode("Why?", add_special_tokens=False),
                     free.token_ids[:3], SamplingParams(temperature=0, max_tokens=12,
                                                        thinking_token_budget=5))
        assert out.token_ids[:5] == free.token_ids[:5] and out.token_ids[5] == end
    finally:
        engine.shutdown()
