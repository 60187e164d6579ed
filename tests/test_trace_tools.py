"""``sidecar trace lint`` and ``stats``: each lint rule on a purpose-made bad trace, silence on
a clean one, stats checked by hand on a tiny trace, and the command line end to end."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sidecar.replay import trace_cli
from sidecar.replay.importers import ImportOptions, import_trace
from sidecar.replay.tracelint import ERROR, RULES, WARNING, lint_trace
from sidecar.replay.tracestats import choose_bin_s, format_stats, sparkline, trace_stats
from sidecar.tracefile import TraceFormatError, TraceHeader, TraceReader, TraceRequest, write_trace

DATA = Path(__file__).resolve().parent / "data" / "traces"
REPO = Path(__file__).resolve().parent.parent


def write_lines(path: Path, lines: list[dict[str, Any] | str]) -> Path:
    """A trace with a valid header and these request lines (dicts, or raw text as is)."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(TraceHeader(source="test").to_dict()) + "\n")
        for line in lines:
            handle.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def req(t: float, **fields: Any) -> dict[str, Any]:
    return {"t": t, "endpoint": "completions", "stream": True, "n_in": 100, "n_out": 10, **fields}


def blocks(size: int, *hashes: int, unit: str = "tokens") -> dict[str, Any]:
    return {"unit": unit, "size": size, "hashes": list(hashes)}


# ---------------------------------------------------------------------------------------------
# Lint


CLEAN = [
    req(0.0, n_in=1100, n_out=10, max_tokens=10, ignore_eos=True, prefix=blocks(512, 1, 2, 3)),
    req(0.5, endpoint="chat", n_in=1024, n_out=20, prefix=blocks(512, 1, 2)),  # exact blocks
    req(0.5, n_in=1025, n_out=20, prefix=blocks(512, 1, 2, 4)),  # a 1-token last block
    req(0.75, n_in=30, n_out=20, max_tokens=10, n=2),  # n_out counts both choices
    req(1.25, n_in=40, n_out=5, prefix=blocks(64, 7, unit="chars")),
    req(3.0, n_in=200, n_out=0, max_tokens=1, outcome="failed_in_source"),
    req(3.0, n_in=3000, n_out=1000, max_tokens=1096, n_cached=2048, session_id="s"),
]


def test_lint_is_silent_on_a_clean_trace(tmp_path: Path) -> None:
    report = lint_trace(write_lines(tmp_path / "clean.jsonl", list(CLEAN)), max_model_len=4096)
    assert report.findings == ()
    assert report.requests == 7 and report.exit_code == 0
    assert report.format().endswith("clean.jsonl: 7 requests: clean")


# (lines, code, count, an example that must be reported); each trace trips only its rule.
BAD_TRACES: list[tuple[str, list[dict[str, Any] | str], int, str]] = [
    ("unreadable-line", [req(0.0), "{not json", req(1.0)], 1, "line 3: not valid JSON"),
    ("unreadable-line", [req(0.0), {"n_in": 5}], 1, "line 3: a request line needs `t`"),
    (
        "unreadable-line",
        [req(0.0, prefix=blocks(16, 1, unit="bytes"))],
        1,
        "line 2: prefix unit must be 'tokens' or 'chars'",
    ),
    ("partial-last-line", [req(0.0), req(1.0), '{"t": 2.0, "n_i'], 1, "line 4: not valid"),
    (
        "t-not-finite",
        [req(0.0), '{"t": NaN, "n_in": 100, "n_out": 10}', req(1.0)],
        1,
        "line 3: t=nan",
    ),
    ("t-negative", [req(-1.0), req(0.0), req(1.0)], 1, "line 2: t=-1"),
    (
        "t-absurd",
        [req(0.0), req(0.5), req(1.5), req(2.5), req(4e7 + 0.5)],
        1,
        "line 6: t=4e+07 s (463 days)",
    ),
    (
        "t-non-monotonic",
        [req(0.0), req(5.0), req(2.0), req(3.0), req(6.0)],
        2,
        "line 4: t=2 after t=5 (line 3), 3 s back",
    ),
    ("t-large-start", [req(200000.5), req(200001.5)], 1, "first request at t=200000 s"),
    (
        "t-looks-like-ms",
        [req(0.0), req(1500.0), req(3000.0), req(4500.0)],
        1,
        "median inter-arrival 1500 s over 4 requests",
    ),
    (
        "t-looks-like-ms",
        [req(0.0), req(1e6), req(1e6 + 1), req(1e6 + 2)],
        1,
        "every t is a whole number and the largest is 1e+06",
    ),
    # A line replay can still send (max_tokens bounds its output), but not reproduce exactly.
    ("length-missing", [req(0.0), {"t": 1.0, "n_in": 5, "max_tokens": 8}], 1, "line 3: no n_out"),
    # Lines replay skips, with replay's own reasons (tracefile.unreplayable_reason).
    (
        "cannot-replay",
        [req(0.0), {"t": 1.0, "n_in": 5}],
        1,
        "line 3: n_out and max_tokens missing: output length unknown",
    ),
    (
        "cannot-replay",
        [req(0.0), req(1.0, n_in=None, http_status=404, outcome="http_error")],
        1,
        "line 3: n_in missing: prompt size unknown",
    ),
    ("cannot-replay", [req(0.0), req(1.0, n_in=0)], 1, "line 3: n_in=0: prompt size unknown"),
    ("length-negative", [req(0.0, n_out=-3)], 1, "line 2: n_out=-3"),
    ("length-absurd", [req(0.0, n_in=20_000_000)], 1, "line 2: n_in=20000000"),
    ("n-cached-over-n-in", [req(0.0, n_in=10, n_cached=20)], 1, "line 2: n_cached=20 > n_in=10"),
    (
        "lengths-look-like-chars",
        [req(t, n_in=40000, n_out=5000) for t in (0.0, 1.0, 2.0)],
        1,
        "median n_in 40000, median n_out 5000",
    ),
    # vLLM's footgun: Mooncake's 512-token hash_ids read as 16-token blocks.
    (
        "prefix-size-mismatch",
        [req(0.0, n_in=6758, prefix=blocks(16, *range(14)))],
        1,
        "line 2: 14 hashes of size 16 for n_in=6758 (expected 423; n_in / len(hashes) = 483",
    ),
    # Line 2's two choices of 90 tokens each fit; line 3's max_tokens does not.
    (
        "over-max-model-len",
        [req(0.0, n_in=4000, n_out=180, n=2), req(1.0, n_in=4000, n_out=100, max_tokens=200)],
        1,
        "line 3: 4000 + 200 = 4200 > 4096",
    ),
    (
        "max-tokens-below-n-out",
        [req(0.0, n_out=10, max_tokens=5)],
        1,
        "line 2: max_tokens=5 < n_out=10",
    ),
    # n_out counts every choice's tokens: n=2 x max_tokens=10 reach 20 but not 21.
    (
        "max-tokens-below-n-out",
        [req(0.0, n=2, n_out=20, max_tokens=10), req(1.0, n=2, n_out=21, max_tokens=10)],
        1,
        "line 3: max_tokens=10 x n=2 < n_out=21",
    ),
    ("empty-prompt", [req(0.0, n_in=0, body={"prompt": ""})], 1, "line 2"),
    ("zero-output", [req(0.0, n_out=0)], 1, "line 2"),
    ("duplicate", [req(0.0), req(1.0), req(1.0), req(2.0)], 1, "line 4 = line 3"),
    ("unknown-endpoint", [req(0.0, endpoint="responses")], 1, "line 2: 'responses'"),
]


@pytest.mark.parametrize(
    ("code", "lines", "count", "example"),
    BAD_TRACES,
    ids=[f"{case[0]}-{i}" for i, case in enumerate(BAD_TRACES)],
)
def test_lint_finds_each_problem(
    tmp_path: Path, code: str, lines: list[dict[str, Any] | str], count: int, example: str
) -> None:
    max_model_len = 4096 if code == "over-max-model-len" else None
    report = lint_trace(write_lines(tmp_path / "bad.jsonl", lines), max_model_len=max_model_len)
    assert report.codes() == {code}
    (finding,) = report.findings
    assert finding.count == count
    assert any(e.startswith(example) for e in finding.examples), finding.examples
    assert finding.severity == RULES[code][0]
    assert report.exit_code == (1 if finding.severity == ERROR else 0)
    text = report.format()
    assert f"{finding.severity}: {code}:" in text and "where: " in text and "fix: " in text


def test_lint_reports_the_worst_jump_back_and_caps_examples(tmp_path: Path) -> None:
    lines: list[dict[str, Any] | str] = [req(100.0)]
    lines += [req(90.0 - i) for i in range(8)]  # 8 rows back: 10 s .. 17 s
    report = lint_trace(write_lines(tmp_path / "back.jsonl", lines))
    (finding,) = report.findings
    assert finding.code == "t-non-monotonic" and finding.severity == WARNING
    assert finding.count == 8 and len(finding.examples) == 5
    assert "worst jump back 17 s (line 10)" in finding.what
    assert "(+3 more)" in finding.format()


def test_lint_json_and_missing_max_model_len(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "long.jsonl", [req(0.0, n_in=4000, n_out=200)])
    assert lint_trace(path).findings == ()  # without --max-model-len nothing is too long
    as_dict = lint_trace(path, max_model_len=4096).to_dict()
    assert as_dict["errors"] == 1 and as_dict["findings"][0]["code"] == "over-max-model-len"


def test_lint_refuses_a_file_that_is_not_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "raw.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    with pytest.raises(TraceFormatError, match="not a sidecar-trace file"):
        lint_trace(path)


def test_lint_warns_on_a_compressed_trace_cut_short(tmp_path: Path) -> None:
    whole = tmp_path / "whole.jsonl.gz"
    write_trace(
        whole,
        TraceHeader(source="test"),
        [TraceRequest(t=i * 0.5, n_in=100 + i, n_out=10) for i in range(2000)],
    )
    data = whole.read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    report = lint_trace(cut)
    assert report.codes() == {"partial-last-line"} and report.exit_code == 0
    assert 0 < report.requests < 2000
    assert trace_stats(cut).requests == report.requests


def test_unsorted_import_is_sorted_or_warned(tmp_path: Path) -> None:
    # The importer's choice for rows out of time order: sort (default), or keep the file
    # order with --no-sort, and then lint warns.
    sample = DATA / "azure_2024_sample.csv"
    import_trace("azure", sample, tmp_path / "sorted.jsonl")
    assert lint_trace(tmp_path / "sorted.jsonl").findings == ()
    import_trace("azure", sample, tmp_path / "unsorted.jsonl", ImportOptions(sort=False))
    (finding,) = lint_trace(tmp_path / "unsorted.jsonl").findings
    assert finding.code == "t-non-monotonic" and finding.count == 1
    assert finding.examples == ["line 5: t=0.5 after t=1 (line 4), 0.5 s back"]


def test_the_reader_numbers_lines_past_blank_ones(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [req(0.0), "", req(1.0)])
    entries = list(TraceReader(path).lines())
    assert [(e.line, e.request is not None) for e in entries] == [(2, True), (4, True)]


# ---------------------------------------------------------------------------------------------
# Stats


# Five requests, 4-token blocks. Chains: r1 [1,2], r2 [1,2,3], r3 [1], r4 [7,2], r5 [1,2,3].
TINY = [
    req(0.0, n_in=8, n_out=2, model="m", session_id="a", prefix=blocks(4, 1, 2)),
    req(1.0, n_in=10, n_out=4, model="m", session_id="a", prefix=blocks(4, 1, 2, 3)),
    req(2.0, n_in=4, n_out=6, model="m", session_id="b", prefix=blocks(4, 1)),
    req(4.0, n_in=8, n_out=8, model="m", prefix=blocks(4, 7, 2)),
    req(
        10.0,
        n_in=12,
        n_out=10,
        model="other",
        prefix=blocks(4, 1, 2, 3),
        endpoint="chat",
        outcome="failed_in_source",
    ),
]


def test_stats_by_hand(tmp_path: Path) -> None:
    stats = trace_stats(write_lines(tmp_path / "tiny.jsonl", list(TINY)))
    assert stats.requests == 5 and stats.unreadable_lines == 0 and stats.source == "test"
    a = stats.arrivals
    assert a.duration_s == 10.0 and a.first_t == 0.0 and a.last_t == 10.0
    assert a.mean_rate_rps == 0.5  # 5 requests / 10 s
    assert a.bin_s == 0.2  # the smallest round width giving <= 60 bins over 10 s
    # t/0.2 = 0, 5, 10, 20, 50: one request in each of those bins, 51 bins in all.
    assert len(a.counts) == 51 and sum(a.counts) == 5
    assert [i for i, c in enumerate(a.counts) if c] == [0, 5, 10, 20, 50]
    assert a.peak_rate_rps == pytest.approx(5.0) and a.peak_bin_start_s == 0.0
    # gaps 1, 1, 2, 6: mean 2.5, population std sqrt(17/4) -> CV 0.8246
    assert a.interarrival_mean_s == 2.5 and a.interarrival_p50_s == 1.5
    assert a.burstiness_cv == pytest.approx((17 / 4) ** 0.5 / 2.5)
    assert a.sorted_in_file

    # n_in 4 8 8 10 12 (linear percentiles): p90 at rank 3.6 = 10 + 0.6 * 2
    assert stats.n_in.count == 5 and stats.n_in.mean == pytest.approx(8.4)
    assert stats.n_in.p50 == 8 and stats.n_in.p90 == pytest.approx(11.2)
    assert stats.n_in.p99 == pytest.approx(11.92) and stats.n_in.max == 12
    assert stats.n_in.total == 42
    assert stats.n_out.p50 == 6 and stats.n_out.mean == 6 and stats.n_out.p90 == pytest.approx(9.2)

    p = stats.prefix
    assert p is not None
    assert p.requests_with_prefix == 5 and p.block_sizes == {"tokens/4": 5}
    # Blocks 2+3+1+2+3 = 11. Repeats: r2 [1,2], r3 [1], r5 [1,2,3]; r4's block 2 follows 7,
    # a new chain, so it is no hit. 6 of 11.
    assert p.blocks == 11 and p.reused_blocks == 6
    assert p.block_reuse_fraction == pytest.approx(6 / 11)
    # Hit tokens: r2 min(8,10)=8, r3 min(4,4)=4, r5 min(12,12)=12 -> 24 of 42 prompt tokens.
    assert p.hit_ratio_tokens == pytest.approx(24 / 42)
    # Nodes (1) (1,2) (1,2,3) (7) (7,2); prompts end at (1,2) (1,2,3) (1) (7,2); roots 1, 7.
    assert (p.distinct_blocks, p.distinct_prompts, p.distinct_first_blocks) == (5, 4, 2)

    s = stats.sessions
    assert s is not None and s.sessions == 2 and s.requests_with_session == 3
    assert s.requests_per_session.mean == 1.5 and s.requests_per_session.max == 2
    assert stats.models == {"m": 4, "other": 1}
    assert stats.endpoints == {"completions": 4, "chat": 1}
    assert stats.outcomes == {"(none)": 4, "failed_in_source": 1}

    as_json = json.loads(json.dumps(stats.to_dict()))
    assert as_json["prefix"]["hit_ratio_tokens_infinite_cache"] == pytest.approx(24 / 42)
    assert as_json["arrivals"]["burstiness_cv"] == pytest.approx(0.8246, abs=1e-4)
    text = format_stats(stats)
    assert "requests    5" in text and "infinite-cache hit ratio 57.1% of prompt tokens" in text
    assert "6 repeat an earlier prefix (54.5%)" in text and "sessions    2" in text


def test_stats_without_prefix_sessions_or_order(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "plain.jsonl", [req(1.0), req(0.0), "{bad", req(3.0)])
    stats = trace_stats(path)
    assert stats.requests == 3 and stats.unreadable_lines == 1
    assert stats.prefix is None and stats.sessions is None
    assert not stats.arrivals.sorted_in_file
    assert stats.arrivals.interarrival_mean_s == 1.5  # of the sorted t: 0, 1, 3
    assert "no prefix information" in format_stats(stats)
    single = trace_stats(write_lines(tmp_path / "one.jsonl", [req(0.0)]))
    assert single.arrivals.duration_s == 0.0 and single.arrivals.mean_rate_rps is None
    assert single.arrivals.counts == (1,) and single.arrivals.burstiness_cv is None


def test_choose_bin_and_sparkline() -> None:
    assert choose_bin_s(0.0) == 1.0
    assert choose_bin_s(10.0) == 0.2
    assert choose_bin_s(3537.0) == 60.0  # the Mooncake conversation trace: 59 bins
    assert choose_bin_s(604800.0) == 10800.0  # an Azure week: 3 h bins
    assert choose_bin_s(121 * 86400.0) == 604800.0  # BurstGPT's 121 days: weeks
    assert sparkline((0, 1, 2, 4)) == " -+@"  # proportional to the largest bin
    assert sparkline(()) == "" and sparkline((0, 0)) == ""


# ---------------------------------------------------------------------------------------------
# The command line


def test_cli_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bailian.jsonl"
    argv = ["import", "--format", "bailian", str(DATA / "bailian_sample.jsonl"), "-o", str(out)]
    assert trace_cli.main(argv) == 0
    assert "imported 4 requests" in capsys.readouterr().out
    assert trace_cli.main(argv) == 2  # no overwrite without --force: an input error
    assert "exists (use --force" in capsys.readouterr().err
    assert trace_cli.main([*argv, "--force", "--time-scale", "2"]) == 0
    capsys.readouterr()
    assert trace_cli.main(["lint", str(out)]) == 0
    assert "4 requests: clean" in capsys.readouterr().out
    assert trace_cli.main(["stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["requests"] == 4 and stats["arrivals"]["duration_s"] == 5.5  # 2.75 s x 2

    # The Mooncake sample has a hash list too short for its n_in: lint exits 1.
    mooncake = tmp_path / "mooncake.jsonl"
    assert (
        trace_cli.main(
            [
                "import",
                "--format",
                "mooncake",
                str(DATA / "mooncake_sample.jsonl"),
                "-o",
                str(mooncake),
            ]
        )
        == 0
    )
    assert "remark: 1 x hash_ids length" in capsys.readouterr().out
    assert trace_cli.main(["lint", str(mooncake), "--json"]) == 1
    codes = {f["code"] for f in json.loads(capsys.readouterr().out)["findings"]}
    assert codes == {"prefix-size-mismatch", "zero-output"}

    assert (
        trace_cli.main(
            [
                "import",
                "--format",
                "azure",
                str(DATA / "mooncake_sample.jsonl"),
                "-o",
                str(tmp_path / "x.jsonl"),
            ]
        )
        == 2
    )
    assert "missing column(s) 'TIMESTAMP'" in capsys.readouterr().err
    assert (
        trace_cli.main(
            [
                "import",
                "--format",
                "mooncake",
                str(DATA / "mooncake_sample.jsonl"),
                "-o",
                str(tmp_path / "y.jsonl"),
                "--duration",
                "soon",
            ]
        )
        == 2
    )
    assert "--duration" in capsys.readouterr().err
    assert trace_cli.main(["stats", str(tmp_path / "absent.jsonl")]) == 2
    assert trace_cli.main([]) == 2


def test_cli_follows_the_command_pattern() -> None:
    # The pattern of sidecar/sim/cli.py, which sidecar/cli.py wires: DESCRIPTION, EPILOG,
    # add_arguments(parser), async run(args) -> int.
    parser = argparse.ArgumentParser(prog="sidecar trace")
    trace_cli.add_arguments(parser)
    args = parser.parse_args(["stats", "t.jsonl", "--json"])
    assert args.trace_command == "stats" and args.json
    assert "import" in trace_cli.DESCRIPTION and "examples:" in trace_cli.EPILOG
    import inspect

    assert inspect.iscoroutinefunction(trace_cli.run)


def run_module(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_as_a_subprocess(tmp_path: Path) -> None:
    out = tmp_path / "azure.jsonl.gz"
    done = run_module(
        "sidecar.replay.trace_cli",
        "import",
        "--format",
        "azure",
        str(DATA / "azure_2024_sample.csv"),
        "-o",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "imported 5 requests" in done.stdout and "sorted by t" in done.stdout
    done = run_module("sidecar.replay.trace_cli", "lint", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    done = run_module("sidecar.replay.trace_cli", "stats", str(out), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["arrivals"]["duration_s"] == 172800


def test_sidecar_trace_subcommand(tmp_path: Path) -> None:
    out = tmp_path / "mooncake.jsonl"
    done = run_module(
        "sidecar",
        "trace",
        "import",
        "--format",
        "mooncake",
        str(DATA / "mooncake_plus_sample.jsonl"),
        "-o",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    done = run_module("sidecar", "trace", "stats", str(out))
    assert done.returncode == 0 and "requests    4" in done.stdout
    done = run_module("sidecar", "trace", "lint", str(out))
    assert done.returncode == 0, done.stdout
    assert run_module("sidecar", "trace", "--help").returncode == 0
