"""The one reader of Prometheus text in sluice: sample values summed per metric name.

The router's worker scrape (`router/scrape.py`, every probe interval per worker) and
the benchmarks' before/after server counters (`bench/metrics.py`) both want the same
thing: for each metric name, the sum of its samples over every label set. A full
parser (`prometheus_client.parser`) builds objects for every sample and is ~10x
slower, which matters on a scrape of a vLLM server's few hundred histogram lines.

Grammar handled (the text exposition format 0.0.4):

    # HELP / # TYPE / any comment        skipped
    name value [timestamp]
    name{label="value",...} value [timestamp]

Label values may hold `}`, spaces, `"` and `\\` escaped as `\\"` and `\\\\`; values may be
`NaN`, `+Inf`, `-Inf`. A line that does not parse is skipped, never an error: a
scrape must not fail on one odd line.
"""

from __future__ import annotations

import re

# the `{...}` after a name: any run of non-quote non-brace characters or quoted strings
_LABELS = re.compile(r'\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\}')


def sum_samples(text: str) -> dict[str, float]:
    """{metric name: sum of its samples over all label sets} for a Prometheus text."""
    sums: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        sample = _sample(line)
        if sample is not None:
            name, value = sample
            sums[name] = sums.get(name, 0.0) + value
    return sums


def _sample(line: str) -> tuple[str, float] | None:
    brace, space = line.find("{"), line.find(" ")
    if brace > 0 and (space < 0 or brace < space):
        labels = _LABELS.match(line, brace)
        if labels is None:
            return None
        name, rest = line[:brace], line[labels.end():]
    elif space > 0:
        name, rest = line[:space], line[space:]
    else:
        return None
    fields = rest.split()
    if not fields:
        return None
    try:
        return name, float(fields[0])
    except ValueError:
        return None
