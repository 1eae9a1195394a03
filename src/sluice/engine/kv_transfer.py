"""Prefill/decode disaggregation: a finished prefill's KV blocks, held by the prefill
engine under a lease, pulled by a decode engine into its own pool (vLLM's
`kv_transfer_params` protocol; the router carries the params between the two).

    prefill engine (do_remote_decode)               decode engine (do_remote_prefill)
    prompt computed, one token sampled
    on_finished: hold the prompt's full blocks      start: the chain of the prompt's full
      (one more ref each; a lease of 30 s)            blocks; those not cached here are
      params {remote_host, remote_port,               pulled on a thread; the request waits,
      remote_block_ids, remote_request_id} ──────►    the others keep running
    TransferServer (thread, TCP)  ◄── pull(ids) ──  TCPConnector.pull
      lease extended; blocks read from the pool,
      encoded (kv_offload's self-checking blob) ──►   each blob checked: namespace (model,
                                   ◄── done ──        dtype, block shape), hash, tokens
      the lease ends; the blocks stay cached        poll (engine thread): install them in
    tick: leases past their TTL end the same way      free blocks as prefix-cache entries
                                                      (BlockStored); the request is queued,
                                                      hits them and computes the rest: at
                                                      least the last prompt token, whose
                                                      logits give the first output token.

Only full blocks travel, and only those the decode side can use: a prompt of P tokens
hands over (P - 1) // block_size blocks, the prefix-cache lookup's own limit, so the
decode engine computes 1..block_size tokens itself, as it would after a prefix hit.
Blocks the decode engine already caches are not pulled (its `remote_block_ids` are the
prefill engine's ids for blocks 0, 1, ...; it asks for the missing suffix).

A pull that fails (connection refused, timeout, unknown or expired lease, a blob that
fails its checks, another model, dtype or block size) is counted by reason and, under
`kv_load_failure_policy=recompute`, the request computes its whole prompt locally (the
same output); under `fail` it ends with `KVTransferError` (503, code
`kv_transfer_failed`, param `kv_transfer_params`).

`KVConnector` is the seam where a GPU transport (NIXL, LMCache, P2P NCCL) would plug in:
the engine calls `publish` (prefill side) and `start_pull` / `release` /
`finished_pulls` / `wait` (decode side) and never sees sockets. `TCPConnector` is the one here: a
threaded TCP server in the engine core's process and one short-lived connection per pull.

Threads: the engine thread owns the block manager and the pool writes; the server's
threads read the pool (held blocks only: nothing writes them while the lease pins them)
and the lease table (locked); pull threads only touch sockets and their own buffers.
"""

from __future__ import annotations

import bisect
import logging
import queue
import socket
import socketserver
import struct
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from sluice.engine.config import KVTransferConfig
from sluice.engine.kv_offload import (
    CorruptBlock,
    PoolAccess,
    StoredBlock,
    decode_block,
    encode_block_parts,
    pool_namespace,
)
from sluice.protocol.block_hash import hash_block
from sluice.protocol.errors import SluiceError

if TYPE_CHECKING:
    from sluice.engine.block_manager import BlockManager
    from sluice.engine.sequence import Sequence as Seq

log = logging.getLogger("sluice.engine.kv_transfer")

# decode-side pull time (sluice:kv_transfer_seconds), seconds
PULL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FAILURE_REASONS = ("connect", "timeout", "lease", "mismatch", "corrupt", "protocol",
                   "no_prefix_cache")

Chain = list[tuple[int, tuple[int, ...]]]  # (block hash, token ids) of consecutive blocks


class KVTransferError(SluiceError):
    """Pulling a prefill's KV failed and kv_load_failure_policy is `fail` (or, inside
    the engine, any pull failure: `reason` is one of FAILURE_REASONS)."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "kv_transfer_failed"

    def __init__(self, message: str, reason: str = "protocol") -> None:
        super().__init__(message, param="kv_transfer_params", headers={"Retry-After": "1"})
        self.reason = reason


# -- what makes two pools' blocks interchangeable -----------------------------------------
@dataclass(frozen=True)
class PoolIdentity:
    """Model, dtype and block shape `[2, layers, block_size, kv_heads, head_dim]`."""

    model: str
    dtype: str
    block_shape: tuple[int, ...]

    @classmethod
    def of(cls, model: str, pool: PoolAccess) -> PoolIdentity:
        return cls(model, str(pool.dtype).removeprefix("torch."), tuple(pool.block_shape))

    @property
    def block_size(self) -> int:
        return self.block_shape[2]

    @property
    def namespace(self) -> str:
        return pool_namespace(self.model, getattr(torch, self.dtype), self.block_shape)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "block_shape": list(self.block_shape)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolIdentity:
        return cls(str(d["model"]), str(d["dtype"]), tuple(int(x) for x in d["block_shape"]))

    def mismatch(self, other: PoolIdentity) -> str | None:
        """None when `other`'s blocks fit this pool, else what differs, in words."""
        ours, theirs = self.as_dict(), other.as_dict()
        ours["block_size"], theirs["block_size"] = self.block_size, other.block_size
        diffs = [f"{k} {theirs[k]!r} there, {ours[k]!r} here" for k in
                 ("model", "dtype", "block_size", "block_shape") if ours[k] != theirs[k]]
        if not diffs:
            return None
        return ("the prefill engine's KV blocks do not fit this engine (same model, dtype "
                "and block size needed): " + "; ".join(diffs))


# -- counters -----------------------------------------------------------------------------
class TransferStats:
    """Cumulative transfer counters, the held-block gauge and the pull-time histogram;
    updated from the engine, server and pull threads (locked)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = {"bytes_sent": 0, "blocks_sent": 0, "bytes_received": 0,
                       "blocks_received": 0, "held_blocks": 0}
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)
        self.buckets = [0] * len(PULL_BUCKETS)
        self.seconds_sum = 0.0
        self.seconds_count = 0

    def add(self, **counts: int) -> None:
        with self._lock:
            for key, n in counts.items():
                self.counts[key] += n

    def failure(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] = self.failures.get(reason, 0) + 1

    def observe_pull(self, seconds: float) -> None:
        with self._lock:
            i = bisect.bisect_left(PULL_BUCKETS, seconds)
            if i < len(self.buckets):
                self.buckets[i] += 1
            self.seconds_sum += seconds
            self.seconds_count += 1

    def as_dict(self) -> dict[str, float]:
        """Flat: the counts, `failure:<reason>`, `le:<bound>` (cumulative), `seconds_sum`,
        `seconds_count` (EngineStats.kv_transfer; the worker turns it into metrics)."""
        with self._lock:
            out = {k: float(v) for k, v in self.counts.items()}
            out.update({f"failure:{k}": float(v) for k, v in self.failures.items()})
            total = 0
            for bound, n in zip(PULL_BUCKETS, self.buckets, strict=True):
                total += n
                out[f"le:{bound}"] = float(total)
            out["seconds_sum"], out["seconds_count"] = self.seconds_sum, float(self.seconds_count)
        return out


# -- leases (prefill side) -----------------------------------------------------------------
@dataclass
class Lease:
    """Blocks a finished prefill holds for a decode engine, until `done` or `expires`."""

    request_id: str
    block_ids: list[int]
    chain: Chain
    expires: float
    pins: int = 0  # pulls reading the blocks now: the lease cannot end under them
    done: bool = False


class LeaseError(Exception):
    """A pull named a lease that is unknown, expired or over, or blocks it does not hold."""


class LeaseTable:
    """Leases by request id (engine thread adds and ends them, server threads pin them)."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}

    def add(self, request_id: str, block_ids: list[int], chain: Chain) -> Lease:
        lease = Lease(request_id, block_ids, chain, self.clock() + self.timeout)
        with self._lock:
            self._leases[request_id] = lease
        return lease

    def pin(self, request_id: str, block_ids: Sequence[int]) -> Chain:
        """The (hash, tokens) of `block_ids` under the lease, which is extended by a full
        timeout and pinned until `unpin`; LeaseError if it cannot serve them."""
        with self._lock:
            lease = self._leases.get(request_id)
            now = self.clock()
            if lease is None or lease.done or now > lease.expires:
                raise LeaseError(f"no KV held for request {request_id!r} (unknown, already "
                                 "pulled, or its lease expired)")
            where = {b: i for i, b in enumerate(lease.block_ids)}
            if any(b not in where for b in block_ids):
                raise LeaseError(f"request {request_id!r} holds no such blocks {list(block_ids)}")
            lease.expires = max(lease.expires, now + self.timeout)
            lease.pins += 1
            return [lease.chain[where[b]] for b in block_ids]

    def unpin(self, request_id: str) -> None:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.pins -= 1

    def finish(self, request_id: str) -> bool:
        """The decode side has the blocks: end the lease at the next `due`."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            lease.done = True
            return True

    def due(self) -> list[Lease]:
        """Remove and return the leases that are over (done or expired) and unpinned."""
        now = self.clock()
        with self._lock:
            over = [lease for lease in self._leases.values()
                    if lease.pins == 0 and (lease.done or now > lease.expires)]
            for lease in over:
                del self._leases[lease.request_id]
        return over

    def held_blocks(self) -> int:
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._leases.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)


# -- the connector seam ----------------------------------------------------------------------
@dataclass
class PullJob:
    """What a decode engine fetches: `block_ids` of the prefill engine's lease
    `remote_request_id`, expected to hold `chain` (chained on `parent`)."""

    request_id: str
    params: dict[str, Any]
    block_ids: list[int]
    chain: Chain
    parent: int | None
    lora_id: int | None = None
    prefix: Chain = field(default_factory=list)  # the blocks before `chain`, cached here
    started: float = field(default_factory=time.perf_counter)


@dataclass
class PullResult:
    request_id: str
    blocks: list[StoredBlock] | None  # in `chain` order; None on failure
    error: KVTransferError | None = None
    nbytes: int = 0
    seconds: float = 0.0


class KVConnector(ABC):
    """How KV leaves a prefill engine and reaches a decode engine.

    Contract: every method is called from the engine thread except where noted.
    `publish` makes a held lease reachable and returns the `kv_transfer_params` of the
    prefill response (None: it cannot be served; the caller releases the blocks).
    `start_pull` must not block: the job runs elsewhere and its `PullResult` comes
    back from `finished_pulls`; `wait` blocks up to `timeout` for one. A result's
    blocks are checked (namespace, hash, tokens) before they are returned. `close`
    stops any thread or server and is idempotent.
    """

    def __init__(self, config: KVTransferConfig, identity: PoolIdentity, leases: LeaseTable,
                 read: Callable[[list[int]], torch.Tensor], stats: TransferStats) -> None:
        self.config = config
        self.identity = identity
        self.leases = leases
        self.read = read  # pool block ids -> [n, 2, layers, ...] host copies (thread-safe)
        self.stats = stats
        self.engine_id = f"sluice-{uuid.uuid4().hex[:16]}"

    @abstractmethod
    def publish(self, lease: Lease) -> dict[str, Any] | None: ...

    @abstractmethod
    def start_pull(self, job: PullJob) -> None: ...

    @abstractmethod
    def release(self, params: dict[str, Any]) -> None:
        """The decode side caches every block of `params`' lease: end it without a pull
        (the prefill side frees them now, not at its TTL). Must not block; a failure
        only costs the prefill side its lease timeout."""

    @abstractmethod
    def finished_pulls(self) -> list[PullResult]: ...

    @abstractmethod
    def wait(self, timeout: float) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


# -- the TCP connector's wire ----------------------------------------------------------------
# message: <u32 header length><u64 payload length> msgpack header, payload bytes
_FRAME = struct.Struct("<IQ")
MAX_HEADER = 1 << 24


def send_message(sock: socket.socket, header: dict[str, Any],
                 payload: Sequence[bytes | memoryview] = ()) -> None:
    head = msgpack.packb(header, use_bin_type=True)
    sock.sendall(_FRAME.pack(len(head), sum(len(p) for p in payload)) + head)
    for part in payload:
        sock.sendall(part)


def recv_message(sock: socket.socket, max_payload: int = 1 << 34,
                 deadline: float | None = None) -> tuple[dict[str, Any], memoryview]:
    """One message; EOFError if the peer closed first, ValueError if it is malformed,
    TimeoutError past `deadline` (time.monotonic; None: the socket's own timeout per
    read, so a peer that trickles bytes could hold it for ever)."""
    head_len, payload_len = _FRAME.unpack(_recv_exact(sock, _FRAME.size, deadline))
    if head_len > MAX_HEADER or payload_len > max_payload:
        raise ValueError("KV transfer message too large")
    header = msgpack.unpackb(_recv_exact(sock, head_len, deadline), raw=False,
                             strict_map_key=False)
    if not isinstance(header, dict):
        raise ValueError("KV transfer header is not a map")
    return header, memoryview(_recv_exact(sock, payload_len, deadline))


def _until(sock: socket.socket, deadline: float | None) -> None:
    """Give the socket's next call what is left before `deadline`."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("KV transfer deadline passed")
        sock.settimeout(left)


def _end_lease(sock: socket.socket, request_id: str, deadline: float) -> None:
    """Tell the prefill side its lease on `request_id`'s blocks is over (`done`), and
    wait for its answer, both before `deadline`."""
    _until(sock, deadline)
    send_message(sock, {"op": "done", "request_id": request_id})
    recv_message(sock, max_payload=0, deadline=deadline)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        _until(sock, deadline)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the KV transfer peer closed the connection")
        got += k
    return buf


class TransferServer(socketserver.ThreadingTCPServer):
    """The prefill side: serves held blocks to decode engines (one thread per connection).

        pull {request_id, block_ids, identity} -> {ok, identity, hashes, sizes} + blobs
        done {request_id}                      -> {ok}       (the lease ends)
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, connector: TCPConnector, host: str, port: int) -> None:
        self.connector = connector
        super().__init__((host, port), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, name="kv-transfer-server",
                                       daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def answer(self, header: dict[str, Any]
               ) -> tuple[dict[str, Any], list[bytes | memoryview]]:
        op = header.get("op")
        if op == "done":
            return {"ok": self.connector.leases.finish(str(header.get("request_id")))}, []
        if op != "pull":
            return {"ok": False, "reason": "protocol", "message": f"unknown op {op!r}"}, []
        return self._pull(header)

    def _pull(self, header: dict[str, Any]
              ) -> tuple[dict[str, Any], list[bytes | memoryview]]:
        c = self.connector
        ours = c.identity.as_dict()
        try:
            theirs = PoolIdentity.from_dict(header["identity"])
            request_id, block_ids = str(header["request_id"]), [int(b) for b in
                                                                 header["block_ids"]]
        except (KeyError, TypeError, ValueError) as exc:
            return {"ok": False, "reason": "protocol", "message": f"bad pull: {exc}"}, []
        if (why := theirs.mismatch(c.identity)) is not None:
            return {"ok": False, "reason": "mismatch", "message": why, "identity": ours}, []
        try:
            chain = c.leases.pin(request_id, block_ids)
        except LeaseError as exc:
            return {"ok": False, "reason": "lease", "message": str(exc)}, []
        try:
            kv = c.read(block_ids) if block_ids else None
            ns = c.identity.namespace
            blobs = [encode_block_parts(ns, h, StoredBlock(tokens, kv[i]))  # type: ignore[index]
                     for i, (h, tokens) in enumerate(chain)]
        finally:
            c.leases.unpin(request_id)
        sizes = [sum(len(part) for part in parts) for parts in blobs]
        c.stats.add(bytes_sent=sum(sizes), blocks_sent=len(blobs))
        return {"ok": True, "identity": ours, "hashes": [h for h, _ in chain],
                "sizes": sizes}, [part for parts in blobs for part in parts]


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: TransferServer = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        timeout = server.connector.config.kv_transfer_timeout
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:  # each message within the timeout, however its bytes arrive
                header, _ = recv_message(sock, max_payload=0,
                                         deadline=time.monotonic() + timeout)
                reply, blobs = server.answer(header)
                sock.settimeout(timeout)
                send_message(sock, reply, blobs)
            except (EOFError, OSError, ValueError):
                return


class TCPConnector(KVConnector):
    """KV over TCP: a `TransferServer` started on the first `publish` (host and port
    from the config; port 0 picks a free one), a daemon thread per pull."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server: TransferServer | None = None
        self._results: queue.Queue[PullResult] = queue.Queue()
        self._closed = False

    def publish(self, lease: Lease) -> dict[str, Any] | None:
        if self.server is None:
            try:
                self.server = TransferServer(self, self.config.kv_transfer_host,
                                             self.config.kv_transfer_port)
            except OSError as exc:
                log.error("kv transfer: cannot listen on %s:%d (%s); prefills are not "
                          "handed off", self.config.kv_transfer_host,
                          self.config.kv_transfer_port, exc)
                return None
            log.info("kv transfer: serving held KV on %s:%d (engine %s)",
                     self.config.kv_transfer_host, self.server.port, self.engine_id)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_block_ids": list(lease.block_ids),
                "remote_host": self.config.kv_transfer_host, "remote_port": self.server.port,
                "remote_request_id": lease.request_id, "tp_size": 1}

    def start_pull(self, job: PullJob) -> None:
        threading.Thread(target=self._run, args=(job,), name="kv-transfer-pull",
                         daemon=True).start()

    def release(self, params: dict[str, Any]) -> None:
        threading.Thread(target=self._release, args=(params,), name="kv-transfer-release",
                         daemon=True).start()

    def _release(self, params: dict[str, Any]) -> None:
        where = f"{params.get('remote_host')}:{params.get('remote_port')}"
        timeout = self.config.kv_transfer_timeout
        deadline = time.monotonic() + timeout
        try:
            with socket.create_connection((params["remote_host"], params["remote_port"]),
                                          timeout=timeout) as sock:
                _end_lease(sock, params["remote_request_id"], deadline)
        except (OSError, EOFError, ValueError, KeyError) as exc:
            log.info("kv transfer: could not end the lease on %s (%s); it ends at its "
                     "timeout", where, exc)

    def _run(self, job: PullJob) -> None:
        try:
            result = self.pull(job)
        except KVTransferError as exc:
            result = PullResult(job.request_id, None, exc)
        except Exception as exc:  # noqa: BLE001 - any surprise is a failed pull, not a crash
            log.exception("kv transfer: pull failed")
            result = PullResult(job.request_id, None, KVTransferError(str(exc)))
        result.seconds = time.perf_counter() - job.started
        self._results.put(result)

    def pull(self, job: PullJob, done: bool = True) -> PullResult:
        """Fetch and check `job`'s blocks (any thread); `done`: end the lease after.
        Raises KVTransferError with the failure's reason."""
        p = job.params
        where = f"{p['remote_host']}:{p['remote_port']}"
        timeout = self.config.kv_transfer_timeout
        deadline = time.monotonic() + timeout  # the whole pull, not each read
        try:
            with socket.create_connection((p["remote_host"], p["remote_port"]),
                                          timeout=timeout) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _until(sock, deadline)
                send_message(sock, {"op": "pull", "request_id": p["remote_request_id"],
                                    "block_ids": job.block_ids,
                                    "identity": self.identity.as_dict()})
                header, payload = recv_message(sock, deadline=deadline)
                blocks = self._check(job, header, payload)
                if done:
                    _end_lease(sock, p["remote_request_id"], deadline)
        except TimeoutError:
            raise KVTransferError(f"KV transfer from {where} timed out after {timeout} s",
                                  "timeout") from None
        except (OSError, EOFError) as exc:
            raise KVTransferError(f"KV transfer from {where} failed: {exc}", "connect") from None
        except ValueError as exc:  # malformed frames
            raise KVTransferError(f"KV transfer from {where}: {exc}", "protocol") from None
        nbytes = len(payload)
        self.stats.add(bytes_received=nbytes, blocks_received=len(blocks))
        return PullResult(job.request_id, blocks, None, nbytes)

    def _check(self, job: PullJob, header: dict[str, Any],
               payload: memoryview) -> list[StoredBlock]:
        if not header.get("ok"):
            reason = str(header.get("reason", "protocol"))
            raise KVTransferError(str(header.get("message", "the prefill engine refused")),
                                  reason if reason in FAILURE_REASONS else "protocol")
        why = PoolIdentity.from_dict(header["identity"]).mismatch(self.identity)
        if why is not None:
            raise KVTransferError(why, "mismatch")
        sizes, ns = header["sizes"], self.identity.namespace
        if len(sizes) != len(job.chain) or sum(sizes) != len(payload):
            raise KVTransferError("the prefill engine sent another number of blocks", "protocol")
        blocks, offset = [], 0
        for size, (h, tokens) in zip(sizes, job.chain, strict=True):
            try:
                block = decode_block(ns, h, payload[offset:offset + size])  # no copy
            except (CorruptBlock, ValueError, KeyError, TypeError) as exc:
                raise KVTransferError(f"a pulled KV block failed its checks ({exc})",
                                      "corrupt") from None
            if block.token_ids != tokens:
                raise KVTransferError("a pulled KV block holds other tokens than this "
                                      "request's prompt", "corrupt")
            blocks.append(block)
            offset += size
        return blocks

    def finished_pulls(self) -> list[PullResult]:
        out: list[PullResult] = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def wait(self, timeout: float) -> None:
        try:
            result = self._results.get(timeout=timeout)
        except queue.Empty:
            return
        self._results.put(result)  # put back for finished_pulls

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


CONNECTORS: dict[str, type[KVConnector]] = {"tcp": TCPConnector}


# -- the engine's side -------------------------------------------------------------------------
class KVTransfer:
    """The engine core's P/D hooks (engine thread only), over one connector:

        on_finished(seq)  prefill done: hold its blocks, return the response's params
        start(seq)        a decode request: pull what is not cached here (or nothing,
                          and end the prefill side's lease)
        poll()            finished pulls installed in the pool -> requests to queue/fail
        tick()            leases that ended release their blocks

    Mutates the block manager (refs, free list, prefix cache) and the pool."""

    def __init__(self, config: KVTransferConfig, block_manager: BlockManager, model: str,
                 pool: Callable[[], PoolAccess], connector: str = "tcp") -> None:
        self.config = config
        self.bm = block_manager
        self.model = model
        self._pool_factory = pool
        self._pool: PoolAccess | None = None
        self._connector_cls = CONNECTORS[connector]
        self._connector: KVConnector | None = None
        self.stats = TransferStats()
        self.leases = LeaseTable(config.kv_lease_timeout)
        self.pending: dict[str, PullJob] = {}

    @property
    def pool(self) -> PoolAccess:
        if self._pool is None:
            self._pool = self._pool_factory()
        return self._pool

    @property
    def connector(self) -> KVConnector:
        if self._connector is None:
            self._connector = self._connector_cls(
                self.config, PoolIdentity.of(self.model, self.pool), self.leases,
                self.pool.read, self.stats)
        return self._connector

    # -- prefill side ----------------------------------------------------------------
    def on_finished(self, seq: Seq) -> dict[str, Any] | None:
        """`seq` (a do_remote_decode request) finished: hold the full blocks of its prompt
        that a decode engine can use and return the params that name them (None: not a
        hand-off, or it cannot be served)."""
        params = seq.params.kv_transfer_params
        if not params or not params.get("do_remote_decode") or seq.index != 0:
            return None
        bs = self.bm.block_size
        n = min(len(seq.block_table), max(seq.num_prompt_tokens - 1, 0) // bs)
        block_ids = list(seq.block_table[:n])
        chain = _chain(seq.token_ids, bs, n, seq.cache_salt)
        self.bm.hold(block_ids)
        lease = self.leases.add(seq.request_id, block_ids, chain)
        out = self.connector.publish(lease)
        if out is None:
            self.leases.finish(seq.request_id)
        self._update_held()
        return out

    def tick(self) -> bool:
        """End the leases that are over (released blocks stay cached); whether any did."""
        if not len(self.leases):
            return False
        over = self.leases.due()
        for lease in over:
            self.bm.release(lease.block_ids)
        if over:
            self._update_held()
        return bool(over)

    def _update_held(self) -> None:
        held = self.leases.held_blocks()
        self.stats.add(held_blocks=held - self.stats.counts["held_blocks"])

    # -- decode side -----------------------------------------------------------------
    @staticmethod
    def wants_pull(params: dict[str, Any] | None) -> bool:
        return bool(params and params.get("do_remote_prefill"))

    def start(self, seq: Seq) -> bool:
        """Pull the prompt blocks of `seq` (a do_remote_prefill request) that this pool
        does not cache; True when a pull started (the request must wait for `poll`),
        False when nothing is missing. Raises KVTransferError when it cannot pull."""
        params = seq.params.kv_transfer_params or {}
        if not self.bm.enable_prefix_caching:
            raise KVTransferError("this engine cannot take remote KV: prefix caching is off",
                                  "no_prefix_cache")
        bs = self.bm.block_size
        remote = list(params.get("remote_block_ids") or [])
        n = min(len(remote), (seq.num_tokens - 1) // bs)
        chain = _chain(seq.token_ids, bs, n, seq.cache_salt)
        first = 0
        while first < n and self._cached(*chain[first]):
            first += 1
        if first == n:
            if n:  # all cached here: the prefill side may free them now
                self.connector.release(params)
            return False
        self.pending[seq.request_id] = job = PullJob(
            seq.request_id, params, remote[first:n], chain[first:],
            chain[first - 1][0] if first else None, seq.lora_id, chain[:first])
        self.connector.start_pull(job)
        return True

    def _cached(self, block_hash: int, tokens: tuple[int, ...]) -> bool:
        block_id = self.bm.cached.get(block_hash)
        return block_id is not None and self.bm.blocks[block_id].token_ids == tokens

    def poll(self) -> list[tuple[str, KVTransferError | None]]:
        """Finished pulls: blocks installed as prefix-cache entries; per request, None
        (queue it: it hits what was pulled, or recomputes) or the error that fails it
        (kv_load_failure_policy=fail)."""
        if not self.pending:
            return []
        out: list[tuple[str, KVTransferError | None]] = []
        for result in self.connector.finished_pulls():
            job = self.pending.pop(result.request_id, None)
            if job is None:
                continue
            self.stats.observe_pull(result.seconds)
            if result.error is None and result.blocks is not None:
                self._install(job, result.blocks)
                out.append((job.request_id, None))
            else:
                out.append((job.request_id, self.failed(job.request_id, result.error)))
        return out

    def failed(self, request_id: str, error: KVTransferError | None) -> KVTransferError | None:
        """Count a failed pull; the error to fail the request with, or None (recompute)."""
        error = error or KVTransferError("KV transfer failed")
        self.stats.failure(error.reason)
        policy = self.config.kv_load_failure_policy
        log.warning("kv transfer for %s failed (%s): %s; %s", request_id, error.reason,
                    error.message, "failing it" if policy == "fail" else "recomputing")
        return error if policy == "fail" else None

    def _install(self, job: PullJob, blocks: list[StoredBlock]) -> None:
        def write(block_ids: list[int], indices: list[int]) -> None:
            self.pool.write(block_ids, torch.stack([blocks[i].kv for i in indices]))

        keep = [self.bm.cached[h] for h, _ in job.prefix if h in self.bm.cached]
        self.bm.install(job.chain, job.parent, write, job.lora_id, keep)

    def has_pending(self) -> bool:
        return bool(self.pending)

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` for a pull to finish (an idle core must not spin)."""
        if self.pending:
            self.connector.wait(timeout)

    def stats_dict(self) -> dict[str, float]:
        return self.stats.as_dict()

    def close(self) -> None:
        if self._connector is not None:
            self._connector.close()


def _chain(token_ids: Sequence[int], block_size: int, n: int, salt: bytes) -> Chain:
    chain: Chain = []
    parent: int | None = None
    for i in range(n):
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash_block(parent, tokens, salt)
        chain.append((parent, tokens))
    return chain
