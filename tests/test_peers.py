"""Our records under other tools' definitions: hand-worked values for each formula."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.record import ChunkMark, Outcome, RequestRecord, Timeline, TokenSource
from sidecar.replay import replay_cli
from sidecar.replay.peers import peer_values
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas
from sidecar.tracefile import TraceHeader, TraceRequest, write_trace

MS = 1_000_000


def record(marks: list[tuple[float, int]], n_out: int, end_ms: float) -> RequestRecord:
    return RequestRecord(
        request_id="r", wall_time_ns=0, outcome=Outcome.OK, endpoint="completions",
        client=Timeline.from_marks(0, tuple(ChunkMark(int(t * MS), n) for t, n in marks),
                                   int(end_ms * MS), len(marks)),
        n_in=10, n_out=n_out, token_source=TokenSource.USAGE)


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


def test_single_token_replies_split_the_tools() -> None:
    values = peer_values([record([(80, 1)], 1, 85)])
    assert values["vllm.ttft"] == pytest.approx([0.080])  # vLLM: has a TTFT
    assert values["inference_perf.ttft"] == []  # inference-perf: needs two token stamps
    assert values["vllm.tpot"] == [] and values["aiperf.itl"] == []


async def test_replay_reports_peer_definitions_and_exports_vllm_json(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, TraceHeader(source="test"),
                [TraceRequest(t=i * 0.01, n_in=8, n_out=4) for i in range(5)])
    replicas = await start_replicas(SimConfig(model="m", engine=EngineConfig(
        step_floor_s=0.002, per_token_s=0.0)), 1)
    out, vllm_json = tmp_path / "out", tmp_path / "vllm.json"
    import argparse

    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    args = parser.parse_args([str(trace), "--target", replicas[0].url, "--repeats", "1",
                              "--no-progress", "--output-dir", str(out), "--peer-definitions",
                              "--export-vllm-bench", str(vllm_json)])
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
