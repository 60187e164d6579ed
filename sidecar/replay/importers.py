"""Importers: public LLM-inference traces -> sidecar trace files (``sidecar trace import``).

Every input is read line by line, by column or field NAME (never by position), and every
imported request becomes one `TraceRequest`:

    endpoint = --endpoint ("completions"), stream = True, n_in / n_out from the source (tokens),
    max_tokens = n_out (1 where n_out is 0: vLLM refuses max_tokens=0) and ignore_eos = True,
    so that a replay reproduces each output length exactly; model = the source's where it has
    one (BurstGPT), else --model (default none).

Time: each format has a *source clock* (below). ``t`` is that clock in seconds, rebased so that
the earliest imported request has ``t = 0``, then multiplied by ``time_scale`` (0.5 = the same
arrivals twice as fast), rounded to the nanosecond. ``--start-at`` / ``--duration`` select a
window on the source clock; ``--limit`` keeps the first N requests (in file order) that pass.

Formats (``FORMATS``) and the exact mapping:

mooncake   JSONL, kvcache-ai/Mooncake FAST'25 traces and AIPerf's "Mooncake+" extras.
           source clock: ``timestamp`` = ms since the first request -> t = timestamp / 1000.
           input_length -> n_in, output_length -> n_out, hash_ids (one id per 512-token block)
           -> prefix = PrefixBlocks("tokens", 512, hash_ids), session_id -> session_id.
           ``delay`` (ms) is used only for a follow-up row without ``timestamp``: t = the
           session's previous arrival + delay (a lower bound: the previous answer's duration
           is unknown, so this arrival may come early). A first row without ``timestamp`` is
           an error. text_input / messages / payload / tools / extra are not imported (the
           trace carries shapes, not text); rows that had them are counted in the notes.
bailian    JSONL, Alibaba Bailian (qwen-bailian-usagetraces-anon).
           source clock: ``timestamp`` in s. input_length -> n_in, output_length -> n_out,
           hash_ids (salted SipHash, one per 16-token block) -> PrefixBlocks("tokens", 16, ...),
           chat_id -> request_id, root of the parent_chat_id chain (-1 = root) -> session_id,
           ``type`` is counted in the notes, ``turn`` is implied by the order.
azure      CSV, Azure LLM inference traces 2023 (Splitwise) and 2024 (DynamoLLM).
           source clock: TIMESTAMP as calendar time, ns-exact (``2023-11-16 18:15:46.6805900``:
           7 fractional digits; ``2024-05-10 00:00:00.009930+00:00``; ``...00+00:00`` with no
           fraction). A timestamp without a zone is read as UTC. Clock = seconds since the
           first row of the file. ContextTokens -> n_in, GeneratedTokens -> n_out. No prefix,
           no session. Header source "azure-2024" when the first timestamp carries a zone,
           else "azure-2023"; start_wall_ns = the calendar instant of t = 0.
burstgpt   CSV, BurstGPT v1.1 and v2 (the column order of v2 is unverified: names only).
           source clock: ``Timestamp`` = s since 0:00 of day 1. Model -> model, Request tokens
           -> n_in, Response tokens -> n_out, Session ID (v2) -> session_id, Elapsed time
           (v2, s from submission to the full response) -> e2e_s. Total tokens is checked
           against the sum; Log Type is counted in the notes. Response tokens = 0 marks a
           request that failed in the source: kept with outcome "failed_in_source" and
           max_tokens = 1 (its prefill load still happened), or dropped with drop_failed.

Order: the rows of a trace may be out of order (nothing promises the Azure files are sorted).
With ``sort`` (the default) the output is sorted by t, stably (ties keep file order), and the
header notes say how many rows were out of order and by how much; without it the file order is
kept and ``sidecar trace lint`` warns.

Memory: bounded. Rows are spooled to a temporary file next to the output (so the header, which
holds the row counts, can be written first); an out-of-order input is sorted by an external
merge sort over runs of `SORT_RUN_LINES` lines. The only state that grows with the input is
one entry per session (Mooncake+ delay rows) or per chat (Bailian roots). The output is
written under a temporary name and renamed at the end: a failed import leaves no half file.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import heapq
import itertools
import json
import math
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path
from typing import IO, Any

import sidecar
from sidecar.config import parse_duration
from sidecar.tracefile import PrefixBlocks, TraceHeader, TraceRequest, header_line

FORMATS = ("mooncake", "bailian", "azure", "burstgpt")
ENDPOINTS = ("completions", "chat")
FAILED_IN_SOURCE = "failed_in_source"
MOONCAKE_BLOCK_TOKENS = 512
BAILIAN_BLOCK_TOKENS = 16
SORT_RUN_LINES = 500_000  # lines held in memory per sorted run (~150 bytes each)
MAX_EXAMPLES = 5  # example line numbers kept per skip reason / remark
NS_PER_S = 1_000_000_000
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()


class TraceImportError(ValueError):
    """An input that cannot be imported, with the file, the line and the reason."""


@dataclass(frozen=True, slots=True)
class ImportOptions:
    endpoint: str = "completions"
    model: str | None = None  # for sources without a model column
    time_scale: float = 1.0  # multiplies t after the conversion to seconds
    limit: int | None = None  # first N requests that pass the window (file order)
    start_at: str | None = None  # source clock: "90", "15m", "2h"; azure also a timestamp
    duration_s: float | None = None  # window length after start_at (or after the first row)
    drop_failed: bool = False  # BurstGPT rows with Response tokens = 0
    sort: bool = True
    skip_bad_rows: bool = False  # count unparseable rows in the notes instead of failing


@dataclass(frozen=True, slots=True)
class ImportResult:
    output: Path
    header: TraceHeader
    requests: int
    rows_read: int
    skipped: Mapping[str, int]
    out_of_order: int


@dataclass(slots=True)
class SourceRow:
    """One row of a source, in the source's terms, before rebasing its time."""

    line: int
    clock_ns: int  # the format's source clock, ns
    n_in: int
    n_out: int
    model: str | None = None
    prefix: PrefixBlocks | None = None
    session_id: str | None = None
    request_id: str | None = None
    failed: bool = False
    e2e_s: float | None = None


class _BadRow(ValueError):
    """A row that cannot be read; the message says which field and value."""


class _Tally:
    """Counts per reason, with the first few examples of each (line numbers and values)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}

    def add(self, reason: str, example: str | None = None) -> None:
        self.counts[reason] += 1
        if example is not None:
            kept = self.examples.setdefault(reason, [])
            if len(kept) < MAX_EXAMPLES:
                kept.append(example)

    def to_notes(self) -> dict[str, Any]:
        return {
            reason: {"count": count, "examples": self.examples.get(reason, [])}
            for reason, count in sorted(self.counts.items())
        }


# ---------------------------------------------------------------------------------------------
# Field parsing


_CALENDAR = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:[.,](\d{1,9})\d*)?"
    r"\s*(Z|[+-]\d{2}(?::?\d{2})?)?"
)
_day_cache: dict[str, int] = {}


def parse_calendar_ns(text: str) -> tuple[int, bool]:
    """A calendar timestamp -> (ns since the Unix epoch, whether it carried a zone).

    Python's datetime refuses 7 fractional digits (Azure 2023) and inference-perf choked on
    '+00:00' without a fraction (Azure 2024), so this parses the fields itself, exactly:
    ``YYYY-MM-DD HH:MM:SS[.fraction up to 9 digits][Z|±HH:MM]``. No zone = UTC.
    """
    match = _CALENDAR.fullmatch(text.strip())
    if match is None:
        raise ValueError("expected YYYY-MM-DD HH:MM:SS[.fraction][±HH:MM]")
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    day_key = f"{year}-{month}-{day}"
    days = _day_cache.get(day_key)
    if days is None:
        days = date(int(year), int(month), int(day)).toordinal() - _EPOCH_ORDINAL
        if len(_day_cache) < 10_000:  # a trace spans days, not years: keep the cache small
            _day_cache[day_key] = days
    hours, minutes, seconds = int(hour), int(minute), int(second)
    if hours > 23 or minutes > 59 or seconds > 60:
        raise ValueError("hour, minute or second out of range")
    total_s = days * 86400 + hours * 3600 + minutes * 60 + seconds
    ns = total_s * NS_PER_S + (int(fraction.ljust(9, "0")) if fraction else 0)
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        offset_s = int(digits[:2]) * 3600 + (int(digits[2:4]) * 60 if len(digits) > 2 else 0)
        ns -= sign * offset_s * NS_PER_S  # local = UTC + offset
    return ns, zone is not None


def format_calendar_ns(ns: int) -> str:
    """ns since the epoch -> '2023-11-16 18:17:03.979960000+00:00' (UTC, ns digits)."""
    seconds, fraction = divmod(ns, NS_PER_S)
    moment = datetime.fromtimestamp(seconds, tz=timezone.utc)
    return f"{moment:%Y-%m-%d %H:%M:%S}.{fraction:09d}+00:00"


def _token_count(value: Any, name: str) -> int:
    """A JSON or CSV token count: a non-negative integer (12, 12.0, '12')."""
    if isinstance(value, bool) or value is None:
        raise _BadRow(f"{name} {value!r} is not a token count")
    if isinstance(value, int):
        count = value
    else:
        try:
            number = float(value) if isinstance(value, (float, str)) else math.nan
        except ValueError:
            raise _BadRow(f"{name} {value!r} is not a token count") from None
        if not math.isfinite(number) or not number.is_integer():
            raise _BadRow(f"{name} {value!r} is not a whole number of tokens")
        count = int(number)
    if count < 0:
        raise _BadRow(f"{name} {value!r} is negative")
    return count


MS_NS = 1_000_000


def _time_to_ns(value: Any, name: str, unit_ns: int = NS_PER_S) -> int:
    """A time in seconds (unit_ns = NS_PER_S) or milliseconds (MS_NS) -> ns; ints stay exact."""
    if isinstance(value, bool) or value is None:
        raise _BadRow(f"{name} {value!r} is not a number")
    if isinstance(value, int):
        return value * unit_ns
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise _BadRow(f"{name} {value!r} is not a number") from None
    if not math.isfinite(number):
        raise _BadRow(f"{name} {value!r} is not a finite number")
    return round(number * unit_ns)


def _hash_ids(value: Any, name: str = "hash_ids") -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _BadRow(f"{name} is not a list")
    if any(isinstance(item, bool) or not isinstance(item, int) for item in value):
        raise _BadRow(f"{name} holds something other than integers")
    return tuple(value)


def _open_input(path: Path) -> IO[str]:
    # utf-8-sig: a CSV saved by a spreadsheet starts with a byte-order mark.
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115 - caller closes


def _normal_column(name: str) -> str:
    return re.sub(r"[\s_]+", " ", name.strip().lower())


# ---------------------------------------------------------------------------------------------
# Sources


class _Source:
    """One input format: yields SourceRows in file order and describes its units."""

    format_name = ""
    source_name = ""
    description = ""
    mapping: dict[str, str] = {}
    clock_units = ""

    def __init__(
        self, path: Path, options: ImportOptions, skipped: _Tally, remarks: _Tally
    ) -> None:
        self.path = path
        self.options = options
        self.skipped = skipped
        self.remarks = remarks
        self.rows_read = 0
        self.saw_data = False  # any non-blank line at all (an empty file is an error)
        self.ignored_columns: list[str] = []  # CSV columns the format does not map

    def rows(self) -> Generator[SourceRow, None, None]:
        raise NotImplementedError

    def clock_of(self, spec: str) -> int:
        """--start-at on this source's clock, ns."""
        try:
            return round(parse_duration(spec, bare_unit="s") * NS_PER_S)
        except ValueError as exc:
            raise TraceImportError(f"--start-at: {exc}") from None

    def describe_clock(self, clock_ns: int) -> str:
        return f"{clock_ns / NS_PER_S:g} s"

    def start_wall_ns(self, clock_ns: int) -> int:
        return 0  # no calendar time in this source

    def extra_notes(self) -> dict[str, Any]:
        return {}

    def _bad(self, line: int, message: str) -> None:
        if not self.options.skip_bad_rows:
            raise TraceImportError(
                f"{self.path}:{line}: {message} (use --skip-bad-rows to skip such rows)"
            )
        self.skipped.add("unreadable row (--skip-bad-rows)", f"line {line}: {message}")


class _JsonLinesSource(_Source):
    def rows(self) -> Generator[SourceRow, None, None]:
        with _open_input(self.path) as handle:
            for line_no, text in enumerate(handle, start=1):
                if not text.strip():
                    continue
                self.saw_data = True
                self.rows_read += 1
                try:
                    data = json.loads(text)
                except json.JSONDecodeError as exc:
                    self._bad(line_no, f"not valid JSON ({exc.msg})")
                    continue
                if not isinstance(data, dict):
                    self._bad(line_no, "not a JSON object")
                    continue
                try:
                    row = self._parse(line_no, data)
                except _BadRow as exc:
                    self._bad(line_no, str(exc))
                    continue
                yield row

    def _parse(self, line_no: int, data: dict[str, Any]) -> SourceRow:
        raise NotImplementedError

    def _field(self, data: dict[str, Any], name: str) -> Any:
        if name not in data:
            raise _BadRow(f"no `{name}` field")
        return data[name]

    def _prefix(
        self, data: dict[str, Any], n_in: int, block: int, line_no: int
    ) -> PrefixBlocks | None:
        if data.get("hash_ids") is None:
            return None
        hashes = _hash_ids(data["hash_ids"])
        expected = math.ceil(n_in / block)
        if len(hashes) != expected:
            self.remarks.add(
                f"hash_ids length != ceil(input_length/{block})",
                f"line {line_no}: {len(hashes)} ids for {n_in} tokens (expected {expected})",
            )
        return PrefixBlocks("tokens", block, hashes)


class _MooncakeSource(_JsonLinesSource):
    format_name = "mooncake"
    source_name = "mooncake"
    description = (
        "Mooncake trace JSONL (kvcache-ai/Mooncake FAST'25; AIPerf Mooncake+ "
        "extras session_id, delay)"
    )
    mapping = {
        "timestamp": "t = timestamp / 1000 (ms since the first request -> s)",
        "input_length": "n_in (tokens)",
        "output_length": "n_out (tokens); max_tokens = n_out, ignore_eos = true",
        "hash_ids": f"prefix = {{unit: tokens, size: {MOONCAKE_BLOCK_TOKENS}, hashes}}",
        "session_id": "session_id",
        "delay": "only for a follow-up row without timestamp: t = the session's previous "
        "arrival + delay/1000 (a lower bound)",
    }
    clock_units = "timestamp is ms since the first request; t = timestamp / 1000 s"

    def __init__(
        self, path: Path, options: ImportOptions, skipped: _Tally, remarks: _Tally
    ) -> None:
        super().__init__(path, options, skipped, remarks)
        self._last_clock: dict[str, int] = {}  # session -> its latest arrival (delay rows)

    def describe_clock(self, clock_ns: int) -> str:
        return f"timestamp {clock_ns / MS_NS:g} ms"

    def _parse(self, line_no: int, data: dict[str, Any]) -> SourceRow:
        n_in = _token_count(self._field(data, "input_length"), "input_length")
        n_out = _token_count(self._field(data, "output_length"), "output_length")
        session = data.get("session_id")
        session_id = None if session is None else str(session)
        if data.get("timestamp") is None:
            delay = data.get("delay")
            if delay is None or session_id is None or session_id not in self._last_clock:
                raise _BadRow(
                    "no `timestamp`: only a follow-up turn (a session_id seen "
                    "before, with `delay`) can be placed without one"
                )
            clock = self._last_clock[session_id] + _time_to_ns(delay, "delay", MS_NS)
            self.remarks.add(
                "t from the session's previous arrival + delay (lower bound)", f"line {line_no}"
            )
        else:
            clock = _time_to_ns(data["timestamp"], "timestamp", MS_NS)
            if data.get("delay") is not None:
                self.remarks.add("delay ignored (the row has a timestamp)", f"line {line_no}")
        if session_id is not None:
            self._last_clock[session_id] = clock
        if any(key in data for key in ("text_input", "messages", "payload", "tools")):
            self.remarks.add("text/messages/payload not imported (lengths only)", f"line {line_no}")
        if "extra" in data:
            self.remarks.add("extra request body fields not imported", f"line {line_no}")
        prefix = self._prefix(data, n_in, MOONCAKE_BLOCK_TOKENS, line_no)
        return SourceRow(line_no, clock, n_in, n_out, prefix=prefix, session_id=session_id)


class _BailianSource(_JsonLinesSource):
    format_name = "bailian"
    source_name = "bailian"
    description = "Alibaba Bailian trace JSONL (qwen-bailian-usagetraces-anon)"
    mapping = {
        "timestamp": "t (s)",
        "input_length": "n_in (tokens)",
        "output_length": "n_out (tokens); max_tokens = n_out, ignore_eos = true",
        "hash_ids": f"prefix = {{unit: tokens, size: {BAILIAN_BLOCK_TOKENS}, hashes}} "
        "(salted SipHash per block, as published)",
        "chat_id": "request_id",
        "parent_chat_id": "session_id = the root chat_id of the parent chain (-1 = root)",
        "type": "counted in notes.request_types",
    }
    clock_units = "timestamp is in s; t = timestamp"

    def __init__(
        self, path: Path, options: ImportOptions, skipped: _Tally, remarks: _Tally
    ) -> None:
        super().__init__(path, options, skipped, remarks)
        self._root_of: dict[str, str] = {}  # chat_id -> root chat_id
        self._types: Counter[str] = Counter()

    def describe_clock(self, clock_ns: int) -> str:
        return f"timestamp {clock_ns / NS_PER_S:g} s"

    def extra_notes(self) -> dict[str, Any]:
        return {"request_types": dict(sorted(self._types.items()))} if self._types else {}

    def _parse(self, line_no: int, data: dict[str, Any]) -> SourceRow:
        n_in = _token_count(self._field(data, "input_length"), "input_length")
        n_out = _token_count(self._field(data, "output_length"), "output_length")
        clock = _time_to_ns(self._field(data, "timestamp"), "timestamp")
        chat = data.get("chat_id")
        chat_id = None if chat is None else str(chat)
        session_id = None
        if chat_id is not None:
            parent = data.get("parent_chat_id")
            parent_id = None if parent is None or str(parent) == "-1" else str(parent)
            # A parent not seen yet (a trace cut mid-session) becomes the root itself.
            session_id = chat_id if parent_id is None else self._root_of.get(parent_id, parent_id)
            self._root_of[chat_id] = session_id
        if data.get("type") is not None:
            self._types[str(data["type"])] += 1
        prefix = self._prefix(data, n_in, BAILIAN_BLOCK_TOKENS, line_no)
        return SourceRow(
            line_no, clock, n_in, n_out, prefix=prefix, session_id=session_id, request_id=chat_id
        )


class _CsvSource(_Source):
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    def rows(self) -> Generator[SourceRow, None, None]:
        with _open_input(self.path) as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            while header is not None and not any(cell.strip() for cell in header):
                header = next(reader, None)  # blank lines before the header
            if header is None:
                return
            self.saw_data = True
            columns = self._columns(header)
            width = max(columns.values()) + 1
            for cells in reader:
                if not cells or not any(cell.strip() for cell in cells):
                    continue
                self.rows_read += 1
                line_no = reader.line_num
                if len(cells) < width:
                    self._bad(line_no, f"{len(cells)} fields, the header has {len(header)}")
                    continue
                try:
                    row = self._parse(line_no, cells, columns)
                except _BadRow as exc:
                    self._bad(line_no, str(exc))
                    continue
                yield row

    def _columns(self, header: list[str]) -> dict[str, int]:
        found = {_normal_column(name): index for index, name in enumerate(header)}
        columns: dict[str, int] = {}
        missing = []
        for name in self.required + self.optional:
            index = found.get(_normal_column(name))
            if index is not None:
                columns[name] = index
            elif name in self.required:
                missing.append(name)
        if missing:
            raise TraceImportError(
                f"{self.path}:1: missing column(s) {', '.join(map(repr, missing))}; the header "
                f"has {', '.join(map(repr, header))}; --format {self.format_name} needs "
                f"{', '.join(self.required)}"
            )
        known = {_normal_column(name) for name in self.required + self.optional}
        self.ignored_columns = [name for name in header if _normal_column(name) not in known]
        return columns

    def _parse(self, line_no: int, cells: list[str], columns: dict[str, int]) -> SourceRow:
        raise NotImplementedError


class _AzureSource(_CsvSource):
    format_name = "azure"
    source_name = "azure-2023"  # "azure-2024" once a zoned timestamp is seen first
    description = "Azure LLM inference trace CSV (2023 Splitwise / 2024 DynamoLLM)"
    required = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    mapping = {
        "TIMESTAMP": "t = seconds since the earliest imported row (calendar time, ns-exact; "
        "no zone = UTC)",
        "ContextTokens": "n_in (tokens)",
        "GeneratedTokens": "n_out (tokens); max_tokens = n_out, ignore_eos = true",
    }
    clock_units = (
        "TIMESTAMP is calendar time (no zone read as UTC); t = seconds since the "
        "earliest imported row"
    )

    def __init__(
        self, path: Path, options: ImportOptions, skipped: _Tally, remarks: _Tally
    ) -> None:
        super().__init__(path, options, skipped, remarks)
        self.first_epoch_ns: int | None = None  # the clock is ns since the first row
        self.zoned_rows = 0
        self.unzoned_rows = 0

    def clock_of(self, spec: str) -> int:
        text = spec.strip()
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            text += " 00:00:00"  # a date alone: its midnight
        if re.match(r"\d{4}-\d{2}-\d{2}[ T]", text):
            try:
                epoch_ns, _zoned = parse_calendar_ns(text)
            except ValueError as exc:
                raise TraceImportError(f"--start-at {spec!r}: {exc}") from None
            return epoch_ns - (self.first_epoch_ns or 0)
        return super().clock_of(spec)

    def describe_clock(self, clock_ns: int) -> str:
        return format_calendar_ns((self.first_epoch_ns or 0) + clock_ns)

    def start_wall_ns(self, clock_ns: int) -> int:
        return (self.first_epoch_ns or 0) + clock_ns

    def extra_notes(self) -> dict[str, Any]:
        return {
            "timestamps_with_zone": self.zoned_rows,
            "timestamps_without_zone_read_as_utc": self.unzoned_rows,
        }

    def _parse(self, line_no: int, cells: list[str], columns: dict[str, int]) -> SourceRow:
        text = cells[columns["TIMESTAMP"]]
        try:
            epoch_ns, zoned = parse_calendar_ns(text)
        except ValueError as exc:
            raise _BadRow(f"TIMESTAMP {text!r} does not parse: {exc}") from None
        n_in = _token_count(cells[columns["ContextTokens"]].strip(), "ContextTokens")
        n_out = _token_count(cells[columns["GeneratedTokens"]].strip(), "GeneratedTokens")
        if zoned:
            self.zoned_rows += 1
        else:
            self.unzoned_rows += 1
        if self.first_epoch_ns is None:
            self.first_epoch_ns = epoch_ns
            self.source_name = "azure-2024" if zoned else "azure-2023"
        return SourceRow(line_no, epoch_ns - self.first_epoch_ns, n_in, n_out)


class _BurstGptSource(_CsvSource):
    format_name = "burstgpt"
    source_name = "burstgpt"
    description = "BurstGPT CSV (v1.1 columns; v2 adds Session ID, Elapsed time)"
    required = ("Timestamp", "Request tokens", "Response tokens")
    optional = ("Model", "Total tokens", "Log Type", "Session ID", "Elapsed time")
    mapping = {
        "Timestamp": "t (s since 0:00 of day 1)",
        "Model": "model (--model where empty)",
        "Request tokens": "n_in (tokens)",
        "Response tokens": "n_out (tokens); max_tokens = n_out, ignore_eos = true; 0 = failed "
        "in the source: outcome failed_in_source, max_tokens 1",
        "Total tokens": "checked against Request + Response tokens",
        "Log Type": "counted in notes.log_types",
        "Session ID": "session_id (v2)",
        "Elapsed time": "e2e_s (v2; s from submission to the full response)",
    }
    clock_units = "Timestamp is s since 0:00 of day 1; t = Timestamp"

    def __init__(
        self, path: Path, options: ImportOptions, skipped: _Tally, remarks: _Tally
    ) -> None:
        super().__init__(path, options, skipped, remarks)
        self._log_types: Counter[str] = Counter()
        self.columns_version = "v1.1"

    def describe_clock(self, clock_ns: int) -> str:
        return f"Timestamp {clock_ns / NS_PER_S:g} s"

    def extra_notes(self) -> dict[str, Any]:
        notes: dict[str, Any] = {"columns": self.columns_version}
        if self._log_types:
            notes["log_types"] = dict(sorted(self._log_types.items()))
        return notes

    def _columns(self, header: list[str]) -> dict[str, int]:
        columns = super()._columns(header)
        if "Session ID" in columns or "Elapsed time" in columns:
            self.columns_version = "v2"
        return columns

    def _parse(self, line_no: int, cells: list[str], columns: dict[str, int]) -> SourceRow:
        def cell(name: str) -> str | None:
            index = columns.get(name)
            return cells[index].strip() if index is not None and index < len(cells) else None

        clock = _time_to_ns(cell("Timestamp"), "Timestamp")
        n_in = _token_count(cell("Request tokens"), "Request tokens")
        n_out = _token_count(cell("Response tokens"), "Response tokens")
        total = cell("Total tokens")
        if total:
            if _token_count(total, "Total tokens") != n_in + n_out:
                self.remarks.add(
                    "Total tokens != Request tokens + Response tokens",
                    f"line {line_no}: {total} != {n_in} + {n_out}",
                )
        log_type = cell("Log Type")
        if log_type:
            self._log_types[log_type] += 1
        elapsed = cell("Elapsed time")
        e2e_s = None
        if elapsed:
            e2e_s = _time_to_ns(elapsed, "Elapsed time") / NS_PER_S
        return SourceRow(
            line_no,
            clock,
            n_in,
            n_out,
            model=cell("Model") or None,
            session_id=cell("Session ID") or None,
            failed=n_out == 0,
            e2e_s=e2e_s,
        )


SOURCES: dict[str, type[_Source]] = {
    "mooncake": _MooncakeSource,
    "bailian": _BailianSource,
    "azure": _AzureSource,
    "burstgpt": _BurstGptSource,
}


# ---------------------------------------------------------------------------------------------
# The import pipeline


def _t_of(clock_ns: int, t0_ns: int, time_scale: float) -> float:
    seconds = (clock_ns - t0_ns) / NS_PER_S  # int / int: correctly rounded
    return round(seconds * time_scale, 9) if time_scale != 1.0 else seconds


def _request_of(row: SourceRow, t: float, options: ImportOptions) -> TraceRequest:
    return TraceRequest(
        t=t,
        endpoint=options.endpoint,
        model=row.model if row.model is not None else options.model,
        stream=True,
        n_in=row.n_in,
        n_out=row.n_out,
        max_tokens=max(row.n_out, 1),
        ignore_eos=True,
        prefix=row.prefix,
        session_id=row.session_id,
        request_id=row.request_id,
        outcome=FAILED_IN_SOURCE if row.failed else None,
        e2e_s=row.e2e_s,
    )


def _request_json(row: SourceRow, t: float, options: ImportOptions) -> str:
    """``request_line(_request_of(row, t, options))``, about twice as fast.

    The Azure 2024 files have tens of millions of rows, and TraceRequest.to_dict walks every
    dataclass field per row. Same keys, same order, same separators (a test holds the two
    equal for every kind of row the importers make).
    """
    out: dict[str, Any] = {"t": t, "endpoint": options.endpoint}
    model = row.model if row.model is not None else options.model
    if model is not None:
        out["model"] = model
    out["stream"] = True
    out["n_in"] = row.n_in
    out["n_out"] = row.n_out
    out["max_tokens"] = max(row.n_out, 1)
    out["ignore_eos"] = True
    if row.prefix is not None:
        out["prefix"] = row.prefix.to_dict()
    if row.session_id is not None:
        out["session_id"] = row.session_id
    if row.request_id is not None:
        out["request_id"] = row.request_id
    if row.failed:
        out["outcome"] = FAILED_IN_SOURCE
    if row.e2e_s is not None:
        out["e2e_s"] = row.e2e_s
    return _dumps(out) + "\n"


_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _spool_key(line: str) -> int:
    return int(line[: line.index("\t")])


def _sorted_spool(spool_path: Path, work_dir: Path, run_lines: int) -> Generator[str, None, None]:
    """The spool's lines ordered by their clock prefix, stably, in bounded memory."""
    runs: list[Path] = []
    with open(spool_path, encoding="utf-8") as spool:
        while True:
            chunk = list(itertools.islice(spool, run_lines))
            if not chunk:
                break
            chunk.sort(key=_spool_key)  # list.sort is stable: ties keep file order
            run_path = work_dir / f"run-{len(runs)}"
            with open(run_path, "w", encoding="utf-8") as run:
                run.writelines(chunk)
            runs.append(run_path)
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(open(path, encoding="utf-8")) for path in runs]
        # heapq.merge breaks ties by run index, and runs are in file order: stable overall.
        yield from heapq.merge(*handles, key=_spool_key)


def _open_output(path: Path, compressed: bool) -> IO[str]:
    if compressed:
        # Level 6 (gzip's own default) is several times faster than Python's 9 on big traces.
        return gzip.open(path, "wt", encoding="utf-8", compresslevel=6)
    return open(path, "w", encoding="utf-8")  # noqa: SIM115 - caller closes


def _validate(fmt: str, options: ImportOptions) -> None:
    if fmt not in SOURCES:
        raise TraceImportError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if options.endpoint not in ENDPOINTS:
        raise TraceImportError(f"--endpoint must be one of {', '.join(ENDPOINTS)}")
    if not (math.isfinite(options.time_scale) and options.time_scale > 0):
        raise TraceImportError("--time-scale must be a number > 0")
    if options.limit is not None and options.limit < 1:
        raise TraceImportError("--limit must be >= 1")
    if options.duration_s is not None and not options.duration_s > 0:
        raise TraceImportError("--duration must be > 0")


def import_trace(
    fmt: str,
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    options: ImportOptions | None = None,
    *,
    run_lines: int = SORT_RUN_LINES,
) -> ImportResult:
    """Convert a public trace to a sidecar trace file (``.gz`` output is compressed)."""
    options = options or ImportOptions()
    _validate(fmt, options)
    source_path = Path(input_path)
    output = Path(output_path)
    if not source_path.is_file():
        raise TraceImportError(f"{source_path}: no such file")
    if output.exists() and output.resolve() == source_path.resolve():
        raise TraceImportError(f"{output}: the output would overwrite the input")
    skipped, remarks = _Tally(), _Tally()
    source = SOURCES[fmt](source_path, options, skipped, remarks)
    output.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=".sidecar-import-", dir=output.parent))
    try:
        return _run_import(source, options, output, work_dir, skipped, remarks, run_lines)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


class _Window:
    """--start-at and --duration as bounds on the source's clock, resolved at the first row
    (azure's clock starts there)."""

    def __init__(self, source: _Source, options: ImportOptions) -> None:
        self.source = source
        self.options = options
        self.start: int | None = None
        self.end: int | None = None
        self.resolved = False

    def outside(self, row: SourceRow) -> str | None:
        """Why ``row`` is outside the window (the skip's reason), or None."""
        if not self.resolved:
            self.resolved = True
            if self.options.start_at is not None:
                self.start = self.source.clock_of(self.options.start_at)
            if self.options.duration_s is not None:
                base = self.start if self.start is not None else row.clock_ns
                self.end = base + round(self.options.duration_s * NS_PER_S)
        if self.start is not None and row.clock_ns < self.start:
            return "before --start-at"
        if self.end is not None and row.clock_ns >= self.end:
            return "after --start-at + --duration"
        return None


class _ClockOrder:
    """The kept rows' clocks: the first, the earliest, and how far out of order they came."""

    def __init__(self) -> None:
        self.first_clock: int | None = None
        self.latest_clock = 0
        self.min_clock = 0
        self.out_of_order = 0
        self.worst_back_ns = 0

    def see(self, row: SourceRow, remarks: _Tally) -> int:
        """``row``'s clock taken in (a row earlier than one before it remarked); the first
        row's clock returned."""
        if self.first_clock is None:
            self.first_clock = self.latest_clock = self.min_clock = row.clock_ns
        if row.clock_ns < self.latest_clock:
            self.out_of_order += 1
            self.worst_back_ns = max(self.worst_back_ns, self.latest_clock - row.clock_ns)
            remarks.add(
                "row earlier than a row before it",
                f"line {row.line}: {(self.latest_clock - row.clock_ns) / NS_PER_S:g} s back",
            )
        self.latest_clock = max(self.latest_clock, row.clock_ns)
        self.min_clock = min(self.min_clock, row.clock_ns)
        return self.first_clock

    def describe(self, sort: bool) -> str:
        """The header's note on the rows' order, and what the import did about it."""
        if self.out_of_order == 0:
            return "rows in file order (already sorted by time)"
        action = (
            "sorted by t (stable)" if sort else "file order kept (--no-sort): t is not monotonic"
        )
        return (
            f"{self.out_of_order} rows earlier than a row before them (worst "
            f"{self.worst_back_ns / NS_PER_S:g} s back); {action}"
        )


def _remark_kept(row: SourceRow, remarks: _Tally) -> None:
    """A kept row whose request will differ from the source's: failed there, or no output."""
    if row.failed:
        remarks.add(
            "failed in the source (kept: outcome failed_in_source, max_tokens 1)",
            f"line {row.line}",
        )
    elif row.n_out == 0:
        remarks.add("n_out = 0 (max_tokens set to 1: vLLM refuses 0)", f"line {row.line}")


def _spool(
    source: _Source, options: ImportOptions, spool_path: Path, skipped: _Tally, remarks: _Tally
) -> tuple[int, _ClockOrder, set[str]]:
    """The source's rows inside the window, as requests written to ``spool_path`` in file
    order (one "<clock>\\t<request JSON>" a line): how many, their clocks, their models."""
    kept = 0
    window = _Window(source, options)
    order = _ClockOrder()
    models: set[str] = set()
    with (
        open(spool_path, "w", encoding="utf-8") as spool,
        contextlib.closing(source.rows()) as rows,
    ):
        for row in rows:
            outside = window.outside(row)
            if outside is not None:
                skipped.add(outside)
                continue
            if row.failed and options.drop_failed:
                skipped.add("failed in the source (--drop-failed)", f"line {row.line}")
                continue
            first_clock = order.see(row, remarks)
            _remark_kept(row, remarks)
            model = row.model if row.model is not None else options.model
            if model is not None:
                models.add(model)
            t = _t_of(row.clock_ns, first_clock, options.time_scale)
            spool.write(f"{row.clock_ns}\t{_request_json(row, t, options)}")
            kept += 1
            if options.limit is not None and kept >= options.limit:
                break
    return kept, order, models


def _run_import(
    source: _Source,
    options: ImportOptions,
    output: Path,
    work_dir: Path,
    skipped: _Tally,
    remarks: _Tally,
    run_lines: int,
) -> ImportResult:
    spool_path = work_dir / "rows"
    kept, order, models = _spool(source, options, spool_path, skipped, remarks)
    if not source.saw_data:
        raise TraceImportError(f"{source.path}: empty file")
    if kept == 0 or order.first_clock is None:
        reasons = "; ".join(f"{n} {why}" for why, n in sorted(skipped.counts.items()))
        skipped_note = f"; skipped: {reasons}" if reasons else ""
        raise TraceImportError(
            f"{source.path}: no requests to import ({source.rows_read} rows read{skipped_note})"
        )
    header = _header(source, options, kept, order, models, skipped, remarks)
    _write_output(
        output,
        header,
        spool_path,
        work_dir,
        order.min_clock,
        order.out_of_order == 0,
        options,
        run_lines,
    )
    return ImportResult(
        output=output,
        header=header,
        requests=kept,
        rows_read=source.rows_read,
        skipped=dict(skipped.counts),
        out_of_order=order.out_of_order,
    )


def _header(
    source: _Source,
    options: ImportOptions,
    kept: int,
    order: _ClockOrder,
    models: set[str],
    skipped: _Tally,
    remarks: _Tally,
) -> TraceHeader:
    """The header: provenance, units and every count a reader needs to trust the import."""
    t0_clock = order.min_clock
    window: dict[str, Any] = {}
    if options.start_at is not None:
        window["start_at"] = options.start_at
    if options.duration_s is not None:
        window["duration_s"] = options.duration_s
    if options.limit is not None:
        window["limit"] = options.limit
    notes: dict[str, Any] = {
        "importer": f"sidecar trace import --format {source.format_name}",
        "source_file": source.path.name,
        "source_format": source.description,
        "mapping": dict(source.mapping),
        "units": (
            f"{source.clock_units}; rebased so the earliest imported request has t = 0"
            + (
                f"; then t x {options.time_scale:g} (--time-scale)"
                if options.time_scale != 1.0
                else ""
            )
            + "; lengths in tokens"
        ),
        "time_scale": options.time_scale,
        "t0_source": source.describe_clock(t0_clock),
        "rows_read": source.rows_read,
        "requests": kept,
        "rows_skipped": skipped.to_notes(),
        "remarks": remarks.to_notes(),
        "order": order.describe(options.sort),
        "endpoint": options.endpoint,
    }
    if window:
        notes["window"] = window
    if source.ignored_columns:
        notes["ignored_columns"] = source.ignored_columns
    notes.update(source.extra_notes())
    return TraceHeader(
        source=source.source_name,
        start_wall_ns=source.start_wall_ns(t0_clock),
        sidecar_version=sidecar.__version__,
        models=tuple(sorted(models)),
        notes=notes,
    )


def _write_output(
    output: Path,
    header: TraceHeader,
    spool_path: Path,
    work_dir: Path,
    t0_clock: int,
    in_order: bool,
    options: ImportOptions,
    run_lines: int,
) -> None:
    """Header, then the spooled requests; written under a temporary name, then renamed."""
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    try:
        with _open_output(partial, output.suffix == ".gz") as out:
            out.write(header_line(header))
            if in_order:  # the first row was the earliest: every t was final when spooled
                with open(spool_path, encoding="utf-8") as spool:
                    for line in spool:
                        out.write(line[line.index("\t") + 1 :])
            else:
                with contextlib.ExitStack() as stack:
                    lines: Iterator[str]
                    if options.sort:
                        lines = stack.enter_context(
                            contextlib.closing(_sorted_spool(spool_path, work_dir, run_lines))
                        )
                    else:
                        lines = stack.enter_context(open(spool_path, encoding="utf-8"))
                    for line in lines:
                        # Spooled lines start with '{"t":<t>,' (_request_json puts t first):
                        # swap that number for the one rebased on the earliest row.
                        tab = line.index("\t")
                        rest = line.index(",", tab + 1)
                        t = _t_of(int(line[:tab]), t0_clock, options.time_scale)
                        out.write('{"t":' + _dumps(t) + line[rest:])
        os.replace(partial, output)
    finally:
        if partial.exists():
            partial.unlink()
