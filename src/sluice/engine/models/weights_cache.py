"""A converted-weights cache: a GGUF's model state, saved once exactly as the engine uses it.

Converting SmolLM2's Q4_1 GGUF (dequantize, un-permute Q/K, fuse Q|K|V and gate|up,
cast) takes seconds, and every new worker of an autoscaled pool paid it again. The
first start on a machine writes the result; later starts memory-map it:

    $SLUICE_WEIGHTS_CACHE (default ~/.cache/sluice/weights)/
      <source sha256>-<dtype>-v3.safetensors   the model's state dict (a tied head left out)
      <source sha256>-<dtype>-v3.json          that file's SHA-256 and the stamp it had
      sources/<sha256 of the source's path>.json   the source's SHA-256 and its stamp

A stamp is a file's (device, inode, size, mtime, ctime). Integrity is kept without
hashing hundreds of MB at every start:

- the cache file is named by the source's content hash, which is computed again only
  when the source's stamp changes: any write to a file changes its ctime (which, unlike
  mtime, no user call can set back), so a changed or replaced GGUF never reads stale
  weights, and a merely touched or copied one is re-hashed, not re-converted;
- the cache file's own SHA-256 is recorded when it is written and checked again
  whenever its stamp differs from the recorded one; a mismatch, a torn or unparsable
  file, one recording another source, or a missing record is a miss: converted again
  and rewritten;
- a stamp taken within RACY_S of the file's last change is not recorded (a same-size
  write within the file system's timestamp tick would not change it), so a freshly
  written cache file is hashed once more by the next start, then trusted;
- files are written under a temporary name and renamed, so a crashed writer or two
  workers starting at once never leave a torn file.

Not detected: a change that leaves the stamp as it was (a disk's silent bit rot, which
the disk's and file system's own checksums are for).

A hit costs a few stat calls and reading the safetensors header: safetensors maps the
file copy-on-write (`MAP_PRIVATE`), so the tensors are views of the page cache, shared
by every worker on the machine and copied only if written (the model never writes its
weights); pages are read from disk on first touch (the runner's warm-up forward) where
the page cache does not hold them.

`SLUICE_WEIGHTS_CACHE=off` disables it. An unreadable or unwritable cache is skipped
with a warning: it only ever costs the conversion.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sluice import env

log = logging.getLogger(__name__)

VERSION = "v3"  # bump when the stored state's layout or the conversion changes
CHUNK = 8 << 20
# A file changed less than this long ago is "racily clean" (git's term): file times
# tick coarsely (a few ms), so a same-size write within the same tick would leave the
# stamp as it was. Such a stamp is not recorded, and the next start hashes again.
RACY_S = 2.0


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


def file_stamp(path: Path) -> list[int]:
    """(device, inode, size, mtime, ctime): changes with any write to the file."""
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def hash_and_stamp(path: Path) -> tuple[str, list[int] | None]:
    """The file's SHA-256 and the stamp to record with it: None (so the next check hashes
    again) if the file changed while hashed or is racily clean (see RACY_S)."""
    before = file_stamp(path)
    digest = file_sha256(path)
    after = file_stamp(path)
    racy = time.time_ns() - max(after[3], after[4]) < RACY_S * 1e9
    return digest, None if racy or after != before else after


def cached_state(source: Path, dtype: torch.dtype,
                 build: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
    """`build()`'s tensors (the model's state in `dtype`) for `source`: memory-mapped from
    the cache when it holds them for this content, else built now and written there."""
    folder = cache_dir()
    if folder is None:
        return build()
    try:
        digest = source_sha256(source, folder)
    except OSError as exc:
        log.warning("weights cache %s unusable (%s); converting", folder, exc)
        return build()
    path = folder / f"{digest}-{str(dtype).removeprefix('torch.')}-{VERSION}.safetensors"
    state = _load(path, digest)
    if state is not None:
        return state
    state = build()
    _write(path, state, digest)
    return state


def source_sha256(source: Path, folder: Path) -> str:
    """The source's SHA-256: the recorded one while its stamp is unchanged, else hashed
    now and recorded."""
    resolved = source.resolve()
    record = folder / "sources" / f"{hashlib.sha256(str(resolved).encode()).hexdigest()}.json"
    stamp = file_stamp(resolved)
    known = _read_record(record)
    if known is not None and known.get("stamp") == stamp and isinstance(known.get("sha256"), str):
        return str(known["sha256"])
    digest, recorded = hash_and_stamp(resolved)
    _write_record(record, {"path": str(resolved), "stamp": recorded, "sha256": digest})
    return digest


def _load(path: Path, digest: str) -> dict[str, Tensor] | None:
    """The cached state, memory-mapped; None (a miss) unless it checks out."""
    from safetensors import SafetensorError, safe_open

    if not path.exists():
        return None
    try:
        if not _intact(path):
            log.warning("weights cache %s does not match its recorded hash; converting", path)
            return None
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("source_sha256") != digest:
                log.warning("weights cache %s does not match its source; converting", path)
                return None
            return {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError, ValueError) as exc:
        log.warning("weights cache %s unreadable (%s); converting", path, exc)
        return None


def _intact(path: Path) -> bool:
    """Whether the file is the one written: same stamp as recorded, or else same hash
    (then the new stamp is recorded)."""
    record_path = path.with_suffix(".json")
    record = _read_record(record_path)
    if record is None or not isinstance(record.get("sha256"), str):
        return False
    if record.get("stamp") == file_stamp(path):
        return True
    digest, stamp = hash_and_stamp(path)
    if digest != record["sha256"]:
        return False
    _write_record(record_path, {"sha256": digest, "stamp": stamp})
    return True


def _write(path: Path, state: dict[str, Tensor], digest: str) -> None:
    from safetensors.torch import save_file

    try:
        with _temporary(path) as tmp:
            save_file(state, tmp, metadata={"source_sha256": digest, "converter": VERSION})
            os.replace(tmp, path)
        file_digest, stamp = hash_and_stamp(path)
        _write_record(path.with_suffix(".json"), {"sha256": file_digest, "stamp": stamp})
    except OSError as exc:
        log.warning("could not write the weights cache %s: %s", path, exc)


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_record(path: Path, record: dict[str, Any]) -> None:
    """Atomically; a failure only costs a re-check next time."""
    try:
        with _temporary(path) as tmp:
            Path(tmp).write_text(json.dumps(record), encoding="utf-8")
            os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not write %s: %s", path, exc)


@contextlib.contextmanager
def _temporary(path: Path) -> Iterator[str]:
    """A temporary file name beside `path` (its folder created), removed unless renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
