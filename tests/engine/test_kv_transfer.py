"""P/D KV hand-off between two engines in this process (tiny random model; the real
default model for one identity check): a prefill engine holds a finished prompt's
blocks under a lease and serves them over TCP on 127.0.0.1; a decode engine pulls what
it lacks, installs it as prefix-cache entries and decodes token-for-token as one engine
would. Failures (nobody listening, an expired lease, another block size, dtype or model)
recompute the same output, or fail the request under kv_load_failure_policy=fail."""

from __future__ import annotations

import gc
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.engine.config import EngineConfig
from sluice.engine.kv_transfer import KVTransferError, LeaseError, LeaseTable
from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.protocol.block_hash import hash_blocks
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.kv_events import BlockStored

BS = 16
# float32: a prefix hit then computes exactly what a cold prefill does (in bfloat16 the
# shorter chunk rounds differently, on one engine as across two: see docs/pd.md)
POOL = dict(num_kv_blocks=64, block_size=BS, max_model_len=512, max_num_seqs=4,
            max_num_batched_tokens=512, dtype="float32")
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}
VLLM_RESPONSE_FIELDS = {"do_remote_prefill", "do_remote_decode", "remote_engine_id",
                        "remote_block_ids", "remote_host", "remote_port", "remote_request_id",
                        "tp_size"}


def greedy(n: int = 8, params: dict[str, Any] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                          kv_transfer_params=params)


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` distinct prompts of `length` token ids (no special tokens)."""
    return [[100 + (seed * 7919 + i * 131 + j * 17) % 40000 for j in range(length)]
            for i in range(count)]


def transfer(llm: LLM) -> Any:
    return llm.engine.core.kv_transfer


def stat(llm: LLM, key: str) -> float:
    return llm.engine.core.stats().kv_transfer[key]


def prefill(llm: LLM, prompt: list[int]) -> dict[str, Any]:
    (out,) = llm.generate([prompt], greedy(1, dict(PREFILL)))
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def decode(llm: LLM, prompt: list[int], params: dict[str, Any]) -> tuple[list[int], int]:
    (out,) = llm.generate([prompt], greedy(8, params))
    return list(out.outputs[0].token_ids), out.num_cached_tokens


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> Iterator[dict[str, LLM]]:
    made = {"prefill": LLM(str(tiny_llama_dir), **POOL),
            "decode": LLM(str(tiny_llama_dir), **POOL),
            "local": LLM(str(tiny_llama_dir), **POOL)}
    yield made
    for llm in made.values():
        llm.engine.core.close()
    made.clear()
    gc.collect()


def local(engines: dict[str, LLM], prompt: list[int]) -> list[int]:
    (out,) = engines["local"].generate([prompt], greedy(8))
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("length", [5, 16, 17, 32, 33, 70, 129])
def test_handoff_is_token_for_token_the_local_output(engines: dict[str, LLM],
                                                     length: int) -> None:
    """Prompts inside one block, on a boundary and across several: the decode engine
    gets (length - 1) // 16 blocks and computes the rest, with the same greedy tokens."""
    p, d = engines["prefill"], engines["decode"]
    (prompt,) = prompts(1, length, seed=length)
    params = prefill(p, prompt)
    assert set(params) == VLLM_RESPONSE_FIELDS
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and params["tp_size"] == 1
    assert isinstance(params["remote_port"], int) and params["remote_port"] > 0
    assert isinstance(params["remote_engine_id"], str)
    assert isinstance(params["remote_request_id"], str)
    n = (length - 1) // BS
    assert len(params["remote_block_ids"]) == n
    received = stat(d, "blocks_received")
    tokens, cached = decode(d, prompt, params)
    assert tokens == local(engines, prompt)
    assert cached == n * BS  # every handed-off block was a prefix hit on the decode side
    assert stat(d, "blocks_received") - received == n
    p.engine.core.tick()
    assert stat(p, "held_blocks") == 0  # `done` ended the lease


def test_prefix_hits_on_either_side_pull_only_what_is_missing(engines: dict[str, LLM]) -> None:
    p, d = engines["prefill"], engines["decode"]
    base = prompts(1, 64, seed=99)[0]
    first, second = base + [7, 8, 9], base[:48] + prompts(1, 40, seed=5)[0]
    params = prefill(p, first)
    tokens, _ = decode(d, first, params)
    assert tokens == local(engines, first)
    # the prefill engine hits its own 3 cached blocks; the decode engine has them too
    params = prefill(p, second)
    assert params["remote_block_ids"][:3] == [p.engine.core.block_manager.cached[h]
                                              for h in hash_blocks(second, BS)[:3]]
    received = stat(d, "blocks_received")
    tokens, cached = decode(d, second, params)
    assert tokens == local(engines, second)
    assert stat(d, "blocks_received") - received == (len(second) - 1) // BS - 3
    assert cached == (len(second) - 1) // BS * BS


def test_imported_blocks_are_announced_and_hit_later(engines: dict[str, LLM]) -> None:
    p, d = engines["prefill"], engines["decode"]
    (prompt,) = prompts(1, 50, seed=7)
    d.engine.drain_kv_events()
    decode(d, prompt, prefill(p, prompt))
    stored = [h for e in d.engine.drain_kv_events() if isinstance(e, BlockStored)
              for h in e.block_hashes]
    assert stored[:3] == hash_blocks(prompt, BS)[:3]  # installed, then announced
    (again,) = d.generate([prompt], greedy(2))  # a plain request hits them
    assert again.num_cached_tokens == 48


def test_lease_expiry_releases_blocks_and_the_decode_recomputes(engines: dict[str, LLM]
                                                                ) -> None:
    p, d = engines["prefill"], engines["decode"]
    leases, bm = transfer(p).leases, p.engine.core.block_manager
    now = [0.0]
    leases.clock = lambda: now[0]
    try:
        (prompt,) = prompts(1, 60, seed=11)
        p.engine.core.tick()  # leases of earlier tests, pulled and done, end now
        assert stat(p, "held_blocks") == 0
        free_before = bm.num_free_blocks
        params = prefill(p, prompt)
        assert stat(p, "held_blocks") == 3
        assert bm.num_free_blocks == free_before - 3  # referenced by the lease only
        now[0] += leases.timeout + 1
        assert p.engine.core.tick() and stat(p, "held_blocks") == 0
        assert bm.num_free_blocks == free_before  # free again, still cached
        failures = stat(d, "failure:lease")
        tokens, cached = decode(d, prompt, params)
        assert tokens == local(engines, prompt) and cached == 0
        assert stat(d, "failure:lease") == failures + 1
    finally:
        leases.clock = time.monotonic


def test_nobody_listening_recomputes_or_fails(engines: dict[str, LLM],
                                             tiny_llama_dir: Path) -> None:
    p, d = engines["prefill"], engines["decode"]
    (prompt,) = prompts(1, 40, seed=13)
    params = {**prefill(p, prompt), "remote_port": 9}  # discard: nothing listens
    failures = stat(d, "failure:connect")
    tokens, cached = decode(d, prompt, params)
    assert tokens == local(engines, prompt) and cached == 0
    assert stat(d, "failure:connect") == failures + 1
    strict = LLM(str(tiny_llama_dir), **POOL, kv_load_failure_policy="fail")
    try:
        with pytest.raises(KVTransferError) as info:
            decode(strict, prompt, params)
        err = info.value
        assert (err.status_code, err.code, err.param) == (503, "kv_transfer_failed",
                                                          "kv_transfer_params")
        assert "127.0.0.1:9" in err.message
    finally:
        strict.engine.core.close()


def test_a_decode_that_caches_every_block_ends_the_lease_without_a_pull(
        engines: dict[str, LLM]) -> None:
    """The decode engine needs none of the blocks (its own prefix cache has them): it
    pulls nothing but still tells the prefill engine, which frees them at once (before,
    they stayed held for the whole --kv-lease-timeout, 30 s; vLLM's NIXL connector
    notifies the prefill side the same way)."""
    p, d = engines["prefill"], engines["decode"]
    (prompt,) = prompts(1, 50, seed=29)
    decode(d, prompt, prefill(p, prompt))  # now the decode engine caches all 3 blocks
    p.engine.core.tick()
    before = stat(p, "held_blocks")  # earlier tests' leases that were never pulled
    params = prefill(p, prompt)
    assert stat(p, "held_blocks") == before + 3
    received = stat(d, "blocks_received")
    tokens, cached = decode(d, prompt, params)
    assert tokens == local(engines, prompt) and cached == 48
    assert stat(d, "blocks_received") == received  # nothing travelled
    deadline = time.monotonic() + 5.0
    while stat(p, "held_blocks") > before and time.monotonic() < deadline:
        time.sleep(0.02)
        p.engine.core.tick()
    assert stat(p, "held_blocks") <= before


def _trickle(listener: socket.socket, stop: threading.Event) -> None:
    """A peer that takes the pull, then sends a frame promising a 64-byte header and
    trickles it one byte per 0.2 s: every read gets a byte well inside any per-read
    timeout, so only a deadline on the whole pull ends it."""
    conn, _ = listener.accept()
    with conn:
        conn.recv(65536)
        conn.sendall(struct.pack("<IQ", 64, 0))
        while not stop.wait(0.2):
            try:
                conn.sendall(b"\x00")
            except OSError:
                return


def test_a_trickling_peer_times_out_on_the_whole_pull(engines: dict[str, LLM],
                                                      tiny_llama_dir: Path) -> None:
    """--kv-transfer-timeout bounds the pull, not each read: a prefill side that answers
    a byte at a time must not hold the request (before, it waited as long as bytes came)."""
    (prompt,) = prompts(1, 40, seed=23)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    peer = threading.Thread(target=_trickle, args=(listener, stop), daemon=True)
    peer.start()
    params = {**prefill(engines["prefill"], prompt), "remote_port": listener.getsockname()[1]}
    slow = LLM(str(tiny_llama_dir), **POOL, kv_transfer_timeout=1.0)
    try:
        start = time.monotonic()
        tokens, cached = decode(slow, prompt, params)
        elapsed = time.monotonic() - start
        assert tokens == local(engines, prompt) and cached == 0  # recomputed
        assert stat(slow, "failure:timeout") == 1
        assert elapsed < 4.0, f"the pull took {elapsed:.1f} s with a 1 s timeout"
    finally:
        stop.set()
        listener.close()
        peer.join(timeout=5)
        slow.engine.core.close()


@pytest.mark.parametrize(("option", "words"), [
    ({"block_size": 32}, "block_size 16 there, 32 here"),
    ({"dtype": "bfloat16"}, "dtype 'float32' there, 'bfloat16' here"),
])
def test_mismatched_pools_are_a_clear_error(engines: dict[str, LLM], tiny_llama_dir: Path,
                                            option: dict[str, Any], words: str) -> None:
    p = engines["prefill"]
    (prompt,) = prompts(1, 80, seed=17)
    params = prefill(p, prompt)
    other = LLM(str(tiny_llama_dir), **{**POOL, **option}, kv_load_failure_policy="fail")
    try:
        with pytest.raises(KVTransferError) as info:
            decode(other, prompt, params)
        assert info.value.reason == "mismatch"
        assert words in info.value.message
    finally:
        other.engine.core.close()


def test_another_model_is_a_clear_error(engines: dict[str, LLM], tiny_qwen2_dir: Path) -> None:
    (prompt,) = prompts(1, 40, seed=19)
    params = prefill(engines["prefill"], prompt)
    other = LLM(str(tiny_qwen2_dir), **POOL)  # recompute: the same as its own output
    try:
        tokens, cached = decode(other, prompt, params)
        (alone,) = other.generate([prompt], greedy(8))
        assert tokens == list(alone.outputs[0].token_ids) and cached == 0
        assert stat(other, "failure:mismatch") == 1
    finally:
        other.engine.core.close()


def test_lease_table_pins_extends_and_ends() -> None:
    now = [0.0]
    table = LeaseTable(30.0, clock=lambda: now[0])
    chain = [(11, (1, 2)), (12, (3, 4))]
    table.add("r", [5, 6], chain)
    now[0] = 29.0
    assert table.pin("r", [6]) == [chain[1]]  # extended to 59
    now[0] = 40.0
    assert table.due() == []  # pinned, and not expired
    table.unpin("r")
    with pytest.raises(LeaseError):
        table.pin("r", [7])  # not held
    assert table.held_blocks() == 2
    now[0] = 60.0
    with pytest.raises(LeaseError):
        table.pin("r", [5])  # expired
    assert [lease.request_id for lease in table.due()] == ["r"] and len(table) == 0


def test_failure_policy_is_checked() -> None:
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig.from_options(None, kv_load_failure_policy="retry")
    assert info.value.param == "kv_load_failure_policy"


@pytest.mark.model
def test_default_model_handoff_is_identical(default_gguf: Path) -> None:
    opts = dict(num_kv_blocks=96, block_size=16, max_model_len=1024, max_num_seqs=2)
    p, d = LLM(str(default_gguf), **opts), LLM(str(default_gguf), **opts)
    try:
        tok = p.get_tokenizer()
        for text in ("The history of printing began", "Rivers carry sediment to the sea. " * 9):
            prompt = tok.encode(text)
            (alone,) = p.generate([prompt], greedy(8))
            assert p.engine.core.reset_prefix_cache()  # the prefill computes it afresh
            tokens, cached = decode(d, prompt, prefill(p, prompt))
            assert tokens == list(alone.outputs[0].token_ids)
            assert cached == (len(prompt) - 1) // 16 * 16
    finally:
        p.engine.core.close()
        d.engine.core.close()
