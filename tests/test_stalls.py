"""The proxy's own stalls (sidecar/proxy/stalls.py): loop lag and GC pauses, how late a stamp
may be. Hand-worked on a monitor of the test's loop (uvloop, as in production); then through
real sockets in one process and through a real worker process and its collector, read back
from /metrics as Prometheus parses it and from /workers."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.config import build_config
from sidecar.proxy import stalls
from sidecar.proxy.collector import Collector, _merge
from sidecar.proxy.stalls import BOUNDS_S, N_BUCKETS, StallHistogram, StallMonitor
from sidecar.serve import build_collector, build_proxy_server
from sidecar.sinks.prometheus import StallCollector

MS = 1_000_000  # ns


def bucket_of(seconds: float) -> int:
    """The index of the bucket whose upper bound is ``seconds``."""
    return BOUNDS_S.index(seconds)


def busy_wait(seconds: float) -> None:
    """Hold the loop without a blocking call (time.sleep on the loop fails the test)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)


# -- hand-worked ------------------------------------------------------------------------------


def test_a_value_on_a_bound_is_in_that_bucket_and_the_rest_above() -> None:
    h = StallHistogram()
    for ns in (0, 20 * MS, 20 * MS + 1, 2_500 * MS, 3_000 * MS):
        h.observe(ns)
    counts = h.snapshot()["counts"]
    assert len(counts) == N_BUCKETS == len(BOUNDS_S) + 1
    assert counts[0] == 1  # 0 ns: le=0.0005
    assert counts[bucket_of(0.02)] == 1  # exactly 20 ms: le=0.02
    assert counts[bucket_of(0.05)] == 1  # 1 ns more: le=0.05
    assert counts[bucket_of(2.5)] == 1 and counts[-1] == 1  # 2.5 s on the bound; 3 s: +Inf
    assert h.sum_ns == 20 * MS + 20 * MS + 1 + 2_500 * MS + 3_000 * MS
    assert h.max_ns == 3_000 * MS


async def test_a_30_ms_stall_is_one_lag_sample_in_the_50_ms_bucket() -> None:
    # The probe is due 10 ms after install; the loop is held 40 ms from install: the probe
    # runs ~30 ms late, once. Its next one is due 10 ms after that; we stop before, unless
    # this process lost its core for that long (the suite's other processes on a 2-core
    # host): then that next one is a sample too, and no later than the stall's.
    monitor = StallMonitor(probe_interval_s=0.01)
    monitor.install()
    try:
        busy_wait(0.040)
        await until(lambda: sum(monitor.loop_lag.counts) > 0)
    finally:
        monitor.uninstall()
    lag = monitor.snapshot()["loop_lag"]
    assert lag["counts"][bucket_of(0.05)] >= 1, lag  # in (0.02, 0.05], not le=0.01 or 0.02
    assert sum(lag["counts"][bucket_of(0.05) + 1 :]) == 0, lag
    assert 28 * MS <= lag["max_ns"] <= 50 * MS
    assert sum(lag["counts"]) in (1, 2), lag
    if sum(lag["counts"]) == 1:
        assert lag["counts"][bucket_of(0.05)] == 1 and lag["sum_ns"] == lag["max_ns"]


async def test_an_idle_loop_lags_about_nothing() -> None:
    monitor = StallMonitor(probe_interval_s=0.01)
    monitor.install()
    try:
        await until(lambda: sum(monitor.loop_lag.counts) >= 5)
    finally:
        monitor.uninstall()
    counts = monitor.loop_lag.counts
    # uvloop's timers are millisecond timers: an idle loop is late by under a few ms.
    assert sum(counts[: bucket_of(0.005) + 1]) >= sum(counts) - 1, counts


async def test_gc_collect_is_a_generation_2_pause() -> None:
    monitor = StallMonitor()
    monitor.install()
    try:
        gc.collect()
    finally:
        monitor.uninstall()
    pauses = monitor.snapshot()["gc_pause"]
    assert sum(pauses["2"]["counts"]) == 1
    assert 0 < pauses["2"]["max_ns"] == pauses["2"]["sum_ns"]
    assert set(pauses) == {"0", "1", "2"}


async def test_uninstall_leaves_gc_callbacks_as_they_were_and_stops_the_probe() -> None:
    before = list(gc.callbacks)
    monitor = StallMonitor(probe_interval_s=0.01)
    monitor.install()
    monitor.install()  # a second install does nothing
    assert len(gc.callbacks) == len(before) + 1
    monitor.uninstall()
    monitor.uninstall()
    assert gc.callbacks == before
    gc.collect()
    await asyncio.sleep(0.03)  # three probe intervals
    snapshot = monitor.snapshot()
    assert sum(snapshot["loop_lag"]["counts"]) == 0
    assert all(sum(h["counts"]) == 0 for h in snapshot["gc_pause"].values())


def test_snapshots_sum_over_incarnations_and_the_maximum_is_the_largest() -> None:
    first, second = StallHistogram(), StallHistogram()
    first.observe(30 * MS)
    second.observe(4 * MS)
    second.observe(40 * MS)
    monitor_a, monitor_b = StallMonitor(), StallMonitor()
    monitor_a.loop_lag, monitor_b.loop_lag = first, second
    monitor_b.gc_pause[2].observe(60 * MS)
    totals: Counter[str] = Counter()
    # As the collector adds a retired incarnation's counters to its successor's.
    _merge(totals, stalls.counters(monitor_a.snapshot()))
    _merge(totals, stalls.counters(monitor_b.snapshot()))
    merged = stalls.from_counters(totals)
    lag = merged["loop_lag"]
    assert lag["counts"][bucket_of(0.05)] == 2 and lag["counts"][bucket_of(0.005)] == 1
    assert sum(lag["counts"]) == 3
    assert lag["sum_ns"] == 74 * MS and lag["max_ns"] == 40 * MS  # the larger, not 30 + 40
    assert merged["gc_pause"]["2"]["max_ns"] == 60 * MS
    assert stalls.summary(merged)["loop_lag"] == {"count": 3, "sum_s": 0.074, "max_s": 0.04}
    # A status without stalls (a worker of before, or none yet) adds nothing.
    assert stalls.counters(None) == {} and stalls.counters({}) == {}


# -- the exposition ---------------------------------------------------------------------------


def histograms(exposition: str, name: str) -> dict[tuple[tuple[str, str], ...], dict[str, Any]]:
    """Per label set (without le): buckets [(le, value)], count and sum, as parsed."""
    found: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for family in text_string_to_metric_families(exposition):
        if family.name != name:
            continue
        assert family.type == "histogram"
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            series = found.setdefault(labels, {"buckets": []})
            if sample.name.endswith("_bucket"):
                series["buckets"].append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_count"):
                series["count"] = sample.value
            elif sample.name.endswith("_sum"):
                series["sum"] = sample.value
    return found


def assert_well_formed(series: dict[str, Any]) -> None:
    les = [le for le, _ in series["buckets"]]
    values = [value for _, value in series["buckets"]]
    assert les == [*BOUNDS_S, float("inf")]
    assert values == sorted(values), "buckets must be cumulative"
    assert series["count"] == values[-1], "_count must be the +Inf bucket"
    assert series["sum"] >= 0


def test_the_exposition_parses_with_cumulative_buckets() -> None:
    monitor = StallMonitor()
    monitor.loop_lag.observe(3 * MS)
    monitor.loop_lag.observe(30 * MS)
    monitor.gc_pause[0].observe(MS // 10)
    registry = CollectorRegistry()
    registry.register(StallCollector(lambda: {"0": monitor.snapshot()}))
    text = generate_latest(registry).decode()
    lag = histograms(text, "sidecar_loop_lag_seconds")
    assert list(lag) == [(("worker", "0"),)]
    series = lag[(("worker", "0"),)]
    assert_well_formed(series)
    assert series["count"] == 2 and series["sum"] == pytest.approx(0.033)
    assert dict(series["buckets"])[0.002] == 0 and dict(series["buckets"])[0.005] == 1
    pauses = histograms(text, "sidecar_gc_pause_seconds")
    assert sorted(dict(k)["generation"] for k in pauses) == ["0", "1", "2"]
    for series in pauses.values():
        assert_well_formed(series)
    assert 'sidecar_loop_lag_max_seconds{worker="0"} 0.03' in text
    assert 'sidecar_gc_pause_max_seconds{generation="0",worker="0"} 0.0001' in text


# -- through real sockets and processes ----------------------------------------------------------


async def scrape(admin_url: str, path: str = "/metrics") -> Any:
    async with aiohttp.ClientSession() as session:
        async with session.get(admin_url + path) as response:
            assert response.status == 200
            if path == "/metrics":
                return await response.text()
            return await response.json()


async def until_scraped(
    admin_url: str, predicate: Callable[[str], bool], timeout: float = 10.0
) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text: str = await scrape(admin_url)
        if predicate(text):
            return text
        assert time.monotonic() < deadline, f"/metrics never showed it:\n{text}"
        await asyncio.sleep(0.05)


def lag_count(text: str, worker: str = "0") -> float:
    series = histograms(text, "sidecar_loop_lag_seconds").get((("worker", worker),))
    return float(series["count"]) if series else 0.0


def config_for(upstream: str) -> Any:
    return build_config(
        {
            "upstreams": [upstream],
            "listen": "127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "health_interval": "0",
            "engine_scrape_interval": "0",
        },
        {},
    )


async def one_request(url: str) -> None:
    body = {"model": "M", "prompt": "hi", "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200
            await response.read()


async def test_one_process_exports_its_stalls_as_worker_0(sim_url: str) -> None:
    server, _window = build_proxy_server(config_for(sim_url))
    before = list(gc.callbacks)
    await server.start()
    try:
        assert server.stalls.installed and len(gc.callbacks) == len(before) + 1
        await one_request(server.url)
        gc.collect()
        text = await until_scraped(server.admin_url, lambda t: lag_count(t) > 0)
        assert_well_formed(histograms(text, "sidecar_loop_lag_seconds")[(("worker", "0"),)])
        pauses = histograms(text, "sidecar_gc_pause_seconds")
        for series in pauses.values():
            assert_well_formed(series)
        assert pauses[(("generation", "2"), ("worker", "0"))]["count"] >= 1
    finally:
        await server.close()
    assert not server.stalls.installed and gc.callbacks == before


async def wait_workers(collector: Collector, done: Callable[[dict[str, Any]], bool]) -> Any:
    deadline = time.monotonic() + 15.0
    while True:
        view = await scrape(collector.admin_url, "/workers")
        if done(view):
            return view
        assert time.monotonic() < deadline, view
        await asyncio.sleep(0.05)


async def test_a_worker_sends_its_stalls_and_the_collector_exports_them(sim_url: str) -> None:
    collector, _window = build_collector(config_for(sim_url), 1)
    await collector.start()
    try:
        await one_request(collector.url)
        text = await until_scraped(collector.admin_url, lambda t: lag_count(t) > 0)
        lag = histograms(text, "sidecar_loop_lag_seconds")
        assert list(lag) == [(("worker", "0"),)]
        assert_well_formed(lag[(("worker", "0"),)])
        for series in histograms(text, "sidecar_gc_pause_seconds").values():
            assert_well_formed(series)
        assert "sidecar_loop_lag_max_seconds" in text and "sidecar_gc_pause_max_seconds" in text
        view = await wait_workers(
            collector, lambda v: v["workers"][0]["stalls"]["loop_lag"]["count"]
        )
        shown = view["workers"][0]["stalls"]
        assert set(shown) == {"loop_lag", "gc_pause"} and set(shown["gc_pause"]) == {"0", "1", "2"}
        assert view["stalls"]["loop_lag"]["count"] == shown["loop_lag"]["count"]  # one worker
        assert shown["loop_lag"]["max_s"] >= 0
    finally:
        await collector.close()


async def test_a_restarted_workers_stalls_add_to_its_predecessors(sim_url: str) -> None:
    collector, _window = build_collector(config_for(sim_url), 1)
    await collector.start()
    try:
        first = await wait_workers(
            collector, lambda v: v["workers"][0]["stalls"]["loop_lag"]["count"] >= 2
        )
        before = first["workers"][0]["stalls"]["loop_lag"]["count"]
        os.kill(first["workers"][0]["pid"], signal.SIGKILL)
        # Restarted (0.5 s backoff), and its own samples on top of what the first one sent.
        after = await wait_workers(
            collector,
            lambda v: (
                v["workers"][0]["restarts"] == 1
                and v["workers"][0]["alive"]
                and v["workers"][0]["stalls"]["loop_lag"]["count"] > before
            ),
        )
        assert after["workers"][0]["pid"] != first["workers"][0]["pid"]
        text = await scrape(collector.admin_url)
        assert lag_count(text) >= after["workers"][0]["stalls"]["loop_lag"]["count"] > before
    finally:
        await collector.close()
