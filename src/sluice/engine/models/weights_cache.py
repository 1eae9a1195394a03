"""A converted-weights cache: a GGUF's dequantized tensors, saved once as safetensors.

Dequantizing SmolLM2's Q4_1 GGUF takes ~4 s of a worker's ~8 s start (numpy, single
threaded); every new worker of an autoscaled pool paid it again. The first start on a
machine writes the converted tensors (float32, Q/K rows already un-permuted) to

    $SLUICE_WEIGHTS_CACHE (default ~/.cache/sluice/weights)/<sha256 of the GGUF>-v1.safetensors

and later starts read that file, memory-mapped, instead. The key is the SHA-256 of the
source file's bytes (hashed at every start, ~0.1 s for 100 MB), so a changed file at the
same path never reads stale weights; the converter version is in the name, and the
source hash is also in the file's metadata and checked on load. The file is written to
a temporary name and renamed, so a crashed writer or two workers starting at once never
leave a torn file. `SLUICE_WEIGHTS_CACHE=off` disables it. An unreadable or unwritable
cache is skipped with a warning: it only ever costs the conversion.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

from sluice import env

log = logging.getLogger(__name__)

VERSION = "v1"  # bump when the conversion's output changes
CHUNK = 8 << 20


def cache_dir() -> Path | None:
    """Where converted weights live; None when disabled."""
    configured = env.get("WEIGHTS_CACHE")
    if configured == "off":
        return None
    return Path(configured) if configured else Path.home() / ".cache" / "sluice" / "weights"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def cached_weights(source: Path, convert: Callable[[], dict[str, Tensor]]
                   ) -> dict[str, Tensor]:
    """`convert()`'s tensors for `source`, from the cache when it holds them (verified
    against the source's hash), else converted now and written to the cache."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = cache_dir()
    if folder is None:
        return convert()
    digest = file_sha256(source)
    path = folder / f"{digest}-{VERSION}.safetensors"
    if path.exists():
        try:
            if _source_hash(path) == digest:
                return load_file(path)
            log.warning("weights cache %s does not match its source; converting", path)
        except (OSError, SafetensorError) as exc:
            log.warning("weights cache %s unreadable (%s); converting", path, exc)
    weights = convert()
    _write(path, weights, digest)
    return weights


def _source_hash(path: Path) -> str | None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return meta.get("source_sha256")


def _write(path: Path, weights: dict[str, Tensor], digest: str) -> None:
    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in weights.items()}, tmp,
                      metadata={"source_sha256": digest, "converter": VERSION})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        log.warning("could not write the weights cache %s: %s", path, exc)
