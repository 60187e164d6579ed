from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from sidecar.tracefile import (
    FORMAT_VERSION,
    PrefixBlocks,
    TraceFormatError,
    TraceHeader,
    TraceReader,
    TraceRequest,
    write_trace,
)

HEADER = TraceHeader(
    source="capture",
    start_wall_ns=1_700_000_000_000_000_000,
    sidecar_version="0.1.0",
    models=("m",),
    route_policy="least_outstanding",
    slos={"default": {"ttft": 0.5}},
)
REQUESTS = [
    TraceRequest(
        t=0.0,
        endpoint="chat",
        model="m",
        n_in=812,
        n_out=64,
        max_tokens=64,
        ignore_eos=True,
        prefix=PrefixBlocks("chars", 512, (11, 22)),
        outcome="ok",
        ttft_s=0.12,
    ),
    TraceRequest(
        t=0.25,
        endpoint="completions",
        model="m",
        stream=False,
        n_in=5,
        n_out=3,
        n=2,
        temperature=0.7,
        session_id="s1",
    ),
]


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_round_trip(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    assert write_trace(path, HEADER, REQUESTS) == 2
    reader = TraceReader(path)
    assert reader.header == HEADER
    assert reader.requests() == REQUESTS
    assert not reader.skipped_partial


def test_lines_stay_short_and_absent_means_unknown(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, HEADER, [TraceRequest(t=1.5)])
    line = json.loads(path.read_text().splitlines()[1])
    assert line == {"t": 1.5, "endpoint": "completions", "stream": True}


def test_a_partial_last_line_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, HEADER, REQUESTS)
    with path.open("a") as handle:
        handle.write('{"t": 0.5, "endpoint": "ch')  # the crash
    with caplog.at_level(logging.WARNING):
        reader = TraceReader(path)
        assert reader.requests() == REQUESTS
    assert reader.skipped_partial and "incomplete" in caplog.text


def test_a_truncated_gzip_keeps_what_was_decoded(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, HEADER, REQUESTS * 200)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    reader = TraceReader(path)
    got = reader.requests()
    assert 0 < len(got) <= 400 and reader.skipped_partial
    assert got == (REQUESTS * 200)[: len(got)]


def test_a_bad_line_in_the_middle_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, HEADER, REQUESTS)
    lines = path.read_text().splitlines()
    lines.insert(2, "{broken")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=":3: not valid JSON"):
        TraceReader(path).requests()


def test_a_bad_request_line_is_an_error_naming_its_line(tmp_path: Path) -> None:
    """The reader and lint read lines alike (`TraceReader.lines`): a line that is JSON but not
    a request is an error with its file and line, as an unreadable one is."""
    path = tmp_path / "t.jsonl"
    write_trace(path, HEADER, REQUESTS)
    lines = path.read_text().splitlines()
    lines[1:1] = ['{"n_in": 5}', "[1, 2]"]
    path.write_text("\n".join(lines) + "\n")
    entries = list(TraceReader(path).lines())
    assert [(e.line, e.error) for e in entries[:2]] == [
        (2, "a request line needs `t` (arrival, seconds)"),
        (3, "not a JSON object"),
    ]
    assert all(e.request is not None for e in entries[2:])
    with pytest.raises(TraceFormatError, match=":2: a request line needs `t`"):
        TraceReader(path).requests()


def test_refuses_non_traces_and_newer_versions(tmp_path: Path) -> None:
    public = tmp_path / "mooncake.jsonl"
    public.write_text('{"timestamp": 0, "input_length": 10}\n')
    with pytest.raises(TraceFormatError, match="not a sidecar-trace"):
        TraceReader(public)
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceFormatError, match="sidecar trace import"):
        TraceReader(csv)
    newer = tmp_path / "newer.jsonl"
    newer.write_text(json.dumps({"format": "sidecar-trace", "version": FORMAT_VERSION + 1}) + "\n")
    with pytest.raises(TraceFormatError, match="newer than this sidecar reads"):
        TraceReader(newer)
    with pytest.raises(TraceFormatError, match="cannot read"):
        TraceReader(tmp_path / "missing.jsonl")
    with gzip.open(tmp_path / "empty.jsonl.gz", "wb"):
        pass
    with pytest.raises(TraceFormatError):
        TraceReader(tmp_path / "empty.jsonl.gz")


def test_prefix_blocks_validate() -> None:
    with pytest.raises(TraceFormatError, match="unit"):
        PrefixBlocks.from_dict({"unit": "bytes", "size": 1, "hashes": []})
    with pytest.raises(TraceFormatError, match="size"):
        PrefixBlocks.from_dict({"unit": "tokens", "size": 0, "hashes": []})
