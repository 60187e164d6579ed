"""When each request leaves: pure, seeded schedules (seconds from the run's start).

- `trace_schedule`: the trace's own arrival times, sorted, shifted so the first is at 0, and
  divided by ``time_scale`` (2.0 replays twice as fast).
- `poisson_schedule` / `gamma_schedule`: a synthetic arrival process at ``rate`` requests/s.
  Gamma inter-arrival times with shape k = ``burstiness`` and scale 1/(rate k) keep the mean
  rate and set the coefficient of variation to 1/sqrt(k): k = 1 is Poisson, k < 1 burstier,
  k > 1 smoother (the same parameterisation as vLLM's bench).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def trace_schedule(arrivals: Sequence[float], time_scale: float = 1.0) -> list[float]:
    if time_scale <= 0 or not math.isfinite(time_scale):
        raise ValueError(f"time_scale must be a positive number, got {time_scale!r}")
    if not arrivals:
        return []
    ordered = sorted(arrivals)
    first = ordered[0]
    return [(t - first) / time_scale for t in ordered]


def gamma_schedule(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate!r}")
    if burstiness <= 0 or not math.isfinite(burstiness):
        raise ValueError(f"burstiness must be > 0, got {burstiness!r}")
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    times: list[float] = []
    t = 0.0
    for i in range(n):
        if i > 0:
            t += rng.gammavariate(burstiness, theta)
        times.append(t)
    return times


def poisson_schedule(n: int, rate: float, seed: int = 0) -> list[float]:
    return gamma_schedule(n, rate, 1.0, seed)
