"""Prometheus export: mergeable histograms per vantage, goodput counters, exact window gauges.

Why these buckets. Percentiles across many sidecars must come from mergeable data
(spec/metrics.md section 3): `histogram_quantile(q, sum by (le) (rate(..._bucket[5m])))`. It
finds the bucket holding rank q * n and interpolates linearly inside it. Once the samples
around that rank share a bucket (enough of them), its answer and the exact percentile lie in
that bucket, so they differ by less than the ratio of the bucket's bounds minus 1, and can
come close to that: a tight distribution, or the few samples of a tail, sits at one end of its
bucket while the interpolation spreads them evenly. The default layout, ``schema3``, is the
bounds of a Prometheus native histogram of schema 3: 2**(i/8), eight per doubling (1.09x
apart; rounded to 4 significant digits for readable ``le`` labels) from 94 µs, below any
inter-token gap a GPU produces, to 1024 s, beyond any sane request: 188 bounds, off by less
than 9.2 % whatever the distribution. ``schema4`` (16 per doubling, 374 bounds, 4.5 %) and
``e6`` (the earlier E6 series 1, 1.5, 2.2, 3.3, 4.7, 6.8 per decade, 43 bounds, 50 %) trade
series for accuracy (`--histogram-buckets`; benchmarks/histogram_accuracy.py measures them on
LLM-serving workloads). A histogram costs its bounds + 3 series (+Inf, _sum, _count) per label
set. vLLM's own ITL buckets start at 10 ms, where a fast decode step already is; ours resolve a
sub-millisecond proxy overhead and a 5 ms ITL alike. Every declared SLO threshold is added as a
bucket boundary too, so `le="<threshold>"` counts exactly the requests under it. One set serves
every latency metric, so panels can put client, server and engine side by side.

Exact figures for one sidecar come from the window gauges (numpy over the live window, computed
at scrape time, off the request path). Labels are bounded: model and replica values past
``label_cap`` distinct ones become "other"; endpoint is chat|completions|other; outcome, vantage
and SLO class come from closed sets.
"""

from __future__ import annotations

import math
import struct
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import metrics as _client_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString as _untyped_float_to_go_string

from sidecar import stats
from sidecar.hooks import (
    DROPPED,
    SINK_TIMEOUT_S,
    TAKEN,
    WRITTEN,
    SinkFanout,
    dropped_by_reason,
)
from sidecar.record import (
    OUTCOME_OK,
    SOURCE_USAGE,
    VANTAGE_CLIENT,
    VANTAGE_ENGINE,
    VANTAGE_SERVER,
    RequestRecord,
)
from sidecar.sinks.labels import OTHER, BoundedLabel
from sidecar.sinks.window import GENERATION_ENDPOINTS, WindowSink
from sidecar.stats import NS_PER_S

# prometheus-client leaves it untyped: the `le` label text of a bucket bound.
_go_float: Callable[[float], str] = _untyped_float_to_go_string

UNKNOWN = "unknown"  # the label of a model or replica the record does not name
E6 = (1.0, 1.5, 2.2, 3.3, 4.7, 6.8)


def e6_buckets(low_exponent: int = -4, high_exponent: int = 3) -> tuple[float, ...]:
    """E6 series from 10**low to 10**high inclusive: 100 µs .. 1000 s by default."""
    values = [round(m * 10.0**e, 10) for e in range(low_exponent, high_exponent) for m in E6]
    values.append(float(10**high_exponent))
    return tuple(values)


def log_linear_buckets(
    schema: int, low: float = 1e-4, high: float = 1e3, digits: int = 4
) -> tuple[float, ...]:
    """The bounds 2**(i / 2**schema) of a native histogram of this schema, from the largest at
    or below ``low`` to the smallest at or above ``high``, rounded to ``digits`` significant
    digits (readable ``le`` labels; the ratios stay within 0.1 % of 2**(2**-schema))."""
    step = 2.0**-schema
    first = math.floor(math.log2(low) / step)
    last = math.ceil(math.log2(high) / step)
    return tuple(float(f"{2.0 ** (i * step):.{digits}g}") for i in range(first, last + 1))


# --histogram-buckets: the latency layouts by name (see the module's docstring).
LATENCY_LAYOUTS: dict[str, Callable[[], tuple[float, ...]]] = {
    "schema3": lambda: log_linear_buckets(3),
    "schema4": lambda: log_linear_buckets(4),
    "e6": e6_buckets,
}
DEFAULT_LATENCY_LAYOUT = "schema3"


def checked_buckets(buckets: Sequence[float]) -> tuple[float, ...]:
    """``buckets`` as given, or ValueError naming what is wrong: each bound must be finite and
    above the one before it. Never sorted here: bounds out of order are a mistake upstream (a
    layout, a threshold merged by hand), and sorting would hide it (prometheus_client's own
    Histogram refuses them too)."""
    bounds = tuple(float(b) for b in buckets)
    if not bounds:
        raise ValueError("a histogram needs at least one bucket bound")
    bad = [b for b in bounds if not math.isfinite(b)]
    if bad:
        raise ValueError(f"histogram bucket bounds must be finite (+Inf is implied): {bad}")
    unsorted = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b <= a]
    if unsorted:
        pairs = ", ".join(f"{b:g} after {a:g}" for a, b in unsorted[:5])
        more = f" (and {len(unsorted) - 5} more)" if len(unsorted) > 5 else ""
        raise ValueError(f"histogram bucket bounds must be strictly increasing: {pairs}{more}")
    return bounds


def latency_buckets(
    extra: Iterable[float] = (), layout: str = DEFAULT_LATENCY_LAYOUT
) -> tuple[float, ...]:
    """The layout's bounds plus the ``extra`` ones (SLO thresholds)."""
    try:
        bounds = checked_buckets(LATENCY_LAYOUTS[layout]())
    except KeyError:
        raise ValueError(
            f"histogram buckets must be one of {', '.join(LATENCY_LAYOUTS)}: {layout!r}"
        ) from None
    # A layout is in order (checked); the thresholds are inserted where they belong, and one
    # that is already a bound is not repeated.
    return tuple(sorted(set(bounds) | {round(x, 10) for x in extra if x > 0}))


# The sidecar's own delay per event: the latency layout's resolution (schema 3, 9 % apart), from
# 1 µs, since a relay passes an event on in tens of microseconds, to 10 s (a stalled one).
RELAY_DELAY_BUCKETS = log_linear_buckets(3, low=1e-6, high=10.0)

# Token counts: 1-2-5 per decade up to 1M tokens (vLLM's TOK_B shape, extended).
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(0, 6) for m in (1, 2, 5)) + (1e6,)


class BulkHistogram(Collector):
    """A labelled Prometheus histogram that takes many observations at once.

    prometheus_client's Histogram costs about a microsecond per `observe` (a lock, a scan of
    ~190 bounds), and a streamed request brings one ITL observation per event. Here each label
    set's bucket counts are a plain list; `observe_many` bins a whole batch (many requests'
    values under many label sets) in one numpy pass, which is how `PrometheusSink` feeds it,
    from the columns of the records it holds until the next scrape. It is exposed like any
    histogram (`_bucket{le}`, `_sum`, `_count`). Observation and collection never overlap: both
    run on the event loop's thread, or (a collector, `hooks.ScrapeRunner`) the scrape's thread
    reads while it holds the lock the fan-out takes to deliver a record, so a batch's binning
    (``before_collect``) then runs there, off the loop.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
        created: bool = False,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        # `_created` per series, as prometheus_client's Histogram has (``created``): for the
        # histograms that were those once, so that their exposition did not change.
        self._created: dict[tuple[str, ...], float] | None = {} if created else None
        self.bounds = np.asarray(checked_buckets(buckets), dtype=np.float64)
        self._bound_list: list[float] = self.bounds.tolist()
        self._le = [_go_float(b) for b in self._bound_list] + ["+Inf"]
        self._counts: dict[tuple[str, ...], list[int]] = {}
        self._sums: dict[tuple[str, ...], float] = {}
        # Called first by `collect`: whoever holds observations back bins them then.
        self.before_collect: Callable[[], None] | None = None
        registry.register(self)

    def _series(self, labels: tuple[str, ...], created: float | None = None) -> list[int]:
        counts = self._counts.get(labels)
        if counts is None:
            counts = [0] * (len(self._bound_list) + 1)
            self._counts[labels] = counts
            self._sums[labels] = 0.0
            if self._created is not None:
                self._created[labels] = time.time() if created is None else created
        return counts

    def observe_many(
        self,
        series: Sequence[tuple[str, ...]],
        keys: npt.NDArray[np.int64],
        values: npt.NDArray[Any],
        created: float | None = None,
    ) -> None:
        """Observe ``values[i]`` under the label set ``series[keys[i]]``, for every i (as one
        observation at a time would, but for the float rounding of _sum).
        A label set is made when its first value arrives, with ``created`` as its `_created`
        (now if None)."""
        if not values.size:
            return
        width = len(self._bound_list) + 1
        # side="left": a value equal to a bound belongs to that bound's bucket (le = <=).
        buckets = np.searchsorted(self.bounds, values, side="left")
        binned = np.bincount(keys * width + buckets, minlength=len(series) * width)
        sums = np.bincount(keys, weights=values, minlength=len(series)).tolist()
        rows = binned.reshape(len(series), width)
        for key in np.flatnonzero(rows.any(axis=1)).tolist():
            labels = series[key]
            counts = self._series(labels, created)
            counts[:] = [a + b for a, b in zip(counts, rows[key].tolist(), strict=True)]
            self._sums[labels] += sums[key]

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        if self.before_collect is not None:
            self.before_collect()
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        created = self._created if _created_series() else None
        for labels, counts in self._counts.items():
            family.add_metric(
                list(labels),
                list(zip(self._le, accumulate(counts), strict=True)),
                self._sums[labels],
            )
            if created is not None:
                family.samples.append(
                    Sample(
                        self.name + "_created",
                        dict(zip(self.labelnames, labels, strict=True)),
                        created[labels],
                    )
                )
        yield family


def _created_series() -> bool:
    """Whether `_created` series are exposed: prometheus_client's own setting
    (PROMETHEUS_DISABLE_CREATED_SERIES, `disable_created_metrics()`), read where it keeps it,
    so that the sink's own counters and histograms follow it as its metrics do."""
    return bool(getattr(_client_metrics, "_use_created", True))


class BulkCounter(Collector):
    """A labelled Prometheus counter, exposed as prometheus_client's Counter is (``_total``
    and ``_created`` per series), for the sink's per-request increments: prometheus_client's
    `labels()` validates its arguments and takes a lock, and each `inc` checks and takes a
    lock again (~40 bytecodes and two locks per increment, ten increments per request in the
    collector). Here a series is a dict entry. Increments and collection never overlap, as
    for `BulkHistogram`."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._values: dict[tuple[str, ...], list[float]] = {}  # [value, created]
        # Called first by `collect` (as `BulkHistogram.before_collect`).
        self.before_collect: Callable[[], None] | None = None
        registry.register(self)

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        cell = self._values.get(labels)
        if cell is None:
            cell = self._values[labels] = [0.0, time.time()]
        cell[0] += amount

    def inc_many(
        self,
        series: Sequence[tuple[str, ...]],
        keys: npt.NDArray[np.int64],
        amounts: npt.NDArray[Any] | None = None,
        created: float | None = None,
    ) -> None:
        """Add ``amounts[i]`` (1 each if None) to the label set ``series[keys[i]]``, for every
        i. A label set is made when its first increment arrives (even of 0, as `inc`), with
        ``created`` as its `_created` (now if None)."""
        if not keys.size:
            return
        seen = np.bincount(keys, minlength=len(series))
        totals = (
            seen if amounts is None else np.bincount(keys, weights=amounts, minlength=len(series))
        )
        for key in np.flatnonzero(seen).tolist():
            labels = series[key]
            cell = self._values.get(labels)
            if cell is None:
                cell = self._values[labels] = [0.0, time.time() if created is None else created]
            cell[0] += float(totals[key])

    def touch(self, labels: tuple[str, ...]) -> None:
        """The series exists (at 0) from now on."""
        self.inc(labels, 0.0)

    def value(self, labels: tuple[str, ...]) -> float:
        cell = self._values.get(labels)
        return 0.0 if cell is None else cell[0]

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        if self.before_collect is not None:
            self.before_collect()
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with_created = _created_series()
        for labels, (value, created) in self._values.items():
            family.add_metric(list(labels), value, created=created if with_created else None)
        yield family


@dataclass(frozen=True, slots=True)
class ReplicaState:
    replica: str
    in_flight: int
    healthy: bool


class PrometheusSink:
    """Turns records into histogram observations and counter increments. A record is counted
    in `sidecar_requests_total` at once; the rest waits as columns (`_Held`, a few array
    appends per record) and is binned in bulk, by the definitions `stats` gives the live
    window, just before the sink's metrics are read, or once ``HOLD_RECORDS`` records or
    ``HOLD_EVENTS`` token events wait (memory stays bounded on a sidecar nobody scrapes).
    Observed one by one, the latencies, token counts and SLO verdict were ~0.1M instructions
    per 32-token request in the collector, half its cost. A `hooks.Sink` with nothing to
    flush or release: the registry is read when scraped."""

    name = "prometheus"
    # At most ~3 MiB held (16 bytes per token event, ~0.3 KiB per record; 2.4 MiB measured at
    # the bounds) and one binning pass of 2-7 ms on the loop (measured at the bounds, 1 to 256
    # tokens per record) when nobody scrapes.
    HOLD_RECORDS = 4096
    HOLD_EVENTS = 131_072

    def __init__(
        self,
        registry: CollectorRegistry,
        slo_policy: stats.SLOPolicy | None = None,
        label_cap: int = 64,
        histogram_buckets: str = DEFAULT_LATENCY_LAYOUT,
    ) -> None:
        self.registry = registry
        self.slo_policy = slo_policy
        self.taken = 0
        self.dropped = 0
        self._model = BoundedLabel(label_cap)
        self._replica = BoundedLabel(label_cap)
        thresholds = [
            limit
            for slo in (slo_policy.classes.values() if slo_policy else ())
            for limit in (slo.ttft_s, slo.tpot_s, slo.e2e_s)
            if limit is not None
        ]
        self.latency_buckets = latency_buckets(thresholds, histogram_buckets)
        # Declared in exposition order: latencies, sizes and token counts, SLO series.
        self._declare_latencies(registry, self.latency_buckets)
        self._declare_counts(registry)
        self._declare_slo(registry, slo_policy)
        # (model, replica) label pairs in order of first use: the index each held record keeps.
        self._pairs: dict[tuple[str, str], int] = {}
        self._held = _Held()
        for metric in vars(self).values():
            if isinstance(metric, BulkHistogram | BulkCounter):
                metric.before_collect = self.bin_held

    def _declare_latencies(self, registry: CollectorRegistry, buckets: Sequence[float]) -> None:
        """The latency histograms: per vantage, the engine's queue, the request's upload."""
        hist_labels = ("model", "replica", "vantage")

        def histogram(name: str, doc: str) -> BulkHistogram:
            return BulkHistogram(name, doc, hist_labels, buckets, registry)

        self.ttft = histogram(
            "sidecar_time_to_first_token_seconds",
            "Time to the first token-carrying event, per request. client: from the request "
            "fully received by the proxy; server: from the request sent upstream; engine: vLLM's "
            "own, from scheduling (queue excluded).",
        )
        self.itl = histogram(
            "sidecar_inter_token_latency_seconds",
            "Gap between consecutive token-carrying events (sample = event, not token).",
        )
        self.tpot = histogram(
            "sidecar_time_per_output_token_seconds",
            "(E2E - TTFT) / (N_out - 1) per request; requests with N_out <= 1 are not observed "
            "(see sidecar_requests_without_tpot_total). engine: vLLM's mean ITL.",
        )
        self.e2e = histogram(
            "sidecar_e2e_request_latency_seconds",
            "From the vantage's start to the last token-carrying event (or the stream end).",
        )
        # BulkHistograms too: prometheus_client's Histogram scans its bounds one by one on
        # each observation (~190 of them); a BulkHistogram bins a whole batch at once.
        self.engine_queue = BulkHistogram(
            "sidecar_engine_queue_time_seconds",
            "Queue time vLLM reported for the request (--enable-per-request-metrics).",
            ("model", "replica"),
            buckets,
            registry,
        )
        self.relay_delay = BulkHistogram(
            "sidecar_relay_delay_seconds",
            "The sidecar's own time per relayed token event: from its bytes reaching the "
            "upstream socket to their hand-off to the client socket (sample = event; streams "
            "relayed event for event).",
            ("model", "replica"),
            RELAY_DELAY_BUCKETS,
            registry,
        )
        self.request_read = BulkHistogram(
            "sidecar_request_read_seconds",
            "From a request's first byte to the whole request read by the proxy (its upload; "
            "inside the client vantage's TTFT and E2E, outside the server's).",
            ("model",),
            buckets,
            registry,
        )

    def _declare_counts(self, registry: CollectorRegistry) -> None:
        """Request sizes (histograms), and requests and tokens (counters)."""
        self.prompt_len = BulkHistogram(
            "sidecar_request_prompt_tokens",
            "Prompt tokens per successful request (usage).",
            ("model",),
            TOKEN_BUCKETS,
            registry,
            created=True,
        )
        self.output_len = BulkHistogram(
            "sidecar_request_generation_tokens",
            "Output tokens per successful request (usage, else the estimate).",
            ("model",),
            TOKEN_BUCKETS,
            registry,
            created=True,
        )
        self.requests = BulkCounter(
            "sidecar_requests",
            "Requests that reached the sidecar, by outcome.",
            ("model", "replica", "endpoint", "outcome"),
            registry,
        )
        self.prompt_tokens = BulkCounter(
            "sidecar_prompt_tokens",
            "Prompt tokens of successful requests (upstream usage).",
            ("model", "replica"),
            registry,
        )
        self.generation_tokens = BulkCounter(
            "sidecar_generation_tokens",
            "Output tokens of successful requests.",
            ("model", "replica"),
            registry,
        )
        self.cached_tokens = BulkCounter(
            "sidecar_cached_prompt_tokens",
            "Prompt tokens the upstream served from its prefix cache (when it reports them).",
            ("model", "replica"),
            registry,
        )
        self.estimated = BulkCounter(
            "sidecar_requests_with_estimated_tokens",
            "Successful requests whose per-event or total token counts are estimates "
            "(no usage from the upstream).",
            ("model",),
            registry,
        )
        self.no_tpot = BulkCounter(
            "sidecar_requests_without_tpot",
            "Successful requests with N_out <= 1: no TPOT, excluded from its histogram.",
            ("model",),
            registry,
        )

    def _declare_slo(self, registry: CollectorRegistry, slo_policy: stats.SLOPolicy | None) -> None:
        """Goodput per SLO class, and the declared thresholds and objectives."""
        slo_labels = ("slo_class",)
        self.slo_requests = BulkCounter(
            "sidecar_slo_requests",
            "Goodput denominator: the chat/completions requests of the class, failures "
            "included, but those the class leaves out (see "
            "sidecar_slo_excluded_requests_total).",
            slo_labels,
            registry,
        )
        self.slo_excluded = BulkCounter(
            "sidecar_slo_excluded_requests",
            "Requests left out of the class's denominator: client_error (4xx but 408/429), "
            "client_cancelled (gone before its first token).",
            ("slo_class", "reason"),
            registry,
        )
        self.slo_good = BulkCounter(
            "sidecar_slo_good_requests",
            "Requests that succeeded and met every threshold of their SLO class (client vantage).",
            slo_labels,
            registry,
        )
        self.slo_good_tokens = BulkCounter(
            "sidecar_slo_good_generation_tokens",
            "Output tokens of the requests counted in sidecar_slo_good_requests_total.",
            slo_labels,
            registry,
        )
        threshold = Gauge(
            "sidecar_slo_threshold_seconds",
            "Declared SLO thresholds, by class and metric (ttft, tpot, e2e).",
            ("slo_class", "metric"),
            registry=registry,
        )
        objective = Gauge(
            "sidecar_slo_objective_ratio",
            "Declared objective of the class: the share of counted requests that must be good "
            "(error budget: 1 - objective).",
            slo_labels,
            registry=registry,
        )
        if slo_policy is not None:
            for name, slo in slo_policy.classes.items():
                # Series exist (at 0) from the start, so rate() sees a class's first requests.
                self.slo_requests.touch((name,))
                self.slo_good.touch((name,))
                self.slo_good_tokens.touch((name,))
                for reason in slo.exclude:
                    self.slo_excluded.touch((name, reason))
                objective.labels(name).set(slo.objective)
                for metric, limit in (
                    ("ttft", slo.ttft_s),
                    ("tpot", slo.tpot_s),
                    ("e2e", slo.e2e_s),
                ):
                    if limit is not None:
                        threshold.labels(name, metric).set(limit)

    def flush(self, timeout_s: float = SINK_TIMEOUT_S) -> bool:
        return True

    def close(self, timeout_s: float = SINK_TIMEOUT_S) -> None:
        # The series stay: a scrape after close still reads the last values.
        return None

    def counters(self) -> dict[str, int]:
        # A record whose batch failed to be held or binned (a bug: records that reach the sink
        # fit its columns) is dropped with its batch, and counted.
        return {TAKEN: self.taken, DROPPED + "error": self.dropped}

    def on_record(self, record: RequestRecord) -> None:
        self.taken += 1
        generation = record.endpoint in GENERATION_ENDPOINTS
        # A missing value is a label of its own ("unknown"), outside the cap.
        model = (
            (self._model(record.model, record.model_confirmed) if record.model else UNKNOWN)
            if generation
            else OTHER
        )
        replica = self._replica(record.replica) if record.replica else UNKNOWN
        endpoint = record.endpoint if generation else OTHER
        # `_value_`, not `value` (a Python-level property on Enum: ~3x the time).
        self.requests.inc((model, replica, endpoint, record.outcome._value_))
        # The rest is held as columns and binned in bulk at the next scrape (`bin_held`): a
        # failure is held only for the SLO counters, whose denominator counts it.
        if not generation or (record.outcome is not OUTCOME_OK and self.slo_policy is None):
            return
        pair = self._pairs.get((model, replica))
        if pair is None:
            pair = self._pairs[(model, replica)] = len(self._pairs)
        held = self._held
        try:
            held.append(record, pair)
        except BaseException:
            # A record that does not fit is refused before anything was added (`_Held.append`);
            # whatever else failed, the batch is no longer trusted: it is lost, and counted.
            self._held = _Held()
            self.dropped += len(held) + 1
            raise
        if held.events >= self.HOLD_EVENTS or len(held) >= self.HOLD_RECORDS:
            self.bin_held()

    def bin_held(self) -> None:
        """Observe and count every record held since the last call, in one numpy pass over
        their columns (the definitions are stats': `samples_of`, `goodput_of`, as record by
        record). Called before any of the sink's metrics is read, and when enough wait."""
        held = self._held
        if not held.rows:
            return
        self._held = _Held()  # first: a failure below loses this batch once, not every scrape
        try:
            self._bin(held)
        except BaseException:
            self.dropped += len(held)  # (some of its metrics may have been counted)
            raise

    def _bin(self, held: _Held) -> None:
        pairs = list(self._pairs)
        table, keys, created = held.table, held.column(_PAIR), held.since
        if self.slo_policy is not None:
            self._bin_slo(self.slo_policy, table)
        ok = table.ok
        if not ok.any():
            return
        models: dict[str, int] = {}
        model_of = np.asarray([models.setdefault(m, len(models)) for m, _ in pairs], dtype=np.int64)
        by_model = _Series([(m,) for m in models], model_of[keys[ok]])
        by_pair = _Series(pairs, keys[ok])
        self._bin_latencies(table, ok, by_pair, by_model, created)
        self._bin_tokens(held, ok, by_pair, by_model, created)

    def _bin_slo(self, policy: stats.SLOPolicy, table: stats.RecordTable) -> None:
        """Each held request's SLO class: counted (or excluded), and good or not (client
        vantage), as `stats.SLOPolicy.verdict` says record by record."""
        every = np.ones(len(table), dtype=np.bool_)
        for name, verdict in table.goodput(every, policy, 0.0).items():
            labels = (name,)
            self.slo_requests.inc(labels, verdict.total_requests)
            self.slo_good.inc(labels, verdict.good_requests)
            self.slo_good_tokens.inc(labels, verdict.good_output_tokens)
            for reason, count in verdict.excluded.items():
                self.slo_excluded.inc((name, reason), count)

    def _bin_latencies(
        self,
        table: stats.RecordTable,
        ok: npt.NDArray[np.bool_],
        by_pair: _Series,
        by_model: _Series,
        created: float,
    ) -> None:
        """The successful requests' TTFT, E2E, TPOT and ITL at each vantage they have, and
        the proxy's own delay per event where both vantages saw the same events."""
        sides = {
            vantage: table.columns(vantage, ok) for vantage in (VANTAGE_CLIENT, VANTAGE_SERVER)
        }
        for vantage, columns in sides.items():
            present = columns.present
            samples = stats.samples_of(columns.select(present))
            series = [(model, replica, vantage.value) for model, replica in by_pair.labels]
            keys = by_pair.keys[present]
            for histogram, values in (
                (self.ttft, samples.ttft_s),
                (self.e2e, samples.e2e_s),
                (self.tpot, samples.tpot_s),
            ):
                defined = ~np.isnan(values)
                histogram.observe_many(series, keys[defined], values[defined], created)
            if vantage is VANTAGE_CLIENT:
                untimed = np.isnan(samples.tpot_s) & (samples.n_out <= 1)
                self.no_tpot.inc_many(
                    by_model.labels, by_model.keys[present][untimed], created=created
                )
            # Gaps within each request (with n > 1 within each choice), never across them.
            gap_keys = np.repeat(keys, samples.itl_counts)
            self.itl.observe_many(series, gap_keys, samples.itl_s, created)
        relay = stats.relay_delays(sides[VANTAGE_CLIENT], sides[VANTAGE_SERVER])
        self.relay_delay.observe_many(
            by_pair.labels, by_pair.keys[relay.event_requests()], relay.delay_ns / NS_PER_S, created
        )
        # The same intervals as at the other vantages (record.EngineTiming): TTFT and E2E
        # from queued in the engine, TPOT = vLLM's mean ITL. NaN where vLLM left a part out
        # (or sent no timing): that interval is unknown, not observed.
        queue_ms = table.engine_ms("queue_time_ms")[ok]
        ttft_ms = queue_ms + table.engine_ms("time_to_first_token_ms")[ok]
        e2e_ms = ttft_ms + table.engine_ms("generation_time_ms")[ok]
        itl_ms = table.engine_ms("mean_itl_ms")[ok]
        series = [(model, replica, VANTAGE_ENGINE.value) for model, replica in by_pair.labels]
        for histogram, values_ms, labels in (
            (self.ttft, ttft_ms, series),
            (self.e2e, e2e_ms, series),
            (self.tpot, itl_ms, series),
            (self.engine_queue, queue_ms, by_pair.labels),
        ):
            defined = ~np.isnan(values_ms)
            histogram.observe_many(
                labels, by_pair.keys[defined], values_ms[defined] / 1000, created
            )

    def _bin_tokens(
        self,
        held: _Held,
        ok: npt.NDArray[np.bool_],
        by_pair: _Series,
        by_model: _Series,
        created: float,
    ) -> None:
        """The successful requests' prompt, output and cached tokens, and their upload."""
        n_in = held.column(_HELD_N_IN)[ok]
        known = n_in >= 0
        self.prompt_tokens.inc_many(by_pair.labels, by_pair.keys[known], n_in[known], created)
        self.prompt_len.observe_many(by_model.labels, by_model.keys[known], n_in[known], created)
        n_out = held.table.n_out_total[ok]
        self.generation_tokens.inc_many(by_pair.labels, by_pair.keys, n_out, created)
        self.output_len.observe_many(by_model.labels, by_model.keys, n_out, created)
        cached = held.column(_HELD_CACHED)[ok]
        some = cached != 0
        self.cached_tokens.inc_many(by_pair.labels, by_pair.keys[some], cached[some], created)
        estimated = held.column(_HELD_ESTIMATED)[ok] != 0
        self.estimated.inc_many(by_model.labels, by_model.keys[estimated], created=created)
        read_ns = held.column(_HELD_READ_NS)[ok]
        read = read_ns >= 0
        self.request_read.observe_many(
            by_model.labels, by_model.keys[read], read_ns[read] / 1e9, created
        )


@dataclass(frozen=True, slots=True)
class _Series:
    """Label sets, and per value the index of its own among them."""

    labels: Sequence[tuple[str, ...]]
    keys: npt.NDArray[np.int64]


# A held record's own fields, one row of int64s in `_Held.rows` (one `struct.pack` per record,
# as `stats.RecordTable`'s rows), by index:
_PAIR, _HELD_N_IN, _HELD_READ_NS, _HELD_CACHED, _HELD_ESTIMATED = range(5)
_HELD_FIELDS: Final = 5
_HELD_ROW: Final = struct.Struct(f"={_HELD_FIELDS}q")


class _Held:
    """The records a `PrometheusSink` holds until it bins them: their columns for the metric
    math (`stats.RecordTable`), and beside them, one row per record (`rows`, read by
    `column`), what only this sink reads: the index of its (model, replica) label pair, its
    prompt tokens (-1: unknown), its upload time (-1: not measured), its cached tokens,
    whether its token counts are estimates."""

    __slots__ = ("table", "rows", "events", "since")

    def __init__(self) -> None:
        self.table = stats.RecordTable()
        self.rows = array("q")
        self.events = 0  # token events held, both sides
        self.since = 0.0  # when the first record came: the `_created` of series it makes

    def __len__(self) -> int:
        return len(self.rows) // _HELD_FIELDS

    def append(self, record: RequestRecord, pair: int) -> None:
        n_in, read_ns = record.n_in, record.request_read_ns
        row = _HELD_ROW.pack(
            pair,
            -1 if n_in is None else n_in,
            -1 if read_ns is None else read_ns,
            record.n_cached or 0,
            record.token_source is not SOURCE_USAGE,
        )
        if not self.rows:
            self.since = time.time()
        # The table raises before it adds a record that does not fit, the row was packed
        # first: either both take the record or neither does.
        self.table.append(record, 0, True)
        self.rows.frombytes(row)
        server = record.server
        self.events += record.client.n_marks + (0 if server is None else server.n_marks)

    def column(self, index: int) -> npt.NDArray[np.int64]:
        """Per held record, its row's field ``index`` (a strided view)."""
        return np.frombuffer(self.rows, dtype=np.int64).reshape(-1, _HELD_FIELDS)[:, index]


WINDOW_QUANTILES = (0.5, 0.9, 0.99)


class LiveCollector(Collector):
    """Gauges computed at scrape time: exact window quantiles and attainment, replica state,
    sink errors. Nothing here runs on the request path."""

    def __init__(
        self,
        window: WindowSink,
        fanout: SinkFanout,
        slo_policy: stats.SLOPolicy | None,
        replicas: Callable[[], Sequence[ReplicaState]],
    ) -> None:
        self.window = window
        self.fanout = fanout
        self.slo_policy = slo_policy
        self.replicas = replicas

    def describe(self) -> Iterable[Metric]:
        return []  # computed on each scrape; no fixed description needed at registration

    def collect(self) -> Iterator[Metric]:
        window_s = f"{self.window.window_s:g}"
        yield from self._window_latency(window_s)
        outcomes = GaugeMetricFamily(
            "sidecar_window_requests",
            f"Requests that ended in the last {window_s} s.",
            labels=("outcome",),
        )
        for outcome, count in self.window.generation_outcomes().items():
            outcomes.add_metric((outcome.value,), count)
        yield outcomes
        if self.slo_policy is not None:
            attainment = GaugeMetricFamily(
                "sidecar_window_slo_attainment",
                f"Good / all requests of the class over the last {window_s} s (failures "
                "included; absent when no request of the class ended in the window).",
                labels=("slo_class",),
            )
            for name, (good, total) in sorted(self.window.attainment(self.slo_policy).items()):
                attainment.add_metric((name,), good / total)
            yield attainment
        yield from self._replica_state()
        yield from sink_metrics(self.fanout)

    def _window_latency(self, window_s: str) -> Iterator[Metric]:
        """The window's exact latency percentiles, and the samples behind them."""
        # Gauges, not a summary: a summary's _count and _sum must be counters, and over a
        # sliding window they go down as records leave it, which rate() reads as resets (27 in
        # 20 minutes, seen). A quantile of a window is a value at an instant: a gauge. Its
        # label is `percentile`: Prometheus reserves `quantile` for summaries.
        latency = GaugeMetricFamily(
            "sidecar_window_latency_seconds",
            f"Exact percentiles over the last {window_s} s (numpy, linear interpolation; this "
            "sidecar only: never average these across sidecars, use the histograms).",
            labels=("metric", "vantage", "percentile"),
        )
        samples = GaugeMetricFamily(
            "sidecar_window_latency_samples",
            f"Samples behind sidecar_window_latency_seconds over the last {window_s} s "
            "(requests; gaps for itl).",
            labels=("metric", "vantage"),
        )
        for vantage, report in self.window.vantage_reports().items():
            for metric, summary in (
                ("ttft", report.ttft),
                ("itl", report.itl),
                ("tpot", report.tpot),
                ("e2e", report.e2e),
            ):
                if summary.count == 0 or summary.mean is None:
                    continue
                for q in WINDOW_QUANTILES:
                    value = summary.p(q * 100)
                    if value is not None:
                        latency.add_metric((metric, vantage.value, f"{q * 100:g}"), value)
                samples.add_metric((metric, vantage.value), summary.count)
        yield latency
        yield samples

    def _replica_state(self) -> Iterator[Metric]:
        """Each replica's requests in flight and health."""
        in_flight = GaugeMetricFamily(
            "sidecar_in_flight_requests", "Requests in flight per replica.", labels=("replica",)
        )
        up = GaugeMetricFamily(
            "sidecar_replica_healthy",
            "1 if the replica is in rotation (health checks).",
            labels=("replica",),
        )
        for state in self.replicas():
            in_flight.add_metric((state.replica,), state.in_flight)
            up.add_metric((state.replica,), 1.0 if state.healthy else 0.0)
        yield in_flight
        yield up


def sink_metrics(fanout: SinkFanout) -> Iterator[Metric]:
    """The sinks' own health, from the fan-out's failure counts and every sink's `counters()`
    (hooks.Sink): what each took, handed on and dropped, by reason."""
    errors = CounterMetricFamily(
        "sidecar_sink_errors",
        "Records a sink failed to take (an exception in its on_record).",
        labels=("sink",),
    )
    for sink, count in fanout.errors.items():
        errors.add_metric((sink,), count)
    yield errors
    taken = CounterMetricFamily(
        "sidecar_sink_records_taken",
        "Records a sink accepted (each ends written, dropped or still queued).",
        labels=("sink",),
    )
    written = CounterMetricFamily(
        "sidecar_sink_records_written",
        "Records a sink handed on to where it sends them (a file, its thread, the collector).",
        labels=("sink",),
    )
    dropped = CounterMetricFamily(
        "sidecar_sink_records_dropped",
        "Records a sink took and lost, by reason (queue_full: its queue was full; closed: "
        "given after it closed; write_error, unwritable, error: its own failures).",
        labels=("sink", "reason"),
    )
    for name, counters in fanout.counters().items():
        if TAKEN in counters:
            taken.add_metric((name,), counters[TAKEN])
        if WRITTEN in counters:
            written.add_metric((name,), counters[WRITTEN])
        for reason, count in sorted(dropped_by_reason(counters).items()):
            dropped.add_metric((name, reason), count)
    yield taken
    yield written
    yield dropped


@dataclass(frozen=True, slots=True)
class WorkerState:
    """One worker process of `sidecar proxy --workers N`, as the collector knows it."""

    worker: str
    alive: bool
    restarts: int
    records_received: int
    dropped_channel_full: int
    dropped_channel_closed: int
    encode_errors: int
    decode_errors: int
    lost: int  # requests a worker counted and never sent a record for, before it died
    # Decoded, then dropped: a scrape held the sinks with their backlog full (hooks.py).
    dropped_scrape_backlog: int
    # Its processes' own CPU and context switches, all incarnations (proxy/worker.own_cpu).
    cpu_user_seconds: float = 0.0
    cpu_system_seconds: float = 0.0
    context_switches_voluntary: int = 0
    context_switches_involuntary: int = 0
    # Its loop lag and GC pauses, all incarnations (proxy/stalls.py's snapshot format).
    stalls: Mapping[str, Any] = field(default_factory=dict)


class WorkerCollector(Collector):
    """The worker processes and the channel that brings their records to the collector: how
    many are alive, how often they were restarted, and every record that did not make it
    (so that the request counters can be checked against what the workers served)."""

    def __init__(self, workers: Callable[[], Sequence[WorkerState]]) -> None:
        self.workers = workers

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        states = list(self.workers())
        alive = GaugeMetricFamily("sidecar_workers_alive", "Worker processes serving traffic now.")
        alive.add_metric((), sum(1 for s in states if s.alive))
        yield alive
        configured = GaugeMetricFamily(
            "sidecar_workers", "Worker processes configured (--workers)."
        )
        configured.add_metric((), len(states))
        yield configured
        restarts = CounterMetricFamily(
            "sidecar_worker_restarts",
            "Times a worker process was started again after it died.",
            labels=("worker",),
        )
        received = CounterMetricFamily(
            "sidecar_channel_records",
            "Records the collector received from each worker.",
            labels=("worker",),
        )
        dropped = CounterMetricFamily(
            "sidecar_channel_dropped_records",
            "Records lost between a worker and the collector, by reason: channel_full (the "
            "collector fell behind by more than --channel-buffer-bytes; the worker dropped "
            "rather than wait), channel_closed, encode_error, decode_error, scrape_backlog "
            "(the collector took the record, but a scrape held the sinks with 50,000 records "
            "or 64 MiB already waiting: on a host out of CPU) and worker_died (requests a "
            "worker counted before it died with no record sent).",
            labels=("worker", "reason"),
        )
        cpu = CounterMetricFamily(
            "sidecar_worker_cpu_seconds",
            "CPU each worker process used, by mode (user, system), over its restarts, as of "
            "its last status (every 0.25 s): what relaying costs, beside "
            "process_cpu_seconds_total, which is the collector's own.",
            labels=("worker", "mode"),
        )
        switches = CounterMetricFamily(
            "sidecar_worker_context_switches",
            "Context switches of each worker process, over its restarts: voluntary, each a "
            "sleep that ended (between reads, a relay sleeps and is woken; each wake-up costs "
            "CPU, more under nested virtualisation); involuntary, each a preemption (another "
            "process wanted its core).",
            labels=("worker", "kind"),
        )
        for s in states:
            restarts.add_metric((s.worker,), s.restarts)
            received.add_metric((s.worker,), s.records_received)
            cpu.add_metric((s.worker, "user"), s.cpu_user_seconds)
            cpu.add_metric((s.worker, "system"), s.cpu_system_seconds)
            switches.add_metric((s.worker, "voluntary"), s.context_switches_voluntary)
            switches.add_metric((s.worker, "involuntary"), s.context_switches_involuntary)
            for reason, count in (
                ("channel_full", s.dropped_channel_full),
                ("channel_closed", s.dropped_channel_closed),
                ("encode_error", s.encode_errors),
                ("decode_error", s.decode_errors),
                ("scrape_backlog", s.dropped_scrape_backlog),
                ("worker_died", s.lost),
            ):
                dropped.add_metric((s.worker, reason), count)
        yield restarts
        yield received
        yield dropped
        yield cpu
        yield switches
        yield from stall_metrics((s.worker, s.stalls) for s in states)


def stall_metrics(snapshots: Iterable[tuple[str, Mapping[str, Any]]]) -> Iterator[Metric]:
    """Loop lag and GC pauses per process that relays (label ``worker``), from snapshots in
    the format of sidecar/proxy/stalls.py (``bounds_s``; ``loop_lag`` and ``gc_pause`` by
    generation, each ``counts`` per bucket, ``sum_ns``, ``max_ns``). Every chunk is stamped on
    that process's loop: a stamp taken during a stall is late by up to the stall."""
    lag = HistogramMetricFamily(
        "sidecar_loop_lag_seconds",
        "How late a timer due every 0.1 s ran on the event loop that stamps the chunks: a "
        "sample of how late a stamp taken at an arbitrary moment is (below 1 ms: uvloop's "
        "timer granularity, no stall). Compare with your ITL SLO.",
        labels=("worker",),
    )
    lag_max = GaugeMetricFamily(
        "sidecar_loop_lag_max_seconds",
        "The largest loop lag seen since the worker started (over its restarts).",
        labels=("worker",),
    )
    pause = HistogramMetricFamily(
        "sidecar_gc_pause_seconds",
        "Python garbage-collection pauses, each one, by generation: the event loop (and every "
        "stamp due meanwhile) waits for the whole pause.",
        labels=("worker", "generation"),
    )
    pause_max = GaugeMetricFamily(
        "sidecar_gc_pause_max_seconds",
        "The longest garbage-collection pause seen since the worker started (over its "
        "restarts), by generation.",
        labels=("worker", "generation"),
    )
    for worker, snapshot in snapshots:
        bounds = snapshot.get("bounds_s")
        if not bounds:
            continue
        le = [_go_float(float(b)) for b in bounds] + ["+Inf"]
        _add_stalls(lag, lag_max, [worker], le, snapshot["loop_lag"])
        for generation, histogram in sorted(snapshot["gc_pause"].items()):
            _add_stalls(pause, pause_max, [worker, str(generation)], le, histogram)
    yield lag
    yield lag_max
    yield pause
    yield pause_max


def _add_stalls(
    family: HistogramMetricFamily,
    gauge: GaugeMetricFamily,
    labels: list[str],
    le: list[str],
    histogram: Mapping[str, Any],
) -> None:
    counts = [int(c) for c in histogram["counts"]]
    # Cumulative, as Prometheus has them: _count is the +Inf bucket.
    buckets = list(zip(le, accumulate(counts), strict=True))
    family.add_metric(labels, buckets, int(histogram["sum_ns"]) / NS_PER_S)
    gauge.add_metric(labels, int(histogram["max_ns"]) / NS_PER_S)


class StallCollector(Collector):
    """`stall_metrics` of the processes ``snapshots`` names (worker label -> snapshot). In one
    process (`--workers 0`) that is ``{"0": server.stalls.snapshot()}``: the same series as a
    one-worker proxy, so that dashboards and alerts need no second query. Worker mode needs
    none: `WorkerCollector` exports its workers' stalls."""

    def __init__(self, snapshots: Callable[[], Mapping[str, Mapping[str, Any]]]) -> None:
        self.snapshots = snapshots

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from stall_metrics(self.snapshots().items())


class CaptureCollector(Collector):
    """The capture's own health: records written, dropped (queue full / write errors), queued."""

    def __init__(self, capture: CaptureLike) -> None:
        self.capture = capture

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        counters = self.capture.counters()
        written = CounterMetricFamily(
            "sidecar_capture_records_written", "Records written to capture files."
        )
        written.add_metric((), counters[WRITTEN])
        yield written
        dropped = CounterMetricFamily(
            "sidecar_capture_records_dropped",
            "Records not captured, by reason.",
            labels=("reason",),
        )
        by_reason = dropped_by_reason(counters)
        # The three reasons of this family since it exists; records given after close are
        # in sidecar_sink_records_dropped_total (a stopping process is not scraped).
        for reason in ("queue_full", "write_error", "unwritable"):
            dropped.add_metric((reason,), by_reason.get(reason, 0))
        yield dropped
        restarts = CounterMetricFamily(
            "sidecar_capture_writer_restarts",
            "Capture writer threads found dead and started again (each is logged).",
        )
        restarts.add_metric((), counters["writer_restarts"])
        yield restarts
        queued = GaugeMetricFamily(
            "sidecar_capture_queue_records", "Records waiting for the capture writer."
        )
        queued.add_metric((), self.capture.queued)
        yield queued


class CaptureLike(Protocol):
    """What `CaptureCollector` reads of a capture (sinks.capture.CaptureSink)."""

    def counters(self) -> Mapping[str, int]: ...

    @property
    def queued(self) -> int: ...
