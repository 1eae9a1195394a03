"""KV offload tiers on the real model (SmolLM2-135M): greedy outputs are the same whether
a prefix comes from the host tier, the disk tier (after a restart), the shared Redis
store (a second engine) or recomputation; a corrupt file is recomputed."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.model

REDIS_URL = "redis://127.0.0.1:6379/0"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
POOL = dict(num_kv_blocks=24, block_size=16, max_num_seqs=2, max_model_len=512)


def sessions(llm: LLM) -> list[list[int]]:
    """Four histories of ~150 tokens: together 2.5x the 24-block pool."""
    tok = llm.get_tokenizer()
    topics = ["rivers of Europe", "the history of printing", "how bees make honey",
              "compilers and interpreters"]
    out = []
    for t in topics:
        text = (f"User: Tell me about {t}. Please be thorough and careful, and mention "
                f"three facts, two open questions and one common misconception about {t}. ")
        ids = tok.encode(text * 6)
        assert len(ids) >= 150
        out.append(ids[:150])
    return out


def two_turns(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each session twice (the second time after the others pushed it out of the pool):
    the outputs and each second turn's cached prompt tokens."""
    outputs, cached = [], []
    for turn in range(2):
        for p in prompts:
            (res,) = llm.generate([p], GREEDY)
            outputs.append(list(res.outputs[0].token_ids))
            if turn:
                cached.append(res.num_cached_tokens)
    return outputs, cached


def close(llm: LLM) -> None:
    llm.engine.core.close()
    del llm
    gc.collect()


def clear_store(llm: LLM) -> None:
    offload = llm.engine.core.block_manager.offload
    assert offload is not None
    for tier in offload.blob_tiers:
        if tier.medium == "REDIS":
            client = tier.client  # type: ignore[attr-defined]
            keys = list(client.scan_iter(match=f"sluice:kv:{tier.namespace}:*"))
            if keys:
                client.delete(*keys)


def offload_stats(llm: LLM) -> dict[str, dict[str, float]]:
    return llm.engine.stats().kv_offload


@pytest.mark.services
def test_every_tier_gives_the_recomputed_tokens(tmp_path: Path) -> None:
    base = LLM(**POOL)  # type: ignore[arg-type]
    prompts = sessions(base)
    want, base_cached = two_turns(base, prompts)
    assert sum(base_cached) < 144 * 4 // 2  # the pool alone lost most of every session
    close(base)

    store, disk = REDIS_URL, f"disk={tmp_path}:64MiB"
    opts: dict[str, Any] = dict(POOL)
    tiered = LLM(kv_offload=f"host=64MiB,{disk}", kv_store=store, **opts)
    clear_store(tiered)  # blocks of earlier runs would hit in the first turn
    got, cached = two_turns(tiered, prompts)
    assert got == want
    assert cached == [144] * 4  # 9 full blocks before each last token, from the host tier
    assert offload_stats(tiered)["CPU"]["hits"] >= 36
    close(tiered)

    restarted = LLM(kv_offload=disk, **opts)  # the disk tier outlives the engine
    got, cached = two_turns(restarted, prompts)
    assert got == want and cached == [144] * 4
    assert offload_stats(restarted)["DISK"]["hits"] >= 36
    close(restarted)

    other = LLM(kv_store=store, **opts)  # a second worker: the store has the first's blocks
    (res,) = other.generate([prompts[0]], GREEDY)
    assert res.num_cached_tokens == 144 and list(res.outputs[0].token_ids) == want[0]
    assert offload_stats(other)["REDIS"]["hits"] == 9
    clear_store(other)  # leave the shared Redis as it was
    close(other)


def test_corrupt_disk_blocks_are_recomputed(tmp_path: Path) -> None:
    first = LLM(kv_offload=f"disk={tmp_path}:64MiB", **POOL)  # type: ignore[arg-type]
    prompt = sessions(first)[0]
    (want,) = first.generate([prompt], GREEDY)
    close(first)
    for f in sorted(tmp_path.rglob("*.kv"))[::2]:  # every other file: truncated
        f.write_bytes(f.read_bytes()[:1000])
    second = LLM(kv_offload=f"disk={tmp_path}:64MiB", **POOL)  # type: ignore[arg-type]
    (res,) = second.generate([prompt], GREEDY)
    assert res.outputs[0].token_ids == want.outputs[0].token_ids
    assert res.num_cached_tokens < 144
    assert offload_stats(second)["DISK"]["errors"] >= 1
    close(second)
