"""Linears on GGUF blocks (`quantization="gguf"`, sluice.engine.quant): the native kernel
against a float64 product with the same dequantized weights, for Q4_0, Q4_1 and Q8_0 and
1 to 33 rows; the fused blocks against the loader's dense weights; and on the default
model, greedy tokens and perplexity against the dequantized (`none`) path."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sluice.engine.config import EngineConfig
from sluice.engine.model_runner import ModelRunner, SeqChunk
from sluice.engine.models.gguf_file import read_gguf
from sluice.engine.models.gguf_loader import config_from_gguf, convert_weights
from sluice.engine.native import NativeOps, native_ops
from sluice.engine.quant import GGUF_BLOCK_TYPES, fused_blocks, use_gguf_weights
from sluice.protocol.errors import InvalidRequestError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    built = native_ops("native", CPU, torch.float32)  # raises if they do not build
    assert built is not None and built.gguf_linear is not None
    return built


def quantized(ggml_type: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights in `ggml_type` blocks, and those blocks dequantized (float64)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind = GGMLQuantizationType(ggml_type)
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = quantize(w, kind)
    dense = dequantize(blocks, kind).reshape(rows, cols).astype(np.float64)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(dense)


@pytest.mark.parametrize("ggml_type", sorted(GGUF_BLOCK_TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 33])
def test_gguf_linear_matches_float64_reference(ops: NativeOps, ggml_type: int, rows: int) -> None:
    assert ops.gguf_linear is not None
    blocks, w = quantized(ggml_type, 72, 160, seed=ggml_type * 100 + rows)
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, 160), torch.randn(72)
    for b in (None, bias):
        want = x.double() @ w.T + (0 if b is None else b.double())
        got = ops.gguf_linear(x, blocks, ggml_type, b)
        assert got.dtype == torch.float32 and got.shape == (rows, 72)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())
    # bfloat16 activations: read as float, the output rounded to bfloat16 once
    xb = x.bfloat16()
    got = ops.gguf_linear(xb, blocks, ggml_type, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), xb.double() @ w.T, rtol=1e-2,
                               atol=1e-2 * float(got.abs().max()))


def test_gguf_linear_rejects_bad_shapes(ops: NativeOps) -> None:
    assert ops.gguf_linear is not None
    blocks, _ = quantized(3, 8, 64, seed=0)
    with pytest.raises(RuntimeError, match="K / 32 blocks"):
        ops.gguf_linear(torch.randn(1, 96), blocks, 3, None)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        ops.gguf_linear(torch.randn(1, 64), blocks, 12, None)


def test_fused_blocks_are_the_loaders_dense_weights(default_gguf: Path) -> None:
    """Q|K|V (un-permuted), gate|up and the tied head's blocks, dequantized, are the
    weights the dequantizing loader gives the model."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    gguf = read_gguf(default_gguf)
    cfg, permuted = config_from_gguf(gguf)
    dense = convert_weights(gguf, cfg, permuted)
    found = {name: (blocks, t) for name, blocks, t in fused_blocks(gguf)}
    assert len(found) == 4 * cfg.num_layers + 1  # every linear and the head: none left dense
    want = {"layers.0.attention.wqkv": torch.cat([dense[f"model.layers.0.self_attn.{n}_proj.weight"]
                                                  for n in "qkv"]),
            "layers.0.feed_forward.w13": torch.cat([dense["model.layers.0.mlp.gate_proj.weight"],
                                                    dense["model.layers.0.mlp.up_proj.weight"]]),
            "output": dense["model.embed_tokens.weight"]}
    for name, weight in want.items():
        blocks, t = found[name]
        got = dequantize(blocks.numpy(), GGMLQuantizationType(t)).reshape(weight.shape)
        assert torch.equal(torch.from_numpy(np.ascontiguousarray(got, dtype=np.float32)), weight)


def test_quantization_option_is_checked(tiny_llama_dir: Path) -> None:
    with pytest.raises(InvalidRequestError) as err:
        EngineConfig.from_options(None, quantization="awq")
    assert err.value.param == "quantization"
    with pytest.raises(InvalidRequestError) as err:  # a safetensors checkpoint has no blocks
        ModelRunner(EngineConfig.from_options(str(tiny_llama_dir), num_kv_blocks=8,
                                              quantization="gguf"))
    assert err.value.param == "quantization"


# a fixed text for perplexity (the model's own kind of English prose)
PERPLEXITY_TEXT = (
    "The river begins in the mountains, where snow melts each spring and runs down through "
    "pine forests into a wide valley. Farmers in the valley have used its water for "
    "centuries to grow wheat, barley and apples. In the summer the river is slow and warm, "
    "and children swim in the shallow pools near the old stone bridge. In the autumn heavy "
    "rains can raise the water quickly, so the town built a wall along the bank to keep the "
    "streets dry. Today the river is also a source of electricity: a small dam upstream "
    "turns the flow into power for the homes and shops of the town.")

GREEDY_PROMPTS = ["The three primary colors are", "def fibonacci(n):",
                  "Once upon a time, in a small village,", "The capital of France is"]


def greedy(runner: ModelRunner, ids: list[int], n: int, first_block: int) -> list[int]:
    table = list(range(first_block, first_block + 8))
    logits = runner.execute([SeqChunk(ids, 0, table, True)])
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[0].argmax()))
        logits = runner.execute([SeqChunk(out[-1:], len(ids) + len(out) - 1, table, True)])
    return out


def first_difference(want: list[int], got: list[int]) -> int:
    """How many tokens two greedy decodings agree on before they first differ."""
    return next((j for j, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), len(want))


def mean_nll(runner: ModelRunner, ids: list[int]) -> float:
    """Mean next-token negative log-likelihood of `ids` (every row's logits)."""
    table = list(range(0, -(-len(ids) // runner.block_size)))
    logits = runner.execute([SeqChunk(ids, 0, table, True, num_logits=len(ids))])
    return float(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])))


@pytest.mark.model
def test_default_model_on_gguf_blocks_follows_the_dequantized_path(default_gguf: Path) -> None:
    # gguf_linear in the torch model (enforce_eager: the decode graph has its own tests,
    # tests/engine/test_decode_graph.py); float32 both, as the graph's activations are
    runner = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=64, dtype="float32"))
    quant = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=64, quantization="gguf",
                                                  dtype="float32", enforce_eager=True))
    tok = runner.tokenizer
    agree = []
    for i, prompt in enumerate(GREEDY_PROMPTS):
        ids = tok.encode(prompt)
        agree.append(first_difference(greedy(runner, ids, 24, 8 * i),
                                      greedy(quant, ids, 24, 8 * i)))
    print("greedy tokens agreeing before the first difference:", agree)
    assert sum(agree) >= 0.75 * 24 * len(GREEDY_PROMPTS) and min(agree) >= 4
    # perplexity: every row through the blocks (rows past QUANT_MAX_ROWS too)
    ids = tok.encode(PERPLEXITY_TEXT)
    reference = math.exp(mean_nll(runner, ids))
    use_gguf_weights(quant.model, default_gguf, quant.native, max_rows=1 << 20)
    ppl = math.exp(mean_nll(quant, ids))
    print(f"perplexity: dequantized {reference:.4f}, gguf blocks {ppl:.4f}")
    assert abs(ppl / reference - 1) < 0.01

