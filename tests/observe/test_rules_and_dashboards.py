"""The shipped Prometheus rules pass `promtool check rules` and their unit tests (each
alert fires and resolves); the committed Grafana JSON is what the generator writes."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from sluice.observe.dashboards import DASHBOARDS, queries, render

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (apt-get install prometheus)")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


@needs_promtool
def test_rules_are_valid() -> None:
    result = _promtool("check", "rules", str(PROM / "sluice-rules.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 21 rules found" in result.stdout


@needs_promtool
def test_every_alert_fires_and_resolves_in_promtool_unit_tests() -> None:
    tests = PROM / "tests" / "sluice-rules.test.yml"
    result = _promtool("test", "rules", str(tests))
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {line.split(":", 1)[1].strip() for line in (PROM / "sluice-rules.yml").read_text()
              .splitlines() if line.strip().startswith("- alert:")}
    text = tests.read_text()
    for alert in alerts:  # each alert has a case that expects it firing, and one expecting none
        assert f"alertname: {alert}\n        exp_alerts:\n          - exp_labels" in text, alert
        assert f"alertname: {alert}\n        exp_alerts: []" in text, alert


@needs_promtool
def test_promtool_catches_a_wrong_expectation(tmp_path: Path) -> None:
    broken = (PROM / "tests" / "sluice-rules.test.yml").read_text().replace(
        "value: 4.975", "value: 4.0").replace("../sluice-rules.yml", str(PROM / "sluice-rules.yml"))
    path = tmp_path / "broken.test.yml"
    path.write_text(broken)
    assert _promtool("test", "rules", str(path)).returncode != 0


@pytest.mark.parametrize("uid", sorted(DASHBOARDS))
def test_committed_dashboards_match_the_generator(uid: str) -> None:
    committed = (ROOT / "deploy" / "grafana" / f"{uid}.json").read_text()
    assert committed == render(uid), "run: python -m sluice.observe.dashboards deploy/grafana"


def test_dashboards_cover_the_path() -> None:
    exprs = " ".join(queries())
    for metric in ("vllm:time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc",
                   "vllm:request_queue_time_seconds_bucket", "sluice_router_decision_seconds",
                   "sluice_router_estimated_prefix_hit_tokens_total",
                   "sluice_router_migrations_total",
                   "sluice_gateway_spend_usd_total", "sluice_gateway_rejections_total"):
        assert metric in exprs, metric


def test_the_generator_takes_help_and_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m sluice.observe.dashboards --help` wrote the four dashboards into a new
    directory named `--help`."""
    from sluice.observe.dashboards import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "out_dir" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    assert main(["out"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        f"{uid}.json" for uid in DASHBOARDS)


@needs_promtool
def test_the_5xx_ratio_panel_reads_0_while_nothing_failed(tmp_path: Path) -> None:
    """With no 5xx series (a healthy stack), `sum(5xx) / sum(all)` had no result and the
    overview's "5xx ratio" panel showed "No data" instead of 0."""
    from sluice.observe.dashboards import OVERVIEW

    (panel,) = [p for p in OVERVIEW if p.title == "5xx ratio"]
    expr = panel.queries[0][0].replace("$__rate_interval", "5m")
    test = {"evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": 'sluice_router_requests_total{model="m",status="200"}',
                          "values": "0+60x10"}],
        "promql_expr_test": [{"expr": expr, "eval_time": "10m",
                              "exp_samples": [{"labels": "{}", "value": 0}]}]}]}
    path = tmp_path / "panel.test.yml"
    path.write_text(json.dumps(test))  # JSON is YAML
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
