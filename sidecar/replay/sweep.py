"""Capacity under SLO: the pure part (step verdicts, the search, the knee). No I/O.

A load step passes when, over its requests:
- every declared SLO threshold holds at the declared percentile (e.g. p90 TTFT <= 500 ms),
- failed / all <= the error bound,
- (open loop) the completion rate keeps up with the offered rate: (completions - 1) / (time
  between the first and the last completion) >= keep_up x the rate the step really sent at
  ((requests - 1) / (last scheduled - first scheduled)). Below capacity completions leave at the
  arrival rate; past it they leave at the service rate, while the queue grows.

Capacity is the highest passing load (spec/metrics.md section 7). `--auto` doubles the load
until a step fails (stopping early once the achieved rate falls under half the offered one:
far past saturation nothing new is learnt), then bisects between the last pass and the first
failure. The knee is the load of the highest goodput.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The step metrics kept for every repeat of a step (its `repeat_spread`), so that a comparison
# of two sweeps can tell a change from run-to-run noise: (report key, unit, higher is better).
STEP_METRICS: tuple[tuple[str, str, bool], ...] = (
    ("request_throughput", "req/s", True),
    ("output_throughput", "tok/s", True),
    ("request_goodput", "req/s", True),
    ("slo_attainment", "fraction", True),
    ("p50_ttft_ms", "ms", False),
    ("p90_ttft_ms", "ms", False),
    ("p99_ttft_ms", "ms", False),
    ("p50_tpot_ms", "ms", False),
    ("p90_tpot_ms", "ms", False),
    ("p99_tpot_ms", "ms", False),
    ("p99_itl_ms", "ms", False),
    ("p50_e2el_ms", "ms", False),
    ("p99_e2el_ms", "ms", False),
)


@dataclass(frozen=True, slots=True)
class Criteria:
    thresholds_ms: Mapping[str, float]  # "ttft" | "tpot" | "itl" | "e2el" -> ms
    percentile: float = 90.0
    max_error_rate: float = 0.01
    keep_up: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.percentile < 100:
            raise ValueError("the SLO percentile must be in (0, 100)")
        if not self.thresholds_ms:
            raise ValueError("a sweep needs at least one SLO threshold")
        unknown = set(self.thresholds_ms) - {"ttft", "tpot", "itl", "e2el"}
        if unknown:
            raise ValueError(f"unknown SLO metrics for a sweep: {sorted(unknown)}")

    def describe(self) -> str:
        p = f"p{self.percentile:g}"
        parts = [f"{p} {name} <= {ms:g} ms" for name, ms in self.thresholds_ms.items()]
        return (", ".join(parts) + f"; errors <= {self.max_error_rate:.1%}"
                + f"; achieved >= {self.keep_up:.0%} of offered (open loop)")


@dataclass(frozen=True, slots=True)
class StepVerdict:
    passed: bool
    reasons: tuple[str, ...]


def achieved_rate(completion_ends_s: Sequence[float]) -> float | None:
    """Completions per second between the first and the last completion."""
    if len(completion_ends_s) < 2:
        return None
    ends = sorted(completion_ends_s)
    span = ends[-1] - ends[0]
    return (len(ends) - 1) / span if span > 0 else None


def judge_step(report: Mapping[str, Any], offered: float, mode: str,
               criteria: Criteria, achieved: float | None) -> StepVerdict:
    reasons: list[str] = []
    total = report["completed"] + report["failed"]
    if total == 0:
        return StepVerdict(False, ("no request completed",))
    error_rate = report["failed"] / total
    if error_rate > criteria.max_error_rate:
        reasons.append(f"error rate {error_rate:.1%} > {criteria.max_error_rate:.1%}")
    p = f"p{criteria.percentile:g}"
    for name, limit in criteria.thresholds_ms.items():
        value = report.get(f"{p}_{name}_ms")
        if value is None:
            reasons.append(f"{p} {name} unmeasured")
        elif value > limit:
            reasons.append(f"{p} {name} {value:.1f} ms > {limit:g} ms")
    if mode == "open":
        if achieved is None:
            reasons.append("achieved rate unmeasured")
        elif achieved < criteria.keep_up * offered:
            reasons.append(f"achieved {achieved:.2f}/s < {criteria.keep_up:.0%} of offered "
                           f"{offered:g}/s")
    return StepVerdict(not reasons, tuple(reasons))


@dataclass(slots=True)
class Search:
    """Where the auto search stands; `next_load` says what to run next (None: done)."""

    start: float
    mode: str  # "open" (loads are rates) or "closed" (loads are concurrencies)
    bisect_steps: int = 3
    max_steps: int = 12
    passed: list[float] = field(default_factory=list)
    failed: list[float] = field(default_factory=list)
    saturated: bool = False
    bisections: int = 0

    @property
    def steps(self) -> int:
        return len(self.passed) + len(self.failed)

    def _bracket(self) -> tuple[float, float] | None:
        """(highest pass, lowest failure above it), once both exist."""
        if not self.passed:
            return None
        best = max(self.passed)
        above = [f for f in self.failed if f > best]
        return (best, min(above)) if above else None

    def record(self, load: float, verdict: StepVerdict, offered: float,
               achieved: float | None) -> None:
        if self._bracket() is not None:
            self.bisections += 1
        (self.passed if verdict.passed else self.failed).append(load)
        if self.mode == "open" and achieved is not None and achieved < 0.5 * offered:
            self.saturated = True

    def _round(self, load: float) -> float:
        return float(max(1, round(load))) if self.mode == "closed" else round(load, 3)

    def next_load(self) -> float | None:
        if self.steps >= self.max_steps:
            return None
        if not self.steps:
            return self._round(self.start)
        if not self.failed:
            return self._round(max(self.passed) * 2)  # coarse: double until something fails
        bracket = self._bracket()
        if bracket is None:
            if self.passed:
                return None  # failures only below a pass: nothing left to narrow
            # Even the first load failed: halve until one passes (at most 5 times).
            lowest = min(self.failed)
            floor = 1.0 if self.mode == "closed" else 1e-3
            if len(self.failed) > 5 or lowest / 2 < floor:
                return None
            return self._round(lowest / 2)
        if self.bisections >= self.bisect_steps:
            return None
        best, worst = bracket
        if self.mode == "closed" and worst - best <= 1:
            return None
        if self.mode == "open" and (worst - best) / best < 0.05:
            return None
        return self._round((best + worst) / 2)

    @property
    def capacity(self) -> float | None:
        bracket = self._bracket()
        if bracket is not None:
            return bracket[0]
        if self.passed and not self.failed:
            return max(self.passed)  # never broke: capacity is at least this
        return max(self.passed) if self.passed else None


def run_search(search: Search, run_step: Callable[[float], tuple[StepVerdict, float,
                                                                  float | None]]) -> None:
    """Drive a search: ``run_step(load) -> (verdict, offered, achieved)``."""
    while (load := search.next_load()) is not None:
        verdict, offered, achieved = run_step(load)
        search.record(load, verdict, offered, achieved)


def knee(loads: Sequence[float], goodputs: Sequence[float | None]) -> float | None:
    """The load of the highest goodput (the first one, when goodput plateaus)."""
    best: tuple[float, float] | None = None
    for load, goodput in sorted(zip(loads, goodputs, strict=True)):
        if goodput is None:
            continue
        if best is None or goodput > best[1] * 1.02:
            best = (load, goodput)
    return best[0] if best else None
