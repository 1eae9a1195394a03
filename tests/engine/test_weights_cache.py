"""The converted-weights cache: a hit is memory-mapped and hashes nothing; a changed
source misses, a touched one is re-hashed but not converted; a corrupted, truncated or
unrecorded cache file is detected and rewritten; a racily clean file is hashed until it
is not; `off` converts every time.

Files the tests write are seconds old at most, so most tests set RACY_S to 0 (stamps
recorded at once); the racy tests set it back."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from sluice.engine.models import weights_cache
from sluice.engine.models.weights_cache import VERSION, cached_state, file_sha256


class Converter:
    def __init__(self, value: float) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {"w": torch.full((64, 32), self.value), "b": torch.arange(4.0)}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", str(folder))
    monkeypatch.setattr(weights_cache, "RACY_S", 0.0)
    return folder


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"model v1")
    return path


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file the cache hashes, in order."""
    calls: list[Path] = []

    def counting(path: Path) -> str:
        calls.append(Path(path))
        return file_sha256(path)

    monkeypatch.setattr(weights_cache, "file_sha256", counting)
    return calls


def cache_file(cache: Path, source: Path, dtype: str = "float32") -> Path:
    return cache / f"{file_sha256(source)}-{dtype}-{VERSION}.safetensors"


def mapped_file(t: torch.Tensor) -> str | None:
    """The file whose memory map holds `t`'s data, if any (/proc/self/maps)."""
    address = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *_, name = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            return name if name.startswith("/") else None
    return None


def test_a_hit_is_memory_mapped_and_hashes_nothing(
        source: Path, cache: Path, hashed: list[Path]) -> None:
    convert = Converter(1.0)
    first = cached_state(source, torch.float32, convert)
    assert convert.calls == 1 and len(hashed) == 2  # the source, then the written file
    hashed.clear()
    again = cached_state(source, torch.float32, convert)
    assert convert.calls == 1 and hashed == []
    assert torch.equal(first["w"], again["w"]) and torch.equal(first["b"], again["b"])
    assert mapped_file(again["w"]) == str(cache_file(cache, source))


def test_a_changed_source_misses_and_a_touched_one_is_rehashed_only(
        source: Path, cache: Path, hashed: list[Path]) -> None:
    cached_state(source, torch.float32, Converter(1.0))
    source.write_bytes(b"model v2")  # same path, new bytes: never the old weights
    changed = Converter(2.0)
    assert cached_state(source, torch.float32, changed)["w"][0, 0] == 2.0
    assert changed.calls == 1
    hashed.clear()
    os.utime(source, ns=(1, 1))  # new stamp, same content: re-hashed, not converted
    touched = Converter(3.0)
    assert cached_state(source, torch.float32, touched)["w"][0, 0] == 2.0
    assert touched.calls == 0 and hashed == [source.resolve()]
    hashed.clear()
    cached_state(source, torch.float32, touched)
    assert hashed == []  # the new stamp was recorded


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "drop its record"])
def test_a_damaged_cache_file_is_detected_and_rewritten(
        source: Path, cache: Path, damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if damage == "flip a byte":  # a same-size write within the timestamps' tick: caught
        monkeypatch.setattr(weights_cache, "RACY_S", 2.0)  # because the stamp was racy
    cached_state(source, torch.float32, Converter(1.0))
    path = cache_file(cache, source)
    data = bytearray(path.read_bytes())
    if damage == "flip a byte":
        data[-5] ^= 0x40  # a payload byte: the file parses, the weights are wrong
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-100]))
    else:
        path.with_suffix(".json").unlink()
    convert = Converter(1.0)
    state = cached_state(source, torch.float32, convert)
    assert convert.calls == 1 and torch.equal(state["w"], torch.full((64, 32), 1.0))
    again = cached_state(source, torch.float32, convert)
    assert convert.calls == 1  # rewritten: a hit again
    assert torch.equal(again["w"], state["w"]) and mapped_file(again["w"]) == str(path)


def test_a_racily_clean_file_is_hashed_until_it_is_not(
        source: Path, cache: Path, hashed: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights_cache, "RACY_S", 0.3)
    cached_state(source, torch.float32, Converter(1.0))  # source and cache file: fresh
    hashed.clear()
    cached_state(source, torch.float32, Converter(1.0))
    assert hashed == [source.resolve(), cache_file(cache, source)]
    time.sleep(0.35)
    hashed.clear()
    cached_state(source, torch.float32, Converter(1.0))  # hashed again; now old enough
    assert len(hashed) == 2
    hashed.clear()
    cached_state(source, torch.float32, Converter(1.0))
    assert hashed == []


def test_a_file_recording_another_source_is_not_trusted(
        source: Path, cache: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another model")
    cached_state(other, torch.float32, Converter(5.0))
    cache_file(cache, other).rename(cache_file(cache, source))  # its record still matches
    cache_file(cache, other).with_suffix(".json").rename(
        cache_file(cache, source).with_suffix(".json"))
    convert = Converter(1.0)
    assert cached_state(source, torch.float32, convert)["w"][0, 0] == 1.0
    assert convert.calls == 1


def test_each_dtype_has_its_own_file(source: Path, cache: Path) -> None:
    cached_state(source, torch.float32, Converter(1.0))
    convert = Converter(1.0)
    cached_state(source, torch.bfloat16, convert)
    assert convert.calls == 1
    assert cache_file(cache, source, "bfloat16").is_file()


def test_off_converts_every_time(source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", "off")
    convert = Converter(1.0)
    cached_state(source, torch.float32, convert)
    cached_state(source, torch.float32, convert)
    assert convert.calls == 2


@pytest.mark.model
def test_the_default_gguf_loads_from_the_cache_identically_and_mapped(
        default_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.engine.models.gguf_loader import load_gguf_model

    cpu = torch.device("cpu")
    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", "off")
    converted, _ = load_gguf_model(default_gguf, cpu, torch.float32)
    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", str(cache))
    load_gguf_model(default_gguf, cpu, torch.float32)  # fills the cache
    cached, _ = load_gguf_model(default_gguf, cpu, torch.float32)
    a, b = converted.state_dict(), cached.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cached.output.weight.data_ptr() == cached.tok_embeddings.weight.data_ptr()  # tied
    assert mapped_file(cached.layers[0].attention.wqkv.weight) == str(
        cache_file(cache, default_gguf))
