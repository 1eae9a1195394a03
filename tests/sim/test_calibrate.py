"""`sluice sim calibrate` on the real default model (a quick plan): the fit follows the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.protocol.errors import InvalidRequestError
from sluice.sim.calibrate import calibrate, fastest_per_shape, fit_report, from_steps
from sluice.sim.profile import FEATURES, StepProfile, chunk_features


@pytest.mark.model
def test_quick_calibration_fits_the_real_engine() -> None:
    profile, points = calibrate(None, quick=True, repeats=2, num_kv_blocks=256)
    assert profile.num_kv_blocks == 256 and profile.block_size == 16
    assert len(points) >= 8
    # no single coefficient is held (a prefill chunk's tokens and its attention pairs grow
    # together, so on a busy host the non-negative fit may put all of a prefill's cost on
    # one of them: s_per_token came out 0.0 once beside other jobs); what a fit is for is
    # that bigger steps are predicted to cost more

    def predict(chunks: list[tuple[int, int]]) -> float:
        return sum(c * f for c, f in zip(profile.coefficients, chunk_features(chunks),
                                         strict=True))

    assert predict([(0, 512)]) > predict([(0, 64)]) > predict([(64, 1)])
    # the fit follows the fastest step of each shape; on a shared 2-core host single
    # shapes can be 10x off (a step that never ran alone), so only the median is held
    shapes = fastest_per_shape(points)
    assert len(shapes) >= 4
    table, err = fit_report(profile, points)
    assert "fastest ms" in table and err < 1.0


def test_from_steps_fits_each_shapes_mean_step(tmp_path: Path) -> None:
    """Steps real workers logged while serving (two files, as two engines write them):
    the fit recovers the model that made them from each shape's mean (a slow step
    counts: it is what a request waited for), and a line cut short by a killed worker is
    skipped."""
    truth = StepProfile(step_overhead_s=0.02, s_per_token=3e-4, s_per_seq=5e-4,
                        s_per_kpair=2e-3, s_per_decode_kpair=5e-3)
    shapes = [[(0, n)] for n in (32, 128, 512, 1024)]
    shapes += [[(ctx + i, 1) for i in range(b)] for b in (1, 4, 16) for ctx in (100, 900)]
    shapes += [[(0, 200), (300, 1), (310, 1)]]
    header = {"model": "m", "block_size": 16, "num_kv_blocks": 512, "max_num_seqs": 64,
              "max_num_batched_tokens": 1024}
    for worker, extra in enumerate(("", '{"chunks": [[0, 5]], "s"')):
        lines = [json.dumps(header)]
        for chunks in shapes:
            seconds = sum(c * f for c, f in zip(truth.coefficients, chunk_features(chunks),
                                                strict=True))
            for factor in (0.5, 0.5, 2.0):  # mean 1.0; one step waited for a core
                lines.append(json.dumps({"chunks": chunks, "s": seconds * factor}))
        (tmp_path / f"steps-{worker}.jsonl").write_text("\n".join(lines) + "\n" + extra)
    profile, points = from_steps([str(tmp_path)])
    assert len(points) == 2 * 3 * len(shapes)
    assert (profile.block_size, profile.num_kv_blocks, profile.max_num_seqs,
            profile.max_num_batched_tokens) == (16, 512, 64, 1024)
    for name in FEATURES:
        assert getattr(profile, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert "served steps" in profile.source


def test_from_steps_without_steps_names_the_parameter(tmp_path: Path) -> None:
    (tmp_path / "steps-1.jsonl").write_text('{"model": "m", "block_size": 16}\n')
    with pytest.raises(InvalidRequestError) as err:
        from_steps([str(tmp_path)])
    assert err.value.param == "from_steps"


def test_from_steps_rejects_the_engine_timing_options(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.cli import main

    rc = main(["sim", "calibrate", "--from-steps", str(tmp_path), "--cpu-threads", "1",
               "--out", str(tmp_path / "p.json")])
    assert rc == 2 and "--cpu-threads" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def _write_steps(directory: Path) -> None:
    """One engine's step log, a few shapes: enough for `from_steps` to fit."""
    header = {"model": "m", "block_size": 16, "num_kv_blocks": 512, "max_num_seqs": 64,
              "max_num_batched_tokens": 1024}
    shapes = [[[0, n]] for n in (32, 128, 512)] + [[[100 + i, 1] for i in range(b)]
                                                   for b in (1, 4, 16)]
    lines = [json.dumps(header)] + [json.dumps({"chunks": c, "s": 0.01 + 0.001 * len(c)})
                                    for c in shapes for _ in range(2)]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "steps-1.jsonl").write_text("\n".join(lines) + "\n")


def test_an_out_path_that_cannot_be_written_is_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was a FileNotFoundError traceback after the fit (after minutes of timing,
    without --from-steps), and the profile was lost."""
    from sluice.cli import main

    _write_steps(tmp_path / "steps")
    out = tmp_path / "missing" / "p.json"
    assert main(["sim", "calibrate", "--from-steps", str(tmp_path / "steps"),
                 "--out", str(out)]) == 2
    assert f"cannot write the profile to {out}: no such directory" in capsys.readouterr().err


def test_the_default_out_creates_sluice_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """$SLUICE_HOME (./.sluice) does not exist until something creates it: on a machine
    where `sluice serve` never ran, the default --out failed after the fit."""
    from sluice.cli import main

    _write_steps(tmp_path / "steps")
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    assert main(["sim", "calibrate", "--from-steps", str(tmp_path / "steps")]) == 0
    assert StepProfile(**json.loads((tmp_path / "home" / "sim-profile.json").read_text()))
    capsys.readouterr()
