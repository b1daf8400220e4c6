"""Request arrival times: a Poisson process (or a burstier gamma process), or everything at once."""

from __future__ import annotations

import math

import numpy as np


def parse_rates(text: str) -> list[float]:
    """ "1,2,inf" -> [1.0, 2.0, inf]; ValueError on non-positive, unparsable or empty entries."""
    if not text.strip():
        raise ValueError("no request rate given")
    rates: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"--request-rate {text!r} has an empty entry")
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"request rate {part!r} is not a number or 'inf'") from None
        if math.isnan(rate) or rate <= 0:
            raise ValueError(f"request rate must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    return rates


def arrival_offsets_s(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send time of each request in seconds from the start, non-decreasing, first at 0.

    Gaps are gamma-distributed with shape `burstiness` and mean 1/rate: burstiness 1 is a Poisson
    process, < 1 burstier, > 1 more regular. rate = inf sends everything at time 0.
    """
    if num_requests <= 0:
        return []
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
