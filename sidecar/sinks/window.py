"""A bounded live window of recent records, summarised on demand (the proxy's /stats JSON).

Holds the records that ended within the last ``window_s`` seconds, and never more than
``max_records`` of them nor more than ``max_bytes`` of memory by `approx_record_bytes` (the
oldest go first, and are counted), so memory stays bounded whatever the traffic and however long
the streams. Summaries are computed only when asked, off the per-request path.

A summary can be restricted to one client's requests (`Selection`, the ``/stats`` query
``?request_id_prefix=...``): the proxy keeps the client's ``X-Request-Id``, so a load generator
that names its requests can read back the proxy's view of exactly those requests (``sidecar
sweep --sidecar-admin`` does, per load step) however much other traffic shares the window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from gc import is_tracked
from typing import Any

import numpy as np

from sidecar import clock, stats
from sidecar.hooks import SINK_TIMEOUT_S, TAKEN
from sidecar.record import (
    Outcome,
    RequestRecord,
    Vantage,
    approx_record_bytes,
    untrack_finished,
)

GENERATION_ENDPOINTS = frozenset({"chat", "completions"})

DEFINITIONS = {
    "ttft": "first token-carrying event - vantage start (client: request fully received by the "
    "proxy; server: request sent upstream); sample = request",
    "itl": "gap between consecutive token-carrying events; sample = event (SSE chunk)",
    "itl_per_token": "each ITL gap / tokens in its event, repeated per token (derived view)",
    "tpot": "TPOT as docs/metrics.md section 4 defines it (stats.tpot_ns); N_out <= 1 "
    "excluded and counted; sample = request",
    "e2e": "last token-carrying event (stream end if none) - vantage start; sample = request",
    "relay_delay": "the proxy's own time per token event: the instant it handed the event "
    "to the client socket - the instant the event's bytes reached its upstream socket (kernel "
    "receive stamp where available); over requests whose two sides saw the same token events; "
    "sample = event",
    "percentiles": "numpy linear interpolation; std is the population std",
    "latency_population": "successful chat/completions requests that ended in the window",
    "units": "seconds",
}


SELECTION_QUERY_KEYS = ("request_id_prefix",)


@dataclass(frozen=True, slots=True)
class Selection:
    """Which of the window's records a summary covers (all of them by default)."""

    request_id_prefix: str | None = None

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> Selection:
        """From an admin URL's query; an unknown or empty parameter is an error, not ignored
        (a typo would otherwise silently summarise everything)."""
        unknown = sorted(set(query) - set(SELECTION_QUERY_KEYS))
        if unknown:
            raise ValueError(
                f"unknown /stats parameter(s) {unknown}; known: {list(SELECTION_QUERY_KEYS)}"
            )
        prefix = query.get("request_id_prefix")
        if prefix is not None and not prefix:
            raise ValueError("request_id_prefix must not be empty")
        return cls(request_id_prefix=prefix)

    def matches(self, record: RequestRecord) -> bool:
        prefix = self.request_id_prefix
        return prefix is None or record.request_id.startswith(prefix)

    def to_dict(self) -> dict[str, str | None]:
        return {"request_id_prefix": self.request_id_prefix}


ALL = Selection()


def _end_wall_ns(record: RequestRecord) -> int:
    """When the request ended, wall clock (ns): the window's age is by end, not arrival."""
    return record.wall_time_ns + stats.end_offset_ns(record)


# Records that left the window leave its table this many at a time, or once they hold
# `max_bytes` / DROP_BYTES_SHARE (or before a read): the table holds at most that many more
# records than the window, and ~3 % more memory than its cap.
DROP_BATCH = 512
DROP_BYTES_SHARE = 32


class WindowSink:
    """The live window as a `hooks.Sink`: it holds records in memory only, so there is nothing
    to flush or release (closing it keeps what it holds readable)."""

    name = "window"

    def __init__(
        self,
        window_s: float = 60.0,
        max_records: int = 100_000,
        max_bytes: int = 256 * 1024 * 1024,
        wall_ns: Callable[[], int] = clock.wall_ns,
    ) -> None:
        if window_s <= 0 or max_records <= 0 or max_bytes <= 0:
            raise ValueError("window_s, max_records and max_bytes must be positive")
        self.window_s = window_s
        self.max_records = max_records
        self.max_bytes = max_bytes
        # The records, oldest end first, and beside each its (approx_record_bytes, end wall ns).
        # Apart: a tuple holding a record stays tracked by the cycle collector for as long as
        # it lives (CPython untracks a tuple only when nothing in it can be tracked), and a
        # record the collector process decoded is not tracked (proxy/_recordwire.c).
        self._records: deque[RequestRecord] = deque()
        self._spans: deque[tuple[int, int]] = deque()
        # The same records as columns, for summaries in bulk (stats.RecordTable). Records that
        # left `_records` leave the table in batches (`_undropped`, `DROP_BATCH`), and always
        # before it is read (`_trim`): its drop is numpy over the rows, microseconds each
        # call, and at a steady rate every record that comes makes one leave.
        self._table = stats.RecordTable()
        self._undropped = 0
        self._undropped_bytes = 0
        self._drop_bytes = max(1, max_bytes // DROP_BYTES_SHARE)
        self._bytes = 0
        self._wall_ns = wall_ns
        self.taken = 0
        self.evicted_over_cap = 0

    @property
    def approx_bytes(self) -> int:
        return self._bytes

    def flush(self, timeout_s: float = SINK_TIMEOUT_S) -> bool:
        return True

    def close(self, timeout_s: float = SINK_TIMEOUT_S) -> None:
        return None

    def counters(self) -> dict[str, int]:
        # Evictions over the caps are not drops: the window is a sample of recent records by
        # design; /stats says how many left early.
        return {TAKEN: self.taken, "evicted_over_cap": self.evicted_over_cap}

    def on_record(self, record: RequestRecord) -> None:
        self.taken += 1
        if is_tracked(record):
            # Kept for up to window_s, 100,000 by default: out of the cycle collector's scans
            # (a full collection over a full window was ~70 ms, a stall of every stream where
            # the window shares the traffic's loop: `--workers 0`). The collector's decoded
            # records come untracked already (proxy/_recordwire.c).
            untrack_finished(record)
        records = self._records
        size = approx_record_bytes(record)
        end_wall_ns = _end_wall_ns(record)
        # The table first: a record it refuses (a count beyond 64 bits) is then kept nowhere.
        self._table.append(record, end_wall_ns, record.endpoint in GENERATION_ENDPOINTS)
        records.append(record)
        self._spans.append((size, end_wall_ns))
        self._bytes += size
        while len(records) > self.max_records or (
            self._bytes > self.max_bytes and len(records) > 1
        ):
            self._let_go()
            self.evicted_over_cap += 1
        # Expire by age here too, not only when read: with nobody reading /stats or /metrics
        # the window must still hold only the last window_s (records arrive in completion
        # order, so the oldest are at the left).
        self._expire(self._wall_ns() - int(self.window_s * 1e9))
        if self._undropped >= DROP_BATCH or self._undropped_bytes >= self._drop_bytes:
            self._drop()

    def _let_go(self) -> None:
        """The oldest record leaves `_records` (the table: at the next `_drop`)."""
        self._records.popleft()
        size = self._spans.popleft()[0]
        self._bytes -= size
        self._undropped += 1
        self._undropped_bytes += size

    def _expire(self, horizon: int) -> None:
        """Let the records that ended before ``horizon`` go."""
        spans = self._spans
        while spans and spans[0][1] < horizon:
            self._let_go()

    def _drop(self) -> None:
        self._table.drop_front(self._undropped)
        self._undropped = self._undropped_bytes = 0

    def _trim(self) -> int:
        """Expire by age and bring the table level with `_records`, before either is read;
        the horizon (wall ns)."""
        horizon = self._wall_ns() - int(self.window_s * 1e9)
        self._expire(horizon)
        self._drop()
        return horizon

    def _mask(self, selection: Selection) -> tuple[Any, Any]:
        """(live records in the selection, and of those the generation requests), as masks
        over the table: what `records` keeps, restricted to ``selection``."""
        horizon = self._trim()
        table = self._table
        live = table.end_wall_ns >= horizon
        prefix = selection.request_id_prefix
        if prefix is not None:
            live &= np.fromiter(
                (i.startswith(prefix) for i in table.ids()), dtype=np.bool_, count=len(table)
            )
        return live, live & table.generation

    def vantage_reports(self, selection: Selection = ALL) -> dict[Vantage, stats.VantageReport]:
        _live, generation = self._mask(selection)
        return {
            v: self._table.vantage_report(generation, v) for v in (Vantage.CLIENT, Vantage.SERVER)
        }

    def generation_outcomes(self, selection: Selection = ALL) -> dict[Outcome, int]:
        _live, generation = self._mask(selection)
        return self._table.outcome_counts(generation)

    def attainment(
        self, policy: stats.SLOPolicy, selection: Selection = ALL
    ) -> dict[str, tuple[int, int]]:
        """SLO class -> (good, all) over the window's generation requests (classes with no
        request left out)."""
        _live, generation = self._mask(selection)
        interval = self._table.measured_interval_s(generation)
        out = {}
        for name, g in self._table.goodput(generation, policy, interval).items():
            if g.total_requests:
                out[name] = (g.good_requests, g.total_requests)
        return out

    def records(self) -> list[RequestRecord]:
        """The records that ended within the window (older ones are dropped here)."""
        horizon = self._trim()
        return [
            record
            for record, (_size, end_wall_ns) in zip(self._records, self._spans, strict=True)
            if end_wall_ns >= horizon
        ]

    def snapshot(
        self, slo_policy: stats.SLOPolicy | None = None, selection: Selection = ALL
    ) -> dict[str, Any]:
        live, generation = self._mask(selection)
        table = self._table
        n_generation = int(np.count_nonzero(generation))
        interval = (
            min(self.window_s, table.measured_interval_s(generation)) if n_generation else 0.0
        )
        n_live = int(np.count_nonzero(live))
        out: dict[str, Any] = {
            "window_s": self.window_s,
            "interval_s": interval,
            "records": n_live,
            "generation_requests": n_generation,
            "evicted_over_cap": self.evicted_over_cap,
            "window_bytes": self._bytes,
            "window_max_bytes": self.max_bytes,
            "selection": selection.to_dict(),
            "outcomes": {o.value: n for o, n in table.outcome_counts(generation).items()},
            "other_paths": n_live - n_generation,
            "vantages": {},
            "definitions": DEFINITIONS,
        }
        for vantage in (Vantage.CLIENT, Vantage.SERVER):
            out["vantages"][vantage.value] = _vantage_json(
                table.vantage_report(generation, vantage)
            )
        out["vantages"]["engine"] = _engine_json(table.engine_report(generation))
        out["relay"] = _relay_json(table.relay_report(generation))
        out["throughput"] = _throughput_json(table.throughput(generation, interval))
        if slo_policy is not None:
            out["goodput"] = {
                name: _goodput_json(g)
                for name, g in table.goodput(generation, slo_policy, interval).items()
            }
        return out


# The parts of `WindowSink.snapshot` (the /stats JSON), one per report.


def _vantage_json(report: stats.VantageReport) -> dict[str, Any]:
    return {
        "requests": report.requests,
        "tpot_excluded_n_out_le_1": report.tpot_excluded,
        "no_first_token": report.no_first_token,
        "ttft": report.ttft.to_dict(),
        "itl": report.itl.to_dict(),
        "itl_per_token": report.itl_per_token.to_dict(),
        "tpot": report.tpot.to_dict(),
        "e2e": report.e2e.to_dict(),
    }


def _relay_json(relay: stats.RelayReport) -> dict[str, Any]:
    return {
        "requests": relay.requests,
        "unpaired": relay.unpaired,
        "delay": relay.delay.to_dict(),
    }


def _engine_json(engine: stats.EngineReport) -> dict[str, Any]:
    return {
        "requests": engine.requests,
        "queue_time": engine.queue_time.to_dict(),
        "ttft": engine.ttft.to_dict(),
        "ttft_from_scheduled": engine.ttft_from_scheduled.to_dict(),
        "e2e": engine.e2e.to_dict(),
        "mean_itl": engine.mean_itl.to_dict(),
        "generation_time": engine.generation_time.to_dict(),
    }


def _throughput_json(t: stats.Throughput) -> dict[str, Any]:
    return {
        "requests_per_s": t.requests_per_s,
        "input_tokens_per_s": t.input_tokens_per_s,
        "output_tokens_per_s": t.output_tokens_per_s,
        "total_tokens_per_s": t.total_tokens_per_s,
        "output_tokens_estimated": t.output_tokens_estimated,
    }


def _goodput_json(g: stats.Goodput) -> dict[str, Any]:
    return {
        "slo": g.slo.describe(),
        "vantage": g.vantage.value,
        "objective": g.slo.objective,
        "good_requests": g.good_requests,
        "denominator": g.slo.describe_denominator(),
        "denominator_requests": g.total_requests,
        "excluded": dict(g.excluded),
        "attainment": g.attainment,
        "good_requests_per_s": g.good_requests_per_s,
        "good_output_tokens_per_s": g.good_output_tokens_per_s,
        "judged_without": dict(g.judged_without),
    }
