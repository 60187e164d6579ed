"""`sidecar trace merge` and the capture key a fleet shares (--capture-key-file)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from factories import S
from proxy_stack import stack

from sidecar.config import ConfigError, build_config
from sidecar.replay import trace_cli
from sidecar.replay.tracemerge import MergeRefused, merge_traces
from sidecar.tracefile import PrefixBlocks, TraceHeader, TraceReader, TraceRequest, write_trace


def capture(
    path: Path, start_s: float, key: str | None, requests: list[tuple[float, str]], model: str = "m"
) -> Path:
    notes = {"capture_key_id": key} if key else {}
    write_trace(
        path,
        TraceHeader(
            source="capture",
            start_wall_ns=int(start_s * S),
            models=(model,),
            route_policy="round_robin",
            notes=notes,
        ),
        [
            TraceRequest(
                t=t,
                n_in=10,
                n_out=2,
                request_id=name,
                model=model,
                prefix=PrefixBlocks("chars", 256, (1, 2)),
            )
            for t, name in requests
        ],
    )
    return path


def test_files_are_put_on_one_clock_and_ordered_by_arrival(tmp_path: Path) -> None:
    """A starts at 1000.0 s and wrote x (t 0.5) before y (t 0.1): completion order. B starts at
    1000.2 s: z at t 0, w at t 0.5. On A's clock (the earliest): y 0.1, z 0.2, x 0.5, w 0.7."""
    a = capture(tmp_path / "a.jsonl", 1000.0, "k1", [(0.5, "x"), (0.1, "y")])
    b = capture(tmp_path / "b.jsonl", 1000.2, "k1", [(0.0, "z"), (0.5, "w")], model="n")
    merged = merge_traces([a, b], tmp_path / "fleet.jsonl.gz")
    reader = TraceReader(merged.output)
    lines = list(reader.requests())
    assert [r.request_id for r in lines] == ["y", "z", "x", "w"]
    assert [r.t for r in lines] == pytest.approx([0.1, 0.2, 0.5, 0.7])
    header = reader.header
    assert header.start_wall_ns == 1000 * S and header.models == ("m", "n")
    assert header.source == "capture" and header.route_policy == "round_robin"
    assert header.notes["capture_key_id"] == "k1"
    assert [f["requests"] for f in header.notes["merged_from"]] == [2, 2]
    assert merged.requests == 4 and merged.warnings == ()


def test_what_would_mislead_a_replay_is_refused(tmp_path: Path) -> None:
    a = capture(tmp_path / "a.jsonl", 1000.0, "k1", [(0.1, "x")])
    b = capture(tmp_path / "b.jsonl", 1000.5, "k2", [(0.1, "y")])
    with pytest.raises(MergeRefused, match="different keys"):
        merge_traces([a, b], tmp_path / "out.jsonl")
    forced = merge_traces([a, b], tmp_path / "out.jsonl", force=True)
    notes = TraceReader(forced.output).header.notes
    assert "different keys" in notes["merge_warnings"][0] and "capture_key_id" not in notes
    # No calendar start: refused; forced, the file starts with the earliest one.
    c = capture(tmp_path / "c.jsonl", 0.0, "k1", [(0.3, "z")])
    with pytest.raises(MergeRefused, match="no calendar start"):
        merge_traces([a, c], tmp_path / "out2.jsonl")
    forced = merge_traces([a, c], tmp_path / "out2.jsonl", force=True)
    merged = TraceReader(forced.output).requests()
    assert [r.request_id for r in merged] == ["x", "z"]
    assert [r.t for r in merged] == pytest.approx([0.1, 0.3])


def test_the_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = capture(tmp_path / "a.jsonl", 1000.0, "k1", [(0.1, "x")])
    b = capture(tmp_path / "b.jsonl", 1000.5, "k2", [(0.1, "y")])
    out = tmp_path / "out.jsonl"

    def run(*argv: str) -> int:
        return asyncio.run(trace_cli.run(trace_cli.build_parser().parse_args(list(argv))))

    assert run("merge", str(a), str(b), "-o", str(out)) == 3
    assert "different keys" in capsys.readouterr().err and not out.exists()
    assert run("merge", str(a), str(b), "-o", str(out), "--force") == 0
    assert run("merge", str(a), "-o", str(out)) == 2  # exists: an input error
    assert run("merge", str(a), "-o", str(out), "--overwrite") == 0
    assert "merged 1 requests" in capsys.readouterr().out


def test_a_capture_key_is_checked_when_the_proxy_starts(tmp_path: Path) -> None:
    short = tmp_path / "short.key"
    short.write_bytes(b"0123456789\n")
    flags: dict[str, Any] = {
        "upstreams": ["http://127.0.0.1:1"],
        "capture_dir": str(tmp_path / "cap"),
        "capture_key_file": str(short),
    }
    with pytest.raises(ConfigError, match="10 bytes; it needs at least 16"):
        build_config(flags, {})
    with pytest.raises(ConfigError, match="No such file"):
        build_config({**flags, "capture_key_file": str(tmp_path / "absent.key")}, {})
    with pytest.raises(ConfigError, match="needs --capture"):
        build_config({"upstreams": ["http://127.0.0.1:1"], "capture_key_file": str(short)}, {})


async def test_sidecars_sharing_a_key_hash_alike_and_their_captures_merge(tmp_path: Path) -> None:
    key = tmp_path / "fleet.key"
    key.write_bytes(b"a-fleet-wide-capture-key-of-32-b\n")
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": 3,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "the same long question " * 40}],
    }

    async def one_sidecar(name: str, key_file: Path | None) -> Path:
        settings: dict[str, Any] = {"capture_dir": str(tmp_path / name)}
        if key_file is not None:
            settings["capture_key_file"] = str(key_file)
        async with stack(**settings) as s, aiohttp.ClientSession() as session:
            async with session.post(
                s.url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "user-7"}
            ) as response:
                await response.read()
            await s.records.wait_for(1)
        (path,) = sorted((tmp_path / name).glob("capture-*.jsonl"))
        return path

    pod_a = await one_sidecar("pod-a", key)
    pod_b = await one_sidecar("pod-b", key)
    loner = await one_sidecar("pod-c", None)
    (a,), (b,), (c,) = (list(TraceReader(p).requests()) for p in (pod_a, pod_b, loner))
    key_ids = [TraceReader(p).header.notes.get("capture_key_id") for p in (pod_a, pod_b, loner)]
    # One key: equal hashes and pseudonyms across pods; a pod on its own key: neither.
    assert a.prefix is not None and b.prefix is not None and c.prefix is not None
    assert a.prefix.hashes == b.prefix.hashes != c.prefix.hashes
    assert a.session_id == b.session_id != c.session_id
    assert key_ids[0] == key_ids[1] != key_ids[2] and all(key_ids)
    assert "a-fleet-wide" not in pod_a.read_text()  # the key itself is never written
    merged = merge_traces([pod_a, pod_b], tmp_path / "fleet.jsonl")
    assert merged.requests == 2 and merged.warnings == ()
    with pytest.raises(MergeRefused, match="different keys"):
        merge_traces([pod_a, loner], tmp_path / "mixed.jsonl")
