"""A small, fast GGUF reader: metadata as Python values, tensors as memory-mapped bytes.

`gguf.GGUFReader` wraps every one of the ~150,000 metadata array items in its own
numpy view and takes about five seconds on SmolLM2's file; this reader parses the
header with `struct` from a memory map of the file (~0.1 s, most of it the tokenizer's
~100,000 strings) and leaves tensor data in a `numpy.memmap` for
`gguf.quants.dequantize`. No torch here: the tokenizer uses it.

File layout (little endian, GGUF v2/v3):

    "GGUF" u32 version | u64 n_tensors | u64 n_kv
    n_kv x  (string key, u32 type, value)          value: scalar | string | array
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment (32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sluice.protocol.errors import InvalidRequestError

_SCALARS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
                            7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first): GGUF dims reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_gguf(path: str | Path) -> GGUFFile:
    """The file's parsed header, shared within this process while the file is unchanged
    (same device, inode, size, mtime, ctime): an engine core's model loader and its
    tokenizer read the same file, and the second read costs nothing."""
    st = os.stat(path)
    return _parsed(str(path), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                               st.st_ctime_ns))


@functools.lru_cache(maxsize=2)
def _parsed(path: str, stamp: tuple[int, ...]) -> GGUFFile:
    return GGUFFile(path)


class GGUFFile:
    """Parsed header of a GGUF file; `raw(name)` maps one tensor's bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 4:
                raise InvalidRequestError(f"{self.path.name} is not a GGUF file", param="model")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                self._buf = memoryview(mapped)  # only the header's pages are read
                try:
                    self._parse()
                except (struct.error, ValueError, UnicodeDecodeError) as exc:
                    raise InvalidRequestError(f"{self.path.name}: corrupt or truncated GGUF "
                                              f"header ({exc})", param="model") from None
                finally:
                    self._buf.release()

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 `[rows, row_bytes]` (what gguf.quants.dequantize takes)."""
        info = self.tensors[name]
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset,
                         shape=(info.nbytes,))
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return data.reshape(rows, info.nbytes // rows)

    # -- parsing ----------------------------------------------------------------------------

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _strings(self, count: int) -> list[str]:
        """`count` strings (a vocabulary, merges: ~100,000 in SmolLM2), in one tight loop."""
        buf, pos, out = self._buf, self._pos, []
        length = _U64.unpack_from
        for _ in range(count):
            (n,) = length(buf, pos)
            pos += 8
            out.append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self._pos = pos
        return out

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type in _SCALARS and item_type != 7:
                dtype = np.dtype(_SCALARS[item_type])
                values = np.frombuffer(self._buf, dtype=dtype, count=count,
                                       offset=self._pos).tolist()
                self._pos += count * dtype.itemsize
                return values
            if item_type == _STRING:
                return self._strings(count)
            return [self._value(item_type) for _ in range(count)]
        if vtype not in _SCALARS:
            raise InvalidRequestError(f"{self.path.name}: bad GGUF value type {vtype}", param="model")
        return self._unpack(_SCALARS[vtype])

    def _parse(self) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        if bytes(self._buf[:4]) != b"GGUF":
            raise InvalidRequestError(f"{self.path.name} is not a GGUF file", param="model")
        self._pos = 4
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version < 2:
            raise InvalidRequestError(f"{self.path.name}: GGUF v{version} is not supported",
                                      param="model")
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            infos.append((name, tuple(reversed(dims)), self._unpack("<I"), self._unpack("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        for name, shape, gtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
            nbytes = int(np.prod(shape)) // block * type_size
            self.tensors[name] = GGUFTensorInfo(name, shape, gtype, data_start + offset, nbytes)
