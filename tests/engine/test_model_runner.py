"""ModelRunner.execute against transformers' forward on tiny random Llama and Qwen2 checkpoints.

Every scenario the engine produces is checked on logits (allclose) and argmax: a whole
prompt, a prompt fed in chunks across calls, a second sequence reading a first one's
prefix blocks, and a mixed step (decodes + prefill chunks) equal to separate calls.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.engine.config import EngineConfig
from sluice.engine.model_runner import ModelRunner, SeqChunk, auto_dtype, resolve_device
from sluice.engine.models.llama import Linear
from sluice.engine.native import PANEL_ROWS_MAX_AVX512, PanelLinear, cpu_flags, panel_rows_max
from sluice.protocol.errors import InvalidRequestError

BLOCK = 4
ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "smollm3", "granite",
                                        "mixtral", "qwen3_moe", "gemma2", "gemma3"])
def pair(request: pytest.FixtureRequest) -> tuple[ModelRunner, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    directory: Path = request.getfixturevalue(f"tiny_{request.param}_dir")
    runner = ModelRunner(EngineConfig.from_options(str(directory), num_kv_blocks=256,
                                                   block_size=BLOCK, dtype="float32"))
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    return runner, hf


def reference(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def blocks(first: int, n_tokens: int) -> list[int]:
    return list(range(first, first + (n_tokens + BLOCK - 1) // BLOCK))


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, atol=ATOL, rtol=1e-4)
    assert torch.equal(got.cpu().argmax(-1), want.argmax(-1))


PROMPT = "The quick brown fox jumps over the lazy dog, and then it rests."


def test_full_prompt_matches_transformers(pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, hf = pair
    ids = runner.tokenizer.encode(PROMPT)
    ref = reference(hf, ids)
    out = runner.execute([SeqChunk(ids, 0, blocks(1, len(ids)), True)])
    assert out.shape == (1, runner.vocab_size)
    assert_same(out[0], ref[-1])


def test_chunked_prefill_across_calls(pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, hf = pair
    ids = runner.tokenizer.encode(PROMPT)
    ref = reference(hf, ids)
    table = blocks(20, len(ids))
    for lo, hi in ((0, 5), (5, 6), (6, 11), (11, len(ids))):  # unaligned chunk edges
        out = runner.execute([SeqChunk(ids[lo:hi], lo, table, True)])
        assert_same(out[0], ref[hi - 1])


def test_decode_steps_after_prefill(pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, hf = pair
    ids = runner.tokenizer.encode("Once upon a time")
    table = blocks(40, len(ids) + 4)
    out = runner.execute([SeqChunk(ids, 0, table, True)])
    for _ in range(4):
        ids.append(int(out[0].argmax()))
        out = runner.execute([SeqChunk(ids[-1:], len(ids) - 1, table, True)])
        assert_same(out[0], reference(hf, ids)[-1])


def test_shared_prefix_blocks(pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, hf = pair
    first = runner.tokenizer.encode(PROMPT)
    table1 = blocks(60, len(first))
    runner.execute([SeqChunk(first, 0, table1, False)])
    second = first[:2 * BLOCK] + runner.tokenizer.encode(" but a cat")
    table2 = table1[:2] + blocks(80, len(second) - 2 * BLOCK)
    out = runner.execute([SeqChunk(second[2 * BLOCK:], 2 * BLOCK, table2, True)])
    assert_same(out[0], reference(hf, second)[-1])


def test_mixed_batch_equals_separate_calls(pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, hf = pair
    tok = runner.tokenizer
    a, b, c = tok.encode("Hello there, my friend"), tok.encode(PROMPT), tok.encode("One two")
    ta, tb, tc = blocks(90, len(a) + 1), blocks(100, len(b)), blocks(110, len(c) + 1)
    runner.execute([SeqChunk(a, 0, ta, False), SeqChunk(c, 0, tc, False)])
    runner.execute([SeqChunk(b[:3], 0, tb, False)])
    mixed = runner.execute([SeqChunk(b[3:9], 3, tb, True), SeqChunk([7], len(a), ta, True),
                            SeqChunk([11], len(c), tc, True)])
    assert mixed.shape == (3, runner.vocab_size)
    assert_same(mixed[0], reference(hf, b[:9])[-1])
    assert_same(mixed[1], reference(hf, a + [7])[-1])
    assert_same(mixed[2], reference(hf, c + [11])[-1])
    separate = runner.execute([SeqChunk([7], len(a), ta, True)])
    torch.testing.assert_close(separate[0], mixed[1], atol=ATOL, rtol=1e-4)


def test_two_prefill_chunks_of_different_lengths(pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, hf = pair
    tok = runner.tokenizer
    a, b = tok.encode(PROMPT), tok.encode("A short one here")
    ta, tb = blocks(120, len(a)), blocks(140, len(b))
    runner.execute([SeqChunk(a[:4], 0, ta, False)])
    out = runner.execute([SeqChunk(a[4:], 4, ta, True), SeqChunk(b, 0, tb, True)])
    assert_same(out[0], reference(hf, a)[-1])
    assert_same(out[1], reference(hf, b)[-1])


def test_no_logits_requested_and_empty_step(pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, _ = pair
    assert runner.execute([]).shape == (0, runner.vocab_size)
    out = runner.execute([SeqChunk([5, 6, 7], 0, [0], False)])
    assert out.shape == (0, runner.vocab_size)


def test_bad_block_tables_are_rejected(pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, _ = pair
    with pytest.raises(InvalidRequestError, match="block table"):
        runner.execute([SeqChunk([1] * (BLOCK + 1), 0, [3], True)])
    with pytest.raises(InvalidRequestError, match="block id"):
        runner.execute([SeqChunk([1, 2], 0, [runner.num_kv_blocks], True)])


def test_position_past_max_model_len_is_rejected(pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, _ = pair
    table = list(range(runner.max_model_len // BLOCK + 1))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        runner.execute([SeqChunk([1], runner.max_model_len, table, True)])


def test_runner_attributes(pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, _ = pair
    assert runner.num_kv_blocks == 256 and runner.block_size == BLOCK
    assert runner.max_model_len == 2048 and runner.vocab_size == 49152
    assert runner.model_name.startswith("tiny-")
    assert runner.device.type == "cpu" and runner.dtype == torch.float32
    assert runner.tokenizer.eos_token_ids == {2}


def test_float32_linears_run_on_panels(pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    """The scenarios above run through the panels; on AMX machines prefill-sized inputs
    leave them for oneDNN."""
    runner, _ = pair
    panels = [m.matmul for m in runner.model.modules() if isinstance(m, Linear)]
    assert panels and all(isinstance(p, PanelLinear) for p in panels)
    assert {p.most_rows for p in panels} == {panel_rows_max(cpu_flags())}


@pytest.mark.parametrize("flags,want", [
    ({"avx2", "fma"}, None),  # AVX2: the panels at every size
    ({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}, None),  # AMD Zen 4/5
    ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, PANEL_ROWS_MAX_AVX512),
])
def test_prefill_leaves_the_panels_only_where_onednn_measured_ahead(
        flags: set[str], want: int | None) -> None:
    assert panel_rows_max(frozenset(flags)) == want


@pytest.mark.parametrize("device,flags,want", [
    ("cpu", {"avx2", "fma"}, torch.float32),  # AVX2 only: bfloat16 would be emulated
    ("cpu", {"avx2", "avx512f", "avx512bw"}, torch.float32),  # AVX-512 without BF16
    ("cpu", {"avx512f", "avx512_bf16"}, torch.bfloat16),
    ("cpu", {"avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16),
    ("cpu", set(), torch.float32),  # no flags known (not x86 Linux)
    ("cuda", set(), torch.bfloat16),
])
def test_auto_dtype_is_bfloat16_only_with_native_bfloat16(device: str, flags: set[str],
                                                          want: torch.dtype) -> None:
    assert auto_dtype(torch.device(device), frozenset(flags)) == want


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu:0:1", ""])
def test_an_unknown_device_is_refused_by_name(device: str) -> None:
    """Found by a new-user pass: `--device tpu` passed the flag and failed the engine
    core's start with torch's RuntimeError listing twenty device types."""
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig.from_options(None, device=device)
    assert info.value.param == "device"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_refused_by_name() -> None:
    """`--device cuda` on a machine without one failed with torch's AssertionError
    ("Torch not compiled with CUDA enabled")."""
    for device in ("cuda", "cuda:0"):
        with pytest.raises(InvalidRequestError) as info:
            resolve_device(EngineConfig.from_options(None, device=device).model)
        assert info.value.param == "device" and "no CUDA device" in info.value.message
    assert resolve_device(EngineConfig.from_options(None, device="cpu").model)[0].type == "cpu"


def test_the_runner_warms_up_every_layer_before_it_is_used(tiny_llama_dir: Path) -> None:
    """A prefill and a decode ran at construction (readiness comes after a forward), and
    they wrote K/V into block 0 only: no sequence's block is touched."""
    runner = ModelRunner(EngineConfig.from_options(str(tiny_llama_dir), num_kv_blocks=8,
                                                   block_size=BLOCK, dtype="float32"))
    for layer in runner.model.layers:
        kv = layer.attention.kv_cache
        assert kv is not None
        for pool in (kv.k, kv.v):
            assert pool[0].abs().sum() > 0 and not pool[1:].any()


def test_cpu_threads_sets_the_forward_pass_threads(tiny_llama_dir: Path) -> None:
    before = torch.get_num_threads()
    try:
        ModelRunner(EngineConfig.from_options(str(tiny_llama_dir), num_kv_blocks=8,
                                              block_size=BLOCK, dtype="float32", cpu_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(InvalidRequestError) as exc:
        EngineConfig.from_options(str(tiny_llama_dir), cpu_threads=0)
    assert exc.value.param == "cpu_threads"
