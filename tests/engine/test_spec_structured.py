"""Speculative decoding with structured output, on the tiny random model (SmolLM2's real
tokenizer), for each grammar backend: constrained outputs equal plain decoding's token
for token (greedy and seeded; ngram, suffix and an oracle whose wrong drafts the grammar
mostly refuses); a draft is cut at the first token the grammar refuses or a stop token,
so the verify chunk is exactly that long; after every step the matcher is where plain
decoding's would be (its next mask is the same), and `draftable` leaves it there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.engine.config import SpeculativeConfig
from sluice.engine.core import EngineCore
from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams, StructuredOutputsParams
from sluice.engine.sequence import Sequence
from sluice.engine.spec_decode import Proposer, SpecDecoder
from sluice.engine.structured_output import GrammarBackend, Matcher, draftable

from .test_structured_output import CONSTRAINTS, PROMPT

BACKENDS = ["xgrammar", "guidance"]
DIGITS = StructuredOutputsParams(regex=r"[0-9]{8}")
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
         "adaptive": False}


def make_llm(model_dir: Path, backend: str) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=64, block_size=16,
               max_model_len=512, max_num_seqs=8, structured_outputs_backend=backend,
               speculative_config=NGRAM)


def decoder(core: EngineCore, method: str, proposer: Proposer | None = None,
            k: int = 5) -> SpecDecoder:
    return SpecDecoder(SpeculativeConfig(method=method, num_speculative_tokens=k,
                                         prompt_lookup_min=1, adaptive=False),
                       core.sampler, core.block_manager, core.info.max_model_len, proposer)


class OracleProposer(Proposer):
    """Drafts the plain output it was told for the sequence, every third drafted token
    replaced by its neighbour id (which the grammar usually refuses)."""

    def __init__(self, answers: dict[tuple[Any, int], list[int]]) -> None:
        self.answers, self.calls = answers, 0  # (constraint key, seq index) -> output

    def propose(self, seq: Sequence, k: int) -> list[int]:
        constraint = seq.params.structured_outputs
        assert constraint is not None
        answer = self.answers[(constraint.key, seq.index)]
        draft = list(answer[seq.num_output_tokens:seq.num_output_tokens + k])
        for i in range(len(draft)):
            self.calls += 1
            if self.calls % 3 == 0:
                draft[i] += 1
        return draft

    def forget(self, seq: Sequence) -> None:
        pass


class FixedProposer(Proposer):
    """Drafts `draft` (up to k of it) every time; counts its calls."""

    def __init__(self, draft: list[int]) -> None:
        self.draft, self.calls = draft, 0

    def propose(self, seq: Sequence, k: int) -> list[int]:
        self.calls += 1
        return self.draft[:k]

    def forget(self, seq: Sequence) -> None:
        pass


def token_ids(llm: LLM, params: list[SamplingParams]) -> list[list[list[int]]]:
    outs = llm.generate([PROMPT] * len(params), params)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0),
                                      dict(temperature=1.0, seed=11, n=2)],
                         ids=["greedy", "seeded-n2"])
def test_constrained_outputs_equal_plain(tiny_llama_dir: Path, backend: str,
                                         sampling: dict[str, Any]) -> None:
    """JSON schema, regex, choice and EBNF constraints in one batch: with ngram, suffix
    and oracle drafts, exactly the tokens plain decoding emits; every output valid."""
    llm = make_llm(tiny_llama_dir, backend)
    core = llm.engine.core
    params = [SamplingParams(max_tokens=120, structured_outputs=c, **sampling)
              for c, _ in CONSTRAINTS]
    ngram, core.spec = core.spec, None
    plain = token_ids(llm, params)
    oracle = OracleProposer({(c.key, i): out for (c, _), outs in zip(CONSTRAINTS, plain,
                                                                      strict=True)
                             for i, out in enumerate(outs)})
    for spec in (ngram, decoder(core, "suffix"), decoder(core, "ngram", oracle)):
        core.spec = spec
        outputs = llm.generate([PROMPT] * len(params), params)
        assert [[c.token_ids for c in o.outputs] for o in outputs] == plain
        for (_, check), out in zip(CONSTRAINTS, outputs, strict=True):
            for completion in out.outputs:
                assert completion.finish_reason == "stop", completion.text
                check(completion.text)
        assert spec is not None and spec.num_draft_tokens > 0
    assert 0 < oracle_stats(core)["num_accepted_tokens"] < oracle_stats(core)["num_draft_tokens"]
    assert core.block_manager.num_free_blocks == 64


def oracle_stats(core: EngineCore) -> dict[str, Any]:
    assert core.spec is not None
    return core.spec.stats()


def digit_ids(llm: LLM) -> list[int]:
    tok = llm.get_tokenizer()
    ids = [tok.encode(str(d), add_special_tokens=False) for d in range(10)]
    assert all(len(i) == 1 for i in ids)  # SmolLM2 splits digits
    return [i[0] for i in ids]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cut", ["refused", "stop", "length"])
def test_draft_is_cut_where_the_grammar_refuses(tiny_llama_dir: Path, backend: str,
                                                cut: str) -> None:
    """`[0-9]{8}`, one digit out after prefill: a draft of digits with a letter at index
    2, or EOS at index 2, or 9 more digits (one past the 8) verifies 3, 3 and 8 tokens
    (the last real token and the draft's grammatical prefix); outputs stay plain's."""
    llm = make_llm(tiny_llama_dir, backend)
    core = llm.engine.core
    d = digit_ids(llm)
    letter = llm.get_tokenizer().encode("x", add_special_tokens=False)[0]
    eos = sorted(core.eos_token_ids)[0]
    draft, verified = {"refused": ([d[1], d[2], letter, d[3]], 3),
                       "stop": ([d[1], d[2], eos, d[3]], 3),
                       "length": (d[1:] + d[:1], 8)}[cut]
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=DIGITS)
    core.spec = None
    plain = token_ids(llm, [params])
    fixed = FixedProposer(draft)
    core.spec = decoder(core, "ngram", fixed, k=9)
    llm.engine.add_request("r", PROMPT, params)
    seq = core.requests["r"].seqs[0]
    while fixed.calls == 0:
        llm.engine.step()
    assert seq.num_output_tokens >= 1 and seq.num_output_tokens <= verified
    assert [c.num_tokens for c in core.last_chunks if c.seq is seq] == [verified]
    assert core.spec.num_draft_tokens == verified - 1
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert [seq.output_token_ids] == plain[0]


def next_mask(backend: GrammarBackend, matcher: Matcher) -> torch.Tensor:
    bitmask = backend.bitmask(1)
    backend.fill(bitmask, [matcher], [0])
    return bitmask.clone()


def plain_matcher(core: EngineCore, params: StructuredOutputsParams,
                  tokens: list[int]) -> tuple[GrammarBackend, Matcher]:
    """A fresh matcher for `params` fed `tokens`: where plain decoding's would be."""
    compiled = core.structured._compiled[params.key].result()
    matcher = compiled.backend.matcher(compiled.grammar)
    assert all(matcher.accept_token(t) for t in tokens)
    return compiled.backend, matcher


@pytest.mark.parametrize("backend", BACKENDS)
def test_matcher_after_each_step_is_plain_decodings(tiny_llama_dir: Path, backend: str) -> None:
    """After every step (drafts accepted, rejected, cut), the sequence's matcher allows
    exactly what a matcher fed only the output tokens allows."""
    llm = make_llm(tiny_llama_dir, backend)
    core = llm.engine.core
    constraints = (DIGITS, CONSTRAINTS[0][0])
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=c)
              for c in constraints]
    core.spec = None
    plain = token_ids(llm, params)
    core.spec = decoder(core, "ngram", OracleProposer(
        {(c.key, 0): out[0] for c, out in zip(constraints, plain, strict=True)}))
    for c, p in zip(constraints, params, strict=True):
        llm.engine.add_request(c.kind, PROMPT, p)
    seqs = {rid: r.seqs[0] for rid, r in core.requests.items()}
    steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps += 1
        for rid, seq in seqs.items():
            if seq.is_finished or seq.grammar is None:
                continue
            constraint = seq.params.structured_outputs
            assert constraint is not None
            backend_, fresh = plain_matcher(core, constraint, seq.output_token_ids)
            assert torch.equal(next_mask(backend_, seq.grammar), next_mask(backend_, fresh)), \
                (rid, steps)
    assert [[s.output_token_ids] for s in seqs.values()] == plain
    stats = oracle_stats(core)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_draftable_leaves_the_matcher_where_it_was(tiny_llama_dir: Path, backend: str) -> None:
    llm = make_llm(tiny_llama_dir, backend)
    core = llm.engine.core
    d = digit_ids(llm)
    eos = sorted(core.eos_token_ids)[0]
    llm.generate([PROMPT], SamplingParams(max_tokens=2, structured_outputs=DIGITS))
    backend_, matcher = plain_matcher(core, DIGITS, [d[0], d[1]])
    before = next_mask(backend_, matcher)
    letter = llm.get_tokenizer().encode("x", add_special_tokens=False)[0]
    assert draftable(matcher, d[:3] + [letter] + d[:2]) == 3
    assert draftable(matcher, [d[5]] * 10) == 6  # {8}: 6 more after 2
    assert draftable(matcher, [d[5], eos]) == 1  # stops before a stop token
    assert draftable(matcher, [letter]) == 0
    assert torch.equal(next_mask(backend_, matcher), before)
    assert not matcher.is_terminated()
