"""OpenTelemetry sink: GenAI semantic-convention metrics, goodput counters, spans.

Expected values are worked by hand from the records below (spec/metrics.md's example: TTFT
120 ms, ITL [30, 40, 40] ms, E2E 230 ms, 4 output tokens). Explicit-bucket histograms put a value
equal to a boundary in the bucket that the boundary closes (OTel: bucket i is (b[i-1], b[i]]).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import metrics as metrics_api
from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.metrics.export import (
    ExponentialHistogramDataPoint,
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
)
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind, StatusCode, TraceState
from opentelemetry.util.types import Attributes
from otlp_receiver import OTLPReceiver

from sidecar.hooks import RecordSink, Sink, SinkFanout, ThreadedSink, dropped_by_reason
from sidecar.record import (
    ChunkMark,
    EngineTiming,
    Outcome,
    RequestRecord,
    Timeline,
    TokenSource,
    Vantage,
)
from sidecar.sinks.otel import (
    DURATION_BUCKETS,
    OTHER,
    SERVER_TPOT_BUCKETS,
    SERVER_TTFT_BUCKETS,
    TOKEN_BUCKETS,
    OTelSink,
    build_otel_sink,
    build_resource,
    parse_replica,
)
from sidecar.stats import SLO, SLOPolicy

MS = 1_000_000
WALL = 1_764_000_000_123_000_000  # wall clock at t_arrive of every hand-built record

COMMON = {
    "gen_ai.operation.name": "chat",
    "gen_ai.provider.name": "vllm",
    "gen_ai.request.model": "M",
    "server.address": "10.0.0.7",
    "server.port": 8000,
}
COUNTER_COMMON = {  # the sidecar.* counters: no server address (see _counter_attrs)
    "gen_ai.operation.name": "chat",
    "gen_ai.provider.name": "vllm",
    "gen_ai.request.model": "M",
}
CONVENTION_HISTOGRAMS = {
    "gen_ai.client.operation.duration": ("s", DURATION_BUCKETS),
    "gen_ai.client.operation.time_to_first_chunk": ("s", DURATION_BUCKETS),
    "gen_ai.client.operation.time_per_output_chunk": ("s", DURATION_BUCKETS),
    "gen_ai.client.token.usage": ("{token}", TOKEN_BUCKETS),
    "gen_ai.server.request.duration": ("s", DURATION_BUCKETS),
    "gen_ai.server.time_to_first_token": ("s", SERVER_TTFT_BUCKETS),
    "gen_ai.server.time_per_output_token": ("s", SERVER_TPOT_BUCKETS),
}


def test_bucket_boundaries_are_the_conventions() -> None:
    # Written out again on purpose: a typo in the module must not also be in the test.
    assert DURATION_BUCKETS == (
        0.01,
        0.02,
        0.04,
        0.08,
        0.16,
        0.32,
        0.64,
        1.28,
        2.56,
        5.12,
        10.24,
        20.48,
        40.96,
        81.92,
    )
    assert TOKEN_BUCKETS == tuple(4**i for i in range(14))
    assert SERVER_TTFT_BUCKETS == (
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1,
        2.5,
        5,
        7.5,
        10,
    )
    assert SERVER_TPOT_BUCKETS == (
        0.01,
        0.025,
        0.05,
        0.075,
        0.1,
        0.15,
        0.2,
        0.3,
        0.4,
        0.5,
        0.75,
        1,
        2.5,
    )


# ---------------------------------------------------------------------------------------------
# Records


def marks_ms(*offsets: float, tokens: int = 1) -> tuple[ChunkMark, ...]:
    return tuple(ChunkMark(round(offset * MS), tokens) for offset in offsets)


def spec_example(**overrides: Any) -> RequestRecord:
    """spec/metrics.md: 4 tokens, first at 120 ms, gaps 30/40/40 ms, E2E 230 ms (client).

    Server side: sent upstream at 2 ms, each event received 1 ms before it reached the client:
    TTFT 117 ms, gaps 30/40/40, E2E 227 ms, TPOT (227 - 117) / 3 = 36.67 ms.
    """
    fields: dict[str, Any] = dict(
        request_id="req-1",
        wall_time_ns=WALL,
        outcome=Outcome.OK,
        endpoint="chat",
        model="M",
        client=Timeline.from_marks(
            start_ns=0, marks=marks_ms(120, 150, 190, 230), end_ns=235 * MS, events_total=6
        ),
        server=Timeline.from_marks(
            start_ns=2 * MS, marks=marks_ms(119, 149, 189, 229), end_ns=233 * MS, events_total=6
        ),
        n_in=10,
        n_out=4,
        n_cached=8,
        token_source=TokenSource.USAGE,
        finish_reason="stop",
        http_status=200,
        replica="10.0.0.7:8000",
        route_policy="least_outstanding",
    )
    fields.update(overrides)
    return RequestRecord(**fields)


# ---------------------------------------------------------------------------------------------
# Reading an InMemoryMetricReader


Point = HistogramDataPoint | ExponentialHistogramDataPoint | NumberDataPoint


class Collected:
    """name -> (unit, points) from one collection."""

    def __init__(self, reader: InMemoryMetricReader) -> None:
        self.units: dict[str, str] = {}
        self.points: dict[str, list[Any]] = {}
        data = reader.get_metrics_data()
        if data is None:
            return
        for resource_metrics in data.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    self.units[metric.name] = metric.unit or ""
                    self.points[metric.name] = list(metric.data.data_points)

    def names(self) -> set[str]:
        return {name for name, points in self.points.items() if points}

    def one(self, name: str, **attributes: Any) -> Any:
        """The single point of ``name`` whose attributes include ``attributes``."""
        found = [p for p in self.points.get(name, ()) if _includes(p.attributes, attributes)]
        assert len(found) == 1, f"{name}: {len(found)} points match {attributes}"
        return found[0]


def _includes(attributes: Attributes, wanted: dict[str, Any]) -> bool:
    attrs = dict(attributes or {})
    return all(attrs.get(key.replace("__", ".")) == value for key, value in wanted.items())


def bucket_counts(bounds: Sequence[float], index: int, count: int = 1) -> list[int]:
    """All zero but ``count`` at ``index`` (len(bounds) + 1 buckets)."""
    counts = [0] * (len(bounds) + 1)
    counts[index] = count
    return counts


@pytest.fixture
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture
def make_sink(reader: InMemoryMetricReader) -> Iterator[Any]:
    """build_otel_sink with the in-memory reader only; every sink is shut down at teardown."""
    sinks: list[OTelSink] = []

    def make(**kwargs: Any) -> OTelSink:
        kwargs.setdefault("readers", [reader])
        kwargs.setdefault("slo_policy", None)
        sink = build_otel_sink(**kwargs)
        sinks.append(sink)
        return sink

    yield make
    for sink in sinks:
        sink.shutdown()


# ---------------------------------------------------------------------------------------------
# Metrics, in memory


def test_sink_is_a_record_sink(make_sink: Any) -> None:
    sink = make_sink()
    assert isinstance(sink, RecordSink)
    assert sink.name == "otel"


def test_spec_example_gives_the_convention_points(
    make_sink: Any, reader: InMemoryMetricReader
) -> None:
    sink = make_sink()
    sink.on_record(spec_example())
    got = Collected(reader)

    assert got.names() == set(CONVENTION_HISTOGRAMS) | {"sidecar.requests"}
    for name, (unit, bounds) in CONVENTION_HISTOGRAMS.items():
        assert got.units[name] == unit, name
        for point in got.points[name]:
            assert tuple(point.explicit_bounds) == bounds, name
            attrs = dict(point.attributes)
            attrs.pop("gen_ai.token.type", None)
            assert attrs == COMMON, name

    # Client E2E 230 ms: (0.16, 0.32] is bucket 5.
    e2e = got.one("gen_ai.client.operation.duration")
    assert (e2e.count, e2e.sum) == (1, pytest.approx(0.230))
    assert list(e2e.bucket_counts) == bucket_counts(DURATION_BUCKETS, 5)
    # Client TTFT 120 ms: (0.08, 0.16] is bucket 4.
    ttfc = got.one("gen_ai.client.operation.time_to_first_chunk")
    assert (ttfc.count, ttfc.sum) == (1, pytest.approx(0.120))
    assert list(ttfc.bucket_counts) == bucket_counts(DURATION_BUCKETS, 4)
    # ITL 30, 40, 40 ms: one observation per chunk after the first, all in (0.02, 0.04]
    # (40 ms sits on the boundary 0.04, which closes bucket 2).
    chunks = got.one("gen_ai.client.operation.time_per_output_chunk")
    assert (chunks.count, chunks.sum) == (3, pytest.approx(0.110))
    assert (chunks.min, chunks.max) == (pytest.approx(0.030), pytest.approx(0.040))
    assert list(chunks.bucket_counts) == bucket_counts(DURATION_BUCKETS, 2, 3)
    # Tokens: input 10 in (4, 16] = bucket 2; output 4 on the boundary of (1, 4] = bucket 1.
    tokens_in = got.one("gen_ai.client.token.usage", gen_ai__token__type="input")
    assert (tokens_in.count, tokens_in.sum) == (1, 10)
    assert list(tokens_in.bucket_counts) == bucket_counts(TOKEN_BUCKETS, 2)
    tokens_out = got.one("gen_ai.client.token.usage", gen_ai__token__type="output")
    assert (tokens_out.count, tokens_out.sum) == (1, 4)
    assert list(tokens_out.bucket_counts) == bucket_counts(TOKEN_BUCKETS, 1)
    # Server: E2E 227 ms (bucket 5), TTFT 117 ms in (0.1, 0.25] = bucket 8 of its own
    # buckets, TPOT 36.67 ms in (0.025, 0.05] = bucket 2.
    server = got.one("gen_ai.server.request.duration")
    assert (server.count, server.sum) == (1, pytest.approx(0.227))
    assert list(server.bucket_counts) == bucket_counts(DURATION_BUCKETS, 5)
    ttft = got.one("gen_ai.server.time_to_first_token")
    assert (ttft.count, ttft.sum) == (1, pytest.approx(0.117))
    assert list(ttft.bucket_counts) == bucket_counts(SERVER_TTFT_BUCKETS, 8)
    tpot = got.one("gen_ai.server.time_per_output_token")
    assert (tpot.count, tpot.sum) == (1, pytest.approx(0.110 / 3))
    assert list(tpot.bucket_counts) == bucket_counts(SERVER_TPOT_BUCKETS, 2)

    # Without an SLO policy: the request counter alone, by outcome (no replica attributes).
    requests = got.one("sidecar.requests")
    assert dict(requests.attributes) == {**COUNTER_COMMON, "sidecar.outcome": "ok"}
    assert requests.value == 1
    assert got.units["sidecar.requests"] == "{request}"


def test_server_chunk_gaps_are_opt_in(make_sink: Any, reader: InMemoryMetricReader) -> None:
    sink = make_sink(server_chunks=True)
    sink.on_record(spec_example())
    got = Collected(reader)
    gaps = got.one("sidecar.server.time_per_output_chunk")
    assert got.units["sidecar.server.time_per_output_chunk"] == "s"
    assert tuple(gaps.explicit_bounds) == DURATION_BUCKETS
    assert dict(gaps.attributes) == COMMON
    assert (gaps.count, gaps.sum) == (3, pytest.approx(0.110))


def test_failed_request_carries_error_type_and_no_latency_points(
    make_sink: Any, reader: InMemoryMetricReader
) -> None:
    sink = make_sink()
    # Two tokens reached the client, then the upstream reset the stream at 400 ms.
    failed = spec_example(
        outcome=Outcome.UPSTREAM_ERROR,
        error_type="ClientPayloadError",
        http_status=200,
        client=Timeline.from_marks(start_ns=0, marks=marks_ms(120, 150), end_ns=400 * MS),
        server=Timeline.from_marks(start_ns=2 * MS, marks=marks_ms(119, 149), end_ns=399 * MS),
        n_in=None,
        n_out=None,
        token_source=TokenSource.CHUNK_COUNT,
        finish_reason=None,
    )
    sink.on_record(failed)
    got = Collected(reader)

    assert got.names() == {
        "gen_ai.client.operation.duration",
        "gen_ai.server.request.duration",
        "sidecar.requests",
    }
    # error.type as the conventions define it: the failure's type (no HTTP error status here),
    # never the sidecar's outcome name.
    failed_attrs = {**COMMON, "error.type": "ClientPayloadError"}
    # A failed operation lasts until the error (400 ms, bucket 6), not its last token.
    client = got.one("gen_ai.client.operation.duration")
    assert dict(client.attributes) == failed_attrs
    assert (client.count, client.sum) == (1, pytest.approx(0.400))
    assert list(client.bucket_counts) == bucket_counts(DURATION_BUCKETS, 6)
    server = got.one("gen_ai.server.request.duration")
    assert dict(server.attributes) == failed_attrs
    assert server.sum == pytest.approx(0.397)
    assert dict(got.one("sidecar.requests").attributes) == {
        **COUNTER_COMMON,
        "sidecar.outcome": "upstream_error",
    }


def test_rejected_request_has_no_server_side(make_sink: Any, reader: InMemoryMetricReader) -> None:
    sink = make_sink()
    sink.on_record(
        spec_example(
            outcome=Outcome.REJECTED,
            error_type="max_concurrency",
            http_status=429,
            replica=None,
            server=None,
            n_in=None,
            n_out=None,
            token_source=TokenSource.NONE,
            client=Timeline(start_ns=0, end_ns=1 * MS),
        )
    )
    got = Collected(reader)
    assert got.names() == {"gen_ai.client.operation.duration", "sidecar.requests"}
    point = got.one("gen_ai.client.operation.duration")
    # The upstream never confirmed "M" (the request was refused before it): no label slot.
    assert dict(point.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": "other",
        "error.type": "429",
    }
    assert point.sum == pytest.approx(0.001)


def test_non_streaming_client_has_no_time_to_first_chunk(
    make_sink: Any, reader: InMemoryMetricReader
) -> None:
    sink = make_sink()
    # The proxy streamed from the upstream and assembled the answer: server-side TTFT exists,
    # the client saw one body at 240 ms.
    sink.on_record(
        spec_example(
            client_stream=False, client=Timeline(start_ns=0, end_ns=240 * MS, events_total=0)
        )
    )
    got = Collected(reader)
    assert "gen_ai.client.operation.time_to_first_chunk" not in got.names()
    assert "gen_ai.client.operation.time_per_output_chunk" not in got.names()
    assert got.one("gen_ai.client.operation.duration").sum == pytest.approx(0.240)
    assert got.one("gen_ai.server.time_to_first_token").sum == pytest.approx(0.117)


def test_single_output_token_has_no_server_tpot(
    make_sink: Any, reader: InMemoryMetricReader
) -> None:
    sink = make_sink()
    sink.on_record(
        spec_example(
            n_out=1,
            client=Timeline.from_marks(start_ns=0, marks=marks_ms(120), end_ns=125 * MS),
            server=Timeline.from_marks(start_ns=2 * MS, marks=marks_ms(119), end_ns=124 * MS),
        )
    )
    got = Collected(reader)
    assert "gen_ai.server.time_per_output_token" not in got.names()
    assert "gen_ai.client.operation.time_per_output_chunk" not in got.names()
    assert got.one("gen_ai.server.time_to_first_token").sum == pytest.approx(0.117)
    assert got.one("gen_ai.client.operation.duration").sum == pytest.approx(0.120)


def test_token_usage_only_when_the_counts_are_known(
    make_sink: Any, reader: InMemoryMetricReader
) -> None:
    sink = make_sink()
    # No usage from the upstream: N_out is a chunk count (an estimate), N_in unknown.
    sink.on_record(spec_example(n_in=None, token_source=TokenSource.CHUNK_COUNT))
    assert "gen_ai.client.token.usage" not in Collected(reader).names()
    sink.on_record(spec_example(token_source=TokenSource.USAGE_TOTAL))
    got = Collected(reader)
    assert got.one("gen_ai.client.token.usage", gen_ai__token__type="output").sum == 4
    assert got.one("gen_ai.client.token.usage", gen_ai__token__type="input").sum == 10


def test_completions_is_text_completion_and_pass_through_is_skipped(
    make_sink: Any, reader: InMemoryMetricReader
) -> None:
    sink = make_sink(provider_name="my-vllm")
    sink.on_record(spec_example(endpoint="completions"))
    sink.on_record(spec_example(endpoint="/v1/models", model=None))
    got = Collected(reader)
    point = got.one("gen_ai.client.operation.duration")
    assert point.attributes["gen_ai.operation.name"] == "text_completion"
    assert point.attributes["gen_ai.provider.name"] == "my-vllm"
    assert point.count == 1
    assert sink.skipped == 1


def test_model_and_replica_values_are_capped(make_sink: Any, reader: InMemoryMetricReader) -> None:
    sink = make_sink(max_models=2, max_replicas=1)
    for model, replica in (("a", "h1:1"), ("b", "h2:2"), ("c", "h1:1"), ("a", "h1:1")):
        sink.on_record(spec_example(model=model, replica=replica))
    got = Collected(reader)
    counts = {
        (
            p.attributes["gen_ai.request.model"],
            p.attributes["server.address"],
            p.attributes.get("server.port"),
        ): p.count
        for p in got.points["gen_ai.client.operation.duration"]
    }
    assert counts == {("a", "h1", 1): 2, ("b", OTHER, None): 1, (OTHER, "h1", 1): 1}
    assert sink.models.overflowed == 1 and sink.replicas.overflowed == 1


def test_model_absent_leaves_the_attribute_out(
    make_sink: Any, reader: InMemoryMetricReader
) -> None:
    sink = make_sink()
    sink.on_record(spec_example(model=None))
    point = Collected(reader).one("gen_ai.client.operation.duration")
    assert "gen_ai.request.model" not in point.attributes


def test_replica_parsing() -> None:
    assert parse_replica("10.0.0.7:8000") == ("10.0.0.7", 8000)
    assert parse_replica("[::1]:8001") == ("::1", 8001)
    assert parse_replica("vllm-0.svc:80/prefix") == ("vllm-0.svc", 80)
    assert parse_replica("host") == ("host", None)
    assert parse_replica("host:notaport") == ("host", None)


POLICY = SLOPolicy(
    classes={"interactive": SLO(ttft_s=0.1, tpot_s=0.05), "batch": SLO(e2e_s=10.0)},
    default_class="batch",
)


def goodput_records() -> list[RequestRecord]:
    interactive = {"slo_class": "interactive"}
    return [
        # interactive, TTFT 120 ms > 100 ms: not good
        spec_example(attributes=interactive),
        # interactive, TTFT 50 ms, TPOT (110 - 50) / 3 = 20 ms: good, 4 tokens
        spec_example(
            attributes=interactive,
            client=Timeline.from_marks(
                start_ns=0, marks=marks_ms(50, 70, 90, 110), end_ns=112 * MS
            ),
        ),
        # batch (default class, unknown class name falls back to it): good, 4 tokens
        spec_example(attributes={"slo_class": "nope"}),
        # batch, failed: in the denominator, never good
        spec_example(outcome=Outcome.TIMEOUT, error_type="upstream_timeout"),
    ]


def test_goodput_counters_per_class(make_sink: Any, reader: InMemoryMetricReader) -> None:
    sink = make_sink(slo_policy=POLICY)
    records = goodput_records()
    for record in records:
        sink.on_record(record)
    got = Collected(reader)

    interactive = {**COUNTER_COMMON, "sidecar.slo.class": "interactive"}
    batch = {**COUNTER_COMMON, "sidecar.slo.class": "batch"}
    requests = {
        (p.attributes["sidecar.slo.class"], p.attributes["sidecar.outcome"]): p.value
        for p in got.points["sidecar.requests"]
    }
    assert requests == {("interactive", "ok"): 2, ("batch", "ok"): 1, ("batch", "timeout"): 1}
    for point in got.points["sidecar.requests"]:
        attrs = dict(point.attributes)
        assert attrs.pop("sidecar.outcome")
        assert attrs in (interactive, batch)

    good = {p.attributes["sidecar.slo.class"]: p for p in got.points["sidecar.good_requests"]}
    assert {name: p.value for name, p in good.items()} == {"interactive": 1, "batch": 1}
    assert dict(good["interactive"].attributes) == interactive
    assert dict(good["batch"].attributes) == batch
    tokens = {
        p.attributes["sidecar.slo.class"]: p.value for p in got.points["sidecar.good_output_tokens"]
    }
    assert tokens == {"interactive": 4, "batch": 4}
    assert got.units["sidecar.good_requests"] == "{request}"
    assert got.units["sidecar.good_output_tokens"] == "{token}"

    # The same verdicts as SLOPolicy.judge, the one definition of a good request.
    judged = [POLICY.judge(record) for record in records]
    assert judged == [
        ("interactive", False),
        ("interactive", True),
        ("batch", True),
        ("batch", False),
    ]

    # The thresholds themselves, exported beside the counters at every collection and
    # joined to them on the class.
    thresholds = {
        (p.attributes["sidecar.slo.class"], p.attributes["sidecar.slo.metric"]): (
            p.value,
            p.attributes["sidecar.slo.thresholds"],
            p.attributes["sidecar.slo.vantage"],
        )
        for p in got.points["sidecar.slo.threshold"]
    }
    assert thresholds == {
        ("interactive", "ttft"): (0.1, "ttft<=100ms, tpot<=50ms", "client"),
        ("interactive", "tpot"): (0.05, "ttft<=100ms, tpot<=50ms", "client"),
        ("batch", "e2e"): (10.0, "e2e<=10000ms", "client"),
    }
    assert got.units["sidecar.slo.threshold"] == "s"


def test_goodput_from_the_server_vantage(make_sink: Any, reader: InMemoryMetricReader) -> None:
    # Client TTFT 120 ms fails a 118 ms SLO; the replica's 117 ms meets it.
    sink = make_sink(
        slo_policy=SLOPolicy({"default": SLO(ttft_s=0.118)}), slo_vantage=Vantage.SERVER
    )
    sink.on_record(spec_example())
    got = Collected(reader)
    assert got.one("sidecar.good_requests").value == 1
    assert got.one("sidecar.slo.threshold").attributes["sidecar.slo.vantage"] == "server"


def test_exponential_histograms_in_memory(make_sink: Any, reader: InMemoryMetricReader) -> None:
    sink = make_sink(exponential_histograms=True)
    sink.on_record(spec_example())
    got = Collected(reader)
    for name in CONVENTION_HISTOGRAMS:
        for point in got.points[name]:
            assert isinstance(point, ExponentialHistogramDataPoint), name
    chunks = got.one("gen_ai.client.operation.time_per_output_chunk")
    assert (chunks.count, chunks.sum) == (3, pytest.approx(0.110))
    assert sum(chunks.positive.bucket_counts) == 3


@settings(max_examples=40, deadline=None)
@given(
    gaps_ms=st.lists(st.integers(min_value=0, max_value=5_000), max_size=40),
    ttft_ms=st.integers(min_value=0, max_value=60_000),
)
def test_one_chunk_observation_per_gap(gaps_ms: list[int], ttft_ms: int) -> None:
    reader = InMemoryMetricReader()
    sink = build_otel_sink(readers=[reader], slo_policy=None)
    try:
        offsets = [ttft_ms]
        for gap in gaps_ms:
            offsets.append(offsets[-1] + gap)
        sink.on_record(
            spec_example(
                client=Timeline.from_marks(
                    start_ns=0, marks=marks_ms(*offsets), end_ns=offsets[-1] * MS
                ),
                n_out=len(offsets),
            )
        )
        got = Collected(reader)
        if gaps_ms:
            chunks = got.one("gen_ai.client.operation.time_per_output_chunk")
            assert chunks.count == len(gaps_ms)
            assert chunks.sum == pytest.approx(sum(gaps_ms) / 1000)
            assert sum(chunks.bucket_counts) == len(gaps_ms)
        else:
            assert "gen_ai.client.operation.time_per_output_chunk" not in got.names()
        assert got.one("gen_ai.client.operation.duration").sum == pytest.approx(offsets[-1] / 1000)
    finally:
        sink.shutdown()


def test_fanout_delivers_to_the_sink(make_sink: Any, reader: InMemoryMetricReader) -> None:
    sink = make_sink()
    fanout = SinkFanout([sink])
    fanout.on_record(spec_example())
    assert fanout.errors == {"otel": 0}
    assert Collected(reader).one("gen_ai.client.operation.duration").count == 1


def test_never_the_global_providers(make_sink: Any) -> None:
    sink = make_sink(traces=True, span_exporter=InMemorySpanExporter())
    assert metrics_api.get_meter_provider() is not sink.meter_provider
    assert trace_api.get_tracer_provider() is not sink.tracer_provider


def test_shutdown_is_idempotent_and_later_records_are_dropped(reader: InMemoryMetricReader) -> None:
    sink = build_otel_sink(readers=[reader], slo_policy=None)
    sink.on_record(spec_example())
    sink.shutdown()
    sink.shutdown()
    sink.on_record(spec_example())
    assert sink.skipped == 1


def test_the_sink_lifecycle_in_seconds_closing_once(reader: InMemoryMetricReader) -> None:
    sink = build_otel_sink(readers=[reader], slo_policy=None)
    assert isinstance(sink, Sink)
    shutdowns: list[int] = []
    real_shutdown = sink.meter_provider.shutdown

    def counted_shutdown(timeout_millis: float = 30_000) -> None:
        shutdowns.append(int(timeout_millis))
        real_shutdown(timeout_millis)

    sink.meter_provider.shutdown = counted_shutdown  # type: ignore[method-assign]
    sink.on_record(spec_example())
    sink.on_record(spec_example(endpoint="/v1/models", model=None))
    assert sink.flush(timeout_s=5) is True
    assert Collected(reader).one("gen_ai.client.operation.duration").count == 1
    assert sink.counters() == {"taken": 1, "skipped": 1}
    sink.close(timeout_s=2.5)
    sink.close(timeout_s=2.5)  # idempotent: the SDK is shut down once
    assert shutdowns == [2500]
    sink.on_record(spec_example())  # after close: not measured, counted
    assert sink.counters() == {"taken": 1, "skipped": 2}


async def test_the_fanout_drains_the_threaded_sink_then_the_last_export(
    receiver: OTLPReceiver,
) -> None:
    """As `sidecar proxy` wires it: the OTel sink behind a ThreadedSink, closed through the
    fan-out only. The queue drains into the SDK first, then its shutdown exports."""
    # Built off the loop: the SDK's resource detection waits on threads of its own.
    sink = await asyncio.to_thread(
        lambda: build_otel_sink(endpoint=receiver.url, slo_policy=None, export_interval_s=3600)
    )
    fanout = SinkFanout([ThreadedSink(sink)])
    for _ in range(3):
        fanout.on_record(spec_example())
    fanout.on_record(spec_example(endpoint="/v1/models", model=None))
    # In a thread: the final export goes to a receiver served by this loop.
    assert await asyncio.to_thread(fanout.close, 10) == []
    got = received_metrics(receiver)
    assert sum(p.count for p in got["gen_ai.client.operation.duration"].histogram.data_points) == 3
    counters = fanout.counters()["otel"]
    # The thread handed on all four; the SDK measured three and skipped the pass-through.
    assert counters["taken"] == counters["written"] == 4 and counters["skipped"] == 1
    assert sum(dropped_by_reason(counters).values()) == 0


def test_resource_honours_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_resource().attributes["service.name"] == "vllm-sidecar"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "sidecar-a")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.version=9,k8s.pod.name=p")
    attributes = build_resource().attributes
    assert attributes["service.name"] == "sidecar-a"
    assert attributes["service.version"] == "9"
    assert attributes["k8s.pod.name"] == "p"


# ---------------------------------------------------------------------------------------------
# A real OTLP/HTTP receiver on 127.0.0.1


@pytest.fixture
async def receiver() -> AsyncIterator[OTLPReceiver]:
    server = OTLPReceiver()
    await server.start()
    yield server
    await server.close()


def any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(any_value(v) for v in value.array_value.values)
    return getattr(value, kind)


def kv(attributes: Any) -> dict[str, Any]:
    return {a.key: any_value(a.value) for a in attributes}


def received_metrics(receiver: OTLPReceiver) -> dict[str, Any]:
    """name -> the last proto Metric received with that name."""
    out: dict[str, Any] = {}
    for request in receiver.metrics:
        for resource_metrics in request.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    out[metric.name] = metric
    return out


async def test_real_otlp_export_carries_every_convention(receiver: OTLPReceiver) -> None:
    sink = build_otel_sink(
        endpoint=receiver.url + "/", slo_policy=POLICY, export_interval_s=3600, traces=True
    )
    try:
        for record in goodput_records():
            sink.on_record(record)
        # Export runs in a worker thread; the receiver answers on this loop meanwhile.
        assert await asyncio.to_thread(sink.force_flush)
    finally:
        await sink.aclose()
    assert receiver.rejected == []

    resource = kv(receiver.metrics[0].resource_metrics[0].resource.attributes)
    assert resource["service.name"] == "vllm-sidecar"
    scope = receiver.metrics[0].resource_metrics[0].scope_metrics[0].scope
    assert scope.name == "sidecar.sinks.otel"

    got = received_metrics(receiver)
    assert set(CONVENTION_HISTOGRAMS) <= set(got)
    for name, (unit, bounds) in CONVENTION_HISTOGRAMS.items():
        metric = got[name]
        assert metric.unit == unit, name
        assert metric.WhichOneof("data") == "histogram", name
        for point in metric.histogram.data_points:
            assert tuple(point.explicit_bounds) == bounds, name
            attrs = kv(point.attributes)
            assert attrs.pop("gen_ai.token.type", "input") in ("input", "output")
            attrs.pop("error.type", None)
            assert attrs == COMMON, name

    durations = {
        kv(p.attributes).get("error.type"): p.count
        for p in got["gen_ai.client.operation.duration"].histogram.data_points
    }
    assert durations == {None: 3, "upstream_timeout": 1}
    chunks = got["gen_ai.client.operation.time_per_output_chunk"].histogram.data_points
    assert [p.count for p in chunks] == [9]  # three successful requests, 3 gaps each
    usage = {
        kv(p.attributes)["gen_ai.token.type"]: (p.count, p.sum)
        for p in got["gen_ai.client.token.usage"].histogram.data_points
    }
    assert usage == {"input": (4, 40), "output": (4, 16)}

    assert got["sidecar.requests"].WhichOneof("data") == "sum"
    assert got["sidecar.requests"].sum.is_monotonic
    good = {
        kv(p.attributes)["sidecar.slo.class"]: p.as_int
        for p in got["sidecar.good_requests"].sum.data_points
    }
    assert good == {"interactive": 1, "batch": 1}
    total = sum(p.as_int for p in got["sidecar.requests"].sum.data_points)
    assert total == 4
    assert got["sidecar.slo.threshold"].WhichOneof("data") == "gauge"

    spans = [
        span
        for request in receiver.traces
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    assert len(spans) == 4
    assert {span.name for span in spans} == {"chat M"}


async def test_real_otlp_exponential_histograms(receiver: OTLPReceiver) -> None:
    sink = build_otel_sink(
        endpoint=receiver.url, slo_policy=None, export_interval_s=3600, exponential_histograms=True
    )
    try:
        sink.on_record(spec_example())
        assert await asyncio.to_thread(sink.force_flush)
    finally:
        await sink.aclose()
    got = received_metrics(receiver)
    for name in CONVENTION_HISTOGRAMS:
        assert got[name].WhichOneof("data") == "exponential_histogram", name
        assert got[name].unit == CONVENTION_HISTOGRAMS[name][0]
    (chunks,) = got[
        "gen_ai.client.operation.time_per_output_chunk"
    ].exponential_histogram.data_points
    assert chunks.count == 3
    assert chunks.sum == pytest.approx(0.110)
    assert sum(chunks.positive.bucket_counts) == 3
    assert kv(chunks.attributes) == COMMON


@pytest.mark.parametrize(
    "variable, suffix",
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "/v1/metrics"),
    ],
)
async def test_endpoint_from_the_environment(
    receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch, variable: str, suffix: str
) -> None:
    monkeypatch.setenv(variable, receiver.url + suffix)
    sink = build_otel_sink(endpoint=None, slo_policy=None, export_interval_s=3600)
    sink.on_record(spec_example())
    await sink.aclose()  # shutdown exports what is pending
    assert "gen_ai.client.operation.duration" in received_metrics(receiver)


async def test_periodic_export_needs_no_flush(receiver: OTLPReceiver) -> None:
    # The SDK's own thread exports on schedule while this loop keeps serving the receiver.
    sink = build_otel_sink(endpoint=receiver.url, slo_policy=None, export_interval_s=0.05)
    try:
        sink.on_record(spec_example())
        await receiver.wait_for(lambda r: "gen_ai.client.operation.duration" in received_metrics(r))
    finally:
        await sink.aclose()


# ---------------------------------------------------------------------------------------------
# Spans

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def make_traced(make_sink: Any, spans: InMemorySpanExporter) -> Any:
    def make(**kwargs: Any) -> OTelSink:
        sink: OTelSink = make_sink(traces=True, span_exporter=spans, **kwargs)
        return sink

    return make


def finished(sink: OTelSink, spans: InMemorySpanExporter) -> tuple[ReadableSpan, ...]:
    assert sink.force_flush()
    return spans.get_finished_spans()


def test_span_carries_the_sidecars_own_delay(make_traced: Any, spans: InMemorySpanExporter) -> None:
    """Upstream events at 119.8, 149, 189.6, 229 ms, written to the client at 120, 150, 190,
    230: held 0.2, 1.0, 0.4, 1.0 ms, so at most 1.0 and 0.65 on average. A client gone after
    two events (two client events, four upstream ones) has no such attributes."""
    sink = make_traced()
    server = Timeline.from_marks(
        start_ns=2 * MS, marks=marks_ms(119.8, 149, 189.6, 229), end_ns=233 * MS
    )
    sink.on_record(spec_example(server=server))
    cut = Timeline.from_marks(start_ns=0, marks=marks_ms(120, 150), end_ns=151 * MS)
    sink.on_record(spec_example(request_id="req-2", client=cut))
    whole, gone = finished(sink, spans)
    attrs = dict(whole.attributes or {})
    assert attrs["sidecar.relay.delay_max"] == pytest.approx(0.0010)
    assert attrs["sidecar.relay.delay_mean"] == pytest.approx(0.00065)
    assert not {"sidecar.relay.delay_max", "sidecar.relay.delay_mean"} & set(gone.attributes or {})


def test_span_from_the_record(make_traced: Any, spans: InMemorySpanExporter) -> None:
    sink = make_traced(slo_policy=POLICY)
    record = spec_example(
        attributes={"traceparent": TRACEPARENT, "tracestate": "vendor=x"},
        engine=EngineTiming(
            queue_time_ms=5.0,
            time_to_first_token_ms=100.0,
            generation_time_ms=200.0,
            mean_itl_ms=36.0,
        ),
    )
    sink.on_record(record)
    (span,) = finished(sink, spans)

    assert span.name == "chat M"
    assert span.kind is SpanKind.CLIENT
    assert span.context is not None and span.parent is not None
    assert span.context.trace_id == TRACE_ID
    assert span.parent.span_id == PARENT_ID
    assert span.parent.is_remote
    assert span.context.trace_state == TraceState([("vendor", "x")])
    assert span.start_time == WALL
    assert span.end_time == WALL + 235 * MS
    assert span.status.status_code is StatusCode.UNSET

    attrs = dict(span.attributes or {})
    expected = {
        **COMMON,
        "gen_ai.request.stream": True,
        "gen_ai.response.time_to_first_chunk": pytest.approx(0.120),
        "gen_ai.usage.input_tokens": 10,
        "gen_ai.usage.output_tokens": 4,
        "gen_ai.usage.cache_read.input_tokens": 8,
        "gen_ai.response.finish_reasons": ("stop",),
        "http.response.status_code": 200,
        "sidecar.request_id": "req-1",
        "sidecar.outcome": "ok",
        "sidecar.upstream_stream": True,
        "sidecar.token_source": "usage",
        "sidecar.route_policy": "least_outstanding",
        "sidecar.client.e2e": pytest.approx(0.230),
        "sidecar.client.time_per_output_token": pytest.approx(0.110 / 3),
        "sidecar.client.chunks": 4,
        "sidecar.server.request_sent": pytest.approx(0.002),
        "sidecar.server.time_to_first_token": pytest.approx(0.117),
        "sidecar.server.e2e": pytest.approx(0.227),
        "sidecar.server.time_per_output_token": pytest.approx(0.110 / 3),
        "sidecar.server.chunks": 4,
        # Each event reached the client 1 ms after the upstream socket.
        "sidecar.relay.delay_max": pytest.approx(0.001),
        "sidecar.relay.delay_mean": pytest.approx(0.001),
        "sidecar.engine.queue_time": pytest.approx(0.005),
        # The interval the server's attribute of that name has: queued -> first token.
        "sidecar.engine.time_to_first_token": pytest.approx(0.105),
        "sidecar.engine.time_to_first_token_from_scheduled": pytest.approx(0.100),
        "sidecar.engine.e2e": pytest.approx(0.305),
        "sidecar.engine.generation_time": pytest.approx(0.200),
        "sidecar.engine.mean_itl": pytest.approx(0.036),
        "sidecar.slo.class": "batch",
        "sidecar.slo.good": True,
    }
    assert attrs == expected

    # One event per token-carrying chunk, at the client's instants.
    assert [e.name for e in span.events] == ["sidecar.chunk"] * 4
    assert [e.timestamp for e in span.events] == [WALL + ms * MS for ms in (120, 150, 190, 230)]
    assert [dict(e.attributes or {}) for e in span.events] == [
        {"sidecar.chunk.index": i, "sidecar.chunk.tokens": 1, "sidecar.vantage": "client"}
        for i in range(4)
    ]


def test_span_without_traceparent_is_a_root(make_traced: Any, spans: InMemorySpanExporter) -> None:
    sink = make_traced()
    sink.on_record(spec_example(attributes={"traceparent": "garbage"}))
    sink.on_record(spec_example(endpoint="completions", model=None))
    first, second = finished(sink, spans)
    assert first.parent is None and second.parent is None
    assert first.context is not None and first.context.trace_id != TRACE_ID
    assert second.name == "text_completion"


def test_span_keeps_raw_values_past_the_metric_caps(
    make_traced: Any, spans: InMemorySpanExporter, reader: InMemoryMetricReader
) -> None:
    sink = make_traced(max_models=1, max_replicas=1)
    sink.on_record(spec_example())
    sink.on_record(spec_example(model="N", replica="[::1]:9000"))
    _, second = finished(sink, spans)
    assert second.name == "chat N"
    attrs = dict(second.attributes or {})
    assert (attrs["gen_ai.request.model"], attrs["server.address"], attrs["server.port"]) == (
        "N",
        "::1",
        9000,
    )
    models = {
        p.attributes["gen_ai.request.model"]
        for p in Collected(reader).points["gen_ai.client.operation.duration"]
    }
    assert models == {"M", OTHER}


def test_failed_request_span(make_traced: Any, spans: InMemorySpanExporter) -> None:
    sink = make_traced()
    sink.on_record(
        spec_example(
            outcome=Outcome.HTTP_ERROR,
            error_type="http_503",
            http_status=503,
            client=Timeline(start_ns=0, end_ns=30 * MS),
            server=Timeline(start_ns=2 * MS, end_ns=29 * MS),
            n_in=None,
            n_out=None,
            token_source=TokenSource.NONE,
            finish_reason=None,
        )
    )
    (span,) = finished(sink, spans)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "http_503"
    attrs = dict(span.attributes or {})
    assert attrs["error.type"] == "503"  # the status code, per the conventions
    assert attrs["sidecar.error_type"] == "http_503"
    assert attrs["http.response.status_code"] == 503
    assert "gen_ai.usage.output_tokens" not in attrs
    assert "gen_ai.response.time_to_first_chunk" not in attrs
    assert span.events == ()
    assert span.end_time == WALL + 30 * MS


def test_assembled_answer_uses_the_upstream_chunks(
    make_traced: Any, spans: InMemorySpanExporter
) -> None:
    sink = make_traced()
    sink.on_record(spec_example(client_stream=False, client=Timeline(start_ns=0, end_ns=240 * MS)))
    (span,) = finished(sink, spans)
    attrs = dict(span.attributes or {})
    assert attrs["gen_ai.request.stream"] is False
    assert "gen_ai.response.time_to_first_chunk" not in attrs
    assert [e.timestamp for e in span.events] == [WALL + ms * MS for ms in (119, 149, 189, 229)]
    assert {(e.attributes or {}).get("sidecar.vantage") for e in span.events} == {"server"}


def test_unsampled_parent_exports_nothing(make_traced: Any, spans: InMemorySpanExporter) -> None:
    sink = make_traced()
    sink.on_record(spec_example(attributes={"traceparent": TRACEPARENT[:-2] + "00"}))
    assert finished(sink, spans) == ()


class RecordOnly(Sampler):
    """Records every span but samples none (what a tail-sampling setup may do)."""

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        return SamplingResult(Decision.RECORD_ONLY, attributes)

    def get_description(self) -> str:
        return "RecordOnly"


class Capture(SpanProcessor):
    """Sees every ended span, sampled or not (exporting processors see sampled ones only)."""

    def __init__(self) -> None:
        self.ended: list[ReadableSpan] = []

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        self.ended.append(span)


def test_chunk_events_only_on_sampled_spans(make_traced: Any, spans: InMemorySpanExporter) -> None:
    sink = make_traced(sampler=RecordOnly())
    capture = Capture()
    assert sink.tracer_provider is not None
    sink.tracer_provider.add_span_processor(capture)
    sink.on_record(spec_example())
    assert finished(sink, spans) == ()  # recorded, not sampled: never exported
    (span,) = capture.ended
    assert (span.attributes or {})["sidecar.client.chunks"] == 4
    assert span.events == ()


def test_chunk_events_respect_the_span_event_limit(
    make_sink: Any, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "2")
    sink = make_sink(traces=True, span_exporter=spans)
    sink.on_record(spec_example())
    (span,) = finished(sink, spans)
    # The first chunks are kept (the SDK alone would keep the last ones), the rest counted.
    assert [e.timestamp for e in span.events] == [WALL + 120 * MS, WALL + 150 * MS]
    assert (span.attributes or {})["sidecar.chunk_events.dropped"] == 2


async def test_the_proxy_exports_to_a_real_otlp_receiver_through_its_wiring() -> None:
    """`sidecar proxy --otel-endpoint URL --otel-traces`: the CLI's wiring, end to end."""
    import aiohttp
    from proxy_stack import stack

    receiver = OTLPReceiver()
    url = await receiver.start()
    try:
        async with (
            stack(
                otel_endpoint=url, otel_traces="true", slo="ttft=5s", otel_export_interval="100ms"
            ) as s,
            aiohttp.ClientSession() as session,
        ):
            body = {
                "model": "m",
                "stream": True,
                "max_tokens": 4,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "hi"}],
            }
            headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
            async with session.post(
                s.url + "/v1/chat/completions", json=body, headers=headers
            ) as response:
                await response.read()
            await s.records.wait_for(1)
        # Closing the proxy drained the sink's queue and shut the SDK down (final export).
        names = {
            metric.name
            for request in receiver.metrics
            for resource in request.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        }
        assert {
            "gen_ai.client.operation.duration",
            "gen_ai.client.operation.time_to_first_chunk",
            "gen_ai.client.operation.time_per_output_chunk",
            "gen_ai.server.request.duration",
            "gen_ai.server.time_to_first_token",
            "sidecar.good_requests",
        } <= names
        spans = [
            span
            for request in receiver.traces
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
        assert len(spans) == 1
        assert spans[0].trace_id.hex() == "0af7651916cd43dd8448eb211c80319c"
        assert spans[0].parent_span_id.hex() == "b7ad6b7169203331"
    finally:
        await receiver.close()


def test_the_answers_model_and_id_and_the_requested_max_tokens(
    make_traced: Any, spans: InMemorySpanExporter, reader: InMemoryMetricReader
) -> None:
    """gen_ai.response.model (the name vLLM answered with: an alias resolves to the served
    name) on metrics and spans; gen_ai.response.id and gen_ai.request.max_tokens on spans."""
    sink = make_traced()
    sink.on_record(
        spec_example(
            attributes={
                "response_model": "meta-llama/Llama-3.1-8B",
                "response_id": "chatcmpl-abc123",
                "request_max_tokens": "64",
            }
        )
    )
    (span,) = finished(sink, spans)
    attrs = dict(span.attributes or {})
    assert attrs["gen_ai.response.model"] == "meta-llama/Llama-3.1-8B"
    assert attrs["gen_ai.response.id"] == "chatcmpl-abc123"
    assert attrs["gen_ai.request.max_tokens"] == 64
    (point,) = Collected(reader).points["gen_ai.client.operation.duration"]
    assert point.attributes["gen_ai.response.model"] == "meta-llama/Llama-3.1-8B"
    assert point.attributes["gen_ai.request.model"] == "M"


async def test_the_upstream_is_told_the_sidecars_span_as_its_parent() -> None:
    """With --otel-traces the proxy sends the upstream a traceparent naming the sidecar's own
    CLIENT span (its id chosen while the request runs, the span built later from the record),
    so that vLLM's spans (--otlp-traces-endpoint) are its children: with a client traceparent
    in the client's trace, without one in a trace the sidecar starts."""

    import aiohttp
    from reliability_helpers import RawUpstream, proxy_to

    heads: list[bytes] = []

    async def answer(_c: int, _n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        heads.append(head)
        body = b'{"id":"cmpl-1","object":"text_completion","model":"m","choices":[]}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        return False

    receiver = OTLPReceiver()
    url = await receiver.start()
    client_trace = "0af7651916cd43dd8448eb211c80319c"
    try:
        async with (
            RawUpstream(answer) as upstream,
            proxy_to(
                [upstream], otel_endpoint=url, otel_traces="true", engine_scrape_interval="0"
            ) as p,
            aiohttp.ClientSession() as session,
        ):
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            for headers in ({"traceparent": f"00-{client_trace}-b7ad6b7169203331-01"}, {}):
                async with session.post(
                    p.url + "/v1/completions", json=body, headers=headers
                ) as response:
                    await response.read()
            await p.records.wait_for(2)
    finally:
        await receiver.close()
    sent = [
        line.split(b": ", 1)[1].decode()
        for head in heads
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"traceparent:")
    ]
    spans = [
        span
        for request in receiver.traces
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    by_id = {span.span_id.hex(): span for span in spans}
    assert len(sent) == 2 and len(spans) == 2
    for traceparent in sent:
        _version, trace_id, span_id, flags = traceparent.split("-")
        span = by_id[span_id]  # the span the upstream was told is its parent exists
        assert span.trace_id.hex() == trace_id and flags == "01"
    first, second = (by_id[t.split("-")[2]] for t in sent)
    assert first.trace_id.hex() == client_trace
    assert first.parent_span_id.hex() == "b7ad6b7169203331"  # the client's span
    assert second.trace_id.hex() != client_trace and not second.parent_span_id  # a root
