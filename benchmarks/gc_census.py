"""What the garbage collector finds in the proxy: cyclic garbage per request, objects per stream.

    python benchmarks/gc_census.py --json-out benchmarks/results/gc_census.json \\
        --md-out benchmarks/results/gc_census.out.md          # about 1 minute
    python benchmarks/gc_census.py --smoke                    # CI: seconds, no timing claims

CPython frees an object when its reference count drops to zero, unless it is part of a
reference cycle: then only the cycle collector frees it, and its full (generation-2)
collection stops the whole process for as long as scanning every tracked object takes. In a
worker that is every stream's relay stopped, and the stop stamped into the gaps of the events
behind it. Two things make those pauses long and frequent, and this harness counts both:

1. **Cyclic garbage per finished request** (per scenario): requests are sent through the proxy
   with the collector off, then one collection with ``gc.DEBUG_SAVEALL`` says what it would
   have freed; counted are objects of the proxy's own modules (``sidecar.proxy``,
   ``sidecar.meter``, ``sidecar.protocol``, ``sidecar.record``) and all objects. Cyclic
   garbage waits in the oldest generation for a full collection and makes it longer.
2. **Tracked objects per in-flight stream** and the time of one full collection (``gc.collect()``)
   with N streams held open: what every full collection must scan however little garbage
   there is.

Processes: the proxy runs in this process (``build_proxy_server``, one event loop, as one
worker's data plane), frozen after start-up like a worker (``gc.freeze()``: start-up objects
are not scanned). The upstream is the simulator (``sidecar sim``, a process of its own); the
clients are processes of their own (raw sockets), so this process holds only the proxy.

Scenarios (each request on a connection of its own, so the client connection's end counts):
``stream`` (a streamed chat completion), ``assembled`` (non-streamed: the proxy streams from
the upstream and assembles), ``keepalive`` (three streamed requests on one connection),
``client_leaves`` (the client closes after the first token), ``upstream_reset`` (the upstream
resets after 2 tokens), ``upstream_close`` (ends its body without ``[DONE]``),
``error_event`` (vLLM's mid-stream error event), ``error_status`` (HTTP 500),
``ttft_timeout`` (no first token within the proxy's --ttft-timeout), ``malformed`` (not HTTP),
``bad_json`` (a body that is not JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import proxy_overhead as po

HOST = "127.0.0.1"
PROXY_MODULES = ("sidecar.proxy.", "sidecar.meter", "sidecar.protocol.", "sidecar.record")
SCENARIOS = (
    "stream",
    "assembled",
    "keepalive",
    "client_leaves",
    "upstream_reset",
    "upstream_close",
    "error_event",
    "error_status",
    "ttft_timeout",
    "malformed",
    "bad_json",
)

# The client of the per-request scenarios: a process of its own, raw sockets.
REQUEST_CLIENT = r"""
import json, socket, sys
port, scenario, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
FAULTS = {"upstream_reset": "reset_after=2", "upstream_close": "close_after=2",
          "error_event": "error_event_after=1", "error_status": "error_status=500",
          "ttft_timeout": "stall_ms=1500"}

def request(stream=True, max_tokens=4, fault=None, body=None):
    if body is None:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}],
                           "stream": stream, "max_tokens": max_tokens}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
            b"Content-Type: application/json\r\n")
    if fault:
        head += b"X-Sim-Fault: " + fault.encode() + b"\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body

def answer(sock, stop=None):
    sock.settimeout(10)
    data = b""
    while True:
        piece = sock.recv(65536)
        data += piece
        if not piece or data.endswith(b"0\r\n\r\n") or (stop and stop in data):
            return data
        if b"content-length:" in data.lower() and data.rstrip().endswith(b"}"):
            return data

for _ in range(n):
    sock = socket.create_connection(("127.0.0.1", port))
    if scenario == "keepalive":
        for _ in range(3):
            sock.sendall(request())
            answer(sock)
    elif scenario == "client_leaves":
        sock.sendall(request(max_tokens=2000))
        answer(sock, stop=b'"content"')
    elif scenario == "assembled":
        sock.sendall(request(stream=False))
        answer(sock)
    elif scenario == "malformed":
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer(sock)
    elif scenario == "bad_json":
        sock.sendall(request(body=b"{not json"))
        answer(sock)
    else:
        sock.sendall(request(fault=FAULTS.get(scenario)))
        answer(sock)
    sock.close()
"""

# The client of the held streams: opens n streams, reads each one's first bytes, says "held",
# and keeps them open until its stdin closes.
HOLDING_CLIENT = r"""
import json, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}],
                   "stream": True, "max_tokens": 20000, "ignore_eos": True}).encode()
req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
       b"Content-Length: %d\r\n\r\n" % len(body) + body)
socks = []
for _ in range(n):
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(req)
    socks.append(sock)
for sock in socks:
    sock.settimeout(60)
    sock.recv(65536)
print("held", flush=True)
sys.stdin.read()
"""


def garbage_census() -> tuple[int, Counter[str]]:
    """One collection that keeps what it found: (objects found, the proxy's by class)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        found = gc.collect()
        ours = Counter(
            f"{type(o).__module__}.{type(o).__qualname__}"
            for o in gc.garbage
            if type(o).__module__.startswith(PROXY_MODULES)
        )
        return found, ours
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def run_client(argv: Sequence[str], stdin: bool = False) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", *argv],
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    )


async def wait_exit(proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("a client did not finish in time")
        await asyncio.sleep(0.02)
    if proc.returncode:
        raise RuntimeError(f"a client failed (exit {proc.returncode})")


async def per_request(port: int, scenario: str, n: int) -> dict[str, Any]:
    await wait_exit(run_client([REQUEST_CLIENT, str(port), scenario, "2"]))  # warm
    await asyncio.sleep(0.2)
    gc.collect()
    gc.disable()
    try:
        await wait_exit(run_client([REQUEST_CLIENT, str(port), scenario, str(n)]))
        await asyncio.sleep(0.3)  # the connections' ends reach the proxy
        found, ours = garbage_census()
    finally:
        gc.enable()
    return {
        "scenario": scenario,
        "requests": n,
        "garbage_per_request": found / n,
        "proxy_garbage_per_request": sum(ours.values()) / n,
        "proxy_garbage_classes": {k: v / n for k, v in ours.most_common(12)},
    }


async def held_streams(server: Any, port: int, levels: Sequence[int]) -> list[dict[str, Any]]:
    gc.collect()
    base = len(gc.get_objects())
    rows: list[dict[str, Any]] = []
    holders: list[subprocess.Popen[bytes]] = []
    held = 0
    try:
        for level in levels:
            holder = run_client([HOLDING_CLIENT, str(port), str(level - held)], stdin=True)
            holders.append(holder)
            assert holder.stdout is not None
            line = await asyncio.get_running_loop().run_in_executor(None, holder.stdout.readline)
            if line.strip() != b"held":
                raise RuntimeError(f"the holding client could not open {level - held} streams")
            held = level
            await asyncio.sleep(2.5)  # every stream past its first token
            if server.proxy.in_flight != level:
                raise RuntimeError(f"{server.proxy.in_flight} streams in flight, wanted {level}")
            gc.collect()
            tracked = len(gc.get_objects()) - base
            times = []
            for _ in range(3):
                started = time.perf_counter()
                gc.collect()
                times.append(time.perf_counter() - started)
            rows.append(
                {
                    "streams": level,
                    "in_flight": server.proxy.in_flight,
                    "tracked_objects": tracked,
                    "tracked_per_stream": tracked / level,
                    "full_collection_ms": 1e3 * sorted(times)[1],
                }
            )
    finally:
        for holder in holders:
            with contextlib.suppress(OSError):
                assert holder.stdin is not None
                holder.stdin.close()
            holder.kill()
            holder.wait()
    return rows


async def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from sidecar.config import build_config
    from sidecar.serve import build_proxy_server

    sim_port, port = po.free_port(), po.free_port()
    sim = po.spawn(
        [
            sys.executable, "-m", "sidecar", "sim", "--host", HOST, "--port", str(sim_port),
            "--model", "m", "--step-floor-s", str(args.step_s), "--per-token-s", "0",
            "--max-num-seqs", "100000", "--max-num-batched-tokens", "10000000",
            "--num-gpu-blocks", "10000000",
        ],
        workdir / "sim.log",
        None,
    )  # fmt: skip
    try:
        po.wait_port(sim_port, sim)
        flags = {
            "upstreams": [f"http://{HOST}:{sim_port}"],
            "listen": f"{HOST}:{port}",
            "metrics_listen": f"{HOST}:0",
            "health_interval": "0",
            "max_concurrency": str(max([*args.streams, 1]) * 2),
        }

        async def proxy(settings: dict[str, Any]) -> Any:
            server, _window = build_proxy_server(build_config({**flags, **settings}, {}))
            await server.start()
            gc.collect()
            gc.freeze()  # as a worker does after start-up
            return server

        # The scenarios' proxy has a TTFT timeout (the ttft_timeout scenario); the held
        # streams' has none (their first token may come a whole engine step later).
        server = await proxy({"ttft_timeout": "300ms"})
        try:
            requests = [await per_request(port, s, args.requests) for s in args.scenarios]
        finally:
            await server.close()
            gc.unfreeze()
        streams: list[dict[str, Any]] = []
        if args.streams:
            server = await proxy({})
            try:
                streams = await held_streams(server, port, args.streams)
            finally:
                await server.close()
    finally:
        po.stop(sim)
    return {"requests": requests, "streams": streams}


def report(meta: dict[str, Any], result: dict[str, Any]) -> str:
    lines = [
        "# gc_census: what the garbage collector finds in the proxy",
        "",
        f"# {meta['command']}",
        f"# {meta['machine']}",
        "",
        "## Cyclic garbage per finished request",
        "",
        f"{meta['requests']} requests per scenario, the collector off while they ran; objects "
        "one collection then found unreachable (only the cycle collector frees them), all and "
        "the proxy's own (sidecar.proxy, .meter, .protocol, .record).",
        "",
        "| scenario | all objects / request | the proxy's / request | the proxy's classes |",
        "|---|---:|---:|---|",
    ]
    for row in result["requests"]:
        classes = ", ".join(
            f"{k.rsplit('.', 1)[1]} {v:.1f}" for k, v in row["proxy_garbage_classes"].items()
        )
        lines.append(
            f"| {row['scenario']} | {row['garbage_per_request']:.1f} "
            f"| {row['proxy_garbage_per_request']:.1f} | {classes or '-'} |"
        )
    if result["streams"]:
        lines += [
            "",
            "## Held streams",
            "",
            "Streams open through the proxy (one token per engine step of "
            f"{meta['step_s']} s); objects the collector tracks beyond those of start-up "
            "(frozen), and one full collection (`gc.collect()`, the median of three).",
            "",
            "| streams | tracked objects | per stream | full collection ms |",
            "|---:|---:|---:|---:|",
        ]
        for row in result["streams"]:
            lines.append(
                f"| {row['streams']} | {row['tracked_objects']:,} "
                f"| {row['tracked_per_stream']:.1f} | {row['full_collection_ms']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenarios",
        type=lambda text: [s for s in text.split(",") if s],
        default=list(SCENARIOS),
        help=f"comma-separated, from {', '.join(SCENARIOS)} [all]",
    )
    parser.add_argument("--requests", type=int, default=20, help="per scenario [20]")
    parser.add_argument(
        "--streams",
        type=lambda text: [int(s) for s in text.split(",") if s],
        default=[250, 1000, 2000],
        help="comma-separated numbers of streams held open, ascending [250,1000,2000]",
    )
    parser.add_argument("--step-s", type=float, default=1.0, help="simulator's engine step [1]")
    parser.add_argument("--json-out")
    parser.add_argument("--md-out")
    parser.add_argument(
        "--smoke", action="store_true", help="CI: 3 requests, 2 scenarios, 20 streams"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios: {', '.join(sorted(unknown))}")
    if args.smoke:
        args.scenarios, args.requests, args.streams = ["stream", "client_leaves"], 3, [20]
    if args.streams != sorted(args.streams):
        raise SystemExit("--streams must be ascending")
    po.raise_nofile_limit(4 * max([*args.streams, 1]) + 256)
    meta = {
        "command": "python benchmarks/gc_census.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": po.machine_line(),
        "requests": args.requests,
        "step_s": args.step_s,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    import uvloop

    with tempfile.TemporaryDirectory(prefix="gc-census-") as tmp:
        result = uvloop.run(measure(args, Path(tmp)))
    text = report(meta, result)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"meta": meta, **result}, indent=1) + "\n")
    if args.md_out:
        Path(args.md_out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
