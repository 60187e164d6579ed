"""A running replay's own numbers, live, for Prometheus (``sidecar replay --metrics-listen``).

The sidecar in front of the target measures the requests; this measures the sender: how far a
run has got (planned, sent, completed by outcome, in flight) and how late requests leave against
their schedule (open loop). A sender that falls behind its schedule is no longer offering the
load the report will name, so this is what tells, during a long run, whether it still holds.

The counters live in one shared-memory array, so the sender processes of ``--workers N`` add
to the same numbers the parent serves; each update takes the array's lock (5.5 us per request
for its two updates, measured on the 2-core VM of benchmarks/RESULTS.md; nothing per chunk).
"""

from __future__ import annotations

import bisect
import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString as _untyped_float_to_go_string

from sidecar.record import Outcome

# prometheus-client leaves it untyped: the `le` label text of a bucket bound.
_go_float: Callable[[float], str] = _untyped_float_to_go_string

OUTCOMES = tuple(Outcome)
# Send lateness (actual - scheduled): a healthy sender is well under a millisecond; AIPerf calls
# a run degraded past 500 ms of schedule lag at p99.
LATENESS_BOUNDS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# Layout of the shared array.
_PLANNED, _SENT, _RUN = 0, 1, 2
_COMPLETED = 3  # one slot per outcome, in `OUTCOMES` order
_LATE_COUNT = _COMPLETED + len(OUTCOMES)
_LATE_SUM = _LATE_COUNT + 1
_LATE_BUCKETS = _LATE_SUM + 1  # one slot per bound, then +Inf
SIZE = _LATE_BUCKETS + len(LATENESS_BOUNDS_S) + 1
_OUTCOME_SLOT = {outcome: _COMPLETED + i for i, outcome in enumerate(OUTCOMES)}


class ReplayCounters:
    """The replay's counters in a shared array (pass `shared` to sender processes)."""

    def __init__(self, shared: Any | None = None) -> None:
        self.shared = (
            shared if shared is not None else multiprocessing.get_context("spawn").Array("d", SIZE)
        )

    def start_run(self, run: int, planned: int) -> None:
        with self.shared.get_lock():
            self.shared[_RUN] = run
            self.shared[_PLANNED] += planned

    def sent(self, lateness_ns: int | None) -> None:
        """One request left; ``lateness_ns`` (actual - scheduled) in open loop, else None."""
        with self.shared.get_lock():
            self.shared[_SENT] += 1
            if lateness_ns is not None:
                seconds = max(lateness_ns, 0) / 1e9
                self.shared[_LATE_COUNT] += 1
                self.shared[_LATE_SUM] += seconds
                # le semantics: a value equal to a bound is counted in that bound's bucket.
                index = bisect.bisect_left(LATENESS_BOUNDS_S, seconds)
                self.shared[_LATE_BUCKETS + index] += 1

    def completed(self, outcome: Outcome) -> None:
        with self.shared.get_lock():
            self.shared[_OUTCOME_SLOT[outcome]] += 1

    def totals(self) -> tuple[int, int, int]:
        """(sent, finished, failed) over every run so far: what a progress display shows."""
        values = self.snapshot()
        finished = sum(values[_COMPLETED : _COMPLETED + len(OUTCOMES)])
        ok = values[_OUTCOME_SLOT[Outcome.OK]]
        return int(values[_SENT]), int(finished), int(finished - ok)

    def snapshot(self) -> list[float]:
        with self.shared.get_lock():
            return list(self.shared[:])


class ReplayCollector(Collector):
    def __init__(self, counters: ReplayCounters, shard: str) -> None:
        self.counters = counters
        self.shard = shard

    def describe(self) -> Iterable[Metric]:
        return []

    def _per_shard(
        self,
        family: type[CounterMetricFamily] | type[GaugeMetricFamily],
        name: str,
        documentation: str,
        value: float,
    ) -> Metric:
        """One sample, labelled with this sender's shard."""
        metric = family(name, documentation, labels=["shard"])
        metric.add_metric([self.shard], value)
        return metric

    def collect(self) -> Iterator[Metric]:
        values = self.counters.snapshot()
        yield self._per_shard(
            CounterMetricFamily,
            "sidecar_replay_requests_planned",
            "Requests this sender has planned (every run counted; warm-up excluded).",
            values[_PLANNED],
        )
        yield self._per_shard(
            CounterMetricFamily,
            "sidecar_replay_requests_sent",
            "Requests this sender has sent.",
            values[_SENT],
        )
        completed = CounterMetricFamily(
            "sidecar_replay_requests_completed",
            "Requests this sender has finished, by the outcome it saw (client vantage).",
            labels=["shard", "outcome"],
        )
        for outcome in OUTCOMES:
            completed.add_metric([self.shard, outcome.value], values[_OUTCOME_SLOT[outcome]])
        yield completed
        done = sum(values[_COMPLETED : _COMPLETED + len(OUTCOMES)])
        yield self._per_shard(
            GaugeMetricFamily,
            "sidecar_replay_in_flight_requests",
            "Requests sent and not finished yet.",
            values[_SENT] - done,
        )
        yield self._per_shard(
            GaugeMetricFamily,
            "sidecar_replay_run",
            "The run in progress (1 = the first; --repeats runs the trace several times).",
            values[_RUN],
        )
        labels = [self.shard]
        lateness = HistogramMetricFamily(
            "sidecar_replay_send_lateness_seconds",
            "Actual send instant - scheduled one, per open-loop request (0 when early).",
            labels=["shard"],
        )
        buckets = values[_LATE_BUCKETS : _LATE_BUCKETS + len(LATENESS_BOUNDS_S) + 1]
        bounds = [_go_float(b) for b in LATENESS_BOUNDS_S] + ["+Inf"]
        lateness.add_metric(
            labels, list(zip(bounds, accumulate(buckets), strict=True)), values[_LATE_SUM]
        )
        yield lateness


class MetricsServer:
    """/metrics of a replay on its own small HTTP listener."""

    def __init__(self, counters: ReplayCounters, shard: str, host: str, port: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(ReplayCollector(counters, shard))
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(
                body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
            )

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if self.port == 0:  # the port the kernel chose
            server: Any = site._server
            self.port = server.sockets[0].getsockname()[1]
        return f"http://{self.host}:{self.port}/metrics"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
