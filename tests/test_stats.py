"""Hand-worked answers for every formula in docs/metrics.md."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
from factories import MS, build_record, marks
from random_records import random_records

from sidecar import stats
from sidecar.record import Int64s, Outcome, RequestRecord, Timeline, TokenSource, Vantage

# This module's records: 10 input tokens, the output count from usage, unless a case says.
make_record = partial(build_record, n_in=10, token_source=TokenSource.USAGE)


def test_spec_worked_example() -> None:
    # spec/metrics.md section 1: 4 tokens, first at 120 ms, then gaps of 30, 40, 40 ms.
    record = make_record([(120, 1), (150, 1), (190, 1), (230, 1)], n_out=4)
    m = stats.request_metrics(record, Vantage.CLIENT)
    assert m is not None
    assert m.ttft_s == pytest.approx(0.120)
    assert m.itl_s == pytest.approx((0.030, 0.040, 0.040))
    assert m.itl_tokens == (1, 1, 1)
    assert m.tpot_s == pytest.approx(0.110 / 3)
    assert m.tpot_s is not None and round(m.tpot_s * 1000, 1) == 36.7
    assert m.e2e_s == pytest.approx(0.230)


def test_multi_token_chunks() -> None:
    # Chunks of 1, 3 and 2 tokens (speculative decoding / stream interval), usage says 6.
    record = make_record([(100, 1), (130, 3), (170, 2)], n_out=6)
    m = stats.request_metrics(record, Vantage.CLIENT)
    assert m is not None
    assert m.ttft_s == pytest.approx(0.100)
    assert m.itl_s == pytest.approx((0.030, 0.040))
    assert m.itl_tokens == (3, 2)
    # TPOT = (170 - 100) / (6 - 1) = 14 ms, not the per-event mean of 35 ms.
    assert m.tpot_s == pytest.approx(0.014)
    assert m.e2e_s == pytest.approx(0.170)
    per_token = stats.token_normalised_itl(m.itl_s, m.itl_tokens)
    assert per_token == pytest.approx([0.010, 0.010, 0.010, 0.020, 0.020])


def test_n_out_falls_back_to_event_tokens_without_usage() -> None:
    record = make_record(
        [(100, 1), (130, 3), (170, 2)], n_out=None, token_source=TokenSource.CHUNK_COUNT
    )
    m = stats.request_metrics(record, Vantage.CLIENT)
    assert m is not None and m.n_out == 6
    assert m.tpot_s == pytest.approx(0.014)


def test_single_token_reply_has_no_tpot_and_is_counted() -> None:
    single = make_record([(80, 1)], n_out=1)
    m = stats.request_metrics(single, Vantage.CLIENT)
    assert m is not None
    assert (m.itl_s, m.tpot_s) == ((), None)
    assert (m.ttft_s, m.e2e_s) == pytest.approx((0.08, 0.08))
    report = stats.vantage_report(
        [single, make_record([(100, 1), (140, 1)], n_out=2)], Vantage.CLIENT
    )
    assert report.requests == 2
    assert report.tpot_excluded == 1
    assert report.tpot.count == 1 and report.tpot.mean == pytest.approx(0.040)
    assert report.ttft.count == 2


def test_server_vantage_starts_at_upstream_send() -> None:
    # Proxy: request arrived at 0, sent upstream at 2 ms; upstream events at 112, 142 ms,
    # written to the client at 113, 143 ms.
    server = Timeline.from_marks(start_ns=2 * MS, marks=marks((112, 1), (142, 1)), end_ns=145 * MS)
    record = make_record([(113, 1), (143, 1)], n_out=2, server=server)
    client_m = stats.request_metrics(record, Vantage.CLIENT)
    server_m = stats.request_metrics(record, Vantage.SERVER)
    assert client_m is not None and server_m is not None
    assert client_m.ttft_s == pytest.approx(0.113)
    assert server_m.ttft_s == pytest.approx(0.110)
    assert server_m.itl_s == pytest.approx((0.030,))
    assert stats.request_metrics(make_record([(5, 1)]), Vantage.SERVER) is None


def test_no_token_event_gives_e2e_from_stream_end() -> None:
    # A non-streaming client: the client side sees only the end of the response at 250 ms.
    record = make_record((), n_out=5, end_ms=250)
    m = stats.request_metrics(record, Vantage.CLIENT)
    assert m is not None
    assert m.ttft_s is None and m.tpot_s is None and m.itl_s == ()
    assert m.e2e_s == pytest.approx(0.250)
    report = stats.vantage_report([record], Vantage.CLIENT)
    assert report.no_first_token == 1 and report.tpot_excluded == 0
    assert report.e2e.count == 1 and report.ttft.count == 0


def test_errors_are_out_of_latency_but_in_outcomes() -> None:
    ok = make_record([(100, 1), (130, 1)], n_out=2)
    failed = make_record([(50, 1)], n_out=None, outcome=Outcome.HTTP_ERROR)
    cancelled = make_record([(60, 1), (90, 1)], outcome=Outcome.CLIENT_CANCELLED)
    report = stats.vantage_report([ok, failed, cancelled], Vantage.CLIENT)
    assert report.requests == 1
    assert report.ttft.count == 1 and report.ttft.min == pytest.approx(0.100)
    assert report.itl.count == 1
    counts = stats.outcome_counts([ok, failed, cancelled])
    assert counts[Outcome.OK] == 1
    assert counts[Outcome.HTTP_ERROR] == 1
    assert counts[Outcome.CLIENT_CANCELLED] == 1
    assert counts[Outcome.TIMEOUT] == 0 and set(counts) == set(Outcome)


def test_itl_pools_events_across_requests() -> None:
    a = make_record([(100, 1), (110, 1), (130, 1)], n_out=3)  # gaps 10, 20
    b = make_record([(200, 1), (240, 1)], n_out=2)  # gap 40
    report = stats.vantage_report([a, b], Vantage.CLIENT)
    assert report.itl.count == 3
    assert report.itl.mean == pytest.approx((0.010 + 0.020 + 0.040) / 3)
    assert report.itl.p(50) == pytest.approx(0.020)
    # TPOT is per request: a = 30/2 = 15 ms, b = 40 ms.
    assert report.tpot.count == 2 and report.tpot.mean == pytest.approx(0.0275)


def test_summary_percentiles_hand_worked() -> None:
    s = stats.summarize([4.0, 1.0, 3.0, 2.0])
    assert s.count == 4
    assert s.mean == pytest.approx(2.5)
    assert s.std == pytest.approx(math.sqrt(1.25))  # population std
    assert (s.min, s.max) == (1.0, 4.0)
    # Linear interpolation between closest ranks: rank = q/100 * (n - 1).
    assert s.p(50) == pytest.approx(2.5)
    assert s.p(90) == pytest.approx(3.7)
    assert s.p(95) == pytest.approx(3.85)
    assert s.p(99) == pytest.approx(3.97)
    assert s.p(99.9) == pytest.approx(3.997)
    assert s.to_dict()["p99.9"] == pytest.approx(3.997)


def test_empty_run_has_no_nan_and_no_crash() -> None:
    s = stats.summarize([])
    assert s.count == 0 and s.mean is None and s.p(99) is None
    assert all(v is None or v == 0 for v in s.to_dict().values())
    report = stats.vantage_report([], Vantage.SERVER)
    assert report.requests == 0 and report.itl_per_token.count == 0
    t = stats.throughput([], 0.0)
    assert (t.requests_per_s, t.output_tokens_per_s, t.completed_requests) == (0.0, 0.0, 0)
    g = stats.goodput([], stats.SLO(ttft_s=0.5), 0.0)
    assert g.attainment is None and g.good_requests_per_s == 0.0
    assert stats.measured_interval_s([]) == 0.0
    assert stats.engine_report([]).requests == 0


def test_summary_ignores_non_finite_values() -> None:
    s = stats.summarize([1.0, float("nan"), 3.0, float("inf")])
    assert s.count == 2 and s.mean == pytest.approx(2.0)


def test_throughput_counts_completed_requests_and_says_which_tokens() -> None:
    a = make_record([(100, 1), (200, 1)], n_in=100, n_out=20)
    b = make_record([(100, 1)], n_in=50, n_out=10)
    failed = make_record((), n_in=999, n_out=999, outcome=Outcome.UPSTREAM_ERROR, end_ms=5)
    t = stats.throughput([a, b, failed], interval_s=2.0)
    assert t.completed_requests == 2
    assert t.requests_per_s == pytest.approx(1.0)
    assert t.input_tokens_per_s == pytest.approx(75.0)
    assert t.output_tokens_per_s == pytest.approx(15.0)
    assert t.total_tokens_per_s == pytest.approx(90.0)
    assert not t.output_tokens_estimated
    est = make_record([(100, 2), (200, 3)], n_out=None, token_source=TokenSource.CHUNK_COUNT)
    t2 = stats.throughput([est], interval_s=1.0)
    assert t2.output_tokens_per_s == pytest.approx(5.0) and t2.output_tokens_estimated


def test_goodput_has_failures_in_the_denominator() -> None:
    slo = stats.SLO(ttft_s=0.5, tpot_s=0.05)
    good = make_record([(100, 1), (130, 1), (160, 1)], n_out=3)  # ttft .1, tpot .03
    slow_first = make_record([(600, 1), (610, 1)], n_out=2)  # ttft .6 > .5
    slow_tokens = make_record([(100, 1), (200, 1)], n_out=2)  # tpot .1 > .05
    failed = make_record((), outcome=Outcome.TIMEOUT, end_ms=30_000)
    single = make_record([(200, 1)], n_out=1)  # no TPOT: judged on TTFT alone
    g = stats.goodput([good, slow_first, slow_tokens, failed, single], slo, interval_s=2.0)
    assert g.total_requests == 5
    assert g.good_requests == 2
    assert g.attainment == pytest.approx(0.4)
    assert g.good_requests_per_s == pytest.approx(1.0)
    assert g.good_output_tokens == 4 and g.good_output_tokens_per_s == pytest.approx(2.0)
    assert g.judged_without == {"tpot": 1}
    assert slo.describe() == "ttft<=500ms, tpot<=50ms"


def test_what_the_client_got_wrong_is_out_of_the_denominator() -> None:
    """Availability-SLO practice, hand-worked: of 8 requests, 2 good, a slow one, a 500, a
    429 (out of capacity: the service's), a 408 (timed out: the service's), a 404 for a
    mistyped model (the client's), a client gone before its first token (its own) and one gone
    after its first token (counted: it may have left because the answer was slow)."""
    slo = stats.SLO(ttft_s=0.5)

    def failed(outcome: Outcome, status: int | None, *tokens: tuple[float, int]) -> RequestRecord:
        return replace(make_record([*tokens], outcome=outcome, end_ms=50), http_status=status)

    records = [
        make_record([(100, 1), (130, 1)], n_out=2),
        make_record([(200, 1), (230, 1)], n_out=2),
        make_record([(700, 1), (730, 1)], n_out=2),  # ttft .7 > .5
        failed(Outcome.HTTP_ERROR, 500),
        failed(Outcome.HTTP_ERROR, 429),
        failed(Outcome.REJECTED, 408),
        failed(Outcome.HTTP_ERROR, 404),
        failed(Outcome.CLIENT_CANCELLED, None),
        failed(Outcome.CLIENT_CANCELLED, 200, (100, 1)),
    ]
    assert [stats.slo_exclusion(r) for r in records] == [
        None,
        None,
        None,
        None,
        None,
        None,
        "client_error",
        "client_cancelled",
        None,
    ]
    g = stats.goodput(records, slo, interval_s=1.0)
    assert (g.good_requests, g.total_requests) == (2, 7)
    assert g.attainment == pytest.approx(2 / 7)
    assert g.excluded == {"client_error": 1, "client_cancelled": 1}
    assert slo.describe_denominator() == (
        "every request, failures included, but client errors (4xx but 408 and 429) and "
        "requests the client cancelled before its first token"
    )
    # A class that counts everything: the 9 requests, the same 2 good.
    strict = stats.SLO(ttft_s=0.5, exclude=frozenset())
    g = stats.goodput(records, strict, interval_s=1.0)
    assert (g.good_requests, g.total_requests, g.excluded) == (2, 9, {})
    policy = stats.SLOPolicy({"default": slo})
    assert policy.verdict(records[6]) == ("default", False, "client_error")
    assert policy.verdict(records[0]) == ("default", True, None)


@pytest.mark.parametrize("objective", [0.0, 1.0, 1.5, float("nan")])
def test_an_objective_is_a_share_strictly_between_0_and_1(objective: float) -> None:
    with pytest.raises(ValueError, match="objective"):
        stats.SLO(ttft_s=1.0, objective=objective)


def test_goodput_boundary_is_inclusive() -> None:
    at_limit = make_record([(500, 1), (550, 1)], n_out=2)
    g = stats.goodput([at_limit], stats.SLO(ttft_s=0.5, tpot_s=0.05), interval_s=1.0)
    assert g.good_requests == 1


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_slo_rejects_meaningless_thresholds(bad: float) -> None:
    with pytest.raises(ValueError, match="positive number of seconds"):
        stats.SLO(ttft_s=bad)


def test_measured_interval_spans_first_arrival_to_last_end() -> None:
    a = make_record([(100, 1)], wall_ms=1_000, end_ms=150)  # ends at 1150 ms
    b = make_record([(300, 1)], wall_ms=1_500, end_ms=400)  # ends at 1900 ms
    assert stats.measured_interval_s([a, b]) == pytest.approx(0.9)


def test_a_request_ends_at_its_client_end_else_its_last_token() -> None:
    """`end_offset_ns`, the one "when did it end" (docs/metrics.md section 1): the client
    side's end; without one (a record cut short) its last token event; with neither, 0."""
    assert stats.end_offset_ns(make_record([(100, 1), (130, 1)], end_ms=150)) == 150 * MS
    no_end = replace(
        make_record([(100, 1), (130, 1)]),
        client=Timeline.from_marks(start_ns=0, marks=marks((100, 1), (130, 1))),
    )
    assert stats.end_offset_ns(no_end) == 130 * MS
    nothing = replace(no_end, client=Timeline.from_marks(start_ns=0, marks=()))
    assert stats.end_offset_ns(nothing) == 0


def test_request_samples_hand_worked() -> None:
    """The one per-request computation every aggregate reads. Three successful requests and
    a failure: TTFT 100 / 200 ms / none (no token, ended at 50 ms); TPOT (170 - 100) / 5 = 14
    ms / none (N_out 1) / none; E2E 170 / 200 / 50 ms; ITL 30, 40 ms (3 and 2 tokens)."""
    records = [
        make_record([(100, 1), (130, 3), (170, 2)], n_out=6),
        make_record([(200, 1)], n_out=1),
        make_record((), n_out=0, end_ms=50),
        make_record([(90, 1)], outcome=Outcome.TIMEOUT, end_ms=95),
    ]
    samples = stats.request_samples(records, Vantage.CLIENT)
    assert samples.requests == 3
    assert samples.ttft_s[:2] == pytest.approx([0.100, 0.200]) and math.isnan(samples.ttft_s[2])
    assert samples.defined("tpot") == pytest.approx([0.014])
    assert samples.defined("e2e") == pytest.approx([0.170, 0.200, 0.050])
    assert samples.itl_s == pytest.approx([0.030, 0.040]) and samples.itl_tokens.tolist() == [3, 2]
    assert samples.n_out.tolist() == [6, 1, 0]
    assert (samples.tpot_excluded, samples.no_first_token) == (2, 1)
    for index, record in enumerate(records[:3]):  # equal to the per-request definition
        m = stats.request_metrics(record, Vantage.CLIENT)
        assert m is not None
        for value, sample in (
            (m.ttft_s, samples.ttft_s),
            (m.tpot_s, samples.tpot_s),
            (m.e2e_s, samples.e2e_s),
        ):
            assert (value is None and math.isnan(sample[index])) or value == sample[index]


def test_goodput_by_class_with_and_without_exclusions() -> None:
    """Two classes over T = 2 s. default (ttft <= 150 ms): a fast request (good), a slow one,
    a 404 (a client error). interactive (ttft <= 50 ms): one request at 40 ms (good). With
    exclusions the 404 leaves default's denominator: 1 good of 2; without, 1 of 3."""
    policy = stats.SLOPolicy(
        {"default": stats.SLO(ttft_s=0.150), "interactive": stats.SLO(ttft_s=0.050)}
    )
    records = [
        make_record([(100, 1), (120, 1)], n_out=2),
        make_record([(300, 1), (320, 1)], n_out=2),
        replace(make_record((), end_ms=5), outcome=Outcome.HTTP_ERROR, http_status=404),
        replace(
            make_record([(40, 1), (60, 1), (80, 1)], n_out=3),
            attributes={"slo_class": "interactive"},
        ),
    ]
    counted = stats.goodput_by_class(records, policy, 2.0)
    assert (counted["default"].good_requests, counted["default"].total_requests) == (1, 2)
    assert counted["default"].excluded == {"client_error": 1}
    assert counted["default"].good_requests_per_s == pytest.approx(0.5)
    assert counted["interactive"].good_output_tokens_per_s == pytest.approx(1.5)
    every = stats.goodput_by_class(records, policy, 2.0, exclusions=False)
    assert (every["default"].good_requests, every["default"].total_requests) == (1, 3)
    assert every["default"].attainment == pytest.approx(1 / 3)


def test_engine_report_keeps_vllm_semantics_apart() -> None:
    from dataclasses import replace

    from sidecar.record import EngineTiming

    base = make_record([(100, 1), (130, 1)], n_out=2)
    with_engine = replace(
        base,
        engine=EngineTiming(
            time_to_first_token_ms=40.0,
            queue_time_ms=55.0,
            mean_itl_ms=30.0,
            generation_time_ms=70.0,
        ),
    )
    report = stats.engine_report([with_engine, base])
    assert report.requests == 1
    assert report.queue_time.mean == pytest.approx(0.055)
    assert report.ttft_from_scheduled.mean == pytest.approx(0.040)
    # TTFT and E2E as at every vantage, from queued: 55 + 40 = 95 ms; + 70 of generation.
    assert report.ttft.mean == pytest.approx(0.095)
    assert report.e2e.mean == pytest.approx(0.165)
    assert report.mean_itl.mean == pytest.approx(0.030)


def test_slo_policy_judges_each_request_by_its_class() -> None:
    from dataclasses import replace

    policy = stats.SLOPolicy(
        {"default": stats.SLO(ttft_s=0.5), "interactive": stats.SLO(ttft_s=0.1)}
    )
    fast = make_record([(80, 1), (100, 1)], n_out=2)
    medium = make_record([(300, 1), (320, 1)], n_out=2)
    assert policy.judge(fast) == ("default", True)
    assert policy.judge(medium) == ("default", True)
    medium_interactive = replace(medium, attributes={"slo_class": "interactive"})
    assert policy.judge(medium_interactive) == ("interactive", False)
    unknown = replace(fast, attributes={"slo_class": "batch"})
    assert policy.class_of(unknown) == "default"
    failed = make_record((), outcome=Outcome.TIMEOUT, end_ms=10)
    assert policy.judge(failed) == ("default", False)
    with pytest.raises(ValueError, match="not declared"):
        stats.SLOPolicy({"a": stats.SLO(ttft_s=1.0)})


def test_the_live_window_trims_by_age_without_being_read() -> None:
    from sidecar.sinks.window import WindowSink

    now = [10_000 * MS]
    window = WindowSink(window_s=1.0, max_records=1000, wall_ns=lambda: now[0])
    for i in range(5):
        window.on_record(make_record([(10, 1)], n_out=1, wall_ms=9_000 + 100 * i))
    assert len(window._records) == 5  # all ended within the last second
    now[0] = 12_000 * MS
    window.on_record(make_record([(10, 1)], n_out=1, wall_ms=11_990))
    assert len(window._records) == 1  # the five old ones went when the new one came


def test_the_live_window_keeps_to_its_memory_bound() -> None:
    """Records of 3 events cost 2048 + 8 x 3 (instants) + 8 x 3 (token counts) = 2096 bytes by
    the estimate (client side only): a bound of 5000 bytes keeps two, evicts (and counts) the
    rest, oldest first. With a server side of 3 events too: + 8 x 3 instants = 2120."""
    from sidecar.record import approx_record_bytes
    from sidecar.sinks.window import WindowSink

    now = [10_000 * MS]
    window = WindowSink(window_s=60.0, max_bytes=5000, wall_ns=lambda: now[0])
    records = [
        make_record([(10, 1), (20, 1), (30, 1)], n_out=3, wall_ms=9_000 + i) for i in range(5)
    ]
    assert approx_record_bytes(records[0]) == 2096
    both = make_record(
        [(10, 1), (20, 1), (30, 1)],
        n_out=3,
        server=Timeline.from_marks(2 * MS, marks((9, 1), (19, 1), (29, 1))),
    )
    assert approx_record_bytes(both) == 2120
    for record in records:
        window.on_record(record)
    assert window.records() == records[3:]
    assert window.evicted_over_cap == 3 and window.approx_bytes == 2 * 2096
    snapshot = window.snapshot()
    assert snapshot["window_bytes"] == 4192 and snapshot["evicted_over_cap"] == 3
    now[0] = 80_000 * MS  # both age out: their bytes are given back
    assert window.records() == [] and window.approx_bytes == 0
    # One record larger than the bound is still kept (the newest is never dropped).
    big = WindowSink(window_s=60.0, max_bytes=100, wall_ns=lambda: 10_000 * MS)
    big.on_record(records[0])
    assert big.records() == [records[0]] and big.evicted_over_cap == 0


# -- the bulk aggregates equal the per-request definitions, exactly ---------------------------


def _reference_vantage_report(
    records: list[RequestRecord], vantage: Vantage
) -> stats.VantageReport:
    """The aggregate written request by request from `request_metrics` (the definition)."""
    ttfts: list[float] = []
    tpots: list[float] = []
    e2es: list[float] = []
    itls: list[float] = []
    itl_tokens: list[int] = []
    requests = excluded = no_first = 0
    for record in records:
        if not record.ok:
            continue
        m = stats.request_metrics(record, vantage)
        if m is None:
            continue
        requests += 1
        if m.ttft_s is None:
            no_first += 1
        else:
            ttfts.append(m.ttft_s)
        if m.e2e_s is not None:
            e2es.append(m.e2e_s)
        if m.tpot_s is None:
            # n > 1: no choice had two tokens; else N_out <= 1.
            timeline = record.timeline(vantage)
            excluded += timeline is not None and timeline.choices is not None or m.n_out <= 1
        else:
            tpots.append(m.tpot_s)
        itls.extend(m.itl_s)
        itl_tokens.extend(m.itl_tokens)
    return stats.VantageReport(
        vantage=vantage,
        requests=requests,
        ttft=stats.summarize(ttfts),
        tpot=stats.summarize(tpots),
        e2e=stats.summarize(e2es),
        itl=stats.summarize(itls),
        itl_per_token=stats.summarize(stats.token_normalised_itl(itls, itl_tokens)),
        tpot_excluded=excluded,
        no_first_token=no_first,
    )


@pytest.mark.parametrize("seed", range(8))
def test_bulk_vantage_report_equals_the_per_request_definition(seed: int) -> None:
    records = random_records(seed, 300)
    for vantage in (Vantage.CLIENT, Vantage.SERVER, Vantage.ENGINE):
        assert stats.vantage_report(records, vantage) == _reference_vantage_report(records, vantage)


def test_percentiles_of_a_large_sample_are_numpys_bit_for_bit() -> None:
    # `percentile_values` selects the order statistics one partition at a time and interpolates
    # as numpy's linear method does: every value must be np.percentile's exactly (not close).
    rng = np.random.default_rng(7)
    n = stats.SELECT_FROM
    samples = {
        "lognormal": rng.lognormal(-4, 1, n + 12_345),
        "gaps in ns / 1e9": rng.integers(5_000_000, 12_000_000, n * 2 + 1) / 1e9,
        "few distinct values": rng.integers(0, 4, n) / 1e3,
        "one value": np.full(n, 0.0125),
        "sorted": np.sort(rng.random(n + 1)),
        "reversed": np.sort(rng.random(n + 2))[::-1].copy(),
        "two clusters": np.concatenate((rng.normal(0.01, 1e-4, n), rng.normal(5.0, 1.0, 17))),
    }
    percentile_sets = [
        stats.PERCENTILES,
        (0.0, 100.0),
        (0.0, 1.0, 25.0, 33.3, 50.0, 66.7, 99.99, 100.0),
        (99.9,),
    ]
    for name, data in samples.items():
        before = data.copy()
        for percentiles in percentile_sets:
            ours = stats.percentile_values(data, percentiles)
            assert np.array_equal(ours, np.percentile(data, percentiles)), (name, percentiles)
        assert np.array_equal(data, before), name  # the caller's sample is not reordered
    # Below the threshold, and for percentiles numpy refuses, it is np.percentile itself.
    small = rng.random(1000)
    assert np.array_equal(
        stats.percentile_values(small, stats.PERCENTILES), np.percentile(small, stats.PERCENTILES)
    )
    with pytest.raises(ValueError):
        stats.percentile_values(samples["lognormal"], (50.0, 101.0))


@pytest.mark.parametrize("seed", range(4))
def test_with_one_token_per_event_the_per_token_itl_is_the_itl(seed: int) -> None:
    # vLLM's default stream: every event one token. The bulk report summarises the gaps once
    # and gives the per-token view the same summary; the per-request definition still says it.
    records = random_records(seed, 300, tokens_per_event=(1,))
    for vantage in (Vantage.CLIENT, Vantage.SERVER):
        report = stats.vantage_report(records, vantage)
        assert report == _reference_vantage_report(records, vantage)
        assert report.itl.count > 0 and report.itl_per_token == report.itl
    # One event of two tokens anywhere: the views differ (that gap counts twice per token).
    mixed = random_records(seed, 300, tokens_per_event=(1, 1, 1, 1, 1, 1, 1, 1, 1, 2))
    report = stats.vantage_report(mixed, Vantage.CLIENT)
    assert report == _reference_vantage_report(mixed, Vantage.CLIENT)
    assert report.itl_per_token.count > report.itl.count


@pytest.mark.parametrize("seed", range(8))
def test_bulk_goodput_equals_the_per_request_verdicts(seed: int) -> None:
    records = random_records(seed, 300)
    policy = stats.SLOPolicy(
        {
            "a": stats.SLO(ttft_s=0.5, tpot_s=0.02),
            "b": stats.SLO(e2e_s=1.0),
            "default": stats.SLO(ttft_s=0.3, tpot_s=0.01, e2e_s=0.9),
        }
    )
    for vantage in (Vantage.CLIENT, Vantage.SERVER):
        for name, slo in policy.classes.items():
            members = [r for r in records if policy.class_of(r) == name]
            got = stats.goodput(members, slo, 2.0, vantage)
            good = tokens = 0
            without: dict[str, int] = {}
            for record in members:
                if stats.slo_exclusion(record) in slo.exclude:
                    continue
                if not record.ok or (m := stats.request_metrics(record, vantage)) is None:
                    continue
                met, unjudged = stats.slo_verdict(m, slo)
                if met:
                    good += 1
                    tokens += m.n_out
                    for threshold in unjudged:
                        without[threshold] = without.get(threshold, 0) + 1
            counted = [r for r in members if stats.slo_exclusion(r) not in slo.exclude]
            assert (got.total_requests, got.good_requests, got.good_output_tokens) == (
                len(counted),
                good,
                tokens,
            )
            assert dict(got.judged_without) == without


def test_n2_requests_without_a_token_event_are_summarised() -> None:
    """n = 2 requests that ended without a token-carrying event (and an n = 1 one beside
    them): no TTFT, no ITL, no TPOT (excluded and counted), E2E to the stream's end. The bulk
    TPOT once indexed the last event of no sequence and raised (found by the Prometheus sink,
    which summarises small batches)."""
    empty = Timeline(start_ns=0, end_ns=7 * MS, choices=Int64s([]))
    n2 = RequestRecord(
        request_id="n2",
        wall_time_ns=0,
        outcome=Outcome.OK,
        endpoint="completions",
        client=empty,
        n_out=0,
        token_source=TokenSource.USAGE,
    )
    for records in ([n2], [n2, replace(n2, client=Timeline(start_ns=0, end_ns=3 * MS))]):
        report = stats.vantage_report(records, Vantage.CLIENT)
        assert report.requests == len(records) and report.no_first_token == len(records)
        assert report.ttft.count == report.itl.count == report.tpot.count == 0
        assert report.tpot_excluded == len(records)
        assert report.e2e.max == pytest.approx(0.007)
        assert report == _reference_vantage_report(records, Vantage.CLIENT)


def test_n2_choices_are_sequences_of_their_own() -> None:
    """n = 2, hand-worked. Choice 0 at 100, 110, 120 ms; choice 1 at 101, 111, 121, 131 ms
    (one token each), interleaved as they arrived. TTFT 100 ms (the first token of any
    choice), E2E 131 ms, ITL 10 ms x 5 (within each choice), TPOT (20 + 30) / (2 + 3) = 10 ms.
    Mixed into one series they once gave ITL [1, 9, 1, 9, 1, 10] and TPOT 31 / 6 = 5.2 ms: a
    tpot SLO twice as lenient."""
    offsets = [100, 101, 110, 111, 120, 121, 131]
    choices = [0, 1, 0, 1, 0, 1, 1]
    timeline = Timeline(
        start_ns=0,
        offsets_ns=Int64s(o * MS for o in offsets),
        tokens=Int64s([1] * 7),
        end_ns=132 * MS,
        choices=Int64s(choices),
    )
    record = RequestRecord(
        request_id="n2",
        wall_time_ns=0,
        outcome=Outcome.OK,
        endpoint="completions",
        client=timeline,
        n_out=7,
        token_source=TokenSource.USAGE,
    )
    m = stats.request_metrics(record, Vantage.CLIENT)
    assert m is not None
    assert m.ttft_s == pytest.approx(0.100) and m.e2e_s == pytest.approx(0.131)
    assert m.itl_s == pytest.approx((0.010,) * 5)
    assert m.tpot_s == pytest.approx(0.010)
    assert stats.request_latency(record, Vantage.CLIENT) == (m.ttft_s, m.tpot_s, m.e2e_s, 7)
    report = stats.vantage_report([record], Vantage.CLIENT)
    assert report.itl.count == 5 and report.itl.max == pytest.approx(0.010)
    assert report.tpot.mean == pytest.approx(0.010) and report.tpot_excluded == 0
    # Goodput judges the per-sequence TPOT: 10 ms meets 12 ms; the mixed 5.2 ms met 6 ms.
    assert stats.goodput([record], stats.SLO(tpot_s=0.012), 1.0).good_requests == 1
    assert stats.goodput([record], stats.SLO(tpot_s=0.006), 1.0).good_requests == 0


# -- the proxy's own delay: the client vantage's instant of an event minus the server's -------


def test_relay_delay_hand_worked() -> None:
    # Upstream events reached the proxy at 110.0, 140.0, 180.0, 220.0 ms and were handed to
    # the client at 110.2, 140.5, 180.3, 220.3 ms: the proxy held them 0.2, 0.5, 0.3, 0.3 ms
    # (and so moved the three gaps by +0.3, -0.2 and 0 ms: the client's 30.3, 39.8, 40.0 against
    # the server's 30, 40, 40).
    server = Timeline(
        start_ns=2 * MS,
        offsets_ns=Int64s([110 * MS, 140 * MS, 180 * MS, 220 * MS]),
        tokens=Int64s([1, 1, 1, 1]),
        end_ns=221 * MS,
    )
    client = [(110.2, 1), (140.5, 1), (180.3, 1), (220.3, 1)]
    record = make_record(client, n_out=4, server=server)
    us = 1_000
    assert stats.relay_delays_ns(record) == [200 * us, 500 * us, 300 * us, 300 * us]
    report = stats.relay_report_of(
        stats.columns_of([record], Vantage.CLIENT), stats.columns_of([record], Vantage.SERVER)
    )
    assert report.requests == 1 and report.unpaired == 0
    assert report.delay.count == 4 and report.delay.max == pytest.approx(0.0005)
    assert report.delay.mean == pytest.approx(0.000325)
    # p50 of [0.2, 0.3, 0.3, 0.5] ms (linear): 0.3 ms; p99: 0.3 + 0.97 * 0.2 = 0.494 ms.
    assert report.delay.p(50) == pytest.approx(0.0003)
    assert report.delay.p(99) == pytest.approx(0.000494)


def test_relay_delay_needs_the_same_events_on_both_sides() -> None:
    server = Timeline(
        start_ns=0, offsets_ns=Int64s([10 * MS, 20 * MS]), tokens=Int64s([1, 1]), end_ns=21 * MS
    )
    # A client gone after the first event; a non-streaming client (no events); no server side.
    cut = make_record([(10.1, 1)], n_out=2, server=server)
    whole = make_record((), n_out=2, server=server, end_ms=30)
    alone = make_record([(10.1, 1), (20.1, 1)], n_out=2)
    for record in (cut, whole, alone):
        assert stats.relay_delays_ns(record) is None
    report = stats.relay_report_of(
        stats.columns_of([cut, whole, alone], Vantage.CLIENT),
        stats.columns_of([cut, whole, alone], Vantage.SERVER),
    )
    # Only the cut stream saw events on both sides, and not as many: unpaired, and counted.
    assert report.requests == 0 and report.unpaired == 1 and report.delay.count == 0


def test_relay_delay_with_n2_pairs_events_in_their_order() -> None:
    server = Timeline(
        start_ns=0,
        offsets_ns=Int64s([10 * MS, 11 * MS]),
        tokens=Int64s([1, 1]),
        choices=Int64s([0, 1]),
    )
    client = Timeline(
        start_ns=0,
        offsets_ns=Int64s([10 * MS + 40_000, 11 * MS + 90_000]),
        tokens=Int64s([1, 1]),
        choices=Int64s([0, 1]),
    )
    record = replace(make_record((), n_out=2, server=server), client=client)
    assert stats.relay_delays_ns(record) == [40_000, 90_000]
    relay = stats.relay_delays(
        stats.columns_of([record], Vantage.CLIENT), stats.columns_of([record], Vantage.SERVER)
    )
    assert relay.delay_ns.tolist() == [40_000, 90_000]
    assert relay.event_requests().tolist() == [0, 0]


@pytest.mark.parametrize(("seed", "share"), [(s, 0.6) for s in range(6)] + [(6, 1.0), (7, 1.0)])
def test_bulk_relay_delays_equal_the_per_request_definition(seed: int, share: float) -> None:
    """Random records, ``share`` of them relayed event for event; at 1.0 every one (the bulk
    path without selecting events)."""
    rng = np.random.default_rng(seed)
    records = []
    for record in random_records(seed, 300):
        client = record.client
        if share == 1.0 and record.server is None:
            record = replace(record, server=Timeline(start_ns=0))
        if record.server is not None and rng.random() < share:
            # Relayed event for event: the server saw each client event 0-2 ms earlier.
            held = rng.integers(0, 2_000_000, size=len(client.offsets_ns))
            up = [int(at - d) for at, d in zip(client.offsets_ns, held, strict=True)]
            server = replace(
                record.server, offsets_ns=Int64s(up), tokens=client.tokens, choices=client.choices
            )
            record = replace(record, server=server)
        records.append(record)
    relay = stats.relay_delays(
        stats.columns_of(records, Vantage.CLIENT), stats.columns_of(records, Vantage.SERVER)
    )
    delays: list[int] = []
    delay_of: list[int] = []
    unpaired = 0
    for index, record in enumerate(records):
        d = stats.relay_delays_ns(record)
        if d is None:
            side = record.server
            unpaired += bool(
                side is not None and len(side.offsets_ns) and len(record.client.offsets_ns)
            )
            continue
        delays.extend(d)
        delay_of.extend([index] * len(d))
    # The test tests something: pairs, and (but when every request is paired) others.
    assert len(delays) > 500 and (unpaired > 10) == (share < 1)
    assert relay.delay_ns.tolist() == delays and relay.event_requests().tolist() == delay_of
    assert int(np.count_nonzero(relay.unpaired)) == unpaired
    assert int(np.count_nonzero(relay.paired)) == len(set(delay_of))
