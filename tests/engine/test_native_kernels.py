"""The native CPU kernels against the PyTorch ops they replace: decode attention (gather
the blocks, then SDPA) on scattered block tables, ragged lengths and several head
shapes; the fused residual add + RMSNorm; SiLU-and-mul; the few-rows GEMV; oneDNN's linear against F.linear."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from sluice.engine.attention import (
    AttentionGroup,
    AttentionMetadata,
    KVCache,
    StepLayout,
    build_group,
    paged_attention,
)
from sluice.engine.models.llama import RMSNorm, RopeConfig, apply_rope, rope_tables
from sluice.engine.native import (
    SMALL_ROWS_MAX,
    NativeOps,
    PackedLinear,
    PackedSwiGLU,
    PanelLinear,
    cpu_linear,
    native_ops,
    onednn_linear,
    onednn_packing,
    onednn_swiglu,
    swiglu_rows_min,
    with_small_rows,
)
from sluice.protocol.errors import InvalidRequestError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    built = native_ops("native", CPU, torch.float32)  # raises if they do not build
    assert built is not None
    return built


@dataclass
class DecodeStep:
    """One decode step's inputs: a pool of random K/V, each row's blocks scattered
    through it (in no order), the group, the new tokens' slots and their q, k, v."""

    cache: KVCache
    layout: StepLayout
    group: AttentionGroup
    slots: torch.Tensor
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def decode_step(lens: list[int], heads: int, kv_heads: int, head_dim: int,
                num_blocks: int, bs: int = 4) -> DecodeStep:
    """Rows with `lens` tokens before this step's one."""
    cache = KVCache(torch.randn(num_blocks, bs, kv_heads, head_dim),
                    torch.randn(num_blocks, bs, kv_heads, head_dim))
    order = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in lens:
        need = (n + 1 + bs - 1) // bs
        tables.append(order[used:used + need])
        used += need
    layout = StepLayout(bs, heads // kv_heads, CPU, torch.float32)
    group = build_group(0, [1] * len(lens), lens, tables, layout)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, lens, strict=True)])
    qkv = (torch.randn(len(lens), heads, head_dim), torch.randn(len(lens), kv_heads, head_dim),
           torch.randn(len(lens), kv_heads, head_dim))
    return DecodeStep(cache, layout, group, slots, qkv)


# AVX-512 builds take 64-wide heads with 1-4 query heads a KV head and 128-wide with 1-2
# in one pass over V (attend_one16), the rest (12 / 2) the per-head loops, 24-wide and
# 256-wide (Gemma's) the scalar ones; a
# step of 4 rows gives each (row, KV head) a unit, one of 40 rows each row all its KV
# heads (attend_rows, from 4 rows a thread)
@pytest.mark.parametrize("rows", [4, 40])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (4, 2, 24),
                                                     (8, 2, 64), (4, 2, 128), (12, 2, 64),
                                                     (4, 1, 256), (8, 4, 256)])
def test_decode_attention_equals_gather_and_sdpa(ops: NativeOps, heads: int, kv_heads: int,
                                                 head_dim: int, rows: int) -> None:
    torch.manual_seed(heads * head_dim + rows)
    step = decode_step([1, 5, 16, 9] * (rows // 4), heads, kv_heads, head_dim, 240)
    (q, k, v), cache, group, slots = step.qkv, step.cache, step.group, step.slots
    expected = paged_attention(q, k, v, cache, AttentionMetadata(slots, [group]))
    got = paged_attention(q, k, v, cache,
                          AttentionMetadata(slots, [group], ops.paged_decode_attention))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[0], got[1])  # rows really differ: each read its own blocks


@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize("window", [1, 6, 13, None])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 2, 24), (4, 1, 128),
                                                     (4, 1, 256)])
def test_decode_attention_in_a_sliding_window(ops: NativeOps, heads: int, kv_heads: int,
                                              head_dim: int, window: int | None,
                                              softcap: float | None) -> None:
    """A sliding-window layer's decodes (Gemma's): the native kernel reads each row's last
    `window` context rows alone, from wherever in a block the window starts, and equals
    the masked SDPA path; contexts shorter than the window see all of theirs. With Gemma
    2's cap on the scores too, which changes the outputs (every kernel variant: head
    sizes 64 and 128 on AVX-512's and the 8-wide loops, 24 and 256 on the scalar ones)."""
    torch.manual_seed((window or 50) * head_dim)
    lens = [0, 5, 16, 9, 30, 2, 21, 13]
    step = decode_step(lens, heads, kv_heads, head_dim, 64)
    (q, k, v), cache, group, slots = step.qkv, step.cache, step.group, step.slots
    layout = step.layout
    expected = paged_attention(q, k, v, cache, AttentionMetadata(slots, [group], layout=layout),
                               window, softcap)
    native = AttentionMetadata(slots, [group], ops.paged_decode_attention, layout=layout)
    got = paged_attention(q, k, v, cache, native, window, softcap)
    # the decodes stayed on the native kernel
    assert native.masked(window, every=softcap is not None)[0] is group
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if softcap is not None and window != 1:  # (a row that sees one key weighs it 1)
        uncapped = paged_attention(q, k, v, cache, native, window)
        assert not torch.allclose(got[1:], uncapped[1:], atol=1e-3)
    if window is None:
        return
    whole = paged_attention(q, k, v, cache, AttentionMetadata(slots, [group], layout=layout),
                            None, softcap)
    short = [i for i, n in enumerate(lens) if n + 1 <= window]
    longer = [i for i, n in enumerate(lens) if n + 1 > window]
    torch.testing.assert_close(got[short], whole[short], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[longer], whole[longer], atol=1e-3)


# 64-row units (kPrefillTile): chunks of 1-150 rows, starting at position 0 (a fresh
# prompt) or after context already in the pool (a prefix hit, a later chunk)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (37, None), (None, 0.5),
                                                 (37, 0.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (4, 1, 16),
                                                     (6, 2, 48)])
def test_prefill_attention_equals_padded_sdpa(ops: NativeOps, heads: int, kv_heads: int,
                                              head_dim: int, dtype: torch.dtype,
                                              window: int | None,
                                              softcap: float | None) -> None:
    """Prefill chunks through `paged_prefill_attention` equal the masked SDPA over the
    padded batch (the path without the kernel): causal within a chunk, each chunk reading
    only its own blocks, scattered through the pool; in a sliding window (Gemma's local
    layers), each row's keys before its window given no weight; scores capped (Gemma 2)."""
    assert ops.paged_prefill_attention is not None
    torch.manual_seed(heads * head_dim)
    bs, num_blocks = 16, 120
    cache = KVCache(torch.randn(num_blocks, bs, kv_heads, head_dim, dtype=dtype),
                    torch.randn(num_blocks, bs, kv_heads, head_dim, dtype=dtype))
    chunks = [(139, 0), (1, 0), (70, 200), (150, 33), (2, 5)]  # (rows, start position)
    order = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n, start in chunks:
        need = (start + n + bs - 1) // bs
        tables.append(order[used:used + need])
        used += need
    q_lens, starts = [n for n, _ in chunks], [s for _, s in chunks]
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, (n, s) in zip(tables, chunks, strict=True)
                          for p in range(s, s + n)])
    rows = sum(q_lens)
    q = torch.randn(rows, heads, head_dim, dtype=dtype)
    k = torch.randn(rows, kv_heads, head_dim, dtype=dtype)
    v = torch.randn(rows, kv_heads, head_dim, dtype=dtype)
    plain = StepLayout(bs, heads // kv_heads, CPU, dtype)
    native = StepLayout(bs, heads // kv_heads, CPU, dtype, native_prefill=True)
    expected = paged_attention(q, k, v, cache, AttentionMetadata(
        slots, [build_group(0, q_lens, starts, tables, plain)], layout=plain), window, softcap)
    group = build_group(0, q_lens, starts, tables, native)
    assert group.mask is None and group.q_starts is not None
    meta = AttentionMetadata(slots, [group], prefill_kernel=ops.paged_prefill_attention,
                             layout=native)
    got = paged_attention(q, k, v, cache, meta, window, softcap)
    if window is not None or softcap is not None:  # on the native kernel
        assert meta.masked(window, every=softcap is not None)[0] is group
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    # a chunk's first row sees only the context before it and itself: its output does not
    # change when the chunk's later rows' K/V do
    k2 = k.clone()
    k2[1:139] = torch.randn(138, kv_heads, head_dim, dtype=dtype)
    again = paged_attention(q, k2, v, cache, AttentionMetadata(
        slots, [group], prefill_kernel=ops.paged_prefill_attention, layout=native), window,
        softcap)
    assert torch.equal(again[0], got[0]) and not torch.equal(again[1], got[1])
    if softcap is not None:  # the cap changes the outputs
        uncapped = paged_attention(q, k, v, cache, meta, window)
        assert not torch.allclose(got[1:].float(), uncapped[1:].float(), atol=1e-2)
    if window is not None:  # the window hides what the whole context would show
        whole = paged_attention(q, k, v, cache, AttentionMetadata(
            slots, [group], prefill_kernel=ops.paged_prefill_attention, layout=native), None,
            softcap)
        torch.testing.assert_close(got[:window].float(), whole[:window].float())
        assert not torch.allclose(got[window:139].float(), whole[window:139].float(),
                                  atol=1e-2)


def test_prefill_attention_refuses_bad_inputs(ops: NativeOps) -> None:
    kernel = ops.paged_prefill_attention
    assert kernel is not None
    pool = torch.zeros(4, 16, 1, 64)
    q, table = torch.zeros(10, 2, 64), torch.zeros(1, 4, dtype=torch.long)
    lens, starts = torch.tensor([10]), torch.tensor([0, 10])
    assert kernel(q, pool, pool, table, starts, lens, 0.125).shape == (10, 2, 64)
    with pytest.raises(RuntimeError, match="q_starts span q"):
        kernel(q, pool, pool, table, torch.tensor([0, 9]), lens, 0.125)
    with pytest.raises(RuntimeError, match="rows / context / blocks"):
        kernel(q, pool, pool, table, starts, torch.tensor([65]), 0.125)  # past its blocks
    with pytest.raises(RuntimeError, match="head size a multiple of 16"):
        kernel(torch.zeros(10, 2, 24), torch.zeros(4, 16, 1, 24), torch.zeros(4, 16, 1, 24),
               table, starts, lens, 0.125)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_fused_add_rms_norm_equals_torch(ops: NativeOps, rows: int) -> None:
    torch.manual_seed(rows)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(rows, 96), torch.randn(rows, 96)
    expected_x, expected_residual = norm.add(x.clone(), residual.clone())  # torch ops
    norm.fused = ops.fused_add_rms_norm
    got_x, got_residual = norm.add(x.clone(), residual.clone())
    torch.testing.assert_close(got_residual, expected_residual, rtol=0, atol=0)  # same adds
    torch.testing.assert_close(got_x, expected_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(expected_residual, x + residual)


@pytest.mark.parametrize("rotary", [64, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_rotates_q_and_k_in_place(ops: NativeOps, dtype: torch.dtype,
                                                   rotary: int) -> None:
    """The native RoPE on the Q and K heads of a QKV output equals apply_rope: float32 to
    rounding, bfloat16 bit for bit (x * cos rounded first, as torch's two ops round); V's
    columns are not touched. Tables narrower than a head (Phi-4-mini's 3/4 of it) rotate
    that part of each head and leave the rest as it was."""
    assert ops.rotary_embedding is not None
    torch.manual_seed(0)
    rows, heads, kv_heads, d = 37, 6, 2, 64
    cos_t, sin_t = rope_tables(RopeConfig(theta=10000.0), rotary, 512)
    positions = torch.randint(0, 512, (rows,))
    cos, sin = cos_t.to(dtype)[positions].unsqueeze(1), sin_t.to(dtype)[positions].unsqueeze(1)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d).to(dtype)
    before = qkv.clone()
    qk = qkv[:, :(heads + kv_heads) * d].view(rows, heads + kv_heads, d)
    ops.rotary_embedding(qk, cos, sin)
    src = before[:, :(heads + kv_heads) * d].view(rows, heads + kv_heads, d)
    want = apply_rope(src, cos, sin)
    if dtype == torch.float32:
        torch.testing.assert_close(qk, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(qk, want)
    assert not torch.equal(qk[..., :rotary], src[..., :rotary])  # it rotated
    assert torch.equal(qk[..., rotary:], src[..., rotary:])  # the unrotated part kept
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], before[:, (heads + kv_heads) * d:])
    with pytest.raises(RuntimeError, match="rotary_embedding"):
        ops.rotary_embedding(qk, cos[:-1], sin[:-1])  # a row's tables missing
    with pytest.raises(RuntimeError, match="rotary_embedding"):  # wider than a head
        wide = torch.cat((cos, cos), -1)
        ops.rotary_embedding(qk, wide, wide)


def test_backend_choice() -> None:
    assert native_ops("torch", CPU, torch.float32) is None
    assert native_ops("auto", CPU, torch.float16) is None  # float32 and bfloat16 only
    with pytest.raises(InvalidRequestError) as err:
        native_ops("native", CPU, torch.float16)
    assert err.value.param == "kernel_backend"
    with pytest.raises(InvalidRequestError):
        native_ops("flash", CPU, torch.float32)


@pytest.mark.parametrize("rows", [1, 32, 300])
def test_onednn_linear_equals_f_linear_in_float32(rows: int) -> None:
    linear = cpu_linear("auto", CPU, torch.float32)
    assert linear is not None  # torch's CPU wheels ship oneDNN
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, 576), torch.randn(1536, 576), torch.randn(1536)
    exact = (x.double() @ w.double().T + b.double()).float()
    # float32 accuracy: within a few float32 rounding steps of the float64 result
    torch.testing.assert_close(linear(x, w, b), exact, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, w, None), torch.nn.functional.linear(x, w),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_equals_the_plain_weight_and_falls_back(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # oneDNN reorders bfloat16 weights only with avx512bw/vl/dq or avx_ne_convert:
        # on an AVX2-only CPU the check says no, and the runner keeps the plain weights
        assert not onednn_packing(dtype)
        return
    assert onednn_packing(dtype)
    torch.manual_seed(0)
    w, b = torch.randn(960, 576, dtype=dtype), torch.randn(960, dtype=dtype)
    calls: list[int] = []

    def fallback(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return onednn_linear(x, weight, bias)

    packed = PackedLinear(w, fallback, few_rows=2)
    for rows in (3, 32, 139):  # decode batches and a prefill, one layout
        x = torch.randn(rows, 576, dtype=dtype)
        for bias in (None, b):
            torch.testing.assert_close(packed(x, w, bias), onednn_linear(x, w, bias),
                                       rtol=1e-5, atol=1e-4)
    assert calls == []
    packed(torch.randn(2, 576, dtype=dtype), w, None)  # few rows
    packed(torch.randn(8, 576, dtype=dtype), w.clone(), None)  # not the packed weight
    assert calls == [2, 8]


def test_packed_swiglu_equals_silu_and_mul_and_feed_forward_uses_it_only_on_its_linear(
        ops: NativeOps) -> None:
    """bfloat16 SwiGLU as two oneDNN matmuls with swish and mul epilogues: within
    bfloat16 rounding of silu(x @ gate.T) * (x @ up.T) in float64; a FeedForward takes it
    only while its gate|up linear runs on the PackedLinear it was made from, without a
    LoRA side, in its dtype and from min_rows rows (else the unfused path: its linear,
    then silu_and_mul). Where it is used: Intel's AMX generation only."""
    assert swiglu_rows_min(frozenset({"avx512f", "amx_bf16", "amx_tile"})) == 256
    assert swiglu_rows_min(frozenset({"avx512f", "avx512_bf16"})) is None
    from sluice.engine.models.llama import FeedForward

    dtype = torch.bfloat16
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert not onednn_swiglu(dtype)  # no bfloat16 reorder here: the runner keeps it off
        return
    assert onednn_swiglu(dtype)
    torch.manual_seed(0)
    ff = FeedForward(hidden_size=64, intermediate_size=96).to(dtype).requires_grad_(False)
    for lin in (ff.w13, ff.w2):
        lin.weight.data.normal_(0, 0.1)
        lin.matmul = PackedLinear(lin.weight, torch.nn.functional.linear)
    ff.fused = ops.silu_and_mul
    fused = ff.swiglu = PackedSwiGLU(ff.w13.matmul, 8)
    x = torch.randn(37, 64, dtype=dtype)
    gate, up = (x.double() @ ff.w13.weight.double().T).chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    got = fused(x).double()
    assert ((got - exact).abs() <= 0.02 * exact.abs() + 0.02 * float(exact.abs().mean())).all()
    calls: list[int] = []
    fused_call = PackedSwiGLU.__call__

    def counted(self: PackedSwiGLU, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return fused_call(self, x)

    PackedSwiGLU.__call__ = counted  # type: ignore[method-assign]
    try:
        unfused = ff.w2.matmul(ops.silu_and_mul(ff.w13.matmul(x, ff.w13.weight, None)),
                               ff.w2.weight, None)
        torch.testing.assert_close(ff(x).float(), ff.w2.matmul(fused(x), ff.w2.weight,
                                                                 None).float())
        assert calls == [37, 37]
        torch.testing.assert_close(ff(x[:7]), unfused[:7])  # under min_rows: unfused
        ff.w13.lora = lambda x, y: None  # a LoRA side: the unfused path
        torch.testing.assert_close(ff(x), unfused)
        ff.w13.lora = None
        ff.w13.matmul = torch.nn.functional.linear  # another route in front: unfused
        torch.testing.assert_close(ff(x).float(), unfused.float(), rtol=2e-2, atol=2e-2)
        assert calls == [37, 37]
    finally:
        PackedSwiGLU.__call__ = fused_call  # type: ignore[method-assign]


def test_linear_backend_choice() -> None:
    assert cpu_linear("torch", CPU, torch.float32) is None
    assert cpu_linear("auto", torch.device("cuda"), torch.bfloat16) is None  # cuBLAS there


def test_a_failed_build_falls_back_in_auto_and_is_an_error_in_native(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import sluice.engine.native as native

    def no_compiler() -> NativeOps:
        raise RuntimeError("error: g++: command not found")

    monkeypatch.setattr(native, "load_kernels", no_compiler)
    with caplog.at_level("WARNING", logger="sluice.engine"):
        assert native_ops("auto", CPU, torch.float32) is None
    assert "g++: command not found" in caplog.text
    with pytest.raises(InvalidRequestError) as err:
        native_ops("native", CPU, torch.float32)
    assert err.value.param == "kernel_backend" and "did not build" in str(err.value)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_and_mul_equals_torch(ops: NativeOps, rows: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * 80) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_at_large_gates(ops: NativeOps, dtype: torch.dtype) -> None:
    """Gates far below zero (a real model's, e.g. -100) give 0, not NaN: exp(-gate)
    overflowed in the compiler's vector expf under -ffast-math (the AVX-512 build)."""
    gate = torch.tensor([-1000.0, -100.0, -90.0, -88.5, -50.0, 0.0, 50.0, 1000.0] * 4)
    x = torch.cat([gate, torch.full_like(gate, 2.0)])[None].to(dtype)
    got = ops.silu_and_mul(x).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, (torch.nn.functional.silu(gate) * 2)[None].to(dtype).float(),
                               rtol=1e-2, atol=1e-6)


def test_bfloat16_kernels_equal_torch_within_bfloat16_rounding(ops: NativeOps) -> None:
    torch.manual_seed(5)
    bf16 = torch.bfloat16
    bs, heads, kv_heads, d = 4, 9, 3, 64
    cache = KVCache(torch.randn(12, bs, kv_heads, d, dtype=bf16),
                    torch.randn(12, bs, kv_heads, d, dtype=bf16))
    lens, tables = [3, 9], [[5, 2], [7, 0, 11]]
    layout = StepLayout(bs, heads // kv_heads, CPU, bf16)
    group = build_group(0, [1, 1], lens, tables, layout)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, lens, strict=True)])
    q = torch.randn(2, heads, d, dtype=bf16)
    k, v = torch.randn(2, kv_heads, d, dtype=bf16), torch.randn(2, kv_heads, d, dtype=bf16)
    expected = paged_attention(q, k, v, cache, AttentionMetadata(slots, [group]))
    got = paged_attention(q, k, v, cache,
                          AttentionMetadata(slots, [group], ops.paged_decode_attention))
    assert got.dtype == bf16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)

    x = torch.randn(4, 2 * 80, dtype=bf16)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x).float(),
                               (torch.nn.functional.silu(gate) * up).float(),
                               rtol=2e-2, atol=2e-2)
    norm = RMSNorm(96, 1e-5).to(bf16)
    h, residual = torch.randn(3, 96, dtype=bf16), torch.randn(3, 96, dtype=bf16)
    expected_h, expected_residual = norm.add(h.clone(), residual.clone())
    norm.fused = ops.fused_add_rms_norm
    got_h, got_residual = norm.add(h.clone(), residual.clone())
    torch.testing.assert_close(got_residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(got_h.float(), expected_h.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", range(1, SMALL_ROWS_MAX + 1))
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (100, 37)])  # 100, 37: tails
def test_small_rows_linear_equals_float64(ops: NativeOps, rows: int, k: int, n: int) -> None:
    torch.manual_seed(rows * k + n)
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    exact = x.double() @ w.double().T
    torch.testing.assert_close(ops.small_rows_linear(x, w, b), (exact + b.double()).float(),
                               rtol=1e-5, atol=1e-4)
    got = ops.small_rows_linear(x, w, None)
    torch.testing.assert_close(got, exact.float(), rtol=1e-5, atol=1e-4)
    # each row's result is the same whatever else is in the batch
    for i in range(rows):
        assert torch.equal(got[i], ops.small_rows_linear(x[i:i + 1], w, None)[0])


def test_with_small_rows_sends_only_few_float32_rows_to_the_gemv(ops: NativeOps) -> None:
    calls: list[int] = []

    def fallback(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, w, b)

    linear = with_small_rows(ops, fallback)
    w = torch.randn(40, 64)
    for rows in (1, SMALL_ROWS_MAX, SMALL_ROWS_MAX + 1, 0):
        linear(torch.randn(rows, 64), w, None)
    linear(torch.randn(2, 64, dtype=torch.bfloat16), w.bfloat16(), None)
    assert calls == [SMALL_ROWS_MAX + 1, 0, 2]


# rows 7, 8: blocks of 4 + 3 / 4 (AVX2's 6-row blocks); 13, 25: 7 + 6 / 9 + 8 + 8 (AVX-512's 12)
@pytest.mark.parametrize("rows", [1, 5, 7, 8, 13, 25, 32, 64])
# panels (AVX-512 takes them in pairs): 60; 36; 3, the last partial (a pair and one alone);
# 2, the last partial (in the pair)
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (100, 37), (64, 20)])
def test_panel_linear_equals_float64(ops: NativeOps, rows: int, k: int, n: int) -> None:
    assert ops.pack_panels is not None and ops.panel_linear is not None
    torch.manual_seed(rows * k + n)
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    panels = ops.pack_panels(w)
    assert panels.shape == ((n + 15) // 16, k, 16)
    exact = x.double() @ w.double().T
    torch.testing.assert_close(ops.panel_linear(x, panels, n, b), (exact + b.double()).float(),
                               rtol=1e-5, atol=1e-4)
    got = ops.panel_linear(x, panels, n, None)
    torch.testing.assert_close(got, exact.float(), rtol=1e-5, atol=1e-4)
    # each row's result is the same whatever else is in the batch (same order of sums)
    for i in (0, rows - 1):
        assert torch.equal(got[i], ops.panel_linear(x[i:i + 1], panels, n, None)[0])


def test_panel_linear_routes_rows_and_refuses_bad_shapes(ops: NativeOps) -> None:
    calls: list[int] = []

    def fallback(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, w, b)

    w = torch.randn(40, 64)
    linear = PanelLinear(w, fallback, ops, few_rows=SMALL_ROWS_MAX)
    for rows in (SMALL_ROWS_MAX, SMALL_ROWS_MAX + 1, 2048, 0):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x, w, None), x @ w.T, rtol=1e-5, atol=1e-4)
    linear(torch.randn(8, 64), w.clone(), None)  # not the packed weight
    linear(torch.randn(8, 64, dtype=torch.bfloat16), w.bfloat16(), None)
    assert calls == [SMALL_ROWS_MAX, 0, 8, 8]
    assert ops.panel_linear is not None
    with pytest.raises(RuntimeError, match="panel_linear"):
        ops.panel_linear(torch.randn(3, 63), linear.panels, 40, None)  # K differs
    with pytest.raises(RuntimeError, match="panel_linear"):
        ops.panel_linear(torch.randn(3, 64), linear.panels, 60, None)  # N needs 4 panels
    with pytest.raises(RuntimeError, match="panel_linear: bias"):
        ops.panel_linear(torch.randn(3, 64), linear.panels, 40, torch.randn(39))


@pytest.mark.parametrize("vocab", [49152, 100])  # 100: a partial last word
def test_apply_token_bitmask_equals_xgrammar(ops: NativeOps, vocab: int) -> None:
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(0)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, words), generator=gen, dtype=torch.int32)
    bitmask[1] = 0  # all disallowed
    bitmask[2] = -1  # all allowed
    bitmask[3, ::2] = 0
    logits = torch.randn(6, vocab, generator=gen)
    want, got = logits.clone(), logits.clone()
    rows = [0, 1, 2, 3, 5]
    xgr.apply_token_bitmask_inplace(want, bitmask, indices=rows)
    ops.apply_token_bitmask(got, bitmask, torch.tensor(rows), float("-inf"))
    assert torch.equal(got, want)
    assert torch.equal(got[4], logits[4])  # a row not listed is untouched


def test_every_checkout_builds_from_one_path_per_source(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build's commands name the source's path: two checkouts of the same source must
    hand the builder the same path (else each rebuilds for the other), a changed source
    must not reuse it."""
    import sluice.engine.native as native

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    first = native._stable_copy("sluice_kernels_x_1", b"int f() { return 1; }")
    again = native._stable_copy("sluice_kernels_x_1", b"int f() { return 1; }")
    assert first == again and first.read_bytes() == b"int f() { return 1; }"
    assert tmp_path / "home" in first.parents
    other = native._stable_copy("sluice_kernels_x_2", b"int f() { return 2; }")
    assert other != first and other.read_bytes() == b"int f() { return 2; }"


def need_bf16_path(ops: NativeOps) -> str:
    assert ops.bf16_linear_path is not None
    path = ops.bf16_linear_path()
    if not path:
        pytest.skip("no bfloat16 linear path here: the CPU has neither AMX (amx_bf16, "
                    "amx_tile, the tile state granted) nor avx512_bf16")
    assert path in ("amx", "avx512_bf16"), path
    return path


# rows: passes of 2 row blocks on AMX (70: the last with one), row blocks of up to 12 on
# AVX512-BF16 (5, 17, 70: uneven); n: pairs of 16-output panels (48, 16: the last pair
# with one panel)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 70])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (64, 48), (32, 16)])
def test_bf16_linear_equals_float64(ops: NativeOps, rows: int, k: int, n: int) -> None:
    """x rounded to bfloat16 times the bfloat16 weight, summed in float32, on whichever
    path this machine has (AMX tiles or AVX512-BF16's pair dot products)."""
    need_bf16_path(ops)
    assert ops.pack_bf16 is not None and ops.bf16_linear is not None
    torch.manual_seed(rows * k + n)
    x, w, b = torch.randn(rows, k), torch.randn(n, k).bfloat16(), torch.randn(n)
    packed = ops.pack_bf16(w)
    assert packed.shape == (n // 16, k // 32, 16, 32)
    exact = x.bfloat16().double() @ w.double().T
    torch.testing.assert_close(ops.bf16_linear(x, packed, b), (exact + b.double()).float(),
                               rtol=1e-5, atol=1e-4)
    got = ops.bf16_linear(x, packed, None)
    torch.testing.assert_close(got, exact.float(), rtol=1e-5, atol=1e-4)
    for i in (0, rows - 1):  # a row alone: the same sums, bit for bit
        assert torch.equal(ops.bf16_linear(x[i:i + 1], packed, None)[0], got[i])
    with pytest.raises(RuntimeError, match="bf16_linear"):
        ops.bf16_linear(torch.randn(rows, k + 32), packed, None)  # K differs
    with pytest.raises(RuntimeError, match="pack_bf16"):
        ops.pack_bf16(torch.randn(n + 8, k).bfloat16())  # N not a multiple of 16


def test_a_process_without_the_virtualenv_on_path_reuses_the_build() -> None:
    """The kernels are built with the `ninja` package's binary whatever PATH says: a
    process whose PATH finds another ninja first (a system ninja 1.11 beside the
    package's 1.13) rebuilt them (~40 s), and the next process with the virtualenv's
    PATH rebuilt them again (found by a new-user pass: 15 rebuilds in 40 minutes)."""
    import os
    import shutil
    import subprocess
    import sys

    import ninja  # type: ignore[import-untyped]
    from torch.utils.cpp_extension import get_default_build_root

    from sluice.engine.native import load_kernels, pinned_ninja

    load_kernels()  # built (or found) by this process
    saved = os.environ.get("PATH")
    with pinned_ninja():
        assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
    assert os.environ.get("PATH") == saved
    logs = sorted(Path(get_default_build_root()).glob("sluice_kernels_*/.ninja_log"))
    before = {p: p.read_text() for p in logs}
    path = os.pathsep.join(d for d in (os.environ.get("PATH") or "").split(os.pathsep)
                           if Path(d).resolve() != Path(ninja.BIN_DIR).resolve())
    subprocess.run([sys.executable, "-c", "from sluice.engine.native import load_kernels; "
                    "load_kernels()"], env={**os.environ, "PATH": path or "/usr/bin:/bin"},
                   check=True, timeout=600)
    assert {p: p.read_text() for p in logs} == before  # nothing was built again
