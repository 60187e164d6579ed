"""Capture: what a trace line holds, what it never holds, and that nothing completed is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import IO

import aiohttp
import pytest
from proxy_stack import stack

import sidecar.sinks.capture as capture_module
from sidecar.hooks import Sink, dropped_by_reason
from sidecar.record import ChunkMark, Outcome, RequestRecord, RequestShape, Timeline
from sidecar.sinks.capture import CaptureDirError, CaptureSink
from sidecar.tracefile import TraceHeader, TraceReader, TraceRequest, open_text

SECRET_PROMPT = "my very private medical question about " * 30


def read_all(directory: Path) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    for path in sorted(directory.glob("capture-*")):
        requests.extend(TraceReader(path).requests())
    return requests


async def test_capture_through_the_proxy_keeps_shapes_not_text(tmp_path: Path) -> None:
    capture = tmp_path / "cap"
    async with (
        stack(capture_dir=str(capture), capture_block_chars="64") as s,
        aiohttp.ClientSession() as session,
    ):
        for suffix in ("first question", "second question"):
            body = {
                "model": "m",
                "stream": True,
                "max_tokens": 7,
                "ignore_eos": True,
                "temperature": 0.5,
                "messages": [
                    {"role": "system", "content": SECRET_PROMPT},
                    {"role": "user", "content": suffix},
                ],
            }
            async with session.post(
                s.url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "sess-1"}
            ) as response:
                await response.read()
        body = {"model": "m", "prompt": list(range(3, 200)), "max_tokens": 3}
        async with session.post(s.url + "/v1/completions", json=body) as response:
            await response.read()
        await s.records.wait_for(3)
    # The stack closed the proxy: the capture is flushed.
    files = sorted(capture.glob("capture-*.jsonl"))
    assert len(files) == 1
    raw = files[0].read_text()
    assert "private medical" not in raw and "first question" not in raw
    reader = TraceReader(files[0])
    assert reader.header.source == "capture" and not reader.header.text_included
    chats = sorted((r for r in reader if r.endpoint == "chat"), key=lambda r: r.t)
    (completion,) = [r for r in reader if r.endpoint == "completions"]
    assert [c.n_out for c in chats] == [7, 7] and all(c.n_in for c in chats)
    assert chats[0].max_tokens == 7 and chats[0].ignore_eos is True
    # The session id is pseudonymised (no text opt-in): both turns keep one stand-in.
    assert chats[0].temperature == 0.5 and chats[0].session_id is not None
    assert chats[0].session_id.startswith("anon-") and chats[0].session_id == chats[1].session_id
    assert "sess-1" not in raw
    assert chats[0].outcome == "ok" and chats[0].ttft_s is not None and chats[0].t <= chats[1].t
    a, b = chats[0].prefix, chats[1].prefix
    assert a is not None and b is not None and a.unit == "chars" and a.size == 64
    # The long shared system prompt gives equal leading hashes, then the questions differ.
    shared = next(i for i, (x, y) in enumerate(zip(a.hashes, b.hashes, strict=False)) if x != y)
    assert shared >= len(SECRET_PROMPT) // 64
    assert completion.prefix is not None and completion.prefix.unit == "tokens"
    assert len(completion.prefix.hashes) == 4  # 197 token ids in blocks of 64
    assert completion.n_out == 3 and completion.stream is False


async def test_text_is_stored_only_on_opt_in(tmp_path: Path) -> None:
    capture = tmp_path / "cap"
    async with (
        stack(capture_dir=str(capture), capture_text="true") as s,
        aiohttp.ClientSession() as session,
    ):
        body = {
            "model": "m",
            "stream": True,
            "max_tokens": 4,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello there"}],
        }
        async with session.post(
            s.url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "sess-2"}
        ) as response:
            streamed = await response.read()
        await s.records.wait_for(1)
    (line,) = read_all(capture)
    assert TraceReader(next(capture.glob("capture-*"))).header.text_included
    assert line.session_id == "sess-2"  # with the text opt-in, ids are kept as sent
    assert line.body is not None and line.body["messages"][0]["content"] == "hello there"
    assert line.completion_text
    # The captured completion is exactly the text the client received.
    received = "".join(
        json.loads(ev[len("data: ") :])["choices"][0]["delta"].get("content", "")
        for ev in streamed.decode().split("\n\n")
        if ev.startswith("data: {") and '"choices":[{' in ev
    )
    assert line.completion_text == received


def make_record(i: int) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}",
        wall_time_ns=1_000_000_000 + i,
        outcome=Outcome.OK,
        endpoint="chat",
        model="m",
        client=Timeline.from_marks(0, (ChunkMark(1000, 1),), 2000, 1),
        n_in=5,
        n_out=1,
        shape=RequestShape(max_tokens=1),
    )


class HeldCapture(CaptureSink):
    """A capture whose writer waits at its first batch until released."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _write(self, batch: list[RequestRecord]) -> None:
        self.entered.set()
        self.release.wait(10)
        super()._write(batch)


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    sink = HeldCapture(tmp_path, TraceHeader(source="capture"), queue_size=3)
    sink.on_record(make_record(0))
    assert sink.entered.wait(5)  # the writer holds record 0
    started = time.perf_counter()
    for i in range(1, 10):
        sink.on_record(make_record(i))
    assert time.perf_counter() - started < 1.0  # never waited for the writer
    assert sink.dropped_queue_full == 6 and sink.queued == 3
    sink.release.set()
    sink.close()
    assert sink.written == 4
    assert [r.request_id for r in read_all(tmp_path)] == ["r0", "r1", "r2", "r3"]


def test_rotation_by_size_keeps_a_header_per_file(tmp_path: Path) -> None:
    sink = CaptureSink(
        tmp_path, TraceHeader(source="capture"), rotate_bytes=600, flush_interval_s=0.01
    )
    for i in range(20):
        sink.on_record(make_record(i))
        time.sleep(0.003)
    sink.close()
    files = sorted(tmp_path.glob("capture-*.jsonl"))
    assert len(files) > 1
    ids = sorted(r.request_id or "" for r in read_all(tmp_path))  # "": none, which fails
    assert ids == sorted(f"r{i}" for i in range(20))
    assert [TraceReader(f).header.notes["part"] for f in files] == list(range(len(files)))


def test_a_full_disk_drops_and_counts_then_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    sink_dir = tmp_path / "cap"
    header = TraceHeader(source="capture", start_wall_ns=0)
    # The first part file writes to /dev/full: every write fails with ENOSPC.
    real_open = open_text  # capture's own (it imports it from sidecar.tracefile)

    def first_part_full(path: Path, mode: str) -> IO[str]:
        if path.name.endswith("-0000.jsonl"):
            return open("/dev/full", mode, encoding="utf-8")
        return real_open(path, mode)

    monkeypatch.setattr(capture_module, "open_text", first_part_full)
    sink = CaptureSink(sink_dir, header, flush_interval_s=0.01)
    sink.on_record(make_record(0))
    assert sink.flush(5)  # the writer is done with it: dropped, not pending
    assert sink.dropped_write_errors == 1
    sink._next_open_attempt = 0.0  # skip the retry pause (5 s in service)
    sink.on_record(make_record(1))
    sink.close()
    assert sink.written == 1
    good = sink_dir / "capture-19700101T000000Z-0001.jsonl"
    assert [r.request_id for r in TraceReader(good)] == ["r1"]


def test_the_capture_lifecycle_flush_close_and_counters(tmp_path: Path) -> None:
    sink = CaptureSink(tmp_path, TraceHeader(source="capture"))
    assert isinstance(sink, Sink)
    for i in range(3):
        sink.on_record(make_record(i))
    sink.on_record(replace(make_record(9), endpoint="models"))  # not a generation: skipped
    # flush returns once the writer wrote every record taken: readable without closing.
    assert sink.flush(10)
    assert [r.request_id for r in read_all(tmp_path)] == ["r0", "r1", "r2"]
    sink.close(10)
    assert not sink._thread.is_alive()  # joined
    sink.close(10)  # idempotent
    sink.on_record(make_record(3))  # after close: dropped and counted, not queued
    counters = sink.counters()
    assert counters["taken"] == 4 and counters["skipped"] == 1
    assert counters["written"] == 3 and counters["files"] == 1
    assert dropped_by_reason(counters) == {
        "queue_full": 0,
        "closed": 1,
        "write_error": 0,
        "unwritable": 0,
    }
    assert sink.queued == 0 and len(read_all(tmp_path)) == 3


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sidecar", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _url(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    for _ in range(10):
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line.split()[3] if prefix == "proxy" else line.split()[-1]
    raise AssertionError(f"no {prefix!r} line")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_loses_no_completed_record(tmp_path: Path, sig: signal.Signals) -> None:
    capture = tmp_path / "cap"
    sim = _start(["sim", "--replicas", "1", "--port", "0"])
    proxy = None
    try:
        upstream = _url(sim, "replica")
        proxy = _start(
            [
                "proxy",
                "--upstream",
                upstream,
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--health-interval",
                "0",
                "--capture",
                str(capture),
            ]
        )
        url = _url(proxy, "proxy")
        for i in range(25):
            body = json.dumps(
                {
                    "model": "sim-model",
                    "prompt": f"request {i}",
                    "max_tokens": 2,
                    "stream": i % 2 == 0,
                }
            ).encode()
            request = urllib.request.Request(
                url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                response.read()
        if sig is signal.SIGKILL:
            time.sleep(0.6)  # past the writer's flush interval: what was written must survive
        proxy.send_signal(sig)
        proxy.wait(timeout=20)
    finally:
        for proc in (proxy, sim):
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=10)
                for stream in (proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
    if sig is signal.SIGTERM:
        assert proxy.returncode == 0
    lines = read_all(capture)
    assert sorted(int(r.request_id is not None) for r in lines) == [1] * 25
    assert len(lines) == 25 and all(r.outcome == "ok" for r in lines)


# -- what a hostile client or a careless operator once broke (issue 16) ----------------------


def text_record(i: int, body: str) -> RequestRecord:
    return RequestRecord(
        request_id=f"t{i}",
        wall_time_ns=1_000_000_000 + i,
        outcome=Outcome.OK,
        endpoint="chat",
        model="m",
        client=Timeline.from_marks(0, (ChunkMark(1000, 1),), 2000, 1),
        n_in=5,
        n_out=1,
        shape=RequestShape(max_tokens=1, body=body, completion_text="ok \ud800"),
    )


def test_a_lone_surrogate_is_written_escaped_and_the_writer_goes_on(tmp_path: Path) -> None:
    """A prompt with a lone surrogate ("\\ud800" is valid JSON) once raised UnicodeEncodeError
    in the writer thread, which died silently: nothing more was written or counted, and the
    queue kept every later body. Now the line is written with the character escaped, as JSON
    writes it, and the records after it are written too."""
    header = TraceHeader(source="capture", text_included=True)
    sink = CaptureSink(tmp_path, header, flush_interval_s=0.01)
    sink.on_record(text_record(0, '{"messages":[{"role":"user","content":"a \\ud800 b"}]}'))
    for i in range(1, 4):
        sink.on_record(make_record(i))
    sink.close()
    assert sink.written == 4 and sink.escaped_lines == 1 and sink.dropped_unwritable == 0
    requests = read_all(tmp_path)
    assert [r.request_id for r in requests] == ["t0", "r1", "r2", "r3"]
    assert requests[0].body == {"messages": [{"role": "user", "content": "a \ud800 b"}]}
    assert requests[0].completion_text == "ok \ud800"  # read back as it was


def test_a_record_that_cannot_become_a_line_is_dropped_and_counted(tmp_path: Path) -> None:
    sink = CaptureSink(tmp_path, TraceHeader(source="capture"), flush_interval_s=0.01)
    broken = make_record(0)
    object.__setattr__(broken, "wall_time_ns", "not a number")  # trace_request fails on it
    sink.on_record(broken)
    sink.on_record(make_record(1))
    sink.close()
    assert sink.dropped_unwritable == 1 and sink.written == 1
    assert [r.request_id for r in read_all(tmp_path)] == ["r1"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_writer_is_restarted_by_the_next_record(tmp_path: Path) -> None:
    sink = CaptureSink(tmp_path, TraceHeader(source="capture"), flush_interval_s=0.01)
    sink._queue.put(object())  # not a record: the writer's assertion kills the thread
    sink._thread.join(5)
    assert not sink._thread.is_alive()
    sink.on_record(make_record(1))
    sink.close()
    assert sink.writer_restarts == 1 and sink.written == 1


def test_the_queue_is_bounded_in_bytes_too(tmp_path: Path) -> None:
    """Sixty 8 MiB prompts once took RSS from 58 to 699 MB behind a dead writer; the queue
    now also holds at most `queue_bytes` of records."""
    header = TraceHeader(source="capture", text_included=True)
    sink = HeldCapture(tmp_path, header, queue_bytes=3 * 1024 * 1024, flush_interval_s=0.01)
    big = "x" * (1024 * 1024)
    sink.on_record(text_record(0, big))
    assert sink.entered.wait(5)  # the writer holds the first one
    for i in range(1, 10):
        sink.on_record(text_record(i, big))
    assert sink.queued == 2 and sink.dropped_queue_full == 7  # 2 x (1 MiB + 1 KiB) fit in 3 MiB
    sink.release.set()
    sink.close()
    assert sink.written == 3


def test_capture_files_are_new_private_files_never_links(tmp_path: Path) -> None:
    """A symlink planted at the predictable next name made the capture append to another
    file, and a pre-created 0644 file received prompt text. Files are now created exclusively
    (the planted name is skipped) with mode 0600, in a 0700 directory."""
    directory = tmp_path / "cap"
    header = TraceHeader(source="capture", start_wall_ns=0)
    directory.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (directory / "capture-19700101T000000Z-0000.jsonl").symlink_to(victim)
    (directory / "capture-19700101T000000Z-0001.jsonl").write_text("")
    os.chmod(directory / "capture-19700101T000000Z-0001.jsonl", 0o644)
    sink = CaptureSink(directory, header, flush_interval_s=0.01)
    sink.on_record(make_record(0))
    sink.close()
    assert victim.read_text() == "keep me\n"
    assert (directory / "capture-19700101T000000Z-0001.jsonl").read_text() == ""
    (written,) = sink.files
    assert written.name == "capture-19700101T000000Z-0002.jsonl"
    assert os.stat(written).st_mode & 0o777 == 0o600
    fresh = tmp_path / "new" / "cap"
    CaptureSink(fresh, header).close()
    assert os.stat(fresh).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o757])
def test_a_capture_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    os.chmod(directory, mode)
    with pytest.raises(CaptureDirError, match="writable by every user"):
        CaptureSink(directory, TraceHeader(source="capture"))


def test_a_capture_directory_that_is_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(CaptureDirError, match="symbolic link"):
        CaptureSink(tmp_path / "link", TraceHeader(source="capture"))


async def test_non_json_numbers_from_a_client_never_reach_a_trace(tmp_path: Path) -> None:
    """A NaN temperature or a 4,000-digit max_tokens, copied into the capture, once made it
    non-strict JSON that the project's own `trace lint` rejected. The shape keeps only what a
    replay can use: such values are read as absent."""
    capture = tmp_path / "cap"
    huge = "9" * 4000
    async with stack(capture_dir=str(capture)) as s, aiohttp.ClientSession() as session:
        for extra in (
            '"temperature": NaN',
            '"temperature": -Infinity',
            f'"max_tokens": {huge}',
            '"temperature": 1e999',
        ):
            data = ('{"model": "m", "prompt": "hi", "stream": true, ' + extra + "}").encode()
            async with session.post(
                s.url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
            ) as response:
                await response.read()
        await s.records.wait_for(4)
    (path,) = capture.glob("capture-*.jsonl")
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in the trace"))
        assert huge not in line
    lint = subprocess.run(
        [sys.executable, "-m", "sidecar", "trace", "lint", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "not-json" not in lint.stdout + lint.stderr
    requests = TraceReader(path).requests()
    assert len(requests) == 4
    assert all(r.temperature is None for r in requests)
    assert all(r.max_tokens is None for r in requests)
