"""Our records under other tools' definitions: hand-worked values for each formula."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from factories import build_record, build_sent

from sidecar.realvllm import Home
from sidecar.record import Outcome, RequestRecord
from sidecar.replay import replay_cli
from sidecar.replay.peers import (
    offered_arrivals,
    peer_values,
    vllm_bench_counters,
    vllm_bench_json,
    vllm_bench_peaks,
    vllm_bench_server_keys,
)
from sidecar.replay.report import run_report
from sidecar.replay.runner import SentRequest
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas
from sidecar.tracefile import TraceHeader, TraceRequest, write_trace

# One xdist worker runs the whole module (pyproject.toml: --dist loadgroup): the exports
# (`vllm_exports`, module-scoped) are made once.
pytestmark = pytest.mark.xdist_group("test_peers")


def record(marks_ms: list[tuple[float, int]], n_out: int, end_ms: float) -> RequestRecord:
    """A completion of 10 input tokens and ``n_out`` output tokens (from usage)."""
    return build_record(marks_ms, endpoint="completions", n_in=10, n_out=n_out, end_ms=end_ms)


def test_each_tool_formula_by_hand() -> None:
    # Chunks at 100 ms (2 tokens), 130 ms (1), 170 ms (3); N_out = 6; stream ends at 175 ms.
    values = peer_values([record([(100, 2), (130, 1), (170, 3)], 6, 175)])

    def one(name: str) -> float:
        (value,) = values[name]
        return value

    assert one("vllm.ttft") == pytest.approx(0.100)
    assert values["vllm.itl"] == pytest.approx([0.030, 0.040])
    assert one("vllm.tpot") == pytest.approx(0.070 / 5)
    assert one("vllm.e2el") == pytest.approx(0.170)
    assert one("aiperf.ttst") == pytest.approx(0.030)
    assert one("aiperf.itl") == pytest.approx(0.070 / (6 - 2))  # minus first-chunk tokens
    assert one("guidellm.itl") == pytest.approx(0.070 / 5)  # = vLLM's TPOT
    assert one("guidellm.tpot") == pytest.approx(0.170 / 6)  # includes TTFT
    assert one("guidellm.request_latency") == pytest.approx(0.175)
    assert one("inference_perf.ntpot") == pytest.approx(0.175 / 6)
    # Per-token instants: 100, 100, 130, 170, 170, 170 ms.
    assert values["inference_perf.itl"] == pytest.approx([0.0, 0.030, 0.040, 0.0, 0.0])
    assert one("inference_perf.tpot") == pytest.approx(0.070 / 5)


def test_a_peer_metric_that_is_ours_takes_our_value_and_definition() -> None:
    """peers.py states a peer only where it differs: vLLM's TTFT, ITL, TPOT and E2EL (and
    their AIPerf / GuideLLM twins) are ours, from `stats.request_samples`."""
    from sidecar import stats
    from sidecar.record import Vantage
    from sidecar.replay.peers import FORMULAS, SAME_AS_OURS

    records = [record([(100, 2), (130, 1), (170, 3)], 6, 175), record([(80, 1)], 1, 85)]
    values = peer_values(records)
    samples = stats.request_samples(records, Vantage.CLIENT)
    assert values["vllm.tpot"] == values["guidellm.itl"] == samples.defined("tpot").tolist()
    assert values["aiperf.icl"] == samples.itl_s.tolist()
    assert all(FORMULAS[name].startswith("= our ") for name in SAME_AS_OURS)


def test_single_token_replies_split_the_tools() -> None:
    values = peer_values([record([(80, 1)], 1, 85)])
    assert values["vllm.ttft"] == pytest.approx([0.080])  # vLLM: has a TTFT
    assert values["inference_perf.ttft"] == []  # inference-perf: needs two token stamps
    assert values["vllm.tpot"] == [] and values["aiperf.itl"] == []


async def test_replay_reports_peer_definitions_and_exports_vllm_json(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [TraceRequest(t=i * 0.01, n_in=8, n_out=4) for i in range(5)],
    )
    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0)), 1
    )
    out, vllm_json = tmp_path / "out", tmp_path / "vllm.json"
    import argparse

    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            str(trace),
            "--target",
            replicas[0].url,
            "--repeats",
            "1",
            "--no-progress",
            "--output-dir",
            str(out),
            "--peer-definitions",
            "--export-vllm-bench",
            str(vllm_json),
        ]
    )
    try:
        assert await replay_cli.run(args) == 0
    finally:
        await close_replicas(replicas)
    report = json.loads((out / "report.json").read_text())
    peers = report["peer_definitions"]["metrics"]
    assert peers["guidellm.tpot"]["formula"].endswith("(includes TTFT)")
    assert peers["vllm.ttft"]["count"] == 5 and peers["aiperf.itl"]["count"] == 5
    exported = json.loads(vllm_json.read_text())
    assert exported["completed"] == 5 and exported["output_lens"] == [4] * 5
    assert len(exported["itls"]) == 5 and all(len(x) == 3 for x in exported["itls"])
    assert "p99_ttft_ms" in exported and "mean_itl_ms" in exported


# -- `--export-vllm-bench`: vllm bench serve's result JSON -----------------------------------

# Every key `vllm bench serve --save-result --save-detailed` writes for a generation run with
# its default options, and the type of each value once the file is loaded back, as read from
# vLLM 0.32.0's vllm/benchmarks/serve.py: `main_async` writes the setup keys (date ..
# max_concurrency), `benchmark()` the result dict (duration .. rtfx), then its
# `process_one_metric` mean/median/std and one key per --metric-percentiles value (default 99)
# for each of --percentile-metrics (default ttft, tpot, itl). Without --save-detailed it drops
# input_lens, output_lens, start_times, ttfts, itls, generated_texts and errors (latencies and
# queue_times stay). Keys it writes only under other options or servers (--metadata,
# --ramp-up-*, --probe-request-rate, speculative decoding, diffusion models) are not listed.
NONE = type(None)
FLOATS, INTS, STRS = "list[float]", "list[int]", "list[str]"
VLLM_BENCH_KEYS: dict[str, Any] = {
    "date": str,
    "endpoint_type": str,
    "backend": str,
    "label": (str, NONE),
    "model_id": str,
    "tokenizer_id": (str, NONE),
    "num_prompts": int,
    "request_rate": (float, str),  # a float, or the string "inf"
    "burstiness": float,
    "max_concurrency": (int, NONE),
    "duration": float,
    "completed": int,
    "failed": int,
    "total_input_tokens": int,
    "total_output_tokens": int,
    "request_throughput": float,
    "request_goodput": (float, NONE),  # None without --goodput
    "output_throughput": float,
    "total_token_throughput": float,
    "input_lens": INTS,
    "output_lens": INTS,
    "ttfts": FLOATS,
    "itls": "list[list[float]]",
    "latencies": FLOATS,
    "start_times": FLOATS,
    "queue_times": FLOATS,
    "generated_texts": STRS,
    "errors": STRS,
    "max_output_tokens_per_s": float,
    "max_concurrent_requests": int,
    "rtfx": float,
    **{
        f"{stat}_{metric}_ms": float
        for metric in ("ttft", "tpot", "itl")
        for stat in ("mean", "median", "std", "p99")
    },
}


def has_type(value: Any, expected: Any) -> bool:
    if expected == FLOATS:
        return isinstance(value, list) and all(type(v) is float for v in value)
    if expected == INTS:
        return isinstance(value, list) and all(type(v) is int for v in value)
    if expected == STRS:
        return isinstance(value, list) and all(type(v) is str for v in value)
    if expected == "list[list[float]]":
        return isinstance(value, list) and all(has_type(v, FLOATS) for v in value)
    return type(value) in (expected if isinstance(expected, tuple) else (expected,))


def vllm_bench_buckets(
    start_times: list[float],
    latencies: list[float],
    ttfts: list[float],
    itls: list[list[float]],
    ok: list[bool],
) -> tuple[float, int]:
    """vLLM 0.32.0's `calculate_metrics` peak computation, transcribed from its source, run on
    an export's per-request lists."""
    outputs = [
        (s, lat, t, i)
        for s, lat, t, i, good in zip(start_times, latencies, ttfts, itls, ok, strict=True)
        if good
    ]
    min_start_time = min(s for s, *_ in outputs)
    max_end_time = max(s + lat for s, lat, *_ in outputs)
    duration_seconds = int(np.ceil(max_end_time - min_start_time)) + 1
    tokens_per_second = np.zeros(duration_seconds)
    concurrent_requests_per_second = np.zeros(duration_seconds)
    for start_time, latency, ttft, itl in outputs:
        token_times = [start_time + ttft]
        current_time = token_times[0]
        for itl_value in itl:
            current_time += itl_value
            token_times.append(current_time)
        for token_time in token_times:
            second_bucket = int(token_time - min_start_time)
            if 0 <= second_bucket < duration_seconds:
                tokens_per_second[second_bucket] += 1
        request_start_second = int(start_time - min_start_time)
        request_end_second = int((start_time + latency) - min_start_time)
        for second in range(request_start_second, request_end_second + 1):
            concurrent_requests_per_second[second] += 1
    return float(np.max(tokens_per_second)), int(np.max(concurrent_requests_per_second))


def sent_request(index: int, send_s: float, chunks_s: list[float], ok: bool = True) -> SentRequest:
    end_ms = (chunks_s[-1] if chunks_s else 0.01) * 1000
    rec = record([(c * 1000, 1) for c in chunks_s], len(chunks_s), end_ms)
    if not ok:
        rec = dataclasses.replace(rec, outcome=Outcome.HTTP_ERROR, error_type="boom")
    return build_sent(index, send_s * 1000, rec)


def test_vllm_bench_peaks_are_per_second_buckets_and_the_exact_peak_is_kept() -> None:
    """Two requests that never overlap, in one second: vllm bench's per-second count says 2,
    the exact peak 1. A failed request counts in neither of vllm bench's figures (it does in
    the exact one); each chunk counts one "token" in its second."""
    sent = [
        sent_request(0, 0.1, [0.05, 0.1, 0.2]),
        sent_request(1, 0.5, [0.1, 0.3]),
        sent_request(2, 1.2, [0.1]),
        sent_request(3, 0.15, [0.05], ok=False),
    ]
    assert vllm_bench_peaks(sent) == (5.0, 2)
    report = run_report(sent, mode="open")
    assert report["max_concurrent_requests"] == 2
    assert report["max_in_flight_requests"] == 2  # 0.15-0.2: requests 0 and 3 (failed)
    assert run_report(sent[:3], mode="open")["max_in_flight_requests"] == 1
    lists = vllm_bench_json({"envelope": {"mode": "open"}}, sent)
    assert vllm_bench_buckets(
        lists["start_times"],
        lists["latencies"],
        lists["ttfts"],
        lists["itls"],
        [e == "" for e in lists["errors"]],
    ) == (5.0, 2)


def test_a_traces_arrivals_are_stated_as_vllm_bench_states_a_load() -> None:
    """A replay on the trace's own times: request_rate is their mean rate, (n - 1) / span, and
    burstiness the moment estimate of the Gamma shape of the gaps (mean^2 / variance)."""

    def scheduled(*times_s: float) -> list[SentRequest]:
        return [sent_request(i, t, [0.01]) for i, t in enumerate(times_s)]

    gaps = [0.1, 0.3, 0.2]  # at 0, 0.1, 0.4, 0.6: mean gap 0.2, variance 0.02 / 3
    rate, burstiness, how = offered_arrivals({"mode": "open"}, scheduled(0.0, 0.1, 0.4, 0.6))
    assert rate == pytest.approx(3 / 0.6)
    assert burstiness == pytest.approx(np.mean(gaps) ** 2 / np.var(gaps))
    assert how.startswith("the trace's own arrival times")
    assert offered_arrivals({"mode": "open"}, scheduled(0.5, 0.5))[:2] == ("inf", 1.0)
    assert offered_arrivals({"mode": "open"}, scheduled(0.0, 0.1, 0.2))[1] == float("inf")
    assert offered_arrivals({"mode": "open", "rate": 8, "burstiness": 0.25}, scheduled(0.0))[
        :2
    ] == (8.0, 0.25)
    assert offered_arrivals({"mode": "closed"}, scheduled(0.0))[:2] == ("inf", 1.0)


def test_vllm_bench_reads_speculative_decoding_counters_as_vllm_bench_does() -> None:
    def exposition(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> str:
        lines = [
            "# HELP vllm:spec_decode_num_drafts_total drafts",
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}.0',
            f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {draft_tokens}.0',
            f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}.0',
            "vllm:spec_decode_num_drafts_created 1.7e9",
        ]
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",'
            f'position="{i}"}} {n}.0'
            for i, n in enumerate(per_pos)
        ]
        return "\n".join(lines) + "\n"

    before = vllm_bench_counters(exposition(10, 30, 12, [6, 4, 2]))
    after = vllm_bench_counters(exposition(30, 90, 42, [22, 14, 6]))
    assert vllm_bench_counters("vllm:num_requests_running 3\n") == {
        "spec_decode": None,
        "diffusion": None,
    }
    keys = vllm_bench_server_keys(before, after, 2.0)
    assert keys == {
        "spec_decode_acceptance_rate": pytest.approx(30 / 60 * 100),
        "spec_decode_acceptance_length": pytest.approx(1 + 30 / 20),
        "spec_decode_num_drafts": 20,
        "spec_decode_draft_tokens": 60,
        "spec_decode_accepted_tokens": 30,
        "spec_decode_per_position_acceptance_rates": pytest.approx([16 / 20, 10 / 20, 4 / 20]),
    }
    assert vllm_bench_server_keys(before, before, 2.0) == {}  # no drafts: vllm writes none
    assert vllm_bench_server_keys(None, None, 2.0) == {}


@pytest.fixture(scope="module")
def vllm_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`sidecar replay --export-vllm-bench` as a user runs it, against `sidecar sim`: a Gamma
    arrival process on /v1/completions with an SLO, and closed loop on /v1/chat/completions."""
    tmp = tmp_path_factory.mktemp("vllm-bench")
    trace = tmp / "t.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [TraceRequest(t=i * 0.02, n_in=8 + i, n_out=2 + i % 3) for i in range(8)],
    )
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "sim",
            "--one-process",
            "--port",
            "0",
            "--step-floor-s",
            "0.002",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    exports = {"completions": tmp / "completions.json", "chat": tmp / "chat.json"}
    try:
        assert sim.stdout is not None
        match = re.search(r"listening on (http://\S+)", sim.stdout.readline())
        assert match is not None
        common = [
            sys.executable,
            "-m",
            "sidecar",
            "replay",
            str(trace),
            "--target",
            match.group(1),
            "--repeats",
            "1",
            "--no-progress",
        ]
        # The two replays are independent (each its own export; the simulator serves both):
        # they run side by side.
        replays = [
            subprocess.Popen(
                [*common, *extra, "--export-vllm-bench", str(exports[name])],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name, extra in (
                ("completions", ["--rate", "40", "--burstiness", "0.5", "--slo", "ttft=5s"]),
                ("chat", ["--endpoint", "chat", "--max-concurrency", "2"]),
            )
        ]
        for replay in replays:
            try:
                _, stderr = replay.communicate(timeout=120)
            finally:
                if replay.returncode is None:
                    replay.kill()
                    replay.communicate()
            assert replay.returncode == 0, stderr
    finally:
        sim.terminate()
        sim.wait(timeout=15)
        for stream in (sim.stdout, sim.stderr):
            if stream is not None:
                stream.close()
    return exports


def test_the_export_has_every_key_vllm_bench_writes_with_its_type(
    vllm_exports: dict[str, Path],
) -> None:
    for name, path in vllm_exports.items():
        with path.open("rb") as handle:  # as vllm's sweep reads a result (sweep/serve.py)
            exported = json.load(handle)
        missing = sorted(set(VLLM_BENCH_KEYS) - set(exported))
        assert missing == [], (name, missing)
        wrong = {
            key: repr(exported[key])[:60]
            for key, expected in VLLM_BENCH_KEYS.items()
            if not has_type(exported[key], expected)
        }
        assert wrong == {}, (name, wrong)
        # vllm bench's own key order for what it writes first.
        assert list(exported)[:10] == list(VLLM_BENCH_KEYS)[:10]
        assert exported["request_rate"] == "inf" or isinstance(exported["request_rate"], float)
        n = exported["num_prompts"]
        assert n == 8 and all(
            len(exported[key]) == n
            for key in (
                "input_lens",
                "output_lens",
                "ttfts",
                "itls",
                "latencies",
                "start_times",
                "queue_times",
                "generated_texts",
                "errors",
            )
        )


def test_the_export_means_what_vllm_bench_means(vllm_exports: dict[str, Path]) -> None:
    completions = json.loads(vllm_exports["completions"].read_text())
    chat = json.loads(vllm_exports["chat"].read_text())
    assert (completions["backend"], completions["endpoint_type"]) == ("openai", "openai")
    assert (chat["backend"], chat["endpoint_type"]) == ("openai-chat", "openai-chat")
    assert re.fullmatch(r"\d{8}-\d{6}", completions["date"])
    assert completions["model_id"] == chat["model_id"] == "sim-model"
    # The load as vllm bench states it: a rate and a Gamma shape, or everything released at
    # once with a concurrency limit.
    assert (
        completions["request_rate"],
        completions["burstiness"],
        completions["max_concurrency"],
    ) == (40.0, 0.5, None)
    assert (chat["request_rate"], chat["burstiness"], chat["max_concurrency"]) == ("inf", 1.0, 2)
    assert completions["request_goodput"] is not None and chat["request_goodput"] is None
    for exported in (completions, chat):
        assert exported["completed"] == 8 and exported["failed"] == 0
        assert exported["output_lens"] == [2 + i % 3 for i in range(8)]
        assert exported["total_output_tokens"] == sum(exported["output_lens"])
        assert exported["total_input_tokens"] == sum(exported["input_lens"])
        # A success's latency is its last chunk: vllm bench's timeline rebuilds it as
        # ttft + sum(itls) (serve.py, --plot-timeline).
        for latency, ttft, itl in zip(
            exported["latencies"], exported["ttfts"], exported["itls"], strict=True
        ):
            assert latency == pytest.approx(ttft + sum(itl), abs=1e-6)
        # The peaks, recomputed from the export's own lists by vllm bench's code.
        ok = [error == "" for error in exported["errors"]]
        assert vllm_bench_buckets(
            exported["start_times"], exported["latencies"], exported["ttfts"], exported["itls"], ok
        ) == (exported["max_output_tokens_per_s"], exported["max_concurrent_requests"])
        assert 1 <= exported["sidecar_max_in_flight_requests"] <= 8
        assert (
            exported["generated_texts"] == [""] * 8
            and "generated_texts" in exported["sidecar_not_measured"]
        )
        assert exported["rtfx"] == 0.0 and exported["tokenizer_id"] is None
    assert chat["sidecar_max_in_flight_requests"] <= 2
    assert completions["input_lens"] == [8 + i for i in range(8)]  # completions: exact
    # Waiting for the concurrency limit: closed loop from the start; open loop has none.
    assert completions["queue_times"] == [0.0] * 8
    assert chat["queue_times"] == pytest.approx(chat["start_times"])
    assert sorted(chat["queue_times"])[2] > 0  # the third request waited for a slot


VLLM_READERS = r"""
import json, sys
from pathlib import Path

from vllm.benchmarks.plot import construct_timeline_data
from vllm.benchmarks.sweep.param_sweep import ParameterSweepItem
from vllm.benchmarks.sweep.plot import (PlotBinners, PlotFilters, _convert_inf_nan_strings,
                                        _json_load_bytes, plot)
from vllm.benchmarks.sweep.plot_pareto import _prepare_records, plot_pareto
from vllm.benchmarks.sweep.serve import _update_run_data

out = {}
for name, export in zip(sys.argv[2::2], sys.argv[3::2]):
    # sweep/serve.py run_benchmark: the result file read back and annotated.
    with Path(export).open("rb") as f:
        run_data = json.load(f)
    run_data = _update_run_data(run_data, ParameterSweepItem(), ParameterSweepItem(), 0)
    directory = Path(sys.argv[1]) / name
    directory.mkdir()
    with (directory / "summary.json").open("w") as f:
        json.dump([run_data], f, indent=4)
    # sweep plot and plot_pareto read summary.json the same way (dry run: no pandas here).
    plot(directory, directory / "fig", ["backend"], ["model_id"], ["max_concurrency"],
         ["request_rate"], var_x="request_throughput", var_y="p99_ttft_ms",
         filter_by=PlotFilters(), bin_by=PlotBinners(), scale_x=None, scale_y=None,
         dry_run=True)
    plot_pareto(directory, None, None, ["request_rate"], dry_run=True)
    records = _convert_inf_nan_strings(_json_load_bytes(directory / "summary.json"))
    prepared, skipped = _prepare_records(records, user_count_var=None, gpu_count_var=None)
    # serve.py's --plot-timeline: per-request data from the detailed lists.
    r = run_data
    per_request = [{"start_time": r["start_times"][i], "ttft": r["ttfts"][i],
                    "itl": r["itls"][i],
                    "latency": r["ttfts"][i] + sum(r["itls"][i]) if r["itls"][i]
                    else r["ttfts"][i],
                    "prompt_len": r["input_lens"][i], "output_tokens": r["output_lens"][i]}
                   for i in range(len(r["start_times"]))]
    timeline = construct_timeline_data(per_request, [0.025, 0.05], ["a", "b", "c"])
    out[name] = {"skipped": skipped, "user_count": prepared[0]["user_count_estimate"],
                 "tokens_per_user": prepared[0]["tokens_per_user"],
                 "segments": len(timeline)}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_vllms_own_readers_load_the_export(vllm_exports: dict[str, Path], tmp_path: Path) -> None:
    """vLLM's result readers, run from its wheel on the exports: the sweep's reading and
    annotating of a result, its plot and Pareto plot over summary.json (dry runs: the venv has
    no pandas), and --plot-timeline's per-request table."""
    home = Home.resolve()
    if not home.venv_ready():
        reason = f"vLLM venv not installed at {home.venv} (`sidecar vllm up` installs it)"
        if os.environ.get("SIDECAR_REQUIRE_VLLM_VENV"):  # .ci/run's run after the install
            pytest.fail(reason)
        pytest.skip(reason)
    argv = [str(home.python), "-c", VLLM_READERS, str(tmp_path)]
    for name, path in vllm_exports.items():
        argv += [name, str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    completions = json.loads(vllm_exports["completions"].read_text())
    chat = json.loads(vllm_exports["chat"].read_text())
    # Pareto's users per run: its request_rate ("inf" read as infinity).
    assert result["completions"] == {
        "skipped": 0,
        "user_count": 40.0,
        "tokens_per_user": pytest.approx(completions["output_throughput"] / 40.0),
        "segments": 8 + sum(len(itl) for itl in completions["itls"]),
    }
    assert result["chat"]["user_count"] == float("inf")  # as for vllm bench's own closed loop
    assert result["chat"]["segments"] == 8 + sum(len(itl) for itl in chat["itls"])
