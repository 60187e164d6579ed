"""A whole replay as library calls: read the trace, ask the target, plan, send the warm-up and
the repeats, build the report, write its files. `sidecar replay` is these calls with its
command line parsed into a `ReplayOptions` and the report printed; a script calls them alike:

    result = await session.replay(ReplayOptions("trace.jsonl", "http://127.0.0.1:8000"))
    session.write_outputs(result)  # --output-dir, --export-vllm-bench, --export-llmd
    print(report.console_table(result.report))

`replay` is `prepare`, then `send` while the live /metrics listener (``metrics_listen``) is
up; the command calls the three itself, to write and print its report before that listener's
linger. Notices that the command prints on stderr (the trace lines skipped, where /metrics
is served) go to ``notify``, which prints them on stderr unless given.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from sidecar.config import ConfigError, parse_duration, parse_hostport, parse_slo_spec
from sidecar.replay import llmd, load
from sidecar.replay.live import MetricsServer, ReplayCounters
from sidecar.replay.options import ReplayOptions, UsageError
from sidecar.replay.payload import (
    DEFAULT_TOKEN_IDS,
    TokenCalibration,
    TokenIds,
    parse_token_id_range,
)
from sidecar.replay.peers import peer_report, vllm_bench_json
from sidecar.replay.report import mark_degraded, median_run, run_report
from sidecar.replay.runner import SentRequest
from sidecar.replay.target import (
    calibrate,
    checked_target,
    engine_delta,
    engine_version,
    first_model,
    probe_token_ids,
    scrape_engine,
    server_counters,
)
from sidecar.stats import SLO, SLOPolicy
from sidecar.tracefile import TraceReader, TraceRequest, unreplayable_reason

Notify = Callable[[str], None]


def print_on_stderr(text: str) -> None:
    """The default ``notify``: what the command says on stderr, said there."""
    print(text, file=sys.stderr, flush=True)


# -- the trace --------------------------------------------------------------------------------

# Skipped lines named on stderr, and kept in the report (the count is always whole).
SKIPPED_LINES_SHOWN = 5
SKIPPED_LINES_KEPT = 100


@dataclass(frozen=True, slots=True)
class SkippedLine:
    """A trace line replay cannot send: its line number in the file and why."""

    line: int
    reason: str


def split_replayable(
    lines: Sequence[tuple[int, TraceRequest]], *, use_captured_body: bool
) -> tuple[list[TraceRequest], list[SkippedLine]]:
    """The requests replay can send, and the lines it skips, by `unreplayable_reason` (the
    rule `sidecar trace lint` reports as cannot-replay)."""
    sendable: list[TraceRequest] = []
    skipped: list[SkippedLine] = []
    for line, request in lines:
        reason = unreplayable_reason(request, use_captured_body=use_captured_body)
        if reason is None:
            sendable.append(request)
        else:
            skipped.append(SkippedLine(line, reason))
    return sendable, skipped


def skipped_examples(skipped: Sequence[SkippedLine]) -> str:
    shown = ", ".join(f"line {skip.line} ({skip.reason})" for skip in skipped[:SKIPPED_LINES_SHOWN])
    more = len(skipped) - SKIPPED_LINES_SHOWN
    return shown + (f", +{more} more" if more > 0 else "")


def skipped_summary(skipped: Sequence[SkippedLine], total: int, trace: str) -> str:
    """One line: how many lines are skipped, the first few with their reasons."""
    where = (
        "" if len(skipped) <= SKIPPED_LINES_SHOWN else f" (`sidecar trace lint {trace}` lists them)"
    )
    return (
        f"skipped {len(skipped)} of {total} trace lines that cannot be replayed: "
        f"{skipped_examples(skipped)}{where}"
    )


@dataclass(frozen=True)
class Workload:
    """The requests of the trace this replay sends (after --limit and this shard's share), in
    arrival order, and what was left out."""

    requests: list[TraceRequest]
    trace_origin: float  # the trace's t = 0: the first sendable request's t, before sharding
    lines: int  # request lines in the file
    skipped: list[SkippedLine]
    source: str | None  # the trace header's source ("capture", "mooncake", ...)


def read_workload(options: ReplayOptions, *, notify: Notify = print_on_stderr) -> Workload:
    """Read ``options.trace``; the lines it cannot send are skipped and counted (said through
    ``notify``). Raises UsageError when nothing is left to send."""
    reader = TraceReader(options.trace)
    lines = list(reader.numbered())
    sendable, skipped = split_replayable(lines, use_captured_body=not options.no_captured_bodies)
    if lines and not sendable:
        raise UsageError(
            f"{options.trace}: none of its {len(lines)} request lines can be "
            f"replayed: {skipped_examples(skipped)}; `sidecar trace lint "
            f"{options.trace}` lists them"
        )
    if skipped:
        notify(f"sidecar replay: {skipped_summary(skipped, len(lines), options.trace)}")
    requests = sorted(sendable, key=lambda r: r.t)
    trace_origin = requests[0].t if requests else 0.0
    if options.limit is not None:
        requests = requests[: options.limit]
    if options.shard_count > 1:
        # Round-robin in arrival order: each shard keeps the trace's time span and shape.
        requests = requests[options.shard_index :: options.shard_count]
    if not requests:
        raise UsageError(f"{options.trace}: no requests to replay")
    return Workload(requests, trace_origin, len(lines), skipped, reader.header.source)


def trace_model(requests: Sequence[TraceRequest]) -> str | None:
    """The model of the first request that did not fail, else of the first with one: a
    capture's first line may be a request for a mistyped model."""
    return next(
        (r.model for r in requests if r.model and r.outcome in (None, "ok")),
        next((r.model for r in requests if r.model), None),
    )


def lengths_summary(values: Sequence[int | None]) -> dict[str, float | None]:
    known = [v for v in values if v is not None]
    if not known:
        return {"count": 0}
    arr = sorted(known)
    return {
        "count": len(arr),
        "min": arr[0],
        "p50": arr[len(arr) // 2],
        "p99": arr[min(len(arr) - 1, int(len(arr) * 0.99))],
        "max": arr[-1],
        "mean": sum(arr) / len(arr),
    }


def uses_captured_bodies(requests: Sequence[TraceRequest], no_captured_bodies: bool) -> bool:
    """Were request bodies sent as captured (sampled text) rather than generated?"""
    return not no_captured_bodies and any(r.body is not None for r in requests)


# -- checks before the first request ----------------------------------------------------------


def max_lateness_ms(text: str) -> float | None:
    """--max-lateness as milliseconds; None for `off`."""
    if text.strip().lower() == "off":
        return None
    try:
        return parse_duration(text) * 1000.0
    except ConfigError as exc:
        raise UsageError(f"--max-lateness: {exc}") from None


def check_writable(directory: str | None = None, files: Sequence[str | None] = ()) -> None:
    """Before the first request: the output directory can be made and written, and each output
    file's folder exists and is writable (a run of hours must not end in 'No such file').
    Raises UsageError naming the path and the cause."""

    targets = [Path(directory)] if directory else []
    for file in files:
        if file:
            targets.append(Path(file).parent if str(Path(file).parent) else Path("."))
    for folder in targets:
        try:
            if directory and folder == Path(directory):
                folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".sidecar-write-check-"):
                pass
        except OSError as exc:
            raise UsageError(f"cannot write to {folder}: {exc.strerror or exc}") from None


# -- a replay ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedReplay:
    """Everything decided before the first request: the options (the target's URL
    normalised), the workload, the plan, the report's envelope (its configuration), the
    engine's counters before, and the parsed durations and address."""

    options: ReplayOptions
    workload: Workload
    plan: load.Plan
    envelope: Mapping[str, Any]
    engine_before: dict[str, Any] | None
    slo_policy: SLOPolicy | None
    lateness_ms: float | None  # --max-lateness; None: off
    linger_s: float  # --metrics-linger
    metrics_address: tuple[str, int] | None  # --metrics-listen
    native_args: Mapping[str, Any]  # the arguments as given, for the llm-d report


def _checked(options: ReplayOptions) -> tuple[float | None, float, tuple[str, int] | None]:
    """The options checked together (UsageError naming the fix), and the parsed
    --max-lateness (ms), --metrics-linger (s) and --metrics-listen."""
    if options.repeats < 1 or options.workers < 1:
        raise UsageError("--repeats and --workers must be >= 1")
    check_writable(options.output_dir, (options.export_vllm_bench, options.export_llmd))
    if options.max_concurrency is not None and options.workers > 1:
        raise UsageError("--workers applies to open loop only")
    if not 0 <= options.shard_index < options.shard_count:
        raise UsageError("need 0 <= --shard-index < --shard-count")
    if options.start_at is not None and options.repeats != 1:
        raise UsageError("--start-at fixes one common instant: use it with --repeats 1")
    try:
        lateness_ms = max_lateness_ms(options.max_lateness)
        linger_s = parse_duration(options.metrics_linger)
        metrics_address = parse_hostport(options.metrics_listen) if options.metrics_listen else None
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    return lateness_ms, linger_s, metrics_address


@dataclass(frozen=True)
class _Asked:
    """What the target said before the run: the model, the prompt calibration and token ids
    fitting its tokenizer, its version and its engine counters."""

    model: str
    calibration: TokenCalibration | None
    token_ids: TokenIds
    version: str | None
    engine_before: dict[str, Any] | None


async def _ask_target(
    session: aiohttp.ClientSession, options: ReplayOptions, requests: Sequence[TraceRequest]
) -> _Asked:
    target = options.target
    model = options.model or trace_model(requests) or await first_model(session, target)
    if model is None:
        raise UsageError("no model: pass --model (the target's /v1/models was empty)")
    needs_text = options.endpoint == "chat" or any(
        r.endpoint == "chat" and (r.body is None or options.no_captured_bodies) for r in requests
    )
    calibration = await calibrate(session, target, model) if needs_text else None
    token_ids = DEFAULT_TOKEN_IDS
    if options.token_id_range:
        try:
            token_ids = parse_token_id_range(options.token_id_range)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    elif load.needs_token_ids(requests, options):
        token_ids = await probe_token_ids(session, target, model)
    version = await engine_version(session, target)
    engine_before = await scrape_engine(session, target)
    return _Asked(model, calibration, token_ids, version, engine_before)


def _envelope(
    options: ReplayOptions, workload: Workload, plan: load.Plan, asked: _Asked
) -> dict[str, Any]:
    """The report's envelope: the run's configuration, as planned."""
    requests = workload.requests
    skipped = workload.skipped
    calibration = asked.calibration
    return {
        "trace": str(options.trace),
        "trace_source": workload.source,
        "requests": len(plan.requests),
        "model": asked.model,
        "target": options.target,
        "engine_version": asked.version,
        "mode": plan.mode,
        "time_scale": options.time_scale if options.rate is None else None,
        "rate": options.rate,
        "burstiness": options.burstiness if options.rate else None,
        "max_concurrency": options.max_concurrency,
        "warmup": len(plan.requests[: options.warmup] if options.warmup else []),
        "repeats": options.repeats,
        "workers": options.workers,
        # One sender's share of a sharded replay, and the start all shards share (merge).
        "shard": {"index": options.shard_index, "count": options.shard_count},
        "start_at": options.start_at,
        "slo": options.slo,
        "input_tokens_requested": lengths_summary([r.n_in for r in requests]),
        "output_tokens_requested": lengths_summary([r.n_out for r in requests]),
        "prompt_text_calibration": None
        if calibration is None
        else {
            "tokens_per_word": calibration.tokens_per_word,
            "chat_overhead": calibration.chat_overhead,
        },
        "prompt_token_ids": asked.token_ids.describe(),
        "skipped_lines": {
            "count": len(skipped),
            "of": workload.lines,
            "lines": [
                {"line": skip.line, "reason": skip.reason} for skip in skipped[:SKIPPED_LINES_KEPT]
            ],
        },
    }


async def prepare(
    options: ReplayOptions,
    *,
    notify: Notify = print_on_stderr,
    native_args: Mapping[str, Any] | None = None,
) -> PreparedReplay:
    """Check the options, read the trace, ask the target for its model, tokenizer, version and
    engine counters, and plan the load. Raises UsageError (and the trace's and payload's
    errors, ValueErrors) naming the option and the fix. ``native_args``: the arguments as the
    tool was given them, for the llm-d export [the options']."""
    lateness_ms, linger_s, metrics_address = _checked(options)
    workload = read_workload(options, notify=notify)
    requests = workload.requests
    slo_policy = None
    if options.slo:
        slo_policy = SLOPolicy({"default": SLO(**parse_slo_spec(options.slo).slo_arguments())})
    target = checked_target(options.target)
    given = asdict(options) if native_args is None else dict(native_args)
    options = replace(options, target=target)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        asked = await _ask_target(session, options, requests)
    plan = load.plan(
        requests,
        options,
        asked.model,
        asked.calibration,
        asked.token_ids,
        trace_origin=workload.trace_origin,
    )
    envelope = _envelope(options, workload, plan, asked)
    return PreparedReplay(
        options=options,
        workload=workload,
        plan=plan,
        envelope=envelope,
        engine_before=asked.engine_before,
        slo_policy=slo_policy,
        lateness_ms=lateness_ms,
        linger_s=linger_s,
        metrics_address=metrics_address,
        # The llm-d report's native arguments: as given, and what was derived from them (as
        # earlier reports have them).
        native_args={
            **given,
            "max_lateness_ms": lateness_ms,
            "trace_origin": workload.trace_origin,
        },
    )


@contextlib.asynccontextmanager
async def live_metrics(
    prepared: PreparedReplay, *, notify: Notify = print_on_stderr
) -> AsyncIterator[ReplayCounters | None]:
    """The sender's live numbers on ``metrics_listen`` for the block's duration (and
    ``metrics_linger`` after it, so that a last scrape sees the final numbers): the counters
    to give `send`; None when no listener is asked for."""
    if prepared.metrics_address is None:
        yield None
        return
    counters = ReplayCounters()
    host, port = prepared.metrics_address
    metrics = MetricsServer(counters, str(prepared.options.shard_index), host, port)
    try:
        notify(f"metrics on {await metrics.start()}")
    except OSError as exc:
        await metrics.close()
        # The event loop's message repeats the address as a tuple: the cause alone.
        cause = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror
        raise UsageError(
            f"cannot listen on {host}:{port} (--metrics-listen): {cause or exc}"
        ) from None
    try:
        yield counters
    finally:
        try:
            await asyncio.sleep(prepared.linger_s)
        finally:
            await metrics.close()


@dataclass
class ReplayResult:
    """What a replay measured: ``report`` is report.json (the median run's numbers, the
    envelope, every run's report), ``runs`` every run's requests as sent and measured."""

    prepared: PreparedReplay
    report: dict[str, Any]
    runs: list[list[SentRequest]]
    # Per run, the target's vllm-bench counters before and after (only with export_vllm_bench).
    server: list[tuple[dict[str, Any] | None, dict[str, Any] | None]] = field(default_factory=list)

    @property
    def reported(self) -> list[SentRequest]:
        """The requests of the reported (median) run."""
        return self.runs[self.report["median_run"]]

    def failure(self) -> str | None:
        """When no request of any run succeeded, its most common causes ("timeout x3, ...")."""
        if any(s.record.ok for sent in self.runs for s in sent):
            return None
        causes = Counter(
            s.record.error_type or s.record.outcome.value for sent in self.runs for s in sent
        )
        return ", ".join(f"{cause} x{count}" for cause, count in causes.most_common(3))


async def send(prepared: PreparedReplay, *, counters: ReplayCounters | None = None) -> ReplayResult:
    """Send the warm-up, then the repeats of the plan, and build the report: the median run
    (by median E2E), marked DEGRADED when its sender fell behind. ``counters``: the live
    numbers to update (`live_metrics`)."""
    options, plan = prepared.options, prepared.plan
    target, mode = options.target, plan.mode
    warmup = plan.requests[: options.warmup] if options.warmup else []
    if warmup:
        await load.run(
            load.Plan(warmup, "closed"),
            options,
            concurrency=min(8, len(warmup)),
            workers=1,
            quiet=True,
        )
    reports: list[dict[str, Any]] = []
    runs: list[list[SentRequest]] = []
    # The target's speculative-decoding / diffusion counters around each run, for the export
    # (vllm bench reads them around its run); only when one is asked for.
    server: list[tuple[dict[str, Any] | None, dict[str, Any] | None]] = []
    for repeat in range(options.repeats):
        if counters is not None:
            counters.start_run(repeat + 1, len(plan.requests))
        before = await server_counters(target) if options.export_vllm_bench else None
        sent = await load.run(
            plan, options, label=f"run {repeat + 1}/{options.repeats}", counters=counters
        )
        after = await server_counters(target) if options.export_vllm_bench else None
        server.append((before, after))
        runs.append(sent)
        reports.append(run_report(sent, mode=mode, slo_policy=prepared.slo_policy))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        engine_after = await scrape_engine(session, target)
    envelope = dict(prepared.envelope)
    envelope["engine_before"] = prepared.engine_before
    envelope["engine_after"] = engine_after
    envelope["engine_delta"] = engine_delta(prepared.engine_before, engine_after)
    chosen = median_run(reports)
    result = dict(reports[chosen])
    result["envelope"] = envelope
    result["median_run"] = chosen
    result["runs"] = reports
    mark_degraded(result, prepared.lateness_ms)
    if options.peer_definitions:
        result["peer_definitions"] = peer_report([s.record for s in runs[chosen]])
    return ReplayResult(prepared, result, runs, server)


async def replay(
    options: ReplayOptions,
    *,
    notify: Notify = print_on_stderr,
    native_args: Mapping[str, Any] | None = None,
) -> ReplayResult:
    """A whole replay: `prepare`, then `send` while the live /metrics listener is up (when
    ``options.metrics_listen`` asks for one)."""
    prepared = await prepare(options, notify=notify, native_args=native_args)
    async with live_metrics(prepared, notify=notify) as counters:
        return await send(prepared, counters=counters)


# -- the files --------------------------------------------------------------------------------

# Envelope members that are measurements, not the run's configuration.
MEASURED_ENVELOPE_KEYS = frozenset({"engine_before", "engine_after", "engine_delta"})


def write_outputs(result: ReplayResult) -> None:
    """The files the options ask for: the median run as `vllm bench serve` JSON
    (``export_vllm_bench``) and as an llm-d benchmark report (``export_llmd``), and
    report.json with one records-runN.jsonl per run in ``output_dir``."""
    prepared = result.prepared
    options = prepared.options
    requests = prepared.workload.requests
    chosen = result.report["median_run"]
    if options.export_vllm_bench:
        planned = {p.index: r.n_in for p, r in zip(prepared.plan.requests, requests, strict=True)}
        exported = vllm_bench_json(
            result.report,
            result.runs[chosen],
            requested_input=planned,
            server=result.server[chosen],
        )
        Path(options.export_vllm_bench).write_text(json.dumps(exported, indent=2, default=str))
    if options.export_llmd:
        br = llmd_report(
            result.report,
            result.runs[chosen],
            requests,
            options,
            prepared.slo_policy,
            native_args=prepared.native_args,
        )
        Path(options.export_llmd).write_text(json.dumps(br, indent=2))
    if options.output_dir:
        out = Path(options.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(result.report, indent=2, default=str))
        for i, sent in enumerate(result.runs):
            with (out / f"records-run{i}.jsonl").open("w") as handle:
                for s in sent:
                    line = {
                        "index": s.index,
                        "scheduled_ns": s.scheduled_ns,
                        "actual_ns": s.actual_ns,
                        "record": s.record.to_dict(),
                    }
                    handle.write(json.dumps(line) + "\n")


def llmd_report(
    result: dict[str, Any],
    sent: Sequence[SentRequest],
    requests: Sequence[TraceRequest],
    options: ReplayOptions,
    slo_policy: SLOPolicy | None,
    *,
    native_args: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The reported (median) run as an llm-d benchmark report, schema v0.2. ``native_args``:
    the arguments as the tool was given them [the options']."""
    envelope = result["envelope"]
    engine_before = envelope.get("engine_before") or {}
    workload = llmd.Workload(
        input_lengths=[r.n_in for r in requests],
        output_lengths=[r.n_out for r in requests],
        sampled=uses_captured_bodies(requests, options.no_captured_bodies),
        rate_qps=options.rate if options.max_concurrency is None else None,
        concurrency=options.max_concurrency,
        description=f"sidecar replay of {envelope['trace']} ({envelope['mode']} loop)",
        args=llmd.native_args(asdict(options) if native_args is None else native_args),
        config={k: v for k, v in envelope.items() if k not in MEASURED_ENVELOPE_KEYS},
    )
    target = llmd.component(
        "target",
        engine_before.get("flavour") or "unknown",
        envelope.get("engine_version"),
        description="the server the replay was sent to",
        details={"url": envelope["target"], "model": envelope["model"]},
    )
    return llmd.benchmark_report(
        sent,
        duration_s=result["duration"],
        workload=workload,
        slo_policy=slo_policy,
        stack=[target],
        extension={
            "engine_delta": envelope.get("engine_delta") or None,
            "repeats": {"runs": len(result["runs"]), "reported": result["median_run"]},
        },
    )
