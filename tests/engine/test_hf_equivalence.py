"""Greedy outputs equal Hugging Face transformers' greedy `generate`, token for token,
through chunked prefill (a small token budget), the prefix cache on and off, and
preemption in a tiny KV pool; on tiny random llama / qwen2 checkpoints and (marked
`model`) on the default SmolLM2 GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.protocol.errors import InvalidRequestError

SHARED = ("You are a careful assistant. Answer briefly and precisely, using plain words, "
          "and never more than one sentence. Question: ")
TEXTS = [SHARED + "what is the capital of France?", "Hi", SHARED + "why is the sky blue?",
         "Count: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve",
         "日本語のテキスト 🌍"]
MAX_TOKENS = 10


def hf_greedy(model_dir: Path, gguf_file: str | None, prompts: list[list[int]],
              max_tokens: int) -> list[list[int]]:
    """HF's greedy continuation of each prompt (one prompt at a time: no padding)."""
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kw)
    model.generation_config.eos_token_id = None  # like ignore_eos
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 pad_token_id=0)
            outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


def hf_prompts(model_dir: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok(text).input_ids for text in texts]


OPTIONS = {
    "chunked-cache": {"max_num_batched_tokens": 16, "enable_prefix_caching": True},
    "chunked-nocache": {"max_num_batched_tokens": 16, "enable_prefix_caching": False},
    "whole-cache": {"max_num_batched_tokens": 2048, "enable_prefix_caching": True},
    "tiny-pool-preempt": {"max_num_batched_tokens": 8, "enable_prefix_caching": True,
                          "num_kv_blocks": 7},
    "torch-kernels": {"max_num_batched_tokens": 16, "enable_prefix_caching": True,
                      "kernel_backend": "torch"},
}
# every engine option on the dense families (and Gemma's, OLMo 3's and EXAONE 4's sliding
# windows, Gemma 2's soft caps);
# the architectures that differ from them only in the model (a bias, fused checkpoint
# tensors, experts, OLMo 2's norms, YaRN) on chunks with the cache, on both kernel backends
# (longrope's short-prompt outputs differ from transformers' by design at the tiny
# model's default context: test_rope_scaling.py)
CASES = [(arch, option) for arch in ("llama", "qwen2", "qwen3", "smollm3", "granite",
                                     "gemma2", "gemma3", "olmo3", "exaone4")
         for option in OPTIONS] + [
    (arch, option) for arch in ("llama_bias", "phi3", "mixtral", "qwen3_moe", "granitemoe",
                                "qwen2_moe", "olmoe", "olmo2", "qwen2_yarn",
                                "granite4", "glm", "glm4", "helium", "arcee")
    for option in ("chunked-cache", "torch-kernels")]


@pytest.fixture(scope="module")
def tiny(request: pytest.FixtureRequest) -> tuple[Path, list[list[int]], list[list[int]]]:
    model_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    prompts = hf_prompts(model_dir, TEXTS)
    return model_dir, prompts, hf_greedy(model_dir, None, prompts, MAX_TOKENS)


@pytest.mark.parametrize(("tiny", "option"), CASES, indirect=["tiny"])
def test_greedy_equals_transformers(tiny: tuple[Path, list[list[int]], list[list[int]]],
                                    option: str) -> None:
    options = OPTIONS[option]
    model_dir, prompts, expected = tiny
    llm = LLM(str(model_dir), **{"num_kv_blocks": 64, "dtype": "float32", **options})
    torch_ops = "kernel_backend" in options
    assert (llm.engine.runner.native is None) == torch_ops
    assert (llm.engine.runner.linear is None) == torch_ops
    assert llm.engine.runner.native_prefill != torch_ops  # prefill attention from the pool
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    stats = llm.engine.stats()
    if "num_kv_blocks" in options:
        assert stats.num_preemptions > 0
    if not options["enable_prefix_caching"]:
        assert stats.prefix_cache_hits == 0
        return
    if options["max_num_batched_tokens"] <= 16:  # later prompts admitted after the shared one
        assert stats.prefix_cache_hits > 0
    # Again on the warm cache: the same tokens, now with prompt blocks served from cache.
    again = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert llm.engine.stats().prefix_cache_hits > stats.prefix_cache_hits


@pytest.mark.parametrize("budget", [16, 2048])
def test_prompt_logprobs_equal_transformers(tiny_llama_dir: Path, budget: int) -> None:
    """Each prompt token's logprob given those before it, and its likeliest tokens, as
    transformers' one forward over the prompt gives them; in chunks of 16 or in one, on a
    prompt whose prefix the cache holds (computed again, not served)."""
    from transformers import AutoModelForCausalLM

    prompt = hf_prompts(tiny_llama_dir, [TEXTS[0]])[0]
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, dtype="float32",
              max_num_batched_tokens=budget)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))  # cache it
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2,
                                                prompt_logprobs=2))[0]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with torch.inference_mode():
        want = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    got = out.prompt_logprobs
    assert out.num_cached_tokens == 0 and got is not None and len(got) == len(prompt)
    assert got[0] is None
    for i in range(1, len(prompt)):
        entry, row = got[i], want[i - 1]
        assert entry is not None
        assert float(entry[prompt[i]]) == pytest.approx(float(row[prompt[i]]), abs=2e-4)
        top = row.topk(2)
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert float(entry[t]) == pytest.approx(v, abs=2e-4)
            assert entry[t].rank == top.indices.tolist().index(t) + 1  # type: ignore[attr-defined]


def test_llm_text_and_chat_api(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    tok = llm.get_tokenizer()
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert out[0].prompt == "Hello" and len(out[0].outputs[0].token_ids) == 4
    assert out[0].outputs[0].text == tok.decode(out[0].outputs[0].token_ids)
    chat = llm.chat([{"role": "user", "content": "Hi"}],
                    SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    templated = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat[0].prompt_token_ids == tok.encode(templated, add_special_tokens=False)


def test_llm_takes_vllms_prompt_dicts(tiny_llama_dir: Path) -> None:
    """vLLM's `TextPrompt` / `TokensPrompt` dicts give what plain text and ids give; any
    other key is refused naming it (nothing is left running)."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = llm.get_tokenizer().encode("Hello")
    plain = llm.generate(["Hello", ids], params)
    dicts = llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": ids}], params)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt == "Hello" and dicts[1].prompt_token_ids == ids
    one = llm.generate({"prompt_token_ids": ids}, params)
    assert one[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    for bad, match in (({"prompt": "Hi", "multi_modal_data": {}}, "multi_modal_data"),
                       ({"prompt_token_ids": "1 2"}, "prompt_token_ids"), ({}, "one of")):
        with pytest.raises(InvalidRequestError, match=match) as exc:
            llm.generate(["Hello", bad], params)
        assert exc.value.param == "prompt"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.model
def test_default_gguf_greedy_equals_transformers(default_gguf: Path) -> None:
    llm = LLM(str(default_gguf), num_kv_blocks=64, max_num_batched_tokens=16, dtype="float32")
    tok = llm.get_tokenizer()  # sluice's GGUF tokenizer: HF's takes ~30 s to build
    prompts = [tok.encode(t) for t in (TEXTS[0], TEXTS[2], TEXTS[3])]
    expected = hf_greedy(default_gguf.parent, default_gguf.name, prompts, 8)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.stats().prefix_cache_hits > 0
