"""Capacity under SLO: search logic by hand, and a sweep whose capacity the simulator predicts."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from br_v0_2 import errors
from proxy_stack import stack

from sidecar.replay import sweep_cli, sweep_session
from sidecar.replay.options import SweepOptions
from sidecar.replay.sweep import (
    Criteria,
    Search,
    StepVerdict,
    achieved_rate,
    criteria_detail,
    criteria_of,
    judge_step,
    knee,
    parse_criteria,
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
    criteria = Criteria({"ttft": 0.5, "tpot": 0.05}, percentile=90)
    report = {"completed": 98, "failed": 2, "p90_ttft_ms": 650.0, "p90_tpot_ms": 20.0}
    verdict = judge_step(report, offered=10.0, mode="open", criteria=criteria, achieved=8.0)
    assert not verdict.passed
    assert verdict.reasons == (
        "error rate 2.0% > 1.0%",
        "p90 ttft 650.0 ms > 500 ms",
        "achieved 8.00 req/s < 90% of offered 10.00 req/s",
    )
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


def test_criteria_and_datasets_parse() -> None:
    """The sweep's --slo is the SLO grammar (config.parse_slo_spec) with ITL; held in seconds,
    written to sweep.json in ms under the report's names, as before."""
    criteria = parse_criteria("ttft=500ms,e2e=2s,itl=30ms", 99.0)
    assert criteria.thresholds == {"ttft": 0.5, "e2e": 2.0, "itl": 0.03}
    assert criteria.percentile == 99.0 and parse_criteria("e2el=2s").thresholds == {"e2e": 2.0}
    assert criteria_detail(criteria)["thresholds_ms"] == {
        "ttft": 500.0,
        "e2el": 2000.0,
        "itl": 30.0,
    }
    assert criteria_of({"slo_criteria": criteria_detail(criteria)}).thresholds == pytest.approx(
        criteria.thresholds
    )
    assert criteria.slo().ttft_s == 0.5 and criteria.slo().e2e_s == 2.0
    assert criteria.describe().startswith("p99 ttft <= 500 ms, p99 e2e <= 2000 ms, p99 itl")
    for bad, message in (
        ("speed=1s", "bad SLO term"),
        ("ttft=500", "needs a unit"),
        ("ttft=1s,objective=99%", "do not apply"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_criteria(bad)
    requests = sweep_session.synthetic_requests("synthetic:in=64,out=8,shared=32", 3)
    assert [(r.n_in, r.n_out) for r in requests] == [(64, 8)] * 3
    assert requests[0].prefix is not None and requests[0].prefix.hashes == (1, 2)
    for bad in ("random:in=1,out=1", "synthetic:in=5", "synthetic:in=4,out=1,shared=9"):
        with pytest.raises(ValueError):
            sweep_session.synthetic_requests(bad, 1)


# Four sequences at most, 10 ms per step whatever the batch (flat step time), 20 output tokens:
# a request holds a slot for 20 steps = 0.2 s, so the replica completes at most 4 / 0.2 =
# 20 requests/s. Under a TTFT SLO the capacity is that bound minus the queueing the SLO
# tolerates: for p90 TTFT <= 60 ms (about 6 steps of waiting), between 50% and 100% of it.
SERVERS, STEP_S, OUT = 4, 0.01, 20
BOUND = SERVERS / (OUT * STEP_S)


@pytest.mark.slow
@pytest.mark.realparts
async def test_sweep_finds_the_capacity_the_simulator_predicts(tmp_path: Path) -> None:
    sim = SimConfig(
        model="m",
        engine=EngineConfig(
            step_floor_s=STEP_S, per_token_s=0.0, saturation_tokens=100_000, max_num_seqs=SERVERS
        ),
    )
    replicas = await start_replicas(sim, 1)
    out = tmp_path / "sweep"
    parser = argparse.ArgumentParser()
    sweep_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--target",
            replicas[0].url,
            "--dataset",
            f"synthetic:in=16,out={OUT}",
            "--slo",
            "ttft=60ms",
            "--auto",
            # From 16 (about 80% of the bound; where it fails the search halves to 8, which
            # passes) to 32 (saturated, checked below), then two bisections: 24 and 20 (or 12
            # and 10 or 14 when 16 failed). Lower starts only add passing steps.
            "--start",
            "16",
            "--bisect-steps",
            "2",
            "--step-duration",
            "2s",
            "--min-requests",
            "20",
            "--warmup",
            "2",
            "--output-dir",
            str(out),
        ]
    )
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
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
            (out / "sweep.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'id="capacity"' in done.stdout and done.stdout.count("data:image/png;base64,") == 3
    # The page has no script and loads nothing external: no console message, no failed load.
    assert "CONSOLE" not in done.stderr and "net::ERR" not in done.stderr


@pytest.mark.slow
async def test_a_sweep_through_a_sidecar_reads_its_view_of_each_step(tmp_path: Path) -> None:
    sim = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0))
    out = tmp_path / "sweep"
    parser = argparse.ArgumentParser()
    sweep_cli.add_arguments(parser)
    async with stack(2, sim=sim, route_policy="round_robin") as s:
        args = parser.parse_args(
            [
                "--target",
                s.url,
                "--sidecar-admin",
                s.server.admin_url,
                "--dataset",
                "synthetic:in=32,out=6,shared=16",
                "--slo",
                "ttft=500ms",
                "--rates",
                "10,20",
                "--step-duration",
                "0.5s",
                "--min-requests",
                "10",
                "--warmup",
                "2",
                "--repeats",
                "2",
                "--output-dir",
                str(out),
            ]
        )
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
        # The sidecar's own delay per token event of the step's streams: every one paired.
        relay = view["relay"]
        assert relay["requests"] == report["completed"]
        assert relay["delay_ms"]["count"] > 0
        assert 0 <= relay["delay_ms"]["p50"] <= relay["delay_ms"]["p99"]
        # The sidecar's CPU over the run (here one process with the replayer and the
        # simulators in it: more than the sidecar's own, but CPU it used), per request sent.
        cpu = view["cpu"]
        assert cpu["seconds"] > 0
        assert cpu["per_request_ms"] == pytest.approx(cpu["seconds"] / step["requests"] * 1e3)
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
        / envelope["engine_delta"]["prefix_cache_queries"]
    )
    page = (out / "sweep.html").read_text()
    assert "server TTFT p50" in page and f"{steps[0]['requests']}/{steps[0]['requests']}" in page
    assert "sidecar delay p99" in page and "sidecar CPU/req" in page
    # One llm-d benchmark report per step, for the same run as the step's report.
    assert sorted(p.name for p in (out / "br").iterdir()) == ["step-10.json", "step-20.json"]
    for step in steps:
        br = json.loads((out / "br" / f"step-{step['load']:g}.json").read_text())
        assert errors(br) == []
        assert (
            br["run"]["eid"] == json.loads((out / "br" / "step-10.json").read_text())["run"]["eid"]
        )
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
            step["report"]["request_goodput"]
        )
        assert [c["metadata"]["label"] for c in br["scenario"]["stack"]] == ["target", "sidecar"]
        assert "--admin-token" not in br["scenario"]["load"]["native"]["args"]


def test_a_sweep_over_a_capture_skips_what_replay_skips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A capture with a failed request of unknown prompt size (a 404 for a mistyped model)
    once stopped a sweep with "a trace line needs n_in > 0"; it skips that line, as replay and
    `trace lint` do, and says so."""
    from sidecar.replay.sweep import Criteria
    from sidecar.tracefile import TraceHeader, TraceRequest, write_trace

    trace = tmp_path / "capture.jsonl"
    write_trace(
        trace,
        TraceHeader(source="capture"),
        [
            TraceRequest(t=0.0, endpoint="chat", model="m", n_in=20, n_out=5),
            TraceRequest(
                t=0.1,
                endpoint="chat",
                model="typo",
                n_in=None,
                n_out=None,
                outcome="http_error",
                http_status=404,
            ),
            TraceRequest(t=0.2, endpoint="chat", model="m", n_in=30, n_out=6),
        ],
    )
    parser = argparse.ArgumentParser()
    sweep_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--target",
            "http://127.0.0.1:9",
            "--trace",
            str(trace),
            "--slo",
            "ttft=1s",
            "--rates",
            "1",
        ]
    )
    runner = sweep_session.SweepRunner(
        SweepOptions.from_args(args), "m", Criteria(thresholds={"ttft": 1.0})
    )
    assert runner.trace is not None and [r.n_in for r in runner.trace] == [20, 30]
    err = capsys.readouterr().err
    assert "skipped 1 of 3 trace lines" in err and "line 3 (n_in missing" in err


# -- what the sweep says: one table for the console and the page ------------------------------


def a_step(load: float, passed: bool, goodput: float, **extra: Any) -> dict[str, Any]:
    report = {
        "completed": 20,
        "failed": 0,
        "request_throughput": goodput,
        "request_goodput": goodput,
        "slo_attainment": 1.0,
        "max_concurrent_requests": 3,
        "p90_ttft_ms": 40.0,
        "p50_ttft_ms": 30.0,
        "p99_ttft_ms": 55.0,
        "lateness_ms": {"p99": 0.25},
    }
    return {
        "load": load,
        "offered": load * 0.85,
        "achieved_rate": load * 0.8,
        "passed": passed,
        "reasons": [] if passed else ["p90 ttft 650.0 ms > 60 ms"],
        "report": report,
        **extra,
    }


def a_result(
    steps: list[dict[str, Any]], capacity: float | None, knee_load: float | None
) -> dict[str, Any]:
    return {
        "capacity": capacity,
        "knee": knee_load,
        "unit": "req/s",
        "mode": "open",
        "criteria": "p90 ttft <= 60 ms; errors <= 1.0%; achieved >= 90% of offered (open loop)",
        "slo_criteria": {
            "thresholds_ms": {"ttft": 60.0},
            "percentile": 90.0,
            "max_error_rate": 0.01,
            "keep_up": 0.9,
        },
        "steps": steps,
    }


def test_capacity_and_knee_say_what_they_are() -> None:
    """A capacity no step failed above is a lower bound; the knee is said even when it is the
    capacity; no passing step is no capacity."""
    from sidecar.replay.sweep import capacity_text, knee_text

    never_broke = a_result([a_step(2, True, 1.7), a_step(4, True, 3.4)], 4, 4)
    assert capacity_text(never_broke) == (
        "capacity: >= 4 req/s, no step failed (a lower bound: the highest load tried passed)"
    )
    assert knee_text(never_broke) == (
        "knee: 4 req/s (the load of the highest goodput, 3.40 req/s; the same load as the capacity)"
    )
    broke = a_result([a_step(2, True, 1.7), a_step(4, True, 3.4), a_step(8, False, 3.0)], 4, 4)
    assert capacity_text(broke) == "capacity: 4 req/s (the highest passing load; 8 req/s failed)"
    nothing = a_result([a_step(2, False, 0.5)], None, 2)
    assert capacity_text(nothing) == "capacity: none, no step passed (lowest load tried: 2 req/s)"


def test_the_step_line_shows_the_numbers_the_verdict_was_judged_on() -> None:
    """ "achieved 1.70/s ... pass" beside a 90%-of-offered criterion read as a contradiction at
    a nominal 2 req/s: the line names the offered rate it was judged against, and the ratio."""
    from sidecar.replay.sweep import step_line

    step = a_step(2, True, 1.6, offered=1.85, achieved_rate=1.70)
    assert step_line(a_result([step], 2, 2), step) == (
        "load 2 req/s: offered 1.85 req/s, achieved 1.70 req/s (91.9% of offered, >= 90% "
        "passes), TTFT p90 40.0 ms (<= 60), failed 0/20: pass"
    )


class Tables(HTMLParser):
    """The <table>s of a page: per table, its header cells and its body rows."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[dict[str, list[list[str]]]] = []
        self.cell: list[str] | None = None
        self.part = "body"

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag == "table":
            self.tables.append({"head": [], "body": []})
        elif tag in ("thead", "tbody"):
            self.part = "head" if tag == "thead" else "body"
        elif tag == "tr" and self.tables:
            self.tables[-1][self.part].append([])
        elif tag in ("td", "th"):
            self.cell = []
        elif tag == "br" and self.cell is not None:
            self.cell.append("|")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self.cell is not None:
            self.tables[-1][self.part][-1].append("".join(self.cell))
            self.cell = None

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cell.append(data)


def console_tables(text: str) -> list[dict[str, list[list[str]]]]:
    """The step tables of `sidecar sweep`'s stdout: per table, its header (names, units) and
    its rows' cells."""
    tables: list[dict[str, list[list[str]]]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Steps: "):
            rows = []
            for row in lines[i + 4 :]:
                if not row.strip():
                    break
                rows.append(row.split())
            # Names may hold a space; columns are two spaces apart at least.
            head = [re.split(r"\s{2,}", lines[i + n].strip()) for n in (1, 2)]
            tables.append({"head": head, "body": rows})
    return tables


@pytest.mark.slow
async def test_a_sweep_as_a_user_runs_it_says_what_it_does(tmp_path: Path) -> None:
    """`sidecar sweep` in a terminal-less run (a log): progress and one line per step on
    stderr, while stdout has the step tables the HTML page has (same rows, same units), the
    columns' definitions, the capacity as a lower bound when no step failed, and the knee
    even where it is the capacity. `--quiet`: stderr says nothing while it runs; a sweep where
    every step fails has no capacity, and lists why each failed."""
    from test_replay import sidecar_async

    sim = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0))
    replicas = await start_replicas(sim, 1)
    out_dir = tmp_path / "sweep"
    common = [
        "--target",
        replicas[0].url,
        "--dataset",
        "synthetic:in=16,out=4",
        "--rates",
        "4,8",
        "--step-duration",
        "1s",
        "--min-requests",
        "8",
        "--warmup",
        "1",
    ]
    try:
        code, out, err = await sidecar_async(
            "sweep", *common, "--slo", "ttft=5s", "--output-dir", str(out_dir)
        )
        assert code == 0, err
        quiet_code, quiet_out, quiet_err = await sidecar_async(
            # Every step fails whatever its size: shorter steps (the last --step-duration and
            # --min-requests win) do for this run.
            "sweep",
            *common,
            "--step-duration",
            "0.5s",
            "--min-requests",
            "3",
            "--slo",
            "ttft=0.001ms",
            "--quiet",
        )
    finally:
        await close_replicas(replicas)
    # stderr: progress of each step, then the step's verdict on the numbers it was judged on.
    assert "step 1: 4 req/s: 8/8 finished, 8 sent, 0 failed, " in err
    assert "step 2: 8 req/s: 8/8 finished, 8 sent, 0 failed, " in err
    assert re.search(
        r"^load 4 req/s: offered \S+ req/s, achieved \S+ req/s \(\S+% of "
        r"offered, >= 90% passes\), TTFT p90 \S+ ms \(<= 5000\), failed 0/8: "
        r"pass$",
        err,
        re.M,
    ), err
    # stdout: the report alone.
    assert "finished" not in out
    assert "capacity: >= 8 req/s, no step failed (a lower bound" in out
    assert re.search(
        r"^knee: 8 req/s \(the load of the highest goodput, \S+ req/s; the "
        r"same load as the capacity\)$",
        out,
        re.M,
    ), out
    assert "throughput: completed requests / duration" in out
    assert "(docs/metrics.md §8 SLOs and goodput)" in out
    result = json.loads((out_dir / "sweep.json").read_text())
    assert result["capacity"] == 8 and result["capacity_lower_bound"] is True
    # The console's tables are the page's: same columns, same units, same rows.
    page = Tables()
    page.feed((out_dir / "sweep.html").read_text())
    shown = console_tables(out)
    assert len(shown) == len(page.tables) == 2
    for table, text in zip(page.tables, shown, strict=True):
        assert table["body"] == text["body"]
        names, units = text["head"]
        page_names = [cell.split("|")[0] for cell in table["head"][0]]
        page_units = [cell.split("|")[1] for cell in table["head"][0]]
        assert page_names == names
        assert [unit for unit in page_units if unit] == units  # the verdict has none
    assert page.tables[0]["head"][0][:5] == [
        "load|req/s",
        "offered|req/s",
        "achieved|req/s",
        "keep-up|%",
        "throughput|req/s",
    ]
    assert page.tables[1]["head"][0][1] == "TTFT p90|ms <= 5000"
    rows = shown[0]["body"]
    assert [row[0] for row in rows] == ["4", "8"] and rows[0][-1] == "pass"
    # --quiet, and every step failing.
    assert quiet_code == 0, quiet_err
    assert quiet_err == ""
    assert "capacity: none, no step passed (lowest load tried: 4 req/s)" in quiet_out
    assert "failed steps:\n  load 4 req/s: p90 ttft " in quiet_out
    assert [row[-1] for row in console_tables(quiet_out)[0]["body"]] == ["FAIL", "FAIL"]


def test_the_sidecars_cpu_is_every_process_of_it() -> None:
    from sidecar.replay.admin import AdminError, cpu_seconds_of

    # The collector's own (1.5 s) and two workers' user and system: 1.5 + 2.25 + 0.5 + 0.75
    # = 5.0; other samples, and metrics whose names merely begin alike, do not count.
    exposition = """# HELP process_cpu_seconds_total Total user and system CPU time in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 1.5
# HELP sidecar_worker_cpu_seconds_total CPU each worker process used.
# TYPE sidecar_worker_cpu_seconds_total counter
sidecar_worker_cpu_seconds_total{worker="0",mode="user"} 2.25
sidecar_worker_cpu_seconds_total{worker="0",mode="system"} 0.5
sidecar_worker_cpu_seconds_total{worker="1",mode="user"} 0.75
sidecar_worker_cpu_seconds_total{worker="1",mode="system"} 0.0
# HELP sidecar_requests_total Requests.
# TYPE sidecar_requests_total counter
sidecar_requests_total{model="m"} 99.0
# HELP process_cpu_seconds_limit Not a CPU sample.
# TYPE process_cpu_seconds_limit gauge
process_cpu_seconds_limit 7.0
"""
    assert cpu_seconds_of(exposition) == pytest.approx(5.0)
    with pytest.raises(AdminError, match="no process_cpu_seconds_total"):
        cpu_seconds_of("# TYPE sidecar_requests_total counter\nsidecar_requests_total 3\n")
    with pytest.raises(AdminError, match="does not parse"):
        cpu_seconds_of("process_cpu_seconds_total{ 1\n")
