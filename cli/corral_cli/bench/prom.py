"""Read counters from a Prometheus text exposition (pure parsing; the runner does the HTTP)."""

from __future__ import annotations

import math


def sum_samples(text: str, name: str) -> float | None:
    """Sum of every sample of metric `name` over all label sets; None when the metric is absent.

    Counters may be exposed with or without their `_total` suffix; both spellings are accepted.
    """
    names = {name, name.removesuffix("_total"), name.removesuffix("_total") + "_total"}
    total, seen = 0.0, False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if brace != -1 and (space == -1 or brace < space) else space
        if end == -1 or line[:end] not in names:
            continue
        rest = line[line.rindex("}") + 1 :] if brace == end else line[end:]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        total += value
        seen = True
    return total if seen else None


def delta(before: float | None, after: float | None) -> float | None:
    """Counter increase over a run; None when either scrape lacked it (or the server restarted)."""
    if before is None or after is None or after < before:
        return None
    return after - before
