"""Two replay reports, or two sweeps, side by side, honestly: the library of ``sidecar compare
A B`` (whose command is ``compare_cli.py``).

Two results are the same experiment only when their workload envelopes agree in everything but
the one variable the comparison declares (``--variable target``, say). Anything else that
differs makes it a different experiment: compare refuses (exit 3) unless ``--force``, and then
says so loudly above the table. A difference is called real only when it exceeds run-to-run
noise: the ranges over repeats of A and B do not overlap. With a single run on either side
there is no noise estimate, and the verdict says so instead of guessing.

Sweeps (``sidecar sweep --output-dir``'s sweep.json) are compared the same way, step by step:
steps are matched by load, each metric's noise is the spread over that step's repeats, and
steps at loads only one side ran are listed as such. Two more rows sum a sweep up: the
capacity, called different only when the two searches' brackets (from the highest passing
load to the lowest failing one above it) do not overlap, and the knee with its goodput. A
replay report is never compared with a sweep.

A degraded replay (its sender fell behind its schedule: `sidecar replay --max-lateness`) did
not offer the load it claims, so compare will not call it better or worse: it refuses (exit 3)
in one line saying which run and why, unless ``--force``, which compares with a warning.

``compare_files`` is the whole comparison as one call: it raises ``CompareError`` (an input
that cannot be compared: exit 2) and ``CompareRefused`` (different experiments or a degraded
run, without ``force``: exit 3), and returns a ``Comparison`` (the envelope differences, the
degraded runs, and the rows with their verdicts). The pieces (``load_result``, ``design``,
``envelope_differences``, ``compare``, ``compare_sweeps``, the verdicts) are plain functions too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from sidecar.replay.sweep import STEP_METRICS

# Envelope keys that are measurements or run bookkeeping, not part of the experiment's design.
NOT_DESIGN = frozenset(
    {
        "engine_before",
        "engine_after",
        "engine_delta",
        "trace",
        "prompt_text_calibration",
        "engine_prefix_cache_hit_rate",
        "engine_metrics_from",
        "sidecar_admin",
        "start_at",
    }
)  # when a sharded run started, not what it was
METRICS = (
    ("request_throughput", "req/s", True),
    ("output_throughput", "tok/s", True),
    ("request_goodput", "req/s", True),
    ("median_ttft_ms", "ms", False),
    ("p99_ttft_ms", "ms", False),
    ("median_tpot_ms", "ms", False),
    ("p99_tpot_ms", "ms", False),
    ("median_itl_ms", "ms", False),
    ("p99_itl_ms", "ms", False),
    ("median_e2el_ms", "ms", False),
    ("p99_e2el_ms", "ms", False),
)
REPLAY, SWEEP = "replay", "sweep"

Range = tuple[float, float]


Bracket = tuple[float, float | None]


class Row(TypedDict):
    """One metric of A against B, with its spread over repeats and the verdict."""

    metric: str
    unit: str
    a: float
    b: float
    change: float | None  # (B - A) / A; None when A is 0
    a_range: Range | None  # (min, max) over repeats; None: fewer than two
    b_range: Range | None
    verdict: str  # "real: better", "real: worse", "within run-to-run noise", "no repeats: ..."


class CapacityComparison(TypedDict):
    a: Any
    b: Any
    a_bracket: Bracket | None
    b_bracket: Bracket | None
    verdict: str


class KneeComparison(TypedDict):
    a: Any
    b: Any
    peak_goodput: Row | None  # request_goodput at each side's knee


class StepComparison(TypedDict):
    load: float
    a_passed: Any
    b_passed: Any
    rows: list[Row]


class LoneStep(TypedDict):
    load: float
    passed: Any


class SweepComparison(TypedDict):
    unit: Any
    capacity: CapacityComparison
    knee: KneeComparison
    steps: list[StepComparison]  # the loads both ran
    only_a: list[LoneStep]  # loads only A ran, not compared
    only_b: list[LoneStep]


class CompareError(ValueError):
    """An input that cannot be compared: unreadable, not a report, or a replay report against a
    sweep (`sidecar compare` exits 2)."""


class CompareRefused(Exception):
    """Not one experiment, or a degraded run (`sidecar compare` exits 3; ``force`` compares)."""

    def __init__(self, differences: Sequence[tuple[str, Any, Any]], degraded: str | None) -> None:
        self.differences = list(differences)
        self.degraded = degraded
        super().__init__("; ".join(self.reasons))

    @property
    def reasons(self) -> list[str]:
        found = [degraded_refusal(self.degraded)] if self.degraded else []
        if self.differences:
            found.append(
                "different experiments; the envelopes differ in: "
                + ", ".join(f"{key}: {va!r} vs {vb!r}" for key, va, vb in self.differences)
            )
        return found


@dataclass(frozen=True, slots=True)
class Comparison:
    """Two results compared: what makes them different experiments (empty unless forced), and
    the rows (replays) or the sweep comparison (sweeps) with their verdicts."""

    kind: str  # REPLAY or SWEEP
    a: dict[str, Any]  # the results as loaded
    b: dict[str, Any]
    variables: tuple[str, ...]
    differences: list[tuple[str, Any, Any]]  # undeclared envelope keys that differ
    degraded: str | None  # degraded_text of A and B
    rows: list[Row]  # replays: metric by metric; empty for sweeps
    sweep: SweepComparison | None  # sweeps; None for replays

    def as_json(self) -> dict[str, Any]:
        """The document of `sidecar compare --json`."""
        body: dict[str, Any] = (
            {"kind": SWEEP, **self.sweep}
            if self.sweep is not None
            else {"kind": REPLAY, "rows": self.rows}
        )
        return {
            "envelope_differences": self.differences,
            "variables": list(self.variables),
            "degraded": self.degraded,
            **body,
        }


def compare_files(
    path_a: str | os.PathLike[str],
    path_b: str | os.PathLike[str],
    *,
    variables: Iterable[str] = (),
    force: bool = False,
) -> Comparison:
    """Compare two results (report.json, sweep.json or the directory holding one), A the
    baseline: raises ``CompareError`` or, unless ``force``, ``CompareRefused``."""
    declared = tuple(variables)
    (kind_a, a), (kind_b, b) = load_result(path_a), load_result(path_b)
    if kind_a != kind_b:
        raise CompareError(
            f"A is a {kind_a} and B a {kind_b}: a replay report is only compared with a replay "
            "report, a sweep with a sweep"
        )
    differences = envelope_differences(design(kind_a, a), design(kind_b, b), set(declared))
    degraded = degraded_text({f"A ({path_a})": a, f"B ({path_b})": b})
    if (degraded or differences) and not force:
        raise CompareRefused(differences, degraded)
    return Comparison(
        kind=kind_a,
        a=a,
        b=b,
        variables=declared,
        differences=differences,
        degraded=degraded,
        rows=compare(a, b) if kind_a == REPLAY else [],
        sweep=compare_sweeps(a, b) if kind_a == SWEEP else None,
    )


def degraded_refusal(degraded: str) -> str:
    """Why a comparison with a degraded run is refused, in one line."""
    return (
        f"refused: {degraded}; a run that did not offer its load is not called better or worse "
        "(--force compares anyway)"
    )


def load_result(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """(kind, data) of a replay report or a sweep result, or of the directory holding one;
    ``CompareError`` when it is neither or cannot be read."""
    file = Path(path)
    if file.is_dir():
        found = [file / name for name in ("sweep.json", "report.json") if (file / name).exists()]
        if len(found) > 1:
            raise CompareError(f"{file}: holds both sweep.json and report.json: name the file")
        file = found[0] if found else file / "report.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CompareError(f"{file}: not a readable report ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("envelope"), dict):
        raise CompareError(
            f"{file}: not a `sidecar replay` report or a `sidecar sweep` result (no envelope)"
        )
    return (SWEEP if isinstance(data.get("steps"), list) else REPLAY), data


def degraded_text(results: Mapping[str, Mapping[str, Any]]) -> str | None:
    """One line naming each degraded result ("B (path) is degraded: reason"), or None."""
    found = [
        f"{name} is degraded: {result.get('degraded_reason') or 'see its report'}"
        for name, result in results.items()
        if result.get("degraded") is True
    ]
    return "; ".join(found) or None


def envelope_differences(
    a: Mapping[str, Any], b: Mapping[str, Any], variables: set[str]
) -> list[tuple[str, Any, Any]]:
    keys = (set(a) | set(b)) - NOT_DESIGN - variables
    return [(k, a.get(k), b.get(k)) for k in sorted(keys) if a.get(k) != b.get(k)]


def design(kind: str, result: Mapping[str, Any]) -> dict[str, Any]:
    """What must agree for two results to be one experiment: the envelope, and for a sweep
    also its pass criteria (the same loads judged by another SLO are another experiment)."""
    out = dict(result["envelope"])
    if kind == SWEEP:
        out["criteria"] = result.get("criteria")
    return out


def value_range(values: Sequence[Any] | None) -> Range | None:
    """(min, max) over repeats; None with fewer than two measured repeats (no noise
    estimate)."""
    known = [v for v in values or () if isinstance(v, (int, float))]
    if len(known) < 2:
        return None
    return min(known), max(known)


def spread(report: Mapping[str, Any], key: str) -> Range | None:
    return value_range([r.get(key) for r in report.get("runs", [])])


def noise_verdict(
    va: float, vb: float, range_a: Range | None, range_b: Range | None, higher_is_better: bool
) -> str:
    if range_a is None or range_b is None:
        return "no repeats: noise unknown"
    if range_b[0] > range_a[1] or range_b[1] < range_a[0]:
        better = (vb > va) == higher_is_better
        return "real: " + ("better" if better else "worse")
    return "within run-to-run noise"


def _row(
    key: str,
    unit: str,
    higher_is_better: bool,
    va: Any,
    vb: Any,
    range_a: Range | None,
    range_b: Range | None,
) -> Row | None:
    if not isinstance(va, (int, float)) or not isinstance(vb, (int, float)):
        return None
    return {
        "metric": key,
        "unit": unit,
        "a": va,
        "b": vb,
        "change": (vb - va) / va if va else None,
        "a_range": range_a,
        "b_range": range_b,
        "verdict": noise_verdict(va, vb, range_a, range_b, higher_is_better),
    }


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[Row]:
    """Two replay reports, metric by metric."""
    rows = [
        _row(key, unit, better, a.get(key), b.get(key), spread(a, key), spread(b, key))
        for key, unit, better in METRICS
    ]
    return [row for row in rows if row is not None]


# -- sweeps -----------------------------------------------------------------------------------


def _load_key(load: Any) -> float:
    return round(float(load), 6)


def capacity_bracket(result: Mapping[str, Any]) -> Bracket | None:
    """Where a sweep puts the true capacity: from its capacity (the highest passing load; 0
    when none passed) up to the lowest failing load above it (None: nothing above failed)."""
    capacity = result.get("capacity")
    low = float(capacity) if isinstance(capacity, (int, float)) else 0.0
    above = [
        float(s["load"])
        for s in result.get("steps", [])
        if not s.get("passed") and float(s["load"]) > low
    ]
    high = min(above) if above else None
    if capacity is None and high is None:
        return None  # nothing passed and nothing failed: no sweep to speak of
    return low, high


def capacity_verdict(a: Bracket | None, b: Bracket | None) -> str:
    """Higher capacity is better; called real only when the brackets do not overlap (each
    side's capacity lies in [low, high))."""
    if a is None or b is None:
        return "no bracket: cannot tell"
    (low_a, high_a), (low_b, high_b) = a, b
    if high_a is not None and high_a <= low_b:
        return "real: better"
    if high_b is not None and high_b <= low_a:
        return "real: worse"
    return "within the searches' resolution"


def _step_at(result: Mapping[str, Any], load: Any) -> Mapping[str, Any] | None:
    if load is None:
        return None
    return next(
        (s for s in result.get("steps", []) if _load_key(s["load"]) == _load_key(load)), None
    )


def _goodput_at(result: Mapping[str, Any], load: Any) -> tuple[Any, Range | None]:
    step = _step_at(result, load)
    if step is None:
        return None, None
    return (
        step["report"].get("request_goodput"),
        value_range((step.get("repeat_spread") or {}).get("request_goodput")),
    )


def compare_sweeps(a: Mapping[str, Any], b: Mapping[str, Any]) -> SweepComparison:
    """Capacity, knee and the steps both sweeps ran (matched by load), metric by metric."""
    bracket_a, bracket_b = capacity_bracket(a), capacity_bracket(b)
    goodput_a, range_a = _goodput_at(a, a.get("knee"))
    goodput_b, range_b = _goodput_at(b, b.get("knee"))
    peak = _row(
        "request_goodput at the knee", "req/s", True, goodput_a, goodput_b, range_a, range_b
    )
    steps_a = {_load_key(s["load"]): s for s in a.get("steps", [])}
    steps_b = {_load_key(s["load"]): s for s in b.get("steps", [])}
    steps: list[StepComparison] = []
    for load in sorted(set(steps_a) & set(steps_b)):
        step_a, step_b = steps_a[load], steps_b[load]
        spread_a = step_a.get("repeat_spread") or {}
        spread_b = step_b.get("repeat_spread") or {}
        rows = [
            _row(
                key,
                unit,
                better,
                step_a["report"].get(key),
                step_b["report"].get(key),
                value_range(spread_a.get(key)),
                value_range(spread_b.get(key)),
            )
            for key, unit, better in STEP_METRICS
        ]
        steps.append(
            {
                "load": load,
                "a_passed": step_a.get("passed"),
                "b_passed": step_b.get("passed"),
                "rows": [row for row in rows if row is not None],
            }
        )

    def only(
        mine: Mapping[float, Mapping[str, Any]], theirs: Mapping[float, Any]
    ) -> list[LoneStep]:
        return [
            {"load": load, "passed": mine[load].get("passed")}
            for load in sorted(set(mine) - set(theirs))
        ]

    return {
        "unit": a.get("unit"),
        "capacity": {
            "a": a.get("capacity"),
            "b": b.get("capacity"),
            "a_bracket": bracket_a,
            "b_bracket": bracket_b,
            "verdict": capacity_verdict(bracket_a, bracket_b),
        },
        "knee": {"a": a.get("knee"), "b": b.get("knee"), "peak_goodput": peak},
        "steps": steps,
        "only_a": only(steps_a, steps_b),
        "only_b": only(steps_b, steps_a),
    }
