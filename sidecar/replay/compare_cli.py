"""``sidecar compare A B``: the command; the comparison itself is ``compare.py``'s library.

It declares the flags, calls ``compare.compare_files`` and prints: the refusal (exit 3) or the
input error (exit 2) on stderr, else the table, or the JSON document with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sidecar.replay.compare import Bracket, Range, Row, SweepComparison

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


async def run(args: argparse.Namespace) -> int:
    # Here, not at import: start-up time of the CLI (numpy).
    from sidecar.replay.compare import (
        SWEEP,
        CompareError,
        CompareRefused,
        compare_files,
        degraded_refusal,
    )

    try:
        comparison = compare_files(
            args.run_a, args.run_b, variables=args.variable, force=args.force
        )
    except CompareError as exc:
        print(f"sidecar compare: {exc}", file=sys.stderr)
        return 2
    except CompareRefused as exc:
        if exc.degraded:
            print(f"sidecar compare: {degraded_refusal(exc.degraded)}", file=sys.stderr)
        if exc.differences:
            print(
                "sidecar compare: these are different experiments; the envelopes differ in:",
                file=sys.stderr,
            )
            for key, va, vb in exc.differences:
                print(f"  {key}: {va!r} vs {vb!r}", file=sys.stderr)
            print(
                "declare the intended variable with --variable KEY, or --force to compare anyway",
                file=sys.stderr,
            )
        return 3
    if args.json:
        print(json.dumps(comparison.as_json(), indent=2, default=str))
        return 0
    degraded, differences = comparison.degraded, comparison.differences
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
    a, b = comparison.a, comparison.b
    declared = (
        ", ".join(
            f"{k}: {a['envelope'].get(k)!r} -> {b['envelope'].get(k)!r}"
            for k in comparison.variables
        )
        or "none"
    )
    print(f"A = {args.run_a}\nB = {args.run_b}\nvariable: {declared}")
    if comparison.kind == SWEEP and comparison.sweep is not None:
        print_sweeps(comparison.sweep)
    else:
        print_rows(comparison.rows)
    return 0


def _rng(r: Range | None) -> str:
    return "-" if r is None else f"{r[0]:.2f}..{r[1]:.2f}"


def print_rows(rows: Sequence[Row], indent: str = "") -> None:
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


def _bracket(bracket: Bracket | None) -> str:
    if bracket is None:
        return "no bracket"
    low, high = bracket
    return f"[{low:g}, {'open' if high is None else f'{high:g}'})"


def print_sweeps(comparison: SweepComparison) -> None:
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
    for side, alone in (("a", comparison["only_a"]), ("b", comparison["only_b"])):
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
