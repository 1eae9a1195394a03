"""The engine's one C++ kernel, built on first use: decode attention over the paged pool.

`csrc/paged_attention.cpp` is compiled with torch's own extension builder (g++ and
ninja; cached under `~/.cache/torch_extensions`, so once per machine and source) and
used for float32 decodes on CPU. Where it cannot be built, the engine keeps the plain
PyTorch path (gather the blocks, then SDPA), which gives the same results:

    attention_backend = "auto"    the kernel when it builds, else torch (a warning)
                        "torch"   always gather + SDPA
                        "native"  the kernel, or an error saying why it did not build
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from sluice.protocol.errors import InvalidRequestError

log = logging.getLogger("sluice.engine")

BACKENDS = ("auto", "torch", "native")
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"

DecodeKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float], Tensor]


def _cpu_flags() -> list[str]:
    """Vector flags the build machine has (the cache is per machine, keyed on flags)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    have = set(next((line for line in info.splitlines() if line.startswith("flags")),
                    "").split())
    return [f"-m{f}" for f in ("avx2", "fma", "avx512f") if f in have]


@functools.cache
def _build() -> DecodeKernel:
    from torch.utils.cpp_extension import load

    flags = _cpu_flags()
    # reassociation lets the compiler vectorize the dot products; no -ffast-math (exp, inf)
    cflags = ["-O3", "-fopenmp", "-fassociative-math", "-fno-signed-zeros",
              "-fno-trapping-math", *flags]
    name = "sluice_paged_attention_" + "_".join(f.removeprefix("-m") for f in flags or ["base"])
    t0 = time.perf_counter()
    log.info("loading the CPU paged-attention kernel (built once per machine, ~30 s)")
    module = load(name=name, sources=[str(SOURCE)], extra_cflags=cflags,
                  extra_ldflags=["-fopenmp"], verbose=False)
    log.info("CPU paged-attention kernel ready in %.1fs", time.perf_counter() - t0)
    kernel: DecodeKernel = module.paged_decode_attention
    return kernel


def decode_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> DecodeKernel | None:
    """The kernel to use for decodes, or None for the torch path."""
    if backend not in BACKENDS:
        raise InvalidRequestError(f"attention_backend must be one of {BACKENDS}",
                                  param="attention_backend")
    if backend == "torch":
        return None
    usable = device.type == "cpu" and dtype == torch.float32
    if not usable:
        if backend == "native":
            raise InvalidRequestError("attention_backend 'native' needs device cpu and dtype "
                                      "float32", param="attention_backend")
        return None
    try:
        return _build()
    except Exception as exc:  # no compiler, no headers, ...: say why, keep serving
        if backend == "native":
            raise InvalidRequestError(f"the native attention kernel did not build: {exc}",
                                      param="attention_backend") from exc
        log.warning("CPU paged-attention kernel unavailable (%s); using gather + SDPA",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
