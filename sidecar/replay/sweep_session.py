"""A whole sweep as library calls: replays at increasing load until the SLO breaks, judged
step by step (replay/sweep.py, the pure part), with the target's and the sidecar's views, and
the sweep's files. `sidecar sweep` is these calls with its command line parsed into a
`SweepOptions` and the report printed; a script calls them alike:

    result = await sweep_session.run_sweep(
        SweepOptions("http://127.0.0.1:8000", "ttft=500ms", dataset="synthetic:in=512,out=128",
                     rates=(2, 4, 8))
    )
    print(result.capacity, result.report["knee"])
    sweep_session.write_outputs(result, "sweep-out")  # sweep.json, plots, sweep.html, br/

Notices that the command prints on stderr (a line per finished step unless ``quiet``, trace
lines skipped, a step without the sidecar's view) go to ``notify``, which prints them on
stderr unless given.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from sidecar.config import parse_duration
from sidecar.replay import llmd, load, plots
from sidecar.replay.admin import AdminError, SidecarAdmin
from sidecar.replay.options import ReplayOptions, SweepOptions
from sidecar.replay.payload import DEFAULT_TOKEN_IDS, TokenIds
from sidecar.replay.report import DEFINITIONS, run_report
from sidecar.replay.runner import SentRequest
from sidecar.replay.session import (
    MEASURED_ENVELOPE_KEYS,
    Notify,
    check_writable,
    lengths_summary,
    print_on_stderr,
    skipped_examples,
    skipped_summary,
    split_replayable,
    uses_captured_bodies,
)
from sidecar.replay.sweep import (
    STEP_METRICS,
    Criteria,
    Search,
    StepVerdict,
    achieved_rate,
    criteria_detail,
    judge_step,
    knee,
    parse_criteria,
    step_line,
    step_tables,
)
from sidecar.replay.target import (
    checked_target,
    engine_delta,
    engine_version,
    first_model,
    probe_token_ids,
    scrape_engine,
)
from sidecar.stats import SLOPolicy
from sidecar.tracefile import PrefixBlocks, TraceReader, TraceRequest

# After a run, how long the sweep waits before it reads the sidecar's CPU: a worker's status,
# which carries its CPU, comes every 0.25 s (sidecar proxy's default).
CPU_SETTLE_S = 0.3


def synthetic_requests(spec: str, count: int) -> list[TraceRequest]:
    """``count`` requests of a synthetic dataset, "synthetic:in=N,out=M[,shared=K]" (K tokens
    of shared prefix)."""
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


def load_unit(mode: str) -> str:
    """How a load is counted in the report's text and tables."""
    return "req/s" if mode == "open" else "concurrent requests"


class SweepRunner:
    """Runs a sweep's load steps one by one and keeps what each measured: its step entry of
    sweep.json, its requests' points, and the reported run's requests for its llm-d report."""

    def __init__(
        self,
        options: SweepOptions,
        model: str,
        criteria: Criteria,
        *,
        session: aiohttp.ClientSession | None = None,
        admin: SidecarAdmin | None = None,
        engine_urls: Sequence[str] = (),
        notify: Notify = print_on_stderr,
    ) -> None:
        self.options = options
        self.model = model
        self.criteria = criteria
        self.session = session
        self.admin = admin
        self._cpu_unavailable = False
        self.engine_urls = list(engine_urls)
        self.notify = notify
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
        self.step_duration = parse_duration(options.step_duration)
        self.trace: list[TraceRequest] | None = None
        if options.trace:
            lines = list(TraceReader(options.trace).numbered())
            # The lines replay skips (and `trace lint` reports as cannot-replay): a capture's
            # failed request of unknown prompt size is not a workload to repeat.
            sendable, skipped = split_replayable(lines, use_captured_body=True)
            if lines and not sendable:
                raise ValueError(
                    f"{options.trace}: none of its {len(lines)} request lines can "
                    f"be replayed: {skipped_examples(skipped)}"
                )
            if skipped:
                notify(f"sidecar sweep: {skipped_summary(skipped, len(lines), options.trace)}")
            self.trace = sorted(sendable, key=lambda r: r.t)
            if not self.trace:
                raise ValueError(f"{options.trace}: no requests")

    def requests(self, count: int) -> list[TraceRequest]:
        if self.trace is None:
            assert self.options.dataset is not None  # SweepOptions holds one of the two
            return synthetic_requests(self.options.dataset, count)
        return [self.trace[i % len(self.trace)] for i in range(count)]

    async def run_step(self, step_load: float) -> tuple[StepVerdict, float, float | None]:
        """Run one load step (its warm-up, then its repeats), judge it and keep it: the
        verdict, the offered rate it really had and the completion rate it achieved."""
        options = self.options
        mode = options.mode
        count, replay_options = self._step_replay(step_load)
        stage = len(self.steps)
        requests = self.requests(count + options.warmup)
        token_ids = await self._token_ids(requests, replay_options)
        plan = load.plan(requests, replay_options, self.model, None, token_ids)
        plan_mode = plan.mode
        warmup = load.Plan(plan.requests[: options.warmup], "closed")
        measured = load.Plan(plan.requests[options.warmup :], plan_mode)
        # Request ids "sweep-<id>-s<stage>-r<repeat>-<index>-<random>": the trailing "-" of a
        # run's selector keeps repeat 1 from also selecting repeat 10.
        id_prefix = f"sweep-{self.sweep_id[:8]}-s{stage}"
        if warmup.requests:
            await load.run(
                warmup,
                replay_options,
                concurrency=len(warmup.requests),
                workers=1,
                quiet=True,
                request_id_prefix=id_prefix + "-w",
            )
        engine_before = await self.scrape_engines()
        runs = await self._measure(step_load, stage, measured, replay_options, id_prefix)
        engine_after = await self.scrape_engines()
        runs.sort(key=lambda r: r[0].get("median_e2el_ms") or float("inf"))
        report, sent, view = runs[(len(runs) - 1) // 2]
        ends = [s.end_ns / 1e9 for s in sent if s.record.ok]
        achieved = achieved_rate(ends)
        offered = _realized_rate(sent, step_load) if mode == "open" else (achieved or 0.0)
        verdict = judge_step(report, offered, mode, self.criteria, achieved)
        self.steps.append(
            {
                "load": step_load,
                "stage": stage,
                "offered": offered,
                "nominal": step_load,
                "achieved_rate": achieved,
                "passed": verdict.passed,
                "reasons": list(verdict.reasons),
                "requests": len(sent),
                "report": report,
                "repeat_spread": _spread([r for r, _, _ in runs]),
                "sidecar": view,
                "engine_delta": engine_delta(engine_before, engine_after),
            }
        )
        self.step_sent[stage] = sent
        self.step_requests[stage] = requests[options.warmup :]
        self.points += _points(step_load, sent)
        if not options.quiet:
            self._say_step()
        return verdict, offered, achieved

    async def _token_ids(
        self, requests: Sequence[TraceRequest], replay_options: ReplayOptions
    ) -> TokenIds:
        """The token ids rebuilt prompts use, asked of the target once (at the first step)."""
        if self.token_ids is None:
            self.token_ids = DEFAULT_TOKEN_IDS
            if self.session is not None and load.needs_token_ids(requests, replay_options):
                self.token_ids = await probe_token_ids(
                    self.session, self.options.target.rstrip("/"), self.model
                )
        return self.token_ids

    def _step_replay(self, step_load: float) -> tuple[int, ReplayOptions]:
        """How many requests a step measures, and the replay it is (no trace file: the
        requests are given)."""
        options = self.options
        mode = options.mode
        if mode == "open":
            count = max(options.min_requests, int(round(step_load * self.step_duration)))
        else:
            count = max(options.min_requests, int(step_load) * 4)
        replay_options = ReplayOptions(
            trace="",
            target=options.target,
            seed=options.seed,
            request_timeout=float(options.request_timeout),
            quiet=bool(options.quiet),
            rate=float(step_load) if mode == "open" else None,
            burstiness=float(options.burstiness),
            max_concurrency=int(step_load) if mode != "open" else None,
        )
        return count, replay_options

    async def _measure(
        self,
        step_load: float,
        stage: int,
        measured: load.Plan,
        replay_options: ReplayOptions,
        id_prefix: str,
    ) -> list[tuple[dict[str, Any], list[SentRequest], dict[str, Any] | None]]:
        """A step's repeats: each run's report, requests and the sidecar's view of it."""
        options = self.options
        mode = options.mode
        plan_mode = measured.mode
        runs: list[tuple[dict[str, Any], list[SentRequest], dict[str, Any] | None]] = []
        unit = "req/s" if mode == "open" else "concurrent"
        for repeat in range(options.repeats):
            run_prefix = f"{id_prefix}-r{repeat}"
            label = f"step {stage + 1}: {step_load:g} {unit}"
            if options.repeats > 1:
                label += f", run {repeat + 1}/{options.repeats}"
            cpu_before = await self.sidecar_cpu()
            sent = await load.run(
                measured, replay_options, workers=1, label=label, request_id_prefix=run_prefix
            )
            cpu_after = None
            if cpu_before is not None:
                # Each worker reports its CPU with its status (every 0.25 s by default): a
                # moment more, and the run's last work is in it. Read before the view's /stats
                # polls below, which are the sweep's cost, not the traffic's.
                await asyncio.sleep(CPU_SETTLE_S)
                cpu_after = await self.sidecar_cpu()
            # Read right after each run: the sidecar's window is time-based, and a later
            # repeat may be the reported one or not.
            view = await self.sidecar_view(run_prefix + "-", len(sent))
            if view is not None:
                view["cpu"] = (
                    None
                    if cpu_before is None or cpu_after is None or not sent
                    else {
                        "seconds": cpu_after - cpu_before,
                        "per_request_ms": (cpu_after - cpu_before) / len(sent) * 1000.0,
                    }
                )
            runs.append(
                (run_report(sent, mode=plan_mode, slo_policy=self.criteria_policy()), sent, view)
            )
        return runs

    def _say_step(self) -> None:
        """The last step's line on stderr, and the sidecar's view of it where there is one."""
        self.notify(step_line(self.result_frame(), self.steps[-1]))
        view = self.steps[-1]["sidecar"]
        if view is not None:
            p = f"p{self.criteria.percentile:g}"
            ttft = view["vantages"]["server"]["ttft_ms"].get(p)
            self.notify(
                f"  sidecar: server {p} TTFT {_ms(ttft)} ({view['requests_seen']}/"
                f"{view['requests_sent']} requests seen)"
            )

    def result_frame(self) -> dict[str, Any]:
        """What the tables need of the sweep besides its steps."""
        return {
            "mode": self.options.mode,
            "slo_criteria": criteria_detail(self.criteria),
            "unit": load_unit(self.options.mode),
        }

    async def sidecar_view(self, selector: str, sent: int) -> dict[str, Any] | None:
        if self.admin is None:
            return None
        try:
            return await self.admin.view_of(selector, sent)
        except AdminError as exc:
            # The sweep itself does not depend on the sidecar: say so, and go on without.
            self.notify(f"sidecar sweep: no sidecar view of this step: {exc}")
            return None

    async def sidecar_cpu(self) -> float | None:
        """The sidecar's CPU so far (seconds, all its processes), or None without an admin
        listener or a figure (said once)."""
        if self.admin is None or self._cpu_unavailable:
            return None
        try:
            return await self.admin.cpu_seconds()
        except AdminError as exc:
            self._cpu_unavailable = True
            self.notify(f"sidecar sweep: no sidecar CPU per step: {exc}")
            return None

    async def scrape_engines(self) -> dict[str, Any] | None:
        """The engines' counters summed over `engine_urls`; None unless every one answered
        (a sum over some replicas would be a wrong total, not a partial one)."""
        if self.session is None or not self.engine_urls:
            return None
        scraped = [await scrape_engine(self.session, url) for url in self.engine_urls]
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


def _realized_rate(sent: Sequence[SentRequest], nominal: float) -> float:
    """The offered rate a step really had: a seeded Poisson schedule of a few dozen requests
    can be 15% off its nominal rate, and keeping up is judged against what was sent, not
    against the nominal number."""
    scheduled = sorted(s.scheduled_ns / 1e9 for s in sent)
    if len(scheduled) > 1 and scheduled[-1] > scheduled[0]:
        return (len(scheduled) - 1) / (scheduled[-1] - scheduled[0])
    return nominal


def _points(step_load: float, sent: Sequence[SentRequest]) -> list[dict[str, Any]]:
    """One point per measured request: its step's load, when it was sent, its E2E (ms)."""
    points = []
    for s in sent:
        offsets = s.record.client.offsets_ns
        e2e = offsets[-1] if offsets else None
        points.append(
            {
                "load": step_load,
                "sent_s": s.actual_ns / 1e9,
                "e2e_ms": None if e2e is None else e2e / 1e6,
            }
        )
    return points


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


@dataclass
class SweepResult:
    """What a sweep found: ``report`` is sweep.json (capacity, knee, every step with its
    verdict and run report, the envelope, the definitions); ``runner`` holds the steps' requests
    (points, the reported runs) for the files."""

    report: dict[str, Any]
    runner: SweepRunner
    native_args: Mapping[str, Any]  # the arguments as given, for the llm-d reports

    @property
    def capacity(self) -> float | None:
        """The highest passing load with no failing load below it; None when none passed."""
        capacity: float | None = self.report["capacity"]
        return capacity

    @property
    def points(self) -> list[dict[str, Any]]:
        """One per measured request: its step's load, when it was sent, its E2E (ms)."""
        return self.runner.points


def _plain_args(options: SweepOptions) -> dict[str, Any]:
    # As the command line has them: the loads as a list.
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(options).items()}


async def _run_steps(runner: SweepRunner, options: SweepOptions, notify: Notify) -> float | None:
    """The steps run (``auto``: double, then bisect; else ``rates`` in order, stopping far
    past saturation): the capacity found, None when no step passed."""
    unit = load_unit(options.mode)
    if options.auto:
        search = Search(options.start, options.mode, bisect_steps=options.bisect_steps)
        while (step_load := search.next_load()) is not None:
            verdict, offered, achieved = await runner.run_step(step_load)
            search.record(step_load, verdict, offered, achieved)
        capacity = search.capacity if search.passed else None
    else:
        passed: list[float] = []
        for step_load in options.rates or ():
            verdict, offered, achieved = await runner.run_step(step_load)
            if verdict.passed:
                passed.append(step_load)
            elif options.mode == "open" and achieved is not None and achieved < 0.5 * offered:
                notify(f"stopping: far past saturation at {step_load:g} {unit}")
                break
        failed_below = [s["load"] for s in runner.steps if not s["passed"]]
        capacity = max((p for p in passed if not any(f <= p for f in failed_below)), default=None)
    return capacity


def _envelope(
    options: SweepOptions, runner: SweepRunner, replicas: dict[str, Any] | None
) -> dict[str, Any]:
    """The envelope's members on the load and the sidecar (after the target's)."""
    requests = runner.requests(50)
    return {
        "source": options.trace or options.dataset,
        "mode": options.mode,
        "loop": "open" if options.mode == "open" else "closed",
        "burstiness": options.burstiness if options.mode == "open" else None,
        "step_duration_s": runner.step_duration,
        "min_requests": options.min_requests,
        "warmup_per_step": options.warmup,
        "repeats": options.repeats,
        "input_tokens": lengths_summary([r.n_in for r in requests]),
        "output_tokens": lengths_summary([r.n_out for r in requests]),
        "streaming": True,
        "route_policy": replicas.get("route_policy") if replicas else None,
        "sidecar_replicas": len(replicas.get("replicas", [])) if replicas else None,
        "sidecar_admin": options.sidecar_admin,
    }


def _definitions(
    mode: str, unit: str, steps: list[dict[str, Any]], criteria: Criteria
) -> dict[str, Any]:
    """sweep.json's definitions: the shared ones, the sweep's own, and every column's."""
    return {
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
                    "mode": mode,
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
    }


def _sweep_report(
    mode: str,
    criteria: Criteria,
    capacity: float | None,
    steps: list[dict[str, Any]],
    envelope: dict[str, Any],
) -> dict[str, Any]:
    """sweep.json: the capacity and knee found, the criteria, every step (by load), the
    envelope and the definitions."""
    unit = load_unit(mode)
    steps = sorted(steps, key=lambda s: s["load"])
    knee_load = knee(
        [s["load"] for s in steps], [s["report"].get("request_goodput") for s in steps]
    )
    return {
        "capacity": capacity,
        "unit": unit,
        "knee": knee_load,
        # No step failed above the capacity: the true capacity is this or more.
        "capacity_lower_bound": capacity is not None
        and not any(not s["passed"] and s["load"] > capacity for s in steps),
        "criteria": criteria.describe(),
        "slo_criteria": criteria_detail(criteria),
        "mode": mode,
        "steps": steps,
        "envelope": envelope,
        "definitions": _definitions(mode, unit, steps, criteria),
    }


async def run_sweep(
    options: SweepOptions,
    *,
    notify: Notify = print_on_stderr,
    native_args: Mapping[str, Any] | None = None,
) -> SweepResult:
    """Run the sweep's steps (``rates`` in order, stopping far past saturation; or ``auto``:
    double, then bisect) and build its report. Raises ValueError, ConfigError, OSError,
    AdminError or UsageError naming what is wrong. ``native_args``: the arguments as the tool
    was given them, for the llm-d reports [the options']."""
    criteria = parse_criteria(
        options.slo, options.slo_percentile, options.max_error_rate, options.keep_up
    )
    # Before the first step: a sweep of hours must not end in "No such file".
    check_writable(options.output_dir)
    target = checked_target(options.target)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        model = options.model or await first_model(session, target)
        if model is None:
            raise ValueError("no model: pass --model (the target's /v1/models was empty)")
        version = await engine_version(session, target)
        admin = replicas = None
        if options.sidecar_admin:
            admin = SidecarAdmin(options.sidecar_admin, session, options.admin_token)
            replicas = await admin.replicas()  # fails early on a wrong URL or token
        engine_urls, engine_from = engine_sources(target, replicas)
        runner = SweepRunner(
            options,
            model,
            criteria,
            session=session,
            admin=admin,
            engine_urls=engine_urls,
            notify=notify,
        )
        engine_before = await runner.scrape_engines()
        capacity = await _run_steps(runner, options, notify)
        engine_after = await runner.scrape_engines()
    delta = engine_delta(engine_before, engine_after)
    envelope = {
        "target": target,
        "model": model,
        "engine_version": version,
        **_envelope(options, runner, replicas),
        "engine_metrics_from": engine_from if engine_before is not None else None,
        "engine_prefix_cache_hit_rate": delta.get("prefix_cache_hit_rate"),
        "engine_delta": delta,
    }
    result = _sweep_report(options.mode, criteria, capacity, runner.steps, envelope)
    given = _plain_args(options) if native_args is None else native_args
    return SweepResult(result, runner, given)


# -- the files --------------------------------------------------------------------------------


def write_outputs(result: SweepResult, directory: str | Path) -> None:
    """sweep.json, points.jsonl, br/step-<load>.json (one llm-d report per step), the plots
    (latency.png, throughput.png, scatter.png) and sweep.html, in ``directory``."""
    report, runner = result.report, result.runner
    steps, unit, capacity = report["steps"], report["unit"], report["capacity"]
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(report, indent=2, default=str))
    with (out / "points.jsonl").open("w") as handle:
        for point in runner.points:
            handle.write(json.dumps(point) + "\n")
    write_llmd_reports(result, out / "br")
    lower_bound = report["capacity_lower_bound"]
    images = [
        plots.plot_latency(steps, unit, out / "latency.png", capacity, lower_bound),
        plots.plot_throughput(
            steps, unit, out / "throughput.png", capacity, report["knee"], lower_bound
        ),
        plots.plot_scatter(runner.points, out / "scatter.png"),
    ]
    plots.html_page(report, images, out / "sweep.html")


def step_file_name(step_load: float) -> str:
    return f"step-{step_load:g}.json"


def _llmd_stack(runner: SweepRunner, envelope: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The llm-d reports' stack: the target, and the sidecar where the load went through
    one."""
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
    return stack


def _llmd_extension(step: Mapping[str, Any], report: Mapping[str, Any]) -> dict[str, Any]:
    """A step's members of the llm-d report's sidecar extension: its verdict, the sweep's
    result, the sidecar's view and the engines' counters."""
    return {
        "sweep": {
            "load": step["load"],
            "unit": report["unit"],
            "stage": step["stage"],
            "offered": step["offered"],
            "achieved_rate": step["achieved_rate"],
            "passed": step["passed"],
            "reasons": step["reasons"],
            "criteria": report["criteria"],
            "capacity": report["capacity"],
            "knee": report["knee"],
        },
        "sidecar": step.get("sidecar"),
        "engine_delta": step.get("engine_delta") or None,
    }


def write_llmd_reports(result: SweepResult, directory: Path) -> None:
    """One llm-d benchmark report (v0.2) per load step: the step's reported run, as stage
    ``stage`` (the order steps ran in) of the experiment ``eid`` (the sweep)."""
    directory.mkdir(parents=True, exist_ok=True)
    report, runner = result.report, result.runner
    options = runner.options
    envelope = report["envelope"]
    config = {
        k: v
        for k, v in envelope.items()
        if k not in MEASURED_ENVELOPE_KEYS
        and k not in ("engine_prefix_cache_hit_rate", "sidecar_admin")
    }
    config["criteria"] = report["criteria"]
    stack = _llmd_stack(runner, envelope)
    for step in report["steps"]:
        stage = step["stage"]
        requests = runner.step_requests[stage]
        prefix = requests[0].prefix if requests and runner.trace is None else None
        workload = llmd.Workload(
            input_lengths=[r.n_in for r in requests],
            output_lengths=[r.n_out for r in requests],
            sampled=uses_captured_bodies(requests, no_captured_bodies=False),
            rate_qps=step["load"] if options.mode == "open" else None,
            concurrency=int(step["load"]) if options.mode == "closed" else None,
            stage=stage,
            shared_prefix_tokens=len(prefix.hashes) * prefix.size if prefix else 0,
            description=f"sidecar sweep step {stage}: {step['load']:g} {report['unit']} "
            f"({options.mode} loop)",
            args=llmd.native_args(result.native_args),
            config=config,
        )
        extension = _llmd_extension(step, report)
        br = llmd.benchmark_report(
            runner.step_sent[stage],
            duration_s=step["report"]["duration"],
            workload=workload,
            slo_policy=runner.criteria_policy(),
            stack=stack,
            extension=extension,
            eid=runner.sweep_id,
        )
        (directory / step_file_name(step["load"])).write_text(json.dumps(br, indent=2))
