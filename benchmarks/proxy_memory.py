"""Memory per in-flight stream: the sidecar's RSS with 0, N/2 and N streams held open.

    python benchmarks/proxy_memory.py --json-out /tmp/proxy_memory.json   # N = 1k, 10k (~3 min)
    python benchmarks/proxy_memory.py --streams 10000 --modes sidecar,bare,nginx,envoy
    python benchmarks/proxy_memory.py --smoke                             # CI: N = 100

Processes (pinned on a 2-core host, like proxy_overhead.py): the simulator (``sidecar sim``) on
core 0; the relay under test on core 1 (the sidecar, ``sidecar proxy --health-interval 0
--max-concurrency 2N``; for calibration the bare aiohttp relay of proxy_overhead.py, and on
request nginx and Envoy with proxy_overhead.py's configurations); the client is this process
(uvloop + aiohttp, one connection per stream) on core 0.

Slow streams: the simulator's engine step is ``--step-s`` (2 s) whatever the batch
(``--per-token-s 0``, a token budget and KV cache big enough for N prompts at once), and every
request is a streamed chat completion with ``ignore_eos`` and ``max_tokens`` 20000: each stream
gets one token chunk per step and stays open until the client closes it.

Per mode and N, with a fresh simulator and relay: a warm-up (``--warmup-streams`` streams opened,
each until its first chunk, then closed), then VmRSS of the relay (from /proc/<pid>/status;
nginx: master + worker summed) with 0 streams in flight; N/2 streams opened (at most
``--connect-parallel`` connecting at once) and held until every one has received its first
chunk, one more step to settle, VmRSS again; the other N/2, VmRSS again. KiB per stream is the
least-squares slope of RSS over (0, N/2, N), and, separately, (RSS(N) - RSS(N/2)) / (N/2) (the
upper half: allocator arenas left by the warm-up are used up by then). The sidecar's own
``sidecar_in_flight_requests`` gauge (its /metrics) and the relay's open file descriptors are
read at each point, so the report shows the streams really were in flight there.

10k streams need 2 sockets each in a relay (client side + upstream side): every process raises
its RLIMIT_NOFILE (soft to hard; with CAP_SYS_RESOURCE, both to what N needs). Where the hard
limit is lower than that and cannot be raised, N is cut to what fits (in hundreds) and the run
says so (``requested_streams`` in the JSON): e.g. a 20000 hard limit holds 9900 streams. A
stream that could not be opened is counted with its reason (HTTP 429 when the sidecar's
--max-concurrency is below N, 502 or a dropped connection when the relay ran out of file
descriptors), never retried.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proxy_overhead as po  # noqa: E402  (process, /proc and relay helpers)

MODES = ("sidecar", "bare", "nginx", "envoy")
MAX_TOKENS = 20_000
# Open files a relay needs besides 2 per stream (listeners, event loop, logs: 16 for the
# sidecar with no stream), with room to spare.
FD_MARGIN = 128


def streams_that_fit(requested: int, nofile: int) -> int:
    """The most streams (<= requested, in hundreds when cut) a relay with ``nofile`` open
    files can hold: 2 sockets per stream."""
    fit = (nofile - FD_MARGIN) // 2
    return requested if requested <= fit else max(2, fit // 100 * 100)


def relay_mem_kib(pids: Sequence[int]) -> dict[str, int]:
    """VmRSS, VmHWM and RssAnon summed over the relay's processes."""
    out = {"VmRSS": 0, "VmHWM": 0, "RssAnon": 0}
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in out:
                    out[name] += int(value.split()[0])
    return out


def open_fds(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{pid}/fd"))
    return total


def sidecar_in_flight(admin_port: int | None) -> int | None:
    """The sidecar's sidecar_in_flight_requests gauge, summed over replicas."""
    if admin_port is None:
        return None
    url = f"http://{po.HOST}:{admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - 127.0.0.1
        text = resp.read().decode()
    return int(
        sum(
            float(m.group(1))
            for m in re.finditer(
                r"^sidecar_in_flight_requests(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.MULTILINE
            )
        )
    )


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def sim_argv(port: int, streams: int, step_s: float, prompt_kib: int = 0) -> list[str]:
    # A prompt's tokens, over-estimated (the simulator's tokenizer takes a few characters per
    # token): room in the context and the KV cache for every stream's prompt at once.
    prompt_tokens = prompt_kib * 1024 // 2
    return [
        sys.executable,
        "-m",
        "sidecar",
        "sim",
        "--host",
        po.HOST,
        "--port",
        str(port),
        "--model",
        po.MODEL,
        "--step-floor-s",
        f"{step_s:g}",
        "--per-token-s",
        "0",
        "--max-num-seqs",
        str(streams + 256),
        "--max-num-batched-tokens",
        str(max(8192, 64 * (streams + 256), 2 * prompt_tokens)),
        "--num-gpu-blocks",
        str(max(32768, (64 + prompt_tokens // 16) * (streams + 256))),
        "--max-model-len",
        str(MAX_TOKENS + 1024 + prompt_tokens),
    ]


def prompt_text(kib: int) -> str:
    """The user message: a short sentence, or about ``kib`` KiB of text (a long prompt shows
    whether a relay holds the request while the answer streams)."""
    sentence = "Hold this stream open. "
    if kib <= 0:
        return sentence.strip()
    return sentence * (kib * 1024 // len(sentence) + 1)


class Streams:
    """The client: streams held open through the relay until closed."""

    def __init__(self, url: str, parallel: int, prompt_kib: int = 0) -> None:
        import aiohttp

        self.aiohttp = aiohttp
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.body = json.dumps(
            {
                "model": po.MODEL,
                "stream": True,
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": prompt_text(prompt_kib)}],
            }
        ).encode()
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=None, sock_connect=30),
        )
        self.connecting = asyncio.Semaphore(parallel)
        self.tasks: list[asyncio.Task[None]] = []
        self.failures: Counter[str] = Counter()
        self.open = 0
        self.seq = 0

    async def _hold(self, first: asyncio.Future[bool]) -> None:
        self.seq += 1
        headers = {"Content-Type": "application/json", "X-Request-Id": f"mem-{self.seq}"}
        resp = None
        try:
            async with self.connecting:
                resp = await self.session.post(self.url, data=self.body, headers=headers)
            if resp.status != 200:
                self.failures[f"HTTP {resp.status}"] += 1
                first.set_result(False)
                return
            seen = b""
            while b"\n\n" not in seen:
                data = await resp.content.readany()
                if not data:
                    self.failures["closed before the first chunk"] += 1
                    first.set_result(False)
                    return
                seen += data
            self.open += 1
            first.set_result(True)
            try:
                while await resp.content.readany():
                    pass
                self.failures["closed by the relay while held"] += 1
            finally:
                self.open -= 1
        except (self.aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            self.failures[type(exc).__name__] += 1
            if not first.done():
                first.set_result(False)
        finally:
            if resp is not None:
                resp.close()

    async def open_streams(self, n: int, timeout_s: float) -> int:
        """Open n more streams; return how many reached their first chunk within timeout_s."""
        loop = asyncio.get_running_loop()
        firsts: list[asyncio.Future[bool]] = []
        for _ in range(n):
            first: asyncio.Future[bool] = loop.create_future()
            firsts.append(first)
            self.tasks.append(asyncio.create_task(self._hold(first)))
        done, _pending = await asyncio.wait(firsts, timeout=timeout_s)
        return sum(1 for f in done if f.result())

    async def close_all(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()

    async def aclose(self) -> None:
        await self.close_all()
        await self.session.close()


async def wait_in_flight(admin_port: int | None, want: int, timeout_s: float) -> int | None:
    """Poll the sidecar's gauge until it reads ``want`` (or the timeout); its last reading."""
    if admin_port is None:
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        seen = await asyncio.to_thread(sidecar_in_flight, admin_port)
        if seen == want or time.monotonic() >= deadline:
            return seen
        await asyncio.sleep(0.1)


async def measure_point(
    pids: Sequence[int], admin_port: int | None, settle_s: float, streams: Streams
) -> dict[str, Any]:
    """The relay's memory (median of 3 readings), fds and in-flight gauge, one engine step after
    the last stream opened (so that every held stream has had a chunk relayed since)."""
    await asyncio.sleep(settle_s)
    held = streams.open
    readings = []
    for _ in range(3):
        readings.append(relay_mem_kib(pids))
        await asyncio.sleep(0.1)
    rss = statistics.median(r["VmRSS"] for r in readings)
    anon = statistics.median(r["RssAnon"] for r in readings)
    in_flight = await asyncio.to_thread(sidecar_in_flight, admin_port) if admin_port else None
    return {
        "held": held,
        "rss_kib": rss,
        "rss_anon_kib": anon,
        "hwm_kib": max(r["VmHWM"] for r in readings),
        "fds": open_fds(pids),
        "relay_in_flight": in_flight,
    }


async def run_level(
    mode: str, n: int, args: argparse.Namespace, workdir: Path, place: po.Placement
) -> dict[str, Any]:
    sim_port, port = po.free_port(), po.free_port()
    admin_port = po.free_port() if mode == "sidecar" else None
    procs: list[subprocess.Popen[bytes]] = []
    streams: Streams | None = None
    tag = f"{mode}-{n}"
    try:
        sim = po.spawn(
            sim_argv(sim_port, n, args.step_s, args.prompt_kib),
            workdir / f"sim-{tag}.log",
            place.sim,
        )
        procs.append(sim)
        po.wait_port(sim_port, sim)
        if mode == "sidecar":
            assert admin_port is not None
            proxy = po.start_proxy(
                sim_port,
                port,
                admin_port,
                workdir / f"{tag}.log",
                place.proxy,
                ["--max-concurrency", str(2 * n + 1024), *args.proxy_arg],
            )
            procs.append(proxy)
            pids = po.process_tree(proxy.pid)  # the collector and its worker
        else:
            relay, pids = po.start_relay(
                mode, sim_port, port, workdir, tag, place.proxy, max_conns=n + 1024
            )
            procs.append(relay)
        streams = Streams(f"http://{po.HOST}:{port}", args.connect_parallel, args.prompt_kib)
        open_timeout = args.open_timeout_s + 3 * args.step_s
        warm = await streams.open_streams(args.warmup_streams, open_timeout)
        # The gauge comes from the workers' status (every 0.25 s): seen at the warm-up's count
        # first, so that the 0 waited for below is after it, not a reading from before it.
        await wait_in_flight(admin_port, streams.open, 10)
        await streams.close_all()
        await wait_in_flight(admin_port, 0, 10 + args.step_s)
        points = [await measure_point(pids, admin_port, args.step_s, streams)]
        started = time.monotonic()
        half = n // 2
        for size in (half, n - half):
            await streams.open_streams(size, open_timeout)
            await wait_in_flight(admin_port, streams.open, 10)
            points.append(await measure_point(pids, admin_port, args.step_s, streams))
        open_s = time.monotonic() - started
    finally:
        if streams is not None:
            await streams.aclose()
        for proc in reversed(procs):
            po.stop(proc, 15)
    xs = [p["held"] for p in points]
    ys = [p["rss_kib"] for p in points]
    upper = (points[2]["rss_kib"] - points[1]["rss_kib"]) / max(1, xs[2] - xs[1])
    result = {
        "mode": mode,
        "streams": n,
        "held": xs[2],
        "warmup_ok": warm,
        "failures": dict(streams.failures),
        "points": points,
        "kib_per_stream": slope(xs, ys),
        "kib_per_stream_upper_half": upper,
        "anon_kib_per_stream": slope(xs, [p["rss_anon_kib"] for p in points]),
        "fds_per_stream": slope(xs, [p["fds"] for p in points]),
        "open_wall_s": open_s,
    }
    print(
        f"{mode:8} N={n:<6} held {xs[2]} (failures {dict(streams.failures) or 'none'}): RSS "
        + " / ".join(f"{p['rss_kib'] / 1024:.1f}" for p in points)
        + f" MiB at {'/'.join(str(x) for x in xs)} streams -> {result['kib_per_stream']:.1f} "
        f"KiB/stream (upper half {upper:.1f}), fds/stream {result['fds_per_stream']:.2f}",
        flush=True,
    )
    return result


def report(results: Sequence[dict[str, Any]], step_s: float) -> str:
    lines = [
        f"Relay RSS with streams held open (engine step {step_s:g} s: one token chunk per "
        "stream per step). RSS in MiB at 0 / N/2 / N streams in flight (held = streams "
        "that received their first chunk and were open at the reading); KiB per stream = "
        "least-squares slope over the three points; upper half = (RSS(N) − RSS(N/2)) / "
        "(N/2). In flight = the sidecar's own sidecar_in_flight_requests gauge.",
        "",
        "| relay | N | held | RSS 0 | RSS N/2 | RSS N | KiB/stream | KiB/stream (upper "
        "half) | anon KiB/stream | fds/stream | in flight (sidecar gauge) | failures |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        p = r["points"]
        gauge = " / ".join(
            "-" if x["relay_in_flight"] is None else str(x["relay_in_flight"]) for x in p
        )
        failures = ", ".join(f"{k}: {v}" for k, v in r["failures"].items()) or "none"
        n = str(r["streams"])
        if r.get("requested_streams", r["streams"]) != r["streams"]:
            n += f" ({r['requested_streams']} asked; fd limit)"
        lines.append(
            f"| {po.MODE_LABELS[r['mode']]} | {n} | {r['held']} | "
            + " | ".join(f"{x['rss_kib'] / 1024:.1f}" for x in p)
            + f" | {r['kib_per_stream']:.1f} | {r['kib_per_stream_upper_half']:.1f} | "
            f"{r['anon_kib_per_stream']:.1f} | {r['fds_per_stream']:.2f} | {gauge} | "
            f"{failures} |"
        )
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> int:
    place = po.Placement(args)
    need = 2 * max(args.streams) + FD_MARGIN
    po.NOFILE_WANT = need
    have = po.raise_nofile_limit(need)
    workdir = Path(tempfile.mkdtemp(prefix="proxy-memory-"))
    modes, skipped = po.select_modes(args.modes)
    modes = modes[1:]
    print(f"# {po.machine_line()}", flush=True)
    print(
        f"# pinning: {place.describe()}; open-files limit {have} (want {need}); logs in {workdir}",
        flush=True,
    )
    for mode, reason in skipped.items():
        print(f"# mode {mode} skipped: {reason}", flush=True)
    results = []
    for requested in args.streams:
        n = streams_that_fit(requested, have)
        if n < requested:
            print(
                f"# WARNING: N={requested} needs {2 * requested + FD_MARGIN} open files in a "
                f"relay, the limit here is {have} and cannot be raised (hard limit; raising "
                f"it needs root with CAP_SYS_RESOURCE, e.g. `ulimit -Hn {need}` before the "
                f"run): measuring N={n} instead",
                flush=True,
            )
        for mode in modes:
            result = await run_level(mode, n, args, workdir, place)
            result["requested_streams"] = requested
            results.append(result)
    print()
    print(report(results, args.step_s))
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "machine": po.machine_line(),
                    "step_s": args.step_s,
                    "modes": modes,
                    "prompt_kib": args.prompt_kib,
                    "skipped": skipped,
                    "nofile_limit": have,
                    "results": results,
                },
                indent=1,
            )
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--streams",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1000, 10000],
        help="comma-separated N [1000,10000]",
    )
    parser.add_argument(
        "--modes",
        type=lambda s: [m for m in s.split(",") if m],
        default=["sidecar", "bare"],
        help=f"relays, from {', '.join(MODES)} [sidecar,bare]",
    )
    parser.add_argument(
        "--step-s",
        type=float,
        default=2.0,
        help="the simulator's engine step: one chunk per stream per step [2 s]",
    )
    parser.add_argument(
        "--warmup-streams",
        type=int,
        default=200,
        help="streams opened and closed before the 0-stream reading [200]",
    )
    parser.add_argument(
        "--prompt-kib",
        type=int,
        default=0,
        help="each request's prompt, about this many KiB (0: one sentence)",
    )
    parser.add_argument(
        "--connect-parallel",
        type=int,
        default=100,
        help="streams connecting at once while opening [100]",
    )
    parser.add_argument(
        "--open-timeout-s",
        type=float,
        default=120.0,
        help="longest wait for a batch of streams to open [120 s]",
    )
    parser.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="extra flag for `sidecar proxy` (repeatable)",
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--json-out", help="write the results as JSON here")
    parser.add_argument(
        "--smoke", action="store_true", help="CI smoke run: N=100, 0.2 s steps, 20 warm-up streams"
    )
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(MODES)}")
    if args.smoke:
        args.streams, args.step_s, args.warmup_streams = [100], 0.1, 20
    import uvloop

    return uvloop.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
