"""When requests are sent: all at once, or a Poisson / gamma process at a mean rate.

As in vLLM's benchmark: inter-arrival gaps are gamma-distributed with shape
``burstiness`` and mean ``1 / rate``; burstiness 1 is a Poisson process, below 1 burstier,
above 1 more regular. Rate ``inf`` sends everything at once (``--max-concurrency``
still caps how many are in flight).
"""

from __future__ import annotations

import math
import random


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each of ``n`` requests is sent (non-decreasing)."""
    if rate <= 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    if burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.gammavariate(burstiness, theta)
    return offsets
