"""`sidecar replay --metrics-listen`: the sender's own live numbers, over real HTTP."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from factories import MS
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_helpers import free_port
from test_replay import args_for

from sidecar.record import Outcome
from sidecar.replay import replay_cli
from sidecar.replay.live import ReplayCollector, ReplayCounters
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas
from sidecar.tracefile import TraceHeader, TraceRequest, write_trace


def test_counters_by_hand() -> None:
    """Run 1 plans 5; four leave, three of them in open loop 0.2 ms, exactly 1 ms and early
    (counted as 0) late; two end ok, one times out. Lateness buckets (le): 0.0001 holds the
    early one, 0.00025 adds the 0.2 ms one, 0.001 adds the 1 ms one (a value equal to a bound
    is in that bound's bucket)."""
    counters = ReplayCounters()
    counters.start_run(1, 5)
    counters.sent(200_000)
    counters.sent(1 * MS)
    counters.sent(None)  # closed loop: no schedule, no lateness
    counters.sent(-5)
    counters.completed(Outcome.OK)
    counters.completed(Outcome.OK)
    counters.completed(Outcome.TIMEOUT)
    registry = CollectorRegistry()
    registry.register(ReplayCollector(counters, shard="0"))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"shard": "0", **labels})

    assert value("sidecar_replay_requests_planned_total") == 5
    assert value("sidecar_replay_requests_sent_total") == 4
    assert value("sidecar_replay_requests_completed_total", outcome="ok") == 2
    assert value("sidecar_replay_requests_completed_total", outcome="timeout") == 1
    assert value("sidecar_replay_requests_completed_total", outcome="http_error") == 0
    assert value("sidecar_replay_in_flight_requests") == 1
    assert value("sidecar_replay_run") == 1
    assert value("sidecar_replay_send_lateness_seconds_bucket", le="0.0001") == 1
    assert value("sidecar_replay_send_lateness_seconds_bucket", le="0.00025") == 2
    assert value("sidecar_replay_send_lateness_seconds_bucket", le="0.0005") == 2
    assert value("sidecar_replay_send_lateness_seconds_bucket", le="0.001") == 3
    assert value("sidecar_replay_send_lateness_seconds_bucket", le="+Inf") == 3
    assert value("sidecar_replay_send_lateness_seconds_count") == 3
    assert value("sidecar_replay_send_lateness_seconds_sum") == pytest.approx(0.0012)
    counters.start_run(2, 5)  # a second run adds to the plan
    assert value("sidecar_replay_requests_planned_total") == 10 and value("sidecar_replay_run") == 2


@pytest.mark.slow
async def test_a_replay_with_workers_serves_its_numbers_while_it_runs(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [TraceRequest(t=i * 0.03, n_in=8, n_out=3) for i in range(16)],
    )
    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0)), 1
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    out = tmp_path / "out"
    try:
        replay = asyncio.create_task(
            replay_cli.run(
                args_for(
                    trace,
                    replicas[0].url,
                    repeats=1,
                    workers=2,
                    output_dir=out,
                    metrics_listen=f"127.0.0.1:{port}",
                    metrics_linger="3s",
                )
            )
        )
        samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        async with aiohttp.ClientSession() as session:
            for _ in range(400):  # until the run is over (the listener lingers 3 s for this)
                await asyncio.sleep(0.05)
                try:
                    async with session.get(url) as response:
                        text = await response.text()
                except aiohttp.ClientConnectionError:
                    assert not replay.done(), await replay
                    continue
                samples = {
                    (s.name, tuple(sorted(s.labels.items()))): s.value
                    for family in text_string_to_metric_families(text)
                    for s in family.samples
                }
                done = sum(
                    v
                    for (name, _), v in samples.items()
                    if name == "sidecar_replay_requests_completed_total"
                )
                if done == 16:
                    break
        assert await replay == 0
    finally:
        await close_replicas(replicas)
    shard = (("shard", "0"),)
    report = json.loads((out / "report.json").read_text())
    # What both sender processes did, added up in the parent's numbers.
    assert samples[("sidecar_replay_requests_planned_total", shard)] == 16
    assert samples[("sidecar_replay_requests_sent_total", shard)] == 16
    assert (
        samples[("sidecar_replay_requests_completed_total", (("outcome", "ok"), ("shard", "0")))]
        == report["completed"]
        == 16
    )
    assert samples[("sidecar_replay_in_flight_requests", shard)] == 0
    assert samples[("sidecar_replay_send_lateness_seconds_count", shard)] == 16
    assert samples[("sidecar_replay_run", shard)] == 1


@pytest.mark.slow
async def test_a_replay_with_workers_shows_their_progress(tmp_path: Path) -> None:
    """`--workers 2` as a user runs it: the sender processes' counters, added up in the
    parent, are what its progress shows on stderr (here a log: the line at the end of each
    run); the counts start again at each run."""
    from test_replay import sidecar_async

    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [TraceRequest(t=i * 0.02, n_in=8, n_out=3) for i in range(12)],
    )
    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0)), 1
    )
    try:
        code, out, err = await sidecar_async(
            "replay", str(trace), "--target", replicas[0].url, "--workers", "2", "--repeats", "2"
        )
    finally:
        await close_replicas(replicas)
    assert code == 0, err
    for run in (1, 2):
        assert f"run {run}/2: 12/12 finished, 12 sent, 0 failed, " in err, err
    assert out.startswith("mode ") and "finished" not in out
