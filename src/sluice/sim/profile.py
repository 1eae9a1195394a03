"""The step-time model: what one engine step costs, the only thing the simulator invents.

Everything else in a simulated worker is the production scheduler and block manager;
only `ModelRunner.execute` (the forward pass, sampling included) is replaced by a time
computed from the step's scheduled chunks:

    step_s = step_overhead_s                              fixed cost of a step
           + s_per_token    × Σ chunk.num_tokens          new tokens (prefill chunks, decodes)
           + s_per_seq      × number of chunks            per-sequence cost (decode batch)
           + s_per_kpair    × Σ pairs(prefill chunk) / 1000   attention: query × key pairs
           + s_per_decode_kpair × Σ pairs(decode) / 1000
    pairs(chunk) = num_tokens × (start_pos + (num_tokens + 1) / 2)
                 (a decode at context L reads L keys; a prefill chunk of n at start s
                  reads s + 1 .. s + n keys per query)

Decode attention has its own term because it costs far more per pair than a prefill's:
a decode reads every key once for one query (memory-bound, the paged kernel), a prefill
reuses each key across its chunk's queries (SDPA). Fitted on a 2-core AMD EPYC
(2026-12-02, one thread): 2.1 ms per 1k pairs in prefills against 4.4 ms in decodes; one
shared term had fitted 2.3 ms and put a 16-sequence decode at 1,024 tokens 12% short. `s_per_decode_kpair` None (profiles
fitted before, the built-in one) means the same as `s_per_kpair`.

`sluice sim calibrate` measures single prefills of several lengths and decode batches of
several sizes and contexts on the real engine, and fits the four coefficients by
non-negative least squares (`fit_profile`). A profile is a JSON file with the fields of
`StepProfile`; one measured elsewhere (a GPU) loads the same way. The KV pool and
scheduler limits of the profiled engine travel with it, so a simulated worker is the
engine that was measured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from sluice.engine.scheduler import ScheduledChunk
from sluice.protocol.errors import InvalidRequestError

FEATURES = ("step_overhead_s", "s_per_token", "s_per_seq", "s_per_kpair", "s_per_decode_kpair")


@dataclass(frozen=True)
class StepProfile:
    """A fitted step-time model plus the engine shape it was measured on."""

    # defaults: `sluice sim calibrate` on the 2-core development host (see `source`)
    name: str = "SmolLM2-135M-Instruct.Q4_1@cpu"
    step_overhead_s: float = 0.138
    s_per_token: float = 1.85e-3
    s_per_seq: float = 3.1e-3
    s_per_kpair: float = 1.75e-3
    s_per_decode_kpair: float | None = None  # None: s_per_kpair (one attention term)
    block_size: int = 16
    num_kv_blocks: int = 6856
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    request_overhead_s: float = 0.0  # HTTP, tokenizing, routing: outside the engine's steps
    # CPU workers sharing one host's cores: each other worker busy when a step starts
    # stretches it by this fraction (0: a device per worker, as GPUs; 1: two busy
    # engines, each with threads for every core, run at half speed)
    host_contention: float = 0.0
    source: str = ("built-in: sluice sim calibrate on a 2-core Intel Xeon (AVX-512) shared "
                   "with other jobs, 2026-12-01; run `sluice sim calibrate` for this machine")

    def __post_init__(self) -> None:
        for name in (*FEATURES, "request_overhead_s", "host_contention"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise InvalidRequestError(f"{name} must be >= 0 and finite", param=name)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError("block_size must be a power of two", param="block_size")
        for name in ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1", param=name)

    @property
    def coefficients(self) -> tuple[float, float, float, float, float]:
        decode = self.s_per_kpair if self.s_per_decode_kpair is None else self.s_per_decode_kpair
        return (self.step_overhead_s, self.s_per_token, self.s_per_seq, self.s_per_kpair, decode)

    def step_seconds(self, chunks: Sequence[ScheduledChunk]) -> float:
        """Virtual duration of one engine step that runs `chunks`."""
        tokens = pairs = 0.0
        decode = self.s_per_decode_kpair
        if decode is None:  # one attention term: no split (the simulator's inner loop)
            for c in chunks:
                n = c.num_tokens
                tokens += n
                pairs += n * (c.start_pos + (n + 1) * 0.5)
            return (self.step_overhead_s + self.s_per_token * tokens
                    + self.s_per_seq * len(chunks) + self.s_per_kpair * pairs * 1e-3)
        decode_pairs = 0.0
        for c in chunks:
            n = c.num_tokens
            tokens += n
            if n == 1:
                decode_pairs += c.start_pos + 1
            else:
                pairs += n * (c.start_pos + (n + 1) * 0.5)
        return (self.step_overhead_s + self.s_per_token * tokens + self.s_per_seq * len(chunks)
                + (self.s_per_kpair * pairs + decode * decode_pairs) * 1e-3)

    def faster(self, factor: float) -> StepProfile:
        """Every step-time coefficient divided by `factor` (a faster device); an absent
        decode term stays absent (it follows `s_per_kpair`)."""
        return self.with_overrides(**{k: getattr(self, k) / factor for k in FEATURES
                                      if getattr(self, k) is not None})

    def with_overrides(self, **changes: Any) -> StepProfile:
        """A copy with the given (non-None) fields replaced, validated again."""
        known = {f.name for f in fields(self)}
        for key in changes:
            if key not in known:
                raise InvalidRequestError(f"unknown profile field {key!r}", param=key)
        return StepProfile(**{**asdict(self), **{k: v for k, v in changes.items() if v is not None}})


def chunk_features(chunks: Iterable[tuple[int, int]]
                   ) -> tuple[float, float, float, float, float]:
    """The regression row of one step from (start_pos, num_tokens) pairs: the same terms
    `StepProfile.step_seconds` weighs (prefill and decode pairs apart)."""
    tokens = seqs = pairs = decode_pairs = 0.0
    for start, n in chunks:
        tokens += n
        seqs += 1
        if n == 1:
            decode_pairs += start + 1
        else:
            pairs += n * (start + (n + 1) * 0.5)
    return (1.0, tokens, seqs, pairs * 1e-3, decode_pairs * 1e-3)


def fit_coefficients(rows: Sequence[Sequence[float]], seconds: Sequence[float]
                     ) -> tuple[float, ...]:
    """Non-negative least squares (Lawson-Hanson active set, small and exact enough for
    five columns), each row and target weighted by 1/target so that short steps count
    as much as long ones (relative error)."""
    import numpy as np

    a = np.asarray(rows, dtype=float)
    y = np.asarray(seconds, dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)
    a, y = a * w[:, None], y * w
    active = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        coef[active] = sol
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return tuple(float(c) for c in coef)
        active.remove(min(negative, key=lambda i: coef[i]))


def fit_profile(base: StepProfile, steps: Sequence[tuple[Sequence[tuple[int, int]], float]],
                name: str, source: str) -> StepProfile:
    """A profile whose coefficients fit measured `(chunks, seconds)` steps."""
    rows = [chunk_features(chunks) for chunks, _ in steps]
    coef = fit_coefficients(rows, [s for _, s in steps])
    return base.with_overrides(name=name, source=source, **dict(zip(FEATURES, coef, strict=True)))


def load_profile(path: str | Path) -> StepProfile:
    """A profile from a JSON file with `StepProfile`'s fields (unknown fields are an error)."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"cannot read profile {path}: {exc}", param="profile") from exc
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"profile {path} is not a JSON object", param="profile")
    for key, value in raw.items():
        want = _JSON_TYPES.get(key)
        if want is not None and not _is(value, want):
            raise InvalidRequestError(f"profile {path}: {key} must be {want}, got {value!r}",
                                      param="profile")
    return StepProfile().with_overrides(**raw)


# what each field's JSON value must be (a bool is no number here)
_JSON_TYPES = {f.name: "an integer" if f.type == "int" else "a string" if f.type == "str"
               else "a number or null" if "None" in str(f.type) else "a number"
               for f in fields(StepProfile)}


def _is(value: Any, want: str) -> bool:
    if value is None:
        return want == "a number or null"
    if want == "a string":
        return isinstance(value, str)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if want == "an integer" else isinstance(value, int | float)


def save_profile(profile: StepProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(asdict(profile), indent=2) + "\n", encoding="utf-8")
