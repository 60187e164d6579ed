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
import time
from typing import Any, TextIO

import aiohttp

from sidecar import stats
from sidecar.cli import build_proxy_server, wait_for_shutdown_signal
from sidecar.config import ConfigError, build_config, parse_duration, parse_slo
from sidecar.record import RequestRecord, Vantage
from sidecar.sim.engine import EngineConfig
from sidecar.sim.server import SimConfig, close_replicas, start_replicas

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
"""

WORDS = ("the", "model", "serves", "tokens", "under", "load", "while", "a", "sidecar",
         "measures", "every", "chunk", "on", "both", "sides")


class RecordList:
    """Keeps every record of the demo for the final summary (bounded by --max-requests)."""

    name = "demo-summary"

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def on_record(self, record: RequestRecord) -> None:
        self.records.append(record)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="simulated replicas [2]")
    parser.add_argument("--rate", type=float, default=8.0,
                        help="offered load, requests/s, Poisson arrivals [8]")
    parser.add_argument("--duration", default="20s", help="how long to send load [20s]")
    parser.add_argument("--max-requests", type=int, default=100_000,
                        help="stop sending after this many requests [100000]")
    parser.add_argument("--slo", default="ttft=500ms,tpot=50ms,e2e=20s",
                        help="SLOs for goodput [ttft=500ms,tpot=50ms,e2e=20s]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the load [0]")
    parser.add_argument("--model", default="demo-model", help="served model name [demo-model]")


async def run(args: argparse.Namespace) -> int:
    try:
        duration = parse_duration(args.duration)
        thresholds = parse_slo(args.slo)
    except ConfigError as exc:
        print(f"sidecar demo: {exc}", file=sys.stderr)
        return 2
    if args.rate <= 0 or args.replicas < 1:
        print("sidecar demo: --rate must be > 0 and --replicas >= 1", file=sys.stderr)
        return 2
    slo = stats.SLO(ttft_s=thresholds.get("ttft"), tpot_s=thresholds.get("tpot"),
                    e2e_s=thresholds.get("e2e"))
    replicas = await start_replicas(SimConfig(model=args.model, engine=EngineConfig()),
                                    args.replicas)
    config = build_config({"upstreams": [r.url for r in replicas], "listen": "127.0.0.1:0",
                           "metrics_listen": "127.0.0.1:0", "window_s": "10s",
                           "slo": args.slo}, {})
    server, window = build_proxy_server(config)
    everything = RecordList()
    server.proxy.fanout.add(everything)
    await server.start()
    out = sys.stdout
    print(f"replicas: {', '.join(r.url for r in replicas)}", file=out)
    print(f"proxy:    {server.url}   live stats: {server.admin_url}/stats   "
          f"Prometheus: {server.admin_url}/metrics", file=out)
    print(f"load:     open loop, Poisson, {args.rate:g} req/s for {duration:g} s; "
          f"SLO {slo.describe()}\n", file=out, flush=True)
    started = time.monotonic()
    load = asyncio.create_task(send_load(server.url, args, duration))
    stop = asyncio.create_task(wait_for_shutdown_signal())
    table = asyncio.create_task(live_table(window, out, started))
    try:
        await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (load, stop, table):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await server.close()
        await close_replicas(replicas)
    print_summary(everything.records, slo, out)
    return 0


async def send_load(url: str, args: argparse.Namespace, duration: float) -> None:
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


async def one_request(session: aiohttp.ClientSession, url: str, model: str,
                      rng: random.Random) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400)))
    body = {"model": model, "stream": True, "max_tokens": rng.randint(16, 256),
            "ignore_eos": True, "messages": [{"role": "user", "content": prompt}]}
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            async for _ in response.content.iter_any():
                pass


def _ms(value: float | None) -> str:
    return "     -" if value is None else f"{value * 1000:6.1f}"


async def live_table(window: Any, out: TextIO, started: float) -> None:
    header = (f"{'t':>4} {'vantage':7} | {'TTFT p50':>8} {'p99':>6} | {'ITL p50':>7} {'p99':>6} |"
              f" {'TPOT p50':>8} {'p99':>6} | {'E2E p50':>7} {'p99':>7} | outcomes (last 10 s)")
    print(header, file=out)
    print("-" * len(header), file=out, flush=True)
    while True:
        await asyncio.sleep(1.0)
        snap = window.snapshot()
        outcomes = " ".join(f"{k}={v}" for k, v in snap["outcomes"].items() if v)
        elapsed = time.monotonic() - started
        for vantage in ("client", "server"):
            v = snap["vantages"][vantage]
            print(f"{elapsed:4.0f} {vantage:7} | {_ms(v['ttft']['p50']):>8} "
                  f"{_ms(v['ttft']['p99'])} | {_ms(v['itl']['p50']):>7} {_ms(v['itl']['p99'])} |"
                  f" {_ms(v['tpot']['p50']):>8} {_ms(v['tpot']['p99'])} |"
                  f" {_ms(v['e2e']['p50']):>7} {_ms(v['e2e']['p99']):>7} |"
                  f" {outcomes if vantage == 'client' else ''}", file=out)
        out.flush()


def print_summary(records: list[RequestRecord], slo: stats.SLO, out: TextIO) -> None:
    generation = [r for r in records if r.endpoint in ("chat", "completions")]
    interval = stats.measured_interval_s(generation)
    print("\nsummary (all requests; times in ms; ITL sample = event, TTFT/TPOT/E2E sample = "
          "request; percentiles by linear interpolation)", file=out)
    counts = stats.outcome_counts(generation)
    print("outcomes: " + ", ".join(f"{o.value}={n}" for o, n in counts.items()), file=out)
    for vantage in (Vantage.CLIENT, Vantage.SERVER):
        report = stats.vantage_report(generation, vantage)
        print(f"\n[{vantage.value}] {report.requests} successful requests, "
              f"{report.tpot_excluded} without TPOT (N_out <= 1)", file=out)
        for name, summary in (("TTFT", report.ttft), ("ITL", report.itl),
                              ("TPOT", report.tpot), ("E2E", report.e2e)):
            if summary.count == 0:
                print(f"  {name:5} no samples", file=out)
                continue
            print(f"  {name:5} n={summary.count:<6} mean={_ms(summary.mean)} "
                  + " ".join(f"{stats.percentile_name(q)}={_ms(v)}"
                             for q, v in summary.percentiles.items()), file=out)
    t = stats.throughput(generation, interval)
    g = stats.goodput(generation, slo, interval)
    print(f"\nthroughput over {interval:.1f} s: {t.requests_per_s:.2f} req/s, output "
          f"{t.output_tokens_per_s:.0f} tok/s, input {t.input_tokens_per_s:.0f} tok/s", file=out)
    attainment = "n/a" if g.attainment is None else f"{g.attainment:.1%}"
    print(f"goodput under SLO ({slo.describe()}, client vantage): {g.good_requests_per_s:.2f} "
          f"req/s; attainment {attainment} = {g.good_requests} good / {g.total_requests} "
          "requests (failures included)", file=out)
    out.flush()
