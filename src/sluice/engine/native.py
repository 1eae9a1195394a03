"""The engine's CPU kernels: several in C++, built on first use, and oneDNN's linear.

`csrc/cpu_kernels.cpp` holds these kernels (float32 or bfloat16 storage, float math):

- `paged_decode_attention`: decode attention read straight from the paged pool. The
  torch path gathers each sequence's blocks into a dense tensor every layer, then runs
  SDPA: the context is read twice and written once; the kernel reads it once.
- `paged_prefill_attention`: prefill chunks' causal attention from the pool, each
  chunk as long as it is (SDPA took them padded to one length, with a mask, computing
  every row against every column).
- `fused_add_rms_norm`: the residual add and the RMSNorm after it in one pass, in
  place (vLLM's op of that name); torch's add plus RMSNorm cost ~20 us a call at one row.
- `silu_and_mul`: SwiGLU's `silu(gate) * up` in one pass (vLLM's op of that name).
- `rotary_embedding`: RoPE in place on a step's Q and K heads, one pass (vLLM's op of
  that name, on sluice's cos / signed-sin tables).
- `small_rows_linear`: a float32 GEMV for 1-4 rows (one stream's decode), which streams
  the weights faster than oneDNN's on AVX2 (`with_small_rows` routes those rows to it).
- `pack_panels` / `panel_linear`: a float32 linear of 5 or more rows on its weight
  packed once into 16-column k-major panels (`PanelLinear`: on the AVX2 dev machine
  1.2-1.4x oneDNN from 8 to 256 rows; on AVX-512, two panels at a time, up to 128 rows).
- `gguf_linear`: a linear on GGUF Q4_0 / Q4_1 / Q8_0 blocks (sluice.engine.quant).
- `int8_linear`: a linear on int8 weights with one scale per output row
  (`--quantization int8`, sluice.engine.quant).
- `pack_bf16` / `bf16_linear`: a bfloat16 linear on its weight packed once into pairs
  of inputs per 16 outputs, on AMX tiles or AVX512-BF16's `vdpbf16ps`
  (`bf16_linear_path` says which, each compiled where /proc/cpuinfo has it).
- `DecodeGraph`: a whole decode step (every layer and the head) in one call
  (sluice.engine.decode_graph), over GGUF blocks, float32 panels or bfloat16 pairs; its
  Q4 linears take int8 activations (`q4_int8_path` says which vector path: AVX512-VNNI,
  AVX-512BW or AVX2, each compiled where /proc/cpuinfo has it), and with AVX512-VNNI its
  Q8_0 head too (`int8_activation_types`).
- `apply_token_bitmask`: structured output's grammar mask applied to the logits word by
  word (xgrammar's own CPU kernel tests every bit: ~6 ms for 32 rows of SmolLM2's vocab).

It is compiled with torch's own extension builder (g++ and ninja; cached under
`~/.cache/torch_extensions` under a name keyed by the vector flags and a hash of the
source, built from a copy of the source at a path named the same way, so once per CPU
kind and source, whichever checkout asks; a cache shared between machines never loads
a build made for another CPU's instructions). Where it cannot be built,
the engine keeps the plain PyTorch ops, which compute the same thing:

    kernel_backend = "auto"    the kernels when they build (CPU; float32, bfloat16), else torch
                     "torch"   always the PyTorch ops (and F.linear)
                     "native"  the kernels, or an error saying why they did not build

`cpu_linear` (below) is separate: it needs no build, only torch's own oneDNN, and
`kernel_backend="torch"` turns it off too; so is `PackedLinear`, oneDNN's linear on a
weight reordered once into oneDNN's own blocked layout.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sluice.engine.config import KERNEL_BACKENDS
from sluice.protocol.errors import InvalidRequestError

log = logging.getLogger("sluice.engine")

CPU_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels and oneDNN take here
SMALL_ROWS_MAX = 4  # rows up to which a float32 linear is a native GEMV (small_rows_linear)
# rows above which a float32 linear leaves the panels for oneDNN (PanelLinear), where
# oneDNN was measured ahead at prefill sizes: `panel_rows_max`
PANEL_ROWS_MAX_AVX512 = 128
SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"

# q [B, H, D], k_pool, v_pool, block_tables [B, n], context_lens [B], scale -> [B, H, D]
# (q, k_pool, v_pool, block_tables, context_lens, scale, window: 0 or a sliding window's,
# softcap: 0 or Gemma 2's cap on the scores)
DecodeKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float, int, float], Tensor]
# q [T, H, D] (chunks' rows back to back), k_pool, v_pool, block_tables [B, n],
# q_starts [B + 1], context_lens [B], scale -> [T, H, D]: causal, each chunk's rows
# against its sequence's context in the pool (its own K/V written there first)
# (q, k_pool, v_pool, block_tables, q_starts, context_lens, scale, window: 0 or a sliding
# window's, softcap: 0 or a cap)
PrefillKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float, int, float],
                         Tensor]
# x, residual [T, hidden], weight [hidden], eps: residual += x; x = norm(residual) * w
AddNormKernel = Callable[[Tensor, Tensor, Tensor, float], None]
# [T, 2I] = gate | up -> silu(gate) * up [T, I]
ActivationKernel = Callable[[Tensor], Tensor]
# x [T, heads, D] (a view: rows apart, heads D apart), cos, signed sin [T, 1, D]: x
# rotated in place (llama.apply_rope)
RopeKernel = Callable[[Tensor, Tensor, Tensor], None]
# x [T, in], weight [out, in], bias [out] | None -> [T, out]  (F.linear's signature)
LinearKernel = Callable[[Tensor, Tensor, Tensor | None], Tensor]


@dataclass(frozen=True)
class NativeOps:
    paged_decode_attention: DecodeKernel
    fused_add_rms_norm: AddNormKernel
    silu_and_mul: ActivationKernel
    small_rows_linear: LinearKernel  # float32, 1 to SMALL_ROWS_MAX rows
    # logits [B, V] f32, bitmask [B, W] int32, rows [R] int64, fill: masked logits = fill
    apply_token_bitmask: Callable[[Tensor, Tensor, Tensor, float], None]
    # multi-LoRA decode rows (sluice.engine.lora): x, y, a, [b per part], slots [D],
    # rank, num_slots, [column offset of each part in y]; y updated in place
    lora_bgmv: Callable[[Tensor, Tensor, Tensor, list[Tensor], Tensor, int, int, list[int]],
                        None] | None = None
    # x [M, K] float32/bfloat16, GGUF blocks [N, bytes] uint8, ggml type, bias -> [M, N]
    # (sluice.engine.quant)
    gguf_linear: Callable[[Tensor, Tensor, int, Tensor | None], Tensor] | None = None
    # x [M, K] float32/bfloat16, int8 weight [N, K], float32 scales [N], bias, portable
    # (the tile path, for tests) -> [M, N] (sluice.engine.quant)
    int8_linear: Callable[[Tensor, Tensor, Tensor, Tensor | None, bool], Tensor] | None = None
    # the C++ class behind sluice.engine.decode_graph (its constructor), and the vector
    # path its Q4 x int8 dot products were built with here ("" for none)
    decode_graph: Callable[..., Any] | None = None
    q4_int8_path: Callable[[], str] | None = None
    # x [M, K] float32, Q4 blocks, ggml type, bias: the graph's Q4 x int8 linear alone
    gguf_linear_int8: Callable[[Tensor, Tensor, int, Tensor | None], Tensor] | None = None
    # float32 weight [N, K] -> panels [ceil(N / 16), K, 16]; x [M, K], panels, N, bias ->
    # [M, N]: a float32 linear of 5 or more rows (`PanelLinear`)
    pack_panels: Callable[[Tensor], Tensor] | None = None
    panel_linear: Callable[[Tensor, Tensor, int, Tensor | None], Tensor] | None = None
    # bfloat16 linears (the decode graph's): where they run here ("amx", "avx512_bf16"
    # or "" for neither); bfloat16 weight [N, K] -> its packed pairs int16 [N / 16, K /
    # 32, 16, 32] (AMX's tiles); x [M, K] float32, packed, bias -> [M, N] float32 (x
    # rounded to bfloat16, float32 sums)
    bf16_linear_path: Callable[[], str] | None = None
    pack_bf16: Callable[[Tensor], Tensor] | None = None
    bf16_linear: Callable[[Tensor, Tensor, Tensor | None], Tensor] | None = None
    # the ggml types those int8-activation linears take here: Q4_0, Q4_1, and Q8_0 where
    # the build has AVX512-VNNI ([] where q4_int8_path is "")
    int8_activation_types: Callable[[], list[int]] | None = None
    rotary_embedding: RopeKernel | None = None
    paged_prefill_attention: PrefillKernel | None = None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (/proc/cpuinfo's `flags`; empty off x86 Linux)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line for line in info.splitlines() if line.startswith("flags")),
                          "").split())


# /proc/cpuinfo flag -> the compiler's option for it: the instructions the kernels use;
# the -D ones enable a section's own target (the decode graph's Q4 x int8 dot products,
# its bfloat16 linears on AVX512-BF16)
BUILD_FLAGS = {"avx2": "-mavx2", "fma": "-mfma", "f16c": "-mf16c", "avx512f": "-mavx512f",
               "avx512bw": "-DSLUICE_AVX512BW", "avx512_vnni": "-DSLUICE_AVX512VNNI",
               "avx512_bf16": "-DSLUICE_AVX512BF16",
               "amx_tile": "-mamx-tile", "amx_bf16": "-mamx-bf16"}


def _cpu_flags() -> list[str]:
    """Vector flags the build machine has (the cache is per machine, keyed on flags)."""
    have = cpu_flags()
    return [option for flag, option in BUILD_FLAGS.items() if flag in have]


@functools.cache
def load_kernels() -> NativeOps:
    """The kernels, built on the first call on this machine and cached (per process too)."""
    from torch.utils.cpp_extension import load

    flags = _cpu_flags()
    # -ffast-math lets the compiler vectorize the dot products (reassociation) and the
    # softmax's exp (glibc's vector expf, within 4 ulp); the kernels see no inf or NaN
    cflags = ["-O3", "-fopenmp", "-ffast-math", *flags]
    # keyed by the vector flags and the source: a cache shared between machines (or
    # checkouts) never loads a build for another CPU, nor rebuilds back and forth
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:10]
    name = "_".join(["sluice_kernels", *(f.removeprefix("-m").removeprefix("-DSLUICE_").lower()
                                         .replace("-", "") for f in flags or ["-mbase"]),
                     digest])
    t0 = time.perf_counter()
    log.info("loading the engine's CPU kernels (built once per machine, ~45 s)")
    with pinned_ninja():
        module = load(name=name, sources=[str(_stable_copy(name, source))],
                      extra_cflags=cflags, extra_ldflags=["-fopenmp"], verbose=False)
    log.info("CPU kernels ready in %.1fs", time.perf_counter() - t0)
    return NativeOps(module.paged_decode_attention, module.fused_add_rms_norm,
                     module.silu_and_mul, module.small_rows_linear, module.apply_token_bitmask,
                     module.lora_bgmv, module.gguf_linear, module.int8_linear,
                     module.DecodeGraph, module.q4_int8_path, module.gguf_linear_int8,
                     module.pack_panels, module.panel_linear, module.bf16_linear_path,
                     module.pack_bf16, module.bf16_linear,
                     module.int8_activation_types, module.rotary_embedding,
                     module.paged_prefill_attention)


@contextlib.contextmanager
def pinned_ninja() -> Iterator[None]:
    """torch builds with the first `ninja` on PATH; this puts the `ninja` package's (a
    dependency) first while it builds. Two ninja versions sharing one build folder each
    read the other's log as a changed command (1.11 and 1.13 hash commands differently)
    and rebuild, ~40 s, whenever the other built last: a process started with the
    virtualenv's bin on PATH and one without (a system ninja) took turns rebuilding."""
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        yield
        return
    saved = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(p for p in (ninja.BIN_DIR, saved) if p)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = saved


def _stable_copy(name: str, source: bytes) -> Path:
    """The source at a path that depends on its content only
    (`~/.cache/sluice/kernels/NAME.cpp`): the build's commands name the source's path,
    so every checkout building from its own path would rebuild it (~45 s) for the next
    one. SOURCE itself where that folder is not writable."""
    path = Path.home() / ".cache" / "sluice" / "kernels" / f"{name}.cpp"
    try:
        if not path.is_file() or path.read_bytes() != source:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(source)
            os.replace(tmp, path)
    except OSError:
        return SOURCE
    return path


def native_ops(backend: str, device: torch.device, dtype: torch.dtype) -> NativeOps | None:
    """The kernels to use, or None for the PyTorch ops."""
    if backend not in KERNEL_BACKENDS:
        raise InvalidRequestError(f"kernel_backend must be one of {KERNEL_BACKENDS}",
                                  param="kernel_backend")
    if backend == "torch":
        return None
    if device.type != "cpu" or dtype not in CPU_DTYPES:
        if backend == "native":
            raise InvalidRequestError("kernel_backend 'native' needs device cpu and dtype "
                                      "float32 or bfloat16", param="kernel_backend")
        return None
    try:
        return load_kernels()
    except Exception as exc:  # no compiler, no headers, ...: say why, keep serving
        if backend == "native":
            raise InvalidRequestError(f"the native CPU kernels did not build: {exc}",
                                      param="kernel_backend") from exc
        log.warning("native CPU kernels unavailable (%s); using the PyTorch ops",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear through oneDNN (the op Inductor uses for CPU linears)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def cpu_linear(backend: str, device: torch.device, dtype: torch.dtype) -> LinearKernel | None:
    """oneDNN's matmul for the model's linears on CPU, or None for F.linear.

    torch's CPU `F.linear` goes to MKL, which on the AMD dev machine runs SmolLM2's
    shapes 2x slower than oneDNN at every row count (32 rows: 115 vs 228 GFLOP/s;
    one row: 20.5 vs 15.9 ms for all of a token's layer weights), in full float32.
    Checked against F.linear once before use.
    """
    if backend == "torch" or device.type != "cpu" or dtype not in CPU_DTYPES:
        return None
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn,
                                                               "_linear_pointwise"):
        return None
    x, w, b = (torch.randn(3, 64, dtype=dtype), torch.randn(40, 64, dtype=dtype),
               torch.randn(40, dtype=dtype))
    try:
        ok = all(torch.allclose(onednn_linear(x, w, bias), F.linear(x, w, bias),
                                rtol=1e-2, atol=1e-2) for bias in (None, b))
    except RuntimeError as exc:
        log.warning("oneDNN linear unavailable (%s); using F.linear", exc)
        return None
    if not ok:
        log.warning("oneDNN linear disagrees with F.linear; using F.linear")
        return None
    return onednn_linear


def route_rows(few: LinearKernel, many: LinearKernel, max_rows: int,
               dtypes: tuple[torch.dtype, ...] = CPU_DTYPES) -> LinearKernel:
    """A linear that sends inputs of 1 to `max_rows` rows in one of `dtypes` to `few` and
    the rest (0 rows, more rows, another dtype) to `many`. How the small-rows GEMV and
    the quantized linears (sluice.engine.quant) split decode rows from prefill rows."""

    def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if 0 < x.shape[0] <= max_rows and x.dtype in dtypes:
            return few(x, weight, bias)
        return many(x, weight, bias)

    return linear


def with_small_rows(ops: NativeOps, fallback: LinearKernel) -> LinearKernel:
    """A linear that sends float32 inputs of at most SMALL_ROWS_MAX rows (one stream's
    decode step, the output head of a few) to the native GEMV and the rest to `fallback`.

    On the AVX2 dev machine oneDNN reads a token's layer weights at ~14 GB/s in a one-row
    decode; the GEMV streams them at close to the memory's rate.
    """
    return route_rows(ops.small_rows_linear, fallback, SMALL_ROWS_MAX, (torch.float32,))


PACK_BATCH_HINT = 64  # the row count oneDNN's weight layout is picked for (any rows work)


def onednn_packing(dtype: torch.dtype) -> bool:
    """Whether oneDNN can reorder a weight once (`PackedLinear`) and gives the same
    results with it as with the plain weight, checked on a small shape."""
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    x, w = torch.randn(8, 64, dtype=dtype), torch.randn(40, 64, dtype=dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError as exc:
        log.warning("oneDNN weight packing unavailable (%s)", exc)
        return False
    return torch.allclose(got, onednn_linear(x, w, None), rtol=1e-2, atol=1e-2)


class PackedLinear:
    """A Linear's matmul: oneDNN's on its weight reordered once, at start, into oneDNN's
    blocked layout; `fallback` for inputs of at most `few_rows` rows, another weight
    (the module's was replaced) or another dtype.

    With the plain `[out, in]` weight, oneDNN's matmul (AMX or AVX-512 brgemm) copies
    it into that layout on every call: on a 2-core Sapphire Rapids this cut a bfloat16
    decode step's linears at 32 rows from 23.4 to 17.2 ms and at one row from 20.3 to
    13.7 ms (float32, 32 rows: 55.5 to 47.3 ms). The reordered copy is the process's own
    memory (the plain weight stays, for the other kernels and for LoRA).
    """

    def __init__(self, weight: Tensor, fallback: LinearKernel, few_rows: int = 0) -> None:
        self.weight = weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        self.fallback = fallback
        self.few_rows = few_rows

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if weight is not self.weight or x.shape[0] <= self.few_rows or x.dtype != weight.dtype:
            return self.fallback(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def bf16_packable(weight: Tensor) -> bool:
    """Whether `pack_bf16` takes `weight`: bfloat16 `[N, K]` with N % 16 == 0 and
    K % 32 == 0 (tiles of 16 outputs x 32 inputs)."""
    return weight.dtype == torch.bfloat16 and not weight.shape[0] % 16 and not weight.shape[1] % 32


class FloatHead:
    """A bfloat16 model's output head with float32 logits: `bf16_linear` (AMX tiles or
    AVX512-BF16, float32 accumulation and output) on the head weight packed once, the
    decode graph's own packing where it has one. Through oneDNN the logits came out in
    bfloat16, whose steps are 0.125 apart at SmolLM2's logit sizes (16-32): the prompt's
    first token was picked from logits rounded so coarsely that two tokens 0.08 apart
    tied, and the tie went to the lower id, where the decode graph (float32 logits)
    would pick the other; the same prompt then answered differently with its prefix
    cached (a one-token step, on the graph) and without. `fallback` for another weight
    or a shape the packing does not take."""

    def __init__(self, weight: Tensor, packed: Tensor, ops: NativeOps,
                 fallback: LinearKernel) -> None:
        assert ops.bf16_linear is not None
        self.weight, self.packed = weight, packed
        self.linear = ops.bf16_linear
        self.fallback = fallback

    @classmethod
    def build(cls, weight: Tensor, ops: NativeOps | None, fallback: LinearKernel,
              packed: Tensor | None = None) -> FloatHead | None:
        """The head on `packed` (or a new packing of `weight`), or None where there is no
        native bfloat16 linear or the weight is not a bfloat16 `[N % 16, K % 32]`."""
        if (ops is None or ops.bf16_linear is None or ops.pack_bf16 is None
                or ops.bf16_linear_path is None or not ops.bf16_linear_path()
                or not bf16_packable(weight)):
            return None
        tiles = packed if packed is not None else ops.pack_bf16(weight.detach())
        return cls(weight, tiles, ops, fallback)

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if weight is not self.weight:
            return self.fallback(x, weight, bias)
        if x.shape[0] == 0:  # a prefill chunk that wants no logits (the kernel takes rows)
            return x.new_empty((0, weight.shape[0]), dtype=torch.float32)
        return self.linear(x.float(), self.packed, bias)


class PackedSwiGLU:
    """SwiGLU's `silu(x @ gate.T) * (x @ up.T)` as two oneDNN matmuls with fused
    epilogues, on the gate and up halves of a fused gate|up weight, each reordered once:
    the first applies swish (silu) to its output, the second multiplies its output by
    the first's (Inductor's linear + binary fusion). No `[T, 2I]` intermediate and no
    separate SiLU-and-mul pass over it; silu(gate) is rounded to the dtype before the
    product (the unfused path rounds gate and up, then rounds their product). `packed`
    is the gate|up linear's `PackedLinear`: FeedForward fuses only while the linear still
    runs on it (a GGUF or LoRA route in front of it keeps the unfused path), and only for
    inputs of at least `min_rows` rows (`swiglu_rows_min`).
    """

    def __init__(self, packed: PackedLinear, min_rows: int) -> None:
        self.packed = packed
        self.min_rows = min_rows
        gate, up = packed.weight.chunk(2, dim=0)
        self.gate = torch.ops.mkldnn._reorder_linear_weight(gate.contiguous(), PACK_BATCH_HINT)
        self.up = torch.ops.mkldnn._reorder_linear_weight(up.contiguous(), PACK_BATCH_HINT)
        self.dtype = packed.weight.dtype

    def __call__(self, x: Tensor) -> Tensor:
        gate = torch.ops.mkldnn._linear_pointwise(x, self.gate, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.up, None, "mul")


def swiglu_rows_min(flags: frozenset[str]) -> int | None:
    """Rows from which a bfloat16 SwiGLU runs as `PackedSwiGLU`, or None (never).

    Only where measured: Intel's AMX generation (a 2-core Sapphire Rapids, 2026-12-04,
    the whole model's step, fused against unfused alternated in one process, medians of
    14): prompts of 139 tokens prefilled 1 / 2 / 4 / 8 / 14 at a time 46.2 / 78.9 / 141.8
    / 249.0 / 376.3 ms unfused, 46.4 / 71.9 / 120.0 / 222.0 / 313.1 fused; a step of 31
    decodes and one prompt (170 rows) 61.1 unfused, 64.2 fused: two half-width matmuls
    lose to one under ~200 rows. Again on a 2-core Xeon with AMX (family 6 model 167,
    2026-12-05, medians of 10 alternated): 4 / 14 prompts 137 / 369 ms unfused, 121 /
    314 fused (single steps swung up to 2.4x their median on that host, so a profile of
    one step can show either as the slow one). On a 2-core AMD Zen 4 (avx512_bf16, no
    AMX; 2026-12-05, the same check, medians of 8): 1 / 4 / 14 prompts 115.2 / 399.0 /
    1,311.9 ms unfused, 111.2 / 386.4 / 1,277.1 fused, 3%, within that host's noise, so
    off there; elsewhere unmeasured.
    """
    return 256 if "amx_bf16" in flags else None


def onednn_swiglu(dtype: torch.dtype) -> bool:
    """Whether oneDNN's swish and mul epilogues run here and agree with silu(g) * u."""
    x, w = torch.randn(8, 64, dtype=dtype), torch.randn(80, 64, dtype=dtype) * 0.1
    try:
        got = PackedSwiGLU(PackedLinear(w, F.linear), 0)(x)
    except RuntimeError as exc:
        log.warning("oneDNN's fused SwiGLU unavailable (%s)", exc)
        return False
    gate, up = F.linear(x.float(), w.float()).chunk(2, dim=-1)
    want = F.silu(gate) * up
    return torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def panel_rows_max(flags: frozenset[str]) -> int | None:
    """Rows above which float32 linears leave the panels for oneDNN, or None (never).

    Only on Intel's AMX generation (`amx_tile`; a 2-core Sapphire Rapids, hot cache:
    oneDNN 402-432 GFLOP/s at 2,048 rows against the panels' 300-324, even at 128-192).
    On AMD's AVX-512 the panels lead at every size in the model, weights cold as in a
    step: a 2-core Zen 5 (family 26, 2026-12-04), one prompt prefilled alone, medians,
    panels / oneDNN on the plain weight (the fallback) / oneDNN on its packed copy:
    139 tokens 84.9 / 102.9 / 87.0 ms, 512 tokens 365.5 / 532.3 / 514.3 ms, 2,048
    tokens 2,077 / 2,281 / 2,101 ms (a second run: 84.5 / 100.0 / 89.1, 363.6 / 390.0 /
    513.9, 2,063 / 2,144 / 2,386). AVX2 builds keep the panels everywhere too (their
    docstring's measurements)."""
    return PANEL_ROWS_MAX_AVX512 if "amx_tile" in flags and "avx512f" in flags else None


class PanelLinear:
    """A float32 Linear's matmul on its weight packed once into the native kernel's
    panels (`pack_panels`: 16 output columns, k-major) for inputs of more than `few_rows`
    rows (decode batches and prefill chunks); `fallback` for the rest, for another weight
    (the module's was replaced) or another dtype.

    On the 2-core AMD EPYC (AVX2 only), the linears of all 30 layers and the head with
    the weights cold, as in a step, against oneDNN on its own reordered weight: 32 rows
    96 -> 72 ms (120 GFLOP/s, ~60% of the FMA units' rate), 64 rows 161 -> 129 ms, 256
    rows 1.27x, 1,024 rows about even; a step of 14 prompts of 139 tokens 1.6x against
    oneDNN on the plain weight (which it reorders on every call). The panels replace
    oneDNN's reordered copy (the same memory; the plain weight stays, for the other
    kernels and for LoRA).

    On AVX-512 the kernel takes two panels at a time in 16-float vectors; `most_rows`
    sends larger inputs (prefill) to `fallback` where that was measured faster
    (`panel_rows_max`): on a 2-core Sapphire Rapids (hot cache) the panels ran 317-350
    GFLOP/s at 32 rows against oneDNN's 194-253, but 300-324 at 2,048 rows against its
    402-432 (about even at 128-192).
    """

    def __init__(self, weight: Tensor, fallback: LinearKernel, ops: NativeOps,
                 few_rows: int = 0, most_rows: int | None = None) -> None:
        assert ops.pack_panels is not None and ops.panel_linear is not None
        self.weight = weight
        self.panels = ops.pack_panels(weight)
        self.kernel = ops.panel_linear
        self.fallback = fallback
        self.few_rows = few_rows
        self.most_rows = most_rows

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        rows = x.shape[0]
        if (weight is not self.weight or x.dtype != torch.float32 or rows <= self.few_rows
                or (self.most_rows is not None and rows > self.most_rows)):
            return self.fallback(x, weight, bias)
        return self.kernel(x, self.panels, weight.shape[0], bias)
