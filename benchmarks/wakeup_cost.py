"""What one sleep and wake-up costs the woken process in CPU, on this host.

    python benchmarks/wakeup_cost.py                  # three rounds, about 10 s
    python benchmarks/wakeup_cost.py --smoke          # CI: a second, the harness only

Why: a relay's CPU per relayed event (`proxy_overhead.py`, `cpu_by_length.py`) holds, beside
its own work, every sleep in ``epoll_wait`` that ended in a wake-up: the switch out, the switch
back in, and whatever the host makes of them. Relays differ in how often they sleep (a relay that
finishes each read before the next arrives sleeps between reads; a busier one stays on the CPU
through a burst), so their CPU per event can differ by their sleeps alone. This harness measures
the price of one sleep on the host, so that the harnesses can say how much of a relay's CPU its
sleeps were (wake-ups per event x this price) and how much its work.

Two processes and a pipe, pinned as a relay's traffic is (``--reader-core``, default 1, the
relays' core; ``--writer-core`` 0, the simulator's):

- the writer writes ``--messages`` messages of 8 bytes, one ``write`` each, in one of two
  patterns: **spaced**, one every ``--gap-us`` (spinning between writes, so that its pace is
  exact), long enough that the reader is asleep before each; **burst**, ``--burst`` back to back
  every ``--gap-us`` x ``--burst``, so that the reader finds most of them waiting;
- the reader (a child of this process) loops ``epoll.poll()`` then one 8-byte ``read`` until it
  has every message: one poll and one read per message in both patterns, the same work, so
  that the patterns differ in their sleeps only. Its CPU (``getrusage``: utime + stime, which
  Linux keeps in ns from the scheduler's own accounting) and its voluntary context switches (each
  a sleep in ``poll`` that ended) are read over the phase.

A pipe, not a TCP connection: the wake-up is the same (the writer's side wakes the epoll waiter
in both), but a TCP read's own work varies with how much it finds waiting (its copy, the ACK it
may send), which would pass for a difference in sleeps. Its CPU is then ``a x messages + w x
wake-ups``: each poll and read cost ``a`` (Python's included), each sleep ``w`` more. The two
patterns give two equations (spaced: about one wake-up per message; burst: far fewer), solved
for ``w``: **the CPU one sleep and its wake-up cost the woken process**, poll included. Each
round runs both patterns (alternating their order); the reported price is the median of the
rounds'.

What ``w`` is not: the wake-up's latency (`wakeup_latency.py`), nor what the waking side pays
(the writer's ``write`` wakes the reader; that is the writer's CPU). On this project's
development host (a Firecracker microVM, nested paravirtualised: a context switch goes through
the hypervisor, while a plain syscall costs ~0.1 µs) it came to 7.4-9.1 µs
(results/wakeup_cost_session32.out.md). Ad hoc, in C: a reader blocking in ``recv`` on a TCP
connection, one wake-up per 120-byte message, spent 14-16 µs of CPU per message against ~1 µs
when the message was already there, and the same with a ``SCHED_IDLE`` spinner keeping its
core from halting: the price is the switch, not the idle core's halt.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

MESSAGE_BYTES = 8


@dataclass(frozen=True)
class ReaderRun:
    """One pattern's reader: its loop iterations (one per message), its sleeps and its CPU
    (µs)."""

    pattern: str
    messages: int
    iterations: int
    wakeups: int
    cpu_us: float


@dataclass(frozen=True)
class WakeupCost:
    """The solved prices (µs of the reader's CPU): one loop iteration (a poll and a read), and
    one sleep with its wake-up on top."""

    per_wakeup_us: float
    per_iteration_us: float
    spaced: ReaderRun
    burst: ReaderRun


def solve(spaced: ReaderRun, burst: ReaderRun) -> WakeupCost:
    """``cpu = a x iterations + w x wake-ups`` through both runs, solved for ``a`` and ``w``
    (Cramer's rule). Raises ValueError when the runs cannot tell the two apart (their ratios of
    wake-ups to iterations are equal: the burst did not spare the reader its sleeps)."""
    det = spaced.iterations * burst.wakeups - burst.iterations * spaced.wakeups
    if det == 0 or abs(det) < 0.01 * spaced.iterations * burst.iterations:
        raise ValueError(
            "the two patterns slept as often per iteration "
            f"({spaced.wakeups}/{spaced.iterations} and {burst.wakeups}/{burst.iterations}): "
            "no price of a sleep can be told from them"
        )
    per_iteration = (spaced.cpu_us * burst.wakeups - burst.cpu_us * spaced.wakeups) / det
    per_wakeup = (spaced.iterations * burst.cpu_us - burst.iterations * spaced.cpu_us) / det
    return WakeupCost(per_wakeup, per_iteration, spaced, burst)


def _cpu_us(usage: resource.struct_rusage) -> float:
    return (usage.ru_utime + usage.ru_stime) * 1e6


def _read_all(fd: int, messages: int) -> tuple[int, int, float]:
    """The reader's loop over ``messages`` messages: (iterations, wake-ups, CPU µs)."""
    poller = select.epoll()
    poller.register(fd, select.EPOLLIN)
    got = 0
    before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        while got < messages:
            poller.poll()
            if len(os.read(fd, MESSAGE_BYTES)) != MESSAGE_BYTES:
                raise ConnectionError(f"the writer closed after {got} of {messages} messages")
            got += 1
    finally:
        after = resource.getrusage(resource.RUSAGE_SELF)
        poller.close()
    return got, after.ru_nvcsw - before.ru_nvcsw, _cpu_us(after) - _cpu_us(before)


def _spin_until(deadline_ns: int) -> None:
    while time.perf_counter_ns() < deadline_ns:
        pass


def _write(fd: int, messages: int, gap_ns: int, burst: int) -> None:
    payload = b"x" * MESSAGE_BYTES
    due = time.perf_counter_ns()
    sent = 0
    while sent < messages:
        _spin_until(due)
        for _ in range(min(burst, messages - sent)):
            os.write(fd, payload)
            sent += 1
        due += gap_ns * burst


def run_pattern(
    pattern: str,
    messages: int,
    gap_us: float,
    burst: int,
    reader_core: int | None,
    writer_core: int | None,
) -> ReaderRun:
    """One pattern over a fresh pipe: the reader in a forked child on ``reader_core``, the writer
    here on ``writer_core``."""
    data_r, data_w = os.pipe()
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reader
        status = 1
        try:
            os.close(data_w)
            os.close(report_r)
            if reader_core is not None:
                os.sched_setaffinity(0, {reader_core})
            os.write(report_w, b"R")  # placed: the writer may start
            result = _read_all(data_r, messages)
            os.write(report_w, json.dumps(result).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(data_r)
    os.close(report_w)
    previous = os.sched_getaffinity(0)
    chunks = []
    try:
        if writer_core is not None:
            os.sched_setaffinity(0, {writer_core})
        if os.read(report_r, 1) != b"R":
            raise RuntimeError("the reader did not start")
        time.sleep(0.05)  # the reader asleep in its first poll
        _write(data_w, messages, round(gap_us * 1000), burst if pattern == "burst" else 1)
        while chunk := os.read(report_r, 4096):
            chunks.append(chunk)
    finally:
        os.sched_setaffinity(0, previous)
        os.close(data_w)
        os.close(report_r)
        _, status = os.waitpid(pid, 0)
    if status != 0 or not chunks:
        raise RuntimeError(f"the reader failed (wait status {status})")
    iterations, wakeups, cpu_us = json.loads(b"".join(chunks))
    return ReaderRun(pattern, messages, iterations, wakeups, cpu_us)


def measure(
    rounds: int = 3,
    messages: int = 20_000,
    gap_us: float = 60.0,
    burst: int = 16,
    reader_core: int | None = 1,
    writer_core: int | None = 0,
) -> list[WakeupCost]:
    """``rounds`` pairs of runs (spaced and burst, alternating which goes first), each solved."""
    costs = []
    for i in range(rounds):
        order = ["spaced", "burst"] if i % 2 == 0 else ["burst", "spaced"]
        runs = {
            pattern: run_pattern(pattern, messages, gap_us, burst, reader_core, writer_core)
            for pattern in order
        }
        costs.append(solve(runs["spaced"], runs["burst"]))
    return costs


def median_price(costs: Sequence[WakeupCost]) -> float:
    return statistics.median(c.per_wakeup_us for c in costs)


def describe(costs: Sequence[WakeupCost]) -> str:
    prices = [c.per_wakeup_us for c in costs]
    per_iteration = statistics.median(c.per_iteration_us for c in costs)
    return (
        f"one sleep and wake-up costs the woken process {statistics.median(prices):.1f} µs of "
        f"CPU [{min(prices):.1f}-{max(prices):.1f} over {len(prices)} rounds] on top of its "
        f"poll and read ({per_iteration:.1f} µs)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs [3]")
    parser.add_argument("--messages", type=int, default=20_000, help="per run [20000]")
    parser.add_argument("--gap-us", type=float, default=60.0, help="between messages [60 µs]")
    parser.add_argument("--burst", type=int, default=16, help="messages per burst [16]")
    parser.add_argument("--reader-core", type=int, default=1)
    parser.add_argument("--writer-core", type=int, default=0)
    parser.add_argument("--no-pin", action="store_true", help="do not pin the two processes")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CI: one short round, no claims")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.messages = 1, 400
    cores = os.sched_getaffinity(0)
    pin = not args.no_pin and {args.reader_core, args.writer_core} <= cores
    try:
        costs = measure(
            args.rounds,
            args.messages,
            args.gap_us,
            args.burst,
            args.reader_core if pin else None,
            args.writer_core if pin else None,
        )
    except ValueError as exc:
        raise SystemExit(f"wakeup_cost.py: {exc}") from None
    for cost in costs:
        s, b = cost.spaced, cost.burst
        print(
            f"round: spaced {s.iterations} reads / {s.wakeups} sleeps / {s.cpu_us / 1e3:.1f} ms, "
            f"burst {b.iterations} / {b.wakeups} / {b.cpu_us / 1e3:.1f} ms: "
            f"{cost.per_wakeup_us:.1f} µs per sleep, {cost.per_iteration_us:.1f} per read"
        )
    print(describe(costs) + ("" if pin else " (not pinned)"))
    if args.json_out is not None:
        args.json_out.write_text(
            json.dumps({"pinned": pin, "rounds": [asdict(c) for c in costs]}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
