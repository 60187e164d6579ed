"""Soak: a long run of mixed, partly faulty traffic through the proxy, watching for leaks.

    python benchmarks/soak.py --requests 1000000 --out benchmarks/soak   # the issue's length
    python benchmarks/soak.py --duration 900 --out benchmarks/soak       # what fits in 15 min
    python benchmarks/soak.py --requests 20000 --out /tmp/soak           # a quick look
    python benchmarks/soak.py --smoke --out /tmp/soak-smoke              # CI: 400 requests

Three processes: simulated replicas (``sidecar sim``, a fast engine), the proxy (this file's
``proxy`` sub-command: `sidecar proxy`'s own wiring, ``build_proxy_server``, with capture, the
live window and Prometheus on, plus one extra admin route, ``/soak``, that reports the process's
RSS, open file descriptors, threads, asyncio tasks, the capture queue and the live window's
size), and the load (this process: ``--concurrency`` clients sending back to back).

The mix (`KINDS`): mostly normal requests (chat and completions, streamed and not), and a few
percent each of every fault the simulator injects (HTTP 500, a mid-stream error event, a reset,
a stream closed without [DONE], a malformed chunk, a stall past the TTFT timeout), an unknown
model, a malformed and an oversized request, a pass-through path, a client that leaves
mid-stream and one that leaves before the answer. The choice is seeded.

Sampled every ``--sample-s`` seconds under load (phase ``load``) and at quiet checkpoints every
``--checkpoint`` requests, where the load pauses until nothing is in flight and the capture
queue is empty (phase ``quiet``): those are the comparable points. /metrics and /stats are
scraped every 5 s, as Prometheus and a dashboard would (the live window is trimmed then).

At the end: requests sent = the proxy's requests (bar clients that left before the proxy read
their request: reported) = its records = the capture's lines written (+ pass-through, which is
not captured), drops = 0, the outcome counts in /metrics = the counts
the mix implies, the client saw what each kind implies, and the proxy exits 0 on SIGTERM. Writes
``soak.csv`` (one row per sample) and ``soak.json`` (the summary) into ``--out``.

`tests/test_reliability_soak.py` runs the same mix in one process, scaled down, in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gc
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

MAX_BODY_BYTES = 64 * 1024
PROXY_SETTINGS = {  # the proxy's settings in the soak (and in the CI version)
    "ttft_timeout": "1s",
    "idle_timeout": "2s",
    "max_body_bytes": str(MAX_BODY_BYTES),
    "window_s": "5s",
    "window_max_records": "20000",
    "engine_scrape_interval": "0",
}


@dataclass(frozen=True)
class Kind:
    name: str
    weight: int  # per 1000 requests
    outcome: str  # the record's outcome
    stream: bool = True
    fault: str | None = None
    status: int | None = 200  # what the client gets (None: the client leaves)
    stream_error: bool = False  # a 200 stream that carries an error event


KINDS = (
    Kind("ok_stream", 583, "ok"),
    Kind("ok_whole", 250, "ok", stream=False),
    Kind("http_500", 15, "http_error", fault="error_status=500", status=500),
    Kind("error_event", 15, "http_error", fault="error_event_after=1", stream_error=True),
    Kind("reset", 15, "upstream_error", fault="reset_after=1", stream_error=True),
    Kind("reset_whole", 10, "upstream_error", stream=False, fault="reset_after=1", status=502),
    Kind("closed_early", 15, "upstream_error", fault="close_after=1", stream_error=True),
    Kind("malformed", 15, "upstream_error", fault="malformed_after=0"),  # relayed as is
    Kind("stall", 2, "timeout", fault="stall_ms=4000", stream_error=True),  # past the TTFT timeout
    Kind("unknown_model", 15, "http_error", status=404),
    Kind("bad_json", 10, "http_error", stream=False, status=400),
    Kind("oversized", 10, "rejected", stream=False, status=413),
    Kind("pass_through", 15, "ok", stream=False),
    Kind("client_leaves", 15, "client_cancelled", status=None),
    # Not streamed (no TTFT timeout), headers held 3 s, the client leaves after 0.3 s.
    Kind(
        "client_gone_early",
        15,
        "client_cancelled",
        stream=False,
        fault="slow_headers_ms=3000",
        status=None,
    ),
)
assert sum(k.weight for k in KINDS) == 1000
_CUMULATIVE: list[tuple[int, Kind]] = []
for _kind in KINDS:
    _CUMULATIVE.append(((_CUMULATIVE[-1][0] if _CUMULATIVE else 0) + _kind.weight, _kind))


def pick(rng: random.Random) -> Kind:
    draw = rng.randrange(1000)
    for bound, kind in _CUMULATIVE:
        if draw < bound:
            return kind
    raise AssertionError("unreachable")


OVERSIZED = json.dumps({"model": "m", "prompt": "x" * (MAX_BODY_BYTES + 1)}).encode()


async def send(session: aiohttp.ClientSession, url: str, kind: Kind, i: int) -> bool:
    """One request of ``kind``; True when the client saw what the kind implies."""
    headers = {"X-Request-Id": f"{kind.name}-{i}"}
    if kind.fault:
        headers["X-Sim-Fault"] = kind.fault
    if kind.name == "pass_through":
        async with session.get(url + "/v1/models", headers=headers) as response:
            await response.read()
            return response.status == 200
    chat = i % 2 == 0
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {
        "model": "nope" if kind.name == "unknown_model" else "m",
        "max_tokens": 2000 if kind.name == "client_leaves" else 6,
        "ignore_eos": True,
        "stream": kind.stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": f"request {i}"}]
    else:
        body["prompt"] = f"request {i}"
    data = (
        b"{not json"
        if kind.name == "bad_json"
        else OVERSIZED
        if kind.name == "oversized"
        else json.dumps(body).encode()
    )
    headers["Content-Type"] = "application/json"
    if kind.name == "client_gone_early":
        task = asyncio.create_task(_post(session, url + path, data, headers))
        await asyncio.sleep(0.3)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False
    if kind.name == "client_leaves":
        async with session.post(url + path, data=data, headers=headers) as response:
            await response.content.readline()
            response.close()  # gone mid-stream
        return True
    status, answer = await _post(session, url + path, data, headers)
    if status != kind.status:
        return False
    if kind.stream and status == 200:
        return answer.endswith(b"data: [DONE]\n\n") and (
            (b'{"error"' in answer) == kind.stream_error
        )
    if status != 200:
        return answer.startswith(b'{"error"')  # vLLM's error shape
    return b'"choices"' in answer or b'"data"' in answer


async def _post(
    session: aiohttp.ClientSession, url: str, data: bytes, headers: dict[str, str]
) -> tuple[int, bytes]:
    async with session.post(url, data=data, headers=headers) as response:
        return response.status, await response.read()


def process_state(pid: int | str = "self") -> dict[str, int]:
    """RSS (kB), threads and open file descriptors of a process, from /proc: all fds, those
    that are not sockets, sockets, and sockets in CLOSE_WAIT (the peer closed, this process
    never did: the classic descriptor leak)."""
    rss = threads = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    fds = other = 0
    inodes: set[str] = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        fds += 1
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
        else:
            other += 1
    close_wait = 0
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as handle:
                next(handle, None)
                for line in handle:
                    fields = line.split()
                    if fields[3] == "08" and fields[9] in inodes:
                        close_wait += 1
        except OSError:
            continue
    return {
        "rss_kb": rss,
        "threads": threads,
        "fds": fds,
        "fds_not_sockets": other,
        "sockets": len(inodes),
        "close_wait": close_wait,
    }


def expected_outcomes(counts: Counter[str]) -> Counter[str]:
    by_name = {k.name: k for k in KINDS}
    out: Counter[str] = Counter()
    for name, n in counts.items():
        out[by_name[name].outcome] += n
    return out


# -- the proxy process ----------------------------------------------------------------------


def run_proxy_child(upstreams: list[str], capture: str) -> None:
    """`sidecar proxy` wiring plus /soak; prints its URLs, serves until SIGTERM."""
    import uvloop
    from aiohttp import web

    from sidecar.config import build_config
    from sidecar.proxy import gcpolicy
    from sidecar.serve import build_proxy_server, wait_for_shutdown_signal

    async def main() -> None:
        config = build_config(
            {
                "upstreams": upstreams,
                "listen": "127.0.0.1:0",
                "metrics_listen": "127.0.0.1:0",
                "health_interval": "1s",
                "capture_dir": capture,
                **PROXY_SETTINGS,
            },
            {},
        )
        server, window = build_proxy_server(config)
        capture_sink: Any = next(s for s in server.proxy.fanout.sinks if s.name == "capture")
        proxy = server.proxy

        async def soak_state(_request: web.Request) -> web.Response:
            return web.json_response(
                {
                    **process_state(),
                    "tasks": len(asyncio.all_tasks()),
                    "capture_queue": capture_sink.queued,
                    "window_records": len(window._records),
                    "in_flight": proxy.in_flight,
                    "requests_total": proxy.requests_total,
                    "records_total": proxy.records_total,
                    "capture_written": capture_sink.written,
                    "capture_dropped": capture_sink.dropped_queue_full
                    + capture_sink.dropped_write_errors,
                    "outstanding": sum(r.outstanding for r in proxy.router.replicas),
                    # The collector's view (sidecar/proxy/gcpolicy.py): collections per
                    # generation so far, and the objects it tracks beyond frozen start-up.
                    **{
                        f"gc_collections_{generation}": stats["collections"]
                        for generation, stats in enumerate(gc.get_stats())
                    },
                    "gc_tracked": len(gc.get_objects()),
                }
            )

        server.add_admin_routes([web.get("/soak", soak_state)])
        await server.start()
        gcpolicy.settle()  # as `sidecar proxy` once it serves: full collections are rare
        print(f"proxy listening on {server.url}", flush=True)
        print(f"admin on {server.admin_url}", flush=True)
        try:
            await wait_for_shutdown_signal()
        finally:
            await server.close()

    uvloop.run(main())


# -- the load and the sampling --------------------------------------------------------------


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_urls(proc: subprocess.Popen[str], pattern: str, n: int) -> list[str]:
    assert proc.stdout is not None
    urls: list[str] = []
    for _ in range(40):
        line = proc.stdout.readline()
        match = re.search(pattern, line)
        if match:
            urls.append(match.group(1))
            if len(urls) == n:
                return urls
    raise RuntimeError(f"no {pattern!r} in the output of {proc.args!r}")


def _drain(stream: Any) -> None:
    """Keep reading a child's pipe so that it never blocks on a full pipe."""
    threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, admin: str) -> None:
        self.args = args
        self.url = url
        self.admin = admin
        self.rng = random.Random(args.seed)
        self.sent = 0
        self.kinds: Counter[str] = Counter()
        self.unexpected: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.rows: list[dict[str, Any]] = []
        self.start = time.monotonic()
        self.stop_at = self.start + args.duration if args.duration else None

    def more(self) -> bool:
        if self.stop_at is not None and time.monotonic() >= self.stop_at:
            return False
        requests: int = self.args.requests
        return requests == 0 or self.sent < requests

    async def state(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(self.admin + "/soak") as response:
            state: dict[str, Any] = await response.json()
        return state

    async def sample(self, session: aiohttp.ClientSession, phase: str) -> dict[str, Any]:
        state = await self.state(session)
        row = {
            "t_s": round(time.monotonic() - self.start, 3),
            "phase": phase,
            "requests_sent": self.sent,
            **state,
        }
        self.rows.append(row)
        return row

    async def quiet(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        """Wait until nothing is in flight, every request the proxy counted has its record and
        the capture queue is empty, twice in a row 50 ms apart."""
        deadline = time.monotonic() + 60
        previous = None
        while True:
            state = await self.state(session)
            settled = (
                state["in_flight"],
                state["capture_queue"],
                state["requests_total"] - state["records_total"],
                state["requests_total"],
            )
            if settled[:3] == (0, 0, 0) and settled == previous:
                break
            previous = settled
            if time.monotonic() > deadline:
                raise RuntimeError(f"the proxy did not go quiet: {state}")
            await asyncio.sleep(0.05)
        return await self.sample(session, "quiet")

    async def client(self, session: aiohttp.ClientSession, budget: list[int]) -> None:
        while budget[0] > 0 and self.more():
            budget[0] -= 1
            kind = pick(self.rng)
            i = self.sent
            self.sent += 1
            self.kinds[kind.name] += 1
            try:
                if not await send(session, self.url, kind, i):
                    self.unexpected[kind.name] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.errors[f"{kind.name}:{type(exc).__name__}"] += 1

    async def scraper(self, session: aiohttp.ClientSession, done: asyncio.Event) -> None:
        next_sample = time.monotonic()
        next_scrape = time.monotonic()
        while not done.is_set():
            now = time.monotonic()
            if now >= next_sample:
                await self.sample(session, "load")
                next_sample = now + self.args.sample_s
                if self.args.progress:
                    row = self.rows[-1]
                    print(
                        f"  {row['t_s']:8.1f} s  {self.sent:>9} sent  rss "
                        f"{row['rss_kb'] / 1024:6.1f} MiB  fds {row['fds']:4}  tasks "
                        f"{row['tasks']:4}  window {row['window_records']:6}  capture queue "
                        f"{row['capture_queue']}",
                        flush=True,
                    )
            if now >= next_scrape:
                for path in ("/metrics", "/stats"):
                    async with session.get(self.admin + path) as response:
                        await response.read()
                next_scrape = now + 5.0
            try:
                await asyncio.wait_for(done.wait(), 0.25)
            except asyncio.TimeoutError:
                pass

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.args.concurrency + 4)
        timeout = aiohttp.ClientTimeout(total=60)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            aiohttp.ClientSession() as admin_session,
        ):
            done = asyncio.Event()
            scraper = asyncio.create_task(self.scraper(admin_session, done))
            await self.quiet(admin_session)
            while self.more():
                budget = [self.args.checkpoint]
                await asyncio.gather(
                    *(self.client(session, budget) for _ in range(self.args.concurrency))
                )
                await self.quiet(admin_session)
            done.set()
            await scraper
            async with admin_session.get(self.admin + "/metrics") as response:
                self.metrics = await response.text()


def outcome_counts(exposition: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    for match in re.finditer(
        r"^sidecar_requests_total\{([^}]*)\} ([0-9.e+]+)$", exposition, re.MULTILINE
    ):
        outcome = re.search(r'outcome="([^"]+)"', match.group(1))
        if outcome:
            counts[outcome.group(1)] += int(float(match.group(2)))
    return counts


def summarise(soak: Soak, proxy_rc: int, capture_lines: int, wall_s: float) -> dict[str, Any]:
    quiet = [r for r in soak.rows if r["phase"] == "quiet"]
    warm = quiet[len(quiet) // 10] if len(quiet) > 10 else quiet[min(1, len(quiet) - 1)]
    after = [r for r in quiet if r["t_s"] >= warm["t_s"]]
    load = [r for r in soak.rows if r["phase"] == "load" and r["t_s"] >= warm["t_s"]]
    last = quiet[-1]
    observed = outcome_counts(soak.metrics)
    expected = expected_outcomes(soak.kinds)
    # A client that leaves 0.3 s after sending may leave before the proxy read its request
    # (aiohttp drops a connection closed before its handler started): never counted in.
    never_arrived = soak.sent - last["requests_total"]
    expected["client_cancelled"] -= never_arrived
    generation = soak.sent - soak.kinds["pass_through"] - never_arrived
    summary = {
        "requests": soak.sent,
        "wall_s": round(wall_s, 1),
        "requests_per_s": round(soak.sent / wall_s, 1),
        "concurrency": soak.args.concurrency,
        "seed": soak.args.seed,
        "kinds": dict(soak.kinds),
        "outcomes_in_metrics": dict(observed),
        "outcomes_expected": dict(expected),
        "client_unexpected": dict(soak.unexpected),
        "client_errors": dict(soak.errors),
        "proxy_requests_total": last["requests_total"],
        "proxy_records_total": last["records_total"],
        "never_reached_the_proxy": never_arrived,
        "records_lost": last["requests_total"] - last["records_total"],
        "capture_written": last["capture_written"],
        "capture_lines_read": capture_lines,
        "capture_expected": generation,
        "capture_dropped": last["capture_dropped"],
        "proxy_exit_code": proxy_rc,
        "warm_up_until_s": warm["t_s"],
        "quiet_checkpoints": len(quiet),
        "rss_kb_at_warm": warm["rss_kb"],
        "rss_kb_last_quiet": last["rss_kb"],
        "rss_kb_max_after_warm": max(r["rss_kb"] for r in after + load),
        "fds_quiet_range_after_warm": [min(r["fds"] for r in after), max(r["fds"] for r in after)],
        "tasks_quiet_range_after_warm": [
            min(r["tasks"] for r in after),
            max(r["tasks"] for r in after),
        ],
        "threads_quiet_range_after_warm": [
            min(r["threads"] for r in after),
            max(r["threads"] for r in after),
        ],
        "gc_tracked_quiet_range_after_warm": [
            min(r["gc_tracked"] for r in after),
            max(r["gc_tracked"] for r in after),
        ],
        "gc_collections_after_warm": [
            last[f"gc_collections_{g}"] - warm[f"gc_collections_{g}"] for g in range(3)
        ],
        "window_records_max": max(r["window_records"] for r in soak.rows),
        "capture_queue_max": max(r["capture_queue"] for r in soak.rows),
        "rss_slope_kb_per_100k_requests": _slope(after),
    }
    summary["ok"] = bool(
        summary["records_lost"] == 0
        and 0 <= never_arrived <= soak.kinds["client_gone_early"]
        and capture_lines == generation == last["capture_written"]
        and last["capture_dropped"] == 0
        and observed == expected
        and not soak.unexpected
        and not soak.errors
        and proxy_rc == 0
    )
    return summary


def _slope(rows: list[dict[str, Any]]) -> float | None:
    """Least-squares RSS growth per 100k requests over the quiet checkpoints after warm-up."""
    if len(rows) < 3:
        return None
    xs = [float(r["requests_sent"]) for r in rows]
    ys = [float(r["rss_kb"]) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var * 1e5, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    child = sub.add_parser("proxy", help="(internal) the proxy process")
    child.add_argument("--upstream", action="append", required=True)
    child.add_argument("--capture", required=True)
    parser.add_argument("--requests", type=int, default=20_000, help="0: no limit [20000]")
    parser.add_argument("--duration", type=float, default=0.0, help="seconds; 0: no limit")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--checkpoint", type=int, default=20_000, help="requests between quiet checkpoints [20000]"
    )
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--step-floor-s", type=float, default=0.0005, help="the simulator's engine step [0.5 ms]"
    )
    parser.add_argument("--out", default="soak-out")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke run: 400 requests from 8 clients, checkpoints every 100, 1 s samples",
    )
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.duration, args.checkpoint, args.sample_s = 400, 0.0, 100, 1.0
        args.concurrency = 8
    if args.command == "proxy":
        run_proxy_child(args.upstream, args.capture)
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    capture_dir = Path(tempfile.mkdtemp(prefix="soak-capture-"))
    sim = _start(
        [
            sys.executable,
            "-m",
            "sidecar",
            "sim",
            "--replicas",
            "2",
            "--port",
            "0",
            "--model",
            "m",
            "--step-floor-s",
            str(args.step_floor_s),
            "--per-token-s",
            "0",
        ]
    )
    proxy = None
    try:
        upstreams = _read_urls(sim, r"listening on (http://\S+)", 2)
        _drain(sim.stdout)
        _drain(sim.stderr)
        proxy = _start(
            [
                sys.executable,
                __file__,
                "proxy",
                "--capture",
                str(capture_dir),
                *[f"--upstream={u}" for u in upstreams],
            ]
        )
        url, admin = _read_urls(proxy, r"(?:proxy listening|admin) on (http://\S+)", 2)
        _drain(proxy.stdout)
        _drain(proxy.stderr)
        soak = Soak(args, url, admin)
        started = time.monotonic()
        try:
            import uvloop

            uvloop.run(soak.run())
        except ImportError:  # pragma: no cover
            asyncio.run(soak.run())
        wall = time.monotonic() - started
        proxy.send_signal(signal.SIGTERM)
        proxy_rc = proxy.wait(timeout=120)
        lines = 0
        for path in sorted(capture_dir.glob("capture-*")):
            with open(path) as handle:
                lines += sum(1 for _ in handle) - 1  # minus the header
        summary = summarise(soak, proxy_rc, lines, wall)
    finally:
        for proc in (proxy, sim):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(capture_dir, ignore_errors=True)
    with open(out / "soak.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(soak.rows[0]))
        writer.writeheader()
        writer.writerows(soak.rows)
    (out / "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
