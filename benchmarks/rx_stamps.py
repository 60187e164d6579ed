"""What a kernel receive stamp costs per upstream read (sidecar/proxy/rxstamp.py).

    python benchmarks/rx_stamps.py --json-out benchmarks/results/rx_stamps.json   # ~20 s
    python benchmarks/rx_stamps.py --smoke                                       # CI: tiny

A sender process (core 0) writes one vLLM-sized SSE event to each of 128 loopback TCP
connections, then waits 4 ms, ``--rounds`` times; this process (core 1) reads them on uvloop in
one of three ways, in alternation, ``--repeats`` times each:

- ``uvloop``: uvloop's own TCP transport and an asyncio Protocol (``data_received``): what the
  proxy uses for TLS upstreams and under ``--server-stamps read``;
- ``nostamp``: `rxstamp.StampedTransport` on a socket without ``SO_TIMESTAMPNS`` (the loop's
  reader callback, ``recvmsg_into`` a shared buffer, one copy out): the transport's own cost;
- ``kernel``: the same with ``SO_TIMESTAMPNS`` set: each read's ancillary timestamp parsed and
  converted to the monotonic clock, what the proxy does by default.

The protocol does nothing but count, so the figures are the read path alone: this process's CPU
time (user + system, getrusage) over the run / the reads. Median over the repeats, in µs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po  # noqa: E402  (machine line)

from sidecar.proxy import rxstamp  # noqa: E402

MODES = ("uvloop", "nostamp", "kernel")
EVENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":" x"},"logprobs":null,"finish_reason":null}],'
    b'"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1}}\n\n'
)


class Counter(asyncio.Protocol):
    """Counts reads, both the uvloop way and the stamped way."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def data_received(self, data: bytes) -> None:
        self.state["reads"] += 1

    def data_received_at(self, data: bytes, at_ns: int) -> None:
        self.state["reads"] += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.state["lost"] += 1
        if self.state["lost"] == self.state["connections"]:
            self.state["done"].set_result(None)


def sender(port: int, connections: int, rounds: int, pin: bool) -> None:
    if pin:
        os.sched_setaffinity(0, {0})
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    time.sleep(0.3)
    for _ in range(rounds):
        for s in socks:
            s.send(EVENT)
        until = time.perf_counter() + 0.004
        while time.perf_counter() < until:  # busy: the reader alone decides when it sleeps
            pass
    for s in socks:
        s.close()


def one_run(mode: str, connections: int, rounds: int, pin: bool) -> float:
    """CPU µs per read of this process for one mode."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(connections)
    pid = os.fork()
    if pid == 0:
        try:
            sender(listener.getsockname()[1], connections, rounds, pin)
        finally:
            os._exit(0)
    accepted = [listener.accept()[0] for _ in range(connections)]
    listener.close()
    loop = uvloop.new_event_loop()
    state: dict[str, Any] = {
        "reads": 0,
        "lost": 0,
        "connections": connections,
        "done": loop.create_future(),
    }

    async def attach() -> None:
        buffer = rxstamp.ReadBuffer()
        for sock in accepted:
            sock.setblocking(False)
            if mode == "uvloop":
                await loop.connect_accepted_socket(lambda: Counter(state), sock)
            else:
                if mode == "kernel" and not rxstamp.enable(sock):
                    raise SystemExit("no kernel receive timestamps on this platform")
                rxstamp.StampedTransport(loop, sock, Counter(state), buffer)

    try:
        loop.run_until_complete(attach())
        before = resource.getrusage(resource.RUSAGE_SELF)
        loop.run_until_complete(state["done"])
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        loop.close()
        os.waitpid(pid, 0)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    reads: int = state["reads"]
    return cpu_s / reads * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--connections", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out")
    parser.add_argument("--smoke", action="store_true", help="CI: 8 connections, 20 rounds")
    args = parser.parse_args()
    if args.smoke:
        args.connections, args.rounds, args.repeats = 8, 20, 1
    if not rxstamp.SUPPORTED:
        print("kernel receive timestamps: not on this platform (Linux x86-64/arm64/riscv64)")
        return 2
    pin = po.can_pin()
    if pin:
        os.sched_setaffinity(0, {1})
    print(f"# {po.machine_line()}")
    print(
        f"# {args.connections} connections x {args.rounds} rounds, one event each, 4 ms apart; "
        f"sender core 0, reader core 1 ({'pinned' if pin else 'not pinned'})"
    )
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            runs[mode].append(one_run(mode, args.connections, args.rounds, pin))
    print()
    print("| read path | CPU µs per read, median | runs | vs uvloop |")
    print("|---|---:|---|---:|")
    base = statistics.median(runs["uvloop"])
    for mode in MODES:
        median = statistics.median(runs[mode])
        cells = ", ".join(f"{v:.2f}" for v in runs[mode])
        print(f"| {mode} | {median:.2f} | {cells} | {median - base:+.2f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
