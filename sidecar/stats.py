"""Metric math exactly as spec/metrics.md defines it. Pure: no I/O, no clock, no globals.

Per request (one vantage at a time):

- TTFT  = first token-carrying event - vantage start (t_arrive for the client, t_up_send for
          the server side).
- ITL   = gaps between consecutive token-carrying events; the sample unit is the *event*, and
          the number of tokens the later event carried is kept beside each gap.
- token-normalised ITL = each gap divided by its event's tokens, repeated once per token
          (a derived view, labelled as such; not the same statistic as ITL).
- E2E   = last token-carrying event - vantage start; the stream's end when no token came.
- TPOT  = (E2E - TTFT) / (N_out - 1); undefined for N_out <= 1 (excluded and counted).

Aggregation: TTFT, TPOT and E2E percentiles are over requests, ITL percentiles over events of
all successful requests. Percentiles use numpy's default linear interpolation between closest
ranks (the same as vLLM's bench), std is the population standard deviation (ddof=0).
Goodput and SLO attainment count every request that arrived in their denominator, failures
included. Durations come out in seconds (float); records hold integer nanoseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from sidecar.record import Outcome, RequestRecord, Timeline, Vantage

NS_PER_S = 1_000_000_000
PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0, 99.9)


# ---------------------------------------------------------------------------------------------
# Per-request metrics


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """One request seen from one vantage. Durations in seconds; None where undefined."""

    ttft_s: float | None
    itl_s: tuple[float, ...]  # one per gap between token-carrying events
    itl_tokens: tuple[int, ...]  # tokens carried by the later event of each gap
    tpot_s: float | None
    e2e_s: float | None
    n_out: int  # output tokens used for TPOT (usage if known, else the sum over events)


def ttft_ns(timeline: Timeline) -> int | None:
    if not timeline.offsets_ns:
        return None
    return timeline.offsets_ns[0] - timeline.start_ns


def itl_ns(timeline: Timeline) -> list[int]:
    offsets = timeline.offsets_ns
    return [b - a for a, b in zip(offsets, offsets[1:], strict=False)]


def e2e_ns(timeline: Timeline) -> int | None:
    if timeline.offsets_ns:
        return timeline.offsets_ns[-1] - timeline.start_ns
    if timeline.end_ns is None:
        return None
    return timeline.end_ns - timeline.start_ns


def tpot_ns(ttft: int | None, e2e: int | None, n_out: int) -> float | None:
    """(E2E - TTFT) / (N_out - 1) in ns; None when N_out <= 1 or either instant is missing.

    Computed on integer nanoseconds, so a request exactly at an SLO threshold is not pushed
    over it by float rounding of two separately converted durations.
    """
    if n_out <= 1 or ttft is None or e2e is None:
        return None
    return (e2e - ttft) / (n_out - 1)


def output_tokens(record: RequestRecord, timeline: Timeline) -> int:
    """N_out: the upstream's usage when it gave one, else the tokens counted per event."""
    if record.n_out is not None:
        return record.n_out
    return sum(timeline.tokens)


def timeline_metrics(timeline: Timeline, n_out: int) -> RequestMetrics:
    first = ttft_ns(timeline)
    last = e2e_ns(timeline)
    tpot = tpot_ns(first, last, n_out)
    return RequestMetrics(
        ttft_s=None if first is None else first / NS_PER_S,
        itl_s=tuple(gap / NS_PER_S for gap in itl_ns(timeline)),
        itl_tokens=tuple(timeline.tokens[1:]),
        tpot_s=None if tpot is None else tpot / NS_PER_S,
        e2e_s=None if last is None else last / NS_PER_S,
        n_out=n_out,
    )


def request_metrics(record: RequestRecord, vantage: Vantage) -> RequestMetrics | None:
    """The metrics of one request from the client or server vantage; None if that side was
    never reached (e.g. a request rejected before it was sent upstream has no server side)."""
    timeline = record.timeline(vantage)
    if timeline is None:
        return None
    return timeline_metrics(timeline, output_tokens(record, timeline))


class RequestLatency(NamedTuple):
    """TTFT, TPOT and E2E of one request (seconds), without the per-event ITL list: what SLO
    judgement and per-request export need, at a fraction of `request_metrics`' cost."""

    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    n_out: int


def request_latency(record: RequestRecord, vantage: Vantage) -> RequestLatency | None:
    timeline = record.timeline(vantage)
    if timeline is None:
        return None
    n_out = output_tokens(record, timeline)
    first = ttft_ns(timeline)
    last = e2e_ns(timeline)
    tpot = tpot_ns(first, last, n_out)
    return RequestLatency(
        ttft_s=None if first is None else first / NS_PER_S,
        tpot_s=None if tpot is None else tpot / NS_PER_S,
        e2e_s=None if last is None else last / NS_PER_S,
        n_out=n_out,
    )


def itl_seconds(timeline: Timeline) -> npt.NDArray[np.float64]:
    """The ITL gaps of a timeline as a numpy array (seconds), for bulk export."""
    offsets = timeline.offsets_ns
    if len(offsets) < 2:
        return np.empty(0, dtype=np.float64)
    gaps = np.diff(np.frombuffer(offsets.data, dtype=np.int64))
    return gaps.astype(np.float64) / NS_PER_S


def token_normalised_itl(itl: Sequence[float], tokens: Sequence[int]) -> list[float]:
    """Each gap divided by the tokens its event carried, repeated once per token.

    An event with 3 tokens after a 30 ms gap gives [10, 10, 10] ms. Events that carried no
    token cannot appear here (marks are token-carrying by construction); a count <= 0 is
    skipped rather than divided by.
    """
    out: list[float] = []
    for gap, n in zip(itl, tokens, strict=True):
        if n > 0:
            out.extend([gap / n] * n)
    return out


# ---------------------------------------------------------------------------------------------
# Summaries


@dataclass(frozen=True, slots=True)
class Summary:
    """count, mean, std, min, max and the default percentiles of one sample. An empty sample
    has count 0 and None everywhere else (never NaN)."""

    count: int
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None
    percentiles: Mapping[float, float] = field(default_factory=dict)

    def p(self, q: float) -> float | None:
        return self.percentiles.get(q)

    def to_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {
            "count": self.count,
            "mean": self.mean,
            "std": self.std,
            "min": self.min,
            "max": self.max,
        }
        for q in PERCENTILES:
            out[percentile_name(q)] = self.percentiles.get(q)
        return out


def percentile_name(q: float) -> str:
    """50 -> 'p50', 99.9 -> 'p99.9'."""
    return f"p{q:g}"


def summarize(values: Iterable[float] | npt.NDArray[np.float64],
              percentiles: Sequence[float] = PERCENTILES) -> Summary:
    data = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)
    data = data[np.isfinite(data)]
    if data.size == 0:
        return Summary(count=0)
    qs = np.percentile(data, percentiles)
    return Summary(
        count=int(data.size),
        mean=float(data.mean()),
        std=float(data.std()),
        min=float(data.min()),
        max=float(data.max()),
        percentiles={float(q): float(v) for q, v in zip(percentiles, qs, strict=True)},
    )


# ---------------------------------------------------------------------------------------------
# Aggregates over many requests


@dataclass(frozen=True, slots=True)
class VantageReport:
    """Aggregate latency of the successful requests seen from one vantage."""

    vantage: Vantage
    requests: int  # successful requests that had this vantage
    ttft: Summary  # sample = request
    tpot: Summary  # sample = request, N_out > 1 only
    e2e: Summary  # sample = request
    itl: Summary  # sample = event gap
    itl_per_token: Summary  # sample = token (token-normalised ITL, a derived view)
    tpot_excluded: int  # successful requests with N_out <= 1 (no TPOT), counted not hidden
    no_first_token: int  # successful requests with no token-carrying event on this side


def vantage_report(records: Iterable[RequestRecord], vantage: Vantage) -> VantageReport:
    ttfts: list[float] = []
    tpots: list[float] = []
    e2es: list[float] = []
    itls: list[float] = []
    itl_tokens: list[int] = []
    requests = tpot_excluded = no_first_token = 0
    for record in records:
        if not record.ok:
            continue
        metrics = request_metrics(record, vantage)
        if metrics is None:
            continue
        requests += 1
        if metrics.ttft_s is None:
            no_first_token += 1
        else:
            ttfts.append(metrics.ttft_s)
        if metrics.e2e_s is not None:
            e2es.append(metrics.e2e_s)
        if metrics.tpot_s is None:
            if metrics.n_out <= 1:
                tpot_excluded += 1
        else:
            tpots.append(metrics.tpot_s)
        itls.extend(metrics.itl_s)
        itl_tokens.extend(metrics.itl_tokens)
    return VantageReport(
        vantage=vantage,
        requests=requests,
        ttft=summarize(ttfts),
        tpot=summarize(tpots),
        e2e=summarize(e2es),
        itl=summarize(itls),
        itl_per_token=summarize(token_normalised_itl(itls, itl_tokens)),
        tpot_excluded=tpot_excluded,
        no_first_token=no_first_token,
    )


def outcome_counts(records: Iterable[RequestRecord]) -> dict[Outcome, int]:
    """Every outcome, zeros included, so a report always shows each line."""
    counts = Counter(record.outcome for record in records)
    return {outcome: counts.get(outcome, 0) for outcome in Outcome}


@dataclass(frozen=True, slots=True)
class Throughput:
    interval_s: float
    completed_requests: int
    requests_per_s: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    output_tokens_estimated: bool  # some completed request's N_out was not from usage


def throughput(records: Iterable[RequestRecord], interval_s: float) -> Throughput:
    """Completed (ok) requests and their tokens per second over ``interval_s``.

    A zero or negative interval gives rates of 0.0 rather than a division error.
    """
    completed = n_in = n_out = 0
    estimated = False
    for record in records:
        if not record.ok:
            continue
        completed += 1
        n_in += record.n_in or 0
        # A non-streaming client has no client-side marks; the server side has them when the
        # proxy streamed from the upstream on its behalf.
        timeline = record.server if record.server is not None else record.client
        n_out += output_tokens(record, timeline)
        if not record.token_source.total_exact:
            estimated = True
    rate = (1.0 / interval_s) if interval_s > 0 else 0.0
    return Throughput(
        interval_s=interval_s,
        completed_requests=completed,
        requests_per_s=completed * rate,
        input_tokens_per_s=n_in * rate,
        output_tokens_per_s=n_out * rate,
        total_tokens_per_s=(n_in + n_out) * rate,
        output_tokens_estimated=estimated,
    )


def measured_interval_s(records: Iterable[RequestRecord]) -> float:
    """From the first arrival to the last end seen by the client, in seconds (0.0 if empty)."""
    first: int | None = None
    last: int | None = None
    for record in records:
        start = record.wall_time_ns
        end_offset = record.client.end_ns
        if end_offset is None and record.client.offsets_ns:
            end_offset = record.client.offsets_ns[-1]
        end = start + (end_offset or 0)
        first = start if first is None else min(first, start)
        last = end if last is None else max(last, end)
    if first is None or last is None:
        return 0.0
    return (last - first) / NS_PER_S


# ---------------------------------------------------------------------------------------------
# SLOs and goodput


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request latency thresholds in seconds; None means not declared.

    A request is *good* when it succeeded and met every declared threshold. A threshold whose
    metric is undefined for that request (TTFT with no token event, e.g. a non-streaming client;
    TPOT with N_out <= 1) cannot be violated: the request is judged on the others, and reports
    count such requests (`Goodput.judged_without`).
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise ValueError(f"SLO {name} must be a positive number of seconds, got {value!r}")

    def describe(self) -> str:
        parts = [
            f"{name}<={value * 1000:g}ms"
            for name, value in (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("e2e", self.e2e_s))
            if value is not None
        ]
        return ", ".join(parts) if parts else "no SLO declared"


class _Latencies(Protocol):
    @property
    def ttft_s(self) -> float | None: ...
    @property
    def tpot_s(self) -> float | None: ...
    @property
    def e2e_s(self) -> float | None: ...


def slo_verdict(metrics: _Latencies, slo: SLO) -> tuple[bool, tuple[str, ...]]:
    """(met, names of declared thresholds that could not be judged) for one request."""
    unjudged: list[str] = []
    met = True
    for name, limit, value in (
        ("ttft", slo.ttft_s, metrics.ttft_s),
        ("tpot", slo.tpot_s, metrics.tpot_s),
        ("e2e", slo.e2e_s, metrics.e2e_s),
    ):
        if limit is None:
            continue
        if value is None:
            unjudged.append(name)
        elif value > limit:
            met = False
    return met, tuple(unjudged)


@dataclass(frozen=True, slots=True)
class Goodput:
    slo: SLO
    vantage: Vantage
    interval_s: float
    total_requests: int  # the denominator: every request that arrived, failures included
    good_requests: int
    good_output_tokens: int
    attainment: float | None  # good / total; None when no request arrived
    good_requests_per_s: float
    good_output_tokens_per_s: float
    judged_without: Mapping[str, int]  # threshold name -> good requests judged without it


def goodput(records: Iterable[RequestRecord], slo: SLO, interval_s: float,
            vantage: Vantage = Vantage.CLIENT) -> Goodput:
    total = good = good_tokens = 0
    judged_without: Counter[str] = Counter()
    for record in records:
        total += 1
        if not record.ok:
            continue
        metrics = request_metrics(record, vantage)
        if metrics is None:
            continue
        met, unjudged = slo_verdict(metrics, slo)
        if met:
            good += 1
            good_tokens += metrics.n_out
            judged_without.update(unjudged)
    rate = (1.0 / interval_s) if interval_s > 0 else 0.0
    return Goodput(
        slo=slo,
        vantage=vantage,
        interval_s=interval_s,
        total_requests=total,
        good_requests=good,
        good_output_tokens=good_tokens,
        attainment=(good / total) if total else None,
        good_requests_per_s=good * rate,
        good_output_tokens_per_s=good_tokens * rate,
        judged_without=dict(judged_without),
    )


# ---------------------------------------------------------------------------------------------
# The engine's own view


@dataclass(frozen=True, slots=True)
class EngineReport:
    """vLLM's per-request timings as the engine reported them (vantage "engine"), in seconds.

    Kept apart from the client and server views: vLLM's TTFT here is measured from scheduling,
    so it excludes queue time, and its ITL is a per-request mean, not a per-event sample.
    """

    requests: int  # successful requests that carried engine timings
    queue_time: Summary
    ttft_from_scheduled: Summary
    mean_itl: Summary  # sample = request (vLLM's per-request mean)
    generation_time: Summary


def engine_report(records: Iterable[RequestRecord]) -> EngineReport:
    queue: list[float] = []
    ttft: list[float] = []
    itl: list[float] = []
    generation: list[float] = []
    requests = 0
    for record in records:
        if not record.ok or record.engine is None:
            continue
        requests += 1
        timing = record.engine
        for sink, value_ms in (
            (queue, timing.queue_time_ms),
            (ttft, timing.time_to_first_token_ms),
            (itl, timing.mean_itl_ms),
            (generation, timing.generation_time_ms),
        ):
            if value_ms is not None:
                sink.append(value_ms / 1000.0)
    return EngineReport(
        requests=requests,
        queue_time=summarize(queue),
        ttft_from_scheduled=summarize(ttft),
        mean_itl=summarize(itl),
        generation_time=summarize(generation),
    )


# ---------------------------------------------------------------------------------------------
# Named SLO classes


DEFAULT_SLO_CLASS = "default"


@dataclass(frozen=True, slots=True)
class SLOPolicy:
    """Named SLO classes; a record's class is ``record.attributes["slo_class"]`` (set by the
    proxy from a header or the model), falling back to ``default_class``."""

    classes: Mapping[str, SLO]
    default_class: str = DEFAULT_SLO_CLASS

    def __post_init__(self) -> None:
        if self.default_class not in self.classes:
            raise ValueError(f"default SLO class {self.default_class!r} is not declared")

    def class_of(self, record: RequestRecord) -> str:
        name = record.attributes.get("slo_class")
        return name if name is not None and name in self.classes else self.default_class

    def judge(self, record: RequestRecord,
              vantage: Vantage = Vantage.CLIENT) -> tuple[str, bool]:
        """(class name, good?) for one request: good = succeeded and met every declared
        threshold of its class, from ``vantage``."""
        name = self.class_of(record)
        if not record.ok:
            return name, False
        latency = request_latency(record, vantage)
        if latency is None:
            return name, False
        met, _unjudged = slo_verdict(latency, self.classes[name])
        return name, met
