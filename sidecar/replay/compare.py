"""``sidecar compare A B``: two replay reports, or two sweeps, side by side, honestly.

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
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sidecar.replay.sweep import STEP_METRICS

DESCRIPTION = """\
Compare two runs of `sidecar replay --output-dir` (report.json), or two runs of `sidecar sweep
--output-dir` (sweep.json), or their directories: refuse when the workload envelopes differ in
anything but the declared variable, then show each metric side by side with its spread over
repeats, and call a difference real only when it exceeds run-to-run noise. Sweeps: capacity
and knee, then every load step both ran (matched by load) metric by metric; steps at loads only
one side ran are listed as such.
"""

EPILOG = """\
examples:
  sidecar compare before/report.json after/report.json --variable target
  sidecar compare a/report.json b/report.json --variable model --force
  sidecar compare sweep-v1/ sweep-v2/ --variable engine_version
      two sweeps (their sweep.json): capacity, knee, and the steps both ran, by load

exit status: 0 compared, 2 unreadable input or a replay report against a sweep, 3 refused:
different experiments (the envelopes differ in an undeclared key) or a degraded run (its
sender fell behind its schedule); --force compares anyway
"""

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_a", help="run A (the baseline): report.json, sweep.json or the directory holding one"
    )
    parser.add_argument("run_b", help="run B, of the same kind as A")
    parser.add_argument(
        "--variable",
        action="append",
        default=[],
        metavar="KEY",
        help="envelope key that is meant to differ (repeatable), e.g. target",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="compare even when other envelope keys differ or a run is degraded (warns loudly)",
    )
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")


def load_result(path: str) -> tuple[str, dict[str, Any]]:
    """(kind, data) of a replay report or a sweep result, or of the directory holding one."""
    file = Path(path)
    if file.is_dir():
        found = [file / name for name in ("sweep.json", "report.json") if (file / name).exists()]
        if len(found) > 1:
            raise ValueError(f"{file}: holds both sweep.json and report.json: name the file")
        file = found[0] if found else file / "report.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: not a readable report ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("envelope"), dict):
        raise ValueError(
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
) -> dict[str, Any] | None:
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


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Two replay reports, metric by metric."""
    rows = [
        _row(key, unit, better, a.get(key), b.get(key), spread(a, key), spread(b, key))
        for key, unit, better in METRICS
    ]
    return [row for row in rows if row is not None]


# -- sweeps -----------------------------------------------------------------------------------


def _load_key(load: Any) -> float:
    return round(float(load), 6)


def capacity_bracket(result: Mapping[str, Any]) -> tuple[float, float | None] | None:
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


def capacity_verdict(
    a: tuple[float, float | None] | None, b: tuple[float, float | None] | None
) -> str:
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


def compare_sweeps(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Capacity, knee and the steps both sweeps ran (matched by load), metric by metric."""
    bracket_a, bracket_b = capacity_bracket(a), capacity_bracket(b)
    goodput_a, range_a = _goodput_at(a, a.get("knee"))
    goodput_b, range_b = _goodput_at(b, b.get("knee"))
    peak = _row(
        "request_goodput at the knee", "req/s", True, goodput_a, goodput_b, range_a, range_b
    )
    steps_a = {_load_key(s["load"]): s for s in a.get("steps", [])}
    steps_b = {_load_key(s["load"]): s for s in b.get("steps", [])}
    steps = []
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
    ) -> list[dict[str, Any]]:
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


# -- the command --------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> int:
    try:
        (kind_a, a), (kind_b, b) = load_result(args.run_a), load_result(args.run_b)
    except ValueError as exc:
        print(f"sidecar compare: {exc}", file=sys.stderr)
        return 2
    if kind_a != kind_b:
        print(
            f"sidecar compare: A is a {kind_a} and B a {kind_b}: a replay report is only "
            "compared with a replay report, a sweep with a sweep",
            file=sys.stderr,
        )
        return 2
    differences = envelope_differences(design(kind_a, a), design(kind_b, b), set(args.variable))
    degraded = degraded_text({f"A ({args.run_a})": a, f"B ({args.run_b})": b})
    if degraded and not args.force:
        print(
            f"sidecar compare: refused: {degraded}; a run that did not offer its load is "
            "not called better or worse (--force compares anyway)",
            file=sys.stderr,
        )
    if differences and not args.force:
        print(
            "sidecar compare: these are different experiments; the envelopes differ in:",
            file=sys.stderr,
        )
        for key, va, vb in differences:
            print(f"  {key}: {va!r} vs {vb!r}", file=sys.stderr)
        print(
            "declare the intended variable with --variable KEY, or --force to compare anyway",
            file=sys.stderr,
        )
    if (degraded or differences) and not args.force:
        return 3
    if kind_a == SWEEP:
        comparison: dict[str, Any] = {"kind": SWEEP, **compare_sweeps(a, b)}
    else:
        comparison = {"kind": REPLAY, "rows": compare(a, b)}
    if args.json:
        print(
            json.dumps(
                {
                    "envelope_differences": differences,
                    "variables": args.variable,
                    "degraded": degraded,
                    **comparison,
                },
                indent=2,
                default=str,
            )
        )
        return 0
    if degraded:
        print("!" * 78)
        print(f"WARNING: degraded (--force): {degraded}")
        print("!" * 78)
    if differences:
        print("!" * 78)
        print("WARNING: different experiments (--force). Envelopes differ in:")
        for key, va, vb in differences:
            print(f"  {key}: {va!r} vs {vb!r}")
        print("!" * 78)
    declared = (
        ", ".join(
            f"{k}: {a['envelope'].get(k)!r} -> {b['envelope'].get(k)!r}" for k in args.variable
        )
        or "none"
    )
    print(f"A = {args.run_a}\nB = {args.run_b}\nvariable: {declared}")
    if kind_a == SWEEP:
        print_sweeps(comparison)
    else:
        print_rows(comparison["rows"])
    return 0


def _rng(r: Range | None) -> str:
    return "-" if r is None else f"{r[0]:.2f}..{r[1]:.2f}"


def print_rows(rows: Sequence[Mapping[str, Any]], indent: str = "") -> None:
    print(
        f"{indent}{'metric':<20}{'A':>12}{'B':>12}{'change':>9}  {'A runs':<21}"
        f"{'B runs':<21}verdict"
    )
    for row in rows:
        change = "-" if row["change"] is None else f"{row['change']:+.1%}"
        print(
            f"{indent}{row['metric']:<20}{row['a']:>12.2f}{row['b']:>12.2f}{change:>9}  "
            f"{_rng(row['a_range']):<21}{_rng(row['b_range']):<21}{row['verdict']}"
        )


def _bracket(bracket: Sequence[float | None] | None) -> str:
    if bracket is None:
        return "no bracket"
    low, high = bracket
    return f"[{low:g}, {'open' if high is None else f'{high:g}'})"


def print_sweeps(comparison: Mapping[str, Any]) -> None:
    unit = comparison["unit"]
    capacity = comparison["capacity"]
    print(
        f"capacity ({unit}): A {capacity['a']} {_bracket(capacity['a_bracket'])}  "
        f"B {capacity['b']} {_bracket(capacity['b_bracket'])}  -> {capacity['verdict']}"
    )
    knee = comparison["knee"]
    peak = knee["peak_goodput"]
    peak_text = (
        "goodput at the knee: -"
        if peak is None
        else (
            f"goodput at the knee: A {peak['a']:.2f} ({_rng(peak['a_range'])})  "
            f"B {peak['b']:.2f} ({_rng(peak['b_range'])})  -> {peak['verdict']}"
        )
    )
    print(f"knee ({unit}): A {knee['a']}  B {knee['b']}; {peak_text}")
    for side in ("a", "b"):
        alone = comparison[f"only_{side}"]
        if alone:
            listed = ", ".join(
                f"{s['load']:g} ({'pass' if s['passed'] else 'fail'})" for s in alone
            )
            print(f"steps only {side.upper()} ran, not compared: {listed}")
    for step in comparison["steps"]:

        def verdict(passed: Any) -> str:
            return "pass" if passed else "fail"

        print(
            f"\nload {step['load']:g} {unit}: A {verdict(step['a_passed'])}, "
            f"B {verdict(step['b_passed'])}"
        )
        print_rows(step["rows"], indent="  ")
