"""`sluice bench offline` end to end on the tiny checkpoint: it runs both engines and
reports what it measured, in the table and in the last stdout line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.cli import main


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offline_random_against_transformers(tiny_llama_dir: Path, dtype: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "offline", "--model", str(tiny_llama_dir), "--num-requests", "4",
                 "--input-len", "12", "--output-len", "5", "--batch", "2", "--dtype", dtype])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(lines[-1])
    assert doc["dtype"] == dtype and doc["workload"] == "random"
    engines = [(r["engine"], r["label"]) for r in doc["results"]]
    assert engines == [("sluice", "batch=2"), ("transformers", "batch=2")]
    for r in doc["results"]:
        assert r["output_tokens"] == 4 * 5 and r["wall_s"] > 0
    ours = doc["results"][0]
    assert ours["model_gflops"] > 0 and ours["matmul_gflops"] > 0
    assert ours["streamed_matmul_gflops"] > 0
    assert doc["flop_ratio_vs_streamed_matmul"] == pytest.approx(
        ours["model_gflops"] / ours["streamed_matmul_gflops"], abs=0.001)
    assert doc["speedup_vs_transformers_batch2"] == pytest.approx(
        ours["tok_s"] / doc["results"][1]["tok_s"], rel=0.01)
    assert any(line.startswith("sluice") and "batch=2" in line for line in lines)


def test_offline_prefix_cache_on_off(tiny_llama_dir: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "offline", "--model", str(tiny_llama_dir), "--workload", "prefix",
                 "--num-requests", "6", "--prefix-len", "64", "--suffix-len", "8",
                 "--output-len", "3", "--batch", "4", "--no-flops"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    on, off = doc["results"]
    assert on["label"] == "prefix-cache on" and off["label"] == "prefix-cache off"
    # 6 prompts share a 64-token (4-block) prefix: all but the first batch's can hit it
    assert on["extra"]["prefix_cache_hits"] > 0 and off["extra"]["prefix_cache_hits"] == 0


def test_offline_single_stream_reports_the_decode_alone(
        tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "offline", "--model", str(tiny_llama_dir), "--single-stream",
                 "--input-len", "8", "--output-len", "6", "--peer", "none", "--no-flops"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (ours,) = doc["results"]
    first = ours["extra"]["first_output_s"]
    assert 0 < first < ours["wall_s"] and ours["output_tokens"] == 6
    # the 5 tokens after the first, over the time after it (llama-bench's tg counts so)
    assert doc["single_stream_decode_tok_s"] == pytest.approx(
        5 / (ours["wall_s"] - first), rel=0.01)
    assert doc["single_stream_tok_s"] == pytest.approx(6 / ours["wall_s"], rel=0.01)
