"""``sidecar trace stats``: what load is in a trace?

Duration, request count, arrivals per bin (the bin is chosen from the duration: ~60
bins of a round width), mean and peak rate, burstiness (CV of the inter-arrival times: 1 for
Poisson, 0 for a constant rate), n_in / n_out distributions (p50/p90/p99/max/mean; numpy's
linear percentiles, as `sidecar.stats`), prefix reuse (see `PrefixReuse`), sessions, models,
endpoints and outcomes.

Reads the file once (`TraceReader.lines`; unreadable lines are counted). Memory: t, n_in and
n_out of every request in compact arrays (about 24 bytes a request) for percentiles; prefix
reuse keeps one entry per distinct block (the cache an infinite prefix cache would need).
"""

from __future__ import annotations

import json
import math
import os
from array import array
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar.stats import summarize
from sidecar.tracefile import PrefixBlocks, TraceReader

TARGET_BINS = 60
NICE_BINS_S = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    15.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    900.0,
    1800.0,
    3600.0,
    7200.0,
    10800.0,
    21600.0,
    43200.0,
    86400.0,
    172800.0,
    604800.0,
)


@dataclass(frozen=True, slots=True)
class Distribution:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None
    min: float | None
    total: float

    @classmethod
    def of(cls, values: array[int]) -> Distribution:
        summary = summarize(
            np.frombuffer(values, dtype=np.int64).astype(np.float64) if values else np.empty(0),
            (50.0, 90.0, 99.0),
        )
        return cls(
            count=summary.count,
            mean=summary.mean,
            p50=summary.p(50.0),
            p90=summary.p(90.0),
            p99=summary.p(99.0),
            max=summary.max,
            min=summary.min,
            total=float(sum(values)),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean": self.mean,
            "p50": self.p50,
            "p90": self.p90,
            "p99": self.p99,
            "max": self.max,
            "min": self.min,
            "sum": self.total,
        }


@dataclass(frozen=True, slots=True)
class Arrivals:
    duration_s: float
    first_t: float | None
    last_t: float | None
    mean_rate_rps: float | None  # requests / duration
    bin_s: float
    counts: tuple[int, ...]  # requests per bin, bin i = [first_t + i*bin_s, +bin_s)
    peak_rate_rps: float | None
    peak_bin_start_s: float | None
    interarrival_mean_s: float | None
    interarrival_p50_s: float | None
    burstiness_cv: float | None  # std / mean of the inter-arrival times (1 = Poisson)
    sorted_in_file: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "duration_s": self.duration_s,
            "first_t": self.first_t,
            "last_t": self.last_t,
            "mean_rate_rps": self.mean_rate_rps,
            "bin_s": self.bin_s,
            "counts": list(self.counts),
            "peak_rate_rps": self.peak_rate_rps,
            "peak_bin_start_s": self.peak_bin_start_s,
            "interarrival_mean_s": self.interarrival_mean_s,
            "interarrival_p50_s": self.interarrival_p50_s,
            "burstiness_cv": self.burstiness_cv,
            "sorted_in_file": self.sorted_in_file,
        }


@dataclass(frozen=True, slots=True)
class PrefixReuse:
    """Prefix sharing in file order, as an infinite prefix cache would see it.

    A block is identified by its whole chain (the block and every block before it in its
    prompt), so "block i repeats" means "the first i+1 blocks of this prompt were all seen
    together in an earlier request": exactly a prefix-cache hit. ``hit_ratio_tokens`` =
    sum over requests of min(hit blocks x size, n_in) / sum of n_in (unit "tokens" with n_in
    known): an upper bound on what any real, finite cache could reuse.
    """

    requests_with_prefix: int
    block_sizes: Mapping[str, int]  # "tokens/512" -> requests
    blocks: int
    reused_blocks: int
    block_reuse_fraction: float | None
    hit_ratio_tokens: float | None
    distinct_blocks: int  # blocks an infinite cache ends up holding
    distinct_prompts: int  # distinct whole chains
    distinct_first_blocks: int  # distinct roots (e.g. system prompts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests_with_prefix": self.requests_with_prefix,
            "block_sizes": dict(self.block_sizes),
            "blocks": self.blocks,
            "reused_blocks": self.reused_blocks,
            "block_reuse_fraction": self.block_reuse_fraction,
            "hit_ratio_tokens_infinite_cache": self.hit_ratio_tokens,
            "distinct_blocks": self.distinct_blocks,
            "distinct_prompts": self.distinct_prompts,
            "distinct_first_blocks": self.distinct_first_blocks,
        }


class _PrefixTrie:
    """Chains of block hashes as a trie: a node id stands for a whole prefix."""

    def __init__(self) -> None:
        self.roots: dict[tuple[str, int, int], int] = {}  # (unit, size, first hash) -> node
        self.children: dict[tuple[int, int], int] = {}  # (parent node, hash) -> node
        self.prompts: set[int] = set()  # the last node of each whole chain
        self.blocks = 0
        self.reused = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.requests = 0
        self.sizes: Counter[str] = Counter()

    def _node(self, table: dict[Any, int], key: Any) -> tuple[int, bool]:
        known = table.get(key)
        if known is not None:
            return known, True
        node = table[key] = len(self.roots) + len(self.children)
        return node, False

    def add(self, prefix: PrefixBlocks, n_in: int | None) -> None:
        self.requests += 1
        self.sizes[f"{prefix.unit}/{prefix.size}"] += 1
        node = -1
        hit_blocks = 0
        for position, block in enumerate(prefix.hashes):
            if position == 0:
                node, seen = self._node(self.roots, (prefix.unit, prefix.size, block))
            else:
                node, seen = self._node(self.children, (node, block))
            # A new node has no children yet, so after the first miss every block misses:
            # the hits are always a prefix of the prompt, as in a real prefix cache.
            hit_blocks += seen
        self.blocks += len(prefix.hashes)
        self.reused += hit_blocks
        if node != -1:
            self.prompts.add(node)
        if prefix.unit == "tokens" and n_in is not None and n_in > 0:
            self.prompt_tokens += n_in
            self.hit_tokens += min(hit_blocks * prefix.size, n_in)

    def result(self) -> PrefixReuse | None:
        if not self.requests:
            return None
        return PrefixReuse(
            requests_with_prefix=self.requests,
            block_sizes=dict(sorted(self.sizes.items())),
            blocks=self.blocks,
            reused_blocks=self.reused,
            block_reuse_fraction=self.reused / self.blocks if self.blocks else None,
            hit_ratio_tokens=(self.hit_tokens / self.prompt_tokens if self.prompt_tokens else None),
            distinct_blocks=len(self.children) + len(self.roots),
            distinct_prompts=len(self.prompts),
            distinct_first_blocks=len(self.roots),
        )


@dataclass(frozen=True, slots=True)
class Sessions:
    sessions: int
    requests_with_session: int
    requests_per_session: Distribution

    def to_dict(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "requests_with_session": self.requests_with_session,
            "requests_per_session": self.requests_per_session.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class TraceStats:
    path: str
    source: str
    requests: int
    unreadable_lines: int
    arrivals: Arrivals
    n_in: Distribution
    n_out: Distribution
    prefix: PrefixReuse | None
    sessions: Sessions | None
    models: Mapping[str, int]
    endpoints: Mapping[str, int]
    outcomes: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "source": self.source,
            "requests": self.requests,
            "unreadable_lines": self.unreadable_lines,
            "arrivals": self.arrivals.to_dict(),
            "n_in": self.n_in.to_dict(),
            "n_out": self.n_out.to_dict(),
            "prefix": self.prefix.to_dict() if self.prefix else None,
            "sessions": self.sessions.to_dict() if self.sessions else None,
            "models": dict(self.models),
            "endpoints": dict(self.endpoints),
            "outcomes": dict(self.outcomes),
        }


def choose_bin_s(duration_s: float) -> float:
    """The smallest round bin width that splits the duration in at most ~60 bins."""
    if duration_s <= 0:
        return 1.0
    for width in NICE_BINS_S:
        if duration_s / width <= TARGET_BINS:
            return width
    return math.ceil(duration_s / TARGET_BINS / 86400) * 86400.0


def arrival_stats(times: np.ndarray[Any, np.dtype[np.float64]], sorted_in_file: bool) -> Arrivals:
    if times.size == 0:
        return Arrivals(
            0.0, None, None, None, 1.0, (), None, None, None, None, None, sorted_in_file
        )
    ordered = np.sort(times)
    first, last = float(ordered[0]), float(ordered[-1])
    duration = last - first
    bin_s = choose_bin_s(duration)
    # Bins are counted from the first arrival; the epsilon keeps 0.3/0.1 from landing in bin 2.
    index = np.floor((ordered - first) / bin_s + 1e-9).astype(np.int64)
    counts = np.bincount(index, minlength=int(index[-1]) + 1)
    peak = int(np.argmax(counts))
    gaps = np.diff(ordered)
    gap_mean = float(gaps.mean()) if gaps.size else None
    cv = None
    if gaps.size >= 2 and gap_mean:
        cv = float(gaps.std() / gap_mean)
    return Arrivals(
        duration_s=duration,
        first_t=first,
        last_t=last,
        mean_rate_rps=times.size / duration if duration > 0 else None,
        bin_s=bin_s,
        counts=tuple(int(c) for c in counts),
        peak_rate_rps=float(counts[peak]) / bin_s,
        peak_bin_start_s=first + peak * bin_s,
        interarrival_mean_s=gap_mean,
        interarrival_p50_s=float(np.median(gaps)) if gaps.size else None,
        burstiness_cv=cv,
        sorted_in_file=sorted_in_file,
    )


def trace_stats(path: str | os.PathLike[str]) -> TraceStats:
    reader = TraceReader(path)
    times = array("d")
    n_in_values = array("q")
    n_out_values = array("q")
    trie = _PrefixTrie()
    sessions: Counter[str] = Counter()
    models: Counter[str] = Counter()
    endpoints: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    unreadable = 0
    requests = 0
    latest = -math.inf
    sorted_in_file = True
    for entry in reader.lines():
        request = entry.request
        if request is None:
            unreadable += 1
            continue
        requests += 1
        if math.isfinite(request.t):
            times.append(request.t)
            if request.t < latest:
                sorted_in_file = False
            latest = max(latest, request.t)
        if request.n_in is not None:
            n_in_values.append(request.n_in)
        if request.n_out is not None:
            n_out_values.append(request.n_out)
        if request.prefix is not None and request.prefix.hashes:
            trie.add(request.prefix, request.n_in)
        if request.session_id is not None:
            sessions[request.session_id] += 1
        models[request.model if request.model is not None else "(none)"] += 1
        endpoints[request.endpoint] += 1
        outcomes[request.outcome if request.outcome is not None else "(none)"] += 1
    session_stats = None
    if sessions:
        session_stats = Sessions(
            sessions=len(sessions),
            requests_with_session=sum(sessions.values()),
            requests_per_session=Distribution.of(array("q", sessions.values())),
        )
    return TraceStats(
        path=str(path),
        source=reader.header.source,
        requests=requests,
        unreadable_lines=unreadable,
        arrivals=arrival_stats(np.frombuffer(times, dtype=np.float64), sorted_in_file),
        n_in=Distribution.of(n_in_values),
        n_out=Distribution.of(n_out_values),
        prefix=trie.result(),
        sessions=session_stats,
        models=dict(models.most_common()),
        endpoints=dict(endpoints.most_common()),
        outcomes=dict(outcomes.most_common()),
    )


_SPARK = " .:-=+*#%@"


def sparkline(counts: tuple[int, ...]) -> str:
    """ASCII sparkline of per-bin counts (safe on any terminal encoding)."""
    top = max(counts, default=0)
    if top == 0:
        return ""
    return "".join(_SPARK[0 if c == 0 else 1 + (c * (len(_SPARK) - 2)) // top] for c in counts)


def sparkline_legend(bin_s: float, top: int) -> str:
    """What the sparkline's characters mean, under it."""
    return (
        f"{'legend':<12}one character per {_num(bin_s)} s: ' ' no request, "
        f"{_SPARK[1:]} fewest to most ({_SPARK[-1]} = {top})"
    )


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value)}"
    if abs(value) >= 10**digits:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def _prefix_lines(p: PrefixReuse | None) -> list[str]:
    """The prefix lines of `format_stats`: reuse of blocks, and the hits an infinite cache
    would have."""
    if p is None:
        return ["prefix      no prefix information"]
    reuse = f"{p.block_reuse_fraction:.1%}" if p.block_reuse_fraction is not None else "-"
    hit = f"{p.hit_ratio_tokens:.1%}" if p.hit_ratio_tokens is not None else "-"
    sizes = ", ".join(f"{k} ({v})" for k, v in p.block_sizes.items())
    return [
        f"prefix      {p.requests_with_prefix} requests, blocks {sizes}; "
        f"{p.blocks} blocks, {p.reused_blocks} repeat an earlier prefix ({reuse})",
        f"            infinite-cache hit ratio {hit} of prompt tokens; distinct: "
        f"{p.distinct_blocks} blocks, {p.distinct_prompts} prompts, "
        f"{p.distinct_first_blocks} first blocks",
    ]


def format_stats(stats: TraceStats) -> str:
    a = stats.arrivals
    lines = [
        f"trace       {stats.path}  (source {stats.source})",
        f"requests    {stats.requests}"
        + (
            f"  ({stats.unreadable_lines} unreadable lines skipped)"
            if stats.unreadable_lines
            else ""
        ),
        f"duration    {_num(a.duration_s)} s  (t {_num(a.first_t)} .. {_num(a.last_t)})",
        f"arrivals    mean {_num(a.mean_rate_rps)} req/s, peak {_num(a.peak_rate_rps)} req/s "
        f"(bin of {_num(a.bin_s)} s at t={_num(a.peak_bin_start_s)}), "
        f"burstiness (CV of gaps) {_num(a.burstiness_cv, 3)}",
        f"per {_num(a.bin_s)} s   |{sparkline(a.counts)}|  ({len(a.counts)} bins, max "
        f"{max(a.counts, default=0)} requests)",
    ]
    if a.counts:
        lines.append(sparkline_legend(a.bin_s, max(a.counts)))
    if not a.sorted_in_file:
        lines.append(
            "            (t is not sorted in the file: arrivals use sorted t; prefix "
            "reuse uses file order)"
        )
    lines.append(f"{'':12}{'count':>9}{'mean':>10}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}")
    for name, dist in (("n_in", stats.n_in), ("n_out", stats.n_out)):
        lines.append(
            f"{name:<12}{dist.count:>9}{_num(dist.mean, 5):>10}{_num(dist.p50):>9}"
            f"{_num(dist.p90):>9}{_num(dist.p99):>9}{_num(dist.max):>9}"
        )
    lines += _prefix_lines(stats.prefix)
    s = stats.sessions
    if s is not None:
        r = s.requests_per_session
        lines.append(
            f"sessions    {s.sessions} ({s.requests_with_session} requests); requests "
            f"per session mean {_num(r.mean)}, p50 {_num(r.p50)}, max {_num(r.max)}"
        )
    for name, counts in (
        ("models", stats.models),
        ("endpoints", stats.endpoints),
        ("outcomes", stats.outcomes),
    ):
        shown = ", ".join(f"{k} {v}" for k, v in list(counts.items())[:8])
        more = f", +{len(counts) - 8} more" if len(counts) > 8 else ""
        lines.append(f"{name:<12}{shown}{more}")
    return "\n".join(lines)


def stats_json(stats: TraceStats) -> str:
    return json.dumps(stats.to_dict(), indent=2)
