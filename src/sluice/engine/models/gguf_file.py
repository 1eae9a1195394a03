"""A small, fast GGUF reader: metadata as Python values, tensors as memory-mapped bytes.

`gguf.GGUFReader` wraps every one of the ~150,000 metadata array items in its own
numpy view and takes about five seconds on SmolLM2's file; this reader parses the
header with `struct` in a few tens of milliseconds and leaves tensor data in a
`numpy.memmap` for `gguf.quants.dequantize`. No torch here: the tokenizer uses it.

File layout (little endian, GGUF v2/v3):

    "GGUF" u32 version | u64 n_tensors | u64 n_kv
    n_kv x  (string key, u32 type, value)          value: scalar | string | array
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment (32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sluice.protocol.errors import InvalidRequestError

_SCALARS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
                            7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first): GGUF dims reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Parsed header of a GGUF file; `raw(name)` maps one tensor's bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._buf = memoryview(f.read(self._header_limit()))
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        self._parse()

    def _header_limit(self) -> int:
        return min(self.path.stat().st_size, 64 * 1024 * 1024)

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

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type in _SCALARS and item_type != 7:
                arr = np.frombuffer(self._buf, dtype=np.dtype(_SCALARS[item_type]), count=count,
                                    offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
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
        self._buf = memoryview(b"")  # the header copy is no longer needed
