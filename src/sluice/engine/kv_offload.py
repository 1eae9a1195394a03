"""KV offload tiers below the pool: host memory, a disk directory, a shared store.

A full, cached block is named by its chained hash (`sluice.protocol.block_hash`), the
same identity the prefix cache and the KV events use, so any tier of any worker can be
asked for a prefix:

    pool (device) ──evicted──► host tier (RAM, LRU, bounded bytes)
        │  newly cached blocks, written through on a background thread
        └──────────────────────► disk tier (DIR/<namespace>/<hash>.kv, bounded bytes)
                                 shared store (redis://, key sluice:kv:<namespace>:<hash>)

    prefix-cache miss at block i ──► host, then disk, then store: for each next block of
    the chain (tokens verified), load it into a free pool block instead of recomputing,
    while the tier's measured per-block load time beats the engine's measured prefill
    time for `block_size` tokens.

What a tier stores for a block: its token ids and one tensor `[2, num_layers, block_size,
kv_heads, head_dim]` (K then V), an exact copy in the pool's dtype. On disk and in the
store that is a self-checking blob (magic, JSON header with the namespace, hash, tokens,
shape and dtype, the raw bytes, then a CRC-32 of all of it): a truncated or corrupt blob
is counted, logged and treated as a miss (the block is recomputed), never loaded.

The namespace is a digest of everything that makes two pools' blocks interchangeable
(model, dtype, block size, layer and head shapes), so workers of other models sharing a
directory or a Redis database never read each other's blocks.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

import torch
from torch import Tensor

from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.kv_events import BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("sluice.engine.kv_offload")

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
          "GB": 10**9, "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def parse_size(text: str, param: str) -> int:
    """'4GiB', '500MB', '1e9', '123' -> bytes (> 0); InvalidRequestError naming `param`."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise InvalidRequestError(f"invalid size {text!r} (e.g. 4GiB, 500MB, 1000000)",
                                  param=param)
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise InvalidRequestError(f"size {text!r} must be positive", param=param)
    return size


@dataclass(frozen=True)
class KVOffloadSpec:
    """`--kv-offload host=4GiB,disk=DIR:20GiB` parsed (either part may be absent)."""

    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0

    @classmethod
    def parse(cls, text: str) -> KVOffloadSpec:
        host, disk_dir, disk = 0, None, 0
        seen: set[str] = set()
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or not value:
                raise InvalidRequestError(f"kv_offload part {part!r} is not key=value "
                                          "(host=SIZE or disk=DIR:SIZE)", param="kv_offload")
            if key in seen:
                raise InvalidRequestError(f"kv_offload names the {key} tier twice",
                                          param="kv_offload")
            seen.add(key)
            if key == "host":
                host = parse_size(value, "kv_offload")
            elif key == "disk":
                path, colon, size = value.rpartition(":")
                if not colon or not path:
                    raise InvalidRequestError(f"kv_offload disk={value!r} needs DIR:SIZE",
                                              param="kv_offload")
                disk_dir, disk = path, parse_size(size, "kv_offload")
            else:
                raise InvalidRequestError(f"unknown kv_offload tier {key!r} (host, disk)",
                                          param="kv_offload")
        if not host and disk_dir is None:
            raise InvalidRequestError("kv_offload names no tier (host=SIZE, disk=DIR:SIZE)",
                                      param="kv_offload")
        return cls(host, disk_dir, disk)


def check_store_url(url: str) -> None:
    """`--kv-store`: only redis:// (and rediss://) are known."""
    if not url.startswith(("redis://", "rediss://")):
        raise InvalidRequestError(f"unsupported kv_store {url!r} (redis://HOST:PORT/DB)",
                                  param="kv_store")


# -- blocks and their wire form --------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One block's token ids and K/V `[2, layers, block_size, kv_heads, head_dim]` (CPU)."""

    token_ids: tuple[int, ...]
    kv: Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class CorruptBlock(ValueError):
    """A blob that fails its checks (truncated, bad checksum, another namespace)."""


_MAGIC = b"SLKV"
_HEAD = struct.Struct("<4sHI")  # magic, version, header length
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16,
                                                       torch.float16)}


def encode_block(namespace: str, block_hash: int, block: StoredBlock) -> bytes:
    return b"".join(encode_block_parts(namespace, block_hash, block))


def encode_block_parts(namespace: str, block_hash: int,
                       block: StoredBlock) -> tuple[bytes, memoryview, bytes]:
    """`encode_block` as (header, K/V bytes, checksum) without joining them: a socket
    sends the tensor's memory as it is (sluice.engine.kv_transfer)."""
    kv = block.kv.contiguous()
    meta = json.dumps({"ns": namespace, "hash": block_hash, "tokens": list(block.token_ids),
                       "dtype": str(kv.dtype).removeprefix("torch."),
                       "shape": list(kv.shape)}).encode()
    head = _HEAD.pack(_MAGIC, 1, len(meta)) + meta
    data = kv.view(torch.uint8).numpy().data.cast("B")
    return head, data, struct.pack("<I", zlib.crc32(data, zlib.crc32(head)))


def decode_block(namespace: str, block_hash: int, blob: bytes | memoryview) -> StoredBlock:
    """The block in `blob`, or CorruptBlock; never returns data that failed a check. A
    writable memoryview is not copied: the block's tensor shares its memory."""
    if len(blob) < _HEAD.size + 4:
        raise CorruptBlock("truncated (shorter than a header)")
    body, (crc,) = blob[:-4], struct.unpack("<I", blob[-4:])
    if zlib.crc32(body) != crc:
        raise CorruptBlock("checksum mismatch (truncated or corrupt)")
    magic, version, meta_len = _HEAD.unpack_from(body)
    if magic != _MAGIC or version != 1:
        raise CorruptBlock("not a sluice KV block")
    meta = json.loads(bytes(body[_HEAD.size:_HEAD.size + meta_len]))
    if meta["ns"] != namespace or meta["hash"] != block_hash:
        raise CorruptBlock("another namespace or block")
    data: bytes | bytearray | memoryview = body[_HEAD.size + meta_len:]
    if not (isinstance(data, memoryview) and not data.readonly):
        data = bytearray(data)
    kv = torch.frombuffer(data, dtype=torch.uint8)
    kv = kv.view(_DTYPES[meta["dtype"]])
    if kv.numel() != _numel(meta["shape"]):
        raise CorruptBlock("payload size does not match its shape")
    return StoredBlock(tuple(meta["tokens"]), kv.view(meta["shape"]))


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- tiers -----------------------------------------------------------------------------
@dataclass
class TierStats:
    """Cumulative counters of one tier (Prometheus counters) and its fill level."""

    hits: int = 0  # blocks loaded from this tier into the pool
    queries: int = 0  # blocks looked up here (after the tiers above missed)
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    blocks_stored: int = 0
    bytes_stored: int = 0
    errors: int = 0  # corrupt or truncated blobs, unreachable store
    usage_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


class KVTier(ABC):
    """A block store keyed by block hash. `get` returns None on a miss, and also on any
    failure (counted in `stats.errors`, logged): a tier never makes the engine fail.
    `put` may drop blocks (bounded tiers evict least recently used ones)."""

    medium: str = ""

    def __init__(self) -> None:
        self.stats = TierStats()

    @abstractmethod
    def get(self, block_hash: int) -> StoredBlock | None: ...

    @abstractmethod
    def put(self, block_hash: int, block: StoredBlock) -> None: ...

    @abstractmethod
    def contains(self, block_hash: int) -> bool: ...


class HostTier(KVTier):
    """Blocks in host memory, least recently used evicted past `capacity` bytes.
    Engine thread only."""

    medium = "CPU"

    def __init__(self, capacity: int, on_removed: Callable[[list[int]], None] | None = None):
        super().__init__()
        self.capacity = capacity
        self.blocks: OrderedDict[int, StoredBlock] = OrderedDict()
        self.on_removed = on_removed

    def get(self, block_hash: int) -> StoredBlock | None:
        block = self.blocks.get(block_hash)
        if block is not None:
            self.blocks.move_to_end(block_hash)
        return block

    def contains(self, block_hash: int) -> bool:
        return block_hash in self.blocks

    def put(self, block_hash: int, block: StoredBlock) -> None:
        if block.nbytes > self.capacity or block_hash in self.blocks:
            return
        self.blocks[block_hash] = block
        self.stats.usage_bytes += block.nbytes
        self.stats.blocks_stored += 1
        self.stats.bytes_stored += block.nbytes
        removed = []
        while self.stats.usage_bytes > self.capacity:
            old_hash, old = self.blocks.popitem(last=False)
            self.stats.usage_bytes -= old.nbytes
            removed.append(old_hash)
        if removed and self.on_removed is not None:
            self.on_removed(removed)


class BlobTier(KVTier):
    """A tier holding encoded blobs (disk, a remote store): decode checks every blob."""

    def __init__(self, namespace: str) -> None:
        super().__init__()
        self.namespace = namespace

    @abstractmethod
    def read(self, block_hash: int) -> bytes | None: ...

    @abstractmethod
    def write(self, block_hash: int, blob: bytes) -> None: ...

    def read_many(self, hashes: Sequence[int]) -> list[bytes | None]:
        """`read` of each (a remote store overrides this with one round trip)."""
        return [self.read(h) for h in hashes]

    def write_many(self, items: Sequence[tuple[int, bytes]]) -> list[bool]:
        """`write` each blob not held yet; whether each was stored (a remote store
        overrides this with one round trip for the checks and one for the writes)."""
        out = []
        for block_hash, blob in items:
            stored = self.stats.blocks_stored
            if not self.contains(block_hash):
                self.write(block_hash, blob)
            out.append(self.stats.blocks_stored > stored)
        return out

    def get(self, block_hash: int) -> StoredBlock | None:
        return self._decode(block_hash, self.read(block_hash))

    def get_many(self, hashes: Sequence[int]) -> list[StoredBlock | None]:
        """`get` of each, read in one `read_many`."""
        return [self._decode(h, blob) for h, blob in zip(hashes, self.read_many(hashes),
                                                          strict=True)]

    def _decode(self, block_hash: int, blob: bytes | None) -> StoredBlock | None:
        if blob is None:
            return None
        try:
            return decode_block(self.namespace, block_hash, blob)
        except (CorruptBlock, ValueError, KeyError, TypeError) as exc:
            self.stats.errors += 1
            log.warning("kv offload: %s block %016x unusable (%s); recomputing it",
                        self.medium, block_hash & 0xFFFFFFFFFFFFFFFF, exc)
            self.discard(block_hash)
            return None

    def put(self, block_hash: int, block: StoredBlock) -> None:
        blob = encode_block(self.namespace, block_hash, block)
        self.write(block_hash, blob)

    def discard(self, block_hash: int) -> None:
        """Forget a bad blob (default: nothing)."""


class DiskTier(BlobTier):
    """`DIR/<namespace>/<hash>.kv` files, least recently used removed past `capacity`.

    Written atomically (a temporary file, then `os.replace`), so several workers on one
    machine may share the directory; a file another worker wrote is found by its name.
    The index is rebuilt from the directory (oldest modification first) at start, so a
    restarted worker keeps its blocks. Thread-safe (the writer thread puts, the engine
    thread gets)."""

    medium = "DISK"

    def __init__(self, root: str, capacity: int, namespace: str) -> None:
        super().__init__(namespace)
        self.dir = os.path.join(root, namespace)
        os.makedirs(self.dir, exist_ok=True)
        self.capacity = capacity
        self.lock = threading.Lock()
        self.index: OrderedDict[int, int] = OrderedDict()  # hash -> file size
        self.on_removed: Callable[[list[int]], None] | None = None
        self._scan()

    def _path(self, block_hash: int) -> str:
        return os.path.join(self.dir, f"{block_hash & 0xFFFFFFFFFFFFFFFF:016x}.kv")

    def _scan(self) -> None:
        entries = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".kv") and len(entry.name) == 19:
                st = entry.stat()
                entries.append((st.st_mtime, int(entry.name[:16], 16), st.st_size))
        for _, unsigned, size in sorted(entries):
            self.index[unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned] = size
            self.stats.usage_bytes += size

    def contains(self, block_hash: int) -> bool:
        with self.lock:
            if block_hash in self.index:
                return True
        return os.path.exists(self._path(block_hash))

    def read(self, block_hash: int) -> bytes | None:
        try:
            with open(self._path(block_hash), "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.stats.errors += 1
            log.warning("kv offload: cannot read %s: %s", self._path(block_hash), exc)
            return None
        with self.lock:
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
        return blob

    def write(self, block_hash: int, blob: bytes) -> None:
        path = self._path(block_hash)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError as exc:
            self.stats.errors += 1
            log.warning("kv offload: cannot write %s: %s", path, exc)
            return
        with self.lock:
            self.stats.usage_bytes += len(blob) - self.index.pop(block_hash, 0)
            self.index[block_hash] = len(blob)
            self.stats.blocks_stored += 1
            self.stats.bytes_stored += len(blob)
            victims = []
            while self.stats.usage_bytes > self.capacity and len(self.index) > 1:
                old, size = self.index.popitem(last=False)
                self.stats.usage_bytes -= size
                victims.append(old)
        for old in victims:
            self._unlink(old)
        if victims and self.on_removed is not None:
            self.on_removed(victims)

    def discard(self, block_hash: int) -> None:
        with self.lock:
            self.stats.usage_bytes -= self.index.pop(block_hash, 0)
        self._unlink(block_hash)

    def _unlink(self, block_hash: int) -> None:
        try:
            os.unlink(self._path(block_hash))
        except OSError:
            pass


class RedisTier(BlobTier):
    """A store shared by workers: Redis keys `sluice:kv:<namespace>:<hash>` (SET NX, an
    optional TTL; bound the bytes with Redis's own `maxmemory` + an LRU policy).

    Unreachable or slow (timeouts of `timeout` s): the call counts an error, logs, and
    the tier is skipped for `retry_after` s, so a dead store costs one timeout, not one
    per block."""

    medium = "REDIS"

    def __init__(self, url: str, namespace: str, timeout: float = 0.5,
                 retry_after: float = 5.0, ttl: int | None = None) -> None:
        import redis

        super().__init__(namespace)
        self.url = url
        # 1 MiB a socket read (redis-py reads 64 KiB): a 16-block MGET is ~6 MB, and on a
        # busy worker each read waits for the GIL
        self.client = redis.Redis.from_url(url, socket_timeout=timeout,
                                           socket_connect_timeout=timeout,
                                           socket_read_size=1 << 20)
        self.errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.retry_after = retry_after
        self.ttl = ttl
        self.down_until = 0.0

    def _key(self, block_hash: int) -> str:
        return f"sluice:kv:{self.namespace}:{block_hash & 0xFFFFFFFFFFFFFFFF:016x}"

    def _call(self, fn: Callable[[], Any]) -> Any:
        if time.monotonic() < self.down_until:
            return None
        try:
            return fn()
        except self.errors as exc:
            self.stats.errors += 1
            self.down_until = time.monotonic() + self.retry_after
            log.warning("kv offload: store %s unreachable (%s); recomputing, retrying in "
                        "%.0f s", self.url, exc, self.retry_after)
            return None

    def contains(self, block_hash: int) -> bool:
        return bool(self._call(lambda: self.client.exists(self._key(block_hash))))

    def read(self, block_hash: int) -> bytes | None:
        blob = self._call(lambda: self.client.get(self._key(block_hash)))
        return blob if isinstance(blob, bytes) else None

    def write(self, block_hash: int, blob: bytes) -> None:
        self.write_many([(block_hash, blob)])

    def read_many(self, hashes: Sequence[int]) -> list[bytes | None]:
        """One MGET: a chain of blocks costs one round trip, not one per block."""
        blobs = self._call(lambda: self.client.mget([self._key(h) for h in hashes]))
        if not isinstance(blobs, list):
            return [None] * len(hashes)
        return [b if isinstance(b, bytes) else None for b in blobs]

    def write_many(self, items: Sequence[tuple[int, bytes]]) -> list[bool]:
        """SET NX of each blob (with the TTL) in one pipelined round trip, after one
        EXISTS round trip, so a block another worker stored is not sent again."""
        keys = [self._key(h) for h, _ in items]

        def held() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return pipe.execute()

        def store(todo: list[int]) -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for i in todo:
                pipe.set(keys[i], items[i][1], nx=True, ex=self.ttl)
            return pipe.execute()

        exists = self._call(held)
        if not isinstance(exists, list):
            return [False] * len(items)
        todo = [i for i, e in enumerate(exists) if not e]
        done = self._call(lambda: store(todo)) if todo else []
        out = [False] * len(items)
        for i, ok in zip(todo, done if isinstance(done, list) else [], strict=False):
            if ok:
                out[i] = True
                self.stats.blocks_stored += 1
                self.stats.bytes_stored += len(items[i][1])
        return out

    def discard(self, block_hash: int) -> None:
        self._call(lambda: self.client.delete(self._key(block_hash)))


# -- the pool side -----------------------------------------------------------------------
class PoolAccess:
    """Copies whole blocks (all layers, K and V) out of and into the KV pool.

    `caches` are the layers' (K, V) pools `[num_blocks, block_size, kv_heads, head_dim]`
    on any device; the copies out land in host memory (`torch.device("cpu")`)."""

    def __init__(self, caches: Sequence[tuple[Tensor, Tensor]]) -> None:
        self.caches = list(caches)
        k = self.caches[0][0]
        self.block_shape = (2, len(self.caches), *k.shape[1:])
        self.dtype = k.dtype
        self.device = k.device
        self.block_bytes = _numel(list(self.block_shape)) * k.element_size()

    def read(self, block_ids: Sequence[int]) -> Tensor:
        """`[n, 2, layers, block_size, kv_heads, head_dim]` copies, on the CPU."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        out = torch.empty((len(block_ids), *self.block_shape), dtype=self.dtype)
        for layer, (k, v) in enumerate(self.caches):
            out[:, 0, layer].copy_(k.index_select(0, ids))
            out[:, 1, layer].copy_(v.index_select(0, ids))
        return out

    def write(self, block_ids: Sequence[int], kv: Tensor) -> None:
        """Copy `kv` `[n, 2, layers, ...]` into the pool's blocks `block_ids` (mutates)."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        kv = kv.to(self.device, non_blocking=True)
        for layer, (k, v) in enumerate(self.caches):
            k.index_copy_(0, ids, kv[:, 0, layer])
            v.index_copy_(0, ids, kv[:, 1, layer])


def pool_namespace(model: str, dtype: torch.dtype, block_shape: tuple[int, ...]) -> str:
    """A digest of what makes blocks interchangeable between pools (16 hex digits)."""
    text = json.dumps([model, str(dtype), list(block_shape)])
    return sha256(text.encode()).hexdigest()[:16]


# -- the manager -----------------------------------------------------------------------
@dataclass
class CostModel:
    """Measured costs, as moving averages: the engine's prefill seconds per token and each
    tier's seconds per loaded block. Loading a block is worth it when it is predicted
    faster than recomputing its `block_size` tokens; a tier not yet measured is tried."""

    block_size: int
    prefill_s_per_token: float | None = None
    load_s_per_block: dict[str, float] = field(default_factory=dict)
    alpha: float = 0.2
    probe_every: int = 64
    skipped: dict[str, int] = field(default_factory=dict)

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        self.prefill_s_per_token = self._avg(self.prefill_s_per_token, seconds / tokens)

    def observe_load(self, medium: str, seconds: float, blocks: int) -> None:
        self.load_s_per_block[medium] = self._avg(self.load_s_per_block.get(medium),
                                                  seconds / blocks)

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def worth_loading(self, medium: str) -> bool:
        """Whether to ask `medium` for a block. A tier measured slower than recomputing
        is still asked once every `probe_every` blocks, so its estimate can recover."""
        load = self.load_s_per_block.get(medium)
        if load is None or self.prefill_s_per_token is None:
            return True
        if load < self.prefill_s_per_token * self.block_size:
            return True
        self.skipped[medium] = self.skipped.get(medium, 0) + 1
        return self.skipped[medium] % self.probe_every == 0


@dataclass(frozen=True, slots=True)
class Evicted:
    """A cached block leaving the pool (or newly cached): where it is and what it holds."""

    block_id: int
    block_hash: int
    token_ids: tuple[int, ...]


class KVOffloadManager:
    """The tiers under one pool, in lookup order (host, disk, store), the writer thread
    that writes newly cached blocks through to disk and the store, and the fetcher
    thread that reads them back ahead of their request:

        lookup misses the pool ──► host tier (engine thread, ~0.1 ms a block: in line)
                               └─► prefetch(rest of chain) ──► fetcher: disk, store
            the request waits (others run); its next lookup finds the staged blocks

    Engine thread: `save_evicted`, `write_through`, `find`, `prefetch`, `load`. The
    writer only calls the blob tiers' `write_many` (thread-safe) on copies it owns; the
    fetcher their `get_many`; both `batch_blocks` blocks a call, so a remote store costs
    a round trip per batch, not per block (per block, each trip also waited for the busy
    engine thread, and the store measured slower than recomputing). Staging and the
    queued-block count are under `_lock`."""

    def __init__(self, pool: PoolAccess, block_size: int, host: HostTier | None = None,
                 blob_tiers: Sequence[BlobTier] = (), queue_blocks: int = 256,
                 max_staged: int = 1024, batch_blocks: int = 16) -> None:
        self.pool = pool
        self.host = host
        self.blob_tiers = list(blob_tiers)
        self.tiers: list[KVTier] = [host] if host is not None else []
        self.tiers.extend(self.blob_tiers)
        self.cost = CostModel(block_size)
        # KV events with their medium (vLLM's BlockStored/BlockRemoved `medium`), appended
        # from the engine thread and the writer thread (a deque: thread-safe appends).
        self.events: deque[KVEvent] | None = None
        if host is not None:
            host.on_removed = lambda hashes: self._removed(hashes, HostTier.medium)
        for tier in self.blob_tiers:
            if isinstance(tier, DiskTier):
                tier.on_removed = lambda hashes, m=tier.medium: self._removed(hashes, m)
        self.write_drops = 0  # blocks not written through (the writer was behind)
        self.prefetch_absent = 0  # pool misses whose next block no blob tier held
        self.prefetch_waits = 0  # pool misses that waited for a fetch
        self.fetch_misses = 0  # of those, fetches that got not even the first block
        self._pending_load_s: dict[str, float] = {}  # last fetch time per tier
        # batches of newly cached blocks for the writer; blocks in them (`_lock`)
        self._queue: queue.Queue[list[tuple[int, StoredBlock]] | None] = queue.Queue()
        self.queue_blocks = queue_blocks
        self._queued_blocks = 0
        self.batches_written = 0  # the writer's finished batches: stats an idle core resends
        self._writer: threading.Thread | None = None
        # blocks fetched from the disk tier and the store, waiting for their request's
        # next lookup; blocks being fetched; first blocks of chains that missed lately
        self._lock = threading.Lock()
        self._staged: OrderedDict[int, tuple[KVTier, StoredBlock]] = OrderedDict()
        self._pending: set[int] = set()
        self._missed: OrderedDict[int, float] = OrderedDict()
        # chains fetched so far, and that count when a request last decided to wait
        # (`wait` wakes when it moved on): the engine thread blocks instead of spinning
        self._done = threading.Condition(self._lock)
        self._fetches_done = 0
        self._seen: int | None = None
        self.max_staged = max_staged
        self.batch_blocks = batch_blocks  # blocks a store round trip reads or writes
        self.missed_ttl = 10.0
        self._fetch_queue: queue.Queue[list[tuple[int, tuple[int, ...]]] | None] = queue.Queue()
        self._fetcher: threading.Thread | None = None
        if self.blob_tiers:
            self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer",
                                            daemon=True)
            self._writer.start()
            self._fetcher = threading.Thread(target=self._fetch_loop, name="kv-offload-fetcher",
                                             daemon=True)
            self._fetcher.start()

    # -- down the tiers --------------------------------------------------------------
    def save_evicted(self, evicted: Sequence[Evicted]) -> None:
        """Copy blocks leaving the pool into the host tier (before they are overwritten)."""
        if self.host is None or not evicted:
            return
        todo = [e for e in evicted if not self.host.contains(e.block_hash)]
        if not todo:
            return
        kv = self.pool.read([e.block_id for e in todo])
        for i, e in enumerate(todo):  # a copy each: one block may outlive its batch's others
            self.host.put(e.block_hash, StoredBlock(e.token_ids, kv[i].clone()))
            self._stored(e.block_hash, e.token_ids, self.host.medium)

    def _stored(self, block_hash: int, token_ids: tuple[int, ...], medium: str) -> None:
        if self.events is not None:
            self.events.append(BlockStored([block_hash], None, list(token_ids),
                                           len(token_ids), medium=medium))

    def _removed(self, hashes: list[int], medium: str) -> None:
        if self.events is not None:
            self.events.append(BlockRemoved(hashes, medium=medium))

    def write_through(self, cached: Sequence[Evicted]) -> None:
        """Queue newly cached blocks (one step's, as one batch) for the disk tier and the
        store. At most `queue_blocks` blocks wait: past that the batch's tail is dropped,
        counted in `write_drops` (those blocks stay in the pool and the host tier)."""
        if not self.blob_tiers or not cached:
            return
        with self._lock:
            room = min(len(cached), self.queue_blocks - self._queued_blocks)
            self._queued_blocks += max(room, 0)
        self.write_drops += len(cached) - max(room, 0)
        if room <= 0:
            return
        kv = self.pool.read([c.block_id for c in cached[:room]])
        self._queue.put([(c.block_hash, StoredBlock(c.token_ids, kv[i]))
                         for i, c in enumerate(cached[:room])])

    def _write_loop(self) -> None:
        """Write each queued batch, `batch_blocks` blocks a call (a store's round trips
        are per call, not per block), until the None that `close` queues."""
        while (blocks := self._queue.get()) is not None:
            for i in range(0, len(blocks), self.batch_blocks):
                self._write(blocks[i:i + self.batch_blocks])
            with self._lock:
                self._queued_blocks -= len(blocks)
                self.batches_written += 1
            self._queue.task_done()

    def _write(self, blocks: list[tuple[int, StoredBlock]]) -> None:
        for tier in self.blob_tiers:
            blobs = [(h, encode_block(tier.namespace, h, b)) for h, b in blocks]
            for (h, b), stored in zip(blocks, tier.write_many(blobs), strict=True):
                if stored:
                    self._stored(h, b.token_ids, tier.medium)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until queued writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        """Stop the fetcher and the writer, after the writes already queued."""
        for thread, q in ((self._fetcher, self._fetch_queue), (self._writer, self._queue)):
            if thread is not None:
                q.put(None)  # type: ignore[arg-type]
                thread.join(timeout=10.0)
        self._fetcher = self._writer = None

    # -- back up -------------------------------------------------------------------
    def find(self, block_hash: int, token_ids: tuple[int, ...]) -> tuple[KVTier, StoredBlock] | None:
        """This block from the host tier or from what the fetcher staged (engine thread,
        never waits on a disk or a store: `prefetch` asks those)."""
        with self._lock:
            staged = self._staged.pop(block_hash, None)
        if staged is not None and staged[1].token_ids == token_ids:
            return staged
        return self._fetch([self.host] if self.host is not None else [], block_hash, token_ids)

    def _fetch(self, tiers: Sequence[KVTier], block_hash: int,
               token_ids: tuple[int, ...]) -> tuple[KVTier, StoredBlock] | None:
        """The first of `tiers` holding this block with these tokens, where loading pays."""
        for tier in tiers:
            if not self.cost.worth_loading(tier.medium):
                continue
            tier.stats.queries += 1
            start = time.perf_counter()
            block = tier.get(block_hash)
            if not self._usable(tier, block, token_ids):
                continue
            assert block is not None
            self._observe(tier, block, time.perf_counter() - start)
            return tier, block
        return None

    def _usable(self, tier: KVTier, block: StoredBlock | None,
                token_ids: tuple[int, ...]) -> bool:
        """`block` holds these tokens in the pool's block shape and dtype (a wrong shape or
        dtype counts as an error of `tier`)."""
        if block is None or block.token_ids != token_ids:
            return False
        if tuple(block.kv.shape) != self.pool.block_shape or block.kv.dtype != self.pool.dtype:
            tier.stats.errors += 1
            return False
        return True

    def fetching(self, chain: Sequence[tuple[int, tuple[int, ...]]]) -> bool:
        """Whether the fetcher is still reading a block of `chain`."""
        with self._lock:
            waits = bool(self._pending) and any(h in self._pending for h, _ in chain)
            if waits and self._seen is None:
                self._seen = self._fetches_done
            return waits

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` s until a fetch finishes that a request decided to wait
        for (`fetching`, `prefetch`) since the last `wait`; at once when none is running.
        Returns whether one finished. An idle core waiting only on fetches must not
        spin: its loop holds the GIL that the fetcher needs for every socket read, and a
        16-block fetch measured ~30 ms a block, slower than recomputing."""
        with self._done:
            seen, self._seen = self._seen, None
            if seen is None or not self._pending:
                return seen is not None and seen != self._fetches_done
            return self._done.wait_for(lambda: self._fetches_done != seen, timeout)

    def prefetch(self, chain: Sequence[tuple[int, tuple[int, ...]]]) -> bool:
        """Ask the disk tier and the store, on the fetcher thread, for `chain` (hash,
        tokens) from its first block on, staging what they hold until the first miss.
        Returns whether the request should wait: a fetch of `chain[0]` is running or
        was just started; False when no tier holds `chain[0]`, or a fetch of it failed
        lately (held but unusable: every `missed_ttl` s it is tried again)."""
        if not self.blob_tiers or not chain:
            return False
        first = chain[0][0]
        now = time.monotonic()
        with self._lock:
            if first in self._pending or first in self._staged:  # staged since `find`
                return True
            if now - self._missed.get(first, -1e9) < self.missed_ttl:
                return False
        # a request waits only for a chain some tier holds the start of (a file's name, a
        # key's EXISTS): a new prefix never queues behind another request's fetch
        if not any(t.contains(first) for t in self.blob_tiers):
            self.prefetch_absent += 1
            return False
        self.prefetch_waits += 1
        with self._lock:
            self._pending.update(h for h, _ in chain)
            if self._seen is None:
                self._seen = self._fetches_done
        self._fetch_queue.put(list(chain))
        return True

    def _miss(self, block_hash: int) -> None:
        with self._lock:
            self._missed[block_hash] = time.monotonic()
            while len(self._missed) > 4096:
                self._missed.popitem(last=False)

    def _fetch_loop(self) -> None:
        while (chain := self._fetch_queue.get()) is not None:
            done = 0
            while done < len(chain):  # `batch_blocks` a round trip, to the first miss
                batch = chain[done:done + self.batch_blocks]
                got = self._fetch_run(batch)
                with self._lock:  # staged, then no longer pending: a lookup sees one
                    for (block_hash, _), found in zip(batch, got, strict=False):
                        self._staged[block_hash] = found
                        self._pending.discard(block_hash)
                    while len(self._staged) > self.max_staged:
                        self._staged.popitem(last=False)
                done += len(got)
                if len(got) < len(batch):
                    break
            if done == 0:  # held (`contains` said so) but unusable, or not worth loading
                self.fetch_misses += 1
                self._miss(chain[0][0])
            with self._done:
                self._pending.difference_update(h for h, _ in chain)
                self._fetches_done += 1
                self._done.notify_all()

    def _fetch_run(self, batch: Sequence[tuple[int, tuple[int, ...]]]
                   ) -> list[tuple[KVTier, StoredBlock]]:
        """The leading blocks of `batch` (hash, tokens) that the blob tiers hold with
        these tokens: each tier, in order, is asked in one `get_many` for the blocks the
        tiers before it lacked. Its measured time per block is that call's time shared
        out to the blocks it gave."""
        out: list[tuple[KVTier, StoredBlock]] = []
        for tier in self.blob_tiers:
            rest = batch[len(out):]
            if not rest:
                break
            if not self.cost.worth_loading(tier.medium):
                continue
            start = time.perf_counter()
            blocks = tier.get_many([h for h, _ in rest])
            got = 0
            for (_, token_ids), block in zip(rest, blocks, strict=True):
                if not self._usable(tier, block, token_ids):
                    break
                assert block is not None
                out.append((tier, block))
                got += 1
            tier.stats.queries += got + (got < len(rest))
            seconds = (time.perf_counter() - start) / max(got, 1)
            for _, block in out[len(out) - got:]:
                self._observe(tier, block, seconds)
        return out

    def _observe(self, tier: KVTier, block: StoredBlock, seconds: float) -> None:
        tier.stats.hits += 1
        tier.stats.bytes_loaded += block.nbytes
        tier.stats.load_seconds += seconds
        self._pending_load_s[tier.medium] = seconds

    def load(self, block_ids: Sequence[int],
             found: Sequence[tuple[KVTier, StoredBlock]]) -> None:
        """Copy found blocks into pool blocks `block_ids` (mutates the pool); the copy's
        time is shared out to the blocks' tiers, whose per-block cost it updates."""
        if not block_ids:
            return
        start = time.perf_counter()
        self.pool.write(block_ids, torch.stack([b.kv for _, b in found]))
        share = (time.perf_counter() - start) / len(block_ids)
        for tier, _ in found:
            tier.stats.load_seconds += share
            fetch = self._pending_load_s.get(tier.medium, 0.0)
            self.cost.observe_load(tier.medium, fetch + share, 1)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per medium: TierStats, plus tokens hit / queried and the measured load time of
        a block (0 before the first load); "ENGINE": the prefill time it must beat."""
        out = {tier.medium: tier.stats.as_dict() for tier in self.tiers}
        bs = self.cost.block_size
        for tier in self.tiers:
            row = out[tier.medium]
            row["hit_tokens"], row["query_tokens"] = row["hits"] * bs, row["queries"] * bs
            row["load_s_per_block"] = self.cost.load_s_per_block.get(tier.medium, 0.0)
            row["skipped"] = float(self.cost.skipped.get(tier.medium, 0))
        out["ENGINE"] = {"prefill_s_per_block": (self.cost.prefill_s_per_token or 0.0) * bs,
                         "write_drops": float(self.write_drops),
                         "prefetch_absent": float(self.prefetch_absent),
                         "prefetch_waits": float(self.prefetch_waits),
                         "fetch_misses": float(self.fetch_misses)}
        return out


def build_offload(offload: str | None, store: str | None, model: str, block_size: int,
                  layers: Any) -> KVOffloadManager | None:
    """The tiers `--kv-offload` and `--kv-store` ask for over the pool of `layers` (each
    with `attention.kv_cache.k/.v`), or None."""
    if offload is None and store is None:
        return None
    spec = KVOffloadSpec.parse(offload) if offload else KVOffloadSpec()
    pool = PoolAccess([(layer.attention.kv_cache.k, layer.attention.kv_cache.v)
                       for layer in layers])
    namespace = pool_namespace(model, pool.dtype, pool.block_shape)
    host = HostTier(spec.host_bytes) if spec.host_bytes else None
    blob: list[BlobTier] = []
    if spec.disk_dir is not None:
        blob.append(DiskTier(spec.disk_dir, spec.disk_bytes, namespace))
    if store is not None:
        check_store_url(store)
        blob.append(RedisTier(store, namespace))
    log.info("kv offload: host %d bytes, disk %s, store %s (namespace %s, %d bytes a block)",
             spec.host_bytes, spec.disk_dir, store, namespace, pool.block_bytes)
    return KVOffloadManager(pool, block_size, host, blob)
