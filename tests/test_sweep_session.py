"""A sweep from a script (replay/sweep_session.py): `run_sweep` with a `SweepOptions`, over
real sockets to the built-in simulator, as `sidecar sweep` runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.replay import sweep_session
from sidecar.replay.options import SweepOptions, UsageError
from sidecar.replay.sweep import console_report
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas


def test_sweep_options_hold_one_source_and_one_way_to_pick_loads() -> None:
    target = "http://127.0.0.1:8000"
    options = SweepOptions(target, "ttft=1s", dataset="synthetic:in=8,out=2", rates=(4.0, 1.0, 2.0))
    assert options.rates == (1.0, 2.0, 4.0)  # run in increasing order, as --rates sorts them
    for bad, message in (
        ({"rates": (1,)}, "one of --trace and --dataset"),
        ({"dataset": "synthetic:in=8,out=2"}, "one of --rates and --auto"),
        ({"dataset": "synthetic:in=8,out=2", "rates": (1,), "auto": True}, "one of --rates"),
        ({"dataset": "synthetic:in=8,out=2", "rates": (0,)}, "every load must be a number > 0"),
        ({"dataset": "synthetic:in=8,out=2", "auto": True, "mode": "half"}, "--mode"),
    ):
        with pytest.raises(UsageError, match=message):
            SweepOptions(target, "ttft=1s", **bad)


def test_the_admin_token_comes_from_the_environment_and_is_never_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SIDECAR_ADMIN_TOKEN", "s3cret")
    options = SweepOptions("http://x:1", "ttft=1s", dataset="synthetic:in=8,out=2", auto=True)
    assert options.admin_token == "s3cret" and "s3cret" not in repr(options)


@pytest.mark.slow
async def test_a_script_sweeps_and_writes_what_the_command_writes(tmp_path: Path) -> None:
    sim = SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0))
    replicas = await start_replicas(sim, 1)
    notices: list[str] = []
    try:
        options = SweepOptions(
            replicas[0].url,
            "ttft=2s",
            dataset="synthetic:in=16,out=4",
            rates=(4, 8),
            step_duration="1s",
            min_requests=8,
            warmup=1,
            quiet=True,
        )
        result = await sweep_session.run_sweep(options, notify=notices.append)
    finally:
        await close_replicas(replicas)
    assert notices == []  # quiet: no step lines
    assert [s["load"] for s in result.report["steps"]] == [4.0, 8.0]
    assert all(s["passed"] for s in result.report["steps"]), result.report["steps"]
    assert result.capacity == 8.0 and result.report["envelope"]["model"] == "m"
    assert len(result.points) == sum(s["requests"] for s in result.report["steps"])
    assert "capacity" in console_report(result.report).lower()
    out = tmp_path / "out"
    sweep_session.write_outputs(result, out)
    assert json.loads((out / "sweep.json").read_text())["capacity"] == 8.0
    assert sorted(p.name for p in (out / "br").iterdir()) == ["step-4.json", "step-8.json"]
    report = json.loads((out / "br" / "step-8.json").read_text())
    # The script's options are the llm-d report's arguments, as a command line's would be.
    args = report["scenario"]["load"]["native"]["args"]
    assert args["--rates"] == [4.0, 8.0] and args["--dataset"] == "synthetic:in=16,out=4"
    assert "--admin-token" not in args
