"""`sidecar compare`: refuses different experiments; calls a change real only beyond noise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from sidecar.replay.compare import compare, envelope_differences


def report(envelope: dict[str, Any], runs: list[dict[str, float]]) -> dict[str, Any]:
    median = sorted(runs, key=lambda r: r["median_e2el_ms"])[(len(runs) - 1) // 2]
    return {**median, "envelope": envelope, "runs": runs}


BASE = {"model": "m", "target": "http://a:8000", "mode": "open", "rate": 4.0,
        "engine_delta": {"prefix_cache_hits": 10}}


def runs(ttft: list[float], throughput: list[float]) -> list[dict[str, float]]:
    return [{"median_ttft_ms": t, "request_throughput": q, "median_e2el_ms": 100.0 + i}
            for i, (t, q) in enumerate(zip(ttft, throughput, strict=True))]


def test_envelope_differences_ignore_measurements_and_declared_variables() -> None:
    other = {**BASE, "target": "http://b:8000", "engine_delta": {"prefix_cache_hits": 99}}
    assert envelope_differences(BASE, other, {"target"}) == []
    assert envelope_differences(BASE, other, set()) == [("target", "http://a:8000",
                                                         "http://b:8000")]
    assert envelope_differences(BASE, {**other, "rate": 8.0}, {"target"}) == [("rate", 4.0, 8.0)]


def test_a_change_is_real_only_beyond_run_to_run_noise() -> None:
    a = report(BASE, runs([100, 110, 105], [4.0, 4.0, 4.0]))
    faster = report(BASE, runs([60, 65, 62], [4.0, 4.0, 4.0]))
    noisy = report(BASE, runs([95, 120, 101], [4.0, 4.0, 4.0]))
    rows = {r["metric"]: r for r in compare(a, faster)}
    assert rows["median_ttft_ms"]["verdict"] == "real: better"
    assert rows["request_throughput"]["verdict"] == "within run-to-run noise"
    assert {r["metric"]: r for r in compare(a, noisy)}["median_ttft_ms"]["verdict"] == \
        "within run-to-run noise"
    single = report(BASE, runs([60], [4.0]))
    assert {r["metric"]: r for r in compare(a, single)}["median_ttft_ms"]["verdict"] == \
        "no repeats: noise unknown"


def test_the_cli_refuses_different_experiments_unless_forced(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report(BASE, runs([100, 110, 105], [4, 4, 4]))))
    b.write_text(json.dumps(report({**BASE, "target": "http://b:8000", "rate": 8.0},
                                   runs([60, 65, 62], [4, 4, 4]))))

    def sidecar(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sidecar", "compare", str(a), str(b),
                               *args], capture_output=True, text=True, timeout=60)

    refused = sidecar("--variable", "target")
    assert refused.returncode == 3 and "rate: 4.0 vs 8.0" in refused.stderr
    forced = sidecar("--variable", "target", "--force")
    assert forced.returncode == 0
    assert "WARNING: different experiments" in forced.stdout
    assert "real: better" in forced.stdout
    assert sidecar("--variable", "target", "--variable", "rate").returncode == 0
    missing = subprocess.run([sys.executable, "-m", "sidecar", "compare", str(a),
                              str(tmp_path / "nope.json")], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "not a readable report" in missing.stderr
