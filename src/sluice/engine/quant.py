"""Linears computed on a GGUF file's quantized blocks (`--quantization gguf`).

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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from sluice.engine.models.gguf_file import GGUFFile
from sluice.engine.models.gguf_loader import config_from_gguf, unpermute_qk
from sluice.engine.models.llama import Linear, Transformer
from sluice.engine.native import LinearKernel, NativeOps
from sluice.protocol.errors import InvalidRequestError

QUANTIZATIONS = ("none", "gguf")
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

    def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if 0 < x.shape[0] <= max_rows:
            return kernel(x, blocks, ggml_type, bias)
        return dense(x, weight, bias)

    return linear


def use_gguf_weights(model: Transformer, gguf_path: Path, native: NativeOps | None,
                     dense: LinearKernel, max_rows: int = QUANT_MAX_ROWS) -> dict[str, int]:
    """Point every linear with supported blocks at them; returns {ggml type name: count}.

    Mutates the model's Linear modules (their `matmul`); the dense weights stay."""
    if native is None or native.gguf_linear is None:
        raise InvalidRequestError("quantization 'gguf' needs the native CPU kernels (device "
                                  "cpu, kernel_backend auto or native, a C++ compiler)",
                                  param="quantization")
    from sluice.engine.models.gguf_file import read_gguf

    modules: dict[str, nn.Module] = dict(model.named_modules())
    counts: dict[str, int] = {}
    for name, blocks, ggml_type in fused_blocks(read_gguf(gguf_path)):
        module = modules.get(name)
        if not isinstance(module, Linear) or blocks.shape[0] != module.weight.shape[0]:
            continue
        module.matmul = quantized_linear(blocks, ggml_type, native.gguf_linear, dense, max_rows)
        counts[GGUF_BLOCK_TYPES[ggml_type]] = counts.get(GGUF_BLOCK_TYPES[ggml_type], 0) + 1
    return counts
