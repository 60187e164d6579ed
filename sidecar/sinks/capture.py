"""Capture: every chat/completions request as a line of a trace file (tracefile.py format).

Off the event loop: `on_record` only puts the record in a bounded queue (never blocks; when
the queue is full the record is dropped and counted). A writer thread turns records into lines,
writes them in batches, and flushes after each batch, so a crash (even SIGKILL) loses at most
the records still queued, and a reader sees whole lines followed by at most one partial line,
which it skips. Files rotate by size and age; each file starts with its own header.

A write error (a full disk) drops that batch, counts it, and abandons the file (its tail may be a
partial line, which readers skip); the next batch opens a new part, retried at most every few
seconds while the error lasts. Serving goes on throughout.

Lines are in completion order, not arrival order: a replay sorts by ``t``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import IO

from sidecar import stats
from sidecar.record import RequestRecord, Vantage
from sidecar.sinks.window import GENERATION_ENDPOINTS
from sidecar.tracefile import (
    PrefixBlocks,
    TraceHeader,
    TraceRequest,
    header_line,
    open_text,
    request_line,
)

log = logging.getLogger(__name__)

_STOP = object()
_RETRY_OPEN_S = 5.0


def trace_request(record: RequestRecord, start_wall_ns: int) -> TraceRequest:
    """The trace line of one record: the shape of the work, and what was measured."""
    shape = record.shape
    client = stats.request_latency(record, Vantage.CLIENT)
    server = stats.request_latency(record, Vantage.SERVER)
    prefix = None
    if shape is not None and shape.prefix_unit is not None:
        prefix = PrefixBlocks(shape.prefix_unit, shape.prefix_size, shape.prefix_hashes)
    body = None
    if shape is not None and shape.body is not None:
        try:
            parsed = json.loads(shape.body)
            body = parsed if isinstance(parsed, dict) else None
        except ValueError:
            body = None
    return TraceRequest(
        t=(record.wall_time_ns - start_wall_ns) / 1e9,
        endpoint=record.endpoint,
        model=record.model,
        stream=record.client_stream,
        n_in=record.n_in,
        n_out=record.n_out,
        n_cached=record.n_cached,
        max_tokens=shape.max_tokens if shape else None,
        ignore_eos=shape.ignore_eos if shape else None,
        n=shape.n if shape else 1,
        temperature=shape.temperature if shape else None,
        prefix=prefix,
        session_id=shape.session_id if shape else None,
        wall_ns=record.wall_time_ns,
        request_id=record.request_id,
        outcome=record.outcome.value,
        http_status=record.http_status,
        ttft_s=client.ttft_s if client else None,
        tpot_s=client.tpot_s if client else None,
        e2e_s=client.e2e_s if client else None,
        server_ttft_s=server.ttft_s if server else None,
        body=body,
        completion_text=shape.completion_text if shape else None,
    )


class CaptureSink:
    name = "capture"

    def __init__(self, directory: str | os.PathLike[str], header: TraceHeader, *,
                 compress: bool = False, rotate_bytes: int = 256 * 1024 * 1024,
                 rotate_s: float = 3600.0, queue_size: int = 10_000,
                 flush_interval_s: float = 0.2) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.header = header
        self.compress = compress
        self.rotate_bytes = rotate_bytes
        self.rotate_s = rotate_s
        self.flush_interval_s = flush_interval_s
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self.dropped_queue_full = 0
        self.dropped_write_errors = 0
        self.written = 0
        self.files: list[Path] = []
        self._handle: IO[str] | None = None
        self._opened_at = 0.0
        self._bytes = 0
        self._part = 0
        self._next_open_attempt = 0.0
        self._stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(header.start_wall_ns / 1e9))
        self._thread = threading.Thread(target=self._run, name="capture-writer", daemon=True)
        self._thread.start()

    # -- event loop side ------------------------------------------------------------------

    def on_record(self, record: RequestRecord) -> None:
        if record.endpoint not in GENERATION_ENDPOINTS:
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped_queue_full += 1

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write everything queued, close the file. Blocking: call it off the event loop
        (``await asyncio.to_thread(sink.close)``) or at shutdown."""
        if not self._thread.is_alive():
            return
        self._queue.put(_STOP, timeout=timeout_s)
        self._thread.join(timeout_s)

    # -- writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            try:
                item = self._queue.get(timeout=self.flush_interval_s)
            except queue.Empty:
                self._maybe_rotate()
                continue
            batch: list[RequestRecord] = []
            while True:
                if item is _STOP:
                    stopping = True
                    break
                assert isinstance(item, RequestRecord)
                batch.append(item)
                if len(batch) >= 1000:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._write(batch)
            self._maybe_rotate()
        self._close_file()

    def _write(self, batch: list[RequestRecord]) -> None:
        start = self.header.start_wall_ns
        text = "".join(request_line(trace_request(r, start)) for r in batch)
        handle = self._ensure_file()
        if handle is None:
            self.dropped_write_errors += len(batch)
            return
        try:
            handle.write(text)
            handle.flush()
        except OSError as exc:
            self.dropped_write_errors += len(batch)
            log.error("capture: writing %s failed (%s); %d records dropped so far; serving "
                      "goes on", self.files[-1], exc.strerror or exc, self.dropped_write_errors)
            self._abandon_file()
            return
        self.written += len(batch)
        self._bytes += len(text.encode("utf-8"))

    def _ensure_file(self) -> IO[str] | None:
        if self._handle is not None:
            return self._handle
        now = time.monotonic()
        if now < self._next_open_attempt:
            return None
        suffix = ".jsonl.gz" if self.compress else ".jsonl"
        path = self.directory / f"capture-{self._stamp}-{self._part:04d}{suffix}"
        self._part += 1
        handle: IO[str] | None = None
        try:
            if self.header.text_included:
                # Prompts and completions: readable by the sidecar's user only, from creation.
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
            handle = open_text(path, "a")
            line = header_line(replace(self.header, notes={**self.header.notes,
                                                            "part": self._part - 1}))
            handle.write(line)
            handle.flush()
        except OSError as exc:
            if handle is not None:
                self._discard(handle)
            log.error("capture: cannot open %s (%s); retrying in %g s", path,
                      exc.strerror or exc, _RETRY_OPEN_S)
            self._next_open_attempt = now + _RETRY_OPEN_S
            return None
        self.files.append(path)
        self._handle = handle
        self._opened_at = now
        self._bytes = len(line)
        return handle

    def _maybe_rotate(self) -> None:
        if self._handle is None:
            return
        if self._bytes >= self.rotate_bytes or (
                time.monotonic() - self._opened_at >= self.rotate_s):
            self._close_file()

    def _close_file(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            handle.flush()
            os.fsync(handle.fileno())  # a finished part is on disk, not just in the page cache
            handle.close()
        except (OSError, ValueError) as exc:
            log.error("capture: closing %s failed: %s", self.files[-1], exc)

    def _abandon_file(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._discard(handle)
        self._next_open_attempt = time.monotonic() + _RETRY_OPEN_S

    @staticmethod
    def _discard(handle: IO[str]) -> None:
        """Close a file whose buffered bytes cannot be written (they are counted as dropped)."""
        try:
            handle.close()
        except OSError:
            # close() tried to flush again and failed; the descriptor is released anyway.
            pass
