"""A replay from a script (replay/session.py): the calls `sidecar replay` makes, made with a
`ReplayOptions`, over real sockets to the built-in simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.replay import session
from sidecar.replay.options import ReplayOptions, UsageError
from sidecar.replay.report import console_table
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas
from sidecar.tracefile import TraceHeader, TraceRequest, write_trace

FAST = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0))


def a_trace(path: Path) -> Path:
    write_trace(
        path,
        TraceHeader(source="test"),
        [
            *(TraceRequest(t=i * 0.02, n_in=16 + i, n_out=3) for i in range(8)),
            TraceRequest(t=0.5, n_in=0, n_out=3),  # no prompt size: skipped and counted
        ],
    )
    return path


async def test_a_script_replays_a_trace_and_writes_what_the_command_writes(
    tmp_path: Path,
) -> None:
    trace = a_trace(tmp_path / "t.jsonl")
    replicas = await start_replicas(FAST, 1)
    out = tmp_path / "out"
    notices: list[str] = []
    try:
        options = ReplayOptions(
            str(trace), replicas[0].url + "/", repeats=2, quiet=True, output_dir=str(out)
        )
        result = await session.replay(options, notify=notices.append)
    finally:
        await close_replicas(replicas)
    # The notice the command prints on stderr, handed to the script instead.
    assert notices == [
        "sidecar replay: skipped 1 of 9 trace lines that cannot be replayed: line 10 "
        "(n_in=0: prompt size unknown)"
    ]
    report = result.report
    assert report["completed"] == 8 and report["failed"] == 0 and len(report["runs"]) == 2
    assert result.failure() is None and len(result.reported) == 8
    envelope = report["envelope"]
    assert envelope["target"] == replicas[0].url and envelope["model"] == "m"
    assert envelope["skipped_lines"]["count"] == 1 and envelope["mode"] == "open"
    assert [s.record.n_in for s in result.reported] == [16 + i for i in range(8)]
    assert "completed" in console_table(report).lower()
    session.write_outputs(result)
    assert json.loads((out / "report.json").read_text())["completed"] == 8
    assert len((out / "records-run1.jsonl").read_text().splitlines()) == 8


async def test_prepare_then_send_is_the_command_s_order(tmp_path: Path) -> None:
    trace = a_trace(tmp_path / "t.jsonl")
    replicas = await start_replicas(FAST, 1)
    try:
        options = ReplayOptions(str(trace), replicas[0].url, repeats=1, quiet=True, limit=4)
        prepared = await session.prepare(options, notify=lambda _: None)
        # Planned before anything is sent: the workload, the model, the schedule.
        assert len(prepared.plan.requests) == 4 and prepared.envelope["model"] == "m"
        async with session.live_metrics(prepared) as counters:
            assert counters is None  # no --metrics-listen
            result = await session.send(prepared, counters=counters)
    finally:
        await close_replicas(replicas)
    assert result.report["completed"] == 4


async def test_a_replay_with_nothing_that_answers_fails_with_the_target_named(
    tmp_path: Path,
) -> None:
    trace = a_trace(tmp_path / "t.jsonl")
    with pytest.raises(UsageError, match="http://127.0.0.1:9 is unreachable"):
        await session.prepare(
            ReplayOptions(str(trace), "http://127.0.0.1:9", quiet=True), notify=lambda _: None
        )
    with pytest.raises(UsageError, match="--repeats and --workers must be >= 1"):
        await session.prepare(ReplayOptions(str(trace), "http://127.0.0.1:9", repeats=0))
    with pytest.raises(UsageError, match="--target must be an http"):
        await session.prepare(ReplayOptions(str(trace), "127.0.0.1:9"), notify=lambda _: None)
