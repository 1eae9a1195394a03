"""How the engine's OpenMP threads wait between parallel ops; set before torch loads
OpenMP (the engine core process, and a zygote before its imports).

After each op torch's OpenMP threads (GNU libgomp) spin `GOMP_SPINCOUNT` times, then
sleep. sluice sets a bounded spin of 100,000 unless the environment already chooses
(`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`): the ~120 ops of a decode step start without a
futex wake-up each, and idle threads still go to sleep so an idle worker leaves its
CPUs to others. Measured on a 2-core AMD EPYC with AVX-512 (2026-12-02, bfloat16,
SmolLM2-135M through HTTP): one stream 24 ms per token with this spin against 37 ms
with `OMP_WAIT_POLICY=PASSIVE`, 32 streams 404 against 307 tokens/s (docs/worker.md).
"""

from __future__ import annotations

import os

SPIN_COUNT = "100000"


def set_wait_policy() -> None:
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
