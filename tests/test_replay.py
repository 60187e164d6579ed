"""Replay: schedules, request building, open vs closed loop, capture -> replay fidelity."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from proxy_stack import stack

from sidecar import clock
from sidecar.engine_metrics import parse_engine_metrics
from sidecar.replay import replay_cli, session
from sidecar.replay.payload import (
    PayloadError,
    TokenCalibration,
    TokenIds,
    build_body,
    parse_token_id_range,
    token_prompt,
)
from sidecar.replay.runner import PlannedRequest, Sender, open_loop
from sidecar.replay.schedule import gamma_schedule, poisson_schedule, trace_schedule
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas
from sidecar.tracefile import PrefixBlocks, TraceHeader, TraceReader, TraceRequest, write_trace


def test_trace_schedule_sorts_shifts_and_scales() -> None:
    assert trace_schedule([10.0, 12.0, 11.0], time_scale=2.0) == [0.0, 0.5, 1.0]
    assert trace_schedule([]) == []
    with pytest.raises(ValueError, match="time_scale"):
        trace_schedule([1.0], time_scale=0)


def test_gamma_schedule_keeps_the_rate_and_sets_the_burstiness() -> None:
    for burstiness in (0.25, 1.0, 4.0):
        times = gamma_schedule(20_001, rate=50.0, burstiness=burstiness, seed=3)
        gaps = np.diff(times)
        assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.05)
        # Gamma(k): coefficient of variation 1/sqrt(k).
        assert gaps.std() / gaps.mean() == pytest.approx(1 / burstiness**0.5, rel=0.06)
    assert poisson_schedule(5, 10.0, seed=1) == gamma_schedule(5, 10.0, 1.0, seed=1)
    assert gamma_schedule(5, 10.0, seed=1) != gamma_schedule(5, 10.0, seed=2)
    with pytest.raises(ValueError, match="rate"):
        gamma_schedule(3, rate=0.0)


def test_token_prompts_are_exact_and_share_what_the_hashes_share() -> None:
    a = TraceRequest(t=0, n_in=100, n_out=4, prefix=PrefixBlocks("tokens", 32, (7, 8, 9, 10)))
    b = TraceRequest(t=0, n_in=70, n_out=4, prefix=PrefixBlocks("tokens", 32, (7, 8, 11)))
    pa, pb = token_prompt(a, unique_key=1), token_prompt(b, unique_key=2)
    assert len(pa) == 100 and len(pb) == 70
    assert pa[:64] == pb[:64] and pa[64:70] != pb[64:70]
    # Characters: blocks of ceil(n_in / len(hashes)) tokens.
    c = TraceRequest(t=0, n_in=10, n_out=1, prefix=PrefixBlocks("chars", 256, (7, 99)))
    d = TraceRequest(t=0, n_in=10, n_out=1, prefix=PrefixBlocks("chars", 256, (7, 98)))
    assert token_prompt(c, 1)[:5] == token_prompt(d, 2)[:5]
    assert token_prompt(c, 1)[5:] != token_prompt(d, 2)[5:]
    # No prefix information: unique prompts, still exact length.
    e = TraceRequest(t=0, n_in=50, n_out=1)
    assert len(token_prompt(e, 1)) == 50 and token_prompt(e, 1) != token_prompt(e, 2)
    assert all(1000 <= t < 30000 for t in pa + pb + token_prompt(e, 1))  # the default range


def test_token_prompts_use_only_the_ids_they_are_given() -> None:
    """A target with a small vocabulary (the real tiny model: 8192 ids) must never get an id
    outside it: prompts are drawn from the ids its tokenizer produced, or a range given."""
    valid = TokenIds(ids=(5, 17, 300, 8000), source="test")
    a = TraceRequest(t=0, n_in=100, n_out=4, prefix=PrefixBlocks("tokens", 32, (7, 8, 9, 10)))
    b = TraceRequest(t=0, n_in=70, n_out=4, prefix=PrefixBlocks("tokens", 32, (7, 8, 11)))
    pa, pb = token_prompt(a, 1, valid), token_prompt(b, 2, valid)
    assert set(pa) | set(pb) <= {5, 17, 300, 8000} and len(set(pa)) == 4
    assert len(pa) == 100 and pa[:64] == pb[:64] and pa[64:70] != pb[64:70]
    ranged = parse_token_id_range("10:20")
    assert set(token_prompt(a, 1, ranged)) <= set(range(10, 21))
    assert ranged.describe() == {"source": "--token-id-range 10:20", "min": 10, "max": 20}
    path, body = build_body(a, index=0, model="m", token_ids=valid)
    assert path == "/v1/completions" and set(body["prompt"]) <= {5, 17, 300, 8000}
    for bad in ("10", "a:b", "20:10", "-1:5"):
        with pytest.raises(ValueError, match="--token-id-range"):
            parse_token_id_range(bad)


def test_bodies_reproduce_the_work_or_are_sent_verbatim() -> None:
    line = TraceRequest(t=0, n_in=20, n_out=7, temperature=0.0)
    path, body = build_body(line, index=0, model="m")
    assert path == "/v1/completions" and len(body["prompt"]) == 20
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["stream"] is True
    path, body = build_body(
        line,
        index=0,
        model="m",
        endpoint="chat",
        calibration=TokenCalibration(tokens_per_word=2.0, chat_overhead=4),
    )
    assert path == "/v1/chat/completions"
    assert len(body["messages"][0]["content"].split()) == 8  # (20 - 4) / 2 words
    captured = TraceRequest(
        t=0, endpoint="chat", body={"model": "old", "messages": [], "top_p": 0.3}
    )
    path, body = build_body(captured, index=0, model="new")
    assert body == {"model": "new", "messages": [], "top_p": 0.3}
    with pytest.raises(PayloadError, match="n_in"):
        build_body(TraceRequest(t=0, n_out=3), index=0, model="m")


def args_for(trace: Path, target: str, **extra: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    argv = [str(trace), "--target", target, "--no-progress"]
    for key, value in extra.items():
        argv.append("--" + key.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return parser.parse_args(argv)


async def engine_hits(url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        values, _ = parse_engine_metrics(await response.text())
    return values["prefix_cache_hits"]


async def test_capture_then_replay_reproduces_arrivals_lengths_and_prefix_sharing(
    tmp_path: Path,
) -> None:
    capture = tmp_path / "cap"
    # The original traffic: 30 completions with token-id prompts; groups of requests share a
    # long prefix (a system prompt), at known arrival instants.
    rng = np.random.default_rng(5)
    system_prompts = [list(rng.integers(1000, 30000, 256)) for _ in range(3)]
    plan = []
    for i in range(30):
        prompt = [int(t) for t in system_prompts[i % 3]] + [
            int(t) for t in rng.integers(1000, 30000, 40 + i)
        ]
        plan.append(
            PlannedRequest(
                i,
                0.03 * i,
                "/v1/completions",
                {
                    "model": "m",
                    "prompt": prompt,
                    "max_tokens": 3 + i % 5,
                    "ignore_eos": True,
                    "stream": i % 2 == 0,
                },
            )
        )
    async with stack(capture_dir=str(capture), capture_block_tokens="16") as s:
        async with aiohttp.ClientSession() as session:
            original = await open_loop(
                Sender(s.url, session), plan, clock.monotonic_ns() + 20_000_000
            )
        await s.records.wait_for(30)
        original_hits = await engine_hits(s.replicas[0].url)
    (trace,) = sorted(capture.glob("capture-*.jsonl"))
    lines = TraceReader(trace).requests()
    assert len(lines) == 30

    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0)), 1
    )
    out = tmp_path / "out"
    try:
        code = await replay_cli.run(args_for(trace, replicas[0].url, repeats=1, output_dir=out))
        assert code == 0
        replay_hits = await engine_hits(replicas[0].url)
    finally:
        await close_replicas(replicas)
    report = json.loads((out / "report.json").read_text())
    replayed = [json.loads(line) for line in (out / "records-run0.jsonl").read_text().splitlines()]
    assert report["completed"] == 30 and report["failed"] == 0
    # The prompts were drawn from ids the target's own tokenizer produced.
    assert report["envelope"]["prompt_token_ids"]["source"] == "the target's /tokenize"
    assert report["envelope"]["prompt_token_ids"]["distinct_ids"] >= 32
    # Input and output lengths exactly, request by request (in arrival order).
    by_arrival = sorted(lines, key=lambda r: r.t)
    assert [r["record"]["n_in"] for r in replayed] == [r.n_in for r in by_arrival]
    assert [r["record"]["n_out"] for r in replayed] == [r.n_out for r in by_arrival]
    assert [r.n_in for r in by_arrival] == [len(p.body["prompt"]) for p in plan]
    # Arrival times: the replay was scheduled on exactly the captured arrivals, and sent
    # within its own measured lateness of them.
    captured = np.array([r.t for r in by_arrival])
    scheduled = np.array([r["scheduled_ns"] for r in replayed]) / 1e9
    assert np.allclose(scheduled, captured - captured[0], atol=1e-6)
    lateness = np.array([r["actual_ns"] - r["scheduled_ns"] for r in replayed]) / 1e9
    sent = np.array([r["actual_ns"] for r in replayed]) / 1e9
    assert np.allclose(sent - sent[0], (captured - captured[0]) + lateness - lateness[0], atol=1e-6)
    # And the capture itself recorded the original arrivals (up to the original sender's
    # lateness and the proxy's receive path: loose bound, this is a timing figure).
    original_at = np.array([o.actual_ns for o in original]) / 1e9
    assert np.max(np.abs(np.diff(original_at) - np.diff(captured))) < 0.1
    # Prefix sharing: the replayed prompts share blocks where the originals did, so the
    # simulator's prefix cache hits about as many tokens (block rounding aside).
    assert original_hits > 0
    assert replay_hits == pytest.approx(original_hits, rel=0.15)
    assert report["envelope"]["engine_delta"]["prefix_cache_hits"] == replay_hits


async def test_workers_share_one_schedule(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [TraceRequest(t=i * 0.01, n_in=8, n_out=2) for i in range(40)],
    )
    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0)), 1
    )
    out = tmp_path / "out"
    try:
        code = await replay_cli.run(
            args_for(trace, replicas[0].url, repeats=1, workers=2, output_dir=out, slo="ttft=2s")
        )
    finally:
        await close_replicas(replicas)
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["completed"] == 40 and report["total_output_tokens"] == 80
    assert report["slo_attainment"] == 1.0
    lines = [json.loads(line) for line in (out / "records-run0.jsonl").read_text().splitlines()]
    assert sorted(line["index"] for line in lines) == list(range(40))
    assert sorted(line["scheduled_ns"] for line in lines) == [i * 10_000_000 for i in range(40)]
    # One common start, set once both workers were ready: neither worker's half runs late by
    # its process start-up (seconds when spawned). Loose bound: a timing figure.
    for worker in (0, 1):
        late = [
            line["actual_ns"] - line["scheduled_ns"]
            for line in lines
            if line["index"] % 2 == worker
        ]
        assert statistics.median(late) < 300_000_000


def test_vllm_bench_keys_and_cli_errors(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, TraceHeader(source="test"), [TraceRequest(t=0, n_in=5, n_out=2)])
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "replay",
            str(tmp_path / "no.jsonl"),
            "--target",
            "http://127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "cannot read" in bad.stderr
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    bad = subprocess.run(
        [sys.executable, "-m", "sidecar", "replay", str(csv), "--target", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "sidecar trace import" in bad.stderr


async def test_report_has_vllm_bench_keys(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [TraceRequest(t=i * 0.01, n_in=8, n_out=3) for i in range(6)],
    )
    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0)), 1
    )
    out = tmp_path / "out"
    try:
        assert (
            await replay_cli.run(args_for(trace, replicas[0].url, repeats=3, output_dir=out)) == 0
        )
    finally:
        await close_replicas(replicas)
    report = json.loads((out / "report.json").read_text())
    for key in (
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_itl_ms",
        "median_e2el_ms",
        "max_concurrent_requests",
    ):
        assert key in report, key
    assert len(report["runs"]) == 3 and 0 <= report["median_run"] < 3
    assert report["total_output_tokens"] == 18 and report["mode"] == "open"
    assert sorted(p.name for p in out.iterdir()) == [
        "records-run0.jsonl",
        "records-run1.jsonl",
        "records-run2.jsonl",
        "report.json",
    ]


async def test_shards_split_one_trace_and_keep_its_clock(tmp_path: Path) -> None:
    import time as _time

    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [TraceRequest(t=10.0 + i * 0.02, n_in=6, n_out=2) for i in range(9)],
    )
    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0)), 1
    )
    outs = [tmp_path / f"out{i}" for i in range(3)]
    start_at = _time.time() + 1.0
    try:
        codes = await asyncio.gather(
            *(
                replay_cli.run(
                    args_for(
                        trace,
                        replicas[0].url,
                        repeats=1,
                        output_dir=outs[i],
                        shard_index=i,
                        shard_count=3,
                        start_at=start_at,
                    )
                )
                for i in range(3)
            )
        )
    finally:
        await close_replicas(replicas)
    assert codes == [0, 0, 0]
    scheduled = []
    for i, out in enumerate(outs):
        lines = [json.loads(x) for x in (out / "records-run0.jsonl").read_text().splitlines()]
        # Shard i took requests i, i+3, i+6, scheduled on the trace's own clock.
        scheduled += [line["scheduled_ns"] for line in lines]
        assert [line["scheduled_ns"] for line in lines] == [
            pytest.approx((i + 3 * k) * 20_000_000, abs=1000) for k in range(3)
        ]
    assert len(scheduled) == 9


def one_line_trace(tmp_path: Path) -> Path:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, TraceHeader(source="test"), [TraceRequest(t=0, n_in=5, n_out=2)])
    return trace


def sidecar_command(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python -m sidecar ...` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *argv], capture_output=True, text=True, timeout=60
    )


SWEEP_ONE_STEP = ("sweep", "--slo", "ttft=1s", "--dataset", "random:in=8,out=4", "--rates", "1")


def test_a_target_that_is_down_is_called_unreachable(tmp_path: Path) -> None:
    """Not "no model: pass --model": nothing answers there, and the message says so."""
    trace = one_line_trace(tmp_path)
    for command in (("replay", str(trace), "--no-progress"), SWEEP_ONE_STEP):
        done = sidecar_command(*command, "--target", "http://127.0.0.1:9")
        assert done.returncode == 2, done.stderr
        assert "http://127.0.0.1:9 is unreachable" in done.stderr
        assert "pass --model" not in done.stderr and "Traceback" not in done.stderr


def test_output_paths_are_checked_before_the_first_request(tmp_path: Path) -> None:
    """A run of hours must not end in "No such file": replay's --output-dir and export files
    and sweep's --output-dir are tried before anything is sent (the target here is down, so a
    late check would have shown up as failed requests instead)."""
    trace = one_line_trace(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    replay = ["replay", str(trace), "--model", "m", "--no-progress"]
    runs = [
        [*replay, "--output-dir", str(blocker / "out")],
        [*replay, "--export-llmd", str(tmp_path / "no" / "x.json")],
        [*replay, "--export-vllm-bench", str(blocker / "x.json")],
        [*SWEEP_ONE_STEP, "--model", "m", "--output-dir", str(blocker / "out")],
    ]
    for argv in runs:
        done = sidecar_command(*argv, "--target", "http://127.0.0.1:9")
        assert done.returncode == 2, (argv, done.stderr)
        assert "cannot write to" in done.stderr and "Traceback" not in done.stderr


def test_a_replay_where_nothing_succeeded_exits_non_zero(tmp_path: Path) -> None:
    trace = one_line_trace(tmp_path)
    done = sidecar_command(
        "replay",
        str(trace),
        "--model",
        "m",
        "--target",
        "http://127.0.0.1:9",
        "--repeats",
        "1",
        "--no-progress",
    )
    assert done.returncode == 1, done.stderr
    assert "no request succeeded (ClientConnectorError x1)" in done.stderr


def test_a_target_without_a_scheme_is_refused_at_once(tmp_path: Path) -> None:
    trace = one_line_trace(tmp_path)
    for command in (("replay", str(trace), "--no-progress"), SWEEP_ONE_STEP):
        done = sidecar_command(*command, "--target", "127.0.0.1:9")
        assert done.returncode == 2, done.stderr
        assert (
            "--target must be an http(s) URL like http://127.0.0.1:8000: '127.0.0.1:9'"
            in done.stderr
        )


async def sidecar_async(*argv: str) -> tuple[int, str, str]:
    """`python -m sidecar ...` while this test's event loop keeps serving a simulator."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_a_real_capture_with_a_failed_request_replays_what_it_can(tmp_path: Path) -> None:
    """The README's path, capture -> lint -> replay, on a capture with a 404 for a mistyped
    model among good requests: the failed request has no prompt size (the server never counted
    it), so replay skips that line, says which and why on one line, counts it in the report,
    and replays the rest; lint names the same line with the same reason."""
    capture = tmp_path / "cap"
    async with stack(capture_dir=str(capture)) as s, aiohttp.ClientSession() as session:
        for model in ("m", "m", "mistyped", "m"):
            async with session.post(
                s.url + "/v1/completions",
                json={"model": model, "prompt": "count to three", "max_tokens": 3, "stream": True},
            ) as response:
                await response.read()
                assert response.status == (404 if model == "mistyped" else 200)
        await s.records.wait_for(4)
    (trace,) = sorted(capture.glob("capture-*.jsonl"))
    failed_line = 4  # the header is line 1
    assert TraceReader(trace).requests()[2].http_status == 404

    code, out, err = await sidecar_async("trace", "lint", str(trace))
    assert code == 0, out + err
    assert (
        "warning: cannot-replay:" in out
        and f"line {failed_line}: n_in missing: prompt size unknown" in out
    )

    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0)), 1
    )
    try:
        code, out, err = await sidecar_async(
            "replay",
            str(trace),
            "--target",
            replicas[0].url,
            "--repeats",
            "1",
            "--no-progress",
            "--output-dir",
            str(tmp_path / "out"),
            "--slo",
            "ttft=5s",
        )
    finally:
        await close_replicas(replicas)
    assert code == 0, err
    assert (
        f"sidecar replay: skipped 1 of 4 trace lines that cannot be replayed: line "
        f"{failed_line} (n_in missing: prompt size unknown)\n"
    ) in err
    assert "Traceback" not in err
    # The console table says the SLO as a person writes it, not as a Python dict.
    assert "(attainment 100.0%; SLO ttft<=5000ms)" in out and "{" not in out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["completed"] == 3 and report["failed"] == 0
    assert report["envelope"]["model"] == "m"
    assert report["envelope"]["skipped_lines"] == {
        "count": 1,
        "of": 4,
        "lines": [{"line": failed_line, "reason": "n_in missing: prompt size unknown"}],
    }

    # A capture of nothing but failed requests: nothing to replay, and both commands say so.
    only_failed = tmp_path / "failed.jsonl"
    with open(trace) as source:
        header, *requests = source.read().splitlines()
    only_failed.write_text(f"{header}\n{requests[2]}\n")
    code, out, err = await sidecar_async("trace", "lint", str(only_failed))
    assert code == 1 and "error: nothing-to-replay:" in out, out + err
    code, out, err = await sidecar_async(
        "replay", str(only_failed), "--target", "http://127.0.0.1:9", "--no-progress"
    )
    assert code == 2, err
    assert (
        f"{only_failed}: none of its 1 request lines can be replayed: line 2 (n_in "
        f"missing: prompt size unknown)"
    ) in err


def test_replay_and_lint_skip_the_same_lines_for_the_same_reasons(tmp_path: Path) -> None:
    """One rule for both: each kind of line replay cannot rebuild, and the kinds it can (a
    failed request whose sizes are known is part of the workload; a captured body is sent as
    it is)."""
    from sidecar.replay.tracelint import lint_trace

    lines = [
        TraceRequest(t=0.0, n_in=5, n_out=2),
        TraceRequest(t=0.1, n_in=0, n_out=2),
        TraceRequest(t=0.2, n_out=2),
        TraceRequest(t=0.3, n_in=5),
        TraceRequest(t=0.4, n_in=5, max_tokens=3, outcome="http_error", http_status=500),
        TraceRequest(t=0.5, body={"prompt": "hi", "max_tokens": 2}),
    ]
    trace = tmp_path / "t.jsonl"
    write_trace(trace, TraceHeader(source="test"), lines)
    sendable, skipped = session.split_replayable(
        list(TraceReader(trace).numbered()), use_captured_body=True
    )
    assert [r.t for r in sendable] == [0.0, 0.4, 0.5]
    assert skipped == [
        session.SkippedLine(3, "n_in=0: prompt size unknown"),
        session.SkippedLine(4, "n_in missing: prompt size unknown"),
        session.SkippedLine(5, "n_out and max_tokens missing: output length unknown"),
    ]
    (finding,) = [f for f in lint_trace(trace).findings if f.code == "cannot-replay"]
    assert finding.examples == [f"line {s.line}: {s.reason}" for s in skipped]
    assert session.skipped_summary(skipped, 6, str(trace)) == (
        "skipped 3 of 6 trace lines that cannot be replayed: line 3 (n_in=0: prompt size "
        "unknown), line 4 (n_in missing: prompt size unknown), line 5 (n_out and max_tokens "
        "missing: output length unknown)"
    )
    _, skipped_without_bodies = session.split_replayable(
        list(TraceReader(trace).numbered()), use_captured_body=False
    )
    assert skipped_without_bodies[-1] == session.SkippedLine(7, "n_in missing: prompt size unknown")


def test_a_request_of_n_choices_is_rebuilt_with_its_n() -> None:
    """n_out counts the tokens of every choice: n = 2 and n_out = 10 is two choices of 5 (it
    was once sent as one choice of 10); without n_out, the captured max_tokens is per choice."""
    _, body = build_body(TraceRequest(t=0, n_in=8, n_out=10, n=2), index=0, model="m")
    assert body["n"] == 2 and body["max_tokens"] == 5
    _, body = build_body(TraceRequest(t=0, n_in=8, max_tokens=7, n=3), index=0, model="m")
    assert body["n"] == 3 and body["max_tokens"] == 7
    _, body = build_body(TraceRequest(t=0, n_in=8, n_out=7), index=0, model="m")
    assert "n" not in body and body["max_tokens"] == 7


async def test_replaying_a_capture_of_n_choices_does_the_same_work(tmp_path: Path) -> None:
    """A capture without bodies of n = 2 requests, replayed as a user runs it: the target
    generates as many tokens as the capture recorded."""
    trace = tmp_path / "n2.jsonl"
    write_trace(
        trace,
        TraceHeader(source="capture"),
        [
            TraceRequest(t=0.05 * i, endpoint="completions", model="m", n_in=8, n_out=12, n=2)
            for i in range(4)
        ],
    )
    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.001, per_token_s=0.0)), 1
    )
    try:
        code, out, err = await sidecar_async(
            "replay",
            str(trace),
            "--target",
            replicas[0].url,
            "--repeats",
            "1",
            "--quiet",
            "--output-dir",
            str(tmp_path / "out"),
        )
    finally:
        await close_replicas(replicas)
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["completed"] == 4
    assert report["total_output_tokens"] == 4 * 12  # two choices of 6 tokens each


# -- progress on stderr -------------------------------------------------------------------------


def test_progress_lines_say_how_far_a_run_has_got() -> None:
    """The words of the display, at instants given by hand: waiting for --start-at, then
    counts, rate and ETA, then the final line."""
    from sidecar.replay.progress import Counts, ProgressDisplay

    now = [100.0]
    counts = [Counts(0, 0, 0)]
    display = ProgressDisplay(
        "run 1/3",
        600,
        lambda: counts[0],
        starts_at=142.0,
        waiting_for="--start-at (2030-01-01 00:00:00 UTC)",
        tty=False,
        clock=lambda: now[0],
    )
    assert display.line(counts[0], now[0]) == (
        "run 1/3: waiting for --start-at (2030-01-01 00:00:00 UTC), starts in 0:42"
    )
    counts[0] = Counts(sent=130, finished=120, failed=2)
    assert display.line(counts[0], 152.0) == (
        "run 1/3: 120/600 finished, 130 sent, 2 failed, 12.0 req/s, 0:10 elapsed, ETA 0:40"
    )
    assert display.line(Counts(600, 600, 3), 192.0, final=True) == (
        "run 1/3: 600/600 finished, 600 sent, 3 failed, 12.0 req/s, in 0:50"
    )
    assert display.line(Counts(2, 0, 0), 143.0) == (
        "run 1/3: 0/600 finished, 2 sent, 0 failed, - req/s, 0:01 elapsed, ETA -"
    )


@pytest.mark.slow
async def test_a_replay_shows_its_progress_on_stderr_and_keeps_stdout_the_report(
    tmp_path: Path,
) -> None:
    """Not a terminal (a log): a line at the end of each run (and one every 10 s of a longer
    one), on stderr; stdout is the report alone. `--quiet`: no progress at all. Waiting for
    --start-at is said at once."""
    import time

    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [
            TraceRequest(t=0.02 * i, endpoint="completions", model="m", n_in=8, n_out=3)
            for i in range(10)
        ],
    )
    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.001, per_token_s=0.0)), 1
    )
    try:
        code, out, err = await sidecar_async(
            "replay", str(trace), "--target", replicas[0].url, "--repeats", "2"
        )
        assert code == 0, err
        for run in (1, 2):
            assert f"run {run}/2: 10/10 finished, 10 sent, 0 failed, " in err
        assert out.startswith("mode ") and "finished" not in out
        code, out, err = await sidecar_async(
            "replay", str(trace), "--target", replicas[0].url, "--repeats", "1", "--quiet"
        )
        assert code == 0 and "finished" not in err and out.startswith("mode ")
        # Rounded as it is passed (to the ms): the CLI reads "...53.9997" as "...54.000", which
        # names the next second when the fraction is above .9995.
        start_at = round(time.time() + 2.5, 3)
        code, out, err = await sidecar_async(
            "replay",
            str(trace),
            "--target",
            replicas[0].url,
            "--repeats",
            "1",
            "--start-at",
            f"{start_at:.3f}",
        )
    finally:
        await close_replicas(replicas)
    assert code == 0, err
    first, *_ = err.splitlines()
    assert first.startswith(
        "run 1/1: waiting for --start-at ("
        + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start_at))
    ), err
    assert "starts in 0:0" in first
    assert "run 1/1: 10/10 finished" in err


async def test_on_a_terminal_the_progress_is_a_bar_that_fits_it(tmp_path: Path) -> None:
    """stderr a terminal 80 columns wide (a pseudo-terminal): rich draws a bar, redrawn in
    place, no line of it wider than the terminal; stdout, a pipe here, is the report alone."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [
            TraceRequest(t=0.05 * i, endpoint="completions", model="m", n_in=8, n_out=3)
            for i in range(30)
        ],
    )
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))

    def drain() -> bytes:
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.001, per_token_s=0.0)), 1
    )
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        env["TERM"] = "xterm-256color"
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sidecar",
            "replay",
            str(trace),
            "--target",
            replicas[0].url,
            "--repeats",
            "1",
            stdout=asyncio.subprocess.PIPE,
            stderr=slave,
            env=env,
        )
        os.close(slave)
        reading = asyncio.get_running_loop().run_in_executor(None, drain)
        out, _ = await asyncio.wait_for(process.communicate(), 120)
        screen = (await asyncio.wait_for(reading, 30)).decode()
    finally:
        os.close(master)
        await close_replicas(replicas)
    assert process.returncode == 0, screen
    assert out.decode().startswith("mode ")
    assert "━" in screen  # the bar
    visible = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    drawn = [part for part in re.split(r"[\r\n]+", visible) if part.strip()]
    assert drawn[-1].startswith("run 1/1 ") and "30/30 finished, 30 sent, 0 failed" in drawn[-1]
    assert max(len(part) for part in drawn) <= 80, drawn


LATE_RE = (
    r"sender lateness p99 > --max-lateness 0 ms in run 1 \([\d.]+ ms\) and run 2 "
    r"\([\d.]+ ms\) of 2: the sender fell behind its schedule, so those runs did not "
    r"offer the load they claim"
)


@pytest.mark.slow
async def test_a_replay_whose_sender_fell_behind_is_degraded_and_compare_refuses_it(
    tmp_path: Path,
) -> None:
    """--max-lateness 0ms: every open-loop send is some nanoseconds behind its instant, so the
    sender is "behind" in every run, deterministically. The console says so on one line, the
    report has degraded/degraded_reason/max_lateness_ms (each run too), and compare refuses to
    call the run better or worse (exit 3, one line) unless --force. `off` never marks; closed
    loop has no schedule to be late for."""
    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [TraceRequest(t=i * 0.01, n_in=8, n_out=3) for i in range(6)],
    )
    late, fine, closed = tmp_path / "late", tmp_path / "fine", tmp_path / "closed"
    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0)), 1
    )
    try:
        replay = (
            "replay",
            str(trace),
            "--target",
            replicas[0].url,
            "--repeats",
            "2",
            "--no-progress",
        )
        code, out, err = await sidecar_async(
            *replay, "--output-dir", str(late), "--max-lateness", "0ms"
        )
        assert code == 0, err
        code, fine_out, err = await sidecar_async(
            *replay, "--output-dir", str(fine), "--max-lateness", "off"
        )
        assert code == 0, err
        assert (
            await replay_cli.run(
                args_for(
                    trace,
                    replicas[0].url,
                    repeats=1,
                    max_concurrency=2,
                    max_lateness="0ms",
                    output_dir=closed,
                )
            )
            == 0
        )
    finally:
        await close_replicas(replicas)
    (line,) = [x for x in out.splitlines() if x.startswith("DEGRADED: ")]
    assert re.fullmatch("DEGRADED: " + LATE_RE, line), line
    report = json.loads((late / "report.json").read_text())
    assert report["degraded"] is True and report["max_lateness_ms"] == 0.0
    assert report["degraded_reason"] == line.removeprefix("DEGRADED: ")
    for run in report["runs"]:
        assert run["degraded"] is True and run["max_lateness_ms"] == 0.0
        assert re.fullmatch(
            r"sender lateness p99 [\d.]+ ms > --max-lateness 0 ms: the sender "
            r"fell behind its schedule, so the run did not offer the load it "
            r"claims",
            run["degraded_reason"],
        )
    assert "DEGRADED" not in fine_out
    for directory in (fine, closed):
        other = json.loads((directory / "report.json").read_text())
        assert other["degraded"] is False and other["degraded_reason"] is None
    assert json.loads((fine / "report.json").read_text())["max_lateness_ms"] is None

    code, out, err = await sidecar_async("compare", str(fine), str(late))
    assert code == 3 and out == ""
    (refusal,) = err.splitlines()
    assert re.fullmatch(
        rf"sidecar compare: refused: B \({re.escape(str(late))}\) is degraded: "
        rf"{LATE_RE}; a run that did not offer its load is not called better "
        r"or worse \(--force compares anyway\)",
        refusal,
    ), refusal
    code, out, err = await sidecar_async("compare", str(fine), str(late), "--force")
    assert code == 0, err
    assert f"WARNING: degraded (--force): B ({late}) is degraded: sender lateness" in out
    assert "median_e2el_ms" in out


def test_max_lateness_needs_a_duration(tmp_path: Path) -> None:
    done = sidecar_command(
        "replay",
        str(one_line_trace(tmp_path)),
        "--target",
        "http://127.0.0.1:9",
        "--max-lateness",
        "5",
    )
    assert done.returncode == 2
    assert "sidecar replay: --max-lateness: a duration needs a unit: '5'" in done.stderr
