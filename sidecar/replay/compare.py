"""``sidecar compare RUN_A RUN_B``: two replay reports side by side, honestly.

Two results are the same experiment only when their workload envelopes agree in everything but
the one variable the comparison declares (``--variable target``, say). Anything else that
differs makes it a different experiment: compare refuses (exit 3) unless ``--force``, and then
says so loudly above the table. A difference is called real only when it exceeds run-to-run
noise: the ranges over repeats of A and B do not overlap. With a single run on either side
there is no noise estimate, and the verdict says so instead of guessing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Compare two runs of `sidecar replay --output-dir` (their report.json): refuse when the workload
envelopes differ in anything but the declared variable, then show each metric side by side with
its spread over repeats, and call a difference real only when it exceeds run-to-run noise.
"""

EPILOG = """\
examples:
  sidecar compare before/report.json after/report.json --variable target
  sidecar compare a/report.json b/report.json --variable model --force
"""

# Envelope keys that are measurements or run bookkeeping, not part of the experiment's design.
NOT_DESIGN = frozenset({"engine_before", "engine_after", "engine_delta", "trace",
                        "prompt_text_calibration"})
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", help="report.json of run A (the baseline)")
    parser.add_argument("run_b", help="report.json of run B")
    parser.add_argument("--variable", action="append", default=[], metavar="KEY",
                        help="envelope key that is meant to differ (repeatable), e.g. target")
    parser.add_argument("--force", action="store_true",
                        help="compare even when other envelope keys differ (warns loudly)")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")


def load_report(path: str) -> dict[str, Any]:
    file = Path(path)
    if file.is_dir():
        file = file / "report.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: not a readable report ({exc})") from None
    if not isinstance(data, dict) or "envelope" not in data:
        raise ValueError(f"{file}: not a `sidecar replay` report (no envelope)")
    return data


def envelope_differences(a: Mapping[str, Any], b: Mapping[str, Any],
                         variables: set[str]) -> list[tuple[str, Any, Any]]:
    keys = (set(a) | set(b)) - NOT_DESIGN - variables
    return [(k, a.get(k), b.get(k)) for k in sorted(keys) if a.get(k) != b.get(k)]


def spread(report: Mapping[str, Any], key: str) -> tuple[float, float] | None:
    values = [r.get(key) for r in report.get("runs", [])]
    known = [v for v in values if isinstance(v, (int, float))]
    if len(known) < 2:
        return None
    return min(known), max(known)


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, unit, higher_is_better in METRICS:
        va, vb = a.get(key), b.get(key)
        if not isinstance(va, (int, float)) or not isinstance(vb, (int, float)):
            continue
        sa, sb = spread(a, key), spread(b, key)
        if sa is None or sb is None:
            verdict = "no repeats: noise unknown"
        elif sb[0] > sa[1] or sb[1] < sa[0]:
            better = (vb > va) == higher_is_better
            verdict = "real: " + ("better" if better else "worse")
        else:
            verdict = "within run-to-run noise"
        rows.append({"metric": key, "unit": unit, "a": va, "b": vb,
                     "change": (vb - va) / va if va else None, "a_range": sa, "b_range": sb,
                     "verdict": verdict})
    return rows


async def run(args: argparse.Namespace) -> int:
    try:
        a, b = load_report(args.run_a), load_report(args.run_b)
    except ValueError as exc:
        print(f"sidecar compare: {exc}", file=sys.stderr)
        return 2
    differences = envelope_differences(a["envelope"], b["envelope"], set(args.variable))
    if differences and not args.force:
        print("sidecar compare: these are different experiments; the envelopes differ in:",
              file=sys.stderr)
        for key, va, vb in differences:
            print(f"  {key}: {va!r} vs {vb!r}", file=sys.stderr)
        print("declare the intended variable with --variable KEY, or --force to compare "
              "anyway", file=sys.stderr)
        return 3
    rows = compare(a, b)
    if args.json:
        print(json.dumps({"envelope_differences": differences, "variables": args.variable,
                          "rows": rows}, indent=2, default=str))
        return 0
    if differences:
        print("!" * 78)
        print("WARNING: different experiments (--force). Envelopes differ in:")
        for key, va, vb in differences:
            print(f"  {key}: {va!r} vs {vb!r}")
        print("!" * 78)
    declared = ", ".join(f"{k}: {a['envelope'].get(k)!r} -> {b['envelope'].get(k)!r}"
                         for k in args.variable) or "none"
    print(f"A = {args.run_a}\nB = {args.run_b}\nvariable: {declared}")
    print(f"{'metric':<20}{'A':>12}{'B':>12}{'change':>9}  {'A runs':<21}{'B runs':<21}verdict")
    for row in rows:
        def rng(r: tuple[float, float] | None) -> str:
            return "-" if r is None else f"{r[0]:.2f}..{r[1]:.2f}"

        change = "-" if row["change"] is None else f"{row['change']:+.1%}"
        print(f"{row['metric']:<20}{row['a']:>12.2f}{row['b']:>12.2f}{change:>9}  "
              f"{rng(row['a_range']):<21}{rng(row['b_range']):<21}{row['verdict']}")
    return 0
