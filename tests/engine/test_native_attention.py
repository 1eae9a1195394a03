"""The native decode-attention kernel against the torch path it replaces (gather the
blocks, then SDPA), on scattered block tables, ragged lengths and several head shapes."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.attention import (
    AttentionMetadata,
    KVCache,
    StepLayout,
    build_group,
    paged_attention,
)
from sluice.engine.native import DecodeKernel, decode_kernel
from sluice.protocol.errors import InvalidRequestError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel() -> DecodeKernel:
    built = decode_kernel("native", CPU, torch.float32)  # raises if it does not build
    assert built is not None
    return built


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (4, 2, 24)])
def test_kernel_equals_gather_and_sdpa(kernel: DecodeKernel, heads: int, kv_heads: int,
                                       head_dim: int) -> None:
    torch.manual_seed(heads * head_dim)
    bs, num_blocks = 4, 40
    cache = KVCache(torch.randn(num_blocks, bs, kv_heads, head_dim),
                    torch.randn(num_blocks, bs, kv_heads, head_dim))
    lens = [1, 5, 16, 9]  # tokens before this step's one
    order = torch.randperm(num_blocks).tolist()  # scattered, unordered blocks
    tables, used = [], 0
    for n in lens:
        need = (n + 1 + bs - 1) // bs
        tables.append(order[used:used + need])
        used += need
    layout = StepLayout(bs, heads // kv_heads, CPU, torch.float32)
    group = build_group(0, [1] * len(lens), lens, tables, layout)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, lens, strict=True)])
    q = torch.randn(len(lens), heads, head_dim)
    k, v = torch.randn(len(lens), kv_heads, head_dim), torch.randn(len(lens), kv_heads, head_dim)
    expected = paged_attention(q, k, v, cache, AttentionMetadata(slots, [group]))
    got = paged_attention(q, k, v, cache, AttentionMetadata(slots, [group], kernel))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[0], got[1])  # rows really differ: each read its own blocks


def test_backend_choice() -> None:
    assert decode_kernel("torch", CPU, torch.float32) is None
    assert decode_kernel("auto", CPU, torch.bfloat16) is None  # the kernel is float32 only
    with pytest.raises(InvalidRequestError) as err:
        decode_kernel("native", CPU, torch.bfloat16)
    assert err.value.param == "attention_backend"
    with pytest.raises(InvalidRequestError):
        decode_kernel("flash", CPU, torch.float32)
