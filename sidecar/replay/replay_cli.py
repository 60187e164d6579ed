"""``sidecar replay``: send a trace (or a synthetic arrival process) to a target and report."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from sidecar.config import ConfigError, parse_duration, parse_hostport, parse_slo_spec
from sidecar.engine_metrics import parse_engine_metrics
from sidecar.replay import llmd, load
from sidecar.replay.live import MetricsServer, ReplayCounters
from sidecar.replay.options import ReplayOptions, UsageError
from sidecar.replay.payload import (
    DEFAULT_TOKEN_IDS,
    WORDS,
    PayloadError,
    TokenCalibration,
    TokenIds,
    parse_token_id_range,
    text_prompt,
)
from sidecar.replay.peers import peer_report, vllm_bench_counters, vllm_bench_json
from sidecar.replay.report import (
    DEFAULT_MAX_LATENESS_MS,
    console_table,
    mark_degraded,
    median_run,
    run_report,
)
from sidecar.replay.runner import PlannedRequest, SentRequest
from sidecar.stats import SLO, SLOPolicy
from sidecar.tracefile import (
    TraceFormatError,
    TraceReader,
    TraceRequest,
    unreplayable_reason,
)

DESCRIPTION = """\
Replay a trace as load against a target (a vLLM replica, or the sidecar in front of replicas),
and measure it as a client by the sidecar's definitions. Open loop by default: requests leave at
the trace's own arrival times (scaled by --time-scale) or on a synthetic process (--rate,
--burstiness), whatever the server does; --max-concurrency is the closed-loop experiment
instead, reported as such. Each request reproduces the recorded work: exact input length
(token-id prompts on /v1/completions), exact output length (max_tokens + ignore_eos), shared
prefixes where the trace's hashes say so, captured bodies verbatim when the trace has them.
A run whose sender fell behind its schedule (lateness p99 over --max-lateness) did not offer
the load it claims: it is marked DEGRADED, and `sidecar compare` will not call it better or
worse.
"""

EPILOG = """\
examples:
  sidecar replay capture.jsonl --target http://127.0.0.1:8080
      replay a capture on its own schedule, 3 repeats, the median run reported
  sidecar replay mooncake.jsonl --target http://127.0.0.1:8000 --time-scale 2 --limit 500
  sidecar replay trace.jsonl --target http://127.0.0.1:8000 --rate 20 --burstiness 0.5
      the trace's lengths on a bursty Gamma arrival process at 20 req/s
  sidecar replay trace.jsonl --target http://127.0.0.1:8000 --max-concurrency 32
      closed loop: at most 32 requests outstanding (a different experiment)
  sidecar replay trace.jsonl --target http://127.0.0.1:8000 --rate 8 --slo ttft=500ms \\
      --export-vllm-bench vllm.json --export-llmd br.json
      the reported run also as `vllm bench serve` JSON and as an llm-d benchmark report
      (schema v0.2; goodput and the SLO under results.observability.vllm_sidecar)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="a sidecar trace file (capture or `sidecar trace import`)")
    parser.add_argument("--target", required=True, metavar="URL", help="base URL to send to")
    parser.add_argument(
        "--model",
        help="model name to send [the trace's, else the target's first model from /v1/models]",
    )
    parser.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        help="send every request to this API [each line's own]",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="replay speed: 2 = twice as fast as recorded [1]",
    )
    parser.add_argument(
        "--rate",
        type=float,
        help="synthetic arrivals at this rate (req/s) instead of the trace's times",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape for --rate: 1 = Poisson, <1 burstier [1]",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        help="closed loop: at most N outstanding (not an open-loop rate)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        help="use the first N requests of the trace "
        "(of those it can replay: lines without a prompt size are skipped and "
        "counted)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="send N warm-up requests first (excluded from results) [0]",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of the whole trace; the median run is reported [3]",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="sender processes sharing the schedule, one common start [1]",
    )
    parser.add_argument(
        "--shard-index",
        type=int,
        default=0,
        help="this sender's share of the trace: requests i with i %% "
        "shard-count == shard-index (e.g. a Kubernetes indexed Job) [0]",
    )
    parser.add_argument(
        "--shard-count", type=int, default=1, help="how many senders share the trace [1]"
    )
    parser.add_argument(
        "--start-at",
        type=float,
        metavar="EPOCH_S",
        help="wall-clock instant (Unix seconds) of the trace's t=0, common to "
        "every shard; the run waits for it [now]",
    )
    parser.add_argument("--slo", help="SLO for goodput, e.g. ttft=500ms,tpot=50ms,e2e=20s")
    parser.add_argument("--seed", type=int, default=0, help="seed of synthetic parts [0]")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds before a request counts as timed out [600]",
    )
    parser.add_argument(
        "--no-captured-bodies",
        action="store_true",
        help="rebuild requests from lengths even where bodies were captured",
    )
    parser.add_argument(
        "--token-id-range",
        metavar="LOW:HIGH",
        help="token ids of rebuilt completion prompts, both ends included "
        "[ids the target's /tokenize produces; without that endpoint, "
        "1000:29999]",
    )
    parser.add_argument(
        "--output-dir",
        metavar="DIR",
        help="write report.json and one records-runN.jsonl per run here",
    )
    parser.add_argument(
        "--quiet",
        "--no-progress",
        dest="quiet",
        action="store_true",
        help="no progress on stderr (a bar on a terminal, else a line every "
        "10 s); the report on stdout is the same",
    )
    parser.add_argument(
        "--peer-definitions",
        action="store_true",
        help="also report every metric under vLLM's, inference-perf's, "
        "AIPerf's and GuideLLM's definitions, named by formula",
    )
    parser.add_argument(
        "--export-vllm-bench",
        metavar="FILE",
        help="also write the median run as `vllm bench serve` result JSON "
        "(--save-result --save-detailed: every key it writes, with its "
        "meaning)",
    )
    parser.add_argument(
        "--max-lateness",
        default=f"{DEFAULT_MAX_LATENESS_MS:g}ms",
        metavar="DURATION",
        help="mark a run DEGRADED when its sender lateness p99 (actual send - "
        "scheduled send, open loop) exceeds this: the sender fell behind and "
        "the run did not offer the load it claims; `off` never marks "
        "[%(default)s: a healthy sender stays under 1 ms]",
    )
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve this sender's live numbers on http://HOST:PORT/metrics "
        "(Prometheus): requests planned, sent, completed by outcome, in "
        "flight, send lateness [off]",
    )
    parser.add_argument(
        "--metrics-linger",
        default="0s",
        metavar="DURATION",
        help="keep /metrics up this long after the run, so that a last scrape "
        "sees the final numbers (a Job: 2 scrape intervals) [0s]",
    )
    parser.add_argument(
        "--export-llmd",
        metavar="FILE",
        help="also write the median run as an llm-d benchmark report (schema "
        "v0.2, JSON); goodput and the SLO go under "
        "results.observability.vllm_sidecar",
    )


def max_lateness_ms(text: str) -> float | None:
    """--max-lateness as milliseconds; None for `off`."""
    if text.strip().lower() == "off":
        return None
    try:
        return parse_duration(text) * 1000.0
    except ConfigError as exc:
        raise UsageError(f"--max-lateness: {exc}") from None


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


class TargetUnreachable(UsageError, ValueError):
    """Nothing answers at the target (refused, timed out, not resolvable)."""


async def run(args: argparse.Namespace) -> int:
    try:
        return await _run(args)
    except (UsageError, TraceFormatError, PayloadError, ValueError) as exc:
        print(f"sidecar replay: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # sender workers that did not start or failed: ran, failed
        print(f"sidecar replay: {exc}", file=sys.stderr)
        return 1


def checked_target(target: str) -> str:
    """The target's base URL, refused at once when it is not an http(s) URL (a bare host:port
    used to reach the first request and come back as "no model")."""
    parts = urlsplit(target.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"--target must be an http(s) URL like http://127.0.0.1:8000: {target!r}")
    return target.strip().rstrip("/")


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


async def _run(args: argparse.Namespace) -> int:
    options = ReplayOptions.from_namespace(args)
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
        print(
            f"sidecar replay: {skipped_summary(skipped, len(lines), options.trace)}",
            file=sys.stderr,
        )
    requests = sorted(sendable, key=lambda r: r.t)
    trace_origin = requests[0].t if requests else 0.0
    if options.limit is not None:
        requests = requests[: options.limit]
    if options.shard_count > 1:
        # Round-robin in arrival order: each shard keeps the trace's time span and shape.
        requests = requests[options.shard_index :: options.shard_count]
    if not requests:
        raise UsageError(f"{options.trace}: no requests to replay")
    slo_policy = None
    if options.slo:
        slo_policy = SLOPolicy({"default": SLO(**parse_slo_spec(options.slo).slo_arguments())})
    target = checked_target(options.target)
    options = replace(options, target=target)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model = options.model or _trace_model(requests) or await first_model(session, target)
        if model is None:
            raise UsageError("no model: pass --model (the target's /v1/models was empty)")
        needs_text = options.endpoint == "chat" or any(
            r.endpoint == "chat" and (r.body is None or options.no_captured_bodies)
            for r in requests
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
    plan = load.plan(requests, options, model, calibration, token_ids, trace_origin=trace_origin)
    mode = plan.mode
    warmup = plan.requests[: options.warmup] if options.warmup else []
    envelope = {
        "trace": str(options.trace),
        "trace_source": reader.header.source,
        "requests": len(plan.requests),
        "model": model,
        "target": target,
        "engine_version": version,
        "mode": mode,
        "time_scale": options.time_scale if options.rate is None else None,
        "rate": options.rate,
        "burstiness": options.burstiness if options.rate else None,
        "max_concurrency": options.max_concurrency,
        "warmup": len(warmup),
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
        "prompt_token_ids": token_ids.describe(),
        "skipped_lines": {
            "count": len(skipped),
            "of": len(lines),
            "lines": [
                {"line": skip.line, "reason": skip.reason} for skip in skipped[:SKIPPED_LINES_KEPT]
            ],
        },
    }
    counters: ReplayCounters | None = None
    metrics: MetricsServer | None = None
    if metrics_address is not None:
        counters = ReplayCounters()
        host, port = metrics_address
        metrics = MetricsServer(counters, str(options.shard_index), host, port)
        try:
            print(f"metrics on {await metrics.start()}", file=sys.stderr, flush=True)
        except OSError as exc:
            await metrics.close()
            # The event loop's message repeats the address as a tuple: the cause alone.
            cause = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror
            raise UsageError(
                f"cannot listen on {host}:{port} (--metrics-listen): {cause or exc}"
            ) from None
    try:
        # The llm-d report's native arguments: the command line as parsed, and what was
        # derived from it (as earlier reports have them).
        native = {**vars(args), "max_lateness_ms": lateness_ms, "trace_origin": trace_origin}
        return await _replay(
            options,
            plan,
            envelope,
            requests,
            engine_before,
            slo_policy,
            counters,
            lateness_ms,
            native,
        )
    finally:
        if metrics is not None:
            try:
                await asyncio.sleep(linger_s)
            finally:
                await metrics.close()


async def _replay(
    options: ReplayOptions,
    plan: load.Plan,
    envelope: dict[str, Any],
    requests: list[TraceRequest],
    engine_before: dict[str, Any] | None,
    slo_policy: SLOPolicy | None,
    counters: ReplayCounters | None,
    lateness_ms: float | None,
    native_args: dict[str, Any],
) -> int:
    target, mode = options.target, plan.mode
    warmup = plan.requests[: options.warmup] if options.warmup else []
    timeout = aiohttp.ClientTimeout(total=10)
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
        reports.append(run_report(sent, mode=mode, slo_policy=slo_policy))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        engine_after = await scrape_engine(session, target)
    envelope["engine_before"] = engine_before
    envelope["engine_after"] = engine_after
    envelope["engine_delta"] = engine_delta(engine_before, engine_after)
    chosen = median_run(reports)
    result = dict(reports[chosen])
    result["envelope"] = envelope
    result["median_run"] = chosen
    result["runs"] = reports
    mark_degraded(result, lateness_ms)
    chosen_records = [s.record for s in runs[chosen]]
    if options.peer_definitions:
        result["peer_definitions"] = peer_report(chosen_records)
    if options.export_vllm_bench:
        planned = {p.index: r.n_in for p, r in zip(plan.requests, requests, strict=True)}
        exported = vllm_bench_json(
            result, runs[chosen], requested_input=planned, server=server[chosen]
        )
        Path(options.export_vllm_bench).write_text(json.dumps(exported, indent=2, default=str))
    if options.export_llmd:
        br = llmd_report(
            result, runs[chosen], requests, options, slo_policy, native_args=native_args
        )
        Path(options.export_llmd).write_text(json.dumps(br, indent=2))
    # Files first: a closed stdout (`| head`) must not cost the run's results.
    if options.output_dir:
        out = Path(options.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(result, indent=2, default=str))
        for i, sent in enumerate(runs):
            with (out / f"records-run{i}.jsonl").open("w") as handle:
                for s in sent:
                    line = {
                        "index": s.index,
                        "scheduled_ns": s.scheduled_ns,
                        "actual_ns": s.actual_ns,
                        "record": s.record.to_dict(),
                    }
                    handle.write(json.dumps(line) + "\n")
    print(console_table(result))
    if options.output_dir:
        print(f"report: {Path(options.output_dir) / 'report.json'}")
    if not any(s.record.ok for sent in runs for s in sent):
        causes = Counter(
            s.record.error_type or s.record.outcome.value for sent in runs for s in sent
        )
        top = ", ".join(f"{cause} x{count}" for cause, count in causes.most_common(3))
        print(f"sidecar replay: no request succeeded ({top})", file=sys.stderr)
        return 1
    return 0


# Envelope members that are measurements, not the run's configuration.
MEASURED_ENVELOPE_KEYS = frozenset({"engine_before", "engine_after", "engine_delta"})


def llmd_report(
    result: dict[str, Any],
    sent: Sequence[SentRequest],
    requests: Sequence[TraceRequest],
    options: ReplayOptions,
    slo_policy: SLOPolicy | None,
    *,
    native_args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The reported (median) run as an llm-d benchmark report, schema v0.2. ``native_args``:
    the arguments as the tool was given them [the options']."""
    envelope = result["envelope"]
    engine_before = envelope.get("engine_before") or {}
    workload = llmd.Workload(
        input_lengths=[r.n_in for r in requests],
        output_lengths=[r.n_out for r in requests],
        sampled=uses_captured_bodies(requests, options),
        rate_qps=options.rate if options.max_concurrency is None else None,
        concurrency=options.max_concurrency,
        description=f"sidecar replay of {envelope['trace']} ({envelope['mode']} loop)",
        args=llmd.native_args(vars(options) if native_args is None else native_args),
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


def uses_captured_bodies(
    requests: Sequence[TraceRequest], options: ReplayOptions | argparse.Namespace
) -> bool:
    """Were request bodies sent as captured (sampled text) rather than generated?"""
    return not getattr(options, "no_captured_bodies", False) and any(
        r.body is not None for r in requests
    )


def _trace_model(requests: Sequence[TraceRequest]) -> str | None:
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


def engine_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, float]:
    if not before or not after:
        return {}
    b, a = before.get("values", {}), after.get("values", {})
    out = {
        k: a[k] - b[k]
        for k in (
            "prefix_cache_queries",
            "prefix_cache_hits",
            "preemptions",
            "prompt_tokens",
            "generation_tokens",
            "cached_tokens",
        )
        if k in a and k in b
    }
    if out.get("prefix_cache_queries"):
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0) / out["prefix_cache_queries"]
    elif out.get("cached_tokens") is not None and out.get("prompt_tokens"):
        # SGLang counts cached prompt tokens instead of vLLM's queries and hits (tokens too).
        out["prefix_cache_hit_rate"] = out["cached_tokens"] / out["prompt_tokens"]
    return out


# `sidecar replay`'s own command line into the library (replay/load.py): kept for scripts that
# call the command's functions with a parsed namespace (benchmarks/replay_pacing.py).


def make_plan(
    requests: Sequence[TraceRequest],
    args: argparse.Namespace,
    model: str,
    calibration: TokenCalibration | None,
    token_ids: TokenIds = DEFAULT_TOKEN_IDS,
) -> tuple[list[PlannedRequest], str]:
    planned = load.plan(
        requests,
        ReplayOptions.from_namespace(args),
        model,
        calibration,
        token_ids,
        trace_origin=getattr(args, "trace_origin", None),
    )
    return list(planned.requests), planned.mode


async def execute(
    plan: Sequence[PlannedRequest],
    target: str,
    mode: str,
    concurrency: int | None,
    workers: int,
    args: argparse.Namespace,
    *,
    label: str = "",
    quiet: bool = False,
    request_id_prefix: str = "replay",
    counters: ReplayCounters | None = None,
) -> list[SentRequest]:
    options = replace(ReplayOptions.from_namespace(args), target=target)
    return await load.run(
        load.Plan(plan, mode),
        options,
        concurrency=concurrency or 1,
        workers=workers,
        label=label,
        quiet=quiet,
        request_id_prefix=request_id_prefix,
        counters=counters,
    )


# -- the target's side ------------------------------------------------------------------------


async def first_model(session: aiohttp.ClientSession, target: str) -> str | None:
    """The first model the target's /v1/models lists; None when it lists none or answers
    something else. Raises TargetUnreachable when nothing answers there."""
    try:
        async with session.get(target + "/v1/models") as response:
            body = await response.json(content_type=None)
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        cause = str(exc) or type(exc).__name__
        raise TargetUnreachable(f"{target} is unreachable: {cause}") from None
    except (aiohttp.ClientError, ValueError):
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        model = data[0].get("id")
        return model if isinstance(model, str) else None
    return None


async def calibrate(session: aiohttp.ClientSession, target: str, model: str) -> TokenCalibration:
    """Tokens per generated word and the chat template's overhead, from the target's
    /tokenize; without it, one token per word (input lengths then approximate)."""
    words = 500
    sample = text_prompt(words, 12345, TokenCalibration())
    try:
        async with session.post(
            target + "/tokenize",
            json={"model": model, "prompt": sample, "add_special_tokens": False},
        ) as response:
            plain = await response.json(content_type=None)
        async with session.post(
            target + "/tokenize",
            json={"model": model, "messages": [{"role": "user", "content": sample}]},
        ) as response:
            chat = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return TokenCalibration()
    if not (
        isinstance(plain, dict)
        and isinstance(plain.get("count"), int)
        and isinstance(chat, dict)
        and isinstance(chat.get("count"), int)
    ):
        return TokenCalibration()
    per_word = plain["count"] / words
    return TokenCalibration(
        tokens_per_word=per_word, chat_overhead=max(0, chat["count"] - plain["count"])
    )


# Text for the target's tokenizer to turn into ids a rebuilt prompt may use: words, numbers,
# letters and punctuation, so that the ids are many and spread over the vocabulary.
_TOKEN_SAMPLE = " ".join(
    [
        *WORDS,
        *(f"{w.capitalize()}{i}" for i, w in enumerate(WORDS)),
        *(str(n) for n in range(0, 1000, 7)),
        *("".join(chr(c) for c in range(start, start + 8)) for start in range(33, 127, 8)),
        "the quick brown fox jumps over the lazy dog; THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
    ]
)


async def probe_token_ids(session: aiohttp.ClientSession, target: str, model: str) -> TokenIds:
    """Token ids the target's tokenizer produced for varied text (vLLM's ``/tokenize``): every
    one is in its vocabulary, whatever its size. Without the endpoint, the default range (which
    fits vocabularies of 30k ids and more)."""
    try:
        async with session.post(
            target + "/tokenize",
            json={"model": model, "prompt": _TOKEN_SAMPLE, "add_special_tokens": False},
        ) as response:
            answer = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return DEFAULT_TOKEN_IDS
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list):
        return DEFAULT_TOKEN_IDS
    ids = sorted({t for t in tokens if type(t) is int and t >= 0})
    if len(ids) < 32:
        return DEFAULT_TOKEN_IDS  # too few to make prompts that differ
    return TokenIds(ids=tuple(ids), source="the target's /tokenize")


async def engine_version(session: aiohttp.ClientSession, target: str) -> str | None:
    """The target's /version (vLLM and the simulator serve it), best effort."""
    try:
        async with session.get(target + "/version") as response:
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    version = body.get("version") if isinstance(body, dict) else None
    return version if isinstance(version, str) else None


async def server_counters(target: str) -> dict[str, Any] | None:
    """The target's /metrics counters that vllm bench reads (`vllm_bench_counters`); None
    when it serves no /metrics."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(target + "/metrics") as response,
        ):
            if response.status != 200:
                return None
            return vllm_bench_counters(await response.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def scrape_engine(session: aiohttp.ClientSession, target: str) -> dict[str, Any] | None:
    try:
        async with session.get(target + "/metrics") as response:
            if response.status != 200:
                return None
            text = await response.text()
        values, flavour = parse_engine_metrics(text)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    return {"flavour": flavour, "values": values} if flavour else None
