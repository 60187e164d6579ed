"""llm-d benchmark report v0.2 export: formulas by hand, a real run checked field by field
against its own records, and every report checked against our reading of their schema."""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from br_v0_2 import SCHEMA, STAT_KEYS, errors
from factories import MS, S, build_record, build_sent, ns

from sidecar.record import Outcome
from sidecar.replay import llmd, replay_cli
from sidecar.replay.report import run_report
from sidecar.replay.runner import SentRequest
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas
from sidecar.stats import SLO, SLOPolicy
from sidecar.tracefile import TraceHeader, TraceRequest, write_trace

WALL = 1_700_000_000 * S  # 2023-11-14T22:13:20Z
STATISTICS_KEYS = {"units", "mean", "mode", "stddev", *STAT_KEYS}


def sent(
    index: int,
    actual_ms: float,
    marks: list[tuple[float, int]],
    *,
    n_in: int | None,
    n_out: int | None,
    end_ms: float,
    outcome: Outcome = Outcome.OK,
) -> SentRequest:
    """Request ``index`` of a run that started at `WALL`, sent on time ``actual_ms`` in."""
    record = build_record(
        marks,
        request_id=f"r{index}",
        wall_time_ns=WALL + ns(actual_ms),
        outcome=outcome,
        endpoint="completions",
        end_ms=end_ms,
        n_in=n_in,
        n_out=n_out,
    )
    return build_sent(index, actual_ms, record)


# A: sent at 0 ms, tokens at 100 (1), 130 (1), 170 (2) ms, 10 in / 4 out, ends at 175 ms.
# B: sent at 50 ms, tokens at 200 (1), 260 (1) ms, 20 in / 2 out, ends at 265 ms.
# C: sent at 100 ms, an HTTP error after 5 ms.
# The run lasts from 0 to the last end, 50 + 265 = 315 ms.
RUN = [
    sent(0, 0, [(100, 1), (130, 1), (170, 2)], n_in=10, n_out=4, end_ms=175),
    sent(1, 50, [(200, 1), (260, 1)], n_in=20, n_out=2, end_ms=265),
    sent(2, 100, [], n_in=None, n_out=None, end_ms=5, outcome=Outcome.HTTP_ERROR),
]
WORKLOAD = llmd.Workload(
    input_lengths=[10, 20, 30],
    output_lengths=[4, 4, 4],
    sampled=False,
    rate_qps=10.0,
    stage=2,
    description="by hand",
    args=llmd.native_args(
        {"rate": 10.0, "admin_token": "secret", "handler": print, "trace": "t.jsonl"}
    ),
    config={"mode": "open"},
)


def statistics_blocks(report: Any) -> Iterator[dict[str, Any]]:
    """Every BR Statistics in the request-performance aggregate."""
    aggregate = report["results"]["request_performance"]["aggregate"]
    for section in aggregate.values():
        for value in section.values():
            if isinstance(value, dict):
                yield value


def test_statistics_lengths_and_names_by_hand() -> None:
    block = llmd.statistics([100.0, 200.0, 300.0], "ms")
    assert block is not None
    assert block["units"] == "ms" and block["mean"] == pytest.approx(200.0)
    assert block["stddev"] == pytest.approx((20_000 / 3) ** 0.5)  # population std
    assert (block["min"], block["max"]) == (100.0, 300.0)
    # Linear interpolation: the q-th percentile sits at rank q/100 * (n - 1) = q/50.
    assert block["p25"] == pytest.approx(150.0) and block["p50"] == pytest.approx(200.0)
    assert block["p0p1"] == pytest.approx(100.2) and block["p99p9"] == pytest.approx(299.8)
    assert set(block) == STATISTICS_KEYS - {"mode"}
    assert llmd.statistics([], "ms") is None  # BR's Statistics needs a mean
    assert [llmd.stat_key(q) for q in (0.1, 1, 50, 99.9)] == ["p0p1", "p1", "p50", "p99p9"]
    assert llmd.sequence_length([64, 64, None]) == {"distribution": "fixed", "value": 64}
    assert llmd.sequence_length([10, 20, 30]) == {
        "distribution": "other",
        "value": 20.0,
        "min": 10,
        "max": 30,
    }
    assert llmd.sequence_length([None]) is None and llmd.sequence_length([0, 0]) is None
    assert llmd.iso_duration(49.97206) == "PT49.972S"
    assert llmd.iso_time(WALL + 315 * MS) == "2023-11-14T22:13:20.315Z"
    # No secret and nothing that is not a plain value goes into a report.
    assert WORKLOAD.args == {"--rate": 10.0, "--trace": "t.jsonl"}


def test_a_hand_built_run_field_by_field() -> None:
    assert run_report(RUN, mode="open")["duration"] == pytest.approx(0.315)
    policy = SLOPolicy({"default": SLO(ttft_s=0.150)})
    br = llmd.benchmark_report(
        RUN,
        duration_s=0.315,
        workload=WORKLOAD,
        slo_policy=policy,
        uid="u1",
        eid="e1",
        stack=[llmd.component("target", "vllm", "0.33.0", description="d", details={"model": "m"})],
    )
    assert errors(br) == []
    assert br["version"] == "0.2"
    assert br["run"] == {
        "uid": "u1",
        "eid": "e1",
        "time": {
            "start": "2023-11-14T22:13:20.000Z",
            "end": "2023-11-14T22:13:20.315Z",
            "duration": "PT0.315S",
        },
    }
    aggregate = br["results"]["request_performance"]["aggregate"]
    requests = aggregate["requests"]
    assert (requests["total"], requests["failures"]) == (3, 1)
    assert requests["input_length"]["mean"] == 15 and requests["input_length"]["stddev"] == 5
    assert requests["output_length"]["mean"] == 3 and requests["output_length"]["units"] == "count"
    latency = aggregate["latency"]
    ttft = latency["time_to_first_token"]
    assert ttft["units"] == "ms" and ttft["mean"] == pytest.approx(150)
    assert ttft["p90"] == pytest.approx(190) and ttft["stddev"] == pytest.approx(50)
    # TPOT: A (170 - 100) / (4 - 1), B (260 - 200) / (2 - 1).
    tpot = latency["time_per_output_token"]
    assert tpot["units"] == "ms/token"
    assert (tpot["min"], tpot["max"]) == (pytest.approx(70 / 3), pytest.approx(60))
    # ITL per event: A 30, 40; B 60.
    itl = latency["inter_token_latency"]
    assert itl["mean"] == pytest.approx(130 / 3) and itl["p50"] == pytest.approx(40)
    assert itl["p25"] == pytest.approx(35) and itl["p75"] == pytest.approx(50)
    # NTPOT = E2E / N_out: 170 / 4 and 260 / 2.
    ntpot = latency["normalized_time_per_output_token"]
    assert ntpot["mean"] == pytest.approx((42.5 + 130) / 2) and ntpot["units"] == "ms/token"
    assert latency["request_latency"]["mean"] == pytest.approx(215)
    throughput = aggregate["throughput"]
    assert throughput["input_token_rate"] == {
        "units": "tokens/s",
        "mean": pytest.approx(30 / 0.315),
    }
    assert throughput["output_token_rate"]["mean"] == pytest.approx(6 / 0.315)
    assert throughput["total_token_rate"]["mean"] == pytest.approx(36 / 0.315)
    assert throughput["request_rate"] == {"units": "queries/s", "mean": pytest.approx(2 / 0.315)}
    # The workload: requested lengths, the rate, the stage; never the secret argument.
    load = br["scenario"]["load"]
    assert load["standardized"] == {
        "tool": "vllm-sidecar",
        "tool_version": load["standardized"]["tool_version"],
        "source": "random",
        "stage": 2,
        "input_seq_len": {"distribution": "other", "value": 20.0, "min": 10, "max": 30},
        "output_seq_len": {"distribution": "fixed", "value": 4},
        "rate_qps": 10.0,
    }
    assert load["native"] == {
        "args": {"--rate": 10.0, "--trace": "t.jsonl"},
        "config": {"mode": "open"},
    }
    canonical = json.dumps(load["native"], sort_keys=True)
    assert load["metadata"]["cfg_id"] == hashlib.sha256(canonical.encode()).hexdigest()
    (component,) = br["scenario"]["stack"]
    assert component["metadata"]["kind"] == "generic"
    assert component["standardized"] == {"tool": "vllm", "tool_version": "0.33.0", "model": "m"}
    # Goodput under ttft <= 150 ms: A only (B is slow, C failed), over all 3 requests.
    ours = br["results"]["observability"]["vllm_sidecar"]
    goodput = ours["goodput"]
    assert (goodput["good_requests"], goodput["requests"]) == (1, 3)
    assert goodput["attainment"] == {"units": "fraction", "value": pytest.approx(1 / 3)}
    assert goodput["request_goodput"]["value"] == pytest.approx(1 / 0.315)
    assert goodput["good_output_token_rate"]["value"] == pytest.approx(4 / 0.315)
    assert goodput["slo"] == {"default": "ttft<=150ms"}
    assert ours["outcomes"]["ok"] == 2 and ours["outcomes"]["http_error"] == 1
    for block in statistics_blocks(br):  # pydantic would silently drop anything else there
        assert set(block) <= STATISTICS_KEYS


def test_our_schema_checker_refuses_what_llmd_would() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    good = llmd.benchmark_report(
        RUN,
        duration_s=0.315,
        workload=WORKLOAD,
        uid="u",
        stack=[llmd.component("target", "vllm", None, description="d")],
    )
    assert errors(good) == []

    def broken(change: Any) -> list[str]:
        doc = copy.deepcopy(good)
        change(doc)
        return errors(doc)

    aggregate = ("results", "request_performance", "aggregate")

    def at(doc: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        for key in path:
            doc = doc[key]
        return doc

    assert broken(lambda d: at(d, aggregate).update(goodput=1.0))  # extra="forbid"
    assert broken(lambda d: d.pop("run"))  # required
    assert broken(lambda d: d.update(version="0.1"))
    assert broken(
        lambda d: at(d, (*aggregate, "latency", "time_to_first_token")).update(units="ms/token")
    )  # TTFT is a time
    assert broken(
        lambda d: at(d, (*aggregate, "throughput", "request_rate")).update(units="tokens/s")
    )
    assert broken(lambda d: at(d, (*aggregate, "latency", "request_latency")).pop("mean"))
    assert broken(lambda d: at(d, (*aggregate, "requests")).update(total=-1))
    assert broken(lambda d: at(d, ("scenario", "load", "standardized")).update(rate_qps=0))
    assert broken(lambda d: at(d, ("scenario", "load", "standardized")).update(concurrency=2.5))
    assert broken(lambda d: at(d, ("scenario", "load", "standardized")).update(source="trace"))
    assert broken(
        lambda d: at(d, ("scenario", "load", "standardized", "input_seq_len")).update(value=0)
    )
    assert broken(lambda d: d["scenario"]["stack"][0]["standardized"].update(kind="generic"))
    assert broken(lambda d: d["scenario"]["stack"][0]["metadata"].update(kind="router"))
    assert broken(
        lambda d: d["scenario"]["stack"][0]["metadata"].update(kind="inference_engine")
    )  # then accelerator and role are required
    assert broken(lambda d: d["run"]["time"].update(start="yesterday"))
    # The open places stay open: Observability (extra="allow"), Statistics (extras ignored).
    assert not broken(lambda d: d["results"]["observability"].update(anything={"a": 1}))
    assert not broken(lambda d: at(d, (*aggregate, "latency", "request_latency")).update(p42=1.0))


async def test_a_replay_exports_its_median_run_field_by_field(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        TraceHeader(source="test"),
        [TraceRequest(t=0.0, n_in=12 + i % 3, n_out=3 + i % 4) for i in range(12)],
    )
    replicas = await start_replicas(
        SimConfig(model="m", engine=EngineConfig(step_floor_s=0.002, per_token_s=0.0)), 1
    )
    out, br_path = tmp_path / "out", tmp_path / "br.json"
    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            str(trace),
            "--target",
            replicas[0].url,
            "--rate",
            "40",
            "--repeats",
            "2",
            "--no-progress",
            "--slo",
            "ttft=8ms",
            "--output-dir",
            str(out),
            "--export-llmd",
            str(br_path),
        ]
    )
    try:
        assert await replay_cli.run(args) == 0
    finally:
        await close_replicas(replicas)
    report = json.loads((out / "report.json").read_text())
    br = json.loads(br_path.read_text())
    assert errors(br) == []
    # By hand, from the reported run's own records.
    lines = [
        json.loads(x)
        for x in (out / f"records-run{report['median_run']}.jsonl").read_text().splitlines()
    ]
    records = [line["record"] for line in lines]
    ok = [r for r in records if r["outcome"] == "ok"]
    assert len(ok) == 12
    ttft = [r["client"]["marks"][0][0] / MS for r in ok]
    e2e = [r["client"]["marks"][-1][0] / MS for r in ok]
    itl = [
        (b[0] - a[0]) / MS
        for r in ok
        for a, b in zip(r["client"]["marks"], r["client"]["marks"][1:], strict=False)
    ]
    tpot = [(e - t) / (r["n_out"] - 1) for r, t, e in zip(ok, ttft, e2e, strict=True)]
    ntpot = [e / r["n_out"] for r, e in zip(ok, e2e, strict=True)]
    duration_s = max(line["actual_ns"] + line["record"]["client"]["end_ns"] for line in lines) / 1e9
    aggregate = br["results"]["request_performance"]["aggregate"]
    latency = aggregate["latency"]
    for name, values in (
        ("time_to_first_token", ttft),
        ("request_latency", e2e),
        ("inter_token_latency", itl),
        ("time_per_output_token", tpot),
        ("normalized_time_per_output_token", ntpot),
    ):
        block = latency[name]
        assert block["mean"] == pytest.approx(np.mean(values)), name
        assert block["stddev"] == pytest.approx(np.std(values)), name
        for key, q in (("p1", 1), ("p25", 25), ("p50", 50), ("p90", 90), ("p99p9", 99.9)):
            assert block[key] == pytest.approx(np.percentile(values, q)), (name, key)
        assert (block["min"], block["max"]) == (
            pytest.approx(min(values)),
            pytest.approx(max(values)),
        )
    assert latency["time_to_first_token"]["p50"] == pytest.approx(report["p50_ttft_ms"])
    requests = aggregate["requests"]
    assert (requests["total"], requests["failures"]) == (12, 0)
    assert requests["input_length"]["mean"] == pytest.approx(np.mean([r["n_in"] for r in ok]))
    assert requests["output_length"]["max"] == 6
    throughput = aggregate["throughput"]
    assert throughput["request_rate"]["mean"] == pytest.approx(12 / duration_s)
    assert throughput["output_token_rate"]["mean"] == pytest.approx(
        sum(r["n_out"] for r in ok) / duration_s
    )
    assert throughput["total_token_rate"]["mean"] == pytest.approx(
        sum(r["n_out"] + r["n_in"] for r in ok) / duration_s
    )
    start_ns = min(line["record"]["wall_time_ns"] - line["actual_ns"] for line in lines)
    start = datetime.datetime.fromisoformat(br["run"]["time"]["start"].replace("Z", "+00:00"))
    assert start.timestamp() == pytest.approx(start_ns / 1e9, abs=1e-3)
    assert br["run"]["time"]["duration"] == f"PT{duration_s:.3f}S"
    good = sum(1 for t in ttft if t <= 8.0)
    goodput = br["results"]["observability"]["vllm_sidecar"]["goodput"]
    assert goodput["good_requests"] == good
    assert goodput["request_goodput"]["value"] == pytest.approx(good / duration_s)
    assert goodput["request_goodput"]["value"] == pytest.approx(report["request_goodput"])
    # The workload as it was asked for: 12..14 tokens in, 3..6 out, Poisson at 40 req/s.
    load = br["scenario"]["load"]["standardized"]
    assert load["input_seq_len"] == {
        "distribution": "other",
        "value": pytest.approx(13.0),
        "min": 12,
        "max": 14,
    }
    assert load["output_seq_len"]["min"] == 3 and load["output_seq_len"]["max"] == 6
    assert load["rate_qps"] == 40.0 and "concurrency" not in load
    assert load["source"] == "random" and load["stage"] == 0
    (target,) = br["scenario"]["stack"]
    assert target["standardized"]["tool"] == "vllm"
    assert target["standardized"]["tool_version"] == "0.33.0"
    assert br["scenario"]["load"]["native"]["config"]["engine_version"] == "0.33.0"
    for block in statistics_blocks(br):
        assert set(block) <= STATISTICS_KEYS
