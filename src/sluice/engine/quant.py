"""Linears computed on quantized weights: a GGUF file's blocks (`--quantization gguf`)
and int8 weights with one scale per output row (`--quantization int8`).

One decode stream reads every weight once per token, so its step time is the weights'
bytes over the memory's bandwidth: SmolLM2-135M is ~270 MB a token in bfloat16 and
~96 MB as the file's own blocks (Q4_1 layers, a Q8_0 embedding that is also the tied
output head). With `quantization="gguf"` the runner keeps each linear's Q4_0 / Q4_1 /
Q8_0 blocks as they are in the file (rows un-permuted and fused like the dense
weights) and routes rows through `gguf_linear` (csrc/cpu_kernels.cpp):

    rows <= max_rows (decode)   native kernel on the blocks: dequantized in registers,
                                float32 activations, float accumulation
    rows >  max_rows (prefill)  the dense (dequantized) weights through oneDNN

Activations stay float32 (not llama.cpp's on-the-fly Q8 with integer dot products): at a
few rows the step is bound by reading the weights, not by arithmetic, and float
activations keep the kernel's only rounding the file's own, so outputs follow the
dequantized path closely. The dense weights are kept too (memory-mapped from the
weights cache): large batches are compute-bound and oneDNN's bfloat16 GEMM wins there.

With `quantization="int8"` (any float model: safetensors, or a GGUF file's dequantized
weights) every linear's weight is replaced at load by int8 `q` and float32 `scale` per
output row, `scale = absmax(row) / 127`, `q = round(w / scale)`; the dense weights are
dropped (a quarter of float32's bytes, a half of bfloat16's). Every row count runs the
native `int8_linear` (csrc/cpu_kernels.cpp): the int8 weights widened to float in
registers, activations in the model's float dtype (float32 or bfloat16, read as float),
the row's scale applied to the finished dot product. Without the native kernels,
torch ops (`torch_int8_linear`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sluice.engine.models.gguf_file import GGUFFile
from sluice.engine.models.gguf_loader import config_from_gguf, unpermute_qk
from sluice.engine.models.llama import Linear, Router, Transformer
from sluice.engine.native import LinearKernel, NativeOps, route_rows
from sluice.protocol.errors import InvalidRequestError

GGUF_BLOCK_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}  # ggml type -> name; what the kernel takes
# x [M, K], blocks [N, row_bytes] uint8, ggml type, bias -> [M, N] (NativeOps.gguf_linear)
BlockLinear = Callable[[Tensor, Tensor, int, Tensor | None], Tensor]
QUANT_MAX_ROWS = 4  # rows up to which a linear runs on the blocks (decode, small batches)


# the model's fused linears -> the GGUF tensors each concatenates, in order
FUSED_PARTS = {"attention.wqkv": ("attn_q", "attn_k", "attn_v"), "attention.wo": ("attn_output",),
               "feed_forward.w13": ("ffn_gate", "ffn_up"), "feed_forward.w2": ("ffn_down",)}


def fused_blocks(gguf: GGUFFile) -> Iterator[tuple[str, Tensor, int]]:
    """(module name, uint8 blocks [out, row_bytes], ggml type) for every linear whose
    GGUF tensors are all one supported block type, fused as the model fuses them."""
    cfg, permuted = config_from_gguf(gguf)
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    for i in range(cfg.num_layers):
        blk = f"blk.{i}."
        for module, names in FUSED_PARTS.items():
            tensors = [(blk + n + ".weight", heads.get(n) if permuted else None) for n in names]
            found = _blocks(gguf, tensors)
            if found is not None:
                yield f"layers.{i}.{module}", *found
    head = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
    found = _blocks(gguf, [(head, None)])
    if found is not None:
        yield "output", *found


def _blocks(gguf: GGUFFile, tensors: list[tuple[str, int | None]]) -> tuple[Tensor, int] | None:
    if any(name not in gguf.tensors for name, _ in tensors):  # e.g. a layer of experts
        return None
    types = {gguf.tensors[name].ggml_type for name, _ in tensors}
    if len(types) != 1 or next(iter(types)) not in GGUF_BLOCK_TYPES:
        return None
    rows = []
    for name, heads in tensors:
        raw = torch.from_numpy(gguf.raw(name).copy())
        rows.append(unpermute_qk(raw, heads) if heads else raw)
    return torch.cat(rows).contiguous(), types.pop()


def quantized_linear(blocks: Tensor, ggml_type: int, kernel: BlockLinear,
                     dense: LinearKernel, max_rows: int) -> LinearKernel:
    """A Linear's matmul: its blocks for up to `max_rows` rows, `dense` (the dequantized
    weight) above."""

    def on_blocks(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return kernel(x, blocks, ggml_type, bias)

    return route_rows(on_blocks, dense, max_rows)


def use_gguf_weights(model: Transformer, gguf_path: Path, native: NativeOps | None,
                     max_rows: int = QUANT_MAX_ROWS) -> dict[str, tuple[Tensor, int]]:
    """Point every linear with supported blocks at them for up to `max_rows` rows, its
    current matmul (the runner's: oneDNN on the packed dense weight) above; returns
    {module name: (blocks, ggml type)} of those linears (what the decode graph runs on).

    Mutates the model's Linear modules (their `matmul`); the dense weights stay."""
    if native is None or native.gguf_linear is None:
        raise InvalidRequestError("quantization 'gguf' needs the native CPU kernels (device "
                                  "cpu, kernel_backend auto or native, a C++ compiler)",
                                  param="quantization")
    from sluice.engine.models.gguf_file import read_gguf

    modules: dict[str, nn.Module] = dict(model.named_modules())
    used: dict[str, tuple[Tensor, int]] = {}
    for name, blocks, ggml_type in fused_blocks(read_gguf(gguf_path)):
        module = modules.get(name)
        if not isinstance(module, Linear) or blocks.shape[0] != module.weight.shape[0]:
            continue
        module.matmul = quantized_linear(blocks, ggml_type, native.gguf_linear, module.matmul,
                                         max_rows)
        used[name] = (blocks, ggml_type)
    return used


# x [M, K], int8 weight [N, K], float32 scales [N], bias, portable -> [M, N]
Int8Linear = Callable[[Tensor, Tensor, Tensor, Tensor | None, bool], Tensor]


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output row: (q [N, K] int8, scales [N] float32) with
    `q = round(w / scale)` in [-127, 127], `scale = absmax(row) / 127` (1 for a zero row)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def int8_linear(scales: Tensor, kernel: Int8Linear | None) -> LinearKernel:
    """A Linear's matmul on its int8 weight (passed as `weight`) and these row scales:
    the native kernel, or without one torch's weight-only int8 matmul."""
    if kernel is not None:
        native = kernel

        def on_int8(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
            return native(x, weight, scales, bias, False)

        return on_int8
    return functools.partial(torch_int8_linear, scales=scales)


def torch_int8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, *,
                      scales: Tensor) -> Tensor:
    """x @ (weight * scales[:, None]).T + bias in torch ops (no native kernels): torch's
    `_weight_int8pack_mm` for one CPU row (its loop is ~35x slower than oneDNN at 32 rows
    on the dev machine), else the weight dequantized for the call and F.linear."""
    if x.shape[0] == 1 and x.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm"):
        y = torch._weight_int8pack_mm(x.contiguous(), weight, scales.to(x.dtype))
        return y if bias is None else y + bias
    return F.linear(x, weight.to(x.dtype) * scales.to(x.dtype)[:, None], bias)


def use_int8_weights(model: Transformer, native: NativeOps | None) -> int:
    """Replace every Linear's weight by its int8 quantization (`quantize_int8`) and point
    its matmul at the int8 kernel; returns the int8 bytes. Mutates the model's Linear
    modules (`weight` becomes an int8 [N, K] parameter, `matmul` knows the scales); a
    tied output head gets its own int8 copy, the embedding and a mixture of experts'
    router stay float."""
    kernel = native.int8_linear if native is not None else None
    total = 0
    for module in model.modules():
        if isinstance(module, Linear) and not isinstance(module, Router):
            q, scales = quantize_int8(module.weight)
            module.weight = nn.Parameter(q, requires_grad=False)
            module.matmul = int8_linear(scales.to(q.device), kernel)
            total += q.numel() + 4 * scales.numel()
    return total
