"""``sidecar demo``: simulated replicas, the proxy in front, open-loop load, a live table.

Everything runs in one process on ephemeral 127.0.0.1 ports, so it needs no GPU, no network
and no configuration. The load is open loop: requests leave on a Poisson schedule whatever the
replicas do, so a slow replica shows up as latency, not as a lower offered rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from sidecar.config import (
    ConfigError,
    ProxyConfig,
    build_config,
    parse_duration,
    parse_slo_spec,
)
from sidecar.realvllm import RealVLLMError, start_server
from sidecar.realvllm.server import free_port
from sidecar.record import RequestRecord, Vantage
from sidecar.replay.options import ReplayOptions
from sidecar.sim.config import SimConfig
from sidecar.sim.engine import EngineConfig
from sidecar.tracefile import TraceReader

# aiohttp, numpy (stats), the proxy (serve), the simulator's server and the replay's load are
# imported by the functions that use them: `sidecar --help` imports this module for its parser
# (start-up time of the CLI).
if TYPE_CHECKING:
    import aiohttp

    from sidecar import stats

DESCRIPTION = """\
Start simulated vLLM replicas, the measuring proxy in front of them, and an open-loop load
through the proxy; show live TTFT / ITL / TPOT / E2E percentiles per vantage (client vs
server) and outcomes, then a summary with goodput under the declared SLO. Ctrl-C ends early
and still prints the summary.
"""

EPILOG = """\
examples:
  sidecar demo
      20 s of 8 requests/s against 2 simulated replicas
  sidecar demo --rate 40 --duration 60s --replicas 4 --slo ttft=300ms,tpot=30ms
      heavier load: watch the server-side queueing show up in TTFT
  sidecar demo --real-vllm start
      the same against a real vLLM on this CPU (`sidecar vllm`, docs/real-vllm.md): installed
      the first time (a few minutes), started (about a minute), stopped at the end
  sidecar demo --real-vllm http://127.0.0.1:8000
      against a vLLM already running (its first served model, unless --model)
"""

WORDS = (
    "the",
    "model",
    "serves",
    "tokens",
    "under",
    "load",
    "while",
    "a",
    "sidecar",
    "measures",
    "every",
    "chunk",
    "on",
    "both",
    "sides",
)


class RecordList:
    """Keeps every record of the demo for the final summary (bounded by --max-requests)."""

    name = "demo-summary"

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def on_record(self, record: RequestRecord) -> None:
        self.records.append(record)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="simulated replicas [2]")
    parser.add_argument(
        "--rate", type=float, default=8.0, help="offered load, requests/s, Poisson arrivals [8]"
    )
    parser.add_argument("--duration", default="20s", help="how long to send load [20s]")
    parser.add_argument(
        "--max-requests",
        type=int,
        default=100_000,
        help="stop sending after this many requests [100000]",
    )
    parser.add_argument(
        "--slo",
        default="ttft=500ms,tpot=50ms,e2e=20s",
        help="SLOs for goodput [ttft=500ms,tpot=50ms,e2e=20s]",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the load [0]")
    parser.add_argument(
        "--model",
        default=None,
        help="served model name [demo-model; with --real-vllm, the server's]",
    )
    parser.add_argument(
        "--real-vllm",
        metavar="start|URL",
        help="measure a real vLLM instead of simulated replicas: 'start' brings "
        "one up on this CPU and stops it after; a URL uses one already running",
    )
    parser.add_argument(
        "--capture", metavar="DIR", help="keep the capture here [a temporary directory]"
    )
    parser.add_argument(
        "--no-replay", action="store_true", help="skip replaying the capture after the load"
    )


async def run(args: argparse.Namespace) -> int:
    try:
        duration = parse_duration(args.duration)
        slo_spec = parse_slo_spec(args.slo)
    except ConfigError as exc:
        print(f"sidecar demo: {exc}", file=sys.stderr)
        return 2
    if args.rate <= 0 or args.replicas < 1:
        print("sidecar demo: --rate must be > 0 and --replicas >= 1", file=sys.stderr)
        return 2
    from sidecar import stats  # here, not at import: start-up time of the CLI (numpy)

    slo = stats.SLO(**slo_spec.slo_arguments())
    out = sys.stdout
    async with contextlib.AsyncExitStack() as upstream:
        try:
            urls = await _upstreams(args, upstream, out)
        except (RealVLLMError, OSError, ValueError) as exc:
            print(f"sidecar demo: {exc}", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory(prefix="sidecar-demo-") as tmp:
            capture_dir = args.capture or tmp
            original, interrupted = await measured_load(urls, args, duration, slo, capture_dir, out)
            print_summary(original, slo, out)
            if not interrupted and not args.no_replay:
                replayed = await replay_capture(urls, args, capture_dir, out)
                if replayed is not None:
                    print_comparison(original, replayed, out)
    return 0


async def _upstreams(
    args: argparse.Namespace, stack: contextlib.AsyncExitStack, out: TextIO
) -> list[str]:
    """The replicas' base URLs: simulated ones (the default), or a real vLLM (started here, or
    given). Whatever is started is stopped when ``stack`` closes. Sets ``args.model``."""
    # Here, not at import: start-up time of the CLI (aiohttp).
    import aiohttp

    from sidecar.replay import target as replay_target
    from sidecar.sim.server import close_replicas, start_replicas

    if not args.real_vllm:
        args.model = args.model or "demo-model"
        replicas = await start_replicas(
            SimConfig(model=args.model, engine=EngineConfig()), args.replicas
        )
        stack.push_async_callback(close_replicas, replicas)
        return [r.url for r in replicas]
    if args.real_vllm == "start":
        print(
            "starting a real vLLM on this CPU (docs/real-vllm.md): about a minute, and a "
            "few more the first time, to install it ...",
            file=out,
            flush=True,
        )
        handle = await asyncio.to_thread(start_server, free_port())
        stack.callback(handle.stop)
        url = handle.url
        print(f"vLLM:     {url} (log {handle.log_path})", file=out, flush=True)
    elif args.real_vllm.startswith(("http://", "https://")):
        url = args.real_vllm.rstrip("/")
    else:
        raise ValueError(f"--real-vllm {args.real_vllm!r}: give 'start' or the server's URL")
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            model = args.model or await replay_target.first_model(session, url)
        except replay_target.TargetUnreachable as exc:
            raise ValueError(f"no vLLM: {exc}") from None
    if model is None:
        raise ValueError(f"{url}/v1/models lists no model: pass --model")
    args.model = model
    return [url]


def _proxy_config(
    upstreams: list[str], args: argparse.Namespace, capture_dir: str | None
) -> ProxyConfig:
    flags: dict[str, Any] = {
        "upstreams": upstreams,
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "window_s": "10s",
        "slo": args.slo,
    }
    if capture_dir is not None:
        flags["capture_dir"] = capture_dir
    return build_config(flags, {})


async def measured_load(
    upstreams: list[str],
    args: argparse.Namespace,
    duration: float,
    slo: stats.SLO,
    capture_dir: str,
    out: TextIO,
) -> tuple[list[RequestRecord], bool]:
    """The built-in load through a capturing proxy, with the live table. Returns the records
    and whether the user interrupted it."""
    # Here, not at import: start-up time of the CLI (aiohttp, numpy, ...).
    from sidecar.serve import build_proxy_server, wait_for_shutdown_signal

    server, window = build_proxy_server(_proxy_config(upstreams, args, capture_dir))
    everything = RecordList()
    server.proxy.fanout.add(everything)
    await server.start()
    print(f"replicas: {', '.join(upstreams)}", file=out)
    print(
        f"proxy:    {server.url}   live stats: {server.admin_url}/stats   "
        f"Prometheus: {server.admin_url}/metrics",
        file=out,
    )
    print(f"capture:  {capture_dir}", file=out)
    print(
        f"load:     open loop, Poisson, {args.rate:g} req/s for {duration:g} s; "
        f"SLO {slo.describe()}\n",
        file=out,
        flush=True,
    )
    started = time.monotonic()
    load = asyncio.create_task(send_load(server.url, args, duration))
    stop = asyncio.create_task(wait_for_shutdown_signal())
    table = asyncio.create_task(live_table(window, out, started))
    try:
        await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
        interrupted = stop.done()
    finally:
        for task in (load, stop, table):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await server.close()  # flushes the capture
    return everything.records, interrupted


async def replay_capture(
    upstreams: list[str], args: argparse.Namespace, capture_dir: str, out: TextIO
) -> list[RequestRecord] | None:
    """Replay the capture, open loop on its own arrival times, through a fresh proxy in front
    of the same replicas, so both runs are measured at the same place."""
    # Here, not at import: start-up time of the CLI (aiohttp, numpy, ...).
    import aiohttp

    from sidecar.replay import load as replay_load
    from sidecar.replay import target as replay_target
    from sidecar.serve import build_proxy_server

    files = sorted(Path(capture_dir).glob("capture-*.jsonl*"))
    if not files:
        print("\nno capture to replay", file=out)
        return None
    server, _window = build_proxy_server(_proxy_config(upstreams, args, None))
    everything = RecordList()
    server.proxy.fanout.add(everything)
    await server.start()
    try:
        options = ReplayOptions(
            trace=str(files[0]), target=server.url, repeats=1, quiet=True, seed=args.seed
        )
        requests = TraceReader(files[0]).requests()
        print(
            f"\nreplaying {len(requests)} captured requests from {files[0]} "
            "(open loop, their own arrival times) ...",
            file=out,
            flush=True,
        )
        async with aiohttp.ClientSession() as session:
            # Chat prompts are rebuilt as text: calibrate words to tokens on the target.
            calibration = await replay_target.calibrate(session, server.url, args.model)
            token_ids = await replay_target.probe_token_ids(session, server.url, args.model)
        plan = replay_load.plan(requests, options, args.model, calibration, token_ids)
        await replay_load.run(plan, options, quiet=True)
    finally:
        await server.close()
    return everything.records


def print_comparison(
    original: list[RequestRecord], replayed: list[RequestRecord], out: TextIO
) -> None:
    from sidecar import stats  # here, not at import: start-up time of the CLI (numpy)

    print("\ncaptured run vs its replay (both measured by the proxy, client vantage; ms)", file=out)
    print(f"{'':16}{'original':>22}{'replay':>22}", file=out)
    print(f"{'':16}{'p50':>11}{'p99':>11}{'p50':>11}{'p99':>11}", file=out)
    # Only the measured traffic: the replay's /tokenize calibration passes the proxy too.
    original = [r for r in original if r.endpoint in ("chat", "completions")]
    replayed = [r for r in replayed if r.endpoint in ("chat", "completions")]
    reports = [stats.vantage_report(records, Vantage.CLIENT) for records in (original, replayed)]
    for name in ("ttft", "itl", "tpot", "e2e"):
        cells = []
        for report in reports:
            summary = getattr(report, name)
            cells += [_ms(summary.p(50)), _ms(summary.p(99))]
        print(f"{name.upper():16}" + "".join(f"{c:>11}" for c in cells), file=out)
    totals: list[tuple[str, Callable[[list[RequestRecord]], int]]] = [
        ("requests ok", lambda rs: sum(r.ok for r in rs)),
        ("input tokens", lambda rs: sum(r.n_in or 0 for r in rs if r.ok)),
        ("output tokens", lambda rs: sum(r.n_out or 0 for r in rs if r.ok)),
    ]
    for label, pick in totals:
        print(f"{label:16}{pick(original):>22}{pick(replayed):>22}", file=out)
    out.flush()


async def send_load(url: str, args: argparse.Namespace, duration: float) -> None:
    import aiohttp  # here, not at import: start-up time of the CLI

    rng = random.Random(args.seed)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        in_flight: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        next_at = start
        sent = 0
        try:
            while sent < args.max_requests:
                next_at += rng.expovariate(args.rate)
                if next_at - start > duration:
                    break
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                task = asyncio.create_task(one_request(session, url, args.model, rng))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                sent += 1
            if in_flight:
                await asyncio.wait(in_flight)
        finally:
            for task in in_flight:
                task.cancel()


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, rng: random.Random
) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400)))
    body = {
        "model": model,
        "stream": True,
        "max_tokens": rng.randint(16, 256),
        "ignore_eos": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    import aiohttp  # here, not at import: start-up time of the CLI

    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            async for _ in response.content.iter_any():
                pass


def _ms(value: float | None) -> str:
    return "     -" if value is None else f"{value * 1000:6.1f}"


async def live_table(window: Any, out: TextIO, started: float) -> None:
    header = (
        f"{'t':>4} {'vantage':7} | {'TTFT p50':>8} {'p99':>6} | {'ITL p50':>7} {'p99':>6} |"
        f" {'TPOT p50':>8} {'p99':>6} | {'E2E p50':>7} {'p99':>7} | outcomes (last 10 s)"
    )
    print("t: seconds since the load began; TTFT, ITL, TPOT, E2E: milliseconds", file=out)
    print(header, file=out)
    print("-" * len(header), file=out, flush=True)
    while True:
        await asyncio.sleep(1.0)
        snap = window.snapshot()
        outcomes = " ".join(f"{k}={v}" for k, v in snap["outcomes"].items() if v)
        elapsed = time.monotonic() - started
        for vantage in ("client", "server"):
            v = snap["vantages"][vantage]
            print(
                f"{elapsed:4.0f} {vantage:7} | {_ms(v['ttft']['p50']):>8} "
                f"{_ms(v['ttft']['p99'])} | {_ms(v['itl']['p50']):>7} {_ms(v['itl']['p99'])} |"
                f" {_ms(v['tpot']['p50']):>8} {_ms(v['tpot']['p99'])} |"
                f" {_ms(v['e2e']['p50']):>7} {_ms(v['e2e']['p99']):>7} |"
                f" {outcomes if vantage == 'client' else ''}",
                file=out,
            )
        out.flush()


def print_summary(records: list[RequestRecord], slo: stats.SLO, out: TextIO) -> None:
    from sidecar import stats  # here, not at import: start-up time of the CLI (numpy)

    generation = [r for r in records if r.endpoint in ("chat", "completions")]
    interval = stats.measured_interval_s(generation)
    print(
        "\nsummary (all requests; times in ms; ITL sample = event, TTFT/TPOT/E2E sample = "
        "request; percentiles by linear interpolation)",
        file=out,
    )
    counts = stats.outcome_counts(generation)
    print("outcomes: " + ", ".join(f"{o.value}={n}" for o, n in counts.items()), file=out)
    for vantage in (Vantage.CLIENT, Vantage.SERVER):
        report = stats.vantage_report(generation, vantage)
        print(
            f"\n[{vantage.value}] {report.requests} successful requests, "
            f"{report.tpot_excluded} without TPOT (N_out <= 1)",
            file=out,
        )
        for name, summary in (
            ("TTFT", report.ttft),
            ("ITL", report.itl),
            ("TPOT", report.tpot),
            ("E2E", report.e2e),
        ):
            if summary.count == 0:
                print(f"  {name:5} no samples", file=out)
                continue
            print(
                f"  {name:5} n={summary.count:<6} mean={_ms(summary.mean)} "
                + " ".join(
                    f"{stats.percentile_name(q)}={_ms(v)}" for q, v in summary.percentiles.items()
                ),
                file=out,
            )
    ok = [r for r in generation if r.ok]
    relay = stats.relay_report_of(
        stats.columns_of(ok, Vantage.CLIENT), stats.columns_of(ok, Vantage.SERVER)
    )
    delay = relay.delay
    if delay.count and delay.mean is not None:
        us = {"mean": delay.mean} | {
            stats.percentile_name(q): v for q, v in delay.percentiles.items()
        }
        print(
            f"\n[the sidecar's own delay] per token event, upstream socket to client socket, "
            f"in µs, {relay.requests} streams: n={delay.count} "
            + " ".join(f"{name}={value * 1e6:.0f}" for name, value in us.items()),
            file=out,
        )
    t = stats.throughput(generation, interval)
    g = stats.goodput(generation, slo, interval)
    print(
        f"\nthroughput over {interval:.1f} s: {t.requests_per_s:.2f} req/s, output "
        f"{t.output_tokens_per_s:.0f} tok/s, input {t.input_tokens_per_s:.0f} tok/s",
        file=out,
    )
    attainment = "n/a" if g.attainment is None else f"{g.attainment:.1%}"
    print(
        f"goodput under SLO ({slo.describe()}, client vantage): {g.good_requests_per_s:.2f} "
        f"req/s; attainment {attainment} = {g.good_requests} good / {g.total_requests} "
        "requests (failures included)",
        file=out,
    )
    out.flush()
