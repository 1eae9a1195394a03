"""KV offload tiers: spec parsing, the checked blob format, host LRU, the disk tier across
restarts and corruption, the Redis store (and a dead one), and the engine loop over a
fake runner whose KV pool is real tensors: blocks evicted from the pool come back from a
tier with the exact K/V, and greedy outputs match recomputation."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sluice.engine.attention import KVCache
from sluice.engine.config import EngineConfig
from sluice.engine.kv_offload import (
    BlobTier,
    CorruptBlock,
    DiskTier,
    Evicted,
    HostTier,
    KVOffloadManager,
    KVOffloadSpec,
    PoolAccess,
    RedisTier,
    StoredBlock,
    decode_block,
    encode_block,
    parse_size,
)
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.outputs import RequestOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence
from sluice.protocol.errors import InvalidRequestError

from .fakes import VOCAB, PagedFakeRunner, reference_greedy

BS = 4
NS = "0123456789abcdef"
REDIS_URL = "redis://127.0.0.1:6379/0"


def block(seed: int, tokens: tuple[int, ...] = (1, 2, 3, 4)) -> StoredBlock:
    g = torch.Generator().manual_seed(seed)
    return StoredBlock(tokens, torch.randn((2, 3, BS, 2, 8), generator=g))


# -- spec ------------------------------------------------------------------------------
def test_spec_parses_sizes_and_names_bad_parts() -> None:
    assert parse_size("4GiB", "x") == 4 * 2**30
    assert parse_size("1.5MB", "x") == 1_500_000
    assert KVOffloadSpec.parse("host=4GiB,disk=/tmp/kv:20GiB") == KVOffloadSpec(
        4 * 2**30, "/tmp/kv", 20 * 2**30)
    assert KVOffloadSpec.parse("disk=C:/a:b:1KiB").disk_dir == "C:/a:b"
    for bad in ("host", "host=", "host=4XB", "ram=1GiB", "disk=/tmp/kv", "disk=:1GiB",
                "host=0", "",
                # found by a new-user pass: a repeated tier was taken, the last one winning
                "host=1GiB,host=2GiB", "disk=/tmp/a:1GiB,host=1GiB,disk=/tmp/b:1GiB"):
        with pytest.raises(InvalidRequestError) as exc:
            KVOffloadSpec.parse(bad)
        assert exc.value.param == "kv_offload"
    with pytest.raises(InvalidRequestError) as exc:
        EngineConfig.from_options(None, kv_store="memcached://x")
    assert exc.value.param == "kv_store"
    with pytest.raises(InvalidRequestError):
        EngineConfig.from_options(None, kv_offload="host=1MiB", enable_prefix_caching=False)


# -- blobs and tiers ---------------------------------------------------------------------
def test_blob_round_trip_and_every_damage_detected() -> None:
    b = block(1)
    blob = encode_block(NS, -5, b)
    back = decode_block(NS, -5, blob)
    assert back.token_ids == b.token_ids and torch.equal(back.kv, b.kv)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 1
    for damaged in (blob[:-1], blob[:100], bytes(flipped), b""):
        with pytest.raises(CorruptBlock):
            decode_block(NS, -5, damaged)
    with pytest.raises(CorruptBlock):
        decode_block(NS, -6, blob)  # another block's name
    with pytest.raises(CorruptBlock):
        decode_block("f" * 16, -5, blob)  # another model's namespace


def test_host_tier_is_lru_bounded_by_bytes() -> None:
    removed: list[int] = []
    size = block(0).nbytes
    host = HostTier(3 * size, removed.extend)
    for h in range(3):
        host.put(h, block(h))
    assert host.get(0) is not None  # 0 is now the most recent
    host.put(3, block(3))
    assert removed == [1] and not host.contains(1)
    assert host.stats.usage_bytes == 3 * size and host.stats.blocks_stored == 4


def test_disk_tier_survives_restart_and_drops_corrupt_files(tmp_path: Path) -> None:
    size = len(encode_block(NS, 0, block(0)))  # +-1 byte with the hash's digits
    disk = DiskTier(str(tmp_path), 3 * size + 50, NS)  # room for 3 blocks, not 4
    for h in (10, -11, 12):
        disk.put(h, block(h))
    again = DiskTier(str(tmp_path), 3 * size + 50, NS)  # a restarted worker
    assert len(again.index) == 3 and again.stats.usage_bytes == disk.stats.usage_bytes
    got = again.get(-11)
    assert got is not None and torch.equal(got.kv, block(-11).kv)
    with open(again._path(12), "r+b") as f:  # truncate one file
        f.truncate(size // 2)
    assert again.get(12) is None and again.stats.errors == 1
    assert not os.path.exists(again._path(12))  # a bad file is removed
    again.put(13, block(13))
    again.put(14, block(14))  # over 3 blocks: the least recently used file goes
    assert not again.contains(10) and again.contains(-11) and again.contains(14)


@pytest.mark.services
def test_redis_store_shares_blocks_and_survives_a_dead_store() -> None:
    ns = uuid.uuid4().hex[:16]
    a, b = RedisTier(REDIS_URL, ns), RedisTier(REDIS_URL, ns)
    try:
        a.put(42, block(42))
        got = b.get(42)
        assert got is not None and torch.equal(got.kv, block(42).kv)
        assert b.get(43) is None and b.stats.errors == 0
        a.client.set(a._key(44), b"garbage")
        assert b.get(44) is None and b.stats.errors == 1
    finally:
        a.client.delete(a._key(42), a._key(44))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = RedisTier(f"redis://127.0.0.1:{port}/0", ns, timeout=0.2)
    assert dead.get(42) is None and dead.stats.errors == 1
    dead.put(42, block(42))
    assert dead.get(42) is None and dead.stats.errors == 1  # skipped while down


def test_redis_store_reads_and_writes_many_blocks_at_once() -> None:
    ns = uuid.uuid4().hex[:16]
    a, b = RedisTier(REDIS_URL, ns), RedisTier(REDIS_URL, ns)
    try:
        a.put(1, block(1))
        blobs = [(h, encode_block(ns, h, block(h))) for h in (1, 2, 3)]
        assert b.write_many(blobs) == [False, True, True]  # 1 was there: not sent again
        assert b.stats.blocks_stored == 2 and b.stats.bytes_stored == 2 * len(blobs[1][1])
        got = a.get_many([3, 4, 1])
        assert got[1] is None and got[0] is not None and got[2] is not None
        assert torch.equal(got[0].kv, block(3).kv) and torch.equal(got[2].kv, block(1).kv)
    finally:
        a.client.delete(*(a._key(h) for h in (1, 2, 3)))


# -- the engine loop over a tensor-backed fake runner -------------------------------------
class TensorFakeRunner(PagedFakeRunner):
    """PagedFakeRunner whose KV lives in real pool tensors (2 layers): K holds each
    slot's token, V its position, so a block loaded from a tier must be exact."""

    def __init__(self, num_kv_blocks: int) -> None:
        super().__init__(num_kv_blocks, BS, 128)
        shape = (num_kv_blocks, BS, 1, 1)
        self.model = SimpleNamespace(layers=[
            SimpleNamespace(attention=SimpleNamespace(kv_cache=KVCache(
                torch.full(shape, -1.0), torch.full(shape, -1.0)))) for _ in range(2)])

    def _cache(self) -> KVCache:
        return self.model.layers[1].attention.kv_cache

    def execute(self, chunks: list[Any]) -> torch.Tensor:
        self.num_calls += 1
        rows = []
        for c in chunks:
            for i, tok in enumerate(c.token_ids):
                pos = c.start_pos + i
                blk, off = c.block_table[pos // BS], pos % BS
                for layer in self.model.layers:
                    layer.attention.kv_cache.k[blk, off] = tok
                    layer.attention.kv_cache.v[blk, off] = pos
            if c.need_logits:
                rows.append(_fake_logits(self, c))
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


def _fake_logits(runner: TensorFakeRunner, c: Any) -> torch.Tensor:
    from .fakes import fake_logits

    cache = runner._cache()
    context = []
    for pos in range(c.start_pos + len(c.token_ids)):
        blk, off = c.block_table[pos // BS], pos % BS
        assert int(cache.v[blk, off]) == pos, "KV slot holds another position"
        context.append(int(cache.k[blk, off]))
    return fake_logits(context)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_engine(num_blocks: int, **opts: Any) -> LLMEngine:
    config = EngineConfig.from_options(None, block_size=BS, max_num_batched_tokens=64,
                                       max_num_seqs=2, **opts)
    return LLMEngine(config, TensorFakeRunner(num_blocks))


def run(engine: LLMEngine, rid: str, prompt: list[int]) -> RequestOutput:
    engine.add_request(rid, prompt, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def sessions() -> list[list[int]]:
    return [[(3 + 7 * s + (i * 13) % 17) % VOCAB for i in range(40)] for s in range(4)]


def test_evicted_blocks_come_back_from_the_host_tier_exactly() -> None:
    engine = make_engine(16, kv_offload="host=1MiB")  # the pool holds ~one session
    bm = engine.core.block_manager
    for turn in range(2):
        for s, prompt in enumerate(sessions()):
            out = run(engine, f"t{turn}s{s}", prompt)
            assert out.outputs[0].token_ids == reference_greedy(prompt, 6)
            if turn == 1:  # 40 tokens: 9 full blocks before the last token, all loaded
                assert out.num_cached_tokens == 36
    stats = engine.stats().kv_offload["CPU"]
    assert stats["hits"] >= 4 * 9 and stats["bytes_loaded"] == stats["hits"] * 2 * 2 * BS * 4
    assert bm.num_free_blocks == 16


def test_without_tiers_the_same_workload_recomputes() -> None:
    engine = make_engine(16)
    for turn in range(2):
        for s, prompt in enumerate(sessions()):
            out = run(engine, f"t{turn}s{s}", prompt)
            assert out.outputs[0].token_ids == reference_greedy(prompt, 6)
    assert out.num_cached_tokens == 0 and engine.stats().kv_offload == {}


def test_disk_tier_serves_a_restarted_engine_and_recomputes_a_corrupt_block(
        tmp_path: Path) -> None:
    spec = f"disk={tmp_path}:1MiB"
    first = make_engine(32, kv_offload=spec)
    prompt = sessions()[0]
    run(first, "a", prompt)
    first.core.close()  # waits for the write-through
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) == 11  # 45 computed tokens (40 prompt, 5 of the 6 generated)
    second = make_engine(32, kv_offload=spec)
    out = run(second, "b", prompt)
    assert out.num_cached_tokens == 36
    assert out.outputs[0].token_ids == reference_greedy(prompt, 6)
    second.core.close()
    # damage the third block's file: blocks 0-1 load, the rest is recomputed
    from sluice.protocol.block_hash import hash_blocks

    third = hash_blocks(prompt, BS)[2] & 0xFFFFFFFFFFFFFFFF
    victim = next(f for f in files if f.name.startswith(f"{third:016x}"))
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    third_engine = make_engine(32, kv_offload=spec)
    out = run(third_engine, "c", prompt)
    assert out.num_cached_tokens == 8
    assert out.outputs[0].token_ids == reference_greedy(prompt, 6)
    assert third_engine.stats().kv_offload["DISK"]["errors"] == 1
    third_engine.core.close()


def test_a_tier_slower_than_recomputing_is_skipped_but_probed() -> None:
    from sluice.engine.kv_offload import CostModel

    cost = CostModel(block_size=16, probe_every=4)
    assert cost.worth_loading("DISK")  # nothing measured yet: try it
    cost.observe_prefill(1.6, 1600)  # 1 ms a token: 16 ms a block
    cost.observe_load("CPU", 0.0001, 1)
    cost.observe_load("DISK", 0.05, 1)  # 50 ms a block: slower than recomputing
    assert cost.worth_loading("CPU")
    assert [cost.worth_loading("DISK") for _ in range(8)] == [False, False, False, True] * 2
    for _ in range(20):  # the disk got fast again: the probes see it
        cost.observe_load("DISK", 0.001, 1)
    assert cost.worth_loading("DISK")


def test_a_request_waits_for_its_disk_blocks_while_others_run(tmp_path: Path) -> None:
    spec = f"disk={tmp_path}:1MiB"
    first = make_engine(32, kv_offload=spec)
    prompt, other = sessions()[0], sessions()[1][:9]
    run(first, "a", prompt)
    first.core.close()
    engine = make_engine(32, kv_offload=spec)
    offload = engine.core.block_manager.offload
    assert offload is not None
    disk = offload.blob_tiers[0]
    gate, read = threading.Event(), disk.read
    disk.read = lambda h: (gate.wait(10), read(h))[1]  # type: ignore[method-assign]
    engine.add_request("slow", prompt, GREEDY)
    engine.add_request("other", other, GREEDY)
    finished = {}
    for _ in range(20):  # "other" runs to the end while "slow" waits for the disk
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "other" in finished and "slow" not in finished
    assert engine.core.scheduler.waiting[0].request_id == "slow"
    gate.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["slow"].num_cached_tokens == 36
    assert finished["slow"].outputs[0].token_ids == reference_greedy(prompt, 6)
    assert engine.stats().kv_offload["DISK"]["hits"] == 9
    engine.core.close()


def test_a_tier_never_serves_one_adapters_kv_to_another_or_to_the_base() -> None:
    engine = make_engine(16, kv_offload="host=1MiB")
    for s, prompt in enumerate(sessions()):  # the first session's blocks go down a tier
        run(engine, f"s{s}", prompt)
    bm, first = engine.core.block_manager, sessions()[0]

    def seq(salt: bytes) -> Sequence:
        return Sequence(99, "probe", 0, list(first), len(first), SamplingParams(), 8,
                        cache_salt=salt)

    assert bm.lookup(seq(b"\x01" * 16)) == []  # same tokens, an adapter's key: a miss
    assert len(bm.lookup(seq(b""))) == 9  # the base's chain comes back from the host tier


class CountingStore(BlobTier):
    """A shared store in a dict that counts its round trips: one per call, whether the
    call carries one block (`read`, `write`, `contains`) or many (`read_many`,
    `write_many`), as a remote store's would be."""

    medium = "REDIS"

    def __init__(self, blobs: dict[int, bytes]) -> None:
        super().__init__("")
        self.blobs = blobs
        self.reads = self.writes = 0

    def contains(self, block_hash: int) -> bool:
        return block_hash in self.blobs

    def read(self, block_hash: int) -> bytes | None:
        self.reads += 1
        return self.blobs.get(block_hash)

    def write(self, block_hash: int, blob: bytes) -> None:
        self.write_many([(block_hash, blob)])

    def read_many(self, hashes: list[int]) -> list[bytes | None]:  # type: ignore[override]
        self.reads += 1
        return [self.blobs.get(h) for h in hashes]

    def write_many(self, items: list[tuple[int, bytes]]) -> list[bool]:  # type: ignore[override]
        self.writes += 1
        out = [h not in self.blobs for h, _ in items]
        for (h, blob), new in zip(items, out, strict=True):
            if new:
                self.blobs[h] = blob
                self.stats.blocks_stored += 1
        return out


def store_engine(blobs: dict[int, bytes]) -> tuple[LLMEngine, CountingStore]:
    """An engine whose only tier is a CountingStore over `blobs` (a worker of a pool)."""
    engine = make_engine(32)
    store = CountingStore(blobs)
    caches = [(layer.attention.kv_cache.k, layer.attention.kv_cache.v)
              for layer in engine.core.runner.model.layers]
    engine.core.block_manager.attach_offload(KVOffloadManager(PoolAccess(caches), BS,
                                                              blob_tiers=[store]))
    return engine, store


def test_a_store_round_trip_carries_a_step_or_a_chain_of_blocks_not_one() -> None:
    """One round trip per block made a store's measured load time (on a busy worker,
    each trip waits for the engine thread) look slower than recomputing, and the cost
    model stopped asking the store: hits lost. A step's new blocks are written, and a
    request's chain fetched, in one call each."""
    blobs: dict[int, bytes] = {}
    first, store = store_engine(blobs)
    prompt = sessions()[0]
    run(first, "a", prompt)
    offload = first.core.block_manager.offload
    assert offload is not None
    offload.flush()
    # the prefill step cached 10 blocks (one write), a decode step the 11th (another)
    assert len(blobs) == 11 and store.writes == 2 and offload.write_drops == 0
    second, other = store_engine(blobs)  # another worker, same store, empty pool
    out = run(second, "b", prompt)
    assert out.num_cached_tokens == 36  # 9 full blocks before the last token
    assert out.outputs[0].token_ids == reference_greedy(prompt, 6)
    assert other.reads == 1 and other.stats.hits == 9
    first.core.close()
    second.core.close()


def test_the_writer_drops_only_past_its_bound_and_counts_it() -> None:
    engine, store = store_engine({})
    offload = engine.core.block_manager.offload
    assert offload is not None
    offload.queue_blocks = 4
    gate = threading.Event()
    write_many = store.write_many
    store.write_many = lambda items: (gate.wait(10), write_many(items))[1]  # type: ignore
    offload.write_through([Evicted(i, 100 + i, (i,) * BS) for i in range(3)])
    offload.write_through([Evicted(i, 200 + i, (i,) * BS) for i in range(3)])  # 1 fits
    assert offload.write_drops == 2
    gate.set()
    offload.flush()
    assert sorted(store.blobs) == [100, 101, 102, 200]
    engine.core.close()


def test_an_idle_core_reports_blocks_the_writer_stored_after_its_last_step() -> None:
    """The engine process sends stats with each step and, when idle, only when `tick`
    says they changed: a write-through that ends after the request's last step (a slow
    store, a busy host) must still reach /metrics, not wait for the next request."""
    engine, store = store_engine({})
    core, offload = engine.core, engine.core.block_manager.offload
    assert offload is not None
    gate, write_many = threading.Event(), store.write_many
    store.write_many = lambda items: (gate.wait(10), write_many(items))[1]  # type: ignore
    run(engine, "a", sessions()[0])
    core.tick()  # (whatever the steps wrote so far)
    assert not core.tick() and core.stats().kv_offload["REDIS"]["blocks_stored"] == 0
    gate.set()
    offload.flush()
    assert core.tick() and not core.tick()  # changed once, then idle again
    assert core.stats().kv_offload["REDIS"]["blocks_stored"] > 0
    core.close()


def test_an_idle_core_waits_on_the_fetcher_instead_of_spinning() -> None:
    """A core whose only work is a request waiting for the store blocks in
    `KVOffloadManager.wait` until the fetch is done: a spinning loop held the GIL that
    the fetcher needs, so a fetch took ~30 ms a block and the store was skipped."""
    blobs: dict[int, bytes] = {}
    first, _ = store_engine(blobs)
    prompt = sessions()[0]
    run(first, "a", prompt)
    first.core.close()
    engine, store = store_engine(blobs)
    bm, offload = engine.core.block_manager, engine.core.block_manager.offload
    assert offload is not None
    gate, read_many = threading.Event(), store.read_many
    store.read_many = lambda hashes: (gate.wait(10), read_many(hashes))[1]  # type: ignore
    seq = Sequence(1, "b", 0, list(prompt), len(prompt), SamplingParams(), 8)
    assert bm.lookup(seq) == [] and bm.load_pending  # the fetch started; the request waits
    assert not offload.wait(0.05)  # nothing finished (the store is held up)
    assert bm.lookup(seq) == [] and bm.load_pending
    gate.set()
    assert offload.wait(10)  # woken by the fetch, not by the timeout
    assert len(bm.lookup(seq)) == 9 and not offload.wait(10)  # none running: at once
    engine.core.close()
    # the core's hook: a step with nothing to run waits on the fetcher
    third, store3 = store_engine(blobs)
    offload3 = third.core.block_manager.offload
    assert offload3 is not None
    gate3, read3, wait3 = threading.Event(), store3.read_many, offload3.wait
    store3.read_many = lambda hashes: (gate3.wait(10), read3(hashes))[1]  # type: ignore
    waits: list[float] = []
    offload3.wait = lambda timeout: (waits.append(timeout), wait3(timeout))[1]  # type: ignore
    third.add_request("c", prompt, GREEDY)
    assert third.step() == [] and waits == [0.01]
    gate3.set()
    while third.has_unfinished_requests():
        for out in third.step():
            final = out
    assert final.num_cached_tokens == 36
    assert final.outputs[0].token_ids == reference_greedy(prompt, 6)
    third.core.close()
