"""How many SSE chunks per second one simulator process emits, and what each costs it in CPU.

The simulator runs as its own process (the real ``sidecar sim`` CLI); this script is the client,
in another process, so the client's parsing is not charged to the simulator. It keeps
``--concurrency`` streams open (each ``--max-tokens`` tokens, ignore_eos, one token per chunk)
for ``--duration`` seconds after a warm-up, counts every data event it receives, and reads the
simulator's CPU time from /proc before and after. Reported:

- chunks/s received (wall clock): throughput, bounded by whichever process saturates first;
- simulator CPU seconds per chunk (user+sys): the simulator's own cost, the figure that says
  whether it can be the bottleneck of a benchmark.

Run: ``python benchmarks/sim_throughput.py --concurrency 256 --duration 10``
(``--smoke``: 8 streams of 20 tokens for 0.5 s, for CI: the harness runs, no timing claims).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from dataclasses import dataclass

import aiohttp


@dataclass
class Counts:
    chunks: int = 0
    requests: int = 0
    errors: int = 0


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process, from /proc/PID/stat (Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


async def one_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, object], counts: Counts
) -> None:
    async with session.post(url, json=body) as response:
        if response.status != 200:
            counts.errors += 1
            await response.read()
            return
        tail = b""
        chunks = 0
        async for data in response.content.iter_any():
            # Count event terminators; a terminator split across reads is caught by the tail.
            joined = tail + data
            chunks += joined.count(b"\n\n") - tail.count(b"\n\n")
            tail = joined[-1:]
        counts.chunks += chunks
        counts.requests += 1


async def worker(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, object],
    counts: Counts,
    stop_at: float,
) -> None:
    while time.perf_counter() < stop_at:
        try:
            await one_stream(session, url, body, counts)
        except aiohttp.ClientError:
            counts.errors += 1


async def start_sim(args: argparse.Namespace) -> tuple[asyncio.subprocess.Process, str]:
    command = [
        sys.executable,
        "-m",
        "sidecar",
        "sim",
        "--port",
        "0",
        "--model",
        "bench",
        "--step-floor-s",
        str(args.step_floor_s),
        "--max-num-seqs",
        str(max(256, args.concurrency)),
        *args.sim_args,
    ]
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()
    return process, line.rsplit(" ", 1)[1]


async def measure(args: argparse.Namespace) -> None:
    process, base_url = await start_sim(args)
    url = base_url + "/v1/completions"
    body: dict[str, object] = {
        "model": "bench",
        "prompt": "benchmark prompt",
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    connector = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            warm = Counts()
            warm_until = time.perf_counter() + args.warmup
            await asyncio.gather(
                *(worker(session, url, body, warm, warm_until) for _ in range(args.concurrency))
            )
            counts = Counts()
            cpu_before = cpu_seconds(process.pid)
            started = time.perf_counter()
            stop_at = started + args.duration
            await asyncio.gather(
                *(worker(session, url, body, counts, stop_at) for _ in range(args.concurrency))
            )
            elapsed = time.perf_counter() - started
            sim_cpu = cpu_seconds(process.pid) - cpu_before
    finally:
        process.terminate()
        await process.wait()
    # Each stream is max_tokens token chunks + [DONE].
    token_chunks = counts.chunks - counts.requests
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"python {platform.python_version()}, aiohttp {aiohttp.__version__}, {platform.platform()}"
    )
    print(f"cpus: {os.cpu_count()}  concurrency: {args.concurrency}  max_tokens: {args.max_tokens}")
    print(f"step_floor_s: {args.step_floor_s}  sim args: {' '.join(args.sim_args) or '-'}")
    print(f"requests: {counts.requests}  errors: {counts.errors}  elapsed: {elapsed:.2f} s")
    print(f"chunks: {counts.chunks} ({token_chunks} token chunks)")
    print(f"chunks/s (wall): {counts.chunks / elapsed:,.0f}")
    print(f"sim CPU: {sim_cpu:.2f} s = {100 * sim_cpu / elapsed:.0f}% of one core")
    if counts.chunks:
        print(f"sim CPU per chunk: {1e6 * sim_cpu / counts.chunks:.1f} us")
        print(f"chunks per sim CPU-second: {counts.chunks / sim_cpu:,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--step-floor-s", type=float, default=0.001)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke run: 8 streams, 20 tokens, 0.2 s warm-up, 0.5 s measured",
    )
    parser.add_argument(
        "sim_args", nargs="*", help="extra `sidecar sim` flags (after --), e.g. -- --ground-truth f"
    )
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.max_tokens, args.warmup, args.duration = 8, 20, 0.2, 0.5
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(measure(args))
    else:
        uvloop.run(measure(args))


if __name__ == "__main__":
    main()
