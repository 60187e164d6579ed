"""How late a loopback message reaches an idle uvloop reader, by how long the reader was idle.

    python benchmarks/wakeup_latency.py --json-out benchmarks/results/wakeup_latency.json \\
        --md-out benchmarks/results/wakeup_latency.out.md   # the run (about 2 minutes)
    python benchmarks/wakeup_latency.py --smoke              # CI: seconds, no timing claims

Why: a relay that has been idle pays, on its next read, whatever the host makes a message wait
after a quiet spell; each loopback hop of an idle proxy pays it once (docs/metrics.md, "How late
a stamp may be"; sidecar/proxy/rxstamp.py). This harness measures it by the length of the quiet,
and separates what the idle core's halt costs (the ``busy`` placement keeps that core from
halting) from what code that has not run for a while costs anyway (the reference without any
wake-up, below). Results and reading: benchmarks/results/wakeup_latency.out.md.

Two OS processes, one TCP connection on 127.0.0.1 (``TCP_NODELAY`` both ends):

- the reader (this process, pinned to ``--receiver-core``, default 1): a uvloop loop with a
  reader callback on the socket (``loop.add_reader``; not uvloop's own TCP transport, whose
  reads in C give no access to ancillary data: the same path as the proxy's
  ``rxstamp.StampedTransport``). The callback stamps CLOCK_MONOTONIC as its first statement,
  then ``recvmsg`` returns the message and, with ``SO_TIMESTAMPNS`` set, the kernel's software
  receive timestamp of the segment (CLOCK_REALTIME, converted to the monotonic clock with
  `sidecar.clock.from_realtime_ns`, as the proxy does). It answers each message with a 1-byte
  ack and stamps the instant it goes back to the loop: from then on it is idle.
- the sender (a forked child): waits for the ack, then waits the chosen quiet interval from the
  ack's arrival, stamps CLOCK_MONOTONIC and sends a 16-byte message carrying the stamp and its
  sequence number. CLOCK_MONOTONIC is one system-wide clock on Linux, so the stamps of the two
  processes compare directly.

Per message, in µs: **send -> callback** (the reader callback's stamp - the send stamp), split
into **send -> kernel** (the kernel's receive stamp - the send stamp: on loopback the segment
enters the receive path inside the sender's ``send``, so this is the sender's own syscall down to
the loopback device, no wake-up) and **kernel -> callback** (the reader callback's stamp - the
kernel's: the TCP receive, the wake-up of the reading process and of its core, epoll returning,
uvloop's dispatch to the Python callback). The quiet actually seen by the reader (send stamp -
the instant it went idle after the previous message) is reported beside the nominal one. Also,
per interval, the halts ("usage" of the cpuidle states other than POLL, from
/sys/devices/system/cpu/cpuN/cpuidle) on the reader's core per message: ~1 means the core went
to sleep before (nearly) every message.

Placements (``--placements``, each run once per round, rounds alternate the orders):

- ``idle``: sender on ``--sender-core`` (0), reader alone on its core, idle between messages;
- ``idle-protocol``: the same with uvloop's own TCP transport and an asyncio Protocol as the
  reader (what the proxy's listener and TLS upstreams use), stamped first thing in
  ``data_received``; no kernel stamp there (uvloop reads in C), so only send -> callback;
- ``busy``: the same, plus a spinner process on the reader's core at ``SCHED_IDLE`` (the lowest
  priority: the woken reader preempts it at once), so the reader's core never halts: the
  reference without the idle-core wake-up;
- ``same-core``: the sender on the reader's core too. It sleeps (``time.sleep``, so the quiet
  overshoots the nominal at the shortest intervals: read the actual quiet), its timer wakes the
  core, and its ``send`` wakes the reader on a core already awake.

In ``idle`` and ``busy`` the sender sleeps until ``--spin-tail-ms`` (0.3 ms) before the deadline
and spins the rest (precise quiet; its core awake when it sends, like an engine computing), and
waits for the ack by spinning on a non-blocking ``recv``. Before the first measured message,
``--warmup`` messages (1 ms apart) are not counted; one TCP connection per placement and round.
Quiet intervals: ``--intervals-ms`` (default 0.05 ... 50 ms), ``--n`` messages each, fewer
where ``--n`` x interval would exceed ``--max-s-per-interval``, split over ``--rounds``.
Before each placement's run, a bounded wait for other processes on the host to go quiet
(``--quiet-below`` cores), printed. Percentiles are numpy's (linear), over all rounds.

A reference without any wake-up (``--cold-n``, after the placements): this process, on the
reader's core, spins through each quiet interval (its core never idles, nothing wakes) and then
times a ``getppid()`` syscall and a ``json.dumps`` of a small dict: how much slower code runs
after that long without running it (caches, TLBs, predictors, whatever the host did meanwhile).

Caveats: the kernel's stamp is taken where the segment enters the host's receive path
(``netif_rx``, inside the sender's ``send`` on loopback); converting it from CLOCK_REALTIME to
the monotonic clock is exact up to the calendar clock's slewing (<= 0.5 µs per ms under NTP,
and the conversion is done within µs of the stamp). The callback's stamp is Python's first
statement in the callback, after uvloop's dispatch: the busy placement's kernel -> callback is
that floor. A message of the harness is not a proxy: what carries over is the wake-up cost per
hop of an idle process, not the absolute figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po  # noqa: E402  (machine line, percentiles, quiet wait)

from sidecar import clock  # noqa: E402
from sidecar.proxy import rxstamp  # noqa: E402

HOST = po.HOST
PLACEMENTS = ("idle", "idle-protocol", "busy", "same-core")
DEFAULT_INTERVALS_MS = (0.05, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
MESSAGE = struct.Struct("<qq")  # sequence number, the sender's CLOCK_MONOTONIC send stamp (ns)
TIMESPEC = struct.Struct("@qq")
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
ANCILLARY_SIZE = socket.CMSG_SPACE(TIMESPEC.size)
WARMUP_INTERVAL_MS = 1.0
QUANTITIES = ("total", "send_kernel", "kernel_callback", "quiet")


def mono_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# ---------------------------------------------------------------------------------------------
# The schedule: one nominal quiet interval per message


def interval_counts(
    intervals_ms: Sequence[float], n: int, max_s: float, rounds: int
) -> dict[float, int]:
    """Messages per round for each interval: n / rounds, fewer where the interval is long."""
    counts = {}
    for interval in intervals_ms:
        total = min(n, int(max_s * 1000.0 / interval)) if interval > 0 else n
        counts[interval] = max(1, total // rounds)
    return counts


def round_schedule(counts: dict[float, int], warmup: int, reverse: bool) -> list[float]:
    order = sorted(counts, reverse=reverse)
    schedule = [WARMUP_INTERVAL_MS] * warmup
    for interval in order:
        schedule += [interval] * counts[interval]
    return schedule


# ---------------------------------------------------------------------------------------------
# The processes: sender, spinner


def sender(port: int, schedule_ms: Sequence[float], core: int | None, spin_tail_ms: float) -> None:
    """Send one message per schedule entry, each after the ack of the previous one and the
    entry's quiet interval. ``spin_tail_ms`` < 0: sleep the whole interval, block for acks."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    sock = socket.create_connection((HOST, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    spin = spin_tail_ms >= 0
    tail_ns = int(spin_tail_ms * 1e6)
    if spin:
        sock.setblocking(False)

    def wait_ack() -> None:
        while True:
            try:
                got = sock.recv(1)
            except BlockingIOError:
                continue
            if not got:
                raise ConnectionError("reader closed")
            return

    time.sleep(0.2)  # the reader attaches its callback
    for seq, interval_ms in enumerate(schedule_ms):
        if seq:
            wait_ack()
        interval_ns = int(interval_ms * 1e6)
        if spin:
            deadline = mono_ns() + interval_ns
            rest = deadline - tail_ns - mono_ns()
            if rest > 0:
                time.sleep(rest / 1e9)
            while mono_ns() < deadline:
                pass
        else:
            time.sleep(interval_ns / 1e9)
        sock.send(MESSAGE.pack(seq, mono_ns()))
    wait_ack()
    sock.close()


def start_child(target: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            target()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid


def spinner(core: int) -> None:
    """Keep ``core`` busy at the lowest priority, so that it never goes idle."""
    os.sched_setaffinity(0, {core})
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    while True:
        pass


def stop_child(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


# ---------------------------------------------------------------------------------------------
# The host's idle states


def cpuidle_dir(core: int) -> Path:
    return Path(f"/sys/devices/system/cpu/cpu{core}/cpuidle")


def halts(core: int) -> int | None:
    """Entries of the core's idle states other than POLL (the guest halting), None if unknown."""
    total = 0
    found = False
    for state in sorted(cpuidle_dir(core).glob("state*")):
        try:
            if (state / "name").read_text().strip() == "POLL":
                continue
            total += int((state / "usage").read_text())
            found = True
        except (OSError, ValueError):
            continue
    return total if found else None


def idle_line(core: int) -> str:
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "?"

    base = "/sys/devices/system/cpu/cpuidle"
    states = []
    for state in sorted(cpuidle_dir(core).glob("state*")):
        states.append(f"{read(str(state / 'name'))} (latency {read(str(state / 'latency'))} µs)")
    poll_ns = read("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    return (
        f"cpuidle: driver {read(base + '/current_driver')}, governor "
        f"{read(base + '/current_governor_ro')}, core {core} states: "
        f"{', '.join(states) or '?'}; haltpoll guest_halt_poll_ns {poll_ns}; clocksource "
        f"{read('/sys/devices/system/clocksource/clocksource0/current_clocksource')}"
    )


# ---------------------------------------------------------------------------------------------
# The reader


def measure(
    placement: str,
    schedule_ms: Sequence[float],
    receiver_core: int | None,
    sender_core: int | None,
    spin_tail_ms: float,
    warmup: int,
    timeout_s: float,
) -> dict[str, Any]:
    """One connection: the samples of every counted message (by nominal interval) and the
    halts of the reader's core per interval."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    children = []
    if placement.startswith("busy") and receiver_core is not None:
        children.append(start_child(lambda: spinner(receiver_core)))
    send_core = receiver_core if placement == "same-core" else sender_core
    tail = -1.0 if placement == "same-core" else spin_tail_ms
    children.append(start_child(lambda: sender(port, schedule_ms, send_core, tail)))
    loop = uvloop.new_event_loop()
    try:
        listener.settimeout(30)
        conn, _ = listener.accept()
        listener.close()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stamped = False
        conn.setblocking(False)
        samples: dict[float, dict[str, list[float]]] = {}
        block_halts: dict[float, int] = {}
        state: dict[str, Any] = {
            "idle_since": 0,
            "unstamped": 0,
            "odd_reads": 0,
            "last_halts": None,
            "buffer": bytearray(),
            "done": loop.create_future(),
        }
        # The reader's core's halts are read after the last message of each block (and of the
        # warm-up: the baseline).
        last_of_block = {
            seq
            for seq in range(len(schedule_ms))
            if seq + 1 == len(schedule_ms)
            or seq + 1 == warmup
            or schedule_ms[seq + 1] != schedule_ms[seq]
        }
        protocol = placement.endswith("-protocol")

        def finish() -> None:
            if not protocol:
                loop.remove_reader(conn.fileno())
            if not state["done"].done():
                state["done"].set_result(None)

        def handle(
            callback_ns: int, data: bytes, kernel_ns: int | None, write: Callable[[bytes], Any]
        ) -> None:
            buffer: bytearray = state["buffer"]
            buffer += data
            messages = []
            while len(buffer) >= MESSAGE.size:
                messages.append(MESSAGE.unpack_from(buffer))
                del buffer[: MESSAGE.size]
            if len(messages) != 1 or buffer:
                state["odd_reads"] += 1  # never expected: one message in flight at a time
            elif messages[0][0] >= warmup:
                seq, send_ns = messages[0]
                block = samples.setdefault(schedule_ms[seq], {q: [] for q in QUANTITIES})
                block["total"].append((callback_ns - send_ns) / 1e3)
                block["quiet"].append((send_ns - state["idle_since"]) / 1e3)
                if kernel_ns is None:
                    state["unstamped"] += 1
                else:
                    block["send_kernel"].append((kernel_ns - send_ns) / 1e3)
                    block["kernel_callback"].append((callback_ns - kernel_ns) / 1e3)
            for seq, _send_ns in messages:
                if seq in last_of_block and receiver_core is not None:
                    count = halts(receiver_core)
                    if count is not None and state["last_halts"] is not None and seq >= warmup:
                        interval = schedule_ms[seq]
                        block_halts[interval] = (
                            block_halts.get(interval, 0) + count - state["last_halts"]
                        )
                    state["last_halts"] = count
            if messages:
                write(b"a" * len(messages))
            state["idle_since"] = mono_ns()

        def on_readable() -> None:
            callback_ns = mono_ns()
            try:
                data, ancillary, _flags, _address = conn.recvmsg(256, ANCILLARY_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            now_ns = mono_ns()
            if not data:
                finish()
                return
            kernel_ns = None
            if (
                ancillary
                and ancillary[0][1] == SO_TIMESTAMPNS
                and len(ancillary[0][2]) == TIMESPEC.size
            ):
                seconds, nanoseconds = TIMESPEC.unpack(ancillary[0][2])
                kernel_ns = clock.from_realtime_ns(seconds * 1_000_000_000 + nanoseconds, now_ns)
            handle(callback_ns, data, kernel_ns, conn.send)

        class Reader(asyncio.Protocol):
            """uvloop's own TCP transport: data_received, no kernel stamp."""

            transport: Any  # uvloop's TCPTransport (not an asyncio.Transport subclass)

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport

            def data_received(self, data: bytes) -> None:
                handle(mono_ns(), data, None, self.transport.write)

            def connection_lost(self, exc: Exception | None) -> None:
                finish()

        if protocol:
            loop.run_until_complete(loop.connect_accepted_socket(Reader, conn))
        else:
            stamped = rxstamp.enable(conn)
            loop.add_reader(conn.fileno(), on_readable)
        loop.run_until_complete(asyncio.wait_for(state["done"], timeout_s))
        conn.close()
        _, status = os.waitpid(children.pop(), 0)  # the sender: it has ended by itself
        if status:
            raise RuntimeError(f"{placement}: the sender failed (wait status {status})")
    finally:
        loop.close()
        for pid in children:
            stop_child(pid)
    return {
        "samples": samples,
        "halts": block_halts,
        "stamped": stamped,
        "unstamped": state["unstamped"],
        "odd_reads": state["odd_reads"],
    }


def cold_probe(intervals_ms: Sequence[float], n: int) -> dict[str, dict[str, float | None]]:
    """No wake-up at all: this process spins through the quiet (its core never idles), then
    times two operations it has not run meanwhile: a ``getppid()`` syscall and a
    ``json.dumps`` of a small dict (no syscall). µs per operation, by quiet interval."""
    payload = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": " x"}}]}
    result: dict[str, dict[str, float | None]] = {}
    for interval in intervals_ms:
        timed: dict[str, list[float]] = {"getppid": [], "json.dumps": []}
        for _ in range(n):
            for name in timed:
                deadline = mono_ns() + int(interval * 1e6)
                while mono_ns() < deadline:
                    pass
                start = mono_ns()
                if name == "getppid":
                    os.getppid()
                else:
                    json.dumps(payload)
                timed[name].append((mono_ns() - start) / 1e3)
        result[interval_key(interval)] = {
            name: summarise(values)["p50"] for name, values in timed.items()
        }
    return result


# ---------------------------------------------------------------------------------------------
# Report


def summarise(values: Sequence[float]) -> dict[str, float | None]:
    """n, p50, p90, p99, max (None where there are no values: the -protocol reader's parts)."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "n": len(values),
        "p50": po.pct(values, 50),
        "p90": po.pct(values, 90),
        "p99": po.pct(values, 99),
        "max": max(values),
    }


def fmt(value: float | None, spec: str = "{:.0f}") -> str:
    return "-" if value is None or value != value else spec.format(value)


def report(meta: dict[str, Any], summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        f"# {meta['command']}",
        f"# {meta['machine']}",
        f"# {meta['cpuidle']}",
        f"# started {meta['started']}; reader core {meta['receiver_core']}, sender core "
        f"{meta['sender_core']}; {meta['rounds']} round(s); spin tail {meta['spin_tail_ms']} ms",
        f"# background before each run (other processes, cores): {meta['background']}",
        "",
        "send -> reader callback, µs (the sender's stamp to the first statement of the reader's "
        "callback; quiet: the reader's idle time before the message, actual p50, ms):",
        "",
        "| placement | quiet ms | actual quiet p50 | n | p50 | p90 | p99 | max | halts/msg |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for placement, rows in summary.items():
        for key, row in rows.items():
            t = row["total"]
            lines.append(
                f"| {placement} | {key} | {fmt(row['quiet']['p50'] / 1e3, '{:.3f}')} | {t['n']} "
                f"| {fmt(t['p50'])} | {fmt(t['p90'])} | {fmt(t['p99'])} | {fmt(t['max'])} "
                f"| {fmt(row['halts_per_message'], '{:.2f}')} |"
            )
    lines += [
        "",
        "The two parts, µs: send -> kernel (the segment's kernel receive stamp, SO_TIMESTAMPNS) "
        "and kernel -> callback (the wake-up of the reader):",
        "",
        "| placement | quiet ms | send->kernel p50 | p99 | max | kernel->callback p50 | p90 "
        "| p99 | max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for placement, rows in summary.items():
        if placement.endswith("-protocol"):
            continue  # uvloop's transport: no kernel stamp
        for key, row in rows.items():
            s, k = row["send_kernel"], row["kernel_callback"]
            lines.append(
                f"| {placement} | {key} | {fmt(s['p50'], '{:.1f}')} | {fmt(s['p99'], '{:.1f}')} "
                f"| {fmt(s['max'], '{:.1f}')} | {fmt(k['p50'])} | {fmt(k['p90'])} "
                f"| {fmt(k['p99'])} | {fmt(k['max'])} |"
            )
    if "idle" in summary and "busy" in summary:
        lines += [
            "",
            "The idle core's wake-up: send -> callback p50 (p99), µs, reader idle vs busy core:",
            "",
            "| quiet ms | idle | busy | idle - busy, p50 |"
            + (" same-core |" if "same-core" in summary else ""),
            "|---:|---:|---:|---:|" + ("---:|" if "same-core" in summary else ""),
        ]
        for key, row in summary["idle"].items():
            busy = summary["busy"].get(key)
            if busy is None:
                continue
            i, b = row["total"], busy["total"]
            line = (
                f"| {key} | {fmt(i['p50'])} ({fmt(i['p99'])}) | {fmt(b['p50'])} "
                f"({fmt(b['p99'])}) | {fmt(i['p50'] - b['p50'])} |"
            )
            same = summary.get("same-core", {}).get(key)
            if "same-core" in summary:
                line += (
                    f" {fmt(same['total']['p50'])} ({fmt(same['total']['p99'])}) |"
                    if same
                    else " - |"
                )
            lines.append(line)
    if meta.get("cold"):
        lines += [
            "",
            "Reference without any wake-up: this process spins through the quiet on the reader's "
            "core, then runs an operation it has not run meanwhile, µs p50 "
            f"({meta['cold_n']} each):",
            "",
            "| quiet ms | getppid() | json.dumps (small dict) |",
            "|---:|---:|---:|",
        ]
        for key, row in meta["cold"].items():
            lines.append(
                f"| {key} | {fmt(row['getppid'], '{:.1f}')} | {fmt(row['json.dumps'], '{:.1f}')} |"
            )
    lines += ["", f"# checks: {'; '.join(meta['checks']) or 'ok'}", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Main


def interval_key(interval_ms: float) -> str:
    return f"{interval_ms:g}"


def run(args: argparse.Namespace) -> int:
    command = "python benchmarks/wakeup_latency.py " + " ".join(sys.argv[1:])
    if not rxstamp.SUPPORTED:
        print("SKIPPED: kernel receive timestamps need Linux (x86-64/arm64/riscv64)")
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"skipped": "not Linux"}) + "\n")
        return 0
    rxstamp.hold_timestamping()  # the kernel stamps from the first message on
    pin = po.can_pin() and not args.no_pin
    receiver_core = args.receiver_core if pin else None
    sender_core = args.sender_core if pin else None
    placements = [p for p in args.placements if pin or p.startswith("idle")]
    if receiver_core is not None:
        os.sched_setaffinity(0, {receiver_core})
    counts = interval_counts(args.intervals_ms, args.n, args.max_s_per_interval, args.rounds)
    meta: dict[str, Any] = {
        "command": command,
        "machine": po.machine_line().replace("\n# ", "; "),
        "cpuidle": idle_line(receiver_core if receiver_core is not None else 0),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "receiver_core": receiver_core,
        "sender_core": sender_core,
        "placements": placements,
        "intervals_ms": list(args.intervals_ms),
        "messages_per_round": {interval_key(k): v for k, v in counts.items()},
        "rounds": args.rounds,
        "warmup": args.warmup,
        "spin_tail_ms": args.spin_tail_ms,
        "background": [],
        "checks": [],
    }
    print(f"# {meta['machine']}\n# {meta['cpuidle']}", flush=True)
    merged: dict[str, dict[float, dict[str, list[float]]]] = {p: {} for p in placements}
    halts_sum: dict[str, dict[float, int]] = {p: {} for p in placements}
    for rnd in range(args.rounds):
        schedule = round_schedule(counts, args.warmup, reverse=rnd % 2 == 1)
        order = placements if rnd % 2 == 0 else list(reversed(placements))
        for placement in order:
            background = (
                po.wait_quiet([], args.quiet_below, args.quiet_wait_s)
                if args.quiet_below > 0
                else None
            )
            background_text = "-" if background is None else f"{background:.2f}"
            meta["background"].append(f"r{rnd + 1} {placement} {background_text}")
            started = time.monotonic()
            got = measure(
                placement,
                schedule,
                receiver_core,
                sender_core,
                args.spin_tail_ms,
                args.warmup,
                args.timeout_s,
            )
            for interval, block in got["samples"].items():
                into = merged[placement].setdefault(interval, {q: [] for q in QUANTITIES})
                for q in QUANTITIES:
                    into[q] += block[q]
            for interval, count in got["halts"].items():
                halts_sum[placement][interval] = halts_sum[placement].get(interval, 0) + count
            kernel_stamps = not placement.endswith("-protocol")
            if kernel_stamps and not got["stamped"]:
                meta["checks"].append(f"r{rnd + 1} {placement}: SO_TIMESTAMPNS refused")
            if kernel_stamps and got["unstamped"]:
                meta["checks"].append(
                    f"r{rnd + 1} {placement}: {got['unstamped']} messages without kernel stamp"
                )
            if got["odd_reads"]:
                meta["checks"].append(
                    f"r{rnd + 1} {placement}: {got['odd_reads']} reads not one whole message"
                )
            print(
                f"# r{rnd + 1} {placement}: {sum(len(b['total']) for b in got['samples'].values())}"
                f" messages in {time.monotonic() - started:.1f} s, background before "
                f"{background_text} cores",
                flush=True,
            )
    if args.cold_n > 0:
        meta["cold_n"] = args.cold_n
        meta["cold"] = cold_probe(args.intervals_ms, args.cold_n)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for placement in placements:
        rows: dict[str, dict[str, Any]] = {}
        for interval in sorted(merged[placement]):
            block = merged[placement][interval]
            row: dict[str, Any] = {q: summarise(block[q]) for q in QUANTITIES}
            n_halts = halts_sum[placement].get(interval)
            row["halts_per_message"] = (
                n_halts / len(block["total"]) if n_halts is not None and block["total"] else None
            )
            rows[interval_key(interval)] = row
        summary[placement] = rows
    text = report(meta, summary)
    print(text, end="")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"meta": meta, "summary": summary}, indent=1) + "\n"
        )
    if args.md_out:
        Path(args.md_out).write_text(text)
    return 1 if meta["checks"] else 0


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--intervals-ms",
        type=floats,
        default=list(DEFAULT_INTERVALS_MS),
        help="quiet intervals before a message, ms [0.05,0.2,0.5,1,2,5,10,20,50]",
    )
    parser.add_argument("--n", type=int, default=400, help="messages per interval [400]")
    parser.add_argument(
        "--max-s-per-interval",
        type=float,
        default=8.0,
        help="fewer messages where n x interval exceeds this, per placement [8 s]",
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds, orders alternating [2]")
    parser.add_argument(
        "--placements",
        type=lambda s: [p for p in s.split(",") if p],
        default=list(PLACEMENTS),
        help="idle, idle-protocol, busy, same-core [all four]",
    )
    parser.add_argument("--receiver-core", type=int, default=1)
    parser.add_argument("--sender-core", type=int, default=0)
    parser.add_argument(
        "--no-pin", action="store_true", help="pin nothing (only the idle placements run)"
    )
    parser.add_argument("--warmup", type=int, default=20, help="uncounted first messages [20]")
    parser.add_argument(
        "--spin-tail-ms",
        type=float,
        default=0.3,
        help="the sender spins this last part of each interval (idle, busy) [0.3]",
    )
    po.add_quiet_arguments(parser, 0.3, 20.0, "run")
    parser.add_argument(
        "--cold-n",
        type=int,
        default=100,
        help="the no-wake-up reference: operations per interval, 0: none [100]",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per connection [300]")
    parser.add_argument("--json-out", help="write the summary as JSON")
    parser.add_argument("--md-out", help="write the printed report here too")
    parser.add_argument("--smoke", action="store_true", help="CI: seconds, no timing claims")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = set(args.placements) - set(PLACEMENTS)
    if unknown:
        raise SystemExit(f"unknown placement(s): {', '.join(sorted(unknown))}")
    if args.smoke:
        args.intervals_ms, args.n, args.rounds, args.warmup = [0.2, 1.0], 10, 1, 3
        args.cold_n = 5
        args.quiet_below, args.timeout_s = 0.0, 30.0
    po.exit_on_sigterm()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
