"""Capacity under SLO: search logic by hand, and a sweep whose capacity the simulator predicts."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from br_v0_2 import errors
from proxy_stack import stack

from sidecar.replay import sweep_cli
from sidecar.replay.sweep import (
    Criteria,
    Search,
    StepVerdict,
    achieved_rate,
    judge_step,
    knee,
)
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas

PASS, FAIL = StepVerdict(True, ()), StepVerdict(False, ("slow",))


def drive(search: Search, capacity: float) -> list[float]:
    """Run a search against a system that passes every load <= capacity."""
    tried = []
    while (load := search.next_load()) is not None:
        tried.append(load)
        search.record(load, PASS if load <= capacity else FAIL, load, load)
    return tried


def test_auto_search_doubles_then_bisects() -> None:
    search = Search(start=1.0, mode="open", bisect_steps=3)
    # 1, 2, 4, 8, 16 pass; 32 fails; bisect: 24 (fail), 20 (pass), 22 (fail).
    assert drive(search, capacity=21.0) == [1, 2, 4, 8, 16, 32, 24, 20, 22]
    assert search.capacity == 20


def test_auto_search_halves_when_the_first_load_fails_and_stops_when_closed_is_tight() -> None:
    search = Search(start=8.0, mode="open", bisect_steps=2)
    assert drive(search, capacity=3.0) == [8, 4, 2, 3, 3.5]  # two bisections after 2
    assert search.capacity == 3
    closed = Search(start=1, mode="closed", bisect_steps=5)
    assert drive(closed, capacity=5) == [1, 2, 4, 8, 6, 5]
    assert closed.capacity == 5


def test_judge_step_names_every_reason() -> None:
    criteria = Criteria({"ttft": 500.0, "tpot": 50.0}, percentile=90)
    report = {"completed": 98, "failed": 2, "p90_ttft_ms": 650.0, "p90_tpot_ms": 20.0}
    verdict = judge_step(report, offered=10.0, mode="open", criteria=criteria, achieved=8.0)
    assert not verdict.passed
    assert verdict.reasons == ("error rate 2.0% > 1.0%", "p90 ttft 650.0 ms > 500 ms",
                               "achieved 8.00/s < 90% of offered 10/s")
    good = {"completed": 100, "failed": 0, "p90_ttft_ms": 400.0, "p90_tpot_ms": 50.0}
    assert judge_step(good, 10.0, "open", criteria, 9.5).passed
    assert judge_step(good, 10.0, "closed", criteria, None).passed  # no keep-up when closed
    with pytest.raises(ValueError, match="unknown SLO metrics"):
        Criteria({"latency": 1.0})


def test_achieved_rate_and_knee() -> None:
    assert achieved_rate([0.0, 0.5, 1.0, 1.5, 2.0]) == pytest.approx(2.0)
    assert achieved_rate([1.0]) is None
    assert knee([1, 2, 4, 8], [1.0, 2.0, 3.9, 3.95]) == 4  # plateau: the first of it
    assert knee([1, 2], [None, None]) is None


def test_thresholds_and_datasets_parse() -> None:
    assert sweep_cli.parse_thresholds("ttft=500ms,e2e=2s,itl=30ms") == {
        "ttft": 500.0, "e2el": 2000.0, "itl": 30.0}
    with pytest.raises(ValueError, match="bad SLO term"):
        sweep_cli.parse_thresholds("speed=1s")
    requests = sweep_cli.synthetic_requests("synthetic:in=64,out=8,shared=32", 3)
    assert [(r.n_in, r.n_out) for r in requests] == [(64, 8)] * 3
    assert requests[0].prefix is not None and requests[0].prefix.hashes == (1, 2)
    for bad in ("random:in=1,out=1", "synthetic:in=5", "synthetic:in=4,out=1,shared=9"):
        with pytest.raises(ValueError):
            sweep_cli.synthetic_requests(bad, 1)


# Four sequences at most, 10 ms per step whatever the batch (flat step time), 20 output tokens:
# a request holds a slot for 20 steps = 0.2 s, so the replica completes at most 4 / 0.2 =
# 20 requests/s. Under a TTFT SLO the capacity is that bound minus the queueing the SLO
# tolerates: for p90 TTFT <= 60 ms (about 6 steps of waiting), between 50% and 100% of it.
SERVERS, STEP_S, OUT = 4, 0.01, 20
BOUND = SERVERS / (OUT * STEP_S)


async def test_sweep_finds_the_capacity_the_simulator_predicts(tmp_path: Path) -> None:
    sim = SimConfig(model="m", engine=EngineConfig(step_floor_s=STEP_S, per_token_s=0.0,
                                                   saturation_tokens=100_000,
                                                   max_num_seqs=SERVERS))
    replicas = await start_replicas(sim, 1)
    out = tmp_path / "sweep"
    parser = argparse.ArgumentParser()
    sweep_cli.add_arguments(parser)
    args = parser.parse_args([
        "--target", replicas[0].url, "--dataset", f"synthetic:in=16,out={OUT}",
        "--slo", "ttft=60ms", "--auto", "--start", "4", "--step-duration", "2s",
        "--min-requests", "20", "--warmup", "2", "--output-dir", str(out)])
    try:
        assert await sweep_cli.run(args) == 0
    finally:
        await close_replicas(replicas)
    result = json.loads((out / "sweep.json").read_text())
    capacity = result["capacity"]
    assert capacity is not None and 0.5 * BOUND <= capacity <= BOUND, result["capacity"]
    loads = [s["load"] for s in result["steps"]]
    assert any(load > capacity for load in loads)  # it did find the breaking point
    saturated = [s for s in result["steps"] if s["load"] >= 1.5 * BOUND]
    for step in saturated:  # past the bound, completions leave at the service rate
        assert step["achieved_rate"] <= 1.15 * BOUND
    assert result["envelope"]["engine_version"] == "0.33.0"
    assert result["envelope"]["output_tokens"]["p50"] == OUT

    import matplotlib.image

    for name in ("latency.png", "throughput.png", "scatter.png"):
        image = matplotlib.image.imread(out / name)
        assert image.shape[:2] == (450, 800)  # 8 x 4.5 in at 100 dpi
        assert image.std() > 0.01  # not a blank canvas

    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs Debian's chromium")
        pytest.skip("chromium not installed")
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
         "--v=0", "--dump-dom", (out / "sweep.html").as_uri()],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'id="capacity"' in done.stdout and done.stdout.count("data:image/png;base64,") == 3
    # The page has no script and loads nothing external: no console message, no failed load.
    assert "CONSOLE" not in done.stderr and "net::ERR" not in done.stderr


async def test_a_sweep_through_a_sidecar_reads_its_view_of_each_step(tmp_path: Path) -> None:
    sim = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0))
    out = tmp_path / "sweep"
    parser = argparse.ArgumentParser()
    sweep_cli.add_arguments(parser)
    async with stack(2, sim=sim, route_policy="round_robin") as s:
        args = parser.parse_args([
            "--target", s.url, "--sidecar-admin", s.server.admin_url,
            "--dataset", "synthetic:in=32,out=6,shared=16", "--slo", "ttft=500ms",
            "--rates", "10,20", "--step-duration", "1s", "--min-requests", "10",
            "--warmup", "2", "--repeats", "2", "--output-dir", str(out)])
        assert await sweep_cli.run(args) == 0
        proxied = [r for r in s.records.records if r.endpoint in ("chat", "completions")]
    result = json.loads((out / "sweep.json").read_text())
    steps = result["steps"]
    assert [step["load"] for step in steps] == [10.0, 20.0]
    # Each step ran 2 warm-ups and 2 repeats: the sidecar saw all of them, and each step's view
    # covers exactly the reported run's requests, named by its own request-id prefix.
    assert len(proxied) == sum(2 + 2 * step["requests"] for step in steps)
    for step in steps:
        view = step["sidecar"]
        assert view["requests_sent"] == view["requests_seen"] == step["requests"]
        assert view["complete"] is True
        selected = [r for r in proxied if r.request_id.startswith(view["request_id_prefix"])]
        assert len(selected) == step["requests"]
        # Per request, the sidecar's upstream side sees the first token no later than its
        # client side, and that no later than the replayer: so does every order statistic.
        report = step["report"]
        server, client = view["vantages"]["server"], view["vantages"]["client"]
        assert server["requests"] == client["requests"] == report["completed"]
        for q in ("mean", "p50", "p90", "p99"):
            replayer = report[f"{q}_ttft_ms"]
            assert 0 < server["ttft_ms"][q] <= client["ttft_ms"][q] <= replayer, q
            assert server["e2e_ms"][q] <= report[f"{q}_e2el_ms"], q
        assert step["engine_delta"]["prefix_cache_queries"] == 32 * (2 * step["requests"])
    # The envelope: the sidecar's routing, and the engines read one by one (through the proxy,
    # /metrics would reach only one of the two replicas).
    envelope = result["envelope"]
    assert envelope["route_policy"] == "round_robin" and envelope["sidecar_replicas"] == 2
    assert "each replica" in envelope["engine_metrics_from"]
    # Every prompt token sent to an engine was a prefix-cache query (the simulator counts
    # tokens at admission); at most the 16 shared tokens of 32 can hit.
    assert envelope["engine_delta"]["prefix_cache_queries"] == 32 * len(proxied)
    assert 0 < envelope["engine_prefix_cache_hit_rate"] <= 0.5
    assert envelope["engine_prefix_cache_hit_rate"] == pytest.approx(
        envelope["engine_delta"]["prefix_cache_hits"]
        / envelope["engine_delta"]["prefix_cache_queries"])
    page = (out / "sweep.html").read_text()
    assert "server TTFT p50" in page and f"{steps[0]['requests']}/{steps[0]['requests']}" in page
    # One llm-d benchmark report per step, for the same run as the step's report.
    assert sorted(p.name for p in (out / "br").iterdir()) == ["step-10.json", "step-20.json"]
    for step in steps:
        br = json.loads((out / "br" / f"step-{step['load']:g}.json").read_text())
        assert errors(br) == []
        assert br["run"]["eid"] == json.loads(
            (out / "br" / "step-10.json").read_text())["run"]["eid"]
        load = br["scenario"]["load"]["standardized"]
        assert (load["stage"], load["rate_qps"]) == (step["stage"], step["load"])
        assert load["input_seq_len"] == {"distribution": "fixed", "value": 32}
        assert load["prefix"]["prefix_len"] == {"distribution": "fixed", "value": 16}
        aggregate = br["results"]["request_performance"]["aggregate"]
        assert aggregate["requests"]["total"] == step["requests"]
        ttft = aggregate["latency"]["time_to_first_token"]
        assert ttft["p50"] == pytest.approx(step["report"]["p50_ttft_ms"])
        assert ttft["p99"] == pytest.approx(step["report"]["p99_ttft_ms"])
        ours = br["results"]["observability"]["vllm_sidecar"]
        assert ours["sweep"]["passed"] == step["passed"]
        assert ours["sidecar"] == step["sidecar"]
        assert ours["goodput"]["request_goodput"]["value"] == pytest.approx(
            step["report"]["request_goodput"])
        assert [c["metadata"]["label"] for c in br["scenario"]["stack"]] == ["target",
                                                                              "sidecar"]
        assert "--admin-token" not in br["scenario"]["load"]["native"]["args"]


def test_a_sweep_over_a_capture_skips_what_replay_skips(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A capture with a failed request of unknown prompt size (a 404 for a mistyped model)
    once stopped a sweep with "a trace line needs n_in > 0"; it skips that line, as replay and
    `trace lint` do, and says so."""
    from sidecar.replay.sweep import Criteria
    from sidecar.tracefile import TraceHeader, TraceRequest, write_trace

    trace = tmp_path / "capture.jsonl"
    write_trace(trace, TraceHeader(source="capture"), [
        TraceRequest(t=0.0, endpoint="chat", model="m", n_in=20, n_out=5),
        TraceRequest(t=0.1, endpoint="chat", model="typo", n_in=None, n_out=None,
                     outcome="http_error", http_status=404),
        TraceRequest(t=0.2, endpoint="chat", model="m", n_in=30, n_out=6)])
    parser = argparse.ArgumentParser()
    sweep_cli.add_arguments(parser)
    args = parser.parse_args(["--target", "http://127.0.0.1:9", "--trace", str(trace),
                              "--slo", "ttft=1s", "--rates", "1"])
    runner = sweep_cli.Runner(args, "m", Criteria(thresholds_ms={"ttft": 1000.0}))
    assert runner.trace is not None and [r.n_in for r in runner.trace] == [20, 30]
    err = capsys.readouterr().err
    assert "skipped 1 of 3 trace lines" in err and "line 3 (n_in missing" in err
