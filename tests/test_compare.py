"""`sidecar compare` (compare.py, the library; compare_cli.py, the command): refuses different
experiments; calls a change real only beyond noise."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from sidecar.replay import sweep_cli
from sidecar.replay.compare import (
    CompareError,
    CompareRefused,
    capacity_bracket,
    capacity_verdict,
    compare,
    compare_files,
    compare_sweeps,
    design,
    envelope_differences,
    load_result,
)
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas


def report(envelope: dict[str, Any], runs: list[dict[str, float]]) -> dict[str, Any]:
    median = sorted(runs, key=lambda r: r["median_e2el_ms"])[(len(runs) - 1) // 2]
    return {**median, "envelope": envelope, "runs": runs}


BASE = {
    "model": "m",
    "target": "http://a:8000",
    "mode": "open",
    "rate": 4.0,
    "engine_delta": {"prefix_cache_hits": 10},
}


def runs(ttft: list[float], throughput: list[float]) -> list[dict[str, float]]:
    return [
        {"median_ttft_ms": t, "request_throughput": q, "median_e2el_ms": 100.0 + i}
        for i, (t, q) in enumerate(zip(ttft, throughput, strict=True))
    ]


def test_envelope_differences_ignore_measurements_and_declared_variables() -> None:
    other = {**BASE, "target": "http://b:8000", "engine_delta": {"prefix_cache_hits": 99}}
    assert envelope_differences(BASE, other, {"target"}) == []
    assert envelope_differences(BASE, other, set()) == [
        ("target", "http://a:8000", "http://b:8000")
    ]
    assert envelope_differences(BASE, {**other, "rate": 8.0}, {"target"}) == [("rate", 4.0, 8.0)]


def test_a_change_is_real_only_beyond_run_to_run_noise() -> None:
    a = report(BASE, runs([100, 110, 105], [4.0, 4.0, 4.0]))
    faster = report(BASE, runs([60, 65, 62], [4.0, 4.0, 4.0]))
    noisy = report(BASE, runs([95, 120, 101], [4.0, 4.0, 4.0]))
    rows = {r["metric"]: r for r in compare(a, faster)}
    assert rows["median_ttft_ms"]["verdict"] == "real: better"
    assert rows["request_throughput"]["verdict"] == "within run-to-run noise"
    assert {r["metric"]: r for r in compare(a, noisy)}["median_ttft_ms"][
        "verdict"
    ] == "within run-to-run noise"
    single = report(BASE, runs([60], [4.0]))
    assert {r["metric"]: r for r in compare(a, single)}["median_ttft_ms"][
        "verdict"
    ] == "no repeats: noise unknown"


def test_the_cli_refuses_different_experiments_unless_forced(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report(BASE, runs([100, 110, 105], [4, 4, 4]))))
    b.write_text(
        json.dumps(
            report({**BASE, "target": "http://b:8000", "rate": 8.0}, runs([60, 65, 62], [4, 4, 4]))
        )
    )

    def sidecar(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sidecar", "compare", str(a), str(b), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    # Independent runs: one process each, side by side.
    with ThreadPoolExecutor(4) as pool:
        refused, forced, both_variables = pool.map(
            lambda args: sidecar(*args),
            [
                ("--variable", "target"),
                ("--variable", "target", "--force"),
                ("--variable", "target", "--variable", "rate"),
            ],
        )
        missing = subprocess.run(
            [sys.executable, "-m", "sidecar", "compare", str(a), str(tmp_path / "nope.json")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert refused.returncode == 3 and "rate: 4.0 vs 8.0" in refused.stderr
    assert forced.returncode == 0
    assert "WARNING: different experiments" in forced.stdout
    assert "real: better" in forced.stdout
    assert both_variables.returncode == 0
    assert missing.returncode == 2 and "not a readable report" in missing.stderr


def test_a_script_compares_two_files_in_one_call(tmp_path: Path) -> None:
    """compare_files: what the command does, as typed results, its refusals as exceptions."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report(BASE, runs([100, 110, 105], [4, 4, 4]))))
    b.write_text(json.dumps(report({**BASE, "rate": 8.0}, runs([60, 65, 62], [4, 4, 4]))))
    with pytest.raises(CompareRefused) as refused:
        compare_files(a, b)
    assert refused.value.differences == [("rate", 4.0, 8.0)] and refused.value.degraded is None
    assert refused.value.reasons == [
        "different experiments; the envelopes differ in: rate: 4.0 vs 8.0"
    ]
    result = compare_files(a, b, variables=["rate"])
    assert (result.kind, result.differences, result.variables) == ("replay", [], ("rate",))
    assert result.sweep is None
    rows = {row["metric"]: row for row in result.rows}
    assert rows["median_ttft_ms"]["verdict"] == "real: better"
    assert result.as_json()["rows"] == result.rows and result.as_json()["variables"] == ["rate"]
    forced = compare_files(a, b, force=True)
    assert forced.differences == [("rate", 4.0, 8.0)] and forced.rows == result.rows
    late = degraded(report(BASE, runs([60], [4])), "sender fell behind")
    b.write_text(json.dumps(late))
    with pytest.raises(CompareRefused) as refused:
        compare_files(a, b)
    assert refused.value.degraded == f"B ({b}) is degraded: sender fell behind"
    assert refused.value.reasons[0].startswith(f"refused: B ({b}) is degraded")
    with pytest.raises(CompareError, match="not a readable report"):
        compare_files(a, tmp_path / "nope.json")
    sweep_dir = tmp_path / "s"
    sweep_dir.mkdir()
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep([], None, None)))
    with pytest.raises(CompareError, match="A is a replay and B a sweep"):
        compare_files(a, sweep_dir)
    same = compare_files(sweep_dir, sweep_dir)
    assert same.kind == "sweep" and same.rows == [] and same.sweep is not None
    assert same.as_json()["kind"] == "sweep" and same.as_json()["steps"] == []


# -- sweeps -----------------------------------------------------------------------------------

SWEEP_ENVELOPE = {
    "target": "http://a:8000",
    "model": "m",
    "mode": "open",
    "repeats": 3,
    "engine_delta": {"prefix_cache_hits": 5},
    "engine_prefix_cache_hit_rate": 0.1,
}


def degraded(result: dict[str, Any], reason: str) -> dict[str, Any]:
    return {**result, "degraded": True, "degraded_reason": reason, "max_lateness_ms": 50.0}


@pytest.mark.slow
def test_a_degraded_run_is_not_called_better_or_worse_without_force(tmp_path: Path) -> None:
    """Reports from `sidecar replay` whose sender fell behind (degraded) are refused with exit
    3 and one line naming each and why; --force compares under a warning; the JSON says which.
    Reports without the flag (older ones) and sweeps are compared as before."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    late = "sender lateness p99 812.0 ms > --max-lateness 50 ms: the sender fell behind"
    a.write_text(json.dumps(report(BASE, runs([100, 110, 105], [4, 4, 4]))))
    b.write_text(json.dumps(degraded(report(BASE, runs([60, 65, 62], [4, 4, 4])), late)))

    def sidecar(x: Path, y: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sidecar", "compare", str(x), str(y), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    c = tmp_path / "c.json"
    c.write_text(json.dumps(degraded(report({**BASE, "rate": 8.0}, runs([60], [4])), late)))
    # The six comparisons are independent: one process each, side by side.
    calls: list[tuple[Path, Path, tuple[str, ...]]] = [
        (a, b, ()),
        (b, b, ()),
        (a, b, ("--force",)),
        (a, b, ("--force", "--json")),
        (a, c, ()),
        (a, a, ()),
    ]
    with ThreadPoolExecutor(len(calls)) as pool:
        refused, both, forced, forced_json, two, plain = pool.map(
            lambda call: sidecar(call[0], call[1], *call[2]), calls
        )
    assert refused.returncode == 3 and refused.stdout == ""
    assert refused.stderr.splitlines() == [
        f"sidecar compare: refused: B ({b}) is degraded: {late}; a run that did not offer its "
        "load is not called better or worse (--force compares anyway)"
    ]
    assert both.returncode == 3
    assert f"refused: A ({b}) is degraded: {late}; B ({b}) is degraded: {late};" in both.stderr
    assert forced.returncode == 0
    assert f"WARNING: degraded (--force): B ({b}) is degraded: {late}" in forced.stdout
    assert "real: better" in forced.stdout
    as_json = json.loads(forced_json.stdout)
    assert as_json["degraded"] == f"B ({b}) is degraded: {late}"
    # Degraded and another experiment (c): both refusals are given.
    assert two.returncode == 3 and "is degraded" in two.stderr and "rate: 4.0 vs 8.0" in two.stderr
    assert plain.returncode == 0  # no flag at all: compared


def step(load: float, passed: bool, ttft: list[float], goodput: list[float]) -> dict[str, Any]:
    """A sweep step whose reported run is the median by TTFT (enough for these tests)."""
    return {
        "load": load,
        "passed": passed,
        "reasons": [] if passed else ["slow"],
        "report": {"p50_ttft_ms": sorted(ttft)[1], "request_goodput": sorted(goodput)[1]},
        "repeat_spread": {"p50_ttft_ms": ttft, "request_goodput": goodput},
    }


def sweep(
    steps: list[dict[str, Any]],
    capacity: float | None,
    knee: float | None,
    envelope: dict[str, Any] = SWEEP_ENVELOPE,
    criteria: str = "p90 ttft <= 500 ms",
) -> dict[str, Any]:
    return {
        "capacity": capacity,
        "unit": "req/s",
        "knee": knee,
        "criteria": criteria,
        "mode": "open",
        "steps": steps,
        "envelope": envelope,
    }


def test_capacity_brackets_decide_whether_capacities_really_differ() -> None:
    # Passed 4 and 8, failed 16 and 12: the capacity lies in [8, 12).
    a = sweep(
        [
            step(4, True, [1, 2, 3], [4, 4, 4]),
            step(8, True, [1, 2, 3], [8, 8, 8]),
            step(16, False, [1, 2, 3], [9, 9, 9]),
            step(12, False, [1, 2, 3], [9, 9, 9]),
        ],
        capacity=8,
        knee=8,
    )
    assert capacity_bracket(a) == (8.0, 12.0)
    assert capacity_bracket(sweep([step(4, True, [1, 2, 3], [4, 4, 4])], 4, 4)) == (4.0, None)
    assert capacity_bracket(sweep([step(4, False, [1, 2, 3], [4, 4, 4])], None, None)) == (0.0, 4.0)
    assert capacity_verdict((8.0, 12.0), (12.0, 14.0)) == "real: better"  # B's is >= 12
    assert capacity_verdict((12.0, 14.0), (8.0, 12.0)) == "real: worse"
    assert capacity_verdict((8.0, 12.0), (10.0, 16.0)) == "within the searches' resolution"
    assert capacity_verdict((8.0, None), (16.0, None)) == "within the searches' resolution"
    assert capacity_verdict((8.0, 12.0), None) == "no bracket: cannot tell"


def test_sweeps_are_compared_step_by_step_at_the_loads_both_ran() -> None:
    a = sweep(
        [
            step(4, True, [10, 11, 12], [4.0, 4.0, 4.0]),
            step(8, True, [20, 22, 24], [7.5, 7.8, 8.0]),
            step(16, False, [90, 95, 99], [6.0, 6.5, 7.0]),
        ],
        capacity=8,
        knee=8,
    )
    b = sweep(
        [
            step(4, True, [5, 6, 7], [4.0, 4.0, 4.0]),
            step(8.0000001, True, [19, 23, 25], [7.9, 8.0, 8.1]),
            step(12, True, [30, 31, 33], [11.0, 11.5, 12.0]),
            step(24, False, [80, 85, 90], [10.0, 10.5, 11.0]),
        ],
        capacity=12,
        knee=12,
    )
    result = compare_sweeps(a, b)
    assert [s["load"] for s in result["steps"]] == [4.0, 8.0]  # 8.0000001 is load 8
    assert result["only_a"] == [{"load": 16.0, "passed": False}]
    assert result["only_b"] == [{"load": 12.0, "passed": True}, {"load": 24.0, "passed": False}]
    at_4 = {r["metric"]: r for r in result["steps"][0]["rows"]}
    assert at_4["p50_ttft_ms"]["verdict"] == "real: better"  # 5..7 ms vs 10..12 ms
    assert at_4["p50_ttft_ms"]["change"] == pytest.approx((6 - 11) / 11)
    assert at_4["request_goodput"]["verdict"] == "within run-to-run noise"
    at_8 = {r["metric"]: r for r in result["steps"][1]["rows"]}
    assert at_8["p50_ttft_ms"]["verdict"] == "within run-to-run noise"  # 19..25 vs 20..24
    # Capacity 8 in [8, 16) vs 12 in [12, 24): the brackets overlap.
    assert result["capacity"]["verdict"] == "within the searches' resolution"
    peak = result["knee"]["peak_goodput"]
    assert peak is not None
    assert (result["knee"]["a"], result["knee"]["b"]) == (8, 12)
    assert (peak["a"], peak["b"], peak["verdict"]) == (7.8, 11.5, "real: better")
    # A sweep without repeats has no noise estimate, and says so.
    single = sweep(
        [
            {
                "load": 4,
                "passed": True,
                "reasons": [],
                "report": {"p50_ttft_ms": 6.0},
                "repeat_spread": {"p50_ttft_ms": [6.0]},
            }
        ],
        capacity=4,
        knee=None,
    )
    (only,) = compare_sweeps(a, single)["steps"][0]["rows"]
    assert only["verdict"] == "no repeats: noise unknown"


def test_the_cli_compares_sweeps_and_refuses_a_replay_against_a_sweep(tmp_path: Path) -> None:
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    steps_a = [step(4, True, [10, 11, 12], [4, 4, 4]), step(8, False, [50, 51, 52], [5, 5, 5])]
    steps_b = [step(4, True, [5, 6, 7], [4, 4, 4]), step(6, True, [8, 9, 9], [6, 6, 6])]
    (a_dir / "sweep.json").write_text(json.dumps(sweep(steps_a, 4, 4)))
    (b_dir / "sweep.json").write_text(
        json.dumps(sweep(steps_b, 6, 6, envelope={**SWEEP_ENVELOPE, "target": "http://b:8000"}))
    )
    replay = tmp_path / "report.json"
    replay.write_text(json.dumps(report(BASE, runs([100, 110, 105], [4, 4, 4]))))

    def sidecar(a: Path, b: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sidecar", "compare", str(a), str(b), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    # Another SLO is another experiment, even on the same loads.
    c_dir = tmp_path / "c"
    c_dir.mkdir()
    (c_dir / "sweep.json").write_text(
        json.dumps(sweep(steps_b, 6, 6, criteria="p90 ttft <= 200 ms"))
    )
    # The five comparisons are independent: one process each, side by side.
    calls: list[tuple[Path, Path, tuple[str, ...]]] = [
        (replay, a_dir / "sweep.json", ()),
        (a_dir, b_dir, ()),
        (a_dir, b_dir, ("--variable", "target")),
        (a_dir, c_dir, ()),
        (a_dir, c_dir, ("--force", "--json")),
    ]
    with ThreadPoolExecutor(len(calls)) as pool:
        mixed, refused, shown, other_slo, forced = pool.map(
            lambda call: sidecar(call[0], call[1], *call[2]), calls
        )
    assert mixed.returncode == 2 and "A is a replay and B a sweep" in mixed.stderr
    assert (
        refused.returncode == 3 and "target: 'http://a:8000' vs 'http://b:8000'" in refused.stderr
    )
    assert shown.returncode == 0, shown.stderr
    assert "capacity (req/s): A 4 [4, 8)  B 6 [6, open)" in shown.stdout
    assert "steps only A ran, not compared: 8 (fail)" in shown.stdout
    assert "steps only B ran, not compared: 6 (pass)" in shown.stdout
    assert "load 4 req/s: A pass, B pass" in shown.stdout
    assert "real: better" in shown.stdout
    assert other_slo.returncode == 3 and "criteria" in other_slo.stderr
    assert forced.returncode == 0
    data = json.loads(forced.stdout)
    assert data["kind"] == "sweep" and data["envelope_differences"][0][0] == "criteria"


@pytest.mark.slow
async def test_two_real_sweeps_compare_a_slow_engine_with_a_fast_one(tmp_path: Path) -> None:
    """The same sweep against a fast and a ten times slower simulated engine: at the load both
    ran, the slower one's TTFT is worse beyond the spread of two repeats."""
    outs = {}
    for name, step_s, rates in (("fast", 0.002, "10,20"), ("slow", 0.02, "10,40")):
        replicas = await start_replicas(
            SimConfig(model="m", engine=EngineConfig(step_floor_s=step_s, per_token_s=0.0)), 1
        )
        parser = argparse.ArgumentParser()
        sweep_cli.add_arguments(parser)
        outs[name] = tmp_path / name
        args = parser.parse_args(
            [
                "--target",
                replicas[0].url,
                "--dataset",
                "synthetic:in=16,out=4",
                "--slo",
                "ttft=500ms",
                "--rates",
                rates,
                "--step-duration",
                "0.5s",
                "--min-requests",
                "8",
                "--warmup",
                "1",
                "--repeats",
                "2",
                "--output-dir",
                str(outs[name]),
            ]
        )
        try:
            assert await sweep_cli.run(args) == 0
        finally:
            await close_replicas(replicas)
    (kind_a, fast), (kind_b, slow) = load_result(str(outs["fast"])), load_result(str(outs["slow"]))
    assert kind_a == kind_b == "sweep"
    assert envelope_differences(design(kind_a, fast), design(kind_b, slow), {"target"}) == []
    result = compare_sweeps(fast, slow)
    assert [s["load"] for s in result["steps"]] == [10.0]
    assert result["only_a"] == [{"load": 20.0, "passed": fast["steps"][1]["passed"]}]
    assert [s["load"] for s in result["only_b"]] == [40.0]
    rows = {r["metric"]: r for r in result["steps"][0]["rows"]}
    assert rows["p50_ttft_ms"]["verdict"] == "real: worse"
    assert rows["p50_ttft_ms"]["a_range"] is not None  # the spread of the two repeats
