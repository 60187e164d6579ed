"""Instructions per event of the measuring core's common read, counted by callgrind.

    python benchmarks/meter_instructions.py                        # this tree (~1 minute)
    python benchmarks/meter_instructions.py --tree /tmp/before     # another tree, for an A/B
    python benchmarks/meter_instructions.py --scope read           # the whole per-read relay
    python benchmarks/meter_instructions.py --scope timers         # a deadline added, cancelled
    python benchmarks/meter_instructions.py --smoke                # CI: no valgrind, no claim

Timing the measuring core (`hot_paths.py`) on a shared 2-vCPU VM moves by 30-50 % from run to
run; an instruction count does not: ``valgrind --tool=callgrind`` counts the instructions the
process executed, the same for the same code and input whatever else the host is doing. What
runs: `StreamMeter.feed` over N vLLM chat token events with continuous usage, one event per
read, the usage the proxy injected cut back out (the one-event lane, what almost every read of a
stream is; names as vLLM writes them: a 41-character id, a creation second, a model path,
where until session 23 one-character names understated the walk over a chunk's head). The
process is run four times, N and 2N events, each with and without the feeding
(the setup alone: imports, building the events), and the instructions per event are

    ((run(2N) - run(N)) - (setup(2N) - setup(N))) / N

so that neither the interpreter's start nor the events' making counts. Instructions are not
time (a cache miss costs more than an add), but a change that removes instructions from this
loop removes work from every read of every stream.

``--scope read``: the relay's whole per-read path after the socket, in one process: each event
arrives as one HTTP chunk (``<size>\r\n<event>\r\n``) fed to a real `UpstreamExchange`
(httptools framing, the body callback), whose `MeteredRead` measures it (the same lane), stamps
it and writes it, chunk-framed, to a real `ClientExchange` over a transport that only counts
the bytes. Not counted: the socket reads and writes (`StampedTransport`, the kernel) and the
event loop's dispatch. Its stand-in client connection is not the listener's class, which the
compiled request path would refuse (setup.py): that child runs the source
(``SIDECAR_INTERPRETED=1``, sidecar/_compiled.py), and counts the interpreted read; the default
scope counts the meter as installed (compiled where it was built).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The child: builds the events, then feeds them unless told "setup".
CHILD = r"""
import json, sys
from sidecar.meter import StreamMeter
from sidecar.protocol.rewrite import UsagePlan

n, mode = int(sys.argv[1]), sys.argv[2]
def event(i):
    chunk = {"id": "chatcmpl-" + "8d2f0c4e9b1a47f6" * 2, "object": "chat.completion.chunk",
             "created": 1764547200, "model": "meta-llama/Llama-3.1-8B-Instruct",
             "choices": [{"index": 0, "delta": {"content": " hi"}, "logprobs": None,
                          "finish_reason": None, "token_ids": None}],
             "usage": {"prompt_tokens": 12, "total_tokens": 12 + i, "completion_tokens": i}}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
events = [event(i) for i in range(1, n + 1)]
if mode == "feed":
    # The proxy's plan when the client asked for no usage: both injected, both cut back out.
    meter = StreamMeter(0, UsagePlan(False, False, True, True))
    feed = meter.feed
    for at, raw in enumerate(events):
        out = feed(raw, at)
    assert meter.events == n and meter.token_totals[1] == n, "the events were not all counted"
    assert b'"usage"' not in out, "the injected usage was not cut"
"""

# The child of ``--scope read``: the same events as HTTP chunks through the relay's objects.
READ_CHILD = r"""
import asyncio, json, sys
try:
    from sidecar.proxy.headers import NO_HEADERS
except ImportError:  # a tree before the request's headers were read without a multidict
    from multidict import CIMultiDict, CIMultiDictProxy
    NO_HEADERS = CIMultiDictProxy(CIMultiDict())
from sidecar.meter import StreamMeter
from sidecar.protocol.rewrite import UsagePlan
from sidecar.proxy.builder import RecordBuilder
from sidecar.proxy.listener import ClientExchange, IncomingRequest
from sidecar.proxy.stream_relay import MeteredRead
from sidecar.proxy.timeouts import Timeouts
from sidecar.proxy.upstream import ArrivalBatch, UpstreamConnection, UpstreamExchange

n, mode = int(sys.argv[1]), sys.argv[2]
def event(i):
    chunk = {"id": "chatcmpl-" + "8d2f0c4e9b1a47f6" * 2, "object": "chat.completion.chunk",
             "created": 1764547200, "model": "meta-llama/Llama-3.1-8B-Instruct",
             "choices": [{"index": 0, "delta": {"content": " hi"}, "logprobs": None,
                          "finish_reason": None, "token_ids": None}],
             "usage": {"prompt_tokens": 12, "total_tokens": 12 + i, "completion_tokens": i}}
    data = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)
reads = [event(i) for i in range(1, n + 1)]

class ClientTransport:  # takes the client's writes, counts their bytes
    def __init__(self): self.written = 0
    def write(self, data): self.written += len(data)
    def get_write_buffer_size(self): return 0
    def is_closing(self): return False
class ClientConnection:
    def __init__(self): self.transport = ClientTransport()
class UpstreamTransport:
    def is_closing(self): return False
    def abort(self): raise AssertionError("the relay aborted the upstream")

async def main():
    loop = asyncio.get_running_loop()
    request = IncomingRequest("POST", "/v1/chat/completions", "/v1/chat/completions",
                              NO_HEADERS, b"{}", "1.1", True)
    client = ClientConnection()
    exchange = ClientExchange(client, request)
    exchange.start(200, "OK", [("Content-Type", "text/event-stream")], None)
    connection = UpstreamConnection(("upstream", 8000, False), ArrivalBatch(loop))
    connection.connection_made(UpstreamTransport())
    upstream = UpstreamExchange(connection, False)
    connection.exchange = upstream
    upstream.feed(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                  b"transfer-encoding: chunked\r\n\r\n", 0)
    await upstream.response()
    builder = RecordBuilder("r", 0, 0, "chat")
    meter = StreamMeter(0, UsagePlan(False, False, True, True))
    run = MeteredRead(upstream, meter, builder, Timeouts(), exchange)
    if hasattr(run, "start"):
        run.start()
    else:  # a tree before 3da64c5: the relay's coroutine hands the reads over
        body = asyncio.ensure_future(run.body())  # held: an unreferenced task may be collected
        await asyncio.sleep(0)
    if mode == "feed":
        feed = upstream.feed
        for at, raw in enumerate(reads):
            feed(raw, at)
        assert meter.events == n and builder.down_events == n, "the events were not all relayed"
        assert client.transport.written < sum(map(len, reads)), "the injected usage was not cut"
asyncio.run(main())
"""

# The child of ``--scope receive``: N reads of one 300-byte event each from a TCP socket with
# SO_TIMESTAMPNS (what an upstream connection's reads are), each sent just before; the mode
# picks the read: "c" (`_recvstamp.receive`), "python" (`rxstamp.receive_with_python`) or
# "recv" (a plain `socket.recv`, no stamp: what any reader pays).
RECEIVE_CHILD = r"""
import socket, sys, time
from sidecar.proxy import rxstamp
n, mode = int(sys.argv[1]), sys.argv[2]
rxstamp.hold_timestamping()  # the kernel turns stamping on a little after it is first asked
time.sleep(0.2)
with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
rxstamp.enable(receiver)
sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
payload = b"x" * 300
read = rxstamp.ReadBuffer()
fd, view, send = receiver.fileno(), read.view, sender.send
if mode == "c":
    from sidecar.proxy._recvstamp import receive
    for _ in range(n):
        send(payload)
        data, stamp = receive(fd, view)
        assert len(data) == 300 and stamp > 0
elif mode == "python":
    receive = rxstamp.receive_with_python
    for _ in range(n):
        send(payload)
        data, stamp = receive(receiver, read)
        assert len(data) == 300 and stamp > 0
else:
    recv = receiver.recv
    for _ in range(n):
        send(payload)
        assert len(recv(65536)) == 300
"""

# The child of ``--scope timers``: N deadlines added and cancelled on a running uvloop loop,
# each due in a minute and cancelled at once (a request's timeouts, its connection's keep-alive
# deadline, its pooled upstream connection's idle expiry: each request did three), with ten
# live ones far away; the loop runs every 64. The mode picks how: "uvloop" (`call_later` and
# `TimerHandle.cancel`, what each of them was), "alarms" (`Alarms.add` and `Alarms.cancel`,
# sidecar/proxy/timeouts.py) or "setup" (the loop and a clock reading, no deadline).
TIMER_CHILD = r"""
import asyncio, sys
import uvloop
from sidecar import clock
n, mode = int(sys.argv[1]), sys.argv[2]
try:
    from sidecar.proxy.timeouts import alarms_of
except ImportError:  # a tree from before the alarms
    alarms_of = None
def noop():
    pass
async def main():
    loop = asyncio.get_running_loop()
    alarms = alarms_of(loop) if alarms_of is not None else None
    if mode == "alarms" and alarms is None:
        sys.exit("this tree has no alarms (sidecar/proxy/timeouts.py): --scope timers counts them")
    for _ in range(10):
        now = clock.monotonic_ns()
        loop.call_later(600.0, noop)
        if alarms is not None:
            alarms.add(now + 600_000_000_000, now, noop)
    for i in range(n):
        now = clock.monotonic_ns()
        if mode == "uvloop":
            loop.call_later(60.0, noop).cancel()
        elif mode == "alarms":
            alarms.cancel(alarms.add(now + 60_000_000_000, now, noop))
        if i % 64 == 0:
            await asyncio.sleep(0)  # uvloop closes a cancelled timer's libuv handle in the loop
    await asyncio.sleep(0)
uvloop.run(main())
"""

_COLLECTED = re.compile(r"Collected : (\d+)")


def interpreted(child: str) -> dict[str, str]:
    """The read child's stand-ins need the source, not the compiled request path."""
    return {"SIDECAR_INTERPRETED": "1"} if child == READ_CHILD else {}


def count(tree: Path, child: str, n: int, mode: str) -> int:
    """Instructions the child executed (callgrind)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0", **interpreted(child)}
    proc = subprocess.run(
        [
            "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
            sys.executable, "-c", child, str(n), mode,
        ],
        cwd=tree, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = _COLLECTED.search(proc.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no count:\n{proc.stderr[-2000:]}")
    return int(found.group(1))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=REPO, help="the source tree to count [this]")
    parser.add_argument("--events", type=int, default=20_000, help="N [20000]")
    parser.add_argument(
        "--scope",
        choices=("meter", "read", "receive", "timers"),
        default="meter",
        help="the measuring core alone, the relay's per-read path, the upstream socket's "
        "read with its kernel stamp, C and Python (and a plain recv), or a deadline added and "
        "cancelled, as a uvloop timer and as an alarm [meter]",
    )
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CI: run the child once, no count")
    args = parser.parse_args(argv)
    tree = args.tree.resolve()
    child = CHILD if args.scope == "meter" else READ_CHILD
    if args.smoke:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        for smoke_child in (CHILD, READ_CHILD):
            subprocess.run(
                [sys.executable, "-c", smoke_child, "200", "feed"],
                env={**env, **interpreted(smoke_child)},
                check=True,
            )
        for mode in ("c", "python", "recv"):
            subprocess.run([sys.executable, "-c", RECEIVE_CHILD, "200", mode], env=env, check=True)
        for mode in ("uvloop", "alarms", "setup"):
            subprocess.run([sys.executable, "-c", TIMER_CHILD, "200", mode], env=env, check=True)
        print(
            "meter_instructions smoke: both children fed 200 events through the lane; "
            "the receive child read 200 events each way; the timer child added and cancelled "
            "200 deadlines each way"
        )
        return
    if shutil.which("valgrind") is None:
        print("SKIPPED: valgrind is not installed (apt-get install valgrind)")
        return
    n = args.events
    if args.scope == "receive":
        receive_instructions(tree, n, args.json_out)
        return
    if args.scope == "timers":
        timer_instructions(tree, n, args.json_out)
        return
    counts = {
        (mode, size): count(tree, child, size, mode)
        for mode in ("feed", "setup")
        for size in (n, 2 * n)
    }
    fed = counts[("feed", 2 * n)] - counts[("feed", n)]
    setup = counts[("setup", 2 * n)] - counts[("setup", n)]
    per_event = (fed - setup) / n
    result = {
        "tree": str(tree),
        "events": n,
        "scope": args.scope,
        "python": sys.version.split()[0],
        "counts": {f"{mode}_{size}": value for (mode, size), value in counts.items()},
        "instructions_per_event": round(per_event),
    }
    what = "StreamMeter.feed, one-event lane" if args.scope == "meter" else "the per-read relay"
    print(f"{tree}: {per_event:,.0f} instructions per event ({what})")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


def receive_instructions(tree: Path, n: int, json_out: Path | None) -> None:
    """``--scope receive``: instructions per read of each reader, (run(2N) - run(N)) / N, the
    send before each read included alike (so compare the three, not one alone)."""
    counts = {
        (mode, size): count(tree, RECEIVE_CHILD, size, mode)
        for mode in ("c", "python", "recv")
        for size in (n, 2 * n)
    }
    per_read = {
        mode: round((counts[(mode, 2 * n)] - counts[(mode, n)]) / n)
        for mode in ("c", "python", "recv")
    }
    print(
        f"{tree}: per read, the send before it included: C receive {per_read['c']:,}, "
        f"Python receive {per_read['python']:,}, plain socket.recv {per_read['recv']:,} "
        "instructions"
    )
    write_counts(json_out, tree, "receive", {"reads": n, "instructions_per_read": per_read}, counts)


def timer_instructions(tree: Path, n: int, json_out: Path | None) -> None:
    """``--scope timers``: instructions per deadline added and cancelled, each way, the loop
    and the clock reading taken out: ((run(2N) - run(N)) - (setup(2N) - setup(N))) / N."""
    modes = ("uvloop", "alarms", "setup")
    counts = {
        (mode, size): count(tree, TIMER_CHILD, size, mode) for mode in modes for size in (n, 2 * n)
    }
    setup = counts[("setup", 2 * n)] - counts[("setup", n)]
    per_deadline = {
        mode: round((counts[(mode, 2 * n)] - counts[(mode, n)] - setup) / n)
        for mode in ("uvloop", "alarms")
    }
    print(
        f"{tree}: per deadline added and cancelled: uvloop timer {per_deadline['uvloop']:,}, "
        f"alarm {per_deadline['alarms']:,} instructions"
    )
    write_counts(
        json_out,
        tree,
        "timers",
        {"deadlines": n, "instructions_per_deadline": per_deadline},
        counts,
    )


def write_counts(
    json_out: Path | None,
    tree: Path,
    scope: str,
    figures: dict[str, object],
    counts: dict[tuple[str, int], int],
) -> None:
    """A scope's results as JSON (when asked for): its figures and the raw counts."""
    if json_out is None:
        return
    result = {
        "tree": str(tree),
        "scope": scope,
        "python": sys.version.split()[0],
        **figures,
        "counts": {f"{mode}_{size}": value for (mode, size), value in counts.items()},
    }
    json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
