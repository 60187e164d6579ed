"""How late the proxy's own stamps may be: event-loop lag and garbage-collection pauses.

Every stamp the relay takes (a read's arrival, a write's return) is taken on the event loop,
when the loop gets to the callback. While the loop is stalled (a full collection: ~35 ms with
1,000 streams in flight, ~170 ms with 4,000, rare by `gcpolicy`; a burst of work; a slow sink),
data that arrived meanwhile is stamped when the stall ends: late by what was left of the
stall. A measurement tool must say when that happened. `StallMonitor` measures it, off the
per-chunk path (nothing per read, nothing per request):

- Loop lag, by a probe: a timer due every ``probe_interval_s`` (0.1 s), re-armed each time it
  fires; its lag is when it ran minus when it was due, on ``time.perf_counter_ns`` (the clock
  of the stamps). A timer due at an instant runs late by what is left of a stall covering that
  instant, exactly as a read arriving then is stamped late; the probe's instants fall
  independently of the stalls, so its samples are a sample of the lateness of a stamp taken at
  an arbitrary moment, and the share of samples above x the share of time the loop was more
  than x behind. A stall shorter than the interval is missed unless it covers a due instant
  (the GC histogram sees every collection; the worst stall is the larger of the two maxima).
  Why a probe and not timing every callback: a wrapper around each callback is a cost per
  read, and the loop's own clock (`loop.time()`) is uvloop's libuv time, in whole
  milliseconds; the probe costs one callback per interval. Its floor: libuv timers are
  millisecond timers, so with uvloop an idle loop shows lags up to ~1 ms (a timer can also
  fire up to a millisecond early by perf_counter; that is clamped to 0). Below 1 ms the lag
  buckets say "no stall", not how small.
- GC pauses, every one: ``gc.callbacks`` calls us at the start and the stop of each
  collection; the pause is the time between, per generation (0, 1, 2). A collection runs in
  whichever thread allocated (a sink's thread too), holding the GIL: the loop's thread is
  stalled for its whole length either way. A pause during which a probe was due shows in both
  histograms: the loop lag says how late, the GC pause says why.

Both are kept as histograms of fixed bounds (`BOUNDS_S`, in seconds: stamp lateness that
matters next to inter-token gaps of 5 to 100 ms), with a sum and the largest value seen.
Cumulative counts, never reset: a worker's snapshot goes to the collector in its status every
0.25 s and replaces the previous one, the collector adds up its incarnations (a restarted
worker starts from 0 again) and the workers (collector.py, `counters` / `from_counters`), and
Prometheus derives rates from counters that only grow.

The snapshot (`snapshot()`, JSON as it travels in a status) is the contract with the export
(sinks/prometheus.py `stall_metrics`, which may not import this module)::

    {"bounds_s": [0.0005, ..., 2.5],
     "loop_lag": {"counts": [n per bucket, the last over the top bound], "sum_ns": int,
                  "max_ns": int},
     "gc_pause": {"0": {...}, "1": {...}, "2": {...}}}

``counts`` are per bucket, not cumulative (bucket i holds values in (bound[i-1], bound[i]]).
"""

from __future__ import annotations

import asyncio
import gc
import time
from bisect import bisect_left
from collections.abc import Mapping
from typing import Any, Final, TypedDict

# Upper bounds of the buckets, seconds (+Inf implied): 0.5 ms (noise, below uvloop's timer
# granularity) to 2.5 s (the process is in trouble), dense around 5-50 ms, where a stall is
# the size of an inter-token gap.
BOUNDS_S: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
BOUNDS_NS: Final = tuple(round(bound * 1e9) for bound in BOUNDS_S)
N_BUCKETS: Final = len(BOUNDS_S) + 1
PROBE_INTERVAL_S: Final = 0.1
GC_GENERATIONS: Final = (0, 1, 2)
LOOP_LAG: Final = "loop_lag"
GC_PAUSE: Final = "gc_pause"
NS_PER_S: Final = 1_000_000_000


class HistogramSnapshot(TypedDict):
    counts: list[int]  # per bucket (not cumulative); the last one is over BOUNDS_S[-1]
    sum_ns: int
    max_ns: int


class StallSnapshot(TypedDict):
    bounds_s: list[float]
    loop_lag: HistogramSnapshot
    gc_pause: dict[str, HistogramSnapshot]  # by generation, "0" .. "2" (JSON keys)


class StallHistogram:
    """Counts per bucket of `BOUNDS_S`, the sum and the largest value, in integer ns."""

    __slots__ = ("counts", "sum_ns", "max_ns")

    def __init__(self) -> None:
        self.counts = [0] * N_BUCKETS
        self.sum_ns = 0
        self.max_ns = 0

    def observe(self, ns: int) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le is <=).
        self.counts[bisect_left(BOUNDS_NS, ns)] += 1
        self.sum_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns

    def snapshot(self) -> HistogramSnapshot:
        # The list is copied in one step (under the GIL): a snapshot taken while a collection
        # is being counted in another thread may lack that one, never holds half of it.
        return {"counts": list(self.counts), "sum_ns": self.sum_ns, "max_ns": self.max_ns}


class StallMonitor:
    """Loop lag and GC pauses of the process whose loop installed it (see the module)."""

    def __init__(self, probe_interval_s: float = PROBE_INTERVAL_S) -> None:
        if probe_interval_s <= 0:
            raise ValueError(f"the probe interval must be positive: {probe_interval_s}")
        self.probe_interval_s = probe_interval_s
        self._interval_ns = round(probe_interval_s * NS_PER_S)
        self.loop_lag = StallHistogram()
        self.gc_pause = {generation: StallHistogram() for generation in GC_GENERATIONS}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._due_ns = 0
        self._gc_started_ns: int | None = None

    @property
    def installed(self) -> bool:
        return self._loop is not None

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start measuring: the GC callback, and the probe on ``loop`` (the running one by
        default). Installing an installed monitor does nothing."""
        if self._loop is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        gc.callbacks.append(self._on_gc)
        self._arm()

    def clear(self) -> None:
        """Forget what was counted so far (start-up's own deliberate collection, which stalled
        no traffic: `gcpolicy.settle`)."""
        self.loop_lag = StallHistogram()
        self.gc_pause = {generation: StallHistogram() for generation in GC_GENERATIONS}

    def uninstall(self) -> None:
        """Stop measuring; the counts stay (a final status still reports them)."""
        if self._loop is None:
            return
        self._loop = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # Our own bound method only: the list is the process's, shared with other callbacks.
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._gc_started_ns = None

    def _arm(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        self._due_ns = time.perf_counter_ns() + self._interval_ns
        self._timer = loop.call_later(self.probe_interval_s, self._probe)

    def _probe(self) -> None:
        # Clamped: a libuv timer may fire up to a millisecond early by perf_counter.
        self.loop_lag.observe(max(0, time.perf_counter_ns() - self._due_ns))
        self._arm()

    def _on_gc(self, phase: str, info: Mapping[str, Any]) -> None:
        now = time.perf_counter_ns()
        if phase == "start":
            self._gc_started_ns = now
        elif phase == "stop" and self._gc_started_ns is not None:
            generation = min(max(int(info.get("generation", 2)), 0), GC_GENERATIONS[-1])
            self.gc_pause[generation].observe(now - self._gc_started_ns)
            self._gc_started_ns = None

    def snapshot(self) -> StallSnapshot:
        """Cumulative counts since the monitor was made, JSON-able (the module's format)."""
        return {
            "bounds_s": list(BOUNDS_S),
            LOOP_LAG: self.loop_lag.snapshot(),
            GC_PAUSE: {str(g): h.snapshot() for g, h in self.gc_pause.items()},
        }


# -- summing snapshots (the collector) -----------------------------------------------------------
#
# The collector sums a worker's status counters over its incarnations and over the workers in
# flat `Counter`s (collector.py `_STATUS_COUNTERS`); a snapshot joins them as flat counters
# too. Counts and sums add up; a maximum is the largest (`is_maximum` says which keys).

_PREFIX: Final = "stalls:"
_MAX_SUFFIX: Final = ":max_ns"


def _histograms(snapshot: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    found: list[tuple[str, Mapping[str, Any]]] = []
    lag = snapshot.get(LOOP_LAG)
    if isinstance(lag, Mapping):
        found.append((LOOP_LAG, lag))
    pauses = snapshot.get(GC_PAUSE)
    if isinstance(pauses, Mapping):
        found.extend(
            (f"{GC_PAUSE}{generation}", h)
            for generation, h in pauses.items()
            if isinstance(h, Mapping)
        )
    return found


def counters(snapshot: Mapping[str, Any] | None) -> dict[str, int]:
    """A snapshot as flat counters (``stalls:<kind>:<bucket>``, ``:sum_ns``, ``:max_ns``)."""
    out: dict[str, int] = {}
    if not snapshot:
        return out
    for kind, h in _histograms(snapshot):
        for i, count in enumerate(list(h.get("counts", ()))[:N_BUCKETS]):
            out[f"{_PREFIX}{kind}:{i}"] = int(count)
        out[f"{_PREFIX}{kind}:sum_ns"] = int(h.get("sum_ns", 0))
        out[f"{_PREFIX}{kind}{_MAX_SUFFIX}"] = int(h.get("max_ns", 0))
    return out


def is_maximum(key: str) -> bool:
    """Whether the flat counter ``key`` is a maximum (merged by max, not summed)."""
    return key.startswith(_PREFIX) and key.endswith(_MAX_SUFFIX)


def from_counters(counts: Mapping[str, int]) -> StallSnapshot:
    """The snapshot that flat counters (summed by the collector) stand for."""

    def histogram(kind: str) -> HistogramSnapshot:
        return {
            "counts": [int(counts.get(f"{_PREFIX}{kind}:{i}", 0)) for i in range(N_BUCKETS)],
            "sum_ns": int(counts.get(f"{_PREFIX}{kind}:sum_ns", 0)),
            "max_ns": int(counts.get(f"{_PREFIX}{kind}{_MAX_SUFFIX}", 0)),
        }

    return {
        "bounds_s": list(BOUNDS_S),
        LOOP_LAG: histogram(LOOP_LAG),
        GC_PAUSE: {str(g): histogram(f"{GC_PAUSE}{g}") for g in GC_GENERATIONS},
    }


def summary(snapshot: StallSnapshot) -> dict[str, Any]:
    """What /workers shows: per kind, how many samples, their sum and the largest (seconds)."""

    def brief(h: HistogramSnapshot) -> dict[str, Any]:
        return {
            "count": sum(h["counts"]),
            "sum_s": h["sum_ns"] / NS_PER_S,
            "max_s": h["max_ns"] / NS_PER_S,
        }

    return {
        LOOP_LAG: brief(snapshot[LOOP_LAG]),
        GC_PAUSE: {g: brief(h) for g, h in snapshot[GC_PAUSE].items()},
    }
