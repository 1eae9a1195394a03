"""Weight-only int8 linears (`quantization="int8"`, sluice.engine.quant): the quantizer's
rounding; the native kernel (vector path and portable tile path) and the torch fallback
against a float64 product with the same dequantized weights, at odd shapes and 1 to 33
rows; on tiny random Llama / Qwen2 models, greedy tokens against the float (`none`)
path; on the default model (marker `model`), greedy tokens and perplexity."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tests.engine.test_quant import (
    GREEDY_PROMPTS,
    PERPLEXITY_TEXT,
    first_difference,
    greedy,
    mean_nll,
)

from sluice.engine.config import EngineConfig
from sluice.engine.model_runner import ModelRunner, SeqChunk
from sluice.engine.models.llama import Linear, Router
from sluice.engine.native import NativeOps, native_ops
from sluice.engine.quant import quantize_int8, torch_int8_linear
from sluice.protocol.errors import InvalidRequestError

CPU = torch.device("cpu")
# (out, in): SmolLM2's head-sized K, odd K (vector tails), a single output, a single input
SHAPES = [(72, 160), (37, 45), (1, 576), (130, 1), (9, 17)]


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    built = native_ops("native", CPU, torch.float32)  # raises if they do not build
    assert built is not None and built.int8_linear is not None
    return built


def int8_weights(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scales, the dequantized weight in float64) for random weights."""
    g = torch.Generator().manual_seed(seed)
    q, scales = quantize_int8(torch.randn(out, inp, generator=g))
    return q, scales, q.double() * scales.double()[:, None]


def test_quantize_int8_rounds_each_row_to_its_own_scale() -> None:
    w = torch.randn(6, 50)
    w[2] = 0  # an all-zero row: scale 1, no division by zero
    w[4, 7] = -3 * w[4].abs().max()  # the row's absmax is negative: -127
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (6,)
    assert int(q.abs().max()) == 127 and int(q[4, 7]) == -127
    assert scales[2] == 1 and not q[2].any()
    err = (q.float() * scales[:, None] - w).abs()
    assert bool((err <= scales[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 33])
def test_int8_linear_matches_float64_reference(ops: NativeOps, shape: tuple[int, int],
                                               rows: int, portable: bool) -> None:
    assert ops.int8_linear is not None
    out, inp = shape
    q, scales, w = int8_weights(out, inp, seed=out * 1000 + inp + rows)
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, inp), torch.randn(out)
    for b in (None, bias):
        want = x.double() @ w.T + (0 if b is None else b.double())
        got = ops.int8_linear(x, q, scales, b, portable)
        assert got.dtype == torch.float32 and got.shape == (rows, out)
        torch.testing.assert_close(got.double(), want, rtol=1e-4,
                                   atol=1e-4 * float(want.abs().max()))
    # bfloat16 activations: read as float, the output rounded to bfloat16 once
    xb = x.bfloat16()
    got = ops.int8_linear(xb, q, scales, None, portable)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), xb.double() @ w.T, rtol=1e-2,
                               atol=1e-2 * float(got.abs().max()))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [0, 1, 2, 33])
def test_torch_fallback_matches_float64_reference(shape: tuple[int, int], rows: int) -> None:
    out, inp = shape
    q, scales, w = int8_weights(out, inp, seed=rows)
    x, bias = torch.randn(rows, inp), torch.randn(out)
    got = torch_int8_linear(x, q, bias, scales=scales)
    want = x.double() @ w.T + bias.double()
    assert got.shape == (rows, out)
    torch.testing.assert_close(got.double(), want, rtol=1e-4,
                               atol=1e-4 * float(want.abs().max()) if rows else 0.0)


def test_int8_linear_rejects_bad_inputs(ops: NativeOps) -> None:
    assert ops.int8_linear is not None
    q, scales, _ = int8_weights(8, 64, seed=0)
    with pytest.raises(RuntimeError, match="qweight"):
        ops.int8_linear(torch.randn(1, 96), q, scales, None, False)
    with pytest.raises(RuntimeError, match="scales"):
        ops.int8_linear(torch.randn(1, 64), q, scales[:4], None, False)
    with pytest.raises(RuntimeError, match="qweight"):
        ops.int8_linear(torch.randn(1, 64), q.float(), scales, None, False)


def test_unknown_quantization_names_the_choices() -> None:
    with pytest.raises(InvalidRequestError, match="int8") as err:
        EngineConfig.from_options(None, quantization="int4")
    assert err.value.param == "quantization"


def all_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    table = list(range(0, -(-len(ids) // runner.block_size)))
    return runner.execute([SeqChunk(ids, 0, table, True, num_logits=len(ids))])


def top1_agreement(runner: ModelRunner, quant: ModelRunner, ids: list[int]) -> tuple[float, float]:
    """(share of positions whose argmax agrees, relative error of the logits), both paths
    reading the same tokens (teacher forcing: one early flip does not count twice)."""
    want, got = all_logits(runner, ids), all_logits(quant, ids)
    agree = float((want.argmax(-1) == got.argmax(-1)).float().mean())
    return agree, float((got - want).norm() / want.norm())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_tiny_model_on_int8_weights_follows_the_float_path(
        request: pytest.FixtureRequest, arch: str, backend: str) -> None:
    path = str(request.getfixturevalue(f"tiny_{arch}_dir"))
    runner = ModelRunner(EngineConfig.from_options(path, num_kv_blocks=64,
                                                   kernel_backend=backend))
    quant = ModelRunner(EngineConfig.from_options(path, num_kv_blocks=64, kernel_backend=backend,
                                                  quantization="int8"))
    linears = [m for m in quant.model.modules() if isinstance(m, Linear)]
    routers = [m for m in linears if isinstance(m, Router)]  # a mixture of experts' gates
    assert linears and all(m.weight.dtype == torch.int8 for m in linears if m not in routers)
    assert len(routers) == (1 if arch == "qwen3_moe" else 0)  # its layer 1 is dense
    assert all(m.weight.dtype == runner.dtype for m in routers)  # they stay float
    # the embedding stays in the model's float dtype (float32, or bfloat16 where `auto`
    # picks it): int8 holds only the tied head's copy
    assert quant.model.tok_embeddings.weight.dtype == runner.model.tok_embeddings.weight.dtype
    assert quant.model.tok_embeddings.weight.is_floating_point()
    ids = [(t * 37) % 250 + 1 for t in range(96)]
    agree, err = top1_agreement(runner, quant, ids)
    # greedy decoding, prompt by prompt: where the two paths first differ
    first = [first_difference(greedy(runner, ids[8 * i:8 * i + 8], 16, 8 * i),
                              greedy(quant, ids[8 * i:8 * i + 8], 16, 8 * i)) for i in range(4)]
    print(f"{arch}/{backend}: top-1 agreement {agree:.3f}, logits relative error {err:.4f}, "
          f"greedy tokens agreeing before the first difference {first}")
    assert err < 0.05 and agree >= 0.75


@pytest.mark.model
def test_default_model_on_int8_weights_follows_the_float_path(default_gguf: Path) -> None:
    runner = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=64))
    quant = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=64, quantization="int8"))
    tok = runner.tokenizer
    agree = []
    for i, prompt in enumerate(GREEDY_PROMPTS):
        ids = tok.encode(prompt)
        agree.append(first_difference(greedy(runner, ids, 24, 8 * i),
                                      greedy(quant, ids, 24, 8 * i)))
    ids = tok.encode(PERPLEXITY_TEXT)  # every row through the int8 kernel (prefill rows too)
    top1, err = top1_agreement(runner, quant, ids)
    reference, ppl = math.exp(mean_nll(runner, ids)), math.exp(mean_nll(quant, ids))
    print(f"greedy tokens agreeing before the first difference: {agree}; top-1 agreement "
          f"on the text {top1:.3f}, logits relative error {err:.4f}; perplexity: float "
          f"{reference:.4f}, int8 {ppl:.4f}")
    assert top1 >= 0.9
    assert abs(ppl / reference - 1) < 0.01
