"""Workloads: seeded reproducibility, exact lengths, and the trace's prefix structure."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import httpx
import pytest
from stub_server import StubConfig, running_stub

from sluice.bench.tokens import (
    WORDS,
    LocalTokenizer,
    ServerTokenizer,
    Vocab,
    discover_vocab,
    open_tokenizer,
)
from sluice.bench.workloads import (
    BlockSynthesizer,
    MultiTurnWorkload,
    RandomWorkload,
    SharedPrefixWorkload,
    TraceWorkload,
    WorkloadConfig,
    build_workload,
    load_trace,
    take,
)
from sluice.protocol.errors import InvalidRequestError

TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")


@pytest.fixture(scope="module")
def tok(tokenizer_file: Path) -> LocalTokenizer:
    return LocalTokenizer(tokenizer_file)


@pytest.fixture(scope="module")
def vocab(tok: LocalTokenizer) -> Vocab:
    return discover_vocab(tok)


def test_vocab_words_round_trip_to_their_ids(tok: LocalTokenizer, vocab: Vocab) -> None:
    assert len(vocab) == len(set(WORDS))
    idx = list(range(0, len(vocab), 7))
    assert tok.encode(vocab.text(idx)) == list(vocab.token_ids(idx))


def test_vocab_skips_words_that_are_not_one_token(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    # "house" is split into word pieces, "zebra" is [UNK]: both must be dropped
    vocab = {"[UNK]": 0, "the": 1, "of": 2, "and": 3, "h": 4, "##o": 5, "##u": 6, "##s": 7, "##e": 8}
    t = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    assert len(LocalTokenizer(tmp_path).encode(" house")) == 5
    found = discover_vocab(LocalTokenizer(tmp_path), ["the", "zebra", "house", "of", "and"])
    assert found.words == ("the", "of", "and")
    assert found.ids == (1, 2, 3)


def test_server_tokenizer_gives_the_same_vocab(stub: tuple[str, object], vocab: Vocab) -> None:
    url, _ = stub
    with httpx.Client(trust_env=False) as http:
        assert discover_vocab(ServerTokenizer(http, url, "stub-model")) == vocab


def test_server_tokenizer_strips_a_bos_it_cannot_turn_off(tokenizer_file: Path, vocab: Vocab) -> None:
    with running_stub(StubConfig(tokenizer_path=str(tokenizer_file), old_tokenize=True)) as (url, _):
        with httpx.Client(trust_env=False) as http:
            enc = ServerTokenizer(http, url, "stub-model")
            assert enc.encode(" the of") == [vocab.ids[vocab.words.index("the")], vocab.ids[vocab.words.index("of")]]
            assert discover_vocab(enc) == vocab


def test_gguf_tokenizer_words_round_trip(default_gguf: Path) -> None:
    enc = open_tokenizer(default_gguf)
    v = discover_vocab(enc)
    assert len(v) > 400  # SmolLM2 has most common English words as one token
    idx = [(i * 31) % len(v) for i in range(300)]
    assert enc.encode(v.text(idx)) == list(v.token_ids(idx))


def test_random_workload_exact_lengths_and_seeds(vocab: Vocab) -> None:
    cfg = WorkloadConfig(seed=3, input_len=50, output_len=20, range_ratio=0.5)
    a = take(RandomWorkload(cfg, vocab), 40)
    again = take(RandomWorkload(cfg, vocab), 40)
    other = take(RandomWorkload(WorkloadConfig(seed=4, input_len=50, output_len=20, range_ratio=0.5), vocab), 40)
    assert a == again
    assert [s.turns[0].user.ids for s in a] != [s.turns[0].user.ids for s in other]
    for s in a:
        seg = s.turns[0].user
        assert seg.ids is not None and len(seg.ids) == seg.num_tokens
        assert 25 <= seg.num_tokens <= 75 and 10 <= s.turns[0].output_len <= 30
    assert len({s.turns[0].user.num_tokens for s in a}) > 5  # lengths are really drawn


def test_fixed_lengths_without_range(vocab: Vocab) -> None:
    sessions = take(RandomWorkload(WorkloadConfig(input_len=17, output_len=5), vocab), 10)
    assert {(s.turns[0].user.num_tokens, s.turns[0].output_len) for s in sessions} == {(17, 5)}


@pytest.mark.parametrize("dist", ["normal", "lognormal"])
def test_length_distributions_have_the_asked_mean(vocab: Vocab, dist: str) -> None:
    cfg = WorkloadConfig(input_len=100, output_len=4, range_ratio=0.3, length_dist=dist)
    lens = [s.turns[0].user.num_tokens for s in take(RandomWorkload(cfg, vocab), 400)]
    assert statistics.mean(lens) == pytest.approx(100, rel=0.06)
    assert statistics.pstdev(lens) > 15


def test_shared_prefix_groups_share_exactly_the_system_prompt(vocab: Vocab) -> None:
    cfg = WorkloadConfig(seed=1, num_groups=3, system_prompt_len=40, input_len=10, output_len=4)
    sessions = take(SharedPrefixWorkload(cfg, vocab), 60)
    systems = {s.session_id: s.system for s in sessions}
    assert len(systems) == 3
    for s in sessions:
        assert s.system == systems[s.session_id] and s.system is not None
        assert s.system.num_tokens == 40 and s.turns[0].user.num_tokens == 10
    ids = [sys.ids for sys in systems.values()]
    assert all(a is not None and b is not None and a[0] != b[0] for a, b in zip(ids, ids[1:], strict=False))
    assert len({s.turns[0].user.ids for s in sessions}) == 60  # questions are distinct


def test_multi_turn_sessions(vocab: Vocab) -> None:
    cfg = WorkloadConfig(num_turns=3, input_len=6, output_len=2, system_prompt_len=5)
    sessions = take(MultiTurnWorkload(cfg, vocab), 4)
    assert all(len(s.turns) == 3 and s.multi_turn for s in sessions)
    assert len({s.session_id for s in sessions}) == 4
    assert all(s.system is not None and s.system.num_tokens == 5 for s in sessions)


# ---------------------------------------------------------------- trace


def _write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_equal_hash_prefixes_are_equal_token_prefixes(tmp_path: Path, vocab: Vocab) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 100, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 3]},
        {"timestamp": 250, "input_length": 700, "output_length": 10, "hash_ids": [0, 4]},
        {"timestamp": 400, "input_length": 200, "output_length": 10, "hash_ids": [5]},
    ]
    cfg = WorkloadConfig(trace_path=str(_write_trace(tmp_path / "t.jsonl", rows)), token_scale=0.02, time_scale=2.0)
    w = build_workload("trace", cfg, vocab, LocalTokenizer.__new__(LocalTokenizer))
    assert isinstance(w, TraceWorkload)
    s = list(w.sessions())
    p = [x.turns[0].user.ids for x in s]
    assert all(x is not None for x in p)
    block = 10  # round(512 * 0.02)
    # lengths: full blocks + the last cut to ceil((input_length - 512 * (n-1)) * scale)
    assert [len(x or ()) for x in p] == [2 * block + 10, 2 * block + 2, block + 4, 4]
    assert p[0][: 2 * block] == p[1][: 2 * block]  # type: ignore[index]
    assert p[0][2 * block] != p[1][2 * block]  # type: ignore[index]  # blocks 2 vs 3 differ at once
    assert p[0][:block] == p[2][:block] and p[0][block] != p[2][block]  # type: ignore[index]
    assert p[3][0] != p[0][0]  # type: ignore[index]
    assert [x.arrival for x in s] == [0.0, 0.2, 0.5, 0.8]
    assert [x.turns[0].output_len for x in s] == [10] * 4
    assert s[0].turns[0].user.text.split() == [vocab.words[vocab.ids.index(t)] for t in p[0]]  # type: ignore[union-attr]


def test_block_synthesizer_is_injective_and_seeded(vocab: Vocab) -> None:
    synth = BlockSynthesizer(len(vocab), 3, max_id=len(vocab) ** 2 - 1, seed=0)
    ids = list(range(0, len(vocab) ** 2, 97))
    blocks = [synth.block(h) for h in ids]
    assert len(set(blocks)) == len(ids)
    assert synth.block(5) == BlockSynthesizer(len(vocab), 3, len(vocab) ** 2 - 1, seed=0).block(5)
    assert synth.block(5) != BlockSynthesizer(len(vocab), 3, len(vocab) ** 2 - 1, seed=1).block(5)
    with pytest.raises(InvalidRequestError, match="token-scale"):
        BlockSynthesizer(len(vocab), 1, max_id=len(vocab), seed=0)


def test_real_mooncake_trace_prefix_property(vocab: Vocab) -> None:
    rows = load_trace(TRACE)[:300]
    cfg = WorkloadConfig(token_scale=0.01, seed=0)
    w = TraceWorkload(cfg, vocab, rows)
    prompts = [s.turns[0].user.ids or () for s in w.sessions()]
    b = 5
    for i in range(0, 300, 7):
        for j in range(i + 1, min(i + 40, 300)):
            hi, hj = rows[i].hash_ids, rows[j].hash_ids
            k = 0
            while k < min(len(hi), len(hj)) and hi[k] == hj[k]:
                k += 1
            full = min(k, len(hi) - 1, len(hj) - 1)  # shared blocks that are full in both
            assert prompts[i][: full * b] == prompts[j][: full * b]
            if k < min(len(hi), len(hj)):  # first differing block: tokens differ inside it
                assert prompts[i][k * b : (k + 1) * b] != prompts[j][k * b : (k + 1) * b]


def test_trace_rejects_bad_rows(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 3}\n')
    with pytest.raises(InvalidRequestError, match="bad.jsonl:1"):
        load_trace(bad)


@pytest.mark.parametrize("row", [
    '{"timestamp": NaN, "input_length": 40, "output_length": 2, "hash_ids": [1]}',
    '{"timestamp": "inf", "input_length": 40, "output_length": 2, "hash_ids": [1]}',
    '{"timestamp": -5, "input_length": 40, "output_length": 2, "hash_ids": [1]}',
    '{"timestamp": 0, "input_length": -5, "output_length": 2, "hash_ids": [1]}',
    '{"timestamp": 0, "input_length": 40, "output_length": 0, "hash_ids": [1]}',
])
def test_trace_rows_out_of_range_are_refused(row: str, tmp_path: Path) -> None:
    """A nan timestamp made `sluice sim --trace` run forever; negative lengths ran as 1
    token, silently."""
    path = tmp_path / "t.jsonl"
    path.write_text(row + "\n")
    with pytest.raises(InvalidRequestError, match="t.jsonl:1: not a Mooncake trace row"):
        load_trace(path)


def test_trace_files_that_cannot_be_read_are_clear_errors(tmp_path: Path) -> None:
    """A missing file or a directory raised FileNotFoundError / IsADirectoryError, which
    `sluice bench serve` and `sluice sim` let out as tracebacks; an empty file ran nothing."""
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    for name, message in [("missing.jsonl", "cannot read trace file"), (".", "cannot read trace file"),
                          ("binary.jsonl", "cannot read trace file"),
                          ("empty.jsonl", "holds no Mooncake trace rows")]:
        with pytest.raises(InvalidRequestError, match=message) as e:
            load_trace(tmp_path / name)
        assert e.value.param == "trace"


def test_sharegpt_filters_and_is_seeded(tmp_path: Path, tok: LocalTokenizer, vocab: Vocab) -> None:
    words = list(WORDS)
    convs = [
        {"conversations": [{"from": "human", "value": " ".join(words[i : i + 5 + i % 7])},
                           {"from": "gpt", "value": " ".join(words[i : i + 6])}]}
        for i in range(30)
    ] + [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "the end of it"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    w = build_workload("sharegpt", WorkloadConfig(dataset_path=str(path), seed=2), vocab, tok)
    sessions = list(w.sessions())
    assert len(sessions) == 30  # the one-token prompt is filtered out
    for s in sessions:
        t = s.turns[0]
        assert t.user.num_tokens == len(tok.encode(t.user.text)) and t.output_len == 6
    again = list(build_workload("sharegpt", WorkloadConfig(dataset_path=str(path), seed=2), vocab, tok).sessions())
    other = list(build_workload("sharegpt", WorkloadConfig(dataset_path=str(path), seed=3), vocab, tok).sessions())
    assert again == sessions and [s.turns for s in other] != [s.turns for s in sessions]


def test_config_validation() -> None:
    with pytest.raises(InvalidRequestError) as e:
        WorkloadConfig(input_len=0)
    assert e.value.param == "input_len"
    with pytest.raises(InvalidRequestError):
        WorkloadConfig(length_dist="zipf")


@pytest.mark.parametrize("name", ["range_ratio", "token_scale", "output_token_scale", "time_scale"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nan_and_inf_options_are_refused(name: str, value: float) -> None:
    """They passed `< 0` / `> 0` checks and failed later: nan and inf lengths in int() with
    a ValueError / OverflowError traceback, an infinite time scale with a run that never
    ended."""
    with pytest.raises(InvalidRequestError) as e:
        WorkloadConfig(**{name: value})
    assert e.value.param == name


@pytest.mark.parametrize("ratio", [1.0, 2.0])
def test_a_uniform_spread_of_one_or_more_is_refused(ratio: float, vocab: Vocab) -> None:
    """`--random-range-ratio 2` was taken: uniform in [L(1-r), L(1+r)] reaches below one
    token, and every draw there became one token, so at L=128 a quarter of the prompts were
    1 token long and the mean was not L (vLLM refuses a range ratio >= 1 too). Normal and
    lognormal take any spread."""
    with pytest.raises(InvalidRequestError, match="range_ratio must be < 1 for uniform lengths") as e:
        WorkloadConfig(input_len=128, range_ratio=ratio)
    assert e.value.param == "range_ratio"
    WorkloadConfig(input_len=128, range_ratio=ratio, length_dist="lognormal")
    lens = [s.turns[0].user.num_tokens
            for s in take(RandomWorkload(WorkloadConfig(input_len=128, range_ratio=0.99), vocab), 400)]
    assert min(lens) >= 1 and statistics.mean(lens) == pytest.approx(128, rel=0.08)
