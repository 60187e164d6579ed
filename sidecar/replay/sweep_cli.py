"""``sidecar sweep``: replays at increasing load until the SLO breaks; capacity, curves, knee."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from sidecar.config import ConfigError, parse_duration
from sidecar.replay import llmd, plots, replay_cli
from sidecar.replay import load as replay_load
from sidecar.replay.admin import AdminError, SidecarAdmin
from sidecar.replay.options import ReplayOptions, UsageError
from sidecar.replay.payload import DEFAULT_TOKEN_IDS, TokenIds
from sidecar.replay.report import DEFINITIONS, run_report
from sidecar.replay.runner import SentRequest
from sidecar.replay.sweep import (
    STEP_METRICS,
    Criteria,
    Search,
    StepVerdict,
    achieved_rate,
    console_report,
    criteria_detail,
    judge_step,
    knee,
    parse_criteria,
    step_line,
    step_tables,
)
from sidecar.stats import SLOPolicy
from sidecar.tracefile import PrefixBlocks, TraceReader, TraceRequest

DESCRIPTION = """\
Find the capacity of a target under a declared SLO: run replays at increasing offered load
(open-loop rates in req/s, or closed-loop concurrencies with --mode closed, a different
experiment), judge each step (the SLO at a percentile, an error bound, and the completion rate
keeping up with the offered rate), and report the capacity (the highest passing load), the knee
(the load of the highest goodput) and the curves, as a table, JSON, PNG plots, one HTML page and
one llm-d benchmark report (schema v0.2) per load step.

Through a measuring sidecar, --sidecar-admin adds the sidecar's own view of each step: server
vantage (from the request sent upstream) and its client vantage percentiles for exactly that
step's requests (selected by X-Request-Id on its /stats), its routing policy, and the engines'
prefix-cache hit ratio read from each replica.
"""

EPILOG = """\
examples:
  sidecar sweep --target http://127.0.0.1:8080 --dataset synthetic:in=512,out=128 \\
      --slo ttft=500ms,tpot=50ms --auto --output-dir sweep-out
  sidecar sweep --target http://127.0.0.1:8000 --trace capture.jsonl --slo ttft=1s \\
      --rates 2,4,8,16 --repeats 3
  sidecar sweep --target http://127.0.0.1:8000 --dataset synthetic:in=256,out=64 \\
      --mode closed --auto --slo e2e=5s
  sidecar sweep --target http://127.0.0.1:8080 --sidecar-admin http://127.0.0.1:9464 \\
      --dataset synthetic:in=512,out=128 --slo ttft=500ms --rates 2,4,8 --output-dir out
      also the sidecar's server-vantage percentiles per step (the admin listener's /stats
      window, 60 s by default, must be longer than a step: `sidecar proxy --window`)

files in --output-dir: sweep.json, points.jsonl, latency.png, throughput.png, scatter.png,
sweep.html, br/step-<load>.json (llm-d benchmark report v0.2; goodput and the step's verdict
under results.observability.vllm_sidecar)
"""


def parse_loads(text: str) -> list[float]:
    """--rates: numbers > 0 separated by commas, in increasing order."""
    loads = []
    for part in text.split(","):
        try:
            load = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give loads as numbers separated by commas, e.g. 1,2,4,8 (req/s; "
                "concurrent requests with --mode closed)"
            ) from None
        if not math.isfinite(load) or load <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: every load must be a number > 0")
        loads.append(load)
    return sorted(loads)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="URL")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="requests (lengths, prefixes) from a trace file")
    source.add_argument(
        "--dataset",
        metavar="SPEC",
        help="synthetic:in=N,out=M[,shared=K] (K tokens of shared prefix)",
    )
    parser.add_argument(
        "--slo",
        required=True,
        help="thresholds judged at --slo-percentile, e.g. ttft=500ms,tpot=50ms "
        "(the SLO grammar of `sidecar proxy --slo`, with itl= too)",
    )
    parser.add_argument(
        "--slo-percentile",
        type=float,
        default=90.0,
        help="the percentile each threshold applies to [90]",
    )
    parser.add_argument("--max-error-rate", type=float, default=0.01, help="[0.01]")
    parser.add_argument(
        "--keep-up",
        type=float,
        default=0.9,
        help="minimum completion rate / offered rate, open loop [0.9]",
    )
    loads = parser.add_mutually_exclusive_group(required=True)
    loads.add_argument(
        "--rates",
        type=parse_loads,
        metavar="LOADS",
        help="explicit loads, e.g. 1,2,4,8 (req/s; concurrent requests with --mode closed)",
    )
    loads.add_argument(
        "--auto", action="store_true", help="double from --start until a step fails, then bisect"
    )
    parser.add_argument("--start", type=float, default=1.0, help="first load of --auto [1]")
    parser.add_argument("--bisect-steps", type=int, default=3, help="[3]")
    parser.add_argument("--mode", choices=("open", "closed"), default="open", help="[open]")
    parser.add_argument(
        "--step-duration", default="10s", help="open loop: seconds of arrivals per step [10s]"
    )
    parser.add_argument(
        "--min-requests", type=int, default=20, help="at least this many requests per step [20]"
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape [1: Poisson]")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests per step [2]")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per step; the median run counts [1]"
    )
    parser.add_argument("--model", help="model to send [the target's first]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument(
        "--output-dir",
        metavar="DIR",
        help="sweep.json, plots (PNG), sweep.html and br/step-<load>.json [no files]",
    )
    parser.add_argument(
        "--sidecar-admin",
        metavar="URL",
        help="the admin listener of the sidecar the target is (e.g. "
        "http://127.0.0.1:9464): adds its server-vantage view of each step",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr (a bar per step on a terminal, else a line "
        "every 10 s, and one line per finished step); the table on stdout is "
        "the same",
    )
    parser.add_argument(
        "--admin-token",
        metavar="TOKEN",
        default=os.environ.get("SIDECAR_ADMIN_TOKEN"),
        help="bearer token of --sidecar-admin [SIDECAR_ADMIN_TOKEN]; prefer "
        "the variable, which other local users cannot see in the process list",
    )


def synthetic_requests(spec: str, count: int) -> list[TraceRequest]:
    kind, _, params = spec.partition(":")
    if kind != "synthetic":
        raise ValueError(f"unknown dataset {spec!r}: use synthetic:in=N,out=M[,shared=K]")
    values: dict[str, int] = {}
    for part in params.split(","):
        key, sep, value = part.partition("=")
        if not sep or key not in ("in", "out", "shared") or not value.isdigit():
            raise ValueError(f"bad dataset parameter {part!r} in {spec!r}")
        values[key] = int(value)
    if "in" not in values or "out" not in values or values["in"] < 1 or values["out"] < 1:
        raise ValueError("a synthetic dataset needs in=N and out=M (>= 1)")
    shared = values.get("shared", 0)
    if shared > values["in"]:
        raise ValueError("shared prefix longer than the input")
    block = 16
    prefix = None
    if shared:
        prefix = PrefixBlocks("tokens", block, tuple(range(1, shared // block + 1)))
    return [
        TraceRequest(t=0.0, n_in=values["in"], n_out=values["out"], prefix=prefix)
        for _ in range(count)
    ]


class Runner:
    def __init__(
        self,
        args: argparse.Namespace,
        model: str,
        criteria: Criteria,
        *,
        session: aiohttp.ClientSession | None = None,
        admin: SidecarAdmin | None = None,
        engine_urls: Sequence[str] = (),
    ) -> None:
        self.args = args
        self.model = model
        self.criteria = criteria
        self.session = session
        self.admin = admin
        self.engine_urls = list(engine_urls)
        self.engine_flavour: str | None = None  # "vllm", "sglang", ... once scraped
        # Rebuilt prompts' token ids: asked of the target's tokenizer at the first step.
        self.token_ids: TokenIds | None = None
        # One id per sweep: the experiment id of its llm-d reports, and (shortened) the start
        # of every request id it sends, so a sidecar's view can be selected step by step.
        self.sweep_id = uuid.uuid4().hex
        self.steps: list[dict[str, Any]] = []
        self.points: list[dict[str, Any]] = []
        # Per step (by stage): the reported run's requests and what was asked of them, for the
        # per-step llm-d reports.
        self.step_sent: dict[int, list[SentRequest]] = {}
        self.step_requests: dict[int, list[TraceRequest]] = {}
        self.step_duration = parse_duration(args.step_duration)
        self.trace: list[TraceRequest] | None = None
        if args.trace:
            lines = list(TraceReader(args.trace).numbered())
            # The lines replay skips (and `trace lint` reports as cannot-replay): a capture's
            # failed request of unknown prompt size is not a workload to repeat.
            sendable, skipped = replay_cli.split_replayable(
                lines, use_captured_body=not getattr(args, "no_captured_bodies", False)
            )
            if lines and not sendable:
                raise ValueError(
                    f"{args.trace}: none of its {len(lines)} request lines can "
                    f"be replayed: {replay_cli.skipped_examples(skipped)}"
                )
            if skipped:
                print(
                    f"sidecar sweep: {replay_cli.skipped_summary(skipped, len(lines), args.trace)}",
                    file=sys.stderr,
                )
            self.trace = sorted(sendable, key=lambda r: r.t)
            if not self.trace:
                raise ValueError(f"{args.trace}: no requests")

    def requests(self, count: int) -> list[TraceRequest]:
        if self.trace is None:
            return synthetic_requests(self.args.dataset, count)
        return [self.trace[i % len(self.trace)] for i in range(count)]

    async def run_step(self, load: float) -> tuple[StepVerdict, float, float | None]:
        mode = self.args.mode
        if mode == "open":
            count = max(self.args.min_requests, int(round(load * self.step_duration)))
        else:
            count = max(self.args.min_requests, int(load) * 4)
        # A step is a replay of its own (no trace file: the requests are given).
        options = ReplayOptions(
            trace="",
            target=self.args.target,
            seed=self.args.seed,
            request_timeout=float(self.args.request_timeout),
            quiet=bool(self.args.quiet),
            rate=float(load) if mode == "open" else None,
            burstiness=float(self.args.burstiness),
            max_concurrency=int(load) if mode != "open" else None,
        )
        stage = len(self.steps)
        requests = self.requests(count + self.args.warmup)
        if self.token_ids is None:
            self.token_ids = DEFAULT_TOKEN_IDS
            if self.session is not None and replay_load.needs_token_ids(requests, options):
                self.token_ids = await replay_cli.probe_token_ids(
                    self.session, self.args.target.rstrip("/"), self.model
                )
        plan = replay_load.plan(requests, options, self.model, None, self.token_ids)
        plan_mode = plan.mode
        warmup = replay_load.Plan(plan.requests[: self.args.warmup], "closed")
        measured = replay_load.Plan(plan.requests[self.args.warmup :], plan_mode)
        # Request ids "sweep-<id>-s<stage>-r<repeat>-<index>-<random>": the trailing "-" of a
        # run's selector keeps repeat 1 from also selecting repeat 10.
        id_prefix = f"sweep-{self.sweep_id[:8]}-s{stage}"
        if warmup.requests:
            await replay_load.run(
                warmup,
                options,
                concurrency=len(warmup.requests),
                workers=1,
                quiet=True,
                request_id_prefix=id_prefix + "-w",
            )
        engine_before = await self.scrape_engines()
        runs: list[tuple[dict[str, Any], list[SentRequest], dict[str, Any] | None]] = []
        unit = "req/s" if mode == "open" else "concurrent"
        for repeat in range(self.args.repeats):
            run_prefix = f"{id_prefix}-r{repeat}"
            label = f"step {stage + 1}: {load:g} {unit}"
            if self.args.repeats > 1:
                label += f", run {repeat + 1}/{self.args.repeats}"
            sent = await replay_load.run(
                measured, options, workers=1, label=label, request_id_prefix=run_prefix
            )
            # Read right after each run: the sidecar's window is time-based, and a later
            # repeat may be the reported one or not.
            view = await self.sidecar_view(run_prefix + "-", len(sent))
            runs.append(
                (run_report(sent, mode=plan_mode, slo_policy=self.criteria_policy()), sent, view)
            )
        engine_after = await self.scrape_engines()
        runs.sort(key=lambda r: r[0].get("median_e2el_ms") or float("inf"))
        report, sent, view = runs[(len(runs) - 1) // 2]
        ends = [s.end_ns / 1e9 for s in sent if s.record.ok]
        achieved = achieved_rate(ends)
        # The offered rate this step really had: a seeded Poisson schedule of a few dozen
        # requests can be 15% off its nominal rate, and keeping up is judged against what was
        # sent, not against the nominal number.
        scheduled = sorted(s.scheduled_ns / 1e9 for s in sent)
        realized = (
            (len(scheduled) - 1) / (scheduled[-1] - scheduled[0])
            if len(scheduled) > 1 and scheduled[-1] > scheduled[0]
            else load
        )
        offered = realized if mode == "open" else (achieved or 0.0)
        verdict = judge_step(report, offered, mode, self.criteria, achieved)
        self.steps.append(
            {
                "load": load,
                "stage": stage,
                "offered": offered,
                "nominal": load,
                "achieved_rate": achieved,
                "passed": verdict.passed,
                "reasons": list(verdict.reasons),
                "requests": len(sent),
                "report": report,
                "repeat_spread": _spread([r for r, _, _ in runs]),
                "sidecar": view,
                "engine_delta": replay_cli.engine_delta(engine_before, engine_after),
            }
        )
        self.step_sent[stage] = sent
        self.step_requests[stage] = requests[self.args.warmup :]
        for s in sent:
            offsets = s.record.client.offsets_ns
            e2e = offsets[-1] if offsets else None
            self.points.append(
                {
                    "load": load,
                    "sent_s": s.actual_ns / 1e9,
                    "e2e_ms": None if e2e is None else e2e / 1e6,
                }
            )
        if not self.args.quiet:
            print(step_line(self.result_frame(), self.steps[-1]), file=sys.stderr, flush=True)
            view = self.steps[-1]["sidecar"]
            if view is not None:
                p = f"p{self.criteria.percentile:g}"
                ttft = view["vantages"]["server"]["ttft_ms"].get(p)
                print(
                    f"  sidecar: server {p} TTFT {_ms(ttft)} ({view['requests_seen']}/"
                    f"{view['requests_sent']} requests seen)",
                    file=sys.stderr,
                    flush=True,
                )
        return verdict, offered, achieved

    def result_frame(self) -> dict[str, Any]:
        """What the tables need of the sweep besides its steps."""
        return {
            "mode": self.args.mode,
            "slo_criteria": criteria_detail(self.criteria),
            "unit": "req/s" if self.args.mode == "open" else "concurrent requests",
        }

    async def sidecar_view(self, selector: str, sent: int) -> dict[str, Any] | None:
        if self.admin is None:
            return None
        try:
            return await self.admin.view_of(selector, sent)
        except AdminError as exc:
            # The sweep itself does not depend on the sidecar: say so, and go on without.
            print(f"sidecar sweep: no sidecar view of this step: {exc}", file=sys.stderr)
            return None

    async def scrape_engines(self) -> dict[str, Any] | None:
        """The engines' counters summed over `engine_urls`; None unless every one answered
        (a sum over some replicas would be a wrong total, not a partial one)."""
        if self.session is None or not self.engine_urls:
            return None
        scraped = [await replay_cli.scrape_engine(self.session, url) for url in self.engine_urls]
        views = [view for view in scraped if view is not None]
        if len(views) < len(scraped):
            return None
        values: dict[str, float] = {}
        for view in views:
            for key, value in view["values"].items():
                values[key] = values.get(key, 0.0) + value
        self.engine_flavour = views[0]["flavour"]
        return {"flavour": self.engine_flavour, "values": values}

    def criteria_policy(self) -> SLOPolicy:
        return SLOPolicy({"default": self.criteria.slo()})


def _spread(reports: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    return {k: [r.get(k) for r in reports] for k, _unit, _better in STEP_METRICS}


def _ms(value: Any) -> str:
    return f"{value:.1f} ms" if isinstance(value, (int, float)) else "-"


def engine_sources(target: str, replicas: Mapping[str, Any] | None) -> tuple[list[str], str]:
    """Where the engines' /metrics are read, and how to say so in the envelope.

    Through a sidecar, the target's /metrics is passed through to one replica, whichever its
    routing picks: with several replicas the before and after scrapes could come from
    different engines. Each replica the sidecar lists is read instead, at its URL as the
    sidecar knows it (which must also reach it from here).
    """
    urls = [
        r["url"]
        for r in (replicas or {}).get("replicas", [])
        if isinstance(r, dict) and isinstance(r.get("url"), str)
    ]
    if len(urls) <= 1:
        return [target], "target /metrics"
    return urls, "each replica's /metrics (from the sidecar's /replicas)"


async def run(args: argparse.Namespace) -> int:
    try:
        return await _run(args)
    except (ValueError, ConfigError, OSError, AdminError, UsageError) as exc:
        print(f"sidecar sweep: {exc}", file=sys.stderr)
        return 2


async def _run(args: argparse.Namespace) -> int:
    criteria = parse_criteria(args.slo, args.slo_percentile, args.max_error_rate, args.keep_up)
    # Before the first step: a sweep of hours must not end in "No such file".
    replay_cli.check_writable(args.output_dir)
    target = replay_cli.checked_target(args.target)
    unit = "req/s" if args.mode == "open" else "concurrent requests"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        model = args.model or await replay_cli.first_model(session, target)
        if model is None:
            raise ValueError("no model: pass --model (the target's /v1/models was empty)")
        version = await replay_cli.engine_version(session, target)
        admin = replicas = None
        if args.sidecar_admin:
            admin = SidecarAdmin(args.sidecar_admin, session, args.admin_token)
            replicas = await admin.replicas()  # fails early on a wrong URL or token
        engine_urls, engine_from = engine_sources(target, replicas)
        runner = Runner(
            args, model, criteria, session=session, admin=admin, engine_urls=engine_urls
        )
        engine_before = await runner.scrape_engines()
        if args.auto:
            search = Search(args.start, args.mode, bisect_steps=args.bisect_steps)
            while (load := search.next_load()) is not None:
                verdict, offered, achieved = await runner.run_step(load)
                search.record(load, verdict, offered, achieved)
            capacity = search.capacity if search.passed else None
        else:
            loads = args.rates
            passed: list[float] = []
            for load in loads:
                verdict, offered, achieved = await runner.run_step(load)
                if verdict.passed:
                    passed.append(load)
                elif args.mode == "open" and achieved is not None and achieved < 0.5 * offered:
                    print(f"stopping: far past saturation at {load:g} {unit}", file=sys.stderr)
                    break
            failed_below = [s["load"] for s in runner.steps if not s["passed"]]
            capacity = max(
                (p for p in passed if not any(f <= p for f in failed_below)), default=None
            )
        engine_after = await runner.scrape_engines()
    steps = sorted(runner.steps, key=lambda s: s["load"])
    knee_load = knee(
        [s["load"] for s in steps], [s["report"].get("request_goodput") for s in steps]
    )
    requests = runner.requests(50)
    delta = replay_cli.engine_delta(engine_before, engine_after)
    result: dict[str, Any] = {
        "capacity": capacity,
        "unit": unit,
        "knee": knee_load,
        # No step failed above the capacity: the true capacity is this or more.
        "capacity_lower_bound": capacity is not None
        and not any(not s["passed"] and s["load"] > capacity for s in steps),
        "criteria": criteria.describe(),
        "slo_criteria": criteria_detail(criteria),
        "mode": args.mode,
        "steps": steps,
        "envelope": {
            "target": target,
            "model": model,
            "engine_version": version,
            "source": args.trace or args.dataset,
            "mode": args.mode,
            "loop": "open" if args.mode == "open" else "closed",
            "burstiness": args.burstiness if args.mode == "open" else None,
            "step_duration_s": runner.step_duration,
            "min_requests": args.min_requests,
            "warmup_per_step": args.warmup,
            "repeats": args.repeats,
            "input_tokens": replay_cli.lengths_summary([r.n_in for r in requests]),
            "output_tokens": replay_cli.lengths_summary([r.n_out for r in requests]),
            "streaming": True,
            "route_policy": replicas.get("route_policy") if replicas else None,
            "sidecar_replicas": len(replicas.get("replicas", [])) if replicas else None,
            "sidecar_admin": args.sidecar_admin,
            "engine_metrics_from": engine_from if engine_before is not None else None,
            "engine_prefix_cache_hit_rate": delta.get("prefix_cache_hit_rate"),
            "engine_delta": delta,
        },
        "definitions": {
            **DEFINITIONS,
            "capacity": "highest passing load with no failing "
            "load below it; a lower bound (capacity_lower_bound) when no load "
            "above it failed",
            "knee": "load of the highest goodput",
            "achieved_rate": "(completions - 1) / (last completion - first)",
            "offered": "open loop: (requests - 1) / (last scheduled send - "
            "first), the rate keep-up is judged against",
            "columns": {
                c.title: f"{c.definition} [{c.unit}]" if c.unit else c.definition
                for c in step_tables(
                    {
                        "mode": args.mode,
                        "unit": unit,
                        "steps": steps,
                        "slo_criteria": criteria_detail(criteria),
                    }
                ).definitions()
            },
            "sidecar": "the sidecar's own view of the step's reported run, from "
            "its /stats selected by request id: server vantage from the request "
            "sent upstream, client vantage from the request received by the proxy",
            "engine_prefix_cache_hit_rate": "prefix-cache hits / queries (tokens) "
            "over the sweep, from the engines' /metrics before and after",
            "step engine_delta": "the engines' counters over a step's measured "
            "runs (every repeat, warm-ups excluded)",
        },
    }
    # Files first: a closed stdout (`| head`) must not cost the sweep's results.
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(result, indent=2, default=str))
        with (out / "points.jsonl").open("w") as handle:
            for point in runner.points:
                handle.write(json.dumps(point) + "\n")
        write_llmd_reports(runner, result, out / "br")
        lower_bound = result["capacity_lower_bound"]
        images = [
            plots.plot_latency(steps, unit, out / "latency.png", capacity, lower_bound),
            plots.plot_throughput(
                steps, unit, out / "throughput.png", capacity, knee_load, lower_bound
            ),
            plots.plot_scatter(runner.points, out / "scatter.png"),
        ]
        plots.html_page(result, images, out / "sweep.html")
    print(console_report(result))
    if args.output_dir:
        print(f"report: {Path(args.output_dir) / 'sweep.html'}")
    return 0


def step_file_name(load: float) -> str:
    return f"step-{load:g}.json"


def write_llmd_reports(runner: Runner, result: Mapping[str, Any], directory: Path) -> None:
    """One llm-d benchmark report (v0.2) per load step: the step's reported run, as stage
    ``stage`` (the order steps ran in) of the experiment ``eid`` (the sweep)."""
    directory.mkdir(parents=True, exist_ok=True)
    envelope = result["envelope"]
    args = runner.args
    config = {
        k: v
        for k, v in envelope.items()
        if k not in replay_cli.MEASURED_ENVELOPE_KEYS
        and k not in ("engine_prefix_cache_hit_rate", "sidecar_admin")
    }
    config["criteria"] = result["criteria"]
    stack = [
        llmd.component(
            "target",
            (runner.engine_flavour or "unknown"),
            envelope.get("engine_version"),
            description="the server the sweep sent its load to",
            details={"url": envelope["target"], "model": envelope["model"]},
        )
    ]
    if envelope.get("route_policy") is not None:
        stack.append(
            llmd.component(
                "sidecar",
                llmd.TOOL,
                None,
                description="the measuring proxy (vllm-sidecar) the "
                "load went through; its view of each step is in results.observability",
                details={
                    "route_policy": envelope["route_policy"],
                    "replicas": envelope["sidecar_replicas"],
                },
            )
        )
    for step in result["steps"]:
        stage = step["stage"]
        requests = runner.step_requests[stage]
        prefix = requests[0].prefix if requests and runner.trace is None else None
        workload = llmd.Workload(
            input_lengths=[r.n_in for r in requests],
            output_lengths=[r.n_out for r in requests],
            sampled=replay_cli.uses_captured_bodies(requests, args),
            rate_qps=step["load"] if args.mode == "open" else None,
            concurrency=int(step["load"]) if args.mode == "closed" else None,
            stage=stage,
            shared_prefix_tokens=len(prefix.hashes) * prefix.size if prefix else 0,
            description=f"sidecar sweep step {stage}: {step['load']:g} {result['unit']} "
            f"({args.mode} loop)",
            args=llmd.native_args(vars(args)),
            config=config,
        )
        extension = {
            "sweep": {
                "load": step["load"],
                "unit": result["unit"],
                "stage": stage,
                "offered": step["offered"],
                "achieved_rate": step["achieved_rate"],
                "passed": step["passed"],
                "reasons": step["reasons"],
                "criteria": result["criteria"],
                "capacity": result["capacity"],
                "knee": result["knee"],
            },
            "sidecar": step.get("sidecar"),
            "engine_delta": step.get("engine_delta") or None,
        }
        report = llmd.benchmark_report(
            runner.step_sent[stage],
            duration_s=step["report"]["duration"],
            workload=workload,
            slo_policy=runner.criteria_policy(),
            stack=stack,
            extension=extension,
            eid=runner.sweep_id,
        )
        (directory / step_file_name(step["load"])).write_text(json.dumps(report, indent=2))
