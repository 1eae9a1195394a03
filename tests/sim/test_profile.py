"""The step-time model: what a step costs, the fit that recovers it, the profile file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import ScheduledChunk
from sluice.engine.sequence import Sequence
from sluice.protocol.errors import InvalidRequestError
from sluice.sim.profile import (
    StepProfile,
    chunk_features,
    fit_coefficients,
    fit_profile,
    load_profile,
    save_profile,
)


def chunk(start: int, n: int) -> ScheduledChunk:
    seq = Sequence(1, "r", 0, [0] * (start + n), start + n, SamplingParams(), 8)
    return ScheduledChunk(seq, start, n, True)


def test_step_seconds_weighs_tokens_sequences_and_attention_pairs() -> None:
    p = StepProfile(step_overhead_s=1.0, s_per_token=0.1, s_per_seq=0.01, s_per_kpair=0.5)
    # a 4-token prefill from 0 (pairs 4 * 2.5 = 10) and a decode at context 99 (pairs 100)
    chunks = [chunk(0, 4), chunk(99, 1)]
    assert p.step_seconds(chunks) == pytest.approx(1.0 + 0.1 * 5 + 0.01 * 2 + 0.5 * 110 / 1000)
    assert chunk_features([(0, 4), (99, 1)]) == (1.0, 5.0, 2.0, 0.01, 0.1)


def test_decode_pairs_have_their_own_term_when_the_profile_has_one() -> None:
    one = StepProfile(step_overhead_s=1.0, s_per_token=0.1, s_per_seq=0.01, s_per_kpair=0.5)
    split = one.with_overrides(s_per_decode_kpair=3.0)
    chunks = [chunk(0, 4), chunk(99, 1)]  # prefill pairs 10, decode pairs 100
    base = 1.0 + 0.1 * 5 + 0.01 * 2
    assert split.step_seconds(chunks) == pytest.approx(base + (0.5 * 10 + 3.0 * 100) / 1000)
    assert one.coefficients[4] == 0.5 and split.coefficients[4] == 3.0
    with pytest.raises(InvalidRequestError) as exc:
        one.with_overrides(s_per_decode_kpair=-1.0)
    assert exc.value.param == "s_per_decode_kpair"


def test_fit_recovers_known_coefficients() -> None:
    truth = StepProfile(step_overhead_s=3e-3, s_per_token=2.5e-4, s_per_seq=4e-4,
                        s_per_kpair=2e-6, s_per_decode_kpair=9e-6)
    rng = random.Random(0)
    steps = []
    for _ in range(60):
        chunks = [(rng.randrange(0, 2000), rng.choice([1, 1, 64, 512]))
                  for _ in range(rng.randrange(1, 20))]
        row = chunk_features(chunks)
        steps.append((chunks, sum(c * f for c, f in zip(truth.coefficients, row, strict=True))))
    fitted = fit_profile(StepProfile(), steps, "t", "test")
    for got, want in zip(fitted.coefficients, truth.coefficients, strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_fit_is_non_negative() -> None:
    rows = [(1.0, float(x), 1.0, 0.0, 0.0) for x in range(1, 30)]
    seconds = [0.5 - 0.001 * x for x in range(1, 30)]  # time falls with tokens: no slope
    coef = fit_coefficients(rows, seconds)
    assert all(c >= 0 for c in coef)
    assert coef[1] == 0.0


def test_profile_file_round_trip_and_unknown_field(tmp_path: Path) -> None:
    p = StepProfile(name="gpu", s_per_token=1e-5, num_kv_blocks=100_000)
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == p
    (tmp_path / "bad.json").write_text(json.dumps({"s_per_tokens": 1}))
    with pytest.raises(InvalidRequestError) as exc:
        load_profile(tmp_path / "bad.json")
    assert exc.value.param == "s_per_tokens"
    with pytest.raises(InvalidRequestError) as exc:
        StepProfile(block_size=12)
    assert exc.value.param == "block_size"


def test_faster_divides_every_coefficient_and_keeps_an_absent_decode_term() -> None:
    p = StepProfile(step_overhead_s=1.0, s_per_token=0.1, s_per_seq=0.01, s_per_kpair=0.5)
    assert p.faster(2).coefficients == pytest.approx((0.5, 0.05, 0.005, 0.25, 0.25))
    assert p.faster(2).s_per_decode_kpair is None
    assert p.with_overrides(s_per_decode_kpair=3.0).faster(2).s_per_decode_kpair == 1.5


@pytest.mark.parametrize(("content", "message"), [
    ('{"s_per_token": "abc"}', "s_per_token must be a number, got 'abc'"),
    ('{"num_kv_blocks": 1.5}', "num_kv_blocks must be an integer, got 1.5"),
    ('{"block_size": true}', "block_size must be an integer, got True"),
    ('{"name": 3}', "name must be a string, got 3"),
])
def test_a_profile_field_of_the_wrong_type_is_refused(content: str, message: str,
                                                       tmp_path: Path) -> None:
    """A string coefficient and a float block count were TypeError tracebacks of
    `sluice sim --profile FILE` (from the range checks and from `range()`)."""
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(InvalidRequestError, match=message) as err:
        load_profile(path)
    assert err.value.param == "profile"


def test_a_saved_profile_loads_with_its_null_decode_term(tmp_path: Path) -> None:
    save_profile(StepProfile(), tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == StepProfile()
