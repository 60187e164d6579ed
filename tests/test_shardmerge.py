"""`sidecar merge` (shardmerge.py, the library; merge_cli.py, the command): the shards of one
sharded replay, recomputed from their raw records."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
from test_replay import args_for

from sidecar import stats
from sidecar.record import RequestRecord, Vantage
from sidecar.replay import compare, merge_cli, replay_cli, shardmerge
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas
from sidecar.tracefile import TraceHeader, TraceRequest, write_trace

# One xdist worker runs the whole module (pyproject.toml: --dist loadgroup): the sharded
# replay (`sharded`, module-scoped) runs once.
pytestmark = pytest.mark.xdist_group("test_shardmerge")

SHARDS = 3


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """One 12-request trace replayed by 3 shards with one common start, against one simulator
    (its engine step grows with the batch, so shards' requests really share the engine)."""
    tmp = tmp_path_factory.mktemp("sharded")
    trace = tmp / "t.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [TraceRequest(t=i * 0.015, n_in=8 + i, n_out=2 + i % 4) for i in range(12)],
    )

    async def replay() -> list[int]:
        replicas = await start_replicas(
            SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0005)), 1
        )
        start_at = time.time() + 1.0
        try:
            return list(
                await asyncio.gather(
                    *(
                        replay_cli.run(
                            args_for(
                                trace,
                                replicas[0].url,
                                repeats=1,
                                output_dir=tmp / f"shard-{i}",
                                shard_index=i,
                                shard_count=SHARDS,
                                start_at=start_at,
                                slo="ttft=1s,tpot=200ms",
                            )
                        )
                        for i in range(SHARDS)
                    )
                )
            )
        finally:
            await close_replicas(replicas)

    assert asyncio.run(replay()) == [0] * SHARDS
    return [tmp / f"shard-{i}" for i in range(SHARDS)]


def merge_args(shards: list[Path], out: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    merge_cli.add_arguments(parser)
    return parser.parse_args([*map(str, shards), "--output-dir", str(out), *extra])


def records_of(directory: Path) -> list[RequestRecord]:
    lines = (directory / "records-run0.jsonl").read_text().splitlines()
    return [RequestRecord.from_dict(json.loads(line)["record"]) for line in lines]


def test_the_merged_report_is_recomputed_over_the_union(
    sharded: list[Path], tmp_path: Path
) -> None:
    out = tmp_path / "merged"
    assert asyncio.run(merge_cli.run(merge_args(sharded, out))) == 0
    report = json.loads((out / "report.json").read_text())
    shard_reports = [json.loads((d / "report.json").read_text()) for d in sharded]
    union = [r for d in sharded for r in records_of(d)]
    assert len(union) == 12 and report["completed"] == 12 and report["failed"] == 0
    # Totals add up; percentiles are those of the union (numpy's linear interpolation, as
    # every report states), not anything made of the shards' percentiles.
    assert (
        report["total_output_tokens"]
        == sum(2 + i % 4 for i in range(12))
        == sum(s["total_output_tokens"] for s in shard_reports)
    )
    ttft_ms = [
        m.ttft_s * 1000
        for r in union
        if (m := stats.request_metrics(r, Vantage.CLIENT)) and m.ttft_s is not None
    ]
    assert len(ttft_ms) == 12
    assert report["median_ttft_ms"] == pytest.approx(float(np.percentile(ttft_ms, 50)))
    assert report["p99_ttft_ms"] == pytest.approx(float(np.percentile(ttft_ms, 99)))
    assert report["request_goodput"] is not None  # the shards' SLO, from their envelopes
    # Duration: from the common start to the last end over all shards.
    assert report["duration"] == pytest.approx(max(s["duration"] for s in shard_reports))
    # The exact peak of the union is at least each shard's (vllm bench's per-second count
    # is not: the union's buckets start at another instant).
    assert report["max_in_flight_requests"] >= max(
        s["max_in_flight_requests"] for s in shard_reports
    )
    envelope = report["envelope"]
    assert envelope["requests"] == 12
    assert envelope["shard"] == {"count": 3, "merged": [0, 1, 2]}
    assert [m["requests"] for m in report["merged_from"]] == [4, 4, 4]
    merged_lines = [
        json.loads(line) for line in (out / "records-run0.jsonl").read_text().splitlines()
    ]
    assert sorted(line["shard"] for line in merged_lines) == [0] * 4 + [1] * 4 + [2] * 4
    # The merged directory is a report `sidecar compare` reads like any replay's.
    kind, loaded = compare.load_result(str(out))
    assert kind == "replay" and loaded["completed"] == 12


def test_what_is_not_one_experiment_is_refused(
    sharded: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A shard missing.
    assert asyncio.run(merge_cli.run(merge_args(sharded[:2], tmp_path / "a"))) == 3
    assert "shard(s) [2] of 3 missing" in capsys.readouterr().err
    # A shard given twice.
    assert asyncio.run(merge_cli.run(merge_args([*sharded, sharded[0]], tmp_path / "b"))) == 3
    assert "[0] given more than once" in capsys.readouterr().err
    # --force merges what it can and keeps the warning in the report.
    assert asyncio.run(merge_cli.run(merge_args(sharded[:2], tmp_path / "c", "--force"))) == 0
    forced = json.loads((tmp_path / "c" / "report.json").read_text())
    assert forced["completed"] == 8 and "missing" in forced["merge_warnings"][0]
    # A shard of another experiment (another model), and one without a common start.
    other = tmp_path / "other"
    other.mkdir()
    report = json.loads((sharded[2] / "report.json").read_text())
    report["envelope"]["model"] = "another"
    report["envelope"]["start_at"] = None
    (other / "report.json").write_text(json.dumps(report))
    (other / "records-run0.jsonl").write_text((sharded[2] / "records-run0.jsonl").read_text())
    assert asyncio.run(merge_cli.run(merge_args([*sharded[:2], other], tmp_path / "d"))) == 3
    err = capsys.readouterr().err
    assert "envelope 'model' is 'another'" in err and "one --start-at" in err
    # No raw records: nothing to merge from (exit 2, says what is missing).
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "report.json").write_text((sharded[0] / "report.json").read_text())
    assert asyncio.run(merge_cli.run(merge_args([bare, *sharded[1:]], tmp_path / "e"))) == 2
    assert "raw records of run 0 are missing" in capsys.readouterr().err


def test_the_merged_report_is_judged_by_the_shards_lateness_threshold(
    sharded: list[Path], tmp_path: Path
) -> None:
    """The union's sender lateness, judged by the --max-lateness the shards were run with:
    0 ms marks it degraded (every send is some nanoseconds late), off never does."""
    for threshold, expected in ((0.0, True), (None, False)):
        copies = []
        for shard in sharded:
            copy = tmp_path / f"{threshold}-{shard.name}"
            copy.mkdir()
            for file in shard.iterdir():
                (copy / file.name).write_bytes(file.read_bytes())
            report = json.loads((copy / "report.json").read_text())
            report["max_lateness_ms"] = threshold
            (copy / "report.json").write_text(json.dumps(report))
            copies.append(copy)
        out = tmp_path / f"merged-{threshold}"
        assert asyncio.run(merge_cli.run(merge_args(copies, out))) == 0
        merged = json.loads((out / "report.json").read_text())
        assert merged["degraded"] is expected and merged["max_lateness_ms"] == threshold
        assert (merged["degraded_reason"] or "").startswith(
            "sender lateness p99 " if expected else ""
        )
        assert merged["runs"][0]["degraded"] is expected


def test_a_script_merges_shards_in_one_call(sharded: list[Path], tmp_path: Path) -> None:
    """merge_shards + write_outputs: the command's work as calls, refusals as exceptions."""
    merged = shardmerge.merge_shards(sharded)
    assert merged.warnings == () and merged.report["completed"] == 12
    assert merged.report["envelope"]["slo"] == "ttft=1s,tpot=200ms"  # the shards' own
    assert [len(run) for run in merged.runs] == [12]
    assert sorted(shard for shard, _ in merged.runs[0]) == [0] * 4 + [1] * 4 + [2] * 4
    path = shardmerge.write_outputs(merged, tmp_path / "out")
    assert path == tmp_path / "out" / "report.json"
    assert json.loads(path.read_text())["completed"] == 12
    assert len((tmp_path / "out" / "records-run0.jsonl").read_text().splitlines()) == 12
    with pytest.raises(shardmerge.MergeRefused) as refused:
        shardmerge.merge_shards(sharded[:2])
    assert refused.value.reasons == ["shard(s) [2] of 3 missing"]
    forced = shardmerge.merge_shards(sharded[:2], slo="ttft=2s", force=True)
    assert forced.warnings == ("shard(s) [2] of 3 missing",)
    assert forced.report["merge_warnings"] == ["shard(s) [2] of 3 missing"]
    assert forced.report["envelope"]["slo"] == "ttft=2s"
    with pytest.raises(shardmerge.MergeError, match="--slo"):
        shardmerge.merge_shards(sharded, slo="nonsense")
    with pytest.raises(shardmerge.MergeError, match="no readable report.json"):
        shardmerge.merge_shards([tmp_path / "nowhere"])
