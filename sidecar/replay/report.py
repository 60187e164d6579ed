"""A replay run's report: `vllm bench serve`'s JSON keys where the meaning is the same, plus
what that tool leaves out (outcomes, sender lateness, the workload envelope, definitions).

Meaning notes against `vllm bench serve`: TTFT, ITL (per event), TPOT (N_out from usage) and
E2EL are the same definitions (docs/metrics.md sections 4 and 11), measured by the replayer as
a client (`stats.request_samples`);
``request_goodput`` counts requests that met every declared threshold of the SLO, per second.
``duration`` runs from the run's start (the first scheduled instant) to the last response's end.
``max_concurrent_requests`` is vllm bench's per-second count (`peers.vllm_bench_peaks`); the
exact most requests in flight at once is ``max_in_flight_requests``.

A replay whose sender fell behind its schedule did not offer the load it claims: a run whose
sender lateness p99 exceeds ``--max-lateness`` (`DEFAULT_MAX_LATENESS_MS` unless given) is
marked ``degraded`` with the reason and the threshold (`late_p99`, `mark_degraded`), and
`sidecar compare` refuses to call it better or worse. The default, 50 ms: a healthy sender
keeps p99 under 1 ms (benchmarks/RESULTS.md, replay pacing: 0.27 ms at 1,000 req/s on 2
cores), so 50 ms is never host noise; and it is a tenth of AIPerf's 500 ms, which would let a
run at 100 req/s bunch 50 requests together unflagged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from sidecar import stats
from sidecar.record import Outcome, RequestRecord, Vantage
from sidecar.replay.options import DEFAULT_MAX_LATENESS_MS as DEFAULT_MAX_LATENESS_MS
from sidecar.replay.peers import vllm_bench_peaks
from sidecar.replay.runner import SentRequest

DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)

DEFINITIONS = {
    "ttft": "send -> first token-carrying chunk (client vantage); sample = request",
    "itl": "gap between consecutive token-carrying chunks; sample = chunk (event)",
    "tpot": "TPOT as docs/metrics.md section 4 defines it, N_out from usage; N_out <= 1 "
    "excluded and counted",
    "e2el": "send -> last token-carrying chunk (response end if none); sample = request",
    "lateness": "actual send - scheduled send, per request (open loop only)",
    "percentiles": "numpy linear interpolation; std is the population std",
    "goodput": "completed requests meeting every declared threshold, per second; attainment "
    "= good / all requests (failures included)",
    "max_concurrent_requests": "vllm bench's: one-second buckets from the first send, a "
    "successful request counted in every bucket from its send's "
    "to its last chunk's; the most in one bucket",
    "max_in_flight_requests": "the most requests in flight at once (send to response end), exact",
    "degraded": "open loop: sender lateness p99 > max_lateness_ms in some run; the sender fell "
    "behind its schedule, so that run did not offer the load it claims",
}


def _ms_stats(
    prefix: str, values: npt.NDArray[np.float64], percentiles: Sequence[float]
) -> dict[str, float | None]:
    summary = stats.summarize(values, percentiles)

    def ms(x: float | None) -> float | None:
        return None if x is None else x * 1000.0

    out: dict[str, float | None] = {
        f"mean_{prefix}_ms": ms(summary.mean),
        f"median_{prefix}_ms": ms(float(np.median(values)) if len(values) else None),
        f"std_{prefix}_ms": ms(summary.std),
    }
    for q in percentiles:
        out[f"{stats.percentile_name(q)}_{prefix}_ms"] = ms(summary.p(q))
    return out


def run_report(
    sent: Sequence[SentRequest],
    *,
    mode: str,
    slo_policy: stats.SLOPolicy | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    envelope: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    records = [s.record for s in sent]
    completed = [r for r in records if r.outcome is Outcome.OK]
    ends = [s.end_ns for s in sent]
    duration = max(ends) / 1e9 if ends else 0.0
    samples = stats.request_samples(records, Vantage.CLIENT)
    total_in = sum(r.n_in or 0 for r in completed)
    total_out = int(samples.n_out.sum())
    rate = 1.0 / duration if duration > 0 else 0.0
    report: dict[str, Any] = {
        "mode": mode,
        "duration": duration,
        "completed": len(completed),
        "failed": len(records) - len(completed),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(completed) * rate,
        "output_throughput": total_out * rate,
        "total_token_throughput": (total_in + total_out) * rate,
        "max_concurrent_requests": vllm_bench_peaks(sent)[1],
        "max_in_flight_requests": max_concurrency(sent),
    }
    report["request_goodput"] = None
    if slo_policy is not None:
        goodput = replay_goodput(records, slo_policy, duration)
        report["request_goodput"] = goodput.good_requests_per_s
        report["slo_attainment"] = goodput.attainment
        report["slo"] = {name: slo.describe() for name, slo in slo_policy.classes.items()}
    for prefix, values in (
        ("ttft", samples.defined("ttft")),
        ("tpot", samples.defined("tpot")),
        ("itl", samples.itl_s),
        ("e2el", samples.defined("e2e")),
    ):
        report.update(_ms_stats(prefix, values, percentiles))
    report["requests_without_tpot"] = int(np.count_nonzero(samples.n_out <= 1))
    report["outcomes"] = {o.value: n for o, n in stats.outcome_counts(records).items()}
    if mode == "open":
        lateness = stats.summarize([s.lateness_ns / 1e6 for s in sent], percentiles)
        report["lateness_ms"] = lateness.to_dict()
    report["token_counts_exact"] = all(r.token_source.total_exact for r in completed)
    report["definitions"] = DEFINITIONS
    if envelope is not None:
        report["envelope"] = dict(envelope)
    return report


class ReplayGoodput(NamedTuple):
    """A run's goodput over every class of its SLO policy."""

    good_requests: int
    requests: int
    attainment: float | None  # good / every request of the run; None for no request
    good_requests_per_s: float
    good_output_tokens_per_s: float


def replay_goodput(
    records: Sequence[RequestRecord], slo_policy: stats.SLOPolicy, duration_s: float
) -> ReplayGoodput:
    """`stats.goodput_by_class` at the client vantage, summed over the classes (a replay has
    one, "default"). Every request of the run is in the denominator: `SLO.exclude` is not
    applied here, as replay reports have always said (docs/metrics.md section 8)."""
    per_class = stats.goodput_by_class(
        records, slo_policy, duration_s, Vantage.CLIENT, exclusions=False
    )
    good = sum(g.good_requests for g in per_class.values())
    total = sum(g.total_requests for g in per_class.values())
    return ReplayGoodput(
        good_requests=good,
        requests=total,
        attainment=good / total if total else None,
        good_requests_per_s=sum(g.good_requests_per_s for g in per_class.values()),
        good_output_tokens_per_s=sum(g.good_output_tokens_per_s for g in per_class.values()),
    )


def max_concurrency(sent: Sequence[SentRequest]) -> int:
    """The most requests in flight at once, from the send and end instants."""
    events: list[tuple[int, int]] = []
    for s in sent:
        events.append((s.actual_ns, 1))
        events.append((s.end_ns, -1))
    events.sort()
    current = peak = 0
    for _at, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


BEHIND = "the sender fell behind its schedule, so"


def late_p99(report: Mapping[str, Any], max_lateness_ms: float | None) -> float | None:
    """One run's sender lateness p99 (ms) when it exceeds ``max_lateness_ms``, else None.
    Closed loop has no schedule to be late for; None as the threshold turns the check off."""
    late = report.get("lateness_ms")
    p99 = late.get("p99") if isinstance(late, Mapping) else None
    if max_lateness_ms is None or not isinstance(p99, (int, float)) or p99 <= max_lateness_ms:
        return None
    return float(p99)


def _ms_text(value: float) -> str:
    return f"{value:.3f} ms" if value < 1 else f"{value:.1f} ms"


def mark_degraded(result: dict[str, Any], max_lateness_ms: float | None) -> None:
    """Set ``degraded``, ``degraded_reason`` and ``max_lateness_ms`` on each of
    ``result["runs"]`` and on the result itself: degraded when any run is (the runs are the
    result's spread, and its median run is one of them)."""
    runs: list[dict[str, Any]] = result.get("runs") or [result]
    late: list[tuple[int, float]] = []
    for number, run in enumerate(runs, 1):
        p99 = late_p99(run, max_lateness_ms)
        reason = (
            None
            if p99 is None
            else (
                f"sender lateness p99 {_ms_text(p99)} > --max-lateness {max_lateness_ms:g} ms: "
                f"{BEHIND} the run did not offer the load it claims"
            )
        )
        run.update(
            degraded=reason is not None, degraded_reason=reason, max_lateness_ms=max_lateness_ms
        )
        if p99 is not None:
            late.append((number, p99))
    reason = None
    if len(runs) == 1 and late:
        reason = runs[0]["degraded_reason"]
    elif late:
        which = " and ".join(f"run {n} ({_ms_text(p99)})" for n, p99 in late)
        reason = (
            f"sender lateness p99 > --max-lateness {max_lateness_ms:g} ms in {which} "
            f"of {len(runs)}: {BEHIND} "
            + (
                "that run did not offer the load it claims"
                if len(late) == 1
                else "those runs did not offer the load they claim"
            )
        )
    result.update(
        degraded=reason is not None, degraded_reason=reason, max_lateness_ms=max_lateness_ms
    )


def median_run(reports: Sequence[dict[str, Any]]) -> int:
    """Index of the run reported as the result: the median by median E2E latency (ties to
    the earlier run); every run is kept beside it."""
    keyed = sorted(
        range(len(reports)), key=lambda i: (reports[i].get("median_e2el_ms") or float("inf"), i)
    )
    return keyed[(len(keyed) - 1) // 2]


def slo_text(classes: Mapping[str, str]) -> str:
    """The SLO classes of a report as a person reads them: "ttft<=500ms, tpot<=50ms", or each
    class by name when there are several."""
    if list(classes) == ["default"]:
        return str(classes["default"])
    return "; ".join(f"{name}: {described}" for name, described in classes.items())


def console_table(report: Mapping[str, Any]) -> str:
    lines = [
        f"{'mode':<34} {report['mode']}",
        f"{'completed / failed':<34} {report['completed']} / {report['failed']}",
        f"{'duration (s)':<34} {report['duration']:.2f}",
        f"{'request throughput (req/s)':<34} {report['request_throughput']:.2f}",
        f"{'output token throughput (tok/s)':<34} {report['output_throughput']:.1f}",
        f"{'total token throughput (tok/s)':<34} {report['total_token_throughput']:.1f}",
        f"{'max concurrent requests':<34} {concurrency_text(report)}",
    ]
    if report.get("request_goodput") is not None:
        lines.append(
            f"{'request goodput (req/s)':<34} {report['request_goodput']:.2f}  "
            f"(attainment {report['slo_attainment']:.1%}; SLO "
            f"{slo_text(report['slo'])})"
        )
    lines.append(f"{'':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'p99.9':>14}")
    for name, key in (
        ("TTFT ms", "ttft"),
        ("TPOT ms", "tpot"),
        ("ITL ms", "itl"),
        ("E2E ms", "e2el"),
    ):

        def cell(k: str) -> str:
            value = report.get(k)
            return f"{value:10.2f}" if isinstance(value, float) else f"{'-':>10}"

        lines.append(
            f"{name:<12}{cell(f'mean_{key}_ms')}{cell(f'p50_{key}_ms')}"
            f"{cell(f'p90_{key}_ms')}{cell(f'p99_{key}_ms')}"
            f"{cell(f'p99.9_{key}_ms'):>14}"
        )
    if "lateness_ms" in report:
        late = report["lateness_ms"]
        lines.append(
            f"{'sender lateness ms':<34} p50 {late['p50'] or 0:.3f}  "
            f"p99 {late['p99'] or 0:.3f}  max {late['max'] or 0:.3f}"
        )
    outcomes = ", ".join(f"{k}={v}" for k, v in report["outcomes"].items() if v)
    lines.append(f"{'outcomes':<34} {outcomes}")
    if report.get("degraded"):
        lines.append(f"DEGRADED: {report.get('degraded_reason')}")
    return "\n".join(lines)


def concurrency_text(report: Mapping[str, Any]) -> str:
    """ "7 in flight at once (vllm bench's per-second count: 9)"; a report without the exact
    figure (written before it existed) shows the one it has."""
    exact = report.get("max_in_flight_requests")
    if exact is None:
        return str(report.get("max_concurrent_requests", "-"))
    return (
        f"{exact} in flight at once (vllm bench's per-second count: "
        f"{report.get('max_concurrent_requests', '-')})"
    )
