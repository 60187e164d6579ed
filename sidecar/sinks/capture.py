"""Capture: every chat/completions request as a line of a trace file (tracefile.py format).

Off the event loop: `on_record` only puts the record in a bounded queue (never blocks; when
the queue is full the record is dropped and counted). A writer thread turns records into lines,
writes them in batches, and flushes after each batch, so a crash (even SIGKILL) loses at most
the records still queued, and a reader sees whole lines followed by at most one partial line,
which it skips. Files rotate by size and age; each file starts with its own header.

A write error (a full disk) drops that batch, counts it, and abandons the file (its tail may be a
partial line, which readers skip); the next batch opens a new part, retried at most every few
seconds while the error lasts. Serving goes on throughout.

The writer survives any record: a line that cannot be encoded as it is (a lone surrogate from
a prompt, valid JSON) is written with that character escaped; a record that cannot be turned
into a line at all is dropped and counted, and a writer thread that died anyway is restarted by
the next record (counted, logged). The queue is bounded in records and in bytes (bodies and
completions kept with --capture-text can be megabytes each).

Files are created exclusively (``O_EXCL``, never through a symlink) with mode 0600, in a
directory this process owns and no one else may write to (created 0700): a capture holds
traffic metadata, and with --capture-text prompts and completions.

Lines are in completion order, not arrival order: a replay sorts by ``t``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from dataclasses import replace
from pathlib import Path
from typing import IO

from sidecar import stats
from sidecar.hooks import QueuedSink
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

_RETRY_OPEN_S = 5.0
# What a queued record costs beyond its text (timelines, ids, shape), by estimate.
_RECORD_OVERHEAD_BYTES = 1024


class CaptureDirError(ValueError):
    """The capture directory cannot be used safely; the message says why, in one line."""


def prepare_directory(directory: Path) -> None:
    """Create the capture directory (0700) or check an existing one: a directory, writable
    here, not writable by others (someone else could plant files or links in it)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.lstat()
    except OSError as exc:
        raise CaptureDirError(f"capture directory {directory}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise CaptureDirError(
            f"capture directory {directory}: not a directory"
            + (" (a symbolic link)" if stat.S_ISLNK(info.st_mode) else "")
        )
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise CaptureDirError(
            f"capture directory {directory}: writable by every user (mode "
            f"{stat.S_IMODE(info.st_mode):04o}); anyone could plant a file or link there. "
            f"Use a directory of its own (chmod o-w {directory})"
        )
    if info.st_mode & stat.S_IWOTH or (info.st_mode & stat.S_IWGRP and info.st_uid != os.geteuid()):
        raise CaptureDirError(
            f"capture directory {directory}: others can write to it (mode "
            f"{stat.S_IMODE(info.st_mode):04o}, owner uid {info.st_uid}); use a directory "
            "of its own"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CaptureDirError(f"capture directory {directory}: not writable by this user")


def _record_bytes(record: RequestRecord) -> int:
    shape = record.shape
    size = _RECORD_OVERHEAD_BYTES
    if shape is not None:
        size += len(shape.body or "") + len(shape.completion_text or "")
    return size


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
        request_read_s=(None if record.request_read_ns is None else record.request_read_ns / 1e9),
        body=body,
        completion_text=shape.completion_text if shape else None,
    )


class CaptureSink(QueuedSink):
    """Writes each chat/completions record as a trace line, on a writer thread of its own
    (`QueuedSink`: bounded queue, batches, counted drops). Other paths are ``skipped``."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        header: TraceHeader,
        *,
        compress: bool = False,
        rotate_bytes: int = 256 * 1024 * 1024,
        rotate_s: float = 3600.0,
        queue_size: int = 10_000,
        queue_bytes: int = 256 * 1024 * 1024,
        flush_interval_s: float = 0.2,
    ) -> None:
        self.directory = Path(directory)
        prepare_directory(self.directory)
        self.header = header
        self.compress = compress
        self.rotate_bytes = rotate_bytes
        self.rotate_s = rotate_s
        self.flush_interval_s = flush_interval_s
        self.dropped_unwritable = 0  # records that could not be turned into a line
        self.escaped_lines = 0  # lines written with unencodable characters escaped
        self.files: list[Path] = []
        self._handle: IO[str] | None = None
        self._opened_at = 0.0
        self._bytes = 0
        self._part = 0
        self._next_open_attempt = 0.0
        self._stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(header.start_wall_ns / 1e9))
        # Last: this starts the writer thread, which uses everything above. It wakes up every
        # flush_interval_s when idle, so that a file rotates by age without traffic.
        super().__init__(
            "capture",
            queue_size=queue_size,
            queue_bytes=queue_bytes,
            idle_s=flush_interval_s,
            thread_name="capture-writer",
        )

    def _accepts(self, record: RequestRecord) -> bool:
        return record.endpoint in GENERATION_ENDPOINTS

    def _record_bytes(self, record: RequestRecord) -> int:
        return _record_bytes(record)

    def _extra_counters(self) -> dict[str, int]:
        return {
            "dropped_unwritable": self.dropped_unwritable,
            "escaped_lines": self.escaped_lines,
            "files": len(self.files),
        }

    # -- writer thread (QueuedSink's hooks) ---------------------------------------------------

    def _write_batch(self, batch: list[RequestRecord]) -> None:
        self._write(batch)

    def _idle(self) -> None:
        self._maybe_rotate()

    def _finish(self) -> None:
        self._close_file()

    def _line(self, record: RequestRecord) -> str | None:
        """The record's trace line, or None (counted) when it cannot be made."""
        try:
            line = request_line(trace_request(record, self.header.start_wall_ns))
        except Exception as exc:  # noqa: BLE001 - one bad record must not stop the capture
            self.dropped_unwritable += 1
            log.error(
                "capture: record %s dropped, it cannot be written as a trace line (%s)",
                record.request_id,
                type(exc).__name__,
            )
            return None
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (JSON allows "\ud800"; UTF-8 cannot hold it). It can only sit
            # inside a JSON string, where the backslash escape is what JSON itself writes.
            self.escaped_lines += 1
            line = line.encode("utf-8", "backslashreplace").decode("utf-8")
        return line

    def _write(self, batch: list[RequestRecord]) -> None:
        lines = [line for line in map(self._line, batch) if line is not None]
        batch_written = len(lines)
        text = "".join(lines)
        handle = self._ensure_file()
        if handle is None:
            self.dropped_write_errors += batch_written
            return
        try:
            handle.write(text)
            handle.flush()
        except OSError as exc:
            self.dropped_write_errors += batch_written
            log.error(
                "capture: writing %s failed (%s); %d records dropped so far; serving goes on",
                self.files[-1],
                exc.strerror or exc,
                self.dropped_write_errors,
            )
            self._abandon_file()
            return
        self.written += batch_written
        self._bytes += len(text.encode("utf-8"))

    def _ensure_file(self) -> IO[str] | None:
        if self._handle is not None:
            return self._handle
        now = time.monotonic()
        if now < self._next_open_attempt:
            return None
        suffix = ".jsonl.gz" if self.compress else ".jsonl"
        handle: IO[str] | None = None
        path = self.directory
        try:
            # A new file, created here, never an existing one or a link planted at the
            # predictable name (O_EXCL fails on both: that name is skipped, and said);
            # readable by this user only from the first byte (0600: metadata of the traffic,
            # prompts with --capture-text). The directory admits no other writer
            # (`prepare_directory`), so the file opened next is the one just created.
            for _attempt in range(1000):
                path = self.directory / f"capture-{self._stamp}-{self._part:04d}{suffix}"
                self._part += 1
                try:
                    os.close(
                        os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    )
                    break
                except FileExistsError:
                    log.warning("capture: %s already exists (not ours): skipped", path)
            else:
                raise FileExistsError(
                    f"1000 capture file names in a row already exist in {self.directory}"
                )
            handle = open_text(path, "a")
            line = header_line(
                replace(self.header, notes={**self.header.notes, "part": self._part - 1})
            )
            handle.write(line)
            handle.flush()
        except OSError as exc:
            if handle is not None:
                self._discard(handle)
            log.error(
                "capture: cannot open %s (%s); retrying in %g s",
                path,
                exc.strerror or exc,
                _RETRY_OPEN_S,
            )
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
            time.monotonic() - self._opened_at >= self.rotate_s
        ):
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
