"""The converted-weights cache: hit, miss on a changed source, a bad file ignored, off."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sluice.engine.models.weights_cache import VERSION, cached_weights, file_sha256


class Converter:
    def __init__(self, value: float) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {"w": torch.full((2, 3), self.value), "b": torch.arange(4.0)}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", str(folder))
    return folder


def test_a_second_load_reads_the_cache_and_a_changed_source_misses(
        tmp_path: Path, cache: Path) -> None:
    source = tmp_path / "m.gguf"
    source.write_bytes(b"model v1")
    convert = Converter(1.0)
    first = cached_weights(source, convert)
    again = cached_weights(source, convert)
    assert convert.calls == 1
    assert torch.equal(first["w"], again["w"]) and torch.equal(first["b"], again["b"])
    assert [p.name for p in cache.iterdir()] == [f"{file_sha256(source)}-{VERSION}.safetensors"]
    source.write_bytes(b"model v2")  # same path, new bytes: never the old weights
    convert2 = Converter(2.0)
    assert cached_weights(source, convert2)["w"][0, 0] == 2.0 and convert2.calls == 1
    assert len(list(cache.iterdir())) == 2


def test_a_file_whose_recorded_source_differs_is_not_trusted(
        tmp_path: Path, cache: Path) -> None:
    source = tmp_path / "m.gguf"
    source.write_bytes(b"model")
    cache.mkdir()
    save_file({"w": torch.zeros(1)}, cache / f"{file_sha256(source)}-{VERSION}.safetensors",
              metadata={"source_sha256": "0" * 64})
    convert = Converter(3.0)
    assert cached_weights(source, convert)["w"][0, 0] == 3.0 and convert.calls == 1
    assert cached_weights(source, convert)["w"][0, 0] == 3.0 and convert.calls == 1  # rewritten


def test_off_converts_every_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", "off")
    source = tmp_path / "m.gguf"
    source.write_bytes(b"model")
    convert = Converter(1.0)
    cached_weights(source, convert)
    cached_weights(source, convert)
    assert convert.calls == 2


@pytest.mark.model
def test_the_default_gguf_loads_from_the_cache_identically_and_faster(
        default_gguf: Path, cache: Path) -> None:
    from sluice.engine.models.gguf_loader import load_gguf_model

    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    cold, _ = load_gguf_model(default_gguf, cpu, torch.float32)
    t1 = time.perf_counter()
    warm, _ = load_gguf_model(default_gguf, cpu, torch.float32)
    t2 = time.perf_counter()
    a, b = cold.state_dict(), warm.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert t2 - t1 < (t1 - t0) / 2, (t1 - t0, t2 - t1)
