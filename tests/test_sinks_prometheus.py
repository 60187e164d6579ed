"""Prometheus export: hand-worked sink values, promtool, and a real Prometheus server."""

from __future__ import annotations

import asyncio
import bisect
import importlib.util
import json
import random
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    enable_created_metrics,
    generate_latest,
)
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_helpers import Prometheus, require_binary, running_prometheus
from proxy_stack import stack
from random_records import random_records

from sidecar import stats
from sidecar.config import build_config
from sidecar.hooks import SINK_TIMEOUT_S, Sink, SinkFanout, ThreadedSink
from sidecar.record import (
    ChunkMark,
    EngineTiming,
    Int64s,
    Outcome,
    RequestRecord,
    Timeline,
    TokenSource,
    Vantage,
)
from sidecar.serve import build_proxy_server
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig
from sidecar.sinks.prometheus import (
    BulkCounter,
    BulkHistogram,
    LiveCollector,
    PrometheusSink,
    _go_float,
    e6_buckets,
    latency_buckets,
    log_linear_buckets,
)
from sidecar.sinks.window import WindowSink

MS = 1_000_000


def record(
    marks_ms: list[tuple[float, int]],
    *,
    n_out: int | None = None,
    outcome: Outcome = Outcome.OK,
    model: str = "m",
    slo_class: str | None = None,
    server_shift_ms: float = 1.0,
    engine: EngineTiming | None = None,
    http_status: int = 200,
) -> RequestRecord:
    marks = tuple(ChunkMark(int(t * MS), n) for t, n in marks_ms)
    server_marks = tuple(
        ChunkMark(m.offset_ns - int(server_shift_ms * MS), m.n_tokens) for m in marks
    )
    end = marks[-1].offset_ns if marks else 5 * MS
    return RequestRecord(
        request_id="r",
        wall_time_ns=0,
        outcome=outcome,
        endpoint="chat",
        model=model,
        client=Timeline.from_marks(0, marks, end, len(marks)),
        server=Timeline.from_marks(int(1 * MS), server_marks, end, len(marks)),
        n_in=10,
        n_out=n_out,
        n_cached=4,
        token_source=TokenSource.USAGE,
        replica="127.0.0.1:8000",
        engine=engine,
        http_status=http_status,
        attributes={"slo_class": slo_class} if slo_class else {},
    )


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_spec_example_lands_in_the_histograms_and_counters() -> None:
    registry = CollectorRegistry()
    policy = stats.SLOPolicy({"default": stats.SLO(ttft_s=0.5, tpot_s=0.05)})
    sink = PrometheusSink(registry, policy)
    engine = EngineTiming(time_to_first_token_ms=90.0, mean_itl_ms=33.0, queue_time_ms=20.0)
    sink.on_record(record([(120, 1), (150, 1), (190, 1), (230, 1)], n_out=4, engine=engine))
    client = {"model": "m", "replica": "127.0.0.1:8000", "vantage": "client"}
    server = {**client, "vantage": "server"}
    assert value(registry, "sidecar_time_to_first_token_seconds_count", **client) == 1
    assert value(registry, "sidecar_time_to_first_token_seconds_sum", **client) == pytest.approx(
        0.120
    )
    # Server side: sent upstream at 1 ms, events seen 1 ms earlier than the client's writes.
    assert value(registry, "sidecar_time_to_first_token_seconds_sum", **server) == pytest.approx(
        0.118
    )
    assert value(registry, "sidecar_inter_token_latency_seconds_count", **client) == 3
    assert value(registry, "sidecar_inter_token_latency_seconds_sum", **client) == pytest.approx(
        0.110
    )
    # Gaps of 30, 40 and 40 ms; schema-3 bounds 2**(i/8) around them: 0.02866, 0.03125,
    # 0.03716, 0.04053.
    for le, below in (("0.02866", 0), ("0.03125", 1), ("0.03716", 1), ("0.04053", 3)):
        assert (
            value(registry, "sidecar_inter_token_latency_seconds_bucket", le=le, **client) == below
        )
    assert value(registry, "sidecar_time_per_output_token_seconds_sum", **client) == pytest.approx(
        0.110 / 3
    )
    # The proxy's own delay: each event reached the upstream socket 1 ms before its write to
    # the client; four events, 1 ms each, all in the bucket of the bound just above 1 ms
    # (2**(-80/8) = 0.0009766 and 2**(-79/8) = 0.001065, the schema-3 bounds around it).
    pair = {"model": "m", "replica": "127.0.0.1:8000"}
    assert value(registry, "sidecar_relay_delay_seconds_count", **pair) == 4
    assert value(registry, "sidecar_relay_delay_seconds_sum", **pair) == pytest.approx(0.004)
    for le, below in (("0.0009766", 0), ("0.001065", 4)):
        assert value(registry, "sidecar_relay_delay_seconds_bucket", le=le, **pair) == below
    assert value(registry, "sidecar_e2e_request_latency_seconds_sum", **client) == pytest.approx(
        0.230
    )
    engine_labels = {**client, "vantage": "engine"}
    # TTFT means the same interval at every vantage: from the start (queued in the engine,
    # 20 ms of queue) to the first token (90 ms after scheduling): 110 ms, not vLLM's 90.
    assert value(
        registry, "sidecar_time_to_first_token_seconds_sum", **engine_labels
    ) == pytest.approx(0.110)
    assert value(
        registry, "sidecar_time_per_output_token_seconds_sum", **engine_labels
    ) == pytest.approx(0.033)
    # No generation_time: no engine E2E (a missing part leaves the interval unknown).
    assert value(registry, "sidecar_e2e_request_latency_seconds_count", **engine_labels) in (
        None,
        0,
    )
    assert value(
        registry, "sidecar_engine_queue_time_seconds_sum", model="m", replica="127.0.0.1:8000"
    ) == pytest.approx(0.020)
    assert (
        value(
            registry,
            "sidecar_requests_total",
            model="m",
            replica="127.0.0.1:8000",
            endpoint="chat",
            outcome="ok",
        )
        == 1
    )
    assert (
        value(registry, "sidecar_generation_tokens_total", model="m", replica="127.0.0.1:8000") == 4
    )
    assert (
        value(registry, "sidecar_cached_prompt_tokens_total", model="m", replica="127.0.0.1:8000")
        == 4
    )
    assert value(registry, "sidecar_slo_good_requests_total", slo_class="default") == 1
    assert (
        value(registry, "sidecar_slo_threshold_seconds", slo_class="default", metric="ttft") == 0.5
    )
    # The SLO thresholds are bucket boundaries, so `le="0.05"` counts TPOTs under 50 ms exactly.
    assert 0.05 in sink.latency_buckets and 0.5 in sink.latency_buckets


def test_goodput_counters_and_denominator_per_class() -> None:
    registry = CollectorRegistry()
    policy = stats.SLOPolicy(
        {"default": stats.SLO(ttft_s=0.5), "interactive": stats.SLO(ttft_s=0.1)}
    )
    sink = PrometheusSink(registry, policy)
    sink.on_record(record([(80, 1), (90, 2)], n_out=3, slo_class="interactive"))  # good
    sink.on_record(record([(300, 1), (310, 1)], n_out=2, slo_class="interactive"))  # too slow
    sink.on_record(record([(300, 1)], n_out=1))  # default: good, no TPOT
    sink.on_record(record([], outcome=Outcome.TIMEOUT))  # default: counted, not good
    assert value(registry, "sidecar_slo_requests_total", slo_class="interactive") == 2
    assert value(registry, "sidecar_slo_good_requests_total", slo_class="interactive") == 1
    assert value(registry, "sidecar_slo_good_generation_tokens_total", slo_class="interactive") == 3
    assert value(registry, "sidecar_slo_requests_total", slo_class="default") == 2
    assert value(registry, "sidecar_slo_good_requests_total", slo_class="default") == 1
    assert value(registry, "sidecar_requests_without_tpot_total", model="m") == 1
    assert (
        value(
            registry,
            "sidecar_requests_total",
            model="m",
            replica="127.0.0.1:8000",
            endpoint="chat",
            outcome="timeout",
        )
        == 1
    )


def test_labels_are_capped() -> None:
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, label_cap=2)
    for model in ("a", "b", "c", "d", "a"):
        sink.on_record(record([(10, 1)], n_out=1, model=model))
    text = generate_latest(registry).decode()
    assert 'model="a"' in text and 'model="b"' in text and 'model="other"' in text
    assert 'model="c"' not in text
    assert (
        value(
            registry,
            "sidecar_requests_total",
            model="other",
            replica="127.0.0.1:8000",
            endpoint="chat",
            outcome="ok",
        )
        == 2
    )


def test_junk_model_names_cannot_take_the_label_slots() -> None:
    """64 requests with junk model names (each a 404) once filled the label budget, and the
    real model read 'other' for the life of the process. Only a name the upstream confirmed
    (a 2xx) takes a slot; a refused name reads 'other', a confirmed one keeps its label on
    later failures too."""
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, label_cap=2)
    for i in range(64):
        sink.on_record(record([], outcome=Outcome.HTTP_ERROR, model=f"junk{i}", http_status=404))
    sink.on_record(record([(10, 1)], n_out=1, model="real"))
    sink.on_record(record([], outcome=Outcome.HTTP_ERROR, model="real", http_status=400))
    sink.on_record(record([], outcome=Outcome.REJECTED, model="junk", http_status=429))
    text = generate_latest(registry).decode()
    assert 'model="junk' not in text
    assert (
        value(
            registry,
            "sidecar_requests_total",
            model="other",
            replica="127.0.0.1:8000",
            endpoint="chat",
            outcome="http_error",
        )
        == 64
    )
    assert (
        value(
            registry,
            "sidecar_requests_total",
            model="real",
            replica="127.0.0.1:8000",
            endpoint="chat",
            outcome="ok",
        )
        == 1
    )
    assert (
        value(
            registry,
            "sidecar_requests_total",
            model="real",
            replica="127.0.0.1:8000",
            endpoint="chat",
            outcome="http_error",
        )
        == 1
    )


def _without_created_values(text: bytes) -> str:
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", text.decode())


@pytest.mark.parametrize("exposition", [generate_latest, generate_openmetrics])
def test_the_sinks_own_counter_and_token_histogram_read_as_prometheus_clients_do(
    exposition: Any,
) -> None:
    """The sink counts requests and tokens with its own primitives (no lock, no checks per
    increment): scraped, they must read exactly as prometheus_client's Counter and Histogram
    did, `_created` series included (their values are instants, masked here)."""
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter = Counter("reqs", "Requests.", ("model", "outcome"), registry=theirs)
    bulk_counter = BulkCounter("reqs", "Requests.", ("model", "outcome"), ours)
    buckets = (1.0, 10.0, 100.0)
    histogram = Histogram("toks", "Tokens.", ("model",), registry=theirs, buckets=buckets)
    bulk_histogram = BulkHistogram("toks", "Tokens.", ("model",), buckets, ours, created=True)
    counter.labels("m", "ok")  # a series made before its first increment reads 0
    bulk_counter.touch(("m", "ok"))
    for model, outcome, amount, tokens in [
        ("m", "error", 1, 0),
        ("m", "ok", 3, 10),
        ("n", "ok", 2.5, 250),
        ("m", "ok", 1, 1),
    ]:
        counter.labels(model, outcome).inc(amount)
        bulk_counter.inc((model, outcome), amount)
        histogram.labels(model).observe(tokens)
        bulk_histogram.observe_many([(model,)], np.asarray([0]), np.asarray([tokens]))
    assert bulk_counter.value(("m", "ok")) == 4.0 and bulk_counter.value(("x", "ok")) == 0.0
    mine = _without_created_values(exposition(ours))
    assert mine == _without_created_values(exposition(theirs))
    assert 'reqs_total{model="m",outcome="ok"} 4.0' in mine
    assert 'toks_bucket{le="10.0",model="m"} 3.0' in mine
    # prometheus_client's switch for `_created` series (PROMETHEUS_DISABLE_CREATED_SERIES)
    # holds for the sink's own as for its metrics.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    try:
        mine = exposition(ours).decode()
        assert "_created" not in mine and mine == exposition(theirs).decode()
    finally:
        enable_created_metrics()  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("repeat", [1, 40])
def test_a_batch_is_binned_by_hand(repeat: int) -> None:
    """Bounds 1, 10, 100 ms (+Inf). Under x: 0.5 ms, 10 ms (equal to a bound: le, so in 10 ms)
    and 250 ms, repeated: per repetition one each in le=0.001, le=0.01 and +Inf, sum 260.5 ms.
    Under y, interleaved with x's: 50 ms each time (le=0.1). Label set z is named but gets
    no value: it is not made."""
    registry = CollectorRegistry()
    histogram = BulkHistogram("gaps", "doc", ("v",), [0.001, 0.01, 0.1], registry, created=True)
    series = [("x",), ("z",), ("y",)]
    keys, values = [], []
    for _ in range(repeat):
        for key, value_s in ((0, 0.0005), (2, 0.05), (0, 0.010), (0, 0.250)):
            keys.append(key)
            values.append(value_s)
    histogram.observe_many(series, np.asarray(keys), np.asarray(values), created=12.5)
    histogram.observe_many(series, np.asarray([], dtype=np.int64), np.asarray([]))  # nothing
    expected = {
        "x": {"0.001": 1, "0.01": 2, "0.1": 2, "+Inf": 3},
        "y": {"0.001": 0, "0.01": 0, "0.1": 1, "+Inf": 1},
    }
    for label, buckets in expected.items():
        for le, count in buckets.items():
            assert value(registry, "gaps_bucket", v=label, le=le) == count * repeat, (label, le)
    assert value(registry, "gaps_count", v="x") == 3 * repeat
    assert value(registry, "gaps_sum", v="x") == pytest.approx(0.2605 * repeat)
    assert value(registry, "gaps_sum", v="y") == pytest.approx(0.05 * repeat)
    assert value(registry, "gaps_created", v="x") == 12.5
    assert value(registry, "gaps_count", v="z") is None
    # A second batch adds to the first; a series keeps its `_created`.
    histogram.observe_many(series, np.asarray([0]), np.asarray([0.0001]), created=99.0)
    assert value(registry, "gaps_bucket", v="x", le="0.001") == repeat + 1
    assert value(registry, "gaps_created", v="x") == 12.5


def test_counter_batches_make_series_on_their_first_increment_even_of_zero() -> None:
    registry = CollectorRegistry()
    counter = BulkCounter("toks", "doc", ("m",), registry)
    series = [("a",), ("b",), ("c",)]
    counter.inc_many(series, np.asarray([0, 2, 0]), np.asarray([3, 0, 4]), created=7.0)
    counter.inc_many(series, np.asarray([2, 2]))  # 1 each
    assert value(registry, "toks_total", m="a") == 7
    assert value(registry, "toks_total", m="c") == 2  # made by an increment of 0
    assert value(registry, "toks_created", m="c") == 7.0
    assert value(registry, "toks_total", m="b") is None


def test_itl_gaps_never_span_two_requests_or_two_choices() -> None:
    """Two requests under one label set, and one with n = 2, held and binned together at the
    read. Client side (start 0): request 1's events at 100, 105, 405 ms: gaps 5 ms (le=0.005
    of the bounds below) and 300 ms; request 2's at 50, 50.2 ms: gap 0.2 ms; the n = 2
    request's choice 0 at 100, 110 ms and choice 1 at 101, 151 ms: gaps 10 and 50 ms, never
    1 or 41 ms across the choices. The steps from one request's last event to the next one's
    first (405 -> 50 ms) are no gap. 5 gaps in all; sum 365.2 ms."""
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    sink.on_record(record([(100, 1), (105, 1), (405, 1)], n_out=3))
    sink.on_record(record([(50, 1), (50.2, 1)], n_out=2))
    two = record([], n_out=4)
    choices = Timeline(
        start_ns=0,
        offsets_ns=Int64s([100 * MS, 101 * MS, 110 * MS, 151 * MS]),
        tokens=Int64s([1, 1, 1, 1]),
        end_ns=152 * MS,
        choices=Int64s([0, 1, 0, 1]),
    )
    sink.on_record(replace(two, client=choices))
    client = {"model": "m", "replica": "127.0.0.1:8000", "vantage": "client"}
    name = "sidecar_inter_token_latency_seconds"
    assert value(registry, f"{name}_count", **client) == 5
    assert value(registry, f"{name}_sum", **client) == pytest.approx(0.3652)
    bounds = np.asarray(sink.latency_buckets)
    for gap_s, below in ((0.0002, 1), (0.005, 2), (0.010, 3), (0.050, 4), (0.300, 5)):
        le = _go_float(float(bounds[np.searchsorted(bounds, gap_s)]))
        assert value(registry, f"{name}_bucket", le=le, **client) == below, gap_s


def test_held_records_are_binned_once_enough_wait_without_a_read() -> None:
    """Records wait for a read, but never more than HOLD_RECORDS of them (nor HOLD_EVENTS
    token events): memory stays bounded on a sidecar nobody scrapes."""
    sink = PrometheusSink(CollectorRegistry())
    one = record([(100, 1)], n_out=1)
    for _ in range(sink.HOLD_RECORDS - 1):
        sink.on_record(one)
    assert len(sink._held) == sink.HOLD_RECORDS - 1 and not sink.ttft._counts
    sink.on_record(one)  # reaches HOLD_RECORDS: binned now
    assert len(sink._held) == 0
    labels = ("m", "127.0.0.1:8000", "client")
    assert sum(sink.ttft._counts[labels]) == sink.HOLD_RECORDS
    long = record([(100 + i, 1) for i in range(sink.HOLD_EVENTS // 4)], n_out=sink.HOLD_EVENTS)
    sink.on_record(long)  # client and server: half of HOLD_EVENTS
    assert sink._held.events == sink.HOLD_EVENTS // 2
    sink.on_record(long)
    assert len(sink._held) == 0 and sum(sink.ttft._counts[labels]) == sink.HOLD_RECORDS + 2


def test_a_batch_that_cannot_be_held_is_dropped_and_counted_and_the_next_one_binned() -> None:
    """A record the columns cannot hold (N_out past int64: none reaches the sink from the wire,
    whose usage counts stop at 2**53) leaves the batch it joined with columns of unequal
    length: the batch is dropped and its records counted (`dropped_error`, exposed as
    sidecar_sink_records_dropped_total{reason="error"}); the record still counts in
    sidecar_requests_total, and later records are binned as usual."""
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    fanout = SinkFanout([sink])
    registry.register(LiveCollector(WindowSink(), fanout, None, lambda: []))
    for _ in range(2):
        fanout.on_record(record([(120, 1), (150, 1)], n_out=2))
    fanout.on_record(record([(120, 1)], n_out=2**70))  # raises inside; the fan-out counts it
    fanout.on_record(record([(300, 1)], n_out=1))
    assert sink.counters() == {"taken": 4, "dropped_error": 3}
    client = {"model": "m", "replica": "127.0.0.1:8000", "vantage": "client"}
    assert value(registry, "sidecar_time_to_first_token_seconds_count", **client) == 1
    assert value(registry, "sidecar_time_to_first_token_seconds_sum", **client) == 0.3
    ok = {"model": "m", "replica": "127.0.0.1:8000", "endpoint": "chat", "outcome": "ok"}
    assert value(registry, "sidecar_requests_total", **ok) == 4
    assert (
        value(registry, "sidecar_sink_records_dropped_total", sink="prometheus", reason="error")
        == 3
    )
    assert value(registry, "sidecar_sink_errors_total", sink="prometheus") == 1


def _reference_metrics(
    records: list[RequestRecord], policy: stats.SLOPolicy, bounds: dict[str, list[float]]
) -> tuple[dict[str, dict[tuple[str, ...], tuple[list[int], float]]], dict[str, dict[Any, float]]]:
    """What the sink's histograms and counters must hold after ``records``, written record by
    record from the per-request definitions (`stats.request_latency`, `stats.itl_ns`,
    `SLOPolicy.verdict`), as the sink once observed them, each histogram's values bisected
    into its ``bounds``. Labels uncapped."""
    observed: dict[str, dict[tuple[str, ...], list[float]]] = {}
    counted: dict[str, dict[Any, float]] = {}

    def observe(metric: str, labels: tuple[str, ...], v: float) -> None:
        observed.setdefault(metric, {}).setdefault(labels, []).append(v)

    def count(metric: str, labels: tuple[str, ...], amount: float = 1) -> None:
        series = counted.setdefault(metric, {})
        series[labels] = series.get(labels, 0) + amount

    for r in records:
        if r.endpoint not in ("chat", "completions"):
            continue
        model, replica = r.model or "unknown", r.replica or "unknown"
        name, good, excluded = policy.verdict(r)
        if excluded is not None:
            count("slo_excluded", (name, excluded))
        else:
            count("slo_requests", (name,))
        if good:
            count("slo_good", (name,))
            count("slo_good_tokens", (name,), stats.output_tokens(r, r.client))
        if not r.ok:
            continue
        if r.request_read_ns is not None:
            observe("request_read", (model,), r.request_read_ns / 1e9)
        for vantage in (Vantage.CLIENT, Vantage.SERVER):
            timeline = r.timeline(vantage)
            if timeline is None:
                continue
            latency = stats.request_latency(r, vantage)
            assert latency is not None
            labels = (model, replica, vantage.value)
            for metric, v in (
                ("ttft", latency.ttft_s),
                ("e2e", latency.e2e_s),
                ("tpot", latency.tpot_s),
            ):
                if v is not None:
                    observe(metric, labels, v)
            if latency.tpot_s is None and vantage is Vantage.CLIENT and latency.n_out <= 1:
                count("no_tpot", (model,))
            for gap in stats.itl_ns(timeline):
                observe("itl", labels, gap / 1e9)
        for delay in stats.relay_delays_ns(r) or ():
            observe("relay_delay", (model, replica), delay / 1e9)
        engine = r.engine
        if engine is not None:
            labels = (model, replica, "engine")
            for metric, ms in (
                ("ttft", engine.ttft_ms),
                ("e2e", engine.e2e_ms),
                ("tpot", engine.mean_itl_ms),
            ):
                if ms is not None:
                    observe(metric, labels, ms / 1000)
            if engine.queue_time_ms is not None:
                observe("engine_queue", (model, replica), engine.queue_time_ms / 1000)
        if r.n_in is not None:
            count("prompt_tokens", (model, replica), r.n_in)
            observe("prompt_len", (model,), r.n_in)
        n_out = stats.output_tokens(r, r.server or r.client)
        count("generation_tokens", (model, replica), n_out)
        observe("output_len", (model,), n_out)
        if r.n_cached:
            count("cached_tokens", (model, replica), r.n_cached)
        if r.token_source is not TokenSource.USAGE:
            count("estimated", (model,))
    histograms: dict[str, dict[tuple[str, ...], tuple[list[int], float]]] = {}
    for metric, by_labels in observed.items():
        metric_bounds = list(bounds[metric])
        histograms[metric] = {}
        for series, values in by_labels.items():
            counts = [0] * (len(metric_bounds) + 1)
            for v in values:
                counts[bisect.bisect_left(metric_bounds, v)] += 1
            histograms[metric][series] = (counts, sum(values))
    return histograms, counted


@pytest.mark.parametrize("seed", range(6))
def test_binned_in_bulk_equals_the_per_request_definitions(seed: int) -> None:
    """Random records (failures, missing server sides, no token event, n > 1, unknown N_out,
    partial engine timings, other endpoints, estimated counts, several models and replicas),
    held and binned in batches of every size: every series holds what observing the
    definitions record by record gives, bucket counts exactly, sums to float rounding."""
    rng = random.Random(seed)
    records = [
        replace(
            r,
            model=rng.choice(["m1", "m2", None]),
            replica=rng.choice(["10.0.0.1:8000", "10.0.0.2:8000", None]),
            http_status=200,
            n_cached=rng.choice([None, 0, rng.randint(1, 64)]),
            token_source=rng.choice(list(TokenSource)),
        )
        for r in random_records(seed, 400)
    ]
    policy = stats.SLOPolicy(
        {
            "a": stats.SLO(ttft_s=0.5, tpot_s=0.02, exclude=frozenset({"client_error"})),
            "b": stats.SLO(e2e_s=1.0),
            "default": stats.SLO(ttft_s=0.3, tpot_s=0.01, e2e_s=0.9),
        }
    )
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, policy)
    at = 0
    while at < len(records):  # batches of 1 .. 80 records, each binned as a scrape would
        size = rng.randint(1, 80)
        for r in records[at : at + size]:
            sink.on_record(r)
        sink.bin_held()
        at += size
    bounds = {
        metric: getattr(sink, metric).bounds.tolist()
        for metric in (
            "ttft",
            "e2e",
            "tpot",
            "itl",
            "engine_queue",
            "relay_delay",
            "request_read",
            "prompt_len",
            "output_len",
        )
    }
    histograms, counted = _reference_metrics(records, policy, bounds)
    assert set(histograms) == set(bounds)  # the records reach every histogram
    for metric, expected in histograms.items():
        histogram = getattr(sink, metric)
        assert set(histogram._counts) == set(expected), metric
        for labels, (counts, total) in expected.items():
            assert histogram._counts[labels] == counts, (metric, labels)
            assert histogram._sums[labels] == pytest.approx(total, rel=1e-9, abs=1e-12)
    for metric, expected_counts in counted.items():
        counter = getattr(sink, metric)
        for labels, amount in expected_counts.items():
            assert counter.value(labels) == amount, (metric, labels)
    # The SLO series exist from the start; the others only once something was counted.
    for metric in ("no_tpot", "prompt_tokens", "generation_tokens", "cached_tokens", "estimated"):
        assert set(getattr(sink, metric)._values) == set(counted.get(metric, {})), metric


@pytest.mark.parametrize(
    ("layout", "count", "low", "high", "ratio"),
    [
        ("schema3", 188, 9.413e-05, 1024.0, 1.0912),  # the default
        ("schema4", 374, 9.83e-05, 1024.0, 1.0451),
        ("e6", 43, 0.0001, 1000.0, 1.5),
    ],
)
def test_buckets_span_sub_millisecond_to_minutes(
    layout: str, count: int, low: float, high: float, ratio: float
) -> None:
    """Neighbouring bounds at most ``ratio`` apart, 100 µs .. 1000 s covered: the quantile's
    error bound (tests/test_sinks_prometheus.py's real-Prometheus test, histogram_accuracy.py)."""
    buckets = latency_buckets(layout=layout)
    assert len(buckets) == count and buckets[0] == low and buckets[-1] == high
    assert buckets[0] <= 1e-4 and buckets[-1] >= 1e3
    ratios = np.array(buckets[1:]) / np.array(buckets[:-1])
    assert ratios.max() <= ratio + 1e-9 and ratios.min() > 1
    with_thresholds = latency_buckets([0.05, 0.25, 0.25], layout=layout)
    assert with_thresholds.count(0.05) == 1 and with_thresholds.count(0.25) == 1
    assert set(buckets) <= set(with_thresholds)


def test_the_layouts_by_name() -> None:
    assert latency_buckets() == latency_buckets(layout="schema3")
    assert latency_buckets(layout="e6") == e6_buckets()
    # Native histogram bounds of schema 3: powers of two are exact, the rest 4 digits.
    assert log_linear_buckets(3)[:2] == (9.413e-05, 0.0001026)
    assert {0.5, 1.0, 2.0, 0.25} <= set(log_linear_buckets(3))
    assert set(log_linear_buckets(3)[1:]) <= set(log_linear_buckets(4))  # every other one
    sink = PrometheusSink(CollectorRegistry(), histogram_buckets="e6")
    assert sink.latency_buckets == e6_buckets()
    with pytest.raises(ValueError, match="schema3, schema4, e6"):
        PrometheusSink(CollectorRegistry(), histogram_buckets="e12")


@pytest.mark.parametrize(
    ("buckets", "named"),
    [
        ([0.001, 0.1, 0.01, 1.0], "0.01 after 0.1"),
        ([0.5, 0.5, 1.0], "0.5 after 0.5"),  # a repeated bound would be a repeated le series
        ([2.0, 1.0, 0.5], "1 after 2, 0.5 after 1"),
    ],
)
def test_unsorted_buckets_are_refused_and_named_never_sorted(
    buckets: list[float], named: str
) -> None:
    with pytest.raises(ValueError, match=f"strictly increasing: {named}$"):
        BulkHistogram("h", "doc", ("v",), buckets, CollectorRegistry())
    with pytest.raises(ValueError, match="finite"):
        BulkHistogram("h", "doc", ("v",), [0.1, float("inf")], CollectorRegistry())
    with pytest.raises(ValueError, match="at least one"):
        BulkHistogram("h", "doc", ("v",), [], CollectorRegistry())


def test_the_prometheus_sink_lifecycle() -> None:
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    assert isinstance(sink, Sink)
    fanout = SinkFanout([sink])
    fanout.on_record(record([(120, 1), (150, 1)], n_out=2))
    assert sink.counters() == {"taken": 1, "dropped_error": 0}
    assert sink.flush(0) is True
    assert fanout.close() == []
    sink.close()  # idempotent
    # The series stay readable after close (a last scrape while the process stops).
    assert (
        value(
            registry,
            "sidecar_requests_total",
            model="m",
            replica="127.0.0.1:8000",
            endpoint="chat",
            outcome="ok",
        )
        == 1
    )


def test_sink_health_comes_from_each_sinks_counters() -> None:
    """sidecar_sink_* are read from the sinks' `counters()` (hooks.Sink), by reason."""
    gate = threading.Event()
    entered = threading.Event()

    class Slow:
        name = "slow"

        def on_record(self, _record: RequestRecord) -> None:
            entered.set()
            assert gate.wait(10)

    class Broken:
        name = "broken"

        def on_record(self, _record: RequestRecord) -> None:
            raise RuntimeError("broken on purpose")

        def flush(self, timeout_s: float = SINK_TIMEOUT_S) -> bool:
            return True

        def close(self, timeout_s: float = SINK_TIMEOUT_S) -> None:
            return None

        def counters(self) -> dict[str, int]:
            return {}

    registry = CollectorRegistry()
    window = WindowSink()
    slow = ThreadedSink(Slow(), queue_size=1)
    fanout = SinkFanout([window, PrometheusSink(registry), slow, Broken()])
    registry.register(LiveCollector(window, fanout, None, lambda: []))
    fanout.on_record(record([(120, 1)], n_out=1))
    assert entered.wait(5)  # the slow sink's thread holds the first record
    for _ in range(3):  # one more fits its queue, two are dropped
        fanout.on_record(record([(120, 1)], n_out=1))
    assert value(registry, "sidecar_sink_records_taken_total", sink="window") == 4
    assert value(registry, "sidecar_sink_records_taken_total", sink="slow") == 4
    assert (
        value(registry, "sidecar_sink_records_dropped_total", sink="slow", reason="queue_full") == 2
    )
    assert value(registry, "sidecar_sink_records_dropped_total", sink="slow", reason="error") == 0
    assert value(registry, "sidecar_sink_errors_total", sink="broken") == 4
    assert value(registry, "sidecar_sink_errors_total", sink="window") == 0
    gate.set()
    assert fanout.close(10) == []
    assert value(registry, "sidecar_sink_records_written_total", sink="slow") == 2
    assert value(registry, "sidecar_sink_records_written_total", sink="window") is None


@pytest.mark.realparts
def test_promtool_accepts_the_exposition() -> None:
    promtool = require_binary("promtool")
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, stats.SLOPolicy({"default": stats.SLO(ttft_s=0.5)}))
    sink.on_record(record([(120, 1), (150, 1)], n_out=2))
    done = subprocess.run(
        [promtool, "check", "metrics"],
        input=generate_latest(registry),
        capture_output=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == b"" and done.stderr.strip() == b""


@pytest.fixture
def prometheus_for(tmp_path: Path) -> Iterator[Any]:
    """``start(target)``: a real Prometheus scraping ``target`` every second."""
    with ExitStack() as stack_:

        def start(target: str) -> Prometheus:
            config = (
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                "scrape_configs:\n  - job_name: sidecar\n    metrics_path: /metrics\n"
                f"    static_configs:\n      - targets: ['{target}']\n"
            )
            return stack_.enter_context(running_prometheus(config, tmp_path))

        yield start


def bucket_bounds(estimate: float, bounds: tuple[float, ...]) -> tuple[float, float]:
    upper_index = int(np.searchsorted(bounds, estimate, side="left"))
    lower = bounds[upper_index - 1] if upper_index > 0 else 0.0
    return lower, bounds[upper_index]


@pytest.mark.slow
@pytest.mark.realparts
async def test_real_prometheus_quantiles_and_goodput_agree_with_the_records(
    prometheus_for: Any,
) -> None:
    # Prompt lengths vary widely, so prefill (and TTFT) does too: the SLO splits the requests.
    sim = SimConfig(
        model="m",
        engine=EngineConfig(step_floor_s=0.002, saturation_tokens=64, per_token_s=0.00002),
    )
    async with stack(sim=sim, slo="ttft=25ms,tpot=5ms") as s:
        host_port = s.server.admin_url.split("://")[1]
        prom = await asyncio.to_thread(prometheus_for, host_port)
        rng = random.Random(7)
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> None:
                words = " ".join("w" for _ in range(rng.randint(5, 2500)))
                body = {
                    "model": "m",
                    "stream": True,
                    "max_tokens": rng.randint(1, 40),
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": words}],
                }
                async with session.post(s.url + "/v1/chat/completions", json=body) as response:
                    await response.read()

            for batch in range(6):
                await asyncio.gather(*(one(batch * 10 + i) for i in range(10)))
        records = await s.records.wait_for(60)

        async def scraped_all() -> None:
            for _ in range(200):
                total = await asyncio.to_thread(
                    prom.scalar, 'sum(sidecar_slo_requests_total{slo_class="default"})'
                )
                if total == 60:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError("Prometheus never saw all 60 requests")

        await scraped_all()
        bounds = s.server.proxy.fanout.sinks[1].latency_buckets  # type: ignore[attr-defined]
        for metric, vantage, series in (
            ("sidecar_time_to_first_token_seconds", "client", "ttft"),
            ("sidecar_inter_token_latency_seconds", "server", "itl"),
            ("sidecar_e2e_request_latency_seconds", "client", "e2e"),
            ("sidecar_time_per_output_token_seconds", "server", "tpot"),
        ):
            samples: list[float] = []
            for r in records:
                m = stats.request_metrics(r, Vantage(vantage))
                assert m is not None
                if series == "itl":
                    samples.extend(m.itl_s)
                else:
                    value_ = getattr(m, f"{series}_s")
                    if value_ is not None:
                        samples.append(value_)
            for q in (0.5, 0.9, 0.99):
                estimate = await asyncio.to_thread(
                    prom.scalar,
                    f"histogram_quantile({q}, sum by (le) "
                    f'({metric}_bucket{{vantage="{vantage}"}}))',
                )
                assert estimate is not None
                exact = float(np.percentile(samples, q * 100))
                lower, upper = bucket_bounds(estimate, bounds)
                # "Within the bucket resolution": Prometheus interpolates inside the bucket
                # holding rank q*n; numpy interpolates between the two samples around rank
                # q*(n-1). Those two samples must reach into the estimate's bucket. (Comparing
                # `exact` to the bucket alone fails honestly on small samples whose top two
                # values lie far apart.)
                ordered = sorted(samples)
                rank = q * (len(ordered) - 1)
                low_sample = ordered[int(np.floor(rank))]
                high_sample = ordered[int(np.ceil(rank))]
                assert low_sample <= upper * 1.000001 and high_sample >= lower * 0.999999, (
                    metric,
                    q,
                    estimate,
                    exact,
                    (lower, upper),
                    (low_sample, high_sample),
                )
                assert min(lower, low_sample) <= exact <= max(upper, high_sample)

        # Goodput: a hand count from the records (TTFT <= 25 ms and, with N_out > 1,
        # TPOT <= 5 ms, client vantage), against the counter Prometheus scraped.
        good = 0
        for r in records:
            first = r.client.marks[0].offset_ns
            last = r.client.marks[-1].offset_ns
            n_out = r.n_out or 0
            tpot_ok = n_out <= 1 or (last - first) / (n_out - 1) <= 5 * MS
            good += r.outcome is Outcome.OK and first <= 25 * MS and tpot_ok
        assert 0 < good < 60  # the SLO really splits this load
        scraped_good = await asyncio.to_thread(
            prom.scalar, 'sum(sidecar_slo_good_requests_total{slo_class="default"})'
        )
        assert scraped_good == good
        assert (
            await asyncio.to_thread(prom.scalar, 'sidecar_slo_threshold_seconds{metric="ttft"}')
            == 0.025
        )


ROOT = Path(__file__).resolve().parents[1]
LATENCY_DASHBOARD = ROOT / "grafana" / "dashboards" / "sidecar-latency.json"


def dashboard_percentiles() -> dict[tuple[str, str, str], str]:
    """(metric, vantage, p50|p90|p99) -> the Latency dashboard's query for it."""
    board = json.loads(LATENCY_DASHBOARD.read_text())
    found = {}
    for panel in board["panels"] + [p for row in board["panels"] for p in row.get("panels", [])]:
        match = re.fullmatch(
            r"(TTFT|ITL|TPOT|E2E) (client|server) side: p50, p90, p99", panel["title"]
        )
        if match is None:
            continue
        for target in panel.get("targets", []):
            if target["legendFormat"] in ("p50", "p90", "p99"):
                found[(match.group(1).lower(), match.group(2), target["legendFormat"])] = target[
                    "expr"
                ]
    assert len(found) == 4 * 2 * 3, sorted(found)
    return found


def emulated_histogram_quantile() -> Any:
    """benchmarks/histogram_accuracy.py's model of Prometheus's histogram_quantile."""
    spec = importlib.util.spec_from_file_location(
        "histogram_accuracy", ROOT / "benchmarks" / "histogram_accuracy.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.histogram_quantile


def scraped(prometheus: Prometheus, selector: str) -> list[tuple[float, float]]:
    """Every (timestamp, value) Prometheus holds for one series over the last 5 minutes."""
    return [
        (float(t), float(v))
        for series in prometheus.query(f"{selector}[5m]")
        for t, v in series["values"]
    ]


@pytest.mark.slow
@pytest.mark.realparts
async def test_dashboard_percentiles_are_within_10_percent_of_the_exact_ones(
    prometheus_for: Any,
) -> None:
    """Issue #15 item 3, end to end: the Latency dashboard's own p50/p90/p99 queries (TTFT, ITL,
    TPOT, E2E, client and server side), evaluated by a real Prometheus scraping the proxy,
    against the exact percentiles (numpy, `sidecar.stats`) of the requests' records.

    The load: simulated replica with batching and chunked prefill (a step grows with its
    tokens), prompts of 1 .. 4000 words and outputs of 2 .. 120 tokens (lognormal), 16 streams
    at a time. The rate window is the one that holds exactly the load: from a scrape after a
    warm-up (which made every series exist) to the first scrape that saw the whole load, the
    query evaluated at that scrape. There `rate()` extrapolates nothing, so its buckets are
    the load's counts over a constant, as over any window of a steady long-running series;
    the estimates also equal benchmarks/histogram_accuracy.py's model of histogram_quantile
    for the sink's bounds. With the default layout (2**(1/8) apart) the bound is 9.2 %."""
    sim = SimConfig(
        model="m",
        engine=EngineConfig(step_floor_s=0.003, saturation_tokens=64, per_token_s=0.00002),
    )
    warm, requests, concurrency = 2, 400, 16
    async with stack(sim=sim) as s:
        prom = await asyncio.to_thread(prometheus_for, s.server.admin_url.split("://")[1])
        rng = random.Random(15)
        gate = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession() as session:

            async def one(n_in: int, n_out: int) -> None:
                body = {
                    "model": "m",
                    "stream": True,
                    "max_tokens": n_out,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": "w " * n_in}],
                }
                async with (
                    gate,
                    session.post(s.url + "/v1/chat/completions", json=body) as response,
                ):
                    assert response.status == 200
                    await response.read()

            await asyncio.gather(*(one(4, 3) for _ in range(warm)))
            await s.records.wait_for(warm)
            count = 'sidecar_time_to_first_token_seconds_count{vantage="client"}'

            async def first_scrape_with(total: int) -> float:
                for _ in range(300):
                    seen = await asyncio.to_thread(scraped, prom, count)
                    at = [t for t, v in seen if v == total]
                    if at:
                        return at[0]
                    await asyncio.sleep(0.1)
                raise AssertionError(f"Prometheus never saw {total} requests: {seen}")

            start = await first_scrape_with(warm)
            await asyncio.gather(
                *(
                    one(
                        min(4000, max(1, int(rng.lognormvariate(5.5, 1.0)))),
                        min(120, max(2, int(rng.lognormvariate(3.0, 0.7)))),
                    )
                    for _ in range(requests)
                )
            )
        records = (await s.records.wait_for(warm + requests, 60))[warm:]
        end = await first_scrape_with(warm + requests)
        assert all(r.outcome is Outcome.OK for r in records)
        bounds = s.server.proxy.fanout.sinks[1].latency_buckets  # type: ignore[attr-defined]

    histogram_quantile = emulated_histogram_quantile()
    window = f"{round((end - start) * 1000)}ms"
    errors = {}
    for (metric, vantage, label), expr in dashboard_percentiles().items():
        values: list[float] = []
        for r in records:
            m = stats.request_metrics(r, Vantage(vantage))
            assert m is not None
            if metric == "itl":
                values.extend(m.itl_s)
            elif (one_value := getattr(m, f"{metric}_s")) is not None:
                values.append(one_value)
        q = float(label[1:]) / 100
        exact = float(np.percentile(values, q * 100))
        query = re.sub(
            r"\$\{?(\w+)\}?",
            lambda match: window if match.group(1) == "__rate_interval" else ".*",
            expr,
        )
        result = await asyncio.to_thread(prom.get, "/api/v1/query", query=query, time=f"{end:.3f}")
        (sample,) = result["result"]
        estimate = float(sample["value"][1])
        ordered = np.sort(values)
        cumulative = np.append(np.searchsorted(ordered, bounds, side="right"), len(ordered))
        assert estimate == pytest.approx(
            histogram_quantile(q, np.array(bounds), cumulative), rel=1e-9
        ), (metric, vantage, label)
        errors[(metric, vantage, label)] = estimate / exact - 1
    worst = max(errors.items(), key=lambda item: abs(item[1]))
    assert abs(worst[1]) < 0.10, (worst, errors)


@pytest.mark.realparts
async def test_promtool_accepts_the_whole_admin_exposition(tmp_path: Path) -> None:
    """Everything /metrics serves (sinks, live gauges, capture, process), after real traffic."""
    promtool = require_binary("promtool")
    async with (
        stack(slo="ttft=1s", capture_dir=str(tmp_path / "cap")) as s,
        aiohttp.ClientSession() as session,
    ):
        body = {
            "model": "m",
            "stream": True,
            "max_tokens": 3,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        for _ in range(3):
            async with session.post(s.url + "/v1/chat/completions", json=body) as response:
                await response.read()
        await s.records.wait_for(3)
        async with session.get(s.server.admin_url + "/metrics") as response:
            exposition = await response.read()
    for name in (
        b"sidecar_window_latency_seconds",
        b"sidecar_in_flight_requests",
        b"sidecar_capture_records_written_total",
        b"process_resident_memory_bytes",
    ):
        assert name in exposition
    # Window values are gauges: a summary's _count/_sum slid with the window, and rate() read
    # every record leaving it as a counter reset.
    assert b"# TYPE sidecar_window_latency_seconds gauge" in exposition
    assert b"sidecar_window_latency_seconds_count" not in exposition
    assert b'sidecar_window_latency_samples{metric="ttft",vantage="client"} 3.0' in exposition
    done = subprocess.run(
        [promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == b"" and done.stderr.strip() == b""


# What Prometheus 2.x sends (scrape.go's acceptHeader): OpenMetrics first, then the classic text.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


async def test_metrics_negotiates_openmetrics_or_the_classic_text() -> None:
    """/metrics is prometheus_client's own exposition in the format asked for, on the real
    admin socket; closing the server closes every sink through the fan-out."""
    config = build_config(
        {
            "upstreams": ["http://127.0.0.1:9"],
            "listen": "127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "health_interval": "0",
        },
        {},
    )
    server, _window = build_proxy_server(config)

    class Keep:
        name = "keep"

        def on_record(self, _record: RequestRecord) -> None:
            return None

    # A sink with a thread, as the OTel one is wired (no exporter needed here).
    threaded = ThreadedSink(Keep())
    server.proxy.fanout.add(threaded)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:

            async def scrape(accept: str | None) -> tuple[str, bytes]:
                headers = {"Accept": accept} if accept is not None else {}
                async with session.get(server.admin_url + "/metrics", headers=headers) as response:
                    assert response.status == 200
                    return response.headers["Content-Type"], await response.read()

            for accept in ("application/openmetrics-text", PROMETHEUS_ACCEPT):
                content_type, body = await scrape(accept)
                assert content_type.startswith("application/openmetrics-text"), accept
                assert body.endswith(b"# EOF\n")
                assert b"# TYPE sidecar_requests counter" in body
            for plain_accept in (None, "*/*", "text/plain"):
                content_type, body = await scrape(plain_accept)
                assert content_type.startswith("text/plain; version=0.0.4"), plain_accept
                assert b"# EOF" not in body
                assert b"# TYPE sidecar_requests_total counter" in body
    finally:
        await server.close()
    fanout = server.proxy.fanout
    assert fanout.closed and fanout.close_failures == []
    assert not threaded._thread.is_alive()  # closed through the fan-out: its thread joined
