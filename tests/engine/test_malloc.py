"""glibc's allocator told to keep freed blocks (sluice.engine.malloc): a step's large
blocks are reused instead of mapped and faulted in afresh; each case runs in its own
process (the settings are process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# a step's shape: 8 blocks of 12 MiB alive at once, then all freed; ten steps; print the
# minor page faults the last nine took
PROBE = """
import resource, sys
from sluice.engine.malloc import keep_freed_memory
print(keep_freed_memory())
def step():
    blocks = [bytearray(12 << 20) for _ in range(8)]
    del blocks
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(9):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def probe(tuning: str) -> tuple[str, int]:
    env = {**os.environ, "SLUICE_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_freed_blocks_are_reused_instead_of_faulted_in_again() -> None:
    """Kept: nine more steps of eight 12 MiB blocks fault in almost no page (the first
    step's are reused); glibc's defaults (SLUICE_MALLOC_TUNING=0) give most of each
    step's memory back and fault it in again (3,072 pages a block)."""
    took, kept = probe("1")
    skipped, default = probe("0")
    assert (took, skipped) == ("True", "False")
    pages = 9 * 8 * 3072
    assert default > pages // 2, default
    assert kept < pages // 20, kept
