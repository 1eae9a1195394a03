"""The engine's step log: what each step ran and how long it took, as the server saw it.

`--step-log DIR` (engine option `step_log`) makes each engine core append to
`DIR/steps-<pid>.jsonl`:

    {"model": ..., "block_size": 16, "num_kv_blocks": N, "max_num_seqs": ...,
     "max_num_batched_tokens": ...}                       first line: the engine's shape
    {"chunks": [[start, n], ...], "s": seconds}           then one line per step

`seconds` runs from the step's start to its outputs sent (schedule, forward, sample,
postprocess, emit): the cadence a served request sees, with whatever else shares the
host taking its part. `sluice sim calibrate --from-steps DIR` fits the simulator's
step-time model to these points (docs/sim.md); `sluice sim calibrate` alone times one
engine by itself, which on a CPU host shared by workers, front ends and clients is
faster than serving.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from sluice.protocol.errors import InvalidRequestError

Chunks = list[tuple[int, int]]


class StepLog:
    """One engine core's log file (line-buffered: a killed worker keeps its lines)."""

    def __init__(self, directory: str, header: dict[str, Any]) -> None:
        self.path = Path(directory) / f"steps-{os.getpid()}.jsonl"
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._file: IO[str] = self.path.open("a", encoding="utf-8", buffering=1)
        except OSError as exc:
            raise InvalidRequestError(f"cannot write the step log in {directory}: {exc}",
                                      param="step_log") from exc
        self._file.write(json.dumps(header) + "\n")

    def record(self, chunks: Chunks, seconds: float) -> None:
        self._file.write(f'{{"chunks": {json.dumps(chunks)}, "s": {seconds:.6f}}}\n')

    def close(self) -> None:
        self._file.close()


def read_step_logs(paths: list[str]) -> tuple[dict[str, Any], list[tuple[Chunks, float]]]:
    """The first file's header and every file's steps (`paths`: files or directories)."""
    files: list[Path] = []
    for path in map(Path, paths):
        files += sorted(path.glob("steps-*.jsonl")) if path.is_dir() else [path]
    header: dict[str, Any] | None = None
    points: list[tuple[Chunks, float]] = []
    for file in files:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise InvalidRequestError(f"cannot read step log {file}: {exc}",
                                      param="from_steps") from exc
        for number, line in enumerate(lines):
            try:
                row = json.loads(line)
            except ValueError:
                if number == len(lines) - 1:
                    break  # a line cut short by a killed worker
                raise InvalidRequestError(f"{file}:{number + 1}: not JSON",
                                          param="from_steps") from None
            if "chunks" in row:
                points.append(([(int(s), int(n)) for s, n in row["chunks"]], float(row["s"])))
            elif header is None:
                header = row
    if header is None or not points:
        raise InvalidRequestError(f"no engine steps in {', '.join(paths)}", param="from_steps")
    return header, points
