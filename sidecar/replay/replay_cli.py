"""``sidecar replay``: send a trace (or a synthetic arrival process) to a target and report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sidecar.replay.options import DEFAULT_MAX_LATENESS_MS, ReplayOptions, UsageError
from sidecar.replay.payload import PayloadError
from sidecar.tracefile import TraceFormatError

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


async def run(args: argparse.Namespace) -> int:
    try:
        return await _run(args)
    except (UsageError, TraceFormatError, PayloadError, ValueError) as exc:
        print(f"sidecar replay: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # sender workers that did not start or failed: ran, failed
        print(f"sidecar replay: {exc}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace) -> int:
    # Here, not at import: start-up time of the CLI (aiohttp, numpy, rich, ...).
    from sidecar.replay import session
    from sidecar.replay.report import console_table

    options = ReplayOptions.from_namespace(args)
    # The llm-d report's native arguments are the command line as parsed.
    prepared = await session.prepare(options, native_args=vars(args))
    # The report is written and printed before the live /metrics listener lingers.
    async with session.live_metrics(prepared) as counters:
        result = await session.send(prepared, counters=counters)
        # Files first: a closed stdout (`| head`) must not cost the run's results.
        session.write_outputs(result)
        print(console_table(result.report))
        if options.output_dir:
            print(f"report: {Path(options.output_dir) / 'report.json'}")
        failure = result.failure()
        if failure is not None:
            print(f"sidecar replay: no request succeeded ({failure})", file=sys.stderr)
            return 1
        return 0
