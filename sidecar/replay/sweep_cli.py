"""``sidecar sweep``: replays at increasing load until the SLO breaks; capacity, curves, knee."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp

from sidecar.config import ConfigError, parse_duration
from sidecar.replay import plots, replay_cli
from sidecar.replay.report import DEFINITIONS, run_report
from sidecar.replay.runner import SentRequest
from sidecar.replay.sweep import Criteria, Search, StepVerdict, achieved_rate, judge_step, knee
from sidecar.stats import SLO, SLOPolicy
from sidecar.tracefile import PrefixBlocks, TraceReader, TraceRequest

DESCRIPTION = """\
Find the capacity of a target under a declared SLO: run replays at increasing offered load
(open-loop rates in req/s, or closed-loop concurrencies with --mode closed, a different
experiment), judge each step (the SLO at a percentile, an error bound, and the completion rate
keeping up with the offered rate), and report the capacity (the highest passing load), the knee
(the load of the highest goodput) and the curves, as a table, JSON, PNG plots and one HTML page.
"""

EPILOG = """\
examples:
  sidecar sweep --target http://127.0.0.1:8080 --dataset synthetic:in=512,out=128 \\
      --slo ttft=500ms,tpot=50ms --auto --output-dir sweep-out
  sidecar sweep --target http://127.0.0.1:8000 --trace capture.jsonl --slo ttft=1s \\
      --rates 2,4,8,16 --repeats 3
  sidecar sweep --target http://127.0.0.1:8000 --dataset synthetic:in=256,out=64 \\
      --mode closed --auto --slo e2e=5s
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="URL")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="requests (lengths, prefixes) from a trace file")
    source.add_argument("--dataset", metavar="SPEC",
                        help="synthetic:in=N,out=M[,shared=K] (K tokens of shared prefix)")
    parser.add_argument("--slo", required=True,
                        help="thresholds judged at --slo-percentile, e.g. ttft=500ms,tpot=50ms "
                        "(also itl=, e2el=)")
    parser.add_argument("--slo-percentile", type=float, default=90.0,
                        help="the percentile each threshold applies to [90]")
    parser.add_argument("--max-error-rate", type=float, default=0.01, help="[0.01]")
    parser.add_argument("--keep-up", type=float, default=0.9,
                        help="minimum completion rate / offered rate, open loop [0.9]")
    loads = parser.add_mutually_exclusive_group(required=True)
    loads.add_argument("--rates", help="explicit loads, e.g. 1,2,4,8 (req/s or concurrencies)")
    loads.add_argument("--auto", action="store_true",
                       help="double from --start until a step fails, then bisect")
    parser.add_argument("--start", type=float, default=1.0, help="first load of --auto [1]")
    parser.add_argument("--bisect-steps", type=int, default=3, help="[3]")
    parser.add_argument("--mode", choices=("open", "closed"), default="open", help="[open]")
    parser.add_argument("--step-duration", default="10s",
                        help="open loop: seconds of arrivals per step [10s]")
    parser.add_argument("--min-requests", type=int, default=20,
                        help="at least this many requests per step [20]")
    parser.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape [1: Poisson]")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests per step [2]")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per step; the median run counts [1]")
    parser.add_argument("--model", help="model to send [the target's first]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--output-dir", metavar="DIR",
                        help="sweep.json, plots (PNG) and sweep.html [no files]")


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
    return [TraceRequest(t=0.0, n_in=values["in"], n_out=values["out"], prefix=prefix)
            for _ in range(count)]


class Runner:
    def __init__(self, args: argparse.Namespace, model: str, criteria: Criteria) -> None:
        self.args = args
        self.model = model
        self.criteria = criteria
        self.steps: list[dict[str, Any]] = []
        self.points: list[dict[str, Any]] = []
        self.step_duration = parse_duration(args.step_duration)
        self.trace: list[TraceRequest] | None = None
        if args.trace:
            self.trace = sorted(TraceReader(args.trace).requests(), key=lambda r: r.t)
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
        parser = argparse.ArgumentParser()
        replay_cli.add_arguments(parser)
        argv = ["unused", "--target", self.args.target, "--seed", str(self.args.seed),
                "--no-progress", "--request-timeout", str(self.args.request_timeout)]
        if mode == "open":
            argv += ["--rate", str(load), "--burstiness", str(self.args.burstiness)]
        else:
            argv += ["--max-concurrency", str(int(load))]
        step_args = parser.parse_args(argv)
        requests = self.requests(count + self.args.warmup)
        plan, plan_mode = replay_cli.make_plan(requests, step_args, self.model, None)
        warmup, measured = plan[: self.args.warmup], plan[self.args.warmup:]
        if warmup:
            await replay_cli.execute(warmup, self.args.target, "closed", len(warmup), 1,
                                     step_args, quiet=True)
        runs: list[tuple[dict[str, Any], list[SentRequest]]] = []
        for _ in range(self.args.repeats):
            sent = await replay_cli.execute(measured, self.args.target, plan_mode,
                                            int(load) if mode == "closed" else None, 1,
                                            step_args, quiet=True)
            runs.append((run_report(sent, mode=plan_mode, slo_policy=self.criteria_policy()),
                         sent))
        runs.sort(key=lambda r: r[0].get("median_e2el_ms") or float("inf"))
        report, sent = runs[(len(runs) - 1) // 2]
        ends = [(s.actual_ns + (s.record.client.end_ns or 0)) / 1e9 for s in sent
                if s.record.ok]
        achieved = achieved_rate(ends)
        # The offered rate this step really had: a seeded Poisson schedule of a few dozen
        # requests can be 15% off its nominal rate, and keeping up is judged against what was
        # sent, not against the nominal number.
        scheduled = sorted(s.scheduled_ns / 1e9 for s in sent)
        realized = ((len(scheduled) - 1) / (scheduled[-1] - scheduled[0])
                    if len(scheduled) > 1 and scheduled[-1] > scheduled[0] else load)
        offered = realized if mode == "open" else (achieved or 0.0)
        verdict = judge_step(report, offered, mode, self.criteria, achieved)
        self.steps.append({"load": load, "offered": offered, "nominal": load,
                           "achieved_rate": achieved,
                           "passed": verdict.passed, "reasons": list(verdict.reasons),
                           "requests": len(sent), "report": report,
                           "repeat_spread": _spread([r for r, _ in runs])})
        for s in sent:
            e2e = s.record.client.marks[-1].offset_ns if s.record.client.marks else None
            self.points.append({"load": load, "sent_s": s.actual_ns / 1e9,
                                "e2e_ms": None if e2e is None else e2e / 1e6})
        status = "pass" if verdict.passed else "FAIL " + "; ".join(verdict.reasons)
        print(f"load {load:>8g}  achieved {achieved or 0:8.2f}/s  "
              f"p{self.criteria.percentile:g} ttft {report.get(_key(self.criteria, 'ttft'))}  "
              f"{status}", file=sys.stderr, flush=True)
        return verdict, offered, achieved

    def criteria_policy(self) -> SLOPolicy:
        ms = self.criteria.thresholds_ms

        def s(name: str) -> float | None:
            return ms[name] / 1000 if name in ms else None

        return SLOPolicy({"default": SLO(ttft_s=s("ttft"), tpot_s=s("tpot"), e2e_s=s("e2el"))})


def parse_thresholds(spec: str) -> dict[str, float]:
    """'ttft=500ms,tpot=50ms,itl=100ms,e2e=5s' -> milliseconds by report metric name."""
    out: dict[str, float] = {}
    for term in spec.split(","):
        name, sep, value = term.strip().partition("=")
        name = {"e2e": "e2el"}.get(name.strip().lower(), name.strip().lower())
        if not sep or name not in ("ttft", "tpot", "itl", "e2el"):
            raise ValueError(f"bad SLO term {term!r}: use ttft=, tpot=, itl= or e2e= durations")
        seconds = parse_duration(value)
        if seconds <= 0:
            raise ValueError(f"SLO {name} must be > 0")
        out[name] = seconds * 1000
    return out


def _key(criteria: Criteria, metric: str) -> str:
    return f"p{criteria.percentile:g}_{metric}_ms"


def _spread(reports: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    keys = ("request_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_e2el_ms")
    return {k: [r.get(k) for r in reports] for k in keys}


async def run(args: argparse.Namespace) -> int:
    try:
        return await _run(args)
    except (ValueError, ConfigError, OSError) as exc:
        print(f"sidecar sweep: {exc}", file=sys.stderr)
        return 2


async def _run(args: argparse.Namespace) -> int:
    thresholds = parse_thresholds(args.slo)
    criteria = Criteria(thresholds, args.slo_percentile, args.max_error_rate, args.keep_up)
    target = args.target.rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        model = args.model or await replay_cli.first_model(session, target)
        if model is None:
            raise ValueError("no model: pass --model (the target's /v1/models was empty)")
        version = await _version(session, target)
        engine_before = await replay_cli.scrape_engine(session, target)
    runner = Runner(args, model, criteria)
    unit = "req/s" if args.mode == "open" else "concurrent requests"
    if args.auto:
        search = Search(args.start, args.mode, bisect_steps=args.bisect_steps)
        while (load := search.next_load()) is not None:
            verdict, offered, achieved = await runner.run_step(load)
            search.record(load, verdict, offered, achieved)
        capacity = search.capacity if search.passed else None
    else:
        loads = sorted(float(x) for x in args.rates.split(","))
        passed: list[float] = []
        for load in loads:
            verdict, offered, achieved = await runner.run_step(load)
            if verdict.passed:
                passed.append(load)
            elif args.mode == "open" and achieved is not None and achieved < 0.5 * offered:
                print(f"stopping: far past saturation at {load:g} {unit}", file=sys.stderr)
                break
        failed_below = [s["load"] for s in runner.steps if not s["passed"]]
        capacity = max((p for p in passed if not any(f <= p for f in failed_below)),
                       default=None)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        engine_after = await replay_cli.scrape_engine(session, target)
    steps = sorted(runner.steps, key=lambda s: s["load"])
    knee_load = knee([s["load"] for s in steps],
                     [s["report"].get("request_goodput") for s in steps])
    requests = runner.requests(50)
    result: dict[str, Any] = {
        "capacity": capacity, "unit": unit, "knee": knee_load,
        "criteria": criteria.describe(), "mode": args.mode, "steps": steps,
        "envelope": {
            "target": target, "model": model, "engine_version": version,
            "source": args.trace or args.dataset, "mode": args.mode,
            "loop": "open" if args.mode == "open" else "closed",
            "burstiness": args.burstiness if args.mode == "open" else None,
            "step_duration_s": runner.step_duration, "min_requests": args.min_requests,
            "warmup_per_step": args.warmup, "repeats": args.repeats,
            "input_tokens": replay_cli.lengths_summary([r.n_in for r in requests]),
            "output_tokens": replay_cli.lengths_summary([r.n_out for r in requests]),
            "streaming": True, "engine_delta": replay_cli.engine_delta(engine_before, engine_after),
        },
        "definitions": {**DEFINITIONS, "capacity": "highest passing load with no failing "
                        "load below it", "knee": "load of the highest goodput",
                        "achieved_rate": "(completions - 1) / (last completion - first)"},
    }
    print(f"\ncapacity: {capacity} {unit} ({criteria.describe()}); knee at {knee_load}")
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(result, indent=2, default=str))
        with (out / "points.jsonl").open("w") as handle:
            for point in runner.points:
                handle.write(json.dumps(point) + "\n")
        images = [plots.plot_latency(steps, unit, out / "latency.png", capacity),
                  plots.plot_throughput(steps, unit, out / "throughput.png", capacity,
                                        knee_load),
                  plots.plot_scatter(runner.points, out / "scatter.png")]
        plots.html_page(result, images, out / "sweep.html")
        print(f"report: {out / 'sweep.html'}")
    return 0


async def _version(session: aiohttp.ClientSession, target: str) -> str | None:
    try:
        async with session.get(target + "/version") as response:
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    return body.get("version") if isinstance(body, dict) else None
