"""A replay run's report (sidecar/replay/report.py) on a hand-built run, every figure worked by
hand: the vllm bench keys, the outcomes, the sender's lateness, goodput, the exact and the
per-second concurrency, and the degraded verdict."""

from __future__ import annotations

from typing import Any

import pytest
from factories import build_record, build_sent

from sidecar import stats
from sidecar.record import Outcome
from sidecar.replay.report import (
    concurrency_text,
    late_p99,
    mark_degraded,
    max_concurrency,
    median_run,
    run_report,
    slo_text,
)

# Client offsets in ms from each request's send; the run's clock in ms from its start.
# A: sent at 0, tokens at 100, 130 (1 each) and 250 (2), 10 in / 4 out, ends at 260 (run 260).
# B: sent at 100 (scheduled 98: 2 ms late), tokens at 50, 90, 20 in / 2 out, ends at 100 (200).
# C: sent at 210, an HTTP error after 5 ms (215); no tokens, nothing counted.
# D: sent at 300, one token at 40, 5 in / 1 out, ends at 45 (345): no TPOT.
A = build_record([(100, 1), (130, 1), (250, 2)], n_in=10, n_out=4, end_ms=260)
B = build_record([(50, 1), (90, 1)], n_in=20, n_out=2, end_ms=100)
C = build_record([], outcome=Outcome.HTTP_ERROR, http_status=500, end_ms=5)
D = build_record([(40, 1)], n_in=5, n_out=1, end_ms=45)
RUN = [
    build_sent(0, 0, A),
    build_sent(1, 100, B, scheduled_ms=98),
    build_sent(2, 210, C),
    build_sent(3, 300, D),
]
DURATION = 0.345  # the run's start to D's end


def test_counts_and_throughputs() -> None:
    report = run_report(RUN, mode="open")
    assert report["duration"] == pytest.approx(DURATION)
    assert (report["completed"], report["failed"]) == (3, 1)
    # Tokens of the completed requests only: 10 + 20 + 5 in, 4 + 2 + 1 out.
    assert (report["total_input_tokens"], report["total_output_tokens"]) == (35, 7)
    assert report["request_throughput"] == pytest.approx(3 / DURATION)
    assert report["output_throughput"] == pytest.approx(7 / DURATION)
    assert report["total_token_throughput"] == pytest.approx(42 / DURATION)
    assert report["outcomes"]["ok"] == 3 and report["outcomes"]["http_error"] == 1
    assert report["token_counts_exact"] is True
    assert report["requests_without_tpot"] == 1  # D: one output token
    assert report["request_goodput"] is None and "lateness_ms" in report


def test_latency_percentiles_by_hand() -> None:
    """numpy's linear interpolation: with three sorted values v0 <= v1 <= v2, p90 sits at rank
    0.9 * 2 = 1.8, i.e. v1 + 0.8 * (v2 - v1); std is the population std."""
    report = run_report(RUN, mode="open", percentiles=(50.0, 90.0))
    # TTFT of A, B, D: 100, 50, 40 ms.
    assert report["mean_ttft_ms"] == pytest.approx(190 / 3)
    assert report["median_ttft_ms"] == pytest.approx(50)
    assert report["p50_ttft_ms"] == pytest.approx(50)
    assert report["p90_ttft_ms"] == pytest.approx(50 + 0.8 * 50)
    # deviations from 63.33: -23.33, -13.33, 36.67; their squares' mean is 688.89.
    assert report["std_ttft_ms"] == pytest.approx((6200 / 9) ** 0.5)
    # TPOT = (E2E - TTFT) / (N_out - 1): A (250 - 100) / 3 = 50, B (90 - 50) / 1 = 40.
    assert report["mean_tpot_ms"] == pytest.approx(45)
    assert report["p90_tpot_ms"] == pytest.approx(40 + 0.9 * 10)
    # ITL, one per gap: A 30 and 120, B 40 -> sorted 30, 40, 120.
    assert report["median_itl_ms"] == pytest.approx(40)
    assert report["p90_itl_ms"] == pytest.approx(40 + 0.8 * 80)
    # E2E to the last token: A 250, B 90, D 40.
    assert report["mean_e2el_ms"] == pytest.approx(380 / 3)
    assert report["p90_e2el_ms"] == pytest.approx(90 + 0.8 * 160)
    assert "p99_ttft_ms" not in report  # only the percentiles asked for


def test_the_senders_lateness_is_reported_in_open_loop_only() -> None:
    late = run_report(RUN, mode="open")["lateness_ms"]
    # 0, 2, 0, 0 ms: p99 at rank 0.99 * 3 = 2.97, between the third (0) and the fourth (2).
    assert (late["count"], late["max"], late["mean"]) == (4, 2.0, 0.5)
    assert late["p50"] == 0.0 and late["p99"] == pytest.approx(0.97 * 2)
    assert "lateness_ms" not in run_report(RUN, mode="closed")


def test_goodput_counts_every_request_in_its_denominator() -> None:
    policy = stats.SLOPolicy({"default": stats.SLO(ttft_s=0.060)})
    report = run_report(RUN, mode="open", slo_policy=policy)
    # Good: B (50 ms) and D (40 ms); A's 100 ms is too slow, C failed: 2 of 4.
    assert report["slo_attainment"] == 0.5
    assert report["request_goodput"] == pytest.approx(2 / DURATION)
    assert report["slo"] == {"default": "ttft<=60ms"}


def test_concurrency_exact_and_as_vllm_bench_counts_it() -> None:
    # In flight: A 0-260, B 100-200, C 210-215, D 300-345: never more than two at once.
    assert max_concurrency(RUN) == 2
    report = run_report(RUN, mode="open")
    assert report["max_in_flight_requests"] == 2
    # vllm bench: the successful ones, by one-second bucket: A, B and D all in the first.
    assert report["max_concurrent_requests"] == 3
    assert concurrency_text(report) == "2 in flight at once (vllm bench's per-second count: 3)"
    assert concurrency_text({"max_concurrent_requests": 3}) == "3"  # an older report
    assert max_concurrency([]) == 0


def test_an_empty_run_reports_zeros_and_nones() -> None:
    report = run_report([], mode="closed")
    assert (report["duration"], report["completed"], report["request_throughput"]) == (0, 0, 0)
    assert report["mean_ttft_ms"] is None and report["p99_e2el_ms"] is None


def lateness(p99: float | None) -> dict[str, Any]:
    return {"lateness_ms": {"p99": p99}}


def test_a_run_is_late_only_past_the_threshold() -> None:
    assert late_p99(lateness(50.5), 50.0) == 50.5
    assert late_p99(lateness(50.0), 50.0) is None  # at the threshold is not past it
    assert late_p99(lateness(500.0), None) is None  # the check turned off
    assert late_p99({}, 50.0) is None  # closed loop: no schedule to be late for
    assert late_p99(lateness(None), 50.0) is None


def test_degraded_names_the_late_runs() -> None:
    single = lateness(60.0)
    mark_degraded(single, 50.0)
    assert single["degraded"] is True and single["max_lateness_ms"] == 50.0
    assert single["degraded_reason"].startswith(
        "sender lateness p99 60.0 ms > --max-lateness 50 ms: the sender fell behind"
    )
    result: dict[str, Any] = {"runs": [lateness(1.0), lateness(0.5), lateness(70.0)]}
    mark_degraded(result, 50.0)
    assert [run["degraded"] for run in result["runs"]] == [False, False, True]
    assert result["degraded"] is True
    assert "in run 3 (70.0 ms) of 3" in result["degraded_reason"]
    assert result["degraded_reason"].endswith("that run did not offer the load it claims")
    calm: dict[str, Any] = {"runs": [lateness(1.0)]}
    mark_degraded(calm, 50.0)
    assert calm["degraded"] is False and calm["degraded_reason"] is None


def test_the_median_run_by_median_e2e() -> None:
    runs = [{"median_e2el_ms": 30.0}, {"median_e2el_ms": 10.0}, {"median_e2el_ms": 20.0}]
    assert median_run(runs) == 2
    # Even count: the lower middle; a run without the figure sorts last.
    assert (
        median_run([{"median_e2el_ms": 5.0}, {}, {"median_e2el_ms": 1.0}, {"median_e2el_ms": 3.0}])
        == 3
    )


def test_slo_text() -> None:
    assert slo_text({"default": "ttft<=500ms"}) == "ttft<=500ms"
    assert slo_text({"gold": "ttft<=100ms", "bronze": "e2e<=5000ms"}) == (
        "gold: ttft<=100ms; bronze: e2e<=5000ms"
    )
