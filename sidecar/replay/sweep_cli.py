"""``sidecar sweep``: replays at increasing load until the SLO breaks; capacity, curves, knee."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from sidecar.config import ConfigError
from sidecar.replay.options import SweepOptions, UsageError, admin_token_from_environment

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
        default=admin_token_from_environment(),
        help="bearer token of --sidecar-admin [SIDECAR_ADMIN_TOKEN]; prefer "
        "the variable, which other local users cannot see in the process list",
    )


async def run(args: argparse.Namespace) -> int:
    from sidecar.replay.admin import AdminError  # here, not at import: start-up time of the CLI

    try:
        return await _run(args)
    except (ValueError, ConfigError, OSError, AdminError, UsageError) as exc:
        print(f"sidecar sweep: {exc}", file=sys.stderr)
        return 2


async def _run(args: argparse.Namespace) -> int:
    # Here, not at import: start-up time of the CLI (aiohttp, numpy, ...).
    from sidecar.replay import sweep_session
    from sidecar.replay.sweep import console_report

    options = SweepOptions.from_args(args)
    # The llm-d reports' native arguments are the command line as parsed.
    result = await sweep_session.run_sweep(options, native_args=vars(args))
    # Files first: a closed stdout (`| head`) must not cost the sweep's results.
    if options.output_dir:
        sweep_session.write_outputs(result, options.output_dir)
    print(console_report(result.report))
    if options.output_dir:
        print(f"report: {Path(options.output_dir) / 'sweep.html'}")
    return 0
