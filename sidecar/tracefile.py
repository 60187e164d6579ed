"""The trace file format: versioned JSONL (optionally gzip), one header line, one line per request.

    {"format": "sidecar-trace", "version": 1, "source": "capture", "start_wall_ns": ..., ...}
    {"t": 0.0, "endpoint": "chat", "model": "m", "stream": true, "n_in": 812, "n_out": 64, ...}
    {"t": 0.137, ...}

Units: ``t`` is seconds since ``start_wall_ns`` (the arrival of the request at the proxy, or
the trace's own clock for imports), lengths are tokens, latencies are seconds. Prefix sharing is
a list of chained, salted block hashes (``prefix.hashes``): two requests whose first k hashes
are equal share their first k blocks of ``prefix.size`` ``prefix.unit`` ("tokens" or "chars");
the salt never leaves the capturing process, so no text can be recovered from a hash.

Durability: each line is written whole and flushed; a reader skips a final line that is not
valid JSON (a crash mid-write) with a warning and keeps every line before it. A newer format
version is refused with a clear error; older versions go through `MIGRATIONS`.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any

FORMAT_NAME = "sidecar-trace"
FORMAT_VERSION = 1

log = logging.getLogger(__name__)


class TraceFormatError(ValueError):
    """A file that is not a trace this build can read, with the reason."""


@dataclass(frozen=True, slots=True)
class PrefixBlocks:
    """Chained block hashes of a prompt's prefix: equal leading hashes = shared prefix."""

    unit: str  # "tokens" | "chars"
    size: int  # block size in that unit
    hashes: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "size": self.size, "hashes": list(self.hashes)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrefixBlocks:
        unit = str(data["unit"])
        if unit not in ("tokens", "chars"):
            raise TraceFormatError(f"prefix unit must be 'tokens' or 'chars', not {unit!r}")
        size = int(data["size"])
        if size <= 0:
            raise TraceFormatError(f"prefix block size must be > 0, not {size}")
        return cls(unit, size, tuple(int(h) for h in data.get("hashes", ())))


@dataclass(frozen=True, slots=True)
class TraceHeader:
    source: str  # "capture", "mooncake", "azure-2023", "azure-2024", "burstgpt", ...
    start_wall_ns: int = 0  # calendar instant of t = 0 (0 when the source has none)
    sidecar_version: str = ""
    models: tuple[str, ...] = ()
    route_policy: str | None = None
    slos: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    text_included: bool = False  # prompt/completion text or bodies are in this file (opt-in)
    notes: Mapping[str, Any] = field(default_factory=dict)  # importer provenance, units, ...
    version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "source": self.source,
            "start_wall_ns": self.start_wall_ns,
            "sidecar_version": self.sidecar_version,
            "models": list(self.models),
            "route_policy": self.route_policy,
            "slos": {k: dict(v) for k, v in self.slos.items()},
            "text_included": self.text_included,
            "notes": dict(self.notes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TraceHeader:
        return cls(
            source=str(data.get("source", "unknown")),
            start_wall_ns=int(data.get("start_wall_ns") or 0),
            sidecar_version=str(data.get("sidecar_version", "")),
            models=tuple(str(m) for m in data.get("models", ())),
            route_policy=data.get("route_policy"),
            slos={
                str(k): {str(m): float(v) for m, v in t.items()}
                for k, t in (data.get("slos") or {}).items()
            },
            text_included=bool(data.get("text_included", False)),
            notes=dict(data.get("notes") or {}),
            version=int(data["version"]),
        )


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: what to send (shape of the work) and what was measured."""

    t: float  # arrival, seconds since the header's start
    endpoint: str = "completions"  # "chat" | "completions"
    model: str | None = None
    stream: bool = True
    n_in: int | None = None
    n_out: int | None = None
    n_cached: int | None = None
    max_tokens: int | None = None
    ignore_eos: bool | None = None
    n: int = 1
    temperature: float | None = None
    prefix: PrefixBlocks | None = None
    session_id: str | None = None
    wall_ns: int | None = None
    request_id: str | None = None
    # What was measured (captures; imports that have it): outcome and client-side latencies.
    outcome: str | None = None
    http_status: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    server_ttft_s: float | None = None
    # From the request's first byte to the whole request read (the upload's share of ttft_s).
    request_read_s: float | None = None
    # Opt-in only: the request body as received, and the completion text.
    body: Mapping[str, Any] | None = None
    completion_text: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.t}
        for f in fields(self):
            if f.name == "t":
                continue
            value = getattr(self, f.name)
            if value is None or (f.name == "n" and value == 1):
                continue  # absent = unknown (or the default n=1): keeps lines short
            out[f.name] = value.to_dict() if isinstance(value, PrefixBlocks) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TraceRequest:
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k in known}
        if "t" not in kwargs:
            raise TraceFormatError("a request line needs `t` (arrival, seconds)")
        kwargs["t"] = float(kwargs["t"])
        if kwargs.get("prefix") is not None:
            kwargs["prefix"] = PrefixBlocks.from_dict(kwargs["prefix"])
        for name in ("n_in", "n_out", "n_cached", "max_tokens", "wall_ns", "http_status"):
            if kwargs.get(name) is not None:
                kwargs[name] = int(kwargs[name])
        return cls(**kwargs)


def unreplayable_reason(request: TraceRequest, *, use_captured_body: bool = True) -> str | None:
    """Why `sidecar replay` cannot send this line, or None when it can: the one rule that
    replay (which skips such lines and counts them) and `sidecar trace lint` (which lists them)
    share. A captured body is sent as it is; without one the prompt is rebuilt from n_in and
    the output bounded by n_out or max_tokens (`sidecar.replay.payload.build_body`). A failed
    request is replayable when its sizes are known (it is part of the workload); one that
    failed before the server counted its prompt (a 404 for a mistyped model) is not."""
    if use_captured_body and request.body is not None:
        return None
    if request.n_in is None:
        return "n_in missing: prompt size unknown"
    if request.n_in == 0:
        return "n_in=0: prompt size unknown"
    if request.n_in < 0:
        return f"n_in={request.n_in}: not a token count"
    if request.n_out is None and request.max_tokens is None:
        return "n_out and max_tokens missing: output length unknown"
    return None


# version -> function turning a line of that version into the next version's shape.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def open_text(path: Path, mode: str) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]
    return open(path, mode, encoding="utf-8")  # noqa: SIM115 - returned to the caller


COMPRESSED_CUT = "compressed stream ends early"


@dataclass(frozen=True, slots=True)
class TraceLine:
    """One request line: its number in the file, and the request or why it is unreadable."""

    line: int
    request: TraceRequest | None
    error: str | None = None
    partial: bool = False  # the unreadable last line of a file cut short
    text: str = ""  # the line as written (duplicate detection compares lines, not objects)


class TraceReader:
    """Reads a trace file (plain or .gz): ``header`` then iterate the requests.

    The one reader of the format (migrations included): iterating gives the requests, and a
    last line cut short by a crash is skipped with a warning (``skipped_partial`` says so),
    a bad line anywhere else is an error naming its line number; `lines` gives every line,
    the unreadable ones too (lint).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.skipped_partial = False
        self._version = FORMAT_VERSION
        try:
            with open_text(self.path, "r") as handle:
                first = handle.readline()
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            cause = getattr(exc, "strerror", None) or exc
            raise TraceFormatError(f"{self.path}: cannot read: {cause}") from None
        try:
            data = json.loads(first)
        except json.JSONDecodeError:
            raise TraceFormatError(
                f"{self.path}: the first line is not a JSON trace header; to read a public "
                "trace, convert it first: sidecar trace import --format ..."
            ) from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise TraceFormatError(f"{self.path}: not a {FORMAT_NAME} file (no header line)")
        version = int(data.get("version", 0))
        if version > FORMAT_VERSION:
            raise TraceFormatError(
                f"{self.path}: format version {version} is newer than this sidecar reads "
                f"({FORMAT_VERSION}); upgrade the sidecar"
            )
        self._version = version
        self.header = TraceHeader.from_dict(data)

    def _migrate(self, data: dict[str, Any]) -> dict[str, Any]:
        version = self._version
        while version < FORMAT_VERSION:
            data = MIGRATIONS[version](data)
            version += 1
        return data

    def __iter__(self) -> Iterator[TraceRequest]:
        for _line, request in self.numbered():
            yield request

    def lines(self) -> Iterator[TraceLine]:
        """Every request line with its number in the file (the header is line 1), migrated to
        this version; an unreadable line is reported (``error``) and reading goes on, so that
        `sidecar trace lint` can list every bad line. The last line, or the end of a
        compressed stream cut short, is ``partial`` when a crash cut it (a reader keeps
        everything before it)."""
        pending: TraceLine | None = None  # an unreadable line: fatal unless it is the last
        line_no = 1
        with open_text(self.path, "r") as handle:
            handle.readline()
            try:
                for text in handle:
                    line_no += 1
                    if pending is not None:
                        yield pending
                        pending = None
                    if not text.strip():
                        continue
                    try:
                        data = json.loads(text)
                    except json.JSONDecodeError as exc:
                        pending = TraceLine(line_no, None, f"not valid JSON ({exc.msg})")
                        continue
                    try:
                        if not isinstance(data, dict):
                            raise TraceFormatError("not a JSON object")
                        request = TraceRequest.from_dict(self._migrate(data))
                    except (TraceFormatError, TypeError, ValueError, KeyError) as exc:
                        yield TraceLine(line_no, None, str(exc) or type(exc).__name__)
                        continue
                    yield TraceLine(line_no, request, text=text.strip())
            except (EOFError, gzip.BadGzipFile, OSError):
                # A compressed file cut short by a crash: everything decoded so far stands (an
                # unreadable line just before the cut is the line the cut went through).
                if pending is not None:
                    yield TraceLine(pending.line, None, pending.error, partial=True)
                yield TraceLine(line_no, None, COMPRESSED_CUT, partial=True)
                return
        if pending is not None:
            yield TraceLine(pending.line, None, pending.error, partial=True)

    def numbered(self) -> Iterator[tuple[int, TraceRequest]]:
        """Each request with its line number in the file (the header is line 1): `lines`,
        where an unreadable line is an error, but a partial last line is skipped with a
        warning (``skipped_partial``)."""
        for line in self.lines():
            if line.request is not None:
                yield line.line, line.request
            elif not line.partial:
                raise TraceFormatError(f"{self.path}:{line.line}: {line.error}")
            elif line.error == COMPRESSED_CUT:
                log.warning(
                    "%s: compressed stream ends early after line %d; reading stops there",
                    self.path,
                    line.line,
                )
                self.skipped_partial = True
            else:
                log.warning(
                    "%s: last line (%d) is incomplete (a crash mid-write?); skipped",
                    self.path,
                    line.line,
                )
                self.skipped_partial = True

    def requests(self) -> list[TraceRequest]:
        return list(self)


def write_trace(
    path: str | os.PathLike[str],
    header: TraceHeader,
    requests: Sequence[TraceRequest] | Iterator[TraceRequest],
) -> int:
    """Write a whole trace (importers, tests). Returns the number of request lines."""
    count = 0
    with open_text(Path(path), "w") as handle:
        handle.write(json.dumps(header.to_dict(), separators=(",", ":")) + "\n")
        for request in requests:
            handle.write(
                json.dumps(request.to_dict(), separators=(",", ":"), ensure_ascii=False) + "\n"
            )
            count += 1
    return count


def header_line(header: TraceHeader) -> str:
    return json.dumps(header.to_dict(), separators=(",", ":")) + "\n"


def request_line(request: TraceRequest) -> str:
    return json.dumps(request.to_dict(), separators=(",", ":"), ensure_ascii=False) + "\n"
