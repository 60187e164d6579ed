"""Prometheus export: hand-worked sink values, promtool, and a real Prometheus server."""

from __future__ import annotations

import asyncio
import random
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_helpers import Prometheus, require_binary, running_prometheus
from proxy_stack import stack

from sidecar import stats
from sidecar.record import ChunkMark, EngineTiming, Outcome, RequestRecord, Timeline, TokenSource
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig
from sidecar.sinks.prometheus import (
    BulkHistogram,
    PrometheusSink,
    e6_buckets,
    latency_buckets,
)

MS = 1_000_000


def record(marks_ms: list[tuple[float, int]], *, n_out: int | None = None,
           outcome: Outcome = Outcome.OK, model: str = "m", slo_class: str | None = None,
           server_shift_ms: float = 1.0, engine: EngineTiming | None = None,
           http_status: int = 200) -> RequestRecord:
    marks = tuple(ChunkMark(int(t * MS), n) for t, n in marks_ms)
    server_marks = tuple(ChunkMark(m.offset_ns - int(server_shift_ms * MS), m.n_tokens)
                         for m in marks)
    end = marks[-1].offset_ns if marks else 5 * MS
    return RequestRecord(
        request_id="r", wall_time_ns=0, outcome=outcome, endpoint="chat", model=model,
        client=Timeline.from_marks(0, marks, end, len(marks)),
        server=Timeline.from_marks(int(1 * MS), server_marks, end, len(marks)),
        n_in=10, n_out=n_out, n_cached=4, token_source=TokenSource.USAGE,
        replica="127.0.0.1:8000", engine=engine, http_status=http_status,
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
    assert value(registry, "sidecar_time_to_first_token_seconds_sum", **client) == \
        pytest.approx(0.120)
    # Server side: sent upstream at 1 ms, events seen 1 ms earlier than the client's writes.
    assert value(registry, "sidecar_time_to_first_token_seconds_sum", **server) == \
        pytest.approx(0.118)
    assert value(registry, "sidecar_inter_token_latency_seconds_count", **client) == 3
    assert value(registry, "sidecar_inter_token_latency_seconds_sum", **client) == \
        pytest.approx(0.110)
    # 0.03 s and 0.04 s: two gaps at or below the 0.047 bucket, none at or below 0.022.
    assert value(registry, "sidecar_inter_token_latency_seconds_bucket", le="0.047",
                 **client) == 3
    assert value(registry, "sidecar_inter_token_latency_seconds_bucket", le="0.033",
                 **client) == 1
    assert value(registry, "sidecar_time_per_output_token_seconds_sum", **client) == \
        pytest.approx(0.110 / 3)
    assert value(registry, "sidecar_e2e_request_latency_seconds_sum", **client) == \
        pytest.approx(0.230)
    engine_labels = {**client, "vantage": "engine"}
    # TTFT means the same interval at every vantage: from the start (queued in the engine,
    # 20 ms of queue) to the first token (90 ms after scheduling): 110 ms, not vLLM's 90.
    assert value(registry, "sidecar_time_to_first_token_seconds_sum", **engine_labels) == \
        pytest.approx(0.110)
    assert value(registry, "sidecar_time_per_output_token_seconds_sum", **engine_labels) == \
        pytest.approx(0.033)
    # No generation_time: no engine E2E (a missing part leaves the interval unknown).
    assert value(registry, "sidecar_e2e_request_latency_seconds_count", **engine_labels) in \
        (None, 0)
    assert value(registry, "sidecar_engine_queue_time_seconds_sum", model="m",
                 replica="127.0.0.1:8000") == pytest.approx(0.020)
    assert value(registry, "sidecar_requests_total", model="m", replica="127.0.0.1:8000",
                 endpoint="chat", outcome="ok") == 1
    assert value(registry, "sidecar_generation_tokens_total", model="m",
                 replica="127.0.0.1:8000") == 4
    assert value(registry, "sidecar_cached_prompt_tokens_total", model="m",
                 replica="127.0.0.1:8000") == 4
    assert value(registry, "sidecar_slo_good_requests_total", slo_class="default") == 1
    assert value(registry, "sidecar_slo_threshold_seconds", slo_class="default",
                 metric="ttft") == 0.5
    # The SLO thresholds are bucket boundaries, so `le="0.05"` counts TPOTs under 50 ms exactly.
    assert 0.05 in sink.latency_buckets and 0.5 in sink.latency_buckets


def test_goodput_counters_and_denominator_per_class() -> None:
    registry = CollectorRegistry()
    policy = stats.SLOPolicy({"default": stats.SLO(ttft_s=0.5),
                              "interactive": stats.SLO(ttft_s=0.1)})
    sink = PrometheusSink(registry, policy)
    sink.on_record(record([(80, 1), (90, 2)], n_out=3, slo_class="interactive"))  # good
    sink.on_record(record([(300, 1), (310, 1)], n_out=2, slo_class="interactive"))  # too slow
    sink.on_record(record([(300, 1)], n_out=1))  # default: good, no TPOT
    sink.on_record(record([], outcome=Outcome.TIMEOUT))  # default: counted, not good
    assert value(registry, "sidecar_slo_requests_total", slo_class="interactive") == 2
    assert value(registry, "sidecar_slo_good_requests_total", slo_class="interactive") == 1
    assert value(registry, "sidecar_slo_good_generation_tokens_total",
                 slo_class="interactive") == 3
    assert value(registry, "sidecar_slo_requests_total", slo_class="default") == 2
    assert value(registry, "sidecar_slo_good_requests_total", slo_class="default") == 1
    assert value(registry, "sidecar_requests_without_tpot_total", model="m") == 1
    assert value(registry, "sidecar_requests_total", model="m", replica="127.0.0.1:8000",
                 endpoint="chat", outcome="timeout") == 1


def test_labels_are_capped() -> None:
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, label_cap=2)
    for model in ("a", "b", "c", "d", "a"):
        sink.on_record(record([(10, 1)], n_out=1, model=model))
    text = generate_latest(registry).decode()
    assert 'model="a"' in text and 'model="b"' in text and 'model="other"' in text
    assert 'model="c"' not in text
    assert value(registry, "sidecar_requests_total", model="other", replica="127.0.0.1:8000",
                 endpoint="chat", outcome="ok") == 2


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
    assert value(registry, "sidecar_requests_total", model="other", replica="127.0.0.1:8000",
                 endpoint="chat", outcome="http_error") == 64
    assert value(registry, "sidecar_requests_total", model="real", replica="127.0.0.1:8000",
                 endpoint="chat", outcome="ok") == 1
    assert value(registry, "sidecar_requests_total", model="real", replica="127.0.0.1:8000",
                 endpoint="chat", outcome="http_error") == 1


@pytest.mark.parametrize("repeat", [1, 40])  # 4 and 121 instants: bisect and numpy paths
def test_itl_gaps_are_binned_by_hand(repeat: int) -> None:
    """Bounds 1, 10, 100 ms (+Inf). Gaps 0.5 ms, 10 ms (equal to a bound: le, so in 10 ms) and
    250 ms, repeated: per repetition one each in le=0.001, le=0.01 and +Inf; sum 260.5 ms."""
    registry = CollectorRegistry()
    histogram = BulkHistogram("gaps", "doc", ("v",), [0.001, 0.01, 0.1], registry)
    offsets = [0]
    for _ in range(repeat):
        for gap_ms in (0.5, 10, 250):
            offsets.append(offsets[-1] + int(gap_ms * MS))
    assert (len(offsets) < BulkHistogram.NUMPY_FROM) == (repeat == 1)
    histogram.observe_gaps(("x",), offsets)
    histogram.observe_gaps(("x",), offsets[:1])  # a single instant: no gap, nothing observed
    assert value(registry, "gaps_bucket", v="x", le="0.001") == repeat
    assert value(registry, "gaps_bucket", v="x", le="0.01") == 2 * repeat
    assert value(registry, "gaps_bucket", v="x", le="0.1") == 2 * repeat
    assert value(registry, "gaps_bucket", v="x", le="+Inf") == 3 * repeat
    assert value(registry, "gaps_count", v="x") == 3 * repeat
    assert value(registry, "gaps_sum", v="x") == pytest.approx(0.2605 * repeat)


def test_buckets_span_sub_millisecond_to_minutes() -> None:
    buckets = e6_buckets()
    assert buckets[0] == 0.0001 and buckets[-1] == 1000.0
    ratios = np.array(buckets[1:]) / np.array(buckets[:-1])
    assert ratios.max() <= 1.5 + 1e-9
    assert latency_buckets([0.05, 0.25])[:20].count(0.05) == 1


def test_promtool_accepts_the_exposition() -> None:
    promtool = require_binary("promtool")
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, stats.SLOPolicy({"default": stats.SLO(ttft_s=0.5)}))
    sink.on_record(record([(120, 1), (150, 1)], n_out=2))
    done = subprocess.run([promtool, "check", "metrics"], input=generate_latest(registry),
                          capture_output=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == b"" and done.stderr.strip() == b""


@pytest.fixture
def prometheus_for(tmp_path: Path) -> Iterator[Any]:
    """``start(target)``: a real Prometheus scraping ``target`` every second."""
    with ExitStack() as stack_:
        def start(target: str) -> Prometheus:
            config = ("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                      "scrape_configs:\n  - job_name: sidecar\n    metrics_path: /metrics\n"
                      f"    static_configs:\n      - targets: ['{target}']\n")
            return stack_.enter_context(running_prometheus(config, tmp_path))

        yield start


def bucket_bounds(estimate: float, bounds: tuple[float, ...]) -> tuple[float, float]:
    upper_index = int(np.searchsorted(bounds, estimate, side="left"))
    lower = bounds[upper_index - 1] if upper_index > 0 else 0.0
    return lower, bounds[upper_index]


async def test_real_prometheus_quantiles_and_goodput_agree_with_the_records(
        prometheus_for: Any) -> None:
    # Prompt lengths vary widely, so prefill (and TTFT) does too: the SLO splits the requests.
    sim = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, saturation_tokens=64,
                                                   per_token_s=0.00002))
    async with stack(sim=sim, slo="ttft=25ms,tpot=5ms") as s:
        host_port = s.server.admin_url.split("://")[1]
        prom = await asyncio.to_thread(prometheus_for, host_port)
        rng = random.Random(7)
        async with aiohttp.ClientSession() as session:
            async def one(i: int) -> None:
                words = " ".join("w" for _ in range(rng.randint(5, 2500)))
                body = {"model": "m", "stream": True, "max_tokens": rng.randint(1, 40),
                        "ignore_eos": True, "messages": [{"role": "user", "content": words}]}
                async with session.post(s.url + "/v1/chat/completions", json=body) as response:
                    await response.read()

            for batch in range(6):
                await asyncio.gather(*(one(batch * 10 + i) for i in range(10)))
        records = await s.records.wait_for(60)

        async def scraped_all() -> None:
            for _ in range(200):
                total = await asyncio.to_thread(
                    prom.scalar, 'sum(sidecar_slo_requests_total{slo_class="default"})')
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
                m = stats.request_metrics(r, stats.Vantage(vantage))
                assert m is not None
                if series == "itl":
                    samples.extend(m.itl_s)
                else:
                    value_ = getattr(m, f"{series}_s")
                    if value_ is not None:
                        samples.append(value_)
            for q in (0.5, 0.9, 0.99):
                estimate = await asyncio.to_thread(
                    prom.scalar, f'histogram_quantile({q}, sum by (le) '
                                 f'({metric}_bucket{{vantage="{vantage}"}}))')
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
                    metric, q, estimate, exact, (lower, upper), (low_sample, high_sample))
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
            prom.scalar, 'sum(sidecar_slo_good_requests_total{slo_class="default"})')
        assert scraped_good == good
        assert await asyncio.to_thread(
            prom.scalar, 'sidecar_slo_threshold_seconds{metric="ttft"}') == 0.025


async def test_promtool_accepts_the_whole_admin_exposition(tmp_path: Path) -> None:
    """Everything /metrics serves (sinks, live gauges, capture, process), after real traffic."""
    promtool = require_binary("promtool")
    async with stack(slo="ttft=1s", capture_dir=str(tmp_path / "cap")) as s, \
            aiohttp.ClientSession() as session:
        body = {"model": "m", "stream": True, "max_tokens": 3, "ignore_eos": True,
                "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(3):
            async with session.post(s.url + "/v1/chat/completions", json=body) as response:
                await response.read()
        await s.records.wait_for(3)
        async with session.get(s.server.admin_url + "/metrics") as response:
            exposition = await response.read()
    for name in (b"sidecar_window_latency_seconds", b"sidecar_in_flight_requests",
                 b"sidecar_capture_records_written_total", b"process_resident_memory_bytes"):
        assert name in exposition
    # Window values are gauges: a summary's _count/_sum slid with the window, and rate() read
    # every record leaving it as a counter reset.
    assert b"# TYPE sidecar_window_latency_seconds gauge" in exposition
    assert b"sidecar_window_latency_seconds_count" not in exposition
    assert b'sidecar_window_latency_samples{metric="ttft",vantage="client"} 3.0' in exposition
    done = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True,
                          timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == b"" and done.stderr.strip() == b""
