"""Metric math exactly as docs/metrics.md defines it. Pure: no I/O, no clock, no globals.

Per request (one vantage at a time), each defined once, in its function's docstring and in
docs/metrics.md section 4: TTFT (`ttft_ns`), ITL (`itl_ns`: the sample unit is the *event*),
token-normalised ITL (`token_normalised_itl`, a derived view), E2E (`e2e_ns`), TPOT (`tpot_ns`;
with n > 1 `sequence_tpot_ns`), N_out (`output_tokens`) and when the request ended
(`end_offset_ns`). `request_samples` computes them for many requests at once: every aggregate
(`vantage_report`, the replay and llm-d reports) reads them from there. Across the two
vantages, the proxy's own delay per token event (`relay_delays_ns`; in bulk `relay_delays`).

Aggregation: TTFT, TPOT and E2E percentiles are over requests, ITL percentiles over events of
all successful requests. Percentiles use numpy's default linear interpolation between closest
ranks (the same as vLLM's bench), std is the population standard deviation (ddof=0).
Goodput and SLO attainment count every request that arrived in their denominator, failures
included (`goodput_of`, the one place a goodput rate is computed). Durations come out in
seconds (float); records hold integer nanoseconds.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from sidecar.record import (
    OUTCOME_CLIENT_CANCELLED,
    OUTCOME_HTTP_ERROR,
    OUTCOME_REJECTED,
    VANTAGE_CLIENT,
    VANTAGE_SERVER,
    Outcome,
    RequestRecord,
    Timeline,
    Vantage,
)

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
    """TTFT: the first token-carrying event - the vantage's start (t_arrive for the client,
    t_up_send for the server side); None without a token event."""
    if not timeline.offsets_ns:
        return None
    return timeline.offsets_ns[0] - timeline.start_ns


def sequences(timeline: Timeline) -> list[tuple[list[int], list[int]]]:
    """The timeline's token sequences as (offsets, tokens) pairs: one for n = 1; with n > 1
    one per choice, by choice index (ITL and TPOT are per sequence)."""
    if timeline.choices is None:
        return [(timeline.offsets_ns.tolist(), timeline.tokens.tolist())]
    by_choice: dict[int, tuple[list[int], list[int]]] = {}
    for offset, tokens, choice in zip(
        timeline.offsets_ns, timeline.tokens, timeline.choices, strict=True
    ):
        offsets_of, tokens_of = by_choice.setdefault(choice, ([], []))
        offsets_of.append(offset)
        tokens_of.append(tokens)
    return [by_choice[choice] for choice in sorted(by_choice)]


def itl_ns(timeline: Timeline) -> list[int]:
    """Gaps between consecutive token events of one sequence (of one choice, with n > 1)."""
    if timeline.choices is None:
        offsets = timeline.offsets_ns
        return [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    return [
        b - a
        for offsets, _ in sequences(timeline)
        for a, b in zip(offsets, offsets[1:], strict=False)
    ]


def _itl_tokens(timeline: Timeline) -> tuple[int, ...]:
    """The tokens of the later event of each `itl_ns` gap, in the same order."""
    if timeline.choices is None:
        return tuple(timeline.tokens[1:])
    return tuple(t for _, tokens in sequences(timeline) for t in tokens[1:])


def sequence_tpot_ns(timeline: Timeline) -> float | None:
    """TPOT with n > 1: the decode time of every choice over its tokens after the first,
    sum(last_i - first_i) / sum(N_i - 1) over the choices with N_i > 1 (N_i: the tokens of
    choice i's events). With equal choices it is each choice's own TPOT; choices are never
    mixed into one sequence (that gave TPOT / n)."""
    decode = steps = 0
    for offsets, tokens in sequences(timeline):
        n = sum(tokens)
        if n > 1:
            decode += offsets[-1] - offsets[0]
            steps += n - 1
    return decode / steps if steps else None


def e2e_ns(timeline: Timeline) -> int | None:
    """E2E: the last token-carrying event - the vantage's start; the stream's end when no
    event carried a token; None when that side never ended."""
    if timeline.offsets_ns:
        return timeline.offsets_ns[-1] - timeline.start_ns
    if timeline.end_ns is None:
        return None
    return timeline.end_ns - timeline.start_ns


def tpot_ns(ttft: int | None, e2e: int | None, n_out: int) -> float | None:
    """TPOT = (E2E - TTFT) / (N_out - 1) in ns; None (excluded, and counted by the reports)
    when N_out <= 1 or either instant is missing. The one statement of TPOT in the code (the
    other is docs/metrics.md section 4); with n > 1, `sequence_tpot_ns`.

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


class RequestLatency(NamedTuple):
    """TTFT, TPOT and E2E of one request (seconds), without the per-event ITL list: what SLO
    judgement and per-request export need, at a fraction of `request_metrics`' cost."""

    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    n_out: int


def timeline_latency(timeline: Timeline, n_out: int) -> RequestLatency:
    """TTFT, TPOT (with n > 1 per sequence) and E2E of one timeline, in seconds."""
    first = ttft_ns(timeline)
    last = e2e_ns(timeline)
    tpot = tpot_ns(first, last, n_out) if timeline.choices is None else sequence_tpot_ns(timeline)
    return RequestLatency(
        ttft_s=None if first is None else first / NS_PER_S,
        tpot_s=None if tpot is None else tpot / NS_PER_S,
        e2e_s=None if last is None else last / NS_PER_S,
        n_out=n_out,
    )


def timeline_metrics(timeline: Timeline, n_out: int) -> RequestMetrics:
    latency = timeline_latency(timeline, n_out)
    return RequestMetrics(
        ttft_s=latency.ttft_s,
        itl_s=tuple(gap / NS_PER_S for gap in itl_ns(timeline)),
        itl_tokens=_itl_tokens(timeline),
        tpot_s=latency.tpot_s,
        e2e_s=latency.e2e_s,
        n_out=n_out,
    )


def request_metrics(record: RequestRecord, vantage: Vantage) -> RequestMetrics | None:
    """The metrics of one request from the client or server vantage; None if that side was
    never reached (e.g. a request rejected before it was sent upstream has no server side)."""
    timeline = record.timeline(vantage)
    if timeline is None:
        return None
    return timeline_metrics(timeline, output_tokens(record, timeline))


def request_latency(record: RequestRecord, vantage: Vantage) -> RequestLatency | None:
    timeline = record.timeline(vantage)
    if timeline is None:
        return None
    return timeline_latency(timeline, output_tokens(record, timeline))


def itl_seconds(timeline: Timeline) -> npt.NDArray[np.float64]:
    """The ITL gaps of a timeline as a numpy array (seconds), for bulk export."""
    offsets = timeline.offsets_ns
    if len(offsets) < 2:
        return np.empty(0, dtype=np.float64)
    if timeline.choices is not None:
        return np.array(itl_ns(timeline), dtype=np.float64) / NS_PER_S
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


def relay_delays_ns(record: RequestRecord) -> list[int] | None:
    """What the proxy itself took to pass on each token event: t_down_event[i] - t_up_event[i]
    (the client vantage's instant of event i minus the server vantage's, one clock), in the
    order the events came. Defined when the two sides saw the same token events (as many on
    each, at least one: a stream relayed event for event); None otherwise (no server side, an
    answer assembled for a non-streaming client, a client gone mid-stream)."""
    client, server = record.client, record.server
    if server is None:
        return None
    down, up = client.offsets_ns, server.offsets_ns
    if not down or len(down) != len(up):
        return None
    return [d - u for d, u in zip(down, up, strict=True)]


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


# From this many samples up, `percentile_values` selects the order statistics itself.
SELECT_FROM: Final = 65_536


def percentile_values(
    data: npt.NDArray[np.float64], percentiles: Sequence[float]
) -> npt.NDArray[np.float64]:
    """``np.percentile(data, percentiles)`` (method "linear"), value for value, for finite
    float64 ``data``; faster on large samples.

    numpy's percentile partitions the sample once around every order statistic it needs
    (two per percentile); given several, `ndarray.partition` runs a scalar introselect, while
    given one it runs a vectorised quickselect (x86-simd-sort where the CPU has it), so one
    partition per statistic, each of the part above the previous one, is faster
    (`benchmarks/hot_paths.py`: `summarize` of 1M samples 15.8 -> 3.1 ms). The statistics are
    the same values whichever way they are found; they are then interpolated with numpy's own
    operations for the linear method (`_quantile`, `_get_indexes`, `_get_gamma`, `_lerp` in
    numpy/lib/_function_base_impl.py), so the result is bit for bit np.percentile's
    (tests/test_stats.py holds the two equal on random and degenerate samples)."""
    n = data.size
    q = np.true_divide(np.asarray(percentiles, dtype=np.float64), 100)
    if n < SELECT_FROM or q.ndim != 1 or not bool(((q >= 0) & (q <= 1)).all()):
        return np.asarray(np.percentile(data, percentiles), dtype=np.float64)
    virtual = (n - 1) * q
    previous = np.floor(virtual)
    following = previous + 1
    above = virtual >= n - 1
    previous[above] = -1
    following[above] = -1
    previous_at = previous.astype(np.intp)
    following_at = following.astype(np.intp)
    # The order statistics, smallest position first: a partition leaves the values below its
    # position in front of it, so the next one sorts out only the part behind it, and never
    # moves a statistic already in place.
    work = data.copy()
    begin = 0
    for at in sorted({int(i) % n for i in (*previous_at, *following_at)}):
        work[begin:].partition(at - begin)
        begin = at + 1
    lower = work[previous_at]
    upper = work[following_at]
    gamma = np.asarray(virtual - previous_at, dtype=virtual.dtype)
    span = upper - lower
    result: npt.NDArray[np.float64] = np.add(lower, span * gamma)
    np.subtract(upper, span * (1 - gamma), out=result, where=gamma >= 0.5)
    return result


def summarize(
    values: Iterable[float] | npt.NDArray[np.float64], percentiles: Sequence[float] = PERCENTILES
) -> Summary:
    data = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)
    finite = np.isfinite(data)
    if not finite.all():
        data = data[finite]
    if data.size == 0:
        return Summary(count=0)
    qs = percentile_values(data, percentiles)
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


class Columns(NamedTuple):
    """Many requests' timelines from one vantage as numpy columns, for the bulk aggregates.

    Per request (``n`` of them, in order): ``present`` (the request has this vantage's
    timeline; an absent one has ``counts`` 0), ``counts`` (its token events), ``origin``
    (``start_ns``), ``end`` / ``has_end`` (``end_ns``), ``declared`` (``record.n_out``, -1 for
    None). Per token event, request after request: ``offsets`` and ``tokens``. ``multi``: per
    request, it has several choices (n > 1; `Timeline.choices`); ``choices``: the choice of
    each event of those requests only (nothing is kept per event for n = 1)."""

    present: npt.NDArray[np.bool_]
    counts: npt.NDArray[np.int64]
    origin: npt.NDArray[np.int64]
    end: npt.NDArray[np.int64]
    has_end: npt.NDArray[np.bool_]
    declared: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.int64]
    tokens: npt.NDArray[np.int64]
    multi: npt.NDArray[np.bool_]
    choices: npt.NDArray[np.int64]

    def select(self, mask: npt.NDArray[np.bool_]) -> Columns:
        """The requests where ``mask`` is true (their events with them)."""
        if mask.all():
            return self  # the common case (every request kept): no copy of the event columns
        events = np.repeat(mask, self.counts)
        multi_events = np.repeat(mask[self.multi], self.counts[self.multi])
        return Columns(
            self.present[mask],
            self.counts[mask],
            self.origin[mask],
            self.end[mask],
            self.has_end[mask],
            self.declared[mask],
            self.offsets[events],
            self.tokens[events],
            self.multi[mask],
            self.choices[multi_events],
        )


def columns_of(records: Sequence[RequestRecord], vantage: Vantage) -> Columns:
    n = len(records)
    if vantage is VANTAGE_CLIENT:
        timelines: list[Timeline | None] = [r.client for r in records]
    elif vantage is VANTAGE_SERVER:
        timelines = [r.server for r in records]
    else:
        timelines = [None] * n
    present = np.fromiter((t is not None for t in timelines), dtype=np.bool_, count=n)
    offset_data = [b"" if t is None else t.offsets_ns.data for t in timelines]
    counts = np.fromiter(map(len, offset_data), dtype=np.int64, count=n) // 8
    ends = [None if t is None else t.end_ns for t in timelines]
    return Columns(
        present=present,
        counts=counts,
        origin=np.fromiter(
            (0 if t is None else t.start_ns for t in timelines), dtype=np.int64, count=n
        ),
        end=np.fromiter((0 if e is None else e for e in ends), dtype=np.int64, count=n),
        has_end=np.fromiter((e is not None for e in ends), dtype=np.bool_, count=n),
        declared=np.fromiter(
            (-1 if r.n_out is None else r.n_out for r in records), dtype=np.int64, count=n
        ),
        offsets=np.frombuffer(b"".join(offset_data), dtype=np.int64),
        tokens=np.frombuffer(
            b"".join(b"" if t is None else t.tokens.data for t in timelines), dtype=np.int64
        ),
        multi=np.fromiter(
            (t is not None and t.choices is not None for t in timelines), dtype=np.bool_, count=n
        ),
        choices=np.frombuffer(
            b"".join(t.choices.data for t in timelines if t is not None and t.choices is not None),
            dtype=np.int64,
        ),
    )


class _Derived(NamedTuple):
    """`timeline_metrics`' per-request values for the requests of a `Columns` (valid where the
    request is present): same integer arithmetic on the same int64 nanoseconds, so every value
    equals the per-request one exactly (tests/test_stats.py holds them to it)."""

    starts: npt.NDArray[np.int64]  # index of each request's first event in the event columns
    has_events: npt.NDArray[np.bool_]
    ttft_ns: npt.NDArray[np.int64]
    has_e2e: npt.NDArray[np.bool_]
    e2e_ns: npt.NDArray[np.int64]
    n_out: npt.NDArray[np.int64]


def _derive(c: Columns) -> _Derived:
    counts = c.counts
    starts = np.cumsum(counts) - counts
    has_events = counts > 0
    first = starts[has_events]
    last = first + counts[has_events] - 1
    ttft = np.zeros(counts.size, dtype=np.int64)
    ttft[has_events] = c.offsets[first] - c.origin[has_events]
    e2e = c.end - c.origin
    e2e[has_events] = c.offsets[last] - c.origin[has_events]
    # N_out: the upstream's usage when it gave one, else the tokens counted per event.
    counted = np.zeros(counts.size, dtype=np.int64)
    if first.size:
        counted[has_events] = np.add.reduceat(c.tokens, first)
    n_out = np.where(c.declared < 0, counted, c.declared)
    return _Derived(starts, has_events, ttft, c.has_end | has_events, e2e, n_out)


def _multi_sequences(
    c: Columns,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The events of the n > 1 requests ordered by (request, choice, arrival): their indices
    in the event columns, the request of each, and where each choice's sequence begins."""
    multi_events = np.repeat(c.multi, c.counts)
    index = np.flatnonzero(multi_events)
    request = np.repeat(np.arange(c.counts.size), c.counts)[index]
    order = np.lexsort((index, c.choices, request))
    index, request, choice = index[order], request[order], c.choices[order]
    begins = np.ones(index.size, dtype=np.bool_)
    begins[1:] = (request[1:] != request[:-1]) | (choice[1:] != choice[:-1])
    return index, request, begins


class RelayDelays(NamedTuple):
    """`relay_delays_ns` for many requests at once, from their client and server `Columns`
    (the same requests, in the same order). ``paired``: per request, its two sides saw the
    same token events; ``unpaired``: per request, both sides saw token events but not as many
    (none expected of a stream relayed whole). ``delay_ns``: per event of the paired requests,
    request after request; ``counts``: the events of each paired request."""

    paired: npt.NDArray[np.bool_]
    unpaired: npt.NDArray[np.bool_]
    delay_ns: npt.NDArray[np.int64]
    counts: npt.NDArray[np.int64]

    def event_requests(self) -> npt.NDArray[np.int64]:
        """Per value of ``delay_ns``, the index of its request."""
        return np.repeat(np.flatnonzero(self.paired), self.counts)


def relay_delays(client: Columns, server: Columns) -> RelayDelays:
    """The per-request definition, in bulk (tests/test_stats.py holds them equal)."""
    both = client.present & server.present & (client.counts > 0) & (server.counts > 0)
    same = client.counts == server.counts
    paired = both & same
    if np.array_equal(paired, client.counts > 0) and np.array_equal(paired, server.counts > 0):
        # Every event on either side is a paired one (the common case: streams relayed whole
        # beside requests with no events): no copies of the event columns to select them.
        delay = client.offsets - server.offsets
    else:
        delay = (
            client.offsets[np.repeat(paired, client.counts)]
            - server.offsets[np.repeat(paired, server.counts)]
        )
    return RelayDelays(paired, both & ~same, delay, client.counts[paired])


@dataclass(frozen=True, slots=True)
class RelayReport:
    """The proxy's own delay over the successful requests it relayed event for event."""

    requests: int  # requests whose two sides saw the same token events
    unpaired: int  # requests whose two sides both saw token events, but not as many
    delay: Summary  # sample = token event: t_down_event - t_up_event


def relay_report_of(client: Columns, server: Columns) -> RelayReport:
    relay = relay_delays(client, server)
    return RelayReport(
        requests=int(np.count_nonzero(relay.paired)),
        unpaired=int(np.count_nonzero(relay.unpaired)),
        delay=summarize(relay.delay_ns / NS_PER_S),
    )


def _tpot_ns(c: Columns, d: _Derived) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """TPOT per request (ns, as `tpot_ns`: integer difference, one division; with n > 1 as
    `sequence_tpot_ns`) and where it is defined."""
    defined = (d.n_out > 1) & d.has_events
    tpot = np.full(d.n_out.shape, np.nan)
    if c.multi.any():
        defined &= ~c.multi
    tpot[defined] = (d.e2e_ns[defined] - d.ttft_ns[defined]).astype(np.float64) / (
        d.n_out[defined] - 1
    ).astype(np.float64)
    if c.multi.any():
        index, request, begins = _multi_sequences(c)
        first = np.flatnonzero(begins)
        # (No event at all: `last` would be [-1].)
        last = np.append(first[1:], index.size)[: first.size] - 1
        n_seq = np.add.reduceat(c.tokens[index], first)
        decoding = n_seq > 1
        owner = request[first][decoding]
        # Sums of integers below 2**53 are exact in float64: the same value as the per-request
        # integer sums, then the same one division.
        spans = (c.offsets[index[last]] - c.offsets[index[first]])[decoding]
        decode = np.bincount(owner, weights=spans.astype(np.float64), minlength=d.n_out.size)
        steps = np.bincount(
            owner, weights=(n_seq[decoding] - 1).astype(np.float64), minlength=d.n_out.size
        )
        multi_defined = c.multi & (steps > 0)
        tpot[multi_defined] = decode[multi_defined] / steps[multi_defined]
        defined |= multi_defined
    return tpot, defined


@dataclass(frozen=True, slots=True)
class Samples:
    """The per-request metric values of many requests from one vantage, in seconds: the one
    computation every aggregate reads (`vantage_report`, `goodput` judges from the same
    `_derive`, the replay report, the llm-d report). Bulk numpy over `Columns`, equal to
    `timeline_metrics` request by request (tests/test_stats.py holds them to it).

    ``ttft_s``, ``tpot_s``, ``e2e_s`` and ``n_out``: one per request, in input order, NaN where
    the metric is undefined for it; ``itl_s`` and ``itl_tokens``: one per gap, request after
    request (with n > 1, choice after choice); ``itl_counts``: per request, how many of those
    gaps are its own (so `np.repeat` gives each gap its request)."""

    ttft_s: npt.NDArray[np.float64]
    tpot_s: npt.NDArray[np.float64]
    e2e_s: npt.NDArray[np.float64]
    n_out: npt.NDArray[np.int64]
    itl_s: npt.NDArray[np.float64]
    itl_tokens: npt.NDArray[np.int64]
    itl_counts: npt.NDArray[np.int64]
    tpot_excluded: int  # requests with N_out <= 1 (or n > 1 with no choice past one token)
    no_first_token: int  # requests with no token-carrying event on this side

    @property
    def requests(self) -> int:
        return int(self.n_out.size)

    def defined(self, metric: str) -> npt.NDArray[np.float64]:
        """The values of ``metric`` ("ttft", "tpot" or "e2e") where defined, in request
        order."""
        values: npt.NDArray[np.float64] = getattr(self, f"{metric}_s")
        return values[~np.isnan(values)]


def request_samples(records: Iterable[RequestRecord], vantage: Vantage) -> Samples:
    """`Samples` of the successful requests (outcome ok) from one vantage."""
    ok_records = [r for r in records if r.outcome is Outcome.OK]
    columns = columns_of(ok_records, vantage)
    return samples_of(columns.select(columns.present))


def _undefined_nan(
    values_ns: npt.NDArray[Any], known: npt.NDArray[np.bool_]
) -> npt.NDArray[np.float64]:
    out = np.full(known.size, np.nan)
    out[known] = values_ns[known] / NS_PER_S
    return out


def samples_of(c: Columns) -> Samples:
    """`Samples` of the requests in ``c`` (every one present: select them first)."""
    d = _derive(c)
    tpot, defined = _tpot_ns(c, d)
    # ITL: gaps between consecutive events of one request (a request's first event starts a
    # new run), each with the tokens of the later event; with n > 1, of one choice.
    begins = np.zeros(c.offsets.size, dtype=np.bool_)
    begins[d.starts[d.has_events]] = True
    within = ~begins[1:]
    itl_counts = np.where(d.has_events, c.counts - 1, 0)
    if c.multi.any():
        within &= ~np.repeat(c.multi, c.counts)[1:]
        index, request, seq_begins = _multi_sequences(c)
        # One gap fewer than events per sequence (choice).
        sequences = np.bincount(request[seq_begins], minlength=c.counts.size)
        itl_counts[c.multi] = (c.counts - sequences)[c.multi]
        same = ~seq_begins[1:]
        # Request by request, as the per-request definition lists them (sums of floats are
        # exact only in one order).
        owner = np.repeat(np.arange(c.counts.size), c.counts)[1:][within]
        order = np.argsort(np.concatenate((owner, request[1:][same])), kind="stable")
        itl_ns_ = np.concatenate((np.diff(c.offsets)[within], np.diff(c.offsets[index])[same]))[
            order
        ]
        itl_tokens = np.concatenate((c.tokens[1:][within], c.tokens[index][1:][same]))[order]
        itl_s = itl_ns_ / NS_PER_S
    else:
        itl_s = np.diff(c.offsets)[within] / NS_PER_S
        itl_tokens = c.tokens[1:][within]
    return Samples(
        ttft_s=_undefined_nan(d.ttft_ns, d.has_events),
        tpot_s=_undefined_nan(tpot, defined),
        e2e_s=_undefined_nan(d.e2e_ns, d.has_e2e),
        n_out=d.n_out,
        itl_s=itl_s,
        itl_tokens=itl_tokens,
        itl_counts=itl_counts,
        tpot_excluded=int(np.count_nonzero(~defined & (c.multi | (d.n_out <= 1)))),
        no_first_token=int(np.count_nonzero(~d.has_events)),
    )


def vantage_report(records: Iterable[RequestRecord], vantage: Vantage) -> VantageReport:
    """Aggregate latency of the successful requests from one vantage (definitions: module
    docstring), from their `request_samples`."""
    return summary_of(request_samples(records, vantage), vantage)


def report_of(columns: Columns, vantage: Vantage) -> VantageReport:
    """`vantage_report` of the requests in ``columns`` (successful ones only, as selected by
    the caller)."""
    return summary_of(samples_of(columns.select(columns.present)), vantage)


def summary_of(samples: Samples, vantage: Vantage) -> VantageReport:
    """The `VantageReport` of some requests' `Samples`."""
    if not samples.requests:
        empty = Summary(count=0)
        return VantageReport(
            vantage=vantage,
            requests=0,
            ttft=empty,
            tpot=empty,
            e2e=empty,
            itl=empty,
            itl_per_token=empty,
            tpot_excluded=0,
            no_first_token=0,
        )
    itl_s, itl_tokens = samples.itl_s, samples.itl_tokens
    itl = summarize(itl_s)
    if bool((itl_tokens == 1).all()):
        # Every gap's later event carried one token (vLLM streams one token per chunk unless
        # told otherwise): the per-token view is the same samples (each gap / 1, once), so the
        # same summary. Over a full window that is the largest sample summarised twice (a
        # 100,000-record window of 32-token streams: 3.1M gaps per vantage).
        itl_per_token = itl
    else:
        carried = itl_tokens > 0
        itl_per_token = summarize(
            np.repeat(itl_s[carried] / itl_tokens[carried], itl_tokens[carried])
        )
    return VantageReport(
        vantage=vantage,
        requests=samples.requests,
        ttft=summarize(samples.defined("ttft")),
        tpot=summarize(samples.defined("tpot")),
        e2e=summarize(samples.defined("e2e")),
        itl=itl,
        itl_per_token=itl_per_token,
        tpot_excluded=samples.tpot_excluded,
        no_first_token=samples.no_first_token,
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

    @classmethod
    def of(
        cls, interval_s: float, completed: int, n_in: int, n_out: int, estimated: bool
    ) -> Throughput:
        """The rates of ``completed`` requests and their tokens over ``interval_s``."""
        rate = _per_second(interval_s)
        return cls(
            interval_s=interval_s,
            completed_requests=completed,
            requests_per_s=completed * rate,
            input_tokens_per_s=n_in * rate,
            output_tokens_per_s=n_out * rate,
            total_tokens_per_s=(n_in + n_out) * rate,
            output_tokens_estimated=estimated,
        )


def _per_second(interval_s: float) -> float:
    """The factor that turns a count over ``interval_s`` into a rate (0.0: no interval)."""
    return (1.0 / interval_s) if interval_s > 0 else 0.0


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
    return Throughput.of(interval_s, completed, n_in, n_out, estimated)


def end_offset_ns(record: RequestRecord) -> int:
    """When the request ended, in ns after its arrival (t_arrive): the client side's end (its
    last byte written, or the failure: docs/metrics.md section 1), else its last token event,
    else 0 (nothing was stamped). The one definition of a request's end for intervals,
    concurrency and completion rates."""
    client = record.client
    if client.end_ns is not None:
        return client.end_ns
    return client.offsets_ns[-1] if client.offsets_ns else 0


def measured_interval_s(records: Iterable[RequestRecord]) -> float:
    """From the first arrival to the last end (`end_offset_ns`), in seconds (0.0 if empty)."""
    first: int | None = None
    last: int | None = None
    for record in records:
        start = record.wall_time_ns
        end = start + end_offset_ns(record)
        first = start if first is None else min(first, start)
        last = end if last is None else max(last, end)
    if first is None or last is None:
        return 0.0
    return (last - first) / NS_PER_S


# ---------------------------------------------------------------------------------------------
# SLOs and goodput


# Why a request may be left out of an SLO's denominator (`SLO.exclude`), in code order.
SLO_EXCLUSIONS: Final = ("client_error", "client_cancelled")
_EXCLUSION_CODE: Final = {name: code for code, name in enumerate(SLO_EXCLUSIONS, start=1)}
DEFAULT_EXCLUSIONS: Final = frozenset(SLO_EXCLUSIONS)
DEFAULT_OBJECTIVE: Final = 0.99  # the share of counted requests that must be good


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request latency thresholds in seconds (None: not declared), the objective, and
    which requests the objective is about.

    A request is *good* when it succeeded and met every declared threshold. A threshold whose
    metric is undefined for that request (TTFT with no token event, e.g. a non-streaming client;
    TPOT with N_out <= 1) cannot be violated: the request is judged on the others, and reports
    count such requests (`Goodput.judged_without`).

    The denominator follows availability SLOs: requests the client got wrong
    (``client_error``: 4xx other than 408 and 429) and requests the client cancelled before
    its first token (``client_cancelled``) are not service failures. ``exclude`` names the
    reasons left out of this class's denominator (`slo_exclusion`); they are counted apart.
    ``objective``: the share of counted requests that must be good (burn rates divide by
    1 - objective).
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    objective: float = DEFAULT_OBJECTIVE
    exclude: frozenset[str] = DEFAULT_EXCLUSIONS

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise ValueError(f"SLO {name} must be a positive number of seconds, got {value!r}")
        if not (0 < self.objective < 1):
            raise ValueError(
                f"SLO objective must be between 0 and 1 (exclusive), got {self.objective!r}"
            )
        unknown = set(self.exclude) - set(SLO_EXCLUSIONS)
        if unknown:
            raise ValueError(
                f"unknown SLO exclusion {sorted(unknown)}: known are {', '.join(SLO_EXCLUSIONS)}"
            )

    def describe_denominator(self) -> str:
        """The declared denominator, in words, for every report and export."""
        if not self.exclude:
            return "every request, failures included"
        left_out = {
            "client_error": "client errors (4xx but 408 and 429)",
            "client_cancelled": "requests the client cancelled before its first token",
        }
        return "every request, failures included, but " + " and ".join(
            left_out[name] for name in SLO_EXCLUSIONS if name in self.exclude
        )

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


def slo_exclusion(record: RequestRecord) -> str | None:
    """The reason this request is not the service's failure, or None: ``client_error`` for a
    4xx answer (from the upstream or the proxy) other than 408 (the server timed the request
    out) and 429 (the service was out of capacity); ``client_cancelled`` for a client that left
    before its first token. Whether a class leaves it out is `SLO.exclude`'s to say."""
    outcome = record.outcome
    status = record.http_status
    # The members as module constants: read off the class, each is ~850 instructions on
    # CPython 3.11 (record.py says why), and this runs twice per record in a collector.
    if (
        (outcome is OUTCOME_HTTP_ERROR or outcome is OUTCOME_REJECTED)
        and status is not None
        and 400 <= status < 500
        and status not in (408, 429)
    ):
        return "client_error"
    if outcome is OUTCOME_CLIENT_CANCELLED:
        client = record.client
        if client is None or not len(client.offsets_ns):
            return "client_cancelled"
    return None


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
    # The denominator: every request that ended, failures included, but those the class
    # excludes (`SLO.exclude`), which are counted in `excluded` by reason.
    total_requests: int
    good_requests: int
    good_output_tokens: int
    attainment: float | None  # good / total; None when no request arrived
    good_requests_per_s: float
    good_output_tokens_per_s: float
    judged_without: Mapping[str, int]  # threshold name -> good requests judged without it
    excluded: Mapping[str, int] = field(default_factory=dict)  # reason -> requests left out


def goodput(
    records: Iterable[RequestRecord], slo: SLO, interval_s: float, vantage: Vantage = Vantage.CLIENT
) -> Goodput:
    """Good requests (succeeded, every declared threshold met: `slo_verdict`) over all that
    arrived, in bulk with the same values as the per-request definitions."""
    members = list(records)
    ok, reasons = _ok_column(members), _exclusion_column(members)
    return goodput_of(columns_of(members, vantage), ok, slo, interval_s, vantage, reasons)


def _ok_column(members: Sequence[RequestRecord]) -> npt.NDArray[np.bool_]:
    """Per record: did it succeed?"""
    return np.fromiter(
        (r.outcome is Outcome.OK for r in members), dtype=np.bool_, count=len(members)
    )


def _exclusion_column(members: Sequence[RequestRecord]) -> npt.NDArray[np.uint8]:
    """Per record: its `exclusion_code`."""
    return np.fromiter((exclusion_code(r) for r in members), dtype=np.uint8, count=len(members))


def goodput_by_class(
    records: Iterable[RequestRecord],
    policy: SLOPolicy,
    interval_s: float,
    vantage: Vantage = Vantage.CLIENT,
    *,
    exclusions: bool = True,
) -> dict[str, Goodput]:
    """Per declared class of ``policy``, `goodput` of the records of that class
    (`SLOPolicy.class_of`). ``exclusions=False``: every request counts in its class's
    denominator whatever `SLO.exclude` says (replay reports: docs/metrics.md section 8)."""
    members = list(records)
    columns = columns_of(members, vantage)
    ok = _ok_column(members)
    reasons = _exclusion_column(members) if exclusions else None
    names = [policy.class_of(r) for r in members]
    out: dict[str, Goodput] = {}
    for name, slo in policy.classes.items():
        mask = np.fromiter((n == name for n in names), dtype=np.bool_, count=len(names))
        out[name] = goodput_of(
            columns.select(mask),
            ok[mask],
            slo,
            interval_s,
            vantage,
            None if reasons is None else reasons[mask],
        )
    return out


def exclusion_code(record: RequestRecord) -> int:
    """`slo_exclusion` as a small code (0: none), for columns."""
    reason = slo_exclusion(record)
    return 0 if reason is None else _EXCLUSION_CODE[reason]


def goodput_of(
    columns: Columns,
    ok: npt.NDArray[np.bool_],
    slo: SLO,
    interval_s: float,
    vantage: Vantage = Vantage.CLIENT,
    reasons: npt.NDArray[np.uint8] | None = None,
) -> Goodput:
    """`goodput` of the requests in ``columns`` (``ok``: which succeeded; ``reasons``: their
    `exclusion_code`, None: none excluded)."""
    counted = np.ones(columns.counts.size, dtype=np.bool_)
    excluded: dict[str, int] = {}
    if reasons is not None:
        for name in slo.exclude:
            left_out = reasons == _EXCLUSION_CODE[name]
            if np.any(left_out):
                excluded[name] = int(np.count_nonzero(left_out))
                counted &= ~left_out
    total = int(np.count_nonzero(counted))
    good_mask, unjudged, n_out = judge_columns(columns, ok, slo)
    good_mask &= counted  # an excluded request is never good either: it is not counted
    good = int(np.count_nonzero(good_mask))
    good_tokens = int(n_out[good_mask].sum()) if good else 0
    judged_without = {
        name: int(np.count_nonzero(mask & good_mask))
        for name, mask in unjudged.items()
        if np.any(mask & good_mask)
    }
    rate = _per_second(interval_s)
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
        judged_without=judged_without,
        excluded=excluded,
    )


def judge_columns(
    c: Columns, ok: npt.NDArray[np.bool_], slo: SLO
) -> tuple[npt.NDArray[np.bool_], dict[str, npt.NDArray[np.bool_]], npt.NDArray[np.int64]]:
    """Per request: good? (as `slo_verdict` on `request_latency`: a failure, or a request
    without this vantage, is never good), per declared threshold whether it could not be
    judged, and N_out."""
    d = _derive(c)
    tpot, defined = _tpot_ns(c, d)
    values: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]] = {
        "ttft": (d.ttft_ns / NS_PER_S, d.has_events),
        "tpot": (tpot / NS_PER_S, defined),
        "e2e": (d.e2e_ns / NS_PER_S, d.has_e2e),
    }
    good = ok & c.present
    unjudged: dict[str, npt.NDArray[np.bool_]] = {}
    for name, limit in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s), ("e2e", slo.e2e_s)):
        if limit is None:
            continue
        value, known = values[name]
        good = good & ~(known & (value > limit))
        unjudged[name] = ~known
    return good, unjudged, d.n_out


# ---------------------------------------------------------------------------------------------
# The engine's own view


@dataclass(frozen=True, slots=True)
class EngineReport:
    """vLLM's per-request timings as the engine reported them (vantage "engine"), in seconds.

    Kept apart from the client and server views. ``ttft`` and ``e2e`` are the intervals those
    names mean at every vantage, from the request's start (queued in the engine) to its first
    and last token; ``ttft_from_scheduled`` is vLLM's own ``time_to_first_token_ms``, which
    starts after the queue; ``mean_itl`` is vLLM's per-request mean, i.e. TPOT, not a
    per-event ITL sample (record.EngineTiming).
    """

    requests: int  # successful requests that carried engine timings
    queue_time: Summary
    ttft: Summary
    ttft_from_scheduled: Summary
    mean_itl: Summary  # sample = request (vLLM's per-request mean)
    generation_time: Summary
    e2e: Summary


def engine_report(records: Iterable[RequestRecord]) -> EngineReport:
    queue: list[float] = []
    ttft: list[float] = []
    from_scheduled: list[float] = []
    itl: list[float] = []
    generation: list[float] = []
    e2e: list[float] = []
    requests = 0
    for record in records:
        if not record.ok or record.engine is None:
            continue
        requests += 1
        timing = record.engine
        for sink, value_ms in (
            (queue, timing.queue_time_ms),
            (ttft, timing.ttft_ms),
            (from_scheduled, timing.time_to_first_token_ms),
            (itl, timing.mean_itl_ms),
            (generation, timing.generation_time_ms),
            (e2e, timing.e2e_ms),
        ):
            if value_ms is not None:
                sink.append(value_ms / 1000.0)
    return EngineReport(
        requests=requests,
        queue_time=summarize(queue),
        ttft=summarize(ttft),
        ttft_from_scheduled=summarize(from_scheduled),
        mean_itl=summarize(itl),
        generation_time=summarize(generation),
        e2e=summarize(e2e),
    )


# ---------------------------------------------------------------------------------------------
# A growing table of records (the live window's columns)


_OUTCOMES: tuple[Outcome, ...] = tuple(Outcome)
_OUTCOME_CODE = {outcome: code for code, outcome in enumerate(_OUTCOMES)}
_OK_CODE: Final = _OUTCOME_CODE[Outcome.OK]

ENGINE_FIELDS = ("queue_time_ms", "time_to_first_token_ms", "mean_itl_ms", "generation_time_ms")
_ENGINE_INDEX: Final = {name: i for i, name in enumerate(ENGINE_FIELDS)}

# A record's fixed fields are one row of int64s in `RecordTable._rows` (row-major: one
# `struct.pack` and one `frombytes` per record, where a column each cost an `array.append`:
# 56 per record in the collector's two tables by cProfile, its largest cost per record), read
# back as strided numpy columns. The fields, by index: the record's own ...
(_WALL, _END_WALL, _OUTCOME, _EXCLUSION, _GENERATION, _DECLARED, _N_IN, _N_OUT_TOTAL, _EXACT,
 _HAS_ENGINE) = range(10)  # fmt: skip
# ... then, from `_VANTAGE_FIELDS[vantage]` on, each vantage's timeline (`_row_fields`):
_PRESENT, _COUNTS, _ORIGIN, _END, _HAS_END, _MULTI = range(6)
_OWN_FIELDS: Final = _HAS_ENGINE + 1
_TIMELINE_FIELDS: Final = _MULTI + 1
_VANTAGE_FIELDS: Final = {
    Vantage.CLIENT: _OWN_FIELDS,
    Vantage.SERVER: _OWN_FIELDS + _TIMELINE_FIELDS,
}
_ROW_FIELDS: Final = _OWN_FIELDS + 2 * _TIMELINE_FIELDS
_ROW: Final = struct.Struct(f"={_ROW_FIELDS}q")  # native order: array("q")'s
_ENGINE_ROW: Final = struct.Struct(f"={len(ENGINE_FIELDS)}d")
_NO_ENGINE: Final = _ENGINE_ROW.pack(*[math.nan] * len(ENGINE_FIELDS))
_ABSENT: Final = (0,) * _TIMELINE_FIELDS


def _row_fields(timeline: Timeline | None) -> tuple[int, ...]:
    """A vantage's six fields in a record's row: present, counts, origin, end, has_end,
    multi."""
    if timeline is None:
        return _ABSENT
    end = timeline.end_ns
    return (
        1,
        len(timeline.offsets_ns),
        timeline.start_ns,
        0 if end is None else end,
        end is not None,
        timeline.choices is not None,
    )


class _Events:
    """One vantage's token events, record after record (the columns a `Columns` has per
    event)."""

    __slots__ = ("offsets", "tokens", "event_head", "choices", "choice_head")

    def __init__(self) -> None:
        self.offsets = array("q")
        self.tokens = array("q")
        self.event_head = 0  # events of dropped records at the front of offsets/tokens
        self.choices = array("q")  # per event of the records with n > 1 only
        self.choice_head = 0  # ... of dropped records at the front of choices

    def keep(self, timeline: Timeline | None) -> None:
        """Keep ``timeline``'s events (its row's fields are `_row_fields`)."""
        if timeline is None:
            return
        self.offsets.frombytes(timeline.offsets_ns.data)
        self.tokens.frombytes(timeline.tokens.data)
        choices = timeline.choices
        if choices is not None:
            self.choices.frombytes(choices.data)

    def forget(self, counts: npt.NDArray[np.int64], multi: npt.NDArray[np.bool_]) -> None:
        """Move the heads past the events of dropped records (their counts and multi)."""
        self.event_head += int(counts.sum())
        self.choice_head += int(counts[multi].sum())

    def compact(self) -> None:
        del self.offsets[: self.event_head]
        del self.tokens[: self.event_head]
        self.event_head = 0
        del self.choices[: self.choice_head]
        self.choice_head = 0


class RecordTable:
    """The columns of a sequence of records that grows at the end and is dropped from the
    front (the live window). Appending a record is two packed rows and its events' bytes;
    every summary is numpy over the columns, with the definitions of the functions above
    (`report_of`, `goodput_of`): a 100,000-record window is summarised in tens of
    milliseconds."""

    def __init__(self) -> None:
        self._head = 0  # records dropped from the front, still in the arrays until compaction
        self.request_ids: list[str] = []
        self.slo_attribute: list[str | None] = []
        self._rows = array("q")  # _ROW_FIELDS per record
        self._engine_rows = array("d")  # ENGINE_FIELDS per record (NaN: none given)
        self._events = {Vantage.CLIENT: _Events(), Vantage.SERVER: _Events()}
        self._client_events = self._events[Vantage.CLIENT]
        self._server_events = self._events[Vantage.SERVER]

    def __len__(self) -> int:
        return self.stored - self._head

    @property
    def stored(self) -> int:
        """Records in the arrays: the live ones and those dropped but not yet compacted away."""
        return len(self.request_ids)

    def append(self, record: RequestRecord, end_wall_ns: int, generation: bool) -> None:
        """Add ``record`` at the end; a record that does not fit (a count beyond 64 bits)
        raises before anything was added."""
        client, server = record.client, record.server
        engine = record.engine
        n_out = record.n_out
        slo_class = record.attributes.get("slo_class")
        row = _ROW.pack(
            record.wall_time_ns,
            end_wall_ns,
            _OUTCOME_CODE[record.outcome],
            exclusion_code(record),
            generation,
            -1 if n_out is None else n_out,
            record.n_in or 0,
            output_tokens(record, server if server is not None else client),
            record.token_source.total_exact,
            engine is not None,
            *_row_fields(client),
            *_row_fields(server),
        )
        engine_row = (
            _NO_ENGINE
            if engine is None
            else _ENGINE_ROW.pack(
                *[
                    math.nan if (value := getattr(engine, name)) is None else value
                    for name in ENGINE_FIELDS
                ]
            )
        )
        # Nothing below raises: the record's parts go in together.
        self.request_ids.append(record.request_id)
        self.slo_attribute.append(slo_class)
        self._rows.frombytes(row)
        self._engine_rows.frombytes(engine_row)
        self._client_events.keep(client)
        self._server_events.keep(server)

    def drop_front(self, count: int) -> None:
        """Forget the ``count`` oldest records."""
        if count <= 0:
            return
        dropped = self._all_rows()[self._head : self._head + count]
        for vantage, events in self._events.items():
            base = _VANTAGE_FIELDS[vantage]
            events.forget(dropped[:, base + _COUNTS], dropped[:, base + _MULTI] != 0)
        del dropped  # a view of the rows: none may live when the compaction resizes them
        self._head += count
        if self._head >= 4096 and self._head * 2 >= self.stored:
            self._compact()

    def _compact(self) -> None:
        head = self._head
        del self._rows[: head * _ROW_FIELDS]
        del self._engine_rows[: head * len(ENGINE_FIELDS)]
        del self.request_ids[:head]
        del self.slo_attribute[:head]
        for events in self._events.values():
            events.compact()
        self._head = 0

    # -- numpy views of the live records (no copies but of the flags) ---------------------

    def _all_rows(self) -> npt.NDArray[np.int64]:
        return np.frombuffer(self._rows, dtype=np.int64).reshape(-1, _ROW_FIELDS)

    def _field(self, index: int) -> npt.NDArray[np.int64]:
        """Per live record, its row's field ``index`` (a strided view)."""
        return self._all_rows()[self._head :, index]

    @property
    def end_wall_ns(self) -> npt.NDArray[np.int64]:
        return self._field(_END_WALL)

    @property
    def wall_ns(self) -> npt.NDArray[np.int64]:
        return self._field(_WALL)

    @property
    def generation(self) -> npt.NDArray[np.bool_]:
        generation: npt.NDArray[np.bool_] = self._field(_GENERATION) != 0
        return generation

    @property
    def ok(self) -> npt.NDArray[np.bool_]:
        ok: npt.NDArray[np.bool_] = self._field(_OUTCOME) == _OK_CODE
        return ok

    @property
    def n_out_total(self) -> npt.NDArray[np.int64]:
        """Per record: `output_tokens` from the server side if it has one, else the client's."""
        return self._field(_N_OUT_TOTAL)

    def engine_ms(self, name: str) -> npt.NDArray[np.float64]:
        """Per record: the engine's ``name`` field (one of `ENGINE_FIELDS`), NaN where vLLM
        gave none (or the record has no engine timing)."""
        rows = np.frombuffer(self._engine_rows, dtype=np.float64).reshape(-1, len(ENGINE_FIELDS))
        return rows[self._head :, _ENGINE_INDEX[name]]

    def ids(self) -> list[str]:
        return self.request_ids[self._head :]

    def slo_attributes(self) -> list[str | None]:
        return self.slo_attribute[self._head :]

    def columns(self, vantage: Vantage, mask: npt.NDArray[np.bool_]) -> Columns:
        """The `Columns` of the live records where ``mask`` is true, from the client or the
        server vantage (the engine's has no timeline: `engine_report`)."""
        events = self._events[vantage]
        rows = self._all_rows()[self._head :]
        base = _VANTAGE_FIELDS[vantage]
        return Columns(
            present=rows[:, base + _PRESENT] != 0,
            counts=rows[:, base + _COUNTS],
            origin=rows[:, base + _ORIGIN],
            end=rows[:, base + _END],
            has_end=rows[:, base + _HAS_END] != 0,
            declared=rows[:, _DECLARED],
            offsets=np.frombuffer(events.offsets, dtype=np.int64)[events.event_head :],
            tokens=np.frombuffer(events.tokens, dtype=np.int64)[events.event_head :],
            multi=rows[:, base + _MULTI] != 0,
            choices=np.frombuffer(events.choices, dtype=np.int64)[events.choice_head :],
        ).select(mask)

    # -- the aggregates, over the live records where ``mask`` is true -----------------------

    def outcome_counts(self, mask: npt.NDArray[np.bool_]) -> dict[Outcome, int]:
        codes = np.bincount(self._field(_OUTCOME)[mask], minlength=len(_OUTCOMES))
        return {outcome: int(codes[i]) for i, outcome in enumerate(_OUTCOMES)}

    def measured_interval_s(self, mask: npt.NDArray[np.bool_]) -> float:
        """As `measured_interval_s`: first arrival to last client-side end."""
        if not np.any(mask):
            return 0.0
        return int(self.end_wall_ns[mask].max() - self.wall_ns[mask].min()) / NS_PER_S

    def vantage_report(self, mask: npt.NDArray[np.bool_], vantage: Vantage) -> VantageReport:
        return report_of(self.columns(vantage, mask & self.ok), vantage)

    def relay_report(self, mask: npt.NDArray[np.bool_]) -> RelayReport:
        done = mask & self.ok
        return relay_report_of(
            self.columns(VANTAGE_CLIENT, done), self.columns(VANTAGE_SERVER, done)
        )

    def throughput(self, mask: npt.NDArray[np.bool_], interval_s: float) -> Throughput:
        done = mask & self.ok
        completed = int(np.count_nonzero(done))
        n_in = int(self._field(_N_IN)[done].sum())
        n_out = int(self._field(_N_OUT_TOTAL)[done].sum())
        estimated = bool(np.any(self._field(_EXACT)[done] == 0))
        return Throughput.of(interval_s, completed, n_in, n_out, estimated)

    def engine_report(self, mask: npt.NDArray[np.bool_]) -> EngineReport:
        done = mask & self.ok
        values = {name: self.engine_ms(name)[done] for name in ENGINE_FIELDS}
        # NaN (a field vLLM left out) propagates, and summarize drops it: a request missing
        # one part of an interval has no value for it (as EngineTiming.ttft_ms says).
        # (Summed in ms, then scaled, as EngineTiming does: the same floats as record by record.)
        ttft_ms = values["queue_time_ms"] + values["time_to_first_token_ms"]
        return EngineReport(
            requests=int(np.count_nonzero(self._field(_HAS_ENGINE)[done])),
            queue_time=summarize(values["queue_time_ms"] / 1000.0),
            ttft=summarize(ttft_ms / 1000.0),
            ttft_from_scheduled=summarize(values["time_to_first_token_ms"] / 1000.0),
            mean_itl=summarize(values["mean_itl_ms"] / 1000.0),
            generation_time=summarize(values["generation_time_ms"] / 1000.0),
            e2e=summarize((ttft_ms + values["generation_time_ms"]) / 1000.0),
        )

    def classes(self, policy: SLOPolicy) -> list[str]:
        known = policy.classes
        default = policy.default_class
        return [a if a is not None and a in known else default for a in self.slo_attributes()]

    def goodput(
        self,
        mask: npt.NDArray[np.bool_],
        policy: SLOPolicy,
        interval_s: float,
        vantage: Vantage = Vantage.CLIENT,
    ) -> dict[str, Goodput]:
        """Per declared class, `goodput` over the class's live records where ``mask``."""
        names = np.asarray(self.classes(policy), dtype=object)
        out: dict[str, Goodput] = {}
        ok = self.ok
        reasons = self._field(_EXCLUSION).astype(np.uint8)
        for name, slo in policy.classes.items():
            members = mask & (names == name) if names.size else mask
            out[name] = goodput_of(
                self.columns(vantage, members),
                ok[members],
                slo,
                interval_s,
                vantage,
                reasons[members],
            )
        return out


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

    def verdict(
        self, record: RequestRecord, vantage: Vantage = Vantage.CLIENT
    ) -> tuple[str, bool, str | None]:
        """(class name, good?, why it is left out of the class's denominator or None). A
        request left out is never good."""
        name = self.class_of(record)
        reason = slo_exclusion(record)
        if reason is not None and reason in self.classes[name].exclude:
            return name, False, reason
        return (*self.judge(record, vantage), None)

    def judge(self, record: RequestRecord, vantage: Vantage = Vantage.CLIENT) -> tuple[str, bool]:
        """(class name, good?) for one request: good = succeeded and met every declared
        threshold of its class, from ``vantage`` (whether it counts at all: `verdict`)."""
        name = self.class_of(record)
        if not record.ok:
            return name, False
        latency = request_latency(record, vantage)
        if latency is None:
            return name, False
        met, _unjudged = slo_verdict(latency, self.classes[name])
        return name, met
