"""Capacity under SLO: the pure part (step verdicts, the search, the knee). No I/O.

A load step passes when, over its requests:
- every declared SLO threshold holds at the declared percentile (e.g. p90 TTFT <= 500 ms),
- failed / all <= the error bound,
- (open loop) the completion rate keeps up with the offered rate: (completions - 1) / (time
  between the first and the last completion) >= keep_up x the rate the step really sent at
  ((requests - 1) / (last scheduled - first scheduled)). Below capacity completions leave at the
  arrival rate; past it they leave at the service rate, while the queue grows.

Capacity is the highest passing load (spec/metrics.md section 7). `--auto` doubles the load
until a step fails (stopping early once the achieved rate falls under half the offered one:
far past saturation nothing new is learnt), then bisects between the last pass and the first
failure. The knee is the load of the highest goodput.

`step_tables` builds the steps' table once, with each column's unit and definition: the console
(`console_report`) and sweep.html (`plots.html_page`) show the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.config import PERCENTILE_METRICS, SLO_METRIC_ALIASES, parse_slo_spec
from sidecar.stats import SLO

# The step metrics kept for every repeat of a step (its `repeat_spread`), so that a comparison
# of two sweeps can tell a change from run-to-run noise: (report key, unit, higher is better).
STEP_METRICS: tuple[tuple[str, str, bool], ...] = (
    ("request_throughput", "req/s", True),
    ("output_throughput", "tok/s", True),
    ("request_goodput", "req/s", True),
    ("slo_attainment", "fraction", True),
    ("p50_ttft_ms", "ms", False),
    ("p90_ttft_ms", "ms", False),
    ("p99_ttft_ms", "ms", False),
    ("p50_tpot_ms", "ms", False),
    ("p90_tpot_ms", "ms", False),
    ("p99_tpot_ms", "ms", False),
    ("p99_itl_ms", "ms", False),
    ("p50_e2el_ms", "ms", False),
    ("p99_e2el_ms", "ms", False),
)


# The run report's key of each metric (`report.run_report`: vllm bench's names, "e2el").
REPORT_NAMES = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2el"}


@dataclass(frozen=True, slots=True)
class Criteria:
    """A load step's pass criteria. Not a per-request SLO (`stats.SLO`, which says whether one
    request was good): each threshold applies to a percentile of the step's successful
    requests (ITL: of their gaps), beside an error bound and the keep-up ratio. The thresholds
    are named, parsed and held as SLO thresholds are (`config.parse_slo_spec` with
    `config.PERCENTILE_METRICS`; seconds)."""

    thresholds: Mapping[str, float]  # metric name (config.PERCENTILE_METRICS) -> seconds
    percentile: float = 90.0
    max_error_rate: float = 0.01
    keep_up: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.percentile < 100:
            raise ValueError("the SLO percentile must be in (0, 100)")
        if not self.thresholds:
            raise ValueError("a sweep needs at least one SLO threshold")
        unknown = set(self.thresholds) - set(PERCENTILE_METRICS)
        if unknown:
            raise ValueError(f"unknown SLO metrics for a sweep: {sorted(unknown)}")

    def limits_ms(self) -> dict[str, float]:
        """The thresholds in ms (the run report's unit), by metric name."""
        return {name: seconds * 1000 for name, seconds in self.thresholds.items()}

    def slo(self) -> SLO:
        """The per-request SLO of the same thresholds, for the step's goodput (ITL has no
        per-request value, so it is judged by the percentile only)."""
        get = self.thresholds.get
        return SLO(ttft_s=get("ttft"), tpot_s=get("tpot"), e2e_s=get("e2e"))

    def describe(self) -> str:
        p = f"p{self.percentile:g}"
        parts = [f"{p} {name} <= {ms:g} ms" for name, ms in self.limits_ms().items()]
        return (
            ", ".join(parts)
            + f"; errors <= {self.max_error_rate:.1%}"
            + f"; achieved >= {self.keep_up:.0%} of offered (open loop)"
        )


def parse_criteria(
    slo: str, percentile: float = 90.0, max_error_rate: float = 0.01, keep_up: float = 0.9
) -> Criteria:
    """`sidecar sweep --slo ttft=500ms,itl=30ms` (the SLO grammar, with ITL) and the bounds."""
    spec = parse_slo_spec(slo, PERCENTILE_METRICS)
    if spec.objective is not None or spec.exclude is not None:
        # The percentile is a step's objective, and every request counts in its error bound.
        raise ValueError(
            f"--slo {slo!r}: a sweep judges each threshold at --slo-percentile; "
            "objective= and exclude= do not apply to it"
        )
    return Criteria(dict(spec.thresholds), percentile, max_error_rate, keep_up)


@dataclass(frozen=True, slots=True)
class StepVerdict:
    passed: bool
    reasons: tuple[str, ...]


def achieved_rate(completion_ends_s: Sequence[float]) -> float | None:
    """Completions per second between the first and the last completion."""
    if len(completion_ends_s) < 2:
        return None
    ends = sorted(completion_ends_s)
    span = ends[-1] - ends[0]
    return (len(ends) - 1) / span if span > 0 else None


def judge_step(
    report: Mapping[str, Any], offered: float, mode: str, criteria: Criteria, achieved: float | None
) -> StepVerdict:
    reasons: list[str] = []
    total = report["completed"] + report["failed"]
    if total == 0:
        return StepVerdict(False, ("no request completed",))
    error_rate = report["failed"] / total
    if error_rate > criteria.max_error_rate:
        reasons.append(f"error rate {error_rate:.1%} > {criteria.max_error_rate:.1%}")
    p = f"p{criteria.percentile:g}"
    for name, limit in criteria.limits_ms().items():
        value = report.get(f"{p}_{REPORT_NAMES[name]}_ms")
        if value is None:
            reasons.append(f"{p} {name} unmeasured")
        elif value > limit:
            reasons.append(f"{p} {name} {value:.1f} ms > {limit:g} ms")
    if mode == "open":
        if achieved is None:
            reasons.append("achieved rate unmeasured")
        elif achieved < criteria.keep_up * offered:
            reasons.append(
                f"achieved {achieved:.2f} req/s < {criteria.keep_up:.0%} of "
                f"offered {offered:.2f} req/s"
            )
    return StepVerdict(not reasons, tuple(reasons))


@dataclass(slots=True)
class Search:
    """Where the auto search stands; `next_load` says what to run next (None: done)."""

    start: float
    mode: str  # "open" (loads are rates) or "closed" (loads are concurrencies)
    bisect_steps: int = 3
    max_steps: int = 12
    passed: list[float] = field(default_factory=list)
    failed: list[float] = field(default_factory=list)
    saturated: bool = False
    bisections: int = 0

    @property
    def steps(self) -> int:
        return len(self.passed) + len(self.failed)

    def _bracket(self) -> tuple[float, float] | None:
        """(highest pass, lowest failure above it), once both exist."""
        if not self.passed:
            return None
        best = max(self.passed)
        above = [f for f in self.failed if f > best]
        return (best, min(above)) if above else None

    def record(
        self, load: float, verdict: StepVerdict, offered: float, achieved: float | None
    ) -> None:
        if self._bracket() is not None:
            self.bisections += 1
        (self.passed if verdict.passed else self.failed).append(load)
        if self.mode == "open" and achieved is not None and achieved < 0.5 * offered:
            self.saturated = True

    def _round(self, load: float) -> float:
        return float(max(1, round(load))) if self.mode == "closed" else round(load, 3)

    def next_load(self) -> float | None:
        if self.steps >= self.max_steps:
            return None
        if not self.steps:
            return self._round(self.start)
        if not self.failed:
            return self._round(max(self.passed) * 2)  # coarse: double until something fails
        bracket = self._bracket()
        if bracket is None:
            if self.passed:
                return None  # failures only below a pass: nothing left to narrow
            # Even the first load failed: halve until one passes (at most 5 times).
            lowest = min(self.failed)
            floor = 1.0 if self.mode == "closed" else 1e-3
            if len(self.failed) > 5 or lowest / 2 < floor:
                return None
            return self._round(lowest / 2)
        if self.bisections >= self.bisect_steps:
            return None
        best, worst = bracket
        if self.mode == "closed" and worst - best <= 1:
            return None
        if self.mode == "open" and (worst - best) / best < 0.05:
            return None
        return self._round((best + worst) / 2)

    @property
    def capacity(self) -> float | None:
        bracket = self._bracket()
        if bracket is not None:
            return bracket[0]
        if self.passed and not self.failed:
            return max(self.passed)  # never broke: capacity is at least this
        return max(self.passed) if self.passed else None


def run_search(
    search: Search, run_step: Callable[[float], tuple[StepVerdict, float, float | None]]
) -> None:
    """Drive a search: ``run_step(load) -> (verdict, offered, achieved)``."""
    while (load := search.next_load()) is not None:
        verdict, offered, achieved = run_step(load)
        search.record(load, verdict, offered, achieved)


def knee(loads: Sequence[float], goodputs: Sequence[float | None]) -> float | None:
    """The load of the highest goodput (the first one, when goodput plateaus)."""
    best: tuple[float, float] | None = None
    for load, goodput in sorted(zip(loads, goodputs, strict=True)):
        if goodput is None:
            continue
        if best is None or goodput > best[1] * 1.02:
            best = (load, goodput)
    return best[0] if best else None


# -- the step table: one builder for the console and the HTML page ---------------------------

METRICS_DOC = "docs/metrics.md"
LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}
# The latency percentiles every table shows (the judged ones come first, and are not repeated).
SHOWN_LATENCIES = (
    ("ttft", 50.0),
    ("ttft", 99.0),
    ("tpot", 50.0),
    ("tpot", 99.0),
    ("itl", 99.0),
    ("e2e", 99.0),
)


@dataclass(frozen=True, slots=True)
class Column:
    title: str
    unit: str
    definition: str


@dataclass(frozen=True, slots=True)
class Table:
    title: str
    columns: tuple[Column, ...]
    rows: tuple[tuple[str, ...], ...]  # one per step, in load order, cells as shown


@dataclass(frozen=True, slots=True)
class StepTables:
    """What both the console and sweep.html show of a sweep's steps."""

    tables: tuple[Table, ...]
    failures: tuple[str, ...]  # "load 16 req/s: <reason>; <reason>", one per failed step

    def definitions(self) -> list[Column]:
        """Every column once (the load column is in each table)."""
        seen: dict[str, Column] = {}
        for table in self.tables:
            for column in table.columns:
                seen.setdefault(column.title, column)
        return list(seen.values())

    def legend(self) -> list[tuple[str, str]]:
        """(names, definition): the columns of one definition named together."""
        grouped: dict[str, list[str]] = {}
        for column in self.definitions():
            grouped.setdefault(column.definition, []).append(column.title)
        return [(", ".join(names), definition) for definition, names in grouped.items()]


def criteria_detail(criteria: Criteria) -> dict[str, Any]:
    """The pass criteria as numbers (sweep.json's `slo_criteria`; `criteria` says them in
    words). The file keeps its format: ms, keyed by the run report's names ("e2el")."""
    return {
        "thresholds_ms": {REPORT_NAMES[name]: ms for name, ms in criteria.limits_ms().items()},
        "percentile": criteria.percentile,
        "max_error_rate": criteria.max_error_rate,
        "keep_up": criteria.keep_up,
    }


def criteria_of(result: Mapping[str, Any]) -> Criteria:
    """`criteria_detail` read back (sweep.json)."""
    detail = result.get("slo_criteria") or {}
    thresholds = {
        SLO_METRIC_ALIASES.get(name, name): ms / 1000
        for name, ms in (detail.get("thresholds_ms") or {"ttft": math.inf}).items()
    }
    return Criteria(
        thresholds,
        detail.get("percentile", 90.0),
        detail.get("max_error_rate", 0.01),
        detail.get("keep_up", 0.9),
    )


def _num(value: Any, digits: int = 2) -> str:
    return (
        f"{value:.{digits}f}"
        if isinstance(value, (int, float)) and math.isfinite(value) and not isinstance(value, bool)
        else "-"
    )


def _pct(value: Any) -> str:
    """A fraction as a percentage, without the sign (the column's unit says %)."""
    return _num(value * 100, 1) if isinstance(value, (int, float)) else "-"


def keep_up_ratio(step: Mapping[str, Any], mode: str) -> float | None:
    achieved, offered = step.get("achieved_rate"), step.get("offered")
    if mode != "open" or achieved is None or not offered:
        return None
    return float(achieved) / float(offered)


def step_tables(result: Mapping[str, Any]) -> StepTables:
    """The sweep's steps as two tables (rates and outcomes; latencies), with units and each
    column's definition: `sidecar sweep` prints them, sweep.html shows them."""
    criteria = criteria_of(result)
    mode = result.get("mode", "open")
    unit = result.get("unit", "req/s")
    steps = sorted(result.get("steps", []), key=lambda s: s["load"])
    load_column = Column(
        "load",
        "req/s" if mode == "open" else "concurrent",
        "the step's nominal load: the arrival rate asked for (open loop) or "
        "the requests kept in flight (closed loop)",
    )
    rate_columns = _rate_columns(load_column, criteria, mode, steps)
    latency_columns, latency_keys = _latency_columns(load_column, criteria)
    with_sidecar = any(s.get("sidecar") for s in steps)
    if with_sidecar:
        latency_columns += _SIDECAR_COLUMNS
    rate_rows: list[tuple[str, ...]] = []
    latency_rows: list[tuple[str, ...]] = []
    failures: list[str] = []
    for step in steps:
        report = step["report"]
        cells_by_title = _rate_cells(step, mode)
        row = [cells_by_title[column.title] for column in rate_columns]
        rate_rows.append(tuple(row))
        cells = [cells_by_title["load"], *(_num(report.get(key), 1) for key in latency_keys)]
        if with_sidecar:
            cells += _sidecar_cells(step.get("sidecar"))
        latency_rows.append(tuple(cells))
        if not step["passed"]:
            failures.append(f"load {step['load']:g} {unit}: " + "; ".join(step["reasons"]))
    return StepTables(
        (
            Table("Steps: rates and outcomes", tuple(rate_columns), tuple(rate_rows)),
            Table("Steps: latency (ms)", tuple(latency_columns), tuple(latency_rows)),
        ),
        tuple(failures),
    )


def _rate_columns(
    load_column: Column, criteria: Criteria, mode: str, steps: Sequence[Mapping[str, Any]]
) -> list[Column]:
    """The rates-and-outcomes table's columns: open loop's schedule columns only there, the
    cache hit rate only where the engines reported one."""
    rate_columns = [
        load_column,
        Column(
            "offered",
            "req/s",
            "the rate the step really sent at: (requests - 1) / (last "
            "scheduled send - first); open loop only",
        ),
        Column(
            "achieved",
            "req/s",
            "completion rate: (completions - 1) / (last completion - first completion)",
        ),
        Column(
            "keep-up",
            "%",
            f"achieved / offered; a step passes at >= {criteria.keep_up:.0%}"
            f" (open loop; {METRICS_DOC} §8, a sweep step's verdict)",
        ),
        Column(
            "throughput",
            "req/s",
            "completed requests / duration, from the run's start to "
            f"its last response's end ({METRICS_DOC} §7 Throughput)",
        ),
        Column(
            "goodput",
            "req/s",
            "requests that met every threshold / the same duration, "
            f"judged per request, not the step's verdict ({METRICS_DOC} §8 SLOs and "
            "goodput)",
        ),
        Column(
            "attain.",
            "%",
            "attainment: requests that met every threshold / all requests, "
            f"failures included ({METRICS_DOC} §8 SLOs and goodput)",
        ),
        Column(
            "conc.", "req", f"the most requests in flight at once ({METRICS_DOC} §7 Throughput)"
        ),
        Column(
            "failed",
            "req",
            "requests with an outcome other than ok / all requests "
            f"({METRICS_DOC} §6 Outcomes); a step passes at <= {criteria.max_error_rate:.1%}",
        ),
        Column(
            "late p99",
            "ms",
            "p99 of actual send - scheduled send, the sender's own error (open loop)",
        ),
    ]
    if mode != "open":  # no schedule: nothing offered, nothing late
        rate_columns = [
            c for c in rate_columns if c.title not in ("offered", "keep-up", "late p99")
        ]
    with_cache = any(
        (s.get("engine_delta") or {}).get("prefix_cache_hit_rate") is not None for s in steps
    )
    if with_cache:
        rate_columns.append(
            Column(
                "cache hit",
                "%",
                "the engines' prefix-cache hits / queries "
                "(tokens) over the step, from their /metrics",
            )
        )
    rate_columns.append(
        Column("verdict", "", "pass, or FAIL (the reasons are listed below the tables)")
    )
    return rate_columns


def _latency_columns(load_column: Column, criteria: Criteria) -> tuple[list[Column], list[str]]:
    """The latency table's columns (the judged percentiles first, then the usual ones) and the
    report keys their cells come from."""
    latency_columns = [load_column]
    latency_keys: list[str] = []
    limits = criteria.limits_ms()
    judged = [(metric, criteria.percentile) for metric in limits]
    for metric, q in [*judged, *(x for x in SHOWN_LATENCIES if x not in judged)]:
        name = f"{LATENCY_NAMES[metric]} p{q:g}"
        limit = limits.get(metric) if (metric, q) in judged else None
        where = f"{METRICS_DOC} §4 Per-request metrics, §10 Percentiles"
        if limit is not None:
            definition = (
                f"judged, <= {limit:g} ms for a pass: the percentile over the step's "
                f"successful requests, client vantage ({where})"
            )
        else:
            definition = (
                f"percentiles over the step's successful requests, client vantage ({where})"
            )
        latency_columns.append(
            Column(name, f"ms <= {limit:g}" if limit is not None else "ms", definition)
        )
        latency_keys.append(f"p{q:g}_{REPORT_NAMES[metric]}_ms")
    return latency_columns, latency_keys


# The sidecar's own view of a step, where the sweep read its /stats.
_SIDECAR_COLUMNS = [
    *(
        Column(
            f"server {name}",
            "ms",
            "the sidecar's view of the same requests, "
            "server vantage: from the request it sent upstream "
            f"({METRICS_DOC} §2 Vantages)",
        )
        for name in ("TTFT p50", "TTFT p99", "TPOT p50", "E2E p99")
    ),
    Column(
        "sidecar delay p99",
        "µs",
        "the sidecar's own delay per token event of the step's streams, from its upstream "
        f"socket to its client socket ({METRICS_DOC} §2 The sidecar's own delay)",
    ),
    Column(
        "sidecar CPU/req",
        "ms",
        "the sidecar's CPU from the step's run's start to 0.3 s after its end (every process of "
        "it: process_cpu_seconds_total and sidecar_worker_cpu_seconds_total, the workers' as "
        "of their last status, every 0.25 s), per request the run sent: all its traffic, the "
        "step's and any other, not the sweep's /stats reads after it",
    ),
    Column(
        "sidecar seen/sent",
        "req",
        "of the step's requests, those the sidecar's /stats window still held",
    ),
]


def _rate_cells(step: Mapping[str, Any], mode: str) -> dict[str, str]:
    """A step's cells in the rates-and-outcomes table, by column title."""
    report = step["report"]
    load = f"{step['load']:g}"
    return {
        "load": load,
        "offered": _num(step.get("offered")),
        "achieved": _num(step.get("achieved_rate")),
        "keep-up": _pct(keep_up_ratio(step, mode)),
        "throughput": _num(report.get("request_throughput")),
        "goodput": _num(report.get("request_goodput")),
        "attain.": _pct(report.get("slo_attainment")),
        "conc.": str(
            report.get("max_in_flight_requests", report.get("max_concurrent_requests", "-"))
        ),
        "failed": f"{report.get('failed', 0)}/"
        f"{report.get('failed', 0) + report.get('completed', 0)}",
        "late p99": _num((report.get("lateness_ms") or {}).get("p99")),
        "cache hit": _pct((step.get("engine_delta") or {}).get("prefix_cache_hit_rate")),
        "verdict": "pass" if step["passed"] else "FAIL",
    }


def _sidecar_cells(view: Mapping[str, Any] | None) -> list[str]:
    if not view:
        return ["-"] * len(_SIDECAR_COLUMNS)
    server = view["vantages"]["server"]
    # A view written before the sidecar reported its own delay has none: "-".
    delay_p99_ms = view.get("relay", {}).get("delay_ms", {}).get("p99")
    return [
        _num(server["ttft_ms"].get("p50"), 1),
        _num(server["ttft_ms"].get("p99"), 1),
        _num(server["tpot_ms"].get("p50"), 1),
        _num(server["e2e_ms"].get("p99"), 1),
        _num(None if delay_p99_ms is None else delay_p99_ms * 1000.0, 0),
        # A view written before the sweep read the sidecar's CPU, or without it: "-".
        _num((view.get("cpu") or {}).get("per_request_ms"), 3),
        f"{view['requests_seen']}/{view['requests_sent']}",
    ]


def text_table(table: Table) -> str:
    """A table as aligned text: a title, a header of names and one of units, the rows."""
    columns = table.columns
    widths = [
        max(len(c.title), len(c.unit), *(len(row[i]) for row in table.rows))
        for i, c in enumerate(columns)
    ]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.rjust(width) for cell, width in zip(cells, widths, strict=True)
        ).rstrip()

    out = [table.title, line([c.title for c in columns]), line([c.unit for c in columns])]
    out.append("  ".join("-" * width for width in widths))
    out += [line(row) for row in table.rows]
    return "\n".join(out)


def capacity_text(result: Mapping[str, Any]) -> str:
    """The capacity as a person reads it: exact, a lower bound, or none."""
    capacity = result.get("capacity")
    unit = result.get("unit", "req/s")
    loads = sorted(s["load"] for s in result.get("steps", []))
    if capacity is None:
        lowest = f" (lowest load tried: {loads[0]:g} {unit})" if loads else ""
        return f"capacity: none, no step passed{lowest}"
    failed_above = sorted(
        s["load"] for s in result.get("steps", []) if not s["passed"] and s["load"] > capacity
    )
    if not failed_above:
        return (
            f"capacity: >= {capacity:g} {unit}, no step failed (a lower bound: the "
            "highest load tried passed)"
        )
    return (
        f"capacity: {capacity:g} {unit} (the highest passing load; "
        f"{failed_above[0]:g} {unit} failed)"
    )


def knee_text(result: Mapping[str, Any]) -> str:
    """The knee, always said, also when it is the capacity."""
    knee_load = result.get("knee")
    unit = result.get("unit", "req/s")
    if knee_load is None:
        return "knee: none (no step measured goodput)"
    goodput = next(
        (
            s["report"].get("request_goodput")
            for s in result.get("steps", [])
            if s["load"] == knee_load
        ),
        None,
    )
    same = "; the same load as the capacity" if knee_load == result.get("capacity") else ""
    return (
        f"knee: {knee_load:g} {unit} (the load of the highest goodput, {_num(goodput)} req/s{same})"
    )


def console_report(result: Mapping[str, Any]) -> str:
    """What `sidecar sweep` prints on stdout: the tables sweep.html shows, the failures, the
    definitions of the columns, the criteria, the capacity and the knee."""
    tables = step_tables(result)
    parts = [text_table(table) for table in tables.tables]
    if tables.failures:
        parts.append("failed steps:\n" + "\n".join(f"  {line}" for line in tables.failures))
    parts.append(
        "columns:\n"
        + "\n".join(f"  {names}: {definition}" for names, definition in tables.legend())
    )
    parts.append(
        "\n".join([f"criteria: {result.get('criteria')}", capacity_text(result), knee_text(result)])
    )
    return "\n\n".join(parts)


def step_line(result: Mapping[str, Any], step: Mapping[str, Any]) -> str:
    """One step as it ends (stderr, while the sweep goes on): the numbers its verdict was
    judged on, named as in the table."""
    criteria = criteria_of(result)
    mode = result.get("mode", "open")
    report = step["report"]
    parts = []
    if mode == "open":
        parts.append(
            f"offered {_num(step.get('offered'))} req/s, achieved "
            f"{_num(step.get('achieved_rate'))} req/s ({_pct(keep_up_ratio(step, mode))}"
            f"% of offered, >= {criteria.keep_up:.0%} passes)"
        )
    else:
        parts.append(f"achieved {_num(step.get('achieved_rate'))} req/s")
    for metric, limit in criteria.limits_ms().items():
        value = report.get(f"p{criteria.percentile:g}_{REPORT_NAMES[metric]}_ms")
        parts.append(
            f"{LATENCY_NAMES[metric]} p{criteria.percentile:g} {_num(value, 1)} ms (<= {limit:g})"
        )
    total = report.get("completed", 0) + report.get("failed", 0)
    parts.append(f"failed {report.get('failed', 0)}/{total}")
    verdict = "pass" if step["passed"] else "FAIL: " + "; ".join(step["reasons"])
    return f"load {step['load']:g} {result.get('unit', 'req/s')}: {', '.join(parts)}: {verdict}"
