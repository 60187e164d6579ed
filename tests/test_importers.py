"""Importers: public trace formats -> sidecar traces, with values worked out by hand.

The samples in tests/data/traces/ are written from each format's documented columns (see the
README there); the excerpts there of two real public traces (their first rows, with their
licences and attribution) are read as they are.
"""

from __future__ import annotations

import calendar
import gzip
import json
import math
from pathlib import Path

import pytest

import sidecar
from sidecar.config import parse_duration
from sidecar.replay import importers
from sidecar.replay.importers import (
    FAILED_IN_SOURCE,
    ImportOptions,
    ImportResult,
    SourceRow,
    TraceImportError,
    import_trace,
    parse_calendar_ns,
)
from sidecar.replay.tracelint import lint_trace
from sidecar.tracefile import PrefixBlocks, TraceReader, TraceRequest, request_line

DATA = Path(__file__).resolve().parent / "data" / "traces"


def run_import(
    tmp_path: Path, fmt: str, sample: str | Path, name: str = "out.jsonl", **options: object
) -> tuple[ImportResult, list[TraceRequest]]:
    source = sample if isinstance(sample, Path) else DATA / sample
    result = import_trace(fmt, source, tmp_path / name, ImportOptions(**options))  # type: ignore[arg-type]
    return result, TraceReader(tmp_path / name).requests()


def utc_ns(*fields: int, fraction_ns: int = 0) -> int:
    return calendar.timegm((*fields, 0, 0, 0)) * 1_000_000_000 + fraction_ns


# ---------------------------------------------------------------------------------------------
# Mooncake


def test_mooncake_sample(tmp_path: Path) -> None:
    result, requests = run_import(tmp_path, "mooncake", "mooncake_sample.jsonl")
    # timestamp ms / 1000; the blank line 4 is not a row.
    assert [r.t for r in requests] == [0.0, 0.0, 1.5, 2.25, 10.0]
    assert [r.n_in for r in requests] == [1100, 600, 1536, 100, 2000]
    assert [r.n_out for r in requests] == [10, 20, 0, 5, 7]
    # max_tokens = n_out so a replay reproduces it; n_out 0 -> 1 (vLLM refuses 0).
    assert [r.max_tokens for r in requests] == [10, 20, 1, 5, 7]
    assert all(r.ignore_eos and r.stream and r.endpoint == "completions" for r in requests)
    assert all(r.model is None and r.outcome is None for r in requests)
    assert requests[0].prefix == PrefixBlocks("tokens", 512, (1, 2, 3))
    assert requests[4].prefix == PrefixBlocks("tokens", 512, (1, 2, 6))
    assert result.rows_read == 5 and result.requests == 5 and result.out_of_order == 0

    header = TraceReader(tmp_path / "out.jsonl").header
    assert header.source == "mooncake" and header.start_wall_ns == 0
    notes = header.notes
    assert notes["source_file"] == "mooncake_sample.jsonl"
    assert "timestamp / 1000" in notes["units"] and "ms" in notes["units"]
    assert notes["rows_read"] == 5 and notes["requests"] == 5
    assert notes["t0_source"] == "timestamp 0 ms"
    assert notes["rows_skipped"] == {}
    remarks = notes["remarks"]
    # 2000 tokens need ceil(2000/512) = 4 blocks; the row has 3: imported, and said so.
    assert remarks["hash_ids length != ceil(input_length/512)"] == {
        "count": 1,
        "examples": ["line 6: 3 ids for 2000 tokens (expected 4)"],
    }
    assert remarks["n_out = 0 (max_tokens set to 1: vLLM refuses 0)"]["examples"] == ["line 3"]


def test_mooncake_plus_sessions_delay_and_order(tmp_path: Path) -> None:
    result, requests = run_import(tmp_path, "mooncake", "mooncake_plus_sample.jsonl")
    # Source clock (ms): a@1000, a@1000+2500, b@2000 (its delay ignored), a@3500+500.
    # Sorted and rebased on the earliest (1000 ms):
    assert [(r.t, r.session_id, r.n_in) for r in requests] == [
        (0.0, "a", 100),
        (1.0, "b", 50),
        (2.5, "a", 300),
        (3.0, "a", 400),
    ]
    assert requests[3].prefix == PrefixBlocks("tokens", 512, (9,))
    assert result.out_of_order == 1
    notes = TraceReader(tmp_path / "out.jsonl").header.notes
    remarks = notes["remarks"]
    assert remarks["t from the session's previous arrival + delay (lower bound)"] == {
        "count": 2,
        "examples": ["line 2", "line 4"],
    }
    assert remarks["delay ignored (the row has a timestamp)"]["count"] == 1
    assert remarks["text/messages/payload not imported (lengths only)"]["examples"] == ["line 3"]
    assert "1 rows earlier than a row before them (worst 1.5 s back); sorted" in notes["order"]
    assert notes["t0_source"] == "timestamp 1000 ms"


def test_mooncake_options_time_scale_limit_window(tmp_path: Path) -> None:
    _, scaled = run_import(tmp_path, "mooncake", "mooncake_sample.jsonl", "a.jsonl", time_scale=0.5)
    assert [r.t for r in scaled] == [0.0, 0.0, 0.75, 1.125, 5.0]
    assert TraceReader(tmp_path / "a.jsonl").header.notes["time_scale"] == 0.5

    result, limited = run_import(tmp_path, "mooncake", "mooncake_sample.jsonl", "b.jsonl", limit=2)
    assert len(limited) == 2 and result.rows_read == 2

    result, late = run_import(
        tmp_path, "mooncake", "mooncake_sample.jsonl", "c.jsonl", start_at="2"
    )
    assert [(r.t, r.n_in) for r in late] == [(0.0, 100), (7.75, 2000)]
    assert result.skipped == {"before --start-at": 3}

    # Window [1 s, 3 s) on the source clock: the rows at 1.5 s and 2.25 s.
    result, window = run_import(
        tmp_path, "mooncake", "mooncake_sample.jsonl", "d.jsonl", start_at="1s", duration_s=2.0
    )
    assert [(r.t, r.n_in) for r in window] == [(0.0, 1536), (0.75, 100)]
    assert result.skipped == {"before --start-at": 2, "after --start-at + --duration": 1}
    header = TraceReader(tmp_path / "d.jsonl").header
    assert header.notes["window"] == {"start_at": "1s", "duration_s": 2.0}
    assert header.notes["t0_source"] == "timestamp 1500 ms"

    _, chat = run_import(
        tmp_path, "mooncake", "mooncake_sample.jsonl", "e.jsonl", endpoint="chat", model="my-model"
    )
    assert {(r.endpoint, r.model) for r in chat} == {("chat", "my-model")}
    assert TraceReader(tmp_path / "e.jsonl").header.models == ("my-model",)


def test_mooncake_errors_name_the_line(tmp_path: Path) -> None:
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1}\n{oops\n')
    with pytest.raises(TraceImportError, match=r"bad.jsonl:2: not valid JSON"):
        import_trace("mooncake", bad_json, tmp_path / "o.jsonl")
    no_time = tmp_path / "no_time.jsonl"
    no_time.write_text('{"session_id": "s", "delay": 5, "input_length": 1, "output_length": 1}\n')
    with pytest.raises(TraceImportError, match=r"no_time.jsonl:1: no `timestamp`"):
        import_trace("mooncake", no_time, tmp_path / "o.jsonl")
    negative = tmp_path / "negative.jsonl"
    negative.write_text('{"timestamp": 0, "input_length": -4, "output_length": 1}\n')
    with pytest.raises(TraceImportError, match=r"negative.jsonl:1: input_length -4 is negative"):
        import_trace("mooncake", negative, tmp_path / "o.jsonl")
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"timestamp": 0, "input_length": 4}\n')
    with pytest.raises(TraceImportError, match=r"missing.jsonl:1: no `output_length` field"):
        import_trace("mooncake", missing, tmp_path / "o.jsonl")
    assert not (tmp_path / "o.jsonl").exists()  # a failed import leaves no file behind


# ---------------------------------------------------------------------------------------------
# Bailian


def test_bailian_sample(tmp_path: Path) -> None:
    _, requests = run_import(tmp_path, "bailian", "bailian_sample.jsonl")
    assert [r.t for r in requests] == [0.0, 0.25, 1.5, 2.75]
    assert [r.request_id for r in requests] == ["1", "2", "3", "4"]
    # chat 4 -> parent 3 -> parent 1 (root): one session "1"; chat 2 is its own root.
    assert [r.session_id for r in requests] == ["1", "2", "1", "1"]
    assert requests[2].prefix == PrefixBlocks("tokens", 16, (11, 12, 13, 14, 15))
    assert [r.n_in for r in requests] == [40, 16, 70, 90]
    header = TraceReader(tmp_path / "out.jsonl").header
    assert header.source == "bailian"
    assert header.notes["request_types"] == {"search": 1, "text": 3}
    assert header.notes["remarks"] == {}  # every hash list is ceil(n_in / 16) long
    assert header.notes["t0_source"] == "timestamp 10.5 s"


# ---------------------------------------------------------------------------------------------
# Azure


def test_parse_calendar_ns() -> None:
    base = utc_ns(2023, 11, 16, 18, 15, 46)
    # 7 fractional digits: exact to 100 ns (datetime.fromisoformat refuses this on 3.10).
    assert parse_calendar_ns("2023-11-16 18:15:46.6805900") == (base + 680_590_000, False)
    assert parse_calendar_ns("2023-11-16 18:15:46") == (base, False)
    assert parse_calendar_ns("2023-11-16T18:15:46Z") == (base, True)
    midnight = utc_ns(2024, 5, 12, 0, 0, 0)
    assert parse_calendar_ns("2024-05-12 00:00:00+00:00") == (midnight, True)  # no fraction
    assert (
        parse_calendar_ns("2024-05-10 00:00:00.009930+00:00")[0]
        == utc_ns(2024, 5, 10, 0, 0, 0) + 9_930_000
    )
    # A +02:00 local time is two hours earlier in UTC.
    assert parse_calendar_ns("2024-05-12 02:00:00+02:00")[0] == midnight
    assert parse_calendar_ns("2024-05-11 22:30:00-01:30")[0] == midnight
    assert parse_calendar_ns("2024-05-12 00:00:00.1234567891")[0] == midnight + 123_456_789
    for bad in ("2023-13-16 18:15:46", "2023-11-16 25:00:00", "16/11/2023 18:15", "", "x"):
        with pytest.raises(ValueError):
            parse_calendar_ns(bad)


def test_azure_2023_seven_digits_unsorted(tmp_path: Path) -> None:
    result, requests = run_import(tmp_path, "azure", "azure_2023_sample.csv")
    # Rows at 46.6805900, 50.9951690, 45.9 (earlier than the first row), 51.0 s past 18:15.
    # Rebased on the earliest (45.9) and sorted:
    assert [(r.t, r.n_in, r.n_out) for r in requests] == [
        (0.0, 100, 7),
        (0.78059, 374, 44),
        (5.095169, 396, 109),
        (5.1, 1020, 129),
    ]
    assert all(r.prefix is None and r.session_id is None for r in requests)
    assert result.out_of_order == 1
    header = TraceReader(tmp_path / "out.jsonl").header
    assert header.source == "azure-2023"
    assert header.start_wall_ns == utc_ns(2023, 11, 16, 18, 15, 45, fraction_ns=900_000_000)
    assert header.notes["t0_source"] == "2023-11-16 18:15:45.900000000+00:00"
    assert header.notes["timestamps_without_zone_read_as_utc"] == 4
    assert "sorted by t" in header.notes["order"]
    assert header.notes["remarks"]["row earlier than a row before it"]["examples"] == [
        "line 4: 5.09517 s back"
    ]


def test_azure_2024_zone_with_and_without_fraction(tmp_path: Path) -> None:
    _, requests = run_import(tmp_path, "azure", "azure_2024_sample.csv")
    assert [(r.t, r.n_in) for r in requests] == [
        (0.0, 2048),
        (0.00993, 512),
        (0.5, 300),
        (1.0, 100),
        (172800.0, 50),
    ]
    header = TraceReader(tmp_path / "out.jsonl").header
    assert header.source == "azure-2024"
    assert header.start_wall_ns == utc_ns(2024, 5, 10, 0, 0, 0)
    assert header.notes["timestamps_with_zone"] == 5
    assert header.notes["rows_skipped"] == {}  # inference-perf skipped the zoned no-fraction


def test_azure_start_at_timestamp_and_no_sort(tmp_path: Path) -> None:
    _, window = run_import(
        tmp_path,
        "azure",
        "azure_2024_sample.csv",
        "a.jsonl",
        start_at="2024-05-10 00:00:00.5+00:00",
    )
    assert [(r.t, r.n_in) for r in window] == [(0.0, 300), (0.5, 100), (172799.5, 50)]
    _, day = run_import(
        tmp_path, "azure", "azure_2024_sample.csv", "b.jsonl", start_at="2024-05-11"
    )
    assert [(r.t, r.n_in) for r in day] == [(0.0, 50)]
    _, unsorted = run_import(tmp_path, "azure", "azure_2024_sample.csv", "c.jsonl", sort=False)
    assert [r.t for r in unsorted] == [0.0, 0.00993, 1.0, 0.5, 172800.0]
    assert "--no-sort" in TraceReader(tmp_path / "c.jsonl").header.notes["order"]


def test_external_sort_matches_in_memory_sort(tmp_path: Path) -> None:
    for fmt, sample in (
        ("azure", "azure_2024_sample.csv"),
        ("azure", "azure_2023_sample.csv"),
        ("mooncake", "mooncake_plus_sample.jsonl"),
    ):
        import_trace(fmt, DATA / sample, tmp_path / "one.jsonl")
        import_trace(fmt, DATA / sample, tmp_path / "runs.jsonl", run_lines=1)
        assert (tmp_path / "one.jsonl").read_text() == (tmp_path / "runs.jsonl").read_text()


def test_azure_errors(tmp_path: Path) -> None:
    no_column = tmp_path / "no_column.csv"
    no_column.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,3\n")
    with pytest.raises(TraceImportError) as missing:
        import_trace("azure", no_column, tmp_path / "o.jsonl")
    assert "missing column(s) 'GeneratedTokens'" in str(missing.value)
    assert "'TIMESTAMP', 'ContextTokens'" in str(missing.value)

    bad_time = tmp_path / "bad_time.csv"
    bad_time.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,3,4\n"
        "2023-11-16 18:15:4x.1,5,6\n"
        "2023-11-16 18:15:47.0,7,8\n"
    )
    with pytest.raises(
        TraceImportError,
        match=r"bad_time.csv:3: TIMESTAMP "
        r"'2023-11-16 18:15:4x.1' does not parse",
    ):
        import_trace("azure", bad_time, tmp_path / "o.jsonl")
    result, requests = run_import(tmp_path, "azure", bad_time, skip_bad_rows=True)
    assert [(r.t, r.n_in) for r in requests] == [(0.0, 3), (pytest.approx(0.31941), 7)]
    skipped = TraceReader(tmp_path / "out.jsonl").header.notes["rows_skipped"]
    ((reason, detail),) = skipped.items()
    assert detail["count"] == 1 and detail["examples"][0].startswith("line 3: TIMESTAMP")
    assert result.rows_read == 3

    bad_count = tmp_path / "bad_count.csv"
    bad_count.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3.5,4\n")
    with pytest.raises(TraceImportError, match=r":2: ContextTokens '3.5' is not a whole"):
        import_trace("azure", bad_count, tmp_path / "o.jsonl")


def test_extra_columns_are_named_in_the_notes(tmp_path: Path) -> None:
    # Columns are found by name, so extra ones (Azure's 2025 multimodal trace adds NumImages)
    # and another order do not shift anything; the unmapped ones are listed.
    path = tmp_path / "lmm.csv"
    path.write_text(
        "TIMESTAMP,NumImages,GeneratedTokens,ContextTokens\n2025-01-01 00:00:00.5,2,30,1000\n"
    )
    _, requests = run_import(tmp_path, "azure", path)
    assert [(r.t, r.n_in, r.n_out) for r in requests] == [(0.0, 1000, 30)]
    header = TraceReader(tmp_path / "out.jsonl").header
    assert header.notes["ignored_columns"] == ["NumImages"]
    assert header.sidecar_version == sidecar.__version__


@pytest.mark.parametrize("fmt", ["mooncake", "bailian", "azure", "burstgpt"])
def test_empty_file_is_an_error(tmp_path: Path, fmt: str) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(TraceImportError, match="empty file"):
        import_trace(fmt, empty, tmp_path / "o.jsonl")


def test_header_only_and_nothing_in_window(tmp_path: Path) -> None:
    header_only = tmp_path / "header.csv"
    header_only.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceImportError, match=r"no requests to import \(0 rows read\)"):
        import_trace("azure", header_only, tmp_path / "o.jsonl")
    with pytest.raises(TraceImportError, match="5 before --start-at"):
        import_trace(
            "mooncake",
            DATA / "mooncake_sample.jsonl",
            tmp_path / "o.jsonl",
            ImportOptions(start_at="1h"),
        )


def test_bad_options(tmp_path: Path) -> None:
    sample = DATA / "mooncake_sample.jsonl"
    for options, message in (
        (ImportOptions(time_scale=0), "--time-scale"),
        (ImportOptions(limit=0), "--limit"),
        (ImportOptions(endpoint="responses"), "--endpoint"),
        (ImportOptions(start_at="soon"), "--start-at"),
    ):
        with pytest.raises(TraceImportError, match=message):
            import_trace("mooncake", sample, tmp_path / "o.jsonl", options)
    with pytest.raises(TraceImportError, match="unknown format"):
        import_trace("sharegpt", sample, tmp_path / "o.jsonl")
    with pytest.raises(TraceImportError, match="no such file"):
        import_trace("mooncake", tmp_path / "absent.jsonl", tmp_path / "o.jsonl")
    # The package's one duration grammar; a bare number is seconds here only (the flags say
    # SECONDS on the source's clock).
    assert parse_duration("1.5h") == 5400.0 and parse_duration("250ms") == 0.25
    assert parse_duration("90", bare_unit="s") == 90.0 and parse_duration("2d") == 172800.0
    assert parse_duration("15min") == 900.0


# ---------------------------------------------------------------------------------------------
# BurstGPT


def test_burstgpt_v1_failed_rows_are_marked(tmp_path: Path) -> None:
    _, requests = run_import(tmp_path, "burstgpt", "burstgpt_v1_sample.csv", model="unused")
    assert [r.t for r in requests] == [0.0, 40.0, 113.0, 115.0, 116.5]
    assert [r.model for r in requests] == ["ChatGPT", "ChatGPT", "GPT-4", "ChatGPT", "GPT-4"]
    assert [r.n_in for r in requests] == [472, 1087, 417, 1360, 2000]
    assert [r.n_out for r in requests] == [18, 0, 276, 0, 500]
    assert [r.outcome for r in requests] == [None, FAILED_IN_SOURCE, None, FAILED_IN_SOURCE, None]
    assert [r.max_tokens for r in requests] == [18, 1, 276, 1, 500]
    assert all(r.session_id is None and r.e2e_s is None for r in requests)
    header = TraceReader(tmp_path / "out.jsonl").header
    assert header.source == "burstgpt" and header.models == ("ChatGPT", "GPT-4")
    notes = header.notes
    assert notes["columns"] == "v1.1"
    assert notes["log_types"] == {"API log": 3, "Conversation log": 2}
    assert notes["t0_source"] == "Timestamp 5 s"
    assert notes["remarks"]["Total tokens != Request tokens + Response tokens"] == {
        "count": 1,
        "examples": ["line 6: 2400 != 2000 + 500"],
    }
    failed = "failed in the source (kept: outcome failed_in_source, max_tokens 1)"
    assert notes["remarks"][failed]["examples"] == ["line 3", "line 5"]


def test_burstgpt_drop_failed(tmp_path: Path) -> None:
    result, requests = run_import(tmp_path, "burstgpt", "burstgpt_v1_sample.csv", drop_failed=True)
    assert [(r.t, r.n_in) for r in requests] == [(0.0, 472), (113.0, 417), (116.5, 2000)]
    assert result.skipped == {"failed in the source (--drop-failed)": 2}
    skipped = TraceReader(tmp_path / "out.jsonl").header.notes["rows_skipped"]
    assert skipped["failed in the source (--drop-failed)"]["examples"] == ["line 3", "line 5"]


def test_burstgpt_v2_columns_by_name(tmp_path: Path) -> None:
    _, requests = run_import(tmp_path, "burstgpt", "burstgpt_v2_sample.csv")
    assert [(r.t, r.n_in, r.n_out, r.session_id, r.e2e_s, r.model) for r in requests] == [
        (0.0, 300, 20, "s1", 3.5, "ChatGPT"),
        (30.25, 420, 0, "s1", None, "ChatGPT"),
        (30.75, 80, 64, "s2", 1.25, "GPT-4"),
    ]
    assert requests[1].outcome == FAILED_IN_SOURCE
    notes = TraceReader(tmp_path / "out.jsonl").header.notes
    assert notes["columns"] == "v2" and notes["remarks"].keys() == {
        "failed in the source (kept: outcome failed_in_source, max_tokens 1)"
    }


def test_burstgpt_missing_column(tmp_path: Path) -> None:
    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Model,Request tokens,Total tokens\n5,ChatGPT,4,4\n")
    with pytest.raises(TraceImportError, match=r"missing column\(s\) 'Response tokens'"):
        import_trace("burstgpt", path, tmp_path / "o.jsonl")


# ---------------------------------------------------------------------------------------------
# Output forms


def test_gzip_output_and_input(tmp_path: Path) -> None:
    _, plain = run_import(tmp_path, "burstgpt", "burstgpt_v2_sample.csv", "plain.jsonl")
    compressed_input = tmp_path / "burst.csv.gz"
    compressed_input.write_bytes(gzip.compress((DATA / "burstgpt_v2_sample.csv").read_bytes()))
    _, packed = run_import(tmp_path, "burstgpt", compressed_input, "packed.jsonl.gz")
    assert packed == plain
    assert gzip.decompress((tmp_path / "packed.jsonl.gz").read_bytes()).startswith(b'{"format"')


def test_fast_request_lines_equal_the_tracefile_serialiser() -> None:
    prefix = PrefixBlocks("tokens", 512, (1, 2))
    rows = [
        SourceRow(1, 0, 10, 5),
        SourceRow(2, 5, 10, 0, model="GPT-4", failed=True, e2e_s=1.25, session_id="s"),
        SourceRow(3, 9, 1100, 7, prefix=prefix, session_id="a", request_id="12"),
    ]
    for options in (ImportOptions(), ImportOptions(endpoint="chat", model="m")):
        for row in rows:
            fast = importers._request_json(row, 1.5, options)
            assert fast == request_line(importers._request_of(row, 1.5, options))
            assert TraceRequest.from_dict(json.loads(fast)).t == 1.5


# ---------------------------------------------------------------------------------------------
# Excerpts of the real public traces (tests/data/traces/README.md)


def test_real_mooncake_first_rows(tmp_path: Path) -> None:
    source = DATA / "mooncake_conversation_first100.jsonl"
    with open(source) as handle:
        raw = [json.loads(line) for line in handle]
    result, requests = run_import(tmp_path, "mooncake", source)
    assert result.requests == len(requests) == len(raw) == 100 and result.rows_read == 100
    assert result.out_of_order == 0
    times = [r.t for r in requests]
    assert times == sorted(times) and times[0] == 0.0
    assert times == [row["timestamp"] / 1000 for row in raw]
    assert [r.n_in for r in requests] == [row["input_length"] for row in raw]
    assert [r.n_out for r in requests] == [row["output_length"] for row in raw]
    for request in requests:
        assert request.prefix is not None and request.prefix.size == 512
        assert request.n_in is not None
        assert len(request.prefix.hashes) == math.ceil(request.n_in / 512)
    assert TraceReader(tmp_path / "out.jsonl").header.notes["remarks"] == {}
    assert lint_trace(tmp_path / "out.jsonl").errors == 0


def test_real_azure_2023_first_rows(tmp_path: Path) -> None:
    source = DATA / "azure_code_2023_first200.csv"
    with open(source) as handle:
        rows = [line.strip().split(",") for line in handle][1:151]
    result, requests = run_import(tmp_path, "azure", source, "azure.jsonl.gz", limit=150)
    assert result.requests == 150 and result.out_of_order == 0
    assert [r.n_in for r in requests] == [int(row[1]) for row in rows]
    assert [r.n_out for r in requests] == [int(row[2]) for row in rows]
    first_ns, _ = parse_calendar_ns(rows[0][0])
    # t of every row = its own timestamp minus the first row's, exact to the 100 ns digit.
    assert [r.t for r in requests] == [
        (parse_calendar_ns(row[0])[0] - first_ns) / 1e9 for row in rows
    ]
    header = TraceReader(tmp_path / "azure.jsonl.gz").header
    assert header.source == "azure-2023"
    assert header.start_wall_ns == utc_ns(2023, 11, 16, 18, 17, 3, fraction_ns=979_960_000)
    assert header.notes["rows_read"] == 150 and header.notes["window"] == {"limit": 150}
    assert lint_trace(tmp_path / "azure.jsonl.gz").errors == 0
