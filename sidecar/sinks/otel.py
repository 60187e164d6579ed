"""OpenTelemetry export: GenAI semantic-convention metrics, goodput counters and optional spans.

One `RequestRecord` in, SDK instruments updated; nothing else happens on the caller's thread.
The SDK's `PeriodicExportingMetricReader` collects and exports on its own thread, and spans go
through a `BatchSpanProcessor` (its own thread too), so `on_record` never does I/O.

Vantage mapping (spec/metrics.md section 1, spec/vllm-protocol.md "OpenTelemetry GenAI"):

- ``gen_ai.client.*`` instruments use the **client** timeline (the proxy's client-facing socket:
  what the client saw, proxy overhead included);
- ``gen_ai.server.*`` instruments use the **server** timeline (the proxy's upstream socket: what
  the replica delivered, proxy overhead excluded).

Every duration is computed by `sidecar.stats` (the project's one definition of TTFT, ITL, TPOT and
E2E), never re-derived here. Latency distributions (TTFT, chunk gaps, TPOT) take successful
requests only, as spec/metrics.md section 3 does; the two duration instruments take every
request, failures included, with ``error.type`` set to the record's outcome (a closed set of five
values, so cardinality stays bounded; the finer ``record.error_type`` goes on spans only).

Only ``chat`` and ``completions`` records are exported; pass-through paths (``/v1/models``, ...)
are counted in `OTelSink.skipped` and dropped: they are not GenAI operations.

Attributes of every ``gen_ai.*`` point: ``gen_ai.operation.name`` (chat | text_completion),
``gen_ai.provider.name``, ``gen_ai.request.model`` (when known; capped, then ``other``),
``server.address`` / ``server.port`` (from the replica label; capped likewise), plus
``error.type`` on failed durations and ``gen_ai.token.type`` on token usage. The ``sidecar.*``
goodput counters carry operation, provider, model, ``sidecar.outcome`` (requests only) and
``sidecar.slo.class``; the thresholds they were judged against are the
``sidecar.slo.threshold`` gauge, exported at every collection.

Cost: the SDK spends roughly 4 µs plus 1 µs per attribute on each measurement (attribute
cleaning and hashing), so a record costs about 80 µs plus 8 µs per client chunk gap (shared
2-core machine); the per-chunk instrument dominates long streams.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, NamedTuple
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import (
    Aggregation,
    ExplicitBucketHistogramAggregation,
    ExponentialBucketHistogramAggregation,
    View,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

import sidecar
from sidecar.hooks import SINK_TIMEOUT_S, SKIPPED, TAKEN
from sidecar.record import RequestRecord, Timeline, Vantage
from sidecar.sinks.labels import OTHER, BoundedLabel
from sidecar.stats import (
    NS_PER_S,
    RequestMetrics,
    SLOPolicy,
    relay_delays_ns,
    request_metrics,
    slo_exclusion,
    slo_verdict,
)

log = logging.getLogger(__name__)

METER_NAME: Final = "sidecar.sinks.otel"
TRACER_NAME: Final = "sidecar.sinks.otel"
DEFAULT_SERVICE_NAME: Final = "vllm-sidecar"

# record.endpoint -> gen_ai.operation.name. Anything else is not a GenAI operation.
OPERATIONS: Final[Mapping[str, str]] = {"chat": "chat", "completions": "text_completion"}

# Attribute keys (GenAI semconv; the `sidecar.*` ones are this project's own namespace).
OPERATION_NAME: Final = "gen_ai.operation.name"
PROVIDER_NAME: Final = "gen_ai.provider.name"
REQUEST_MODEL: Final = "gen_ai.request.model"
RESPONSE_MODEL: Final = "gen_ai.response.model"
TOKEN_TYPE: Final = "gen_ai.token.type"
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
ERROR_TYPE: Final = "error.type"
OUTCOME: Final = "sidecar.outcome"
SLO_CLASS: Final = "sidecar.slo.class"
SLO_EXCLUDED: Final = "sidecar.slo.excluded"  # why a request is out of the denominator
SLO_THRESHOLDS: Final = "sidecar.slo.thresholds"  # e.g. "ttft<=500ms, tpot<=50ms"
SLO_VANTAGE: Final = "sidecar.slo.vantage"
SLO_METRIC: Final = "sidecar.slo.metric"

# Bucket boundaries of the GenAI semantic conventions (spec/vllm-protocol.md).
TOKEN_BUCKETS: Final[tuple[float, ...]] = (
    1,
    4,
    16,
    64,
    256,
    1024,
    4096,
    16384,
    65536,
    262144,
    1048576,
    4194304,
    16777216,
    67108864,
)
DURATION_BUCKETS: Final[tuple[float, ...]] = (
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
SERVER_TTFT_BUCKETS: Final[tuple[float, ...]] = (
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
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
SERVER_TPOT_BUCKETS: Final[tuple[float, ...]] = (
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
    1.0,
    2.5,
)


class InstrumentSpec(NamedTuple):
    """One exported instrument: the single source of its name, unit, description and buckets."""

    name: str
    unit: str
    description: str
    buckets: tuple[float, ...] | None = None  # None: a counter, not a histogram


CLIENT_OPERATION_DURATION = InstrumentSpec(
    "gen_ai.client.operation.duration",
    "s",
    "GenAI operation duration seen by the client (E2E: request fully received by the proxy to "
    "the last token-carrying event, or to the stream's end or error); every request",
    DURATION_BUCKETS,
)
CLIENT_TIME_TO_FIRST_CHUNK = InstrumentSpec(
    "gen_ai.client.operation.time_to_first_chunk",
    "s",
    "Client TTFT: request fully received by the proxy to the first token-carrying chunk handed "
    "to the client; successful streaming requests",
    DURATION_BUCKETS,
)
CLIENT_TIME_PER_OUTPUT_CHUNK = InstrumentSpec(
    "gen_ai.client.operation.time_per_output_chunk",
    "s",
    "Client ITL: one observation per token-carrying chunk after the first, the gap from the "
    "previous one (sample = chunk); successful streaming requests",
    DURATION_BUCKETS,
)
CLIENT_TOKEN_USAGE = InstrumentSpec(
    "gen_ai.client.token.usage",
    "{token}",
    "Input and output tokens per request, from the upstream's usage accounting (exact counts only)",
    TOKEN_BUCKETS,
)
SERVER_REQUEST_DURATION = InstrumentSpec(
    "gen_ai.server.request.duration",
    "s",
    "Server-side E2E: request sent upstream to the last token-carrying event received from it "
    "(or the upstream stream's end or error); every request that reached a replica",
    DURATION_BUCKETS,
)
SERVER_TIME_TO_FIRST_TOKEN = InstrumentSpec(
    "gen_ai.server.time_to_first_token",
    "s",
    "Server-side TTFT: request sent upstream to the first token-carrying event received; "
    "successful requests streamed from the upstream",
    SERVER_TTFT_BUCKETS,
)
SERVER_TIME_PER_OUTPUT_TOKEN = InstrumentSpec(
    "gen_ai.server.time_per_output_token",
    "s",
    "Server-side TPOT = (E2E - TTFT) / (N_out - 1); successful requests with N_out > 1",
    SERVER_TPOT_BUCKETS,
)
SERVER_TIME_PER_OUTPUT_CHUNK = InstrumentSpec(
    "sidecar.server.time_per_output_chunk",
    "s",
    "Server-side ITL: gap between consecutive token-carrying events received from the upstream "
    "(sample = chunk); successful requests. Buckets as the client chunk histogram, to compare",
    DURATION_BUCKETS,
)
REQUESTS = InstrumentSpec(
    "sidecar.requests",
    "{request}",
    "Every chat/completions request, by outcome (and SLO class); without "
    "sidecar.slo.excluded: the goodput denominator",
)
GOOD_REQUESTS = InstrumentSpec(
    "sidecar.good_requests",
    "{request}",
    "Requests that succeeded and met every declared threshold of their SLO class",
)
GOOD_OUTPUT_TOKENS = InstrumentSpec(
    "sidecar.good_output_tokens",
    "{token}",
    "Output tokens of good requests (goodput in tokens)",
)
SLO_THRESHOLD = InstrumentSpec(
    "sidecar.slo.threshold",
    "s",
    "Declared SLO thresholds, one point per class and metric (ttft, tpot, e2e)",
)

HISTOGRAMS: Final[tuple[InstrumentSpec, ...]] = (
    CLIENT_OPERATION_DURATION,
    CLIENT_TIME_TO_FIRST_CHUNK,
    CLIENT_TIME_PER_OUTPUT_CHUNK,
    CLIENT_TOKEN_USAGE,
    SERVER_REQUEST_DURATION,
    SERVER_TIME_TO_FIRST_TOKEN,
    SERVER_TIME_PER_OUTPUT_TOKEN,
    SERVER_TIME_PER_OUTPUT_CHUNK,
)

Attrs = dict[str, AttributeValue]


def parse_replica(label: str) -> tuple[str, int | None]:
    """``host:port`` (a replica label: the upstream URL without its scheme) -> (address, port).

    IPv6 brackets are removed (``[::1]:8000`` -> ``::1``); a path after the authority is
    ignored; a missing or unparsable port gives None.
    """
    parts = urlsplit("//" + label)
    address = parts.hostname or label
    try:
        port = parts.port
    except ValueError:
        port = None
    return address, port


def _histogram_views(exponential: bool) -> list[View]:
    """One View per histogram: the convention's boundaries, or a base-2 exponential histogram.

    Views are scoped to this module's meter so they can never reshape someone else's instruments.
    """
    views = []
    for spec in HISTOGRAMS:
        aggregation: Aggregation
        if exponential:
            aggregation = ExponentialBucketHistogramAggregation()
        else:
            assert spec.buckets is not None
            aggregation = ExplicitBucketHistogramAggregation(boundaries=spec.buckets)
        views.append(
            View(instrument_name=spec.name, meter_name=METER_NAME, aggregation=aggregation)
        )
    return views


def _end_offset_ns(record: RequestRecord) -> int:
    """The last instant known of the request, in ns since t_arrive (0 if none was stamped)."""
    if record.client.end_ns is not None:
        return record.client.end_ns
    candidates = [record.client.offsets_ns[-1]] if record.client.offsets_ns else []
    if record.server is not None:
        if record.server.end_ns is not None:
            candidates.append(record.server.end_ns)
        if record.server.offsets_ns:
            candidates.append(record.server.offsets_ns[-1])
    return max(candidates, default=0)


def _failed_duration_s(timeline: Timeline, metrics: RequestMetrics) -> float | None:
    """A failed request's duration: to the error / stream end when stamped (the last token of
    a stream cut short is not when the operation ended), else the stats E2E."""
    if timeline.end_ns is not None:
        return (timeline.end_ns - timeline.start_ns) / NS_PER_S
    return metrics.e2e_s


class _AttrSets(NamedTuple):
    """The attribute dicts one (operation, model, replica) combination needs, built once."""

    common: Attrs
    input_tokens: Attrs
    output_tokens: Attrs


class OTelSink:
    """A `hooks.Sink` that records each finished request into OpenTelemetry instruments.

    Build it with `build_otel_sink`. It owns its MeterProvider (and TracerProvider when spans
    are on): never the global ones, so it neither steals nor is stolen from by other
    instrumentation in the process. Not thread-safe: call `on_record` from one thread (the
    event loop), as `SinkFanout` does.
    """

    name = "otel"

    def __init__(
        self,
        meter_provider: MeterProvider,
        *,
        provider_name: str = "vllm",
        slo_policy: SLOPolicy | None = None,
        slo_vantage: Vantage = Vantage.CLIENT,
        tracer_provider: TracerProvider | None = None,
        max_models: int = 32,
        max_replicas: int = 64,
        max_span_events: int | None = 128,
        server_chunks: bool = False,
    ) -> None:
        if slo_vantage not in (Vantage.CLIENT, Vantage.SERVER):
            raise ValueError("goodput is judged from the client or the server vantage")
        self.meter_provider = meter_provider
        self.tracer_provider = tracer_provider
        self.provider_name = provider_name
        self.slo_policy = slo_policy
        self.slo_vantage = slo_vantage
        self.models = BoundedLabel(max_models)
        self.replicas = BoundedLabel(max_replicas)
        self.taken = 0  # records measured
        self.skipped = 0  # records not exported: pass-through paths, or after shutdown
        self._closed = False
        self._attr_sets: dict[tuple[str, str | None, str | None, str | None], _AttrSets] = {}
        self._replica_parts: dict[str, tuple[str, int | None]] = {}
        self._slo_attrs: dict[tuple[str, str | None, str, str, str], Attrs] = {}
        self._create_instruments(meter_provider, slo_policy, server_chunks)
        self._set_up_tracing(tracer_provider, max_span_events)

    def _create_instruments(
        self, meter_provider: MeterProvider, slo_policy: SLOPolicy | None, server_chunks: bool
    ) -> None:
        """The histograms and counters, and the SLO thresholds' gauge when SLOs are declared."""
        meter = meter_provider.get_meter(METER_NAME, sidecar.__version__)

        def histogram(spec: InstrumentSpec) -> Histogram:
            return meter.create_histogram(spec.name, unit=spec.unit, description=spec.description)

        def counter(spec: InstrumentSpec) -> Counter:
            return meter.create_counter(spec.name, unit=spec.unit, description=spec.description)

        self._client_duration = histogram(CLIENT_OPERATION_DURATION)
        self._client_ttfc = histogram(CLIENT_TIME_TO_FIRST_CHUNK)
        self._client_tpoc = histogram(CLIENT_TIME_PER_OUTPUT_CHUNK)
        self._token_usage = histogram(CLIENT_TOKEN_USAGE)
        self._server_duration = histogram(SERVER_REQUEST_DURATION)
        self._server_ttft = histogram(SERVER_TIME_TO_FIRST_TOKEN)
        self._server_tpot = histogram(SERVER_TIME_PER_OUTPUT_TOKEN)
        # Off by default: not a convention instrument, and it doubles the per-chunk cost
        # (each SDK measurement costs several µs; chunk gaps dominate the cost of a record).
        self._server_tpoc = histogram(SERVER_TIME_PER_OUTPUT_CHUNK) if server_chunks else None
        self._requests = counter(REQUESTS)
        self._good_requests = counter(GOOD_REQUESTS) if slo_policy is not None else None
        self._good_tokens = counter(GOOD_OUTPUT_TOKENS) if slo_policy is not None else None
        self._slo_descriptions: dict[str, str] = {}
        if slo_policy is not None:
            self._slo_descriptions = {
                name: slo.describe() for name, slo in slo_policy.classes.items()
            }
            # A gauge read at each collection: every export carries the thresholds that the
            # goodput counters beside it were judged against.
            meter.create_observable_gauge(
                SLO_THRESHOLD.name,
                callbacks=[self._observe_thresholds],
                unit=SLO_THRESHOLD.unit,
                description=SLO_THRESHOLD.description,
            )

    def _set_up_tracing(
        self, tracer_provider: TracerProvider | None, max_span_events: int | None
    ) -> None:
        """The tracer (None: no spans), the traceparent reader and the span ids preset."""
        self._tracer = None
        if tracer_provider is not None:
            self._tracer = tracer_provider.get_tracer(TRACER_NAME, sidecar.__version__)
        self._propagator = TraceContextTextMapPropagator()
        # The SDK keeps only the *last* max_events events of a span: adding more is wasted
        # work and would drop the first chunks, the most telling ones. None: no limit.
        self._max_span_events = max_span_events
        generator = getattr(tracer_provider, "id_generator", None)
        self._preset_ids = generator if isinstance(generator, PresetIdGenerator) else None

    # -- the hot path ---------------------------------------------------------------------

    def on_record(self, record: RequestRecord) -> None:
        operation = OPERATIONS.get(record.endpoint)
        if operation is None or self._closed:
            # Not a GenAI operation (or the providers are gone: the SDK would warn per call).
            self.skipped += 1
            return
        self.taken += 1
        # As for Prometheus: only a name the upstream confirmed takes a slot.
        model = None if record.model is None else self.models(record.model, record.model_confirmed)
        replica = None if record.replica is None else self.replicas(record.replica)
        # The model that answered (vLLM: the served name, an alias resolved): a name only the
        # upstream wrote, under the same cap as the requested one.
        answered = record.attributes.get("response_model")
        response_model = None if answered is None else self.models(answered)
        attrs = self._attr_sets.get((operation, model, response_model, replica))
        if attrs is None:
            attrs = self._build_attr_sets(operation, model, response_model, replica)
        common = attrs.common
        ok = record.ok
        failed = common if ok else {**common, ERROR_TYPE: semconv_error_type(record)}

        # Client vantage. request_metrics never returns None for the client (it always exists).
        client = request_metrics(record, Vantage.CLIENT)
        assert client is not None
        duration = client.e2e_s if ok else _failed_duration_s(record.client, client)
        if duration is not None and duration >= 0:
            self._client_duration.record(duration, failed)
        if ok and record.client_stream:
            if client.ttft_s is not None:
                self._client_ttfc.record(client.ttft_s, common)
            record_gap = self._client_tpoc.record
            for gap in client.itl_s:
                record_gap(gap, common)
        if record.n_in is not None:
            self._token_usage.record(record.n_in, attrs.input_tokens)
        if record.n_out is not None and record.token_source.total_exact:
            self._token_usage.record(record.n_out, attrs.output_tokens)

        # Server vantage: only when the request reached a replica.
        server = None
        if record.server is not None:
            server = request_metrics(record, Vantage.SERVER)
            assert server is not None
            duration = server.e2e_s if ok else _failed_duration_s(record.server, server)
            if duration is not None and duration >= 0:
                self._server_duration.record(duration, failed)
            if ok:
                if server.ttft_s is not None:
                    self._server_ttft.record(server.ttft_s, common)
                if server.tpot_s is not None:
                    self._server_tpot.record(server.tpot_s, common)
                if self._server_tpoc is not None:
                    record_gap = self._server_tpoc.record
                    for gap in server.itl_s:
                        record_gap(gap, common)

        slo_class, good = self._goodput(record, operation, model, client, server)

        if self._tracer is not None:
            self._emit_span(record, operation, client, server, slo_class, good)

    def _goodput(
        self,
        record: RequestRecord,
        operation: str,
        model: str | None,
        client: RequestMetrics,
        server: RequestMetrics | None,
    ) -> tuple[str | None, bool | None]:
        """Count the request in the denominator; count it (and its tokens) as good if it is.

        Judged exactly as `SLOPolicy.judge` does, reusing the metrics already computed above
        rather than computing them a second time.
        """
        policy = self.slo_policy
        outcome = record.outcome.value
        if policy is None:
            self._requests.add(1, self._counter_attrs(operation, model, outcome, ""))
            return None, None
        slo_class = policy.class_of(record)
        excluded = slo_exclusion(record)
        if excluded is not None and excluded in policy.classes[slo_class].exclude:
            # Not the service's failure: out of the class's denominator (`SLO.exclude`),
            # counted with the reason as its outcome so that it is not lost.
            self._requests.add(
                1, self._counter_attrs(operation, model, outcome, slo_class, excluded)
            )
            return slo_class, False
        metrics = client if self.slo_vantage is Vantage.CLIENT else server
        good = False
        if record.ok and metrics is not None:
            good, _unjudged = slo_verdict(metrics, policy.classes[slo_class])
        self._requests.add(1, self._counter_attrs(operation, model, outcome, slo_class))
        if good:
            assert self._good_requests is not None and self._good_tokens is not None
            attrs = self._counter_attrs(operation, model, "", slo_class)
            self._good_requests.add(1, attrs)
            self._good_tokens.add(metrics.n_out if metrics is not None else 0, attrs)
        return slo_class, good

    # -- attribute sets (built once per combination, then reused) ------------------------

    def _build_attr_sets(
        self, operation: str, model: str | None, response_model: str | None, replica: str | None
    ) -> _AttrSets:
        common: Attrs = {OPERATION_NAME: operation, PROVIDER_NAME: self.provider_name}
        if model is not None:
            common[REQUEST_MODEL] = model
        if response_model is not None:
            common[RESPONSE_MODEL] = response_model
        if replica is not None:
            address, port = self._replica_address(replica)
            common[SERVER_ADDRESS] = address
            if port is not None:
                common[SERVER_PORT] = port
        sets = _AttrSets(
            common=common,
            input_tokens={**common, TOKEN_TYPE: "input"},
            output_tokens={**common, TOKEN_TYPE: "output"},
        )
        self._attr_sets[(operation, model, response_model, replica)] = sets
        return sets

    def _replica_address(self, replica: str) -> tuple[str, int | None]:
        parts = self._replica_parts.get(replica)
        if parts is None:
            parts = (OTHER, None) if replica == OTHER else parse_replica(replica)
            self._replica_parts[replica] = parts
        return parts

    def _counter_attrs(
        self, operation: str, model: str | None, outcome: str, slo_class: str, excluded: str = ""
    ) -> Attrs:
        """Attributes of the sidecar.* counters: outcome "" = none, slo_class "" = no policy,
        excluded "" = counted in the class's denominator, else why not (`SLO.exclude`).

        Deliberately few (each attribute costs about 1 µs per measurement in the SDK): no
        server address (per-replica failures are on the duration histograms' error.type), and
        the thresholds live on the `sidecar.slo.threshold` gauge, joined on the class.
        """
        key = (operation, model, outcome, slo_class, excluded)
        attrs = self._slo_attrs.get(key)
        if attrs is None:
            attrs = {OPERATION_NAME: operation, PROVIDER_NAME: self.provider_name}
            if model is not None:
                attrs[REQUEST_MODEL] = model
            if outcome:
                attrs[OUTCOME] = outcome
            if slo_class:
                attrs[SLO_CLASS] = slo_class
            if excluded:
                attrs[SLO_EXCLUDED] = excluded
            self._slo_attrs[key] = attrs
        return attrs

    def _observe_thresholds(self, options: CallbackOptions) -> Iterable[Observation]:
        # Runs on the exporting thread; reads only the immutable policy.
        assert self.slo_policy is not None
        for name, slo in self.slo_policy.classes.items():
            for metric, value in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s), ("e2e", slo.e2e_s)):
                if value is not None:
                    yield Observation(
                        value,
                        {
                            SLO_CLASS: name,
                            SLO_METRIC: metric,
                            SLO_VANTAGE: self.slo_vantage.value,
                            SLO_THRESHOLDS: self._slo_descriptions[name],
                        },
                    )

    # -- spans ------------------------------------------------------------------------------

    def _emit_span(
        self,
        record: RequestRecord,
        operation: str,
        client: RequestMetrics,
        server: RequestMetrics | None,
        slo_class: str | None,
        good: bool | None,
    ) -> None:
        """One CLIENT span per request, built after the fact with the record's own instants."""
        span = self._start_span(record, operation)
        start = record.wall_time_ns
        if not span.is_recording():
            # Not sampled and not recorded: skip building attributes and events altogether.
            span.end(end_time=start)
            return
        span.set_attributes(_span_attributes(record, client, server, slo_class, good))
        if not record.ok:
            span.set_status(Status(StatusCode.ERROR, record.error_type or record.outcome.value))
        if span.get_span_context().trace_flags.sampled:
            # Chunk events cost a few µs each; a recorded-but-unsampled span is never exported,
            # so only a sampled one gets them.
            self._add_chunk_events(span, record)
        span.end(end_time=start + _end_offset_ns(record))

    def _span_parent(self, record: RequestRecord) -> Context:
        """The request's parent: the trace context it came with, else none at all."""
        traceparent = record.attributes.get("traceparent")
        if not traceparent:
            # An explicit empty context: whatever span happens to be current on this thread
            # (an instrumented aiohttp handler, say) is not this request's parent.
            return Context()
        carrier = {"traceparent": traceparent}
        tracestate = record.attributes.get("tracestate")
        if tracestate:
            carrier["tracestate"] = tracestate
        return self._propagator.extract(carrier, context=Context())

    def _start_span(self, record: RequestRecord, operation: str) -> Span:
        """The span, started at the request's arrival under its parent, with the attributes a
        sampler may read, and the ids the proxy sent upstream when it sent any."""
        assert self._tracer is not None
        parent = self._span_parent(record)
        # Span attributes are not metric labels: the raw model and replica, never `other`
        # (the SDK's span limits bound their length).
        start_attrs: Attrs = {OPERATION_NAME: operation, PROVIDER_NAME: self.provider_name}
        if record.model is not None:
            start_attrs[REQUEST_MODEL] = record.model
        if record.replica is not None:
            address, port = parse_replica(record.replica)
            start_attrs[SERVER_ADDRESS] = address
            if port is not None:
                start_attrs[SERVER_PORT] = port
        name = f"{operation} {record.model}" if record.model else operation
        ids = self._preset_ids
        preset = record.attributes.get("span_ids") if ids is not None else None
        if ids is not None and preset is not None:
            # The ids the proxy already sent upstream in its traceparent (relay.py): the span
            # the upstream named as its parent must be this one.
            trace_hex, _, span_hex = preset.partition("-")
            ids.preset(int(trace_hex, 16), int(span_hex, 16))
        try:
            return self._tracer.start_span(
                name,
                context=parent,
                kind=SpanKind.CLIENT,
                start_time=record.wall_time_ns,
                attributes=start_attrs,
            )
        finally:
            if ids is not None:
                ids.clear()

    def _add_chunk_events(self, span: Span, record: RequestRecord) -> None:
        """One event per chunk, up to the span's event limit: the client's chunks when it
        streamed, else the upstream's (a non-streaming client whose answer the proxy
        assembled)."""
        timeline, vantage = record.client, Vantage.CLIENT.value
        if not timeline.offsets_ns and record.server is not None:
            timeline, vantage = record.server, Vantage.SERVER.value
        offsets, tokens = timeline.offsets_ns, timeline.tokens
        start = record.wall_time_ns
        limit = len(offsets)
        if self._max_span_events is not None:
            limit = min(limit, self._max_span_events)
        for index, offset, n_tokens in zip(range(limit), offsets, tokens, strict=False):
            span.add_event(
                "sidecar.chunk",
                {
                    "sidecar.chunk.index": index,
                    "sidecar.chunk.tokens": n_tokens,
                    "sidecar.vantage": vantage,
                },
                timestamp=start + offset,
            )
        if limit < len(offsets):
            span.set_attribute("sidecar.chunk_events.dropped", len(offsets) - limit)

    # -- lifecycle (hooks.Sink) ----------------------------------------------------------------

    def flush(self, timeout_s: float = SINK_TIMEOUT_S) -> bool:
        """`force_flush` in the sinks' units (seconds)."""
        return self.force_flush(_millis(timeout_s))

    def close(self, timeout_s: float = SINK_TIMEOUT_S) -> None:
        """`shutdown` in the sinks' units (seconds)."""
        self.shutdown(_millis(timeout_s))

    def counters(self) -> dict[str, int]:
        return {TAKEN: self.taken, SKIPPED: self.skipped}

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        """Collect and export now. Blocking I/O: call it off the event loop
        (``await asyncio.to_thread(sink.force_flush)``)."""
        ok = self.meter_provider.force_flush(timeout_millis)
        if self.tracer_provider is not None:
            ok = self.tracer_provider.force_flush(timeout_millis) and ok
        return ok

    def shutdown(self, timeout_millis: int = 10_000) -> None:
        """Export what is pending, stop the exporting threads. Idempotent. Blocking I/O."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.tracer_provider is not None:
                self.tracer_provider.shutdown()
        finally:
            self.meter_provider.shutdown(timeout_millis)

    async def aclose(self) -> None:
        """`shutdown` from async code: the final export runs in a worker thread, so an OTLP
        receiver served by this same event loop (a test, an in-process collector) can answer."""
        await asyncio.to_thread(self.shutdown)


def _millis(timeout_s: float) -> int:
    # The SDK takes whole milliseconds; a timeout that ran out still gets one to try.
    return max(1, int(timeout_s * 1000))


class PresetIdGenerator(RandomIdGenerator):
    """Random ids, except the next trace and span id when `preset` gave them: spans are
    built after the request, with the ids the proxy chose while it ran. Used from the one
    thread that records spans (the sink's), between `preset` and `clear`."""

    def __init__(self) -> None:
        self._trace_id: int | None = None
        self._span_id: int | None = None

    def preset(self, trace_id: int, span_id: int) -> None:
        self._trace_id, self._span_id = trace_id, span_id

    def clear(self) -> None:
        self._trace_id = self._span_id = None

    def generate_trace_id(self) -> int:
        # Asked only for a span without a parent: the proxy chose the trace id too.
        trace_id, self._trace_id = self._trace_id, None
        return trace_id if trace_id else super().generate_trace_id()

    def generate_span_id(self) -> int:
        span_id, self._span_id = self._span_id, None
        return span_id if span_id else super().generate_span_id()


def semconv_error_type(record: RequestRecord) -> str:
    """``error.type`` as the semantic conventions define it: the HTTP status code the request
    ended with when it is an error, else the failure's own type (the record's cause, without
    its detail: ``ttft_timeout``, ``stream_cut_without_done``, ``client_disconnected``), never
    the outcome's name. Both sets are small: fit for metric attributes."""
    status = record.http_status
    if status is not None and status >= 400:
        return str(status)
    if record.error_type:
        return record.error_type.split(":", 1)[0]
    return "_OTHER"


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def _span_attributes(
    record: RequestRecord,
    client: RequestMetrics,
    server: RequestMetrics | None,
    slo_class: str | None,
    good: bool | None,
) -> Attrs:
    """GenAI span attributes plus the sidecar's own timings, durations in seconds."""
    out: dict[str, AttributeValue | None] = {
        "gen_ai.request.stream": record.client_stream,
        "gen_ai.usage.input_tokens": record.n_in,
        "gen_ai.usage.output_tokens": record.n_out if record.token_source.total_exact else None,
        "gen_ai.usage.cache_read.input_tokens": record.n_cached,
        "gen_ai.response.finish_reasons": (
            (record.finish_reason,) if record.finish_reason is not None else None
        ),
        "http.response.status_code": record.http_status,
        "gen_ai.response.model": record.attributes.get("response_model"),
        "gen_ai.response.id": record.attributes.get("response_id"),
        "gen_ai.request.max_tokens": _int_or_none(record.attributes.get("request_max_tokens")),
        "sidecar.request_id": record.request_id,
        "sidecar.outcome": record.outcome.value,
        "sidecar.upstream_stream": record.upstream_stream,
        "sidecar.token_source": record.token_source.value,
        "sidecar.route_policy": record.route_policy,
        "sidecar.client.e2e": client.e2e_s,
        # From the first byte to the whole request read: the upload, inside client TTFT/e2e.
        "sidecar.client.request_read": (
            None if record.request_read_ns is None else record.request_read_ns / NS_PER_S
        ),
        "sidecar.client.time_per_output_token": client.tpot_s,
        "sidecar.client.chunks": record.client.n_marks,
        "sidecar.slo.class": slo_class,
        "sidecar.slo.good": good,
    }
    if record.client_stream:
        out["gen_ai.response.time_to_first_chunk"] = client.ttft_s
    if not record.ok:
        out[ERROR_TYPE] = semconv_error_type(record)
        out["sidecar.error_type"] = record.error_type
    if record.server is not None and server is not None:
        out["sidecar.server.request_sent"] = record.server.start_ns / NS_PER_S
        out["sidecar.server.time_to_first_token"] = server.ttft_s
        out["sidecar.server.e2e"] = server.e2e_s
        out["sidecar.server.time_per_output_token"] = server.tpot_s
        out["sidecar.server.chunks"] = record.server.n_marks
    delays = relay_delays_ns(record)
    if delays is not None:
        # The sidecar's own time per token event (docs/metrics.md, "The sidecar's own delay").
        out["sidecar.relay.delay_max"] = max(delays) / NS_PER_S
        out["sidecar.relay.delay_mean"] = sum(delays) / len(delays) / NS_PER_S
    engine = record.engine
    if engine is not None:
        out["sidecar.engine.queue_time"] = _seconds(engine.queue_time_ms)
        # Same intervals as the server's attributes of these names (record.EngineTiming).
        out["sidecar.engine.time_to_first_token"] = _seconds(engine.ttft_ms)
        out["sidecar.engine.e2e"] = _seconds(engine.e2e_ms)
        out["sidecar.engine.time_to_first_token_from_scheduled"] = _seconds(
            engine.time_to_first_token_ms
        )
        out["sidecar.engine.generation_time"] = _seconds(engine.generation_time_ms)
        out["sidecar.engine.mean_itl"] = _seconds(engine.mean_itl_ms)
    # None means unknown: leave the attribute out rather than export a made-up value.
    return {key: value for key, value in out.items() if value is not None}


def _signal_endpoint(base: str, signal: str) -> str:
    """Base URL (like OTEL_EXPORTER_OTLP_ENDPOINT) -> the signal's URL, as the SDK builds it."""
    return f"{base.removesuffix('/')}/v1/{signal}"


def build_resource(service_name: str = DEFAULT_SERVICE_NAME) -> Resource:
    """The SDK's resource (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME honoured), with
    ``service.name`` defaulting to ``service_name`` instead of ``unknown_service``."""
    resource = Resource.create({})
    defaults: dict[str, AttributeValue] = {}
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        defaults["service.name"] = service_name
    if "service.version" not in resource.attributes:
        defaults["service.version"] = sidecar.__version__
    # merge(): the argument's values win, so only attributes the environment left unset
    # are added.
    return resource.merge(Resource(defaults)) if defaults else resource


def _metric_readers(
    endpoint: str | None,
    readers: Sequence[MetricReader] | None,
    export_interval_s: float | None,
    export_timeout_s: float | None,
) -> list[MetricReader]:
    """The given readers, and a periodic OTLP/HTTP exporter unless readers alone were asked
    for (`build_otel_sink`)."""
    all_readers: list[MetricReader] = list(readers or ())
    if endpoint is not None or readers is None:
        exporter = OTLPMetricExporter(
            endpoint=None if endpoint is None else _signal_endpoint(endpoint, "metrics")
        )
        all_readers.append(
            PeriodicExportingMetricReader(
                exporter,
                export_interval_millis=None
                if export_interval_s is None
                else export_interval_s * 1e3,
                export_timeout_millis=None if export_timeout_s is None else export_timeout_s * 1e3,
            )
        )
    return all_readers


def _tracer_provider(
    endpoint: str | None,
    span_exporter: SpanExporter | None,
    sampler: Sampler | None,
    resource: Resource,
    meter_provider: MeterProvider,
) -> tuple[TracerProvider, int | None]:
    """The TracerProvider of `build_otel_sink` (``traces``), and its limit on events per
    span."""
    if span_exporter is None:
        span_exporter = OTLPSpanExporter(
            endpoint=None if endpoint is None else _signal_endpoint(endpoint, "traces")
        )
    span_limits = SpanLimits()  # OTEL_SPAN_EVENT_COUNT_LIMIT etc. honoured
    tracer_provider = TracerProvider(
        sampler=sampler,
        resource=resource,
        span_limits=span_limits,
        meter_provider=meter_provider,
        id_generator=PresetIdGenerator(),
    )
    # Batching: the exporter's HTTP request runs on the processor's thread, never on the
    # event loop that ends the span.
    tracer_provider.add_span_processor(
        BatchSpanProcessor(span_exporter, meter_provider=meter_provider)
    )
    return tracer_provider, span_limits.max_events


def build_otel_sink(
    *,
    endpoint: str | None = None,
    slo_policy: SLOPolicy | None = None,
    slo_vantage: Vantage = Vantage.CLIENT,
    provider_name: str = "vllm",
    exponential_histograms: bool = False,
    export_interval_s: float | None = 10.0,
    export_timeout_s: float | None = None,
    traces: bool = False,
    readers: Sequence[MetricReader] | None = None,
    span_exporter: SpanExporter | None = None,
    sampler: Sampler | None = None,
    resource: Resource | None = None,
    max_models: int = 32,
    max_replicas: int = 64,
    server_chunks: bool = False,
) -> OTelSink:
    """An `OTelSink` with its own MeterProvider (and TracerProvider if ``traces``).

    ``endpoint``: OTLP/HTTP **base** URL (``http://collector:4318``); ``/v1/metrics`` and
    ``/v1/traces`` are appended. None: the exporter's own resolution, i.e.
    OTEL_EXPORTER_OTLP_METRICS_ENDPOINT (used as-is), else OTEL_EXPORTER_OTLP_ENDPOINT plus the
    signal path, else ``http://localhost:4318``. Headers, timeouts, compression and temporality
    come from the usual OTEL_EXPORTER_OTLP_* variables.

    ``readers``: extra metric readers (tests inject an InMemoryMetricReader). When readers are
    given and ``endpoint`` is None, no OTLP metric exporter is created at all.

    ``export_interval_s``: None honours OTEL_METRIC_EXPORT_INTERVAL (SDK default 60 s).

    ``server_chunks``: also export ``sidecar.server.time_per_output_chunk`` (the upstream
    side's chunk gaps); off by default because it doubles the per-chunk cost.

    ``span_exporter``: where spans go when ``traces`` (default: OTLP/HTTP, resolved like the
    metrics endpoint). ``sampler``: default ParentBased(always on), or OTEL_TRACES_SAMPLER.
    """
    if resource is None:
        resource = build_resource()
    meter_provider = MeterProvider(
        metric_readers=_metric_readers(endpoint, readers, export_interval_s, export_timeout_s),
        resource=resource,
        # Exemplars would come from the current span on the recording thread, which is never
        # the request's span here (spans are built after the fact): pure cost, no value.
        exemplar_filter=AlwaysOffExemplarFilter(),
        views=_histogram_views(exponential_histograms),
    )
    tracer_provider = None
    max_span_events: int | None = None
    if traces:
        tracer_provider, max_span_events = _tracer_provider(
            endpoint, span_exporter, sampler, resource, meter_provider
        )
    return OTelSink(
        meter_provider,
        provider_name=provider_name,
        slo_policy=slo_policy,
        slo_vantage=slo_vantage,
        tracer_provider=tracer_provider,
        max_models=max_models,
        max_replicas=max_replicas,
        max_span_events=max_span_events,
        server_chunks=server_chunks,
    )


__all__ = [
    "DURATION_BUCKETS",
    "HISTOGRAMS",
    "OPERATIONS",
    "OTHER",
    "SERVER_TPOT_BUCKETS",
    "SERVER_TTFT_BUCKETS",
    "TOKEN_BUCKETS",
    "InstrumentSpec",
    "OTelSink",
    "build_otel_sink",
    "build_resource",
    "parse_replica",
]
