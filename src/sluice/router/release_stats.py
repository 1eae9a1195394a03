"""The tests a release's judge runs: is the canary worse than the baseline?

Each comparison is one-sided (only "the canary is worse" matters) and needs both a
significant test result and an effect larger than a margin, so a large sample does not
roll back a canary for a difference nobody would notice, and a small one does not roll
it back for noise:

    errors         two-proportion z-test          canary rate - baseline rate > margin
    TTFT, TPOT     Mann-Whitney U (normal approx.) canary p90 / baseline p90 > 1 + margin
    prefix hits    Mann-Whitney U on rate samples  baseline mean - canary mean > margin

Each side needs `min_samples` first; below that a comparison says `enough=False` and
judges nothing. The normal approximations are fair from a few dozen samples per side,
which is why the minimum exists. Pure functions on plain numbers: no clock, no I/O.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def two_proportion_z(x1: int, n1: int, x2: int, n2: int) -> tuple[float, float]:
    """(z, one-sided p) for "the rate x1/n1 is above x2/n2", pooled standard error.
    Equal rates of 0 or 1 (no variance) give (0, 1)."""
    pooled = (x1 + x2) / (n1 + n2)
    se = math.sqrt(pooled * (1.0 - pooled) * (1.0 / n1 + 1.0 / n2))
    if se == 0.0:
        return 0.0, 1.0
    z = (x1 / n1 - x2 / n2) / se
    return z, normal_sf(z)


def mann_whitney_greater(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(U of `a`, one-sided p) for "values of `a` tend to be larger than those of `b`".

    U counts, over every pair, 1 where a's value is larger and 1/2 where they are equal
    (binary searches in sorted `b`). Normal approximation with the tie correction and a
    continuity correction of 0.5 (as R's `wilcox.test(a, b, alternative="greater",
    exact=FALSE)`)."""
    n1, n2 = len(a), len(b)
    ordered = sorted(b)
    u = 0.0
    for x in a:
        below = bisect_left(ordered, x)
        u += below + 0.5 * (bisect_right(ordered, x, below) - below)
    n = n1 + n2
    ties = sum(t ** 3 - t for t in Counter(chain(a, b)).values() if t > 1)
    var = n1 * n2 / 12.0 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0.0:
        return u, 1.0
    z = (u - n1 * n2 / 2.0 - 0.5) / math.sqrt(var)
    return u, normal_sf(z)


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile, linear between order statistics (numpy's default)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Verdict:
    """One metric's comparison: the statistic of each side, the test, the outcome."""

    metric: str
    canary: float | None
    baseline: float | None
    p_value: float | None
    samples: tuple[int, int]  # (canary, baseline)
    enough: bool
    regressed: bool

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "canary": self.canary, "baseline": self.baseline,
                "p_value": self.p_value, "samples": {"canary": self.samples[0],
                                                     "baseline": self.samples[1]},
                "enough_samples": self.enough, "regressed": self.regressed}


def compare_errors(canary: Sequence[bool], baseline: Sequence[bool], margin: float,
                   alpha: float, min_samples: int) -> Verdict:
    """Error outcomes (True: failed): a regression if the canary's rate is significantly
    higher and higher by more than `margin`."""
    n1, n2 = len(canary), len(baseline)
    if min(n1, n2) < min_samples:
        return Verdict("errors", None, None, None, (n1, n2), False, False)
    x1, x2 = sum(canary), sum(baseline)
    _, p = two_proportion_z(x1, n1, x2, n2)
    r1, r2 = x1 / n1, x2 / n2
    return Verdict("errors", r1, r2, p, (n1, n2), True, p < alpha and r1 - r2 > margin)


def compare_latency(metric: str, canary: Sequence[float], baseline: Sequence[float],
                    margin: float, alpha: float, min_samples: int) -> Verdict:
    """Latencies (seconds): a regression if the canary's are significantly larger and its
    p90 is above the baseline's by more than `margin` (relative)."""
    n1, n2 = len(canary), len(baseline)
    if min(n1, n2) < min_samples:
        return Verdict(metric, None, None, None, (n1, n2), False, False)
    p90_c, p90_b = quantile(canary, 0.9), quantile(baseline, 0.9)
    _, p = mann_whitney_greater(canary, baseline)
    worse = p90_c > p90_b * (1.0 + margin)
    return Verdict(metric, p90_c, p90_b, p, (n1, n2), True, p < alpha and worse)


def compare_hit_rates(canary: Sequence[float], baseline: Sequence[float], margin: float,
                      alpha: float, min_samples: int) -> Verdict:
    """Prefix-cache hit rates (one per worker and scrape interval): a regression if the
    canary's are significantly lower and their mean lower by more than `margin`."""
    n1, n2 = len(canary), len(baseline)
    if min(n1, n2) < min_samples:
        return Verdict("prefix_hit_rate", None, None, None, (n1, n2), False, False)
    mean_c, mean_b = sum(canary) / n1, sum(baseline) / n2
    _, p = mann_whitney_greater(baseline, canary)
    return Verdict("prefix_hit_rate", mean_c, mean_b, p, (n1, n2), True,
                   p < alpha and mean_b - mean_c > margin)
