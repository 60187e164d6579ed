"""Do N workers relay N times the chunk rate? ``sidecar proxy --workers N`` at saturation.

    python benchmarks/workers_scaling.py --nice -10 --workers 1,2,0 --repeats 2 \\
        --json-out benchmarks/results/workers_scaling.json \\
        --md-out benchmarks/results/workers_scaling.out.md   # the run (about 6 minutes)
    python benchmarks/workers_scaling.py --smoke             # CI: ~6 s, no timing claims

Results and their reading: benchmarks/results/workers_scaling.md.

What runs (separate OS processes, real sockets on 127.0.0.1):

- the upstream: ``workers_scaling_load.c upstream`` (C, epoll, built here with ``cc -O2``;
  without a C compiler the harness prints SKIPPED and exits 0). It answers every request with
  the same stream, captured once at start-up from the simulator (``sidecar sim``) asked as the
  sidecar asks vLLM (``stream_options`` with ``include_usage`` and ``continuous_usage_stats``):
  a role chunk, ``--tokens`` token chunks each carrying its ``usage`` (the shape the relay's
  fast path matches, checked here), the finish, the usage chunk and ``[DONE]``. It paces like an
  engine: every ``--step-us`` it writes the next chunk of every stream in progress, one write
  each, so the relay gets one event per read while it keeps up; a few syscalls per event.
- the sidecar: ``python -m sidecar proxy --workers N --health-interval 0`` (token accounting
  on: the default usage injection, and the usage cut back out of every chunk). ``--workers 0``
  is the one-process mode (relay and collector on one loop), for reference.
- the client: ``workers_scaling_load.c client`` (C, epoll): ``--streams-per-worker`` x
  max(N, 1) keep-alive connections, closed loop (the next request as soon as an answer ends),
  counting answers, SSE events, token events, reads and bytes; SIGUSR1 prints its counters.

The offered chunk rate is streams / step, per worker: ``--streams-per-worker`` is a list of load
levels (default 10, 20, 40, 80 = 10k to 80k chunks/s per worker at the 1 ms step), each run for
every N (the order of N reversed every other round). The lower levels show the cost at one
event per read; the top one saturates a worker (its core full, less delivered than offered),
and the relay is the bottleneck there when the other processes' cores are not full (N = 1).
A relay that falls behind reads several events at once and pays less per event, so "at
saturation" is compared with the batching printed beside it, and a fit per N separates the
cost per read from the cost per event.

Placement (``--placement pinned``, the default, on a 2-core host; every thread of a process is
pinned, the workers after they start):

- N = 0: the one sidecar process alone on core 1; upstream and client on core 0.
- N = 1: the worker alone on core 1; the collector, the upstream and the client on core 0.
- N = 2: worker 0 on core 0 with the upstream and the collector, worker 1 on core 1 with the
  client (the upstream costs more per event than the client: its write does the loopback's
  receive work too). Two cores cannot give two workers a core each *and* run the load: what
  must hold is the CPU per event, not the doubling.

``--placement float`` pins nothing (the kernel's scheduler places everything).

Measured, per run, over the window (after ``--warmup-s``, ``--measure-s`` long): the client's
events/s and token events/s; the CPU of every process (utime+stime from /proc/<pid>/stat: each
worker, the collector, the upstream, the client, and the host's other CPU); each core's busy
share (/proc/stat, tick-sampled: it reads low on a mostly idle core); per worker the client
connections it holds (its sockets on the traffic port, at the window's start: how SO_REUSEPORT
spread them), its requests (``/workers`` of the admin listener) and its CPU; the collector's
records (``/workers``' records_received); the relay's sends to the clients (each client
connection's TCP ``data_segs_out``, `ss -ti`: one segment per send on loopback).
Derived: **events per worker-CPU-second** (client events / summed worker CPU: the quantity that
must stay constant for N workers to relay N times the rate given N cores), µs of worker CPU per
event, the **collector's CPU per record** and the request rate at which it would fill one core
(1 s / CPU per record), and events per relay write (client events / the relay's sends to
the clients; the relay sends once per upstream read it relays, plus the response's head per
request: 1.0 is one event per read, more means the relay fell behind and read several
events at once, which makes each event cheaper; compare N's at a similar value; the client's
events per read is printed beside it). Per N, over all its runs: worker µs/event = per_event +
per_write / (events per relay write), least squares, and the events per worker-CPU-s that gives
at one event per write.

Per request: the worker's CPU per answer. ``--perf`` also counts worker 0's syscalls per request
(``perf stat`` on the syscall tracepoints) and profiles it over each window (``perf record -F
999 -g``; both skipped without perf): shares of its samples by
object (the interpreter, the kernel, uvloop, httptools, ...), its top symbols, and the share
spent in the loopback waking the reader (a local write does the receiver's TCP work and wakes
it, on the writer's CPU: on a VM that wake-up's interrupt is dear). One event per read at 16
streams x 32 tokens, and 1-token streams for the cost per request:

    python benchmarks/workers_scaling.py --workers 1 --repeats 2 --tokens 32 \\
        --streams-per-worker 4,16 --perf --md-out benchmarks/results/worker_profile_32.out.md \\
        --json-out benchmarks/results/worker_profile_32.json   # and --tokens 1, ..._1.*

Reading the report: if events per worker-CPU-s is the same for N = 1 and N = 2, a worker's cost
does not grow with the number of workers, and the rate scales with the CPU the workers get; the
rate ratio N=2 / N=1 on this host is then the worker-CPU ratio (below 2 because the load shares
the cores). What bounds it in general: cores (one per worker), the collector (one for all
workers: its CPU per record sets a ceiling in requests/s), how SO_REUSEPORT spreads few
connections (a hash per connection: with few, long-lived client connections one worker may get
more of them), and the upstream.

Checks printed per run: every answer complete, no error; the records' output tokens per request
(``sidecar_request_generation_tokens`` sum / count from ``/metrics``) equal ``--tokens``, none
estimated; requests_total == records_received for every worker (nothing dropped). ``/metrics``
is read only once the load has stopped: it is computed on the collector's scrape thread at
nice +19 holding the sinks' lock, and with the collector's core full (N = 2 here) a scrape
during the load took 15 s (``/stats``: over 45 s), holding up the collector's loop meanwhile.
``/workers`` alone (on the collector's loop) answers during the load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proxy_overhead as po  # noqa: E402  (the shared process and /proc helpers)

HOST = po.HOST
LOAD_SOURCE = Path(__file__).resolve().parent / "workers_scaling_load.c"
CC_HINT = "install a C compiler (Debian: apt-get install gcc)"
PROMPT = "Tell me a story about a lighthouse."


# ---------------------------------------------------------------------------------------------
# The load program and the stream it serves


def build_load(workdir: Path) -> Path | None:
    """Compile workers_scaling_load.c; None when no C compiler is here."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    out = workdir / "load"
    subprocess.run([cc, "-O2", "-o", str(out), str(LOAD_SOURCE)], check=True, timeout=120)
    return out


def request_body(tokens: int) -> bytes:
    return json.dumps(
        {
            "model": po.MODEL,
            "stream": True,
            "max_tokens": tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": PROMPT}],
        }
    ).encode()


def capture_stream(tokens: int, workdir: Path) -> list[bytes]:
    """The SSE events the simulator sends for one request, asked as the sidecar asks vLLM
    (usage on every chunk); each event with its ``\\n\\n``."""
    port = po.free_port()
    sim = po.start_sim(port, 0.0005, workdir / "sim.log", None)
    try:
        body = json.loads(request_body(tokens))
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        req = urllib.request.Request(
            f"http://{HOST}:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
    finally:
        po.stop(sim)
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event.strip()]


def check_stream(events: Sequence[bytes], tokens: int) -> dict[str, Any]:
    """What the relay will see: token events carrying usage, and how many of them its fast
    path (one regex per event, sidecar/protocol/fastchunk.py) matches."""
    from sidecar.protocol.fastchunk import fast_chunk

    token_events = [e for e in events if b'"delta":{"content":"' in e]
    fast = sum(1 for e in token_events if fast_chunk(e) is not None)
    with_usage = sum(1 for e in token_events if b'"usage":{' in e)
    if len(token_events) != tokens or events[-1] != b"data: [DONE]\n\n":
        raise RuntimeError(
            f"the simulator's stream has {len(token_events)} token events, wanted {tokens}"
        )
    return {
        "events": len(events),
        "token_events": len(token_events),
        "token_events_with_usage": with_usage,
        "token_events_on_fast_path": fast,
        "bytes": sum(map(len, events)),
    }


def write_units(events: Sequence[bytes], path: Path) -> int:
    """The upstream's writes: the response head and the role chunk at once, then one token chunk
    per step, the last token with the usage chunk, [DONE] and the chunked terminator (as vLLM's
    end comes). Each as one HTTP/1.1 chunk."""

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n" % len(data) + data + b"\r\n"

    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    units = [head + chunk(events[0])]
    units += [chunk(e) for e in events[1:-3]]
    units.append(b"".join(chunk(e) for e in events[-3:]) + b"0\r\n\r\n")
    with open(path, "wb") as f:
        f.write(struct.pack("<I", len(units)))
        for unit in units:
            f.write(struct.pack("<I", len(unit)) + unit)
    return len(units)


def write_request(tokens: int, port: int, path: Path) -> None:
    body = request_body(tokens)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    path.write_bytes(head + body)


# ---------------------------------------------------------------------------------------------
# Readings


def core_busy_ticks() -> dict[int, tuple[int, int]]:
    """Per core (busy, total) ticks from /proc/stat."""
    out: dict[int, tuple[int, int]] = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                fields = line.split()
                values = [int(v) for v in fields[1:9]]
                busy = sum(values[i] for i in (0, 1, 2, 5, 6, 7))
                out[int(fields[0][3:])] = (busy, sum(values))
    return out


_DATA_SEGS_OUT = re.compile(rb"\bdata_segs_out:(\d+)")


def relay_sends(port: int) -> int | None:
    """The data segments the relay has sent on its client connections (established TCP
    sockets with local ``port``), from each socket's own TCP counters (`ss -ti`:
    ``data_segs_out``). On loopback a send below the 64 KiB MSS is one segment, so this counts
    the relay's sends to the clients, whatever the call (the lane's ``sendto``, a transport's
    ``write``; /proc/<pid>/io ``syscw`` counts only the write(2) family, not a socket's sends).
    A connection that closed inside the window takes its count with it; the harness's clients
    keep theirs. None without `ss` (iproute2)."""
    ss = shutil.which("ss")
    if ss is None:
        return None
    out = subprocess.run(
        [ss, "-tinH", "state", "established", f"( sport = :{port} )"],
        capture_output=True,
        check=False,
    ).stdout
    return sum(int(m) for m in _DATA_SEGS_OUT.findall(out))


def connections_per_process(pids: Sequence[int], port: int) -> list[int]:
    """Established TCP connections on local ``port`` held by each process: the client's
    connections as SO_REUSEPORT spread them over the workers (/proc/net/tcp's inodes matched
    against each process's socket fds)."""
    inodes: set[str] = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                inodes.add(fields[9])
    counts = []
    for pid in pids:
        n = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    n += 1
        counts.append(n)
    return counts


def admin_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=10) as resp:
        return json.loads(resp.read())


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=60) as resp:
        text: str = resp.read().decode()
    return text


def metric_sums(port: int, names: Sequence[str]) -> dict[str, float]:
    """Each named sample of /metrics, summed over its labels (classic text format)."""
    text = metrics_text(port)
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


def stall_readings_under_load(port: int) -> dict[str, float] | None:
    """`stall_readings` while the load runs, or None when the collector's /metrics does not
    answer within `metrics_text`'s timeout: its scrapes run at the lowest CPU priority and yield
    to traffic, and with every core full (e.g. N = 2 at 320 streams per worker here) one took
    12-64 s. The run goes on without its stall figures, and says so."""
    try:
        return stall_readings(port)
    except (TimeoutError, urllib.error.URLError, ConnectionError):
        return None


def stall_readings(port: int) -> dict[str, float]:
    """The workers' own stall figures (/metrics, sidecar/proxy/stalls.py), summed over the
    workers: garbage-collection pauses per generation (count, seconds) and the largest pause
    and loop lag since start (the largest over the workers)."""
    text = metrics_text(port)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(("sidecar_gc_pause", "sidecar_loop_lag_max")):
            continue
        name, _, value = line.rpartition(" ")
        metric = name.split("{", 1)[0]
        generation = name.split('generation="', 1)[1][0] if 'generation="' in name else ""
        if metric == "sidecar_gc_pause_seconds_count":
            key = f"gc{generation}_count"
        elif metric == "sidecar_gc_pause_seconds_sum":
            key = f"gc{generation}_s"
        elif metric == "sidecar_gc_pause_max_seconds":
            out[f"gc{generation}_max_s"] = max(out.get(f"gc{generation}_max_s", 0.0), float(value))
            continue
        elif metric == "sidecar_loop_lag_max_seconds":
            out["loop_lag_max_s"] = max(out.get("loop_lag_max_s", 0.0), float(value))
            continue
        else:
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


GEN_SUM = "sidecar_request_generation_tokens_sum"
GEN_COUNT = "sidecar_request_generation_tokens_count"
ESTIMATED = "sidecar_requests_with_estimated_tokens_total"


def pin_process(pid: int, core: int | None) -> None:
    """Every thread of ``pid`` on ``core`` (None: leave it)."""
    if core is None:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), {core})


def placement_for(workers: int, placement: str) -> dict[str, Any]:
    """Cores per role: upstream, client, collector (or the one process), and each worker."""
    if placement == "float" or not po.can_pin():
        return {"upstream": None, "client": None, "collector": None, "workers": [None] * workers}
    if workers == 0:
        return {"upstream": 0, "client": 0, "collector": 1, "workers": []}
    if workers == 1:
        return {"upstream": 0, "client": 0, "collector": 0, "workers": [1]}
    return {"upstream": 0, "client": 1, "collector": 0, "workers": [i % 2 for i in range(workers)]}


def client_snap(proc: subprocess.Popen[bytes], out_path: Path, sig: int) -> dict[str, int]:
    """Signal the client and read back the counters line it prints."""
    before = out_path.read_text().count("\n")
    proc.send_signal(sig)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = out_path.read_text().splitlines()
        if len(lines) > before and out_path.read_text().endswith("\n"):
            fields = lines[before].split()
            keys = ("t_ns", "answers", "events", "tokens", "reads", "bytes", "errors")
            return dict(zip(keys, map(int, fields[1:8]), strict=True))
        time.sleep(0.002)
    raise RuntimeError("the load client did not answer its signal")


# ---------------------------------------------------------------------------------------------
# The worker's profile (--perf)

# Kernel functions that mark a sample as the loopback waking the reading process: a write to a
# local socket does the receiver's TCP work and wakes it, on the writer's CPU (on a VM the
# wake-up's interrupt is slow, and the writer pays it).
WAKEUP_MARK = "sock_def_readable"


# Syscalls counted per request (perf's tracepoints; the rest summed as "other").
SYSCALLS = (
    "read", "recvmsg", "recvfrom", "write", "writev", "sendto", "sendmsg", "epoll_pwait",
    "getrandom", "getpid",
)  # fmt: skip
SYSCALL_EVENTS = ",".join(
    [*(f"syscalls:sys_enter_{name}" for name in SYSCALLS), "raw_syscalls:sys_enter"]
)


def start_perf(argv: Sequence[str], pid: int, seconds: float) -> subprocess.Popen[bytes] | None:
    """``perf ARGV -p pid`` (every thread) for ``seconds``; None without perf."""
    perf = shutil.which("perf")
    if perf is None:
        return None
    return subprocess.Popen(
        [perf, *argv, "-p", str(pid), "--", "sleep", f"{seconds:.3f}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def syscalls_per_request(counts_csv: Path, requests: float) -> dict[str, float] | None:
    """`perf stat -x,` counts of the tracepoints in SYSCALL_EVENTS over ``requests``; None
    when perf counted nothing (no tracepoints here) or no request was answered."""
    if not counts_csv.exists() or requests <= 0:
        return None
    counts: dict[str, float] = {}
    for line in counts_csv.read_text().splitlines():
        fields = line.split(",")
        if len(fields) < 3 or not fields[0].strip().isdigit():
            continue
        event = fields[2]
        name = "all" if event == "raw_syscalls:sys_enter" else event.rsplit("_enter_", 1)[-1]
        counts[name] = int(fields[0]) / requests
    if not counts:
        return None
    counts["other"] = counts.get("all", 0.0) - sum(counts.get(n, 0.0) for n in SYSCALLS)
    return counts


def count_syscalls(
    pid: int,
    out_csv: Path,
    seconds: float,
    client: subprocess.Popen[bytes],
    client_out: Path,
    workdir: Path,
) -> int:
    """``perf stat`` of SYSCALL_EVENTS on ``pid`` for ``seconds``, counting switched on and off
    through its control FIFOs right where the client's answers are read, so that counts and
    answers cover the same time. Returns the answers (0: no perf)."""
    perf = shutil.which("perf")
    if perf is None:
        return 0
    ctl, ack = workdir / "perf-ctl.fifo", workdir / "perf-ack.fifo"
    for fifo in (ctl, ack):
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo)
    argv = [perf, "stat", "-x", ",", "-o", str(out_csv), "-e", SYSCALL_EVENTS, "-D", "-1"]
    argv += ["--control", f"fifo:{ctl},{ack}", "-p", str(pid)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    commands = acks = -1
    try:
        deadline = time.monotonic() + 15
        while commands < 0:  # perf opens its end at start-up; never block on a perf that failed
            try:
                commands = os.open(ctl, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    return 0
                time.sleep(0.01)
        acks = os.open(ack, os.O_RDONLY | os.O_NONBLOCK)

        def command(word: str) -> bool:
            os.write(commands, word.encode() + b"\n")
            ready, _, _ = select.select([acks], [], [], 10)
            return bool(ready) and os.read(acks, 64).startswith(b"ack")

        if not command("enable"):
            return 0
        before = client_snap(client, client_out, signal.SIGUSR1)["answers"]
        time.sleep(seconds)
        after = client_snap(client, client_out, signal.SIGUSR1)["answers"]
        if not command("disable"):
            return 0
    finally:
        for fd in (commands, acks):
            if fd >= 0:
                os.close(fd)
        proc.send_signal(signal.SIGINT)  # perf writes its counts and exits
        stop_perf(proc)
    return after - before


def stop_perf(recorder: subprocess.Popen[bytes]) -> None:
    """Wait for a `start_perf` to end (it ends by itself), at most 30 s."""
    try:
        recorder.wait(timeout=30)
    except subprocess.TimeoutExpired:
        recorder.kill()
        recorder.wait()


def perf_profile(data: Path, top: int = 12) -> dict[str, Any] | None:
    """Shares of the worker's samples: by object (libpython, the kernel, uvloop, ...), the
    top symbols, and the samples whose kernel stack is the loopback waking the receiver."""
    perf = shutil.which("perf")
    if perf is None or not data.exists():
        return None

    def shares(sort: str) -> list[tuple[str, float]]:
        done = subprocess.run(
            [perf, "report", "-i", str(data), "--stdio", "--no-children", "-g", "none",
             "--sort", sort],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        rows = []
        for line in done.stdout.splitlines():
            fields = line.split(None, 1)
            if len(fields) == 2 and fields[0].endswith("%"):
                rows.append((fields[1].strip(), float(fields[0][:-1])))
        return rows

    script = subprocess.run(
        [perf, "script", "-i", str(data), "-F", "ip,sym"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    samples = wakeups = 0
    for stack in script.stdout.split("\n\n"):
        if stack.strip():
            samples += 1
            wakeups += WAKEUP_MARK in stack
    return {
        "by_object": shares("dso")[:top],
        "top_symbols": shares("sym")[:top],
        "samples": samples,
        "wakeup_share": wakeups / samples if samples else None,
    }


# ---------------------------------------------------------------------------------------------
# One run


def run_once(
    args: argparse.Namespace,
    load: Path,
    units: Path,
    workers: int,
    streams: int,
    workdir: Path,
    tag: str,
) -> dict[str, Any]:
    place = placement_for(workers, args.placement)
    conns = streams * max(workers, 1)
    up_port, port, admin_port = po.free_port(), po.free_port(), po.free_port()
    request = workdir / f"request-{tag}.bin"
    write_request(args.tokens, port, request)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        upstream = po.spawn(
            [str(load), "upstream", str(up_port), str(units), str(args.step_us)],
            workdir / f"upstream-{tag}.log",
            place["upstream"],
        )
        procs.append(upstream)
        po.wait_port(up_port, upstream)
        proxy = po.start_proxy(
            up_port,
            port,
            admin_port,
            workdir / f"proxy-{tag}.log",
            None,
            ["--workers", str(workers)],
        )
        procs.append(proxy)
        pin_process(proxy.pid, place["collector"])
        worker_pids: list[int] = []
        if workers:
            deadline = time.monotonic() + 20
            while True:
                view = admin_json(admin_port, "/workers")
                if view["alive"] == workers or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            worker_pids = [w["pid"] for w in sorted(view["workers"], key=lambda w: w["worker"])]
            for pid, core in zip(worker_pids, place["workers"], strict=True):
                pin_process(pid, core)
        client_out = workdir / f"client-{tag}.out"
        client_out.write_text("")
        log = open(client_out, "ab")  # noqa: SIM115 - handed to the child, closed after spawn
        try:
            client = subprocess.Popen(
                [str(load), "client", HOST, str(port), str(conns), str(request)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=po._pinner(place["client"]),
            )
        finally:
            log.close()
        procs.append(client)
        time.sleep(args.warmup_s)

        roles: dict[str, int] = {"collector" if workers else "sidecar": proxy.pid}
        for i, pid in enumerate(worker_pids):
            roles[f"worker{i}"] = pid
        roles["upstream"] = upstream.pid
        roles["client"] = client.pid
        roles["harness"] = os.getpid()

        relay_roles = [r for r in roles if r.startswith("worker")] or ["sidecar"]

        def readings() -> dict[str, Any]:
            return {
                "cpu_ns": {role: po.proc_cpu_ns(pid) for role, pid in roles.items()},
                "relay_sends": relay_sends(port),
                "host_busy_ns": po.host_busy_ns(),
                "cores": core_busy_ticks(),
            }

        admin0 = admin_json(admin_port, "/workers") if workers else None
        conns_per_worker = connections_per_process(worker_pids or [proxy.pid], port)
        stalls0 = stall_readings_under_load(admin_port)
        r0 = readings()
        c0 = client_snap(client, client_out, signal.SIGUSR1)
        time.sleep(args.measure_s)
        c1 = client_snap(client, client_out, signal.SIGUSR1)
        r1 = readings()
        admin1 = admin_json(admin_port, "/workers") if workers else None
        # Read after the window: the workers report every 0.25 s (a collection late in the
        # window may come with the next report, and is then missed here).
        stalls1 = stall_readings_under_load(admin_port)
        perf_data = workdir / f"perf-{tag}.data"
        perf_counts = workdir / f"perf-{tag}.csv"
        profiled_answers = 0
        if args.perf:
            # Windows of their own after the measured one (perf's sampling costs the worker a
            # little CPU).
            profiled = roles[relay_roles[0]]
            profiled_answers = count_syscalls(
                profiled, perf_counts, args.measure_s, client, client_out, workdir
            )
            recorder = start_perf(
                ["record", "-F", "999", "-g", "-q", "-o", str(perf_data)], profiled, args.measure_s
            )
            if recorder is not None:
                stop_perf(recorder)
        alive = client.poll() is None
        po.stop(client)
        time.sleep(0.5)  # the last records reach the collector
        admin_end = admin_json(admin_port, "/workers") if workers else None
        metrics_end = metric_sums(admin_port, (GEN_SUM, GEN_COUNT, ESTIMATED))
    finally:
        for proc in reversed(procs):
            po.stop(proc)

    wall_s = (c1["t_ns"] - c0["t_ns"]) / 1e9
    cpu_s = {role: (r1["cpu_ns"][role] - r0["cpu_ns"][role]) / 1e9 for role in roles}
    ours = sum(cpu_s.values())
    other_s = (r1["host_busy_ns"] - r0["host_busy_ns"]) / 1e9 - ours
    cores = {}
    for core, (busy1, total1) in r1["cores"].items():
        busy0, total0 = r0["cores"][core]
        cores[f"core{core}"] = (busy1 - busy0) / max(1, total1 - total0)
    delta = {k: c1[k] - c0[k] for k in ("answers", "events", "tokens", "reads", "bytes", "errors")}
    worker_cpu_s = sum(v for k, v in cpu_s.items() if k.startswith("worker")) or cpu_s.get(
        "sidecar", 0.0
    )
    sidecar_cpu_s = worker_cpu_s + cpu_s.get("collector", 0.0)
    result: dict[str, Any] = {
        "tag": tag,
        "workers": workers,
        "placement": {k: v for k, v in place.items()},
        "streams_per_worker": streams,
        "connections": conns,
        "connections_per_worker": conns_per_worker,
        "offered_events_per_s": conns / (args.step_us / 1e6),
        "window_s": wall_s,
        "client": delta,
        "client_alive_at_end": alive,
        "events_per_s": delta["events"] / wall_s,
        "token_events_per_s": delta["tokens"] / wall_s,
        "answers_per_s": delta["answers"] / wall_s,
        "events_per_client_read": delta["events"] / max(1, delta["reads"]),
        # The relay sends once per upstream read it relays (plus the response's head): events
        # per send is how batched its reads were, 1.0 = one event each.
        "events_per_relay_write": (
            delta["events"] / max(1, r1["relay_sends"] - r0["relay_sends"])
            if r0["relay_sends"] is not None and r1["relay_sends"] is not None
            else float("nan")
        ),
        "cpu_cores": {role: s / wall_s for role, s in cpu_s.items()},
        "other_cpu_cores": other_s / wall_s,
        "core_busy": cores,
        "worker_cpu_cores": worker_cpu_s / wall_s,
        "events_per_worker_cpu_s": delta["events"] / worker_cpu_s if worker_cpu_s else None,
        "worker_us_per_event": 1e6 * worker_cpu_s / max(1, delta["events"]),
        "sidecar_us_per_event": 1e6 * sidecar_cpu_s / max(1, delta["events"]),
        "worker_us_per_request": 1e6 * worker_cpu_s / max(1, delta["answers"]),
    }
    if stalls0 is None or stalls1 is None:
        result["stalls"] = {"unread": True}
    else:
        result["stalls"] = {
            **{
                key: stalls1.get(key, 0.0) - stalls0.get(key, 0.0)
                for key in ("gc0_count", "gc0_s", "gc1_count", "gc1_s", "gc2_count", "gc2_s")
            },
            # Largest since the worker started (warm-up included): a maximum has no window.
            **{key: stalls1.get(key) for key in ("gc0_max_s", "gc1_max_s", "gc2_max_s")},
            "loop_lag_max_s": stalls1.get("loop_lag_max_s"),
        }
    gen_count = metrics_end[GEN_COUNT]
    result["records"] = {
        "n_out_mean": metrics_end[GEN_SUM] / gen_count if gen_count else None,
        "estimated": metrics_end[ESTIMATED],
        "total": gen_count,
    }
    if workers and admin0 and admin1 and admin_end:
        per0 = {w["worker"]: w for w in admin0["workers"]}
        per = []
        for w in sorted(admin1["workers"], key=lambda w: w["worker"]):
            w0 = per0[w["worker"]]
            per.append(
                {
                    "worker": w["worker"],
                    "pid": w["pid"],
                    "requests": w["requests_total"] - w0["requests_total"],
                    "records_received": w["records_received"] - w0["records_received"],
                    "restarts": w["restarts"],
                }
            )
        result["per_worker"] = per
        records = sum(p["records_received"] for p in per)
        collector_s = cpu_s["collector"]
        result["collector_us_per_record"] = 1e6 * collector_s / max(1, records)
        result["collector_saturates_at_records_per_s"] = (
            records / collector_s if collector_s > 0 else None
        )
        result["accounting"] = [
            {
                "worker": w["worker"],
                "requests_total": w["requests_total"],
                "records_received": w["records_received"],
                "dropped": sum(w["dropped"].values()),
                "dropped_by_reason": {k: v for k, v in w["dropped"].items() if v},
                "lost": w["lost"],
            }
            for w in admin_end["workers"]
        ]
        events_per_answer = delta["events"] / max(1, delta["answers"])
        for i, p in enumerate(per):
            cpu = cpu_s.get(f"worker{i}", 0.0)
            p["cpu_cores"] = cpu / wall_s
            # Its records x the client's events per answer: an estimate per worker.
            p["events_per_cpu_s_est"] = (
                p["records_received"] * events_per_answer / cpu if cpu > 0 else None
            )
    if args.perf:
        # Worker 0's share of the answers: its share of the requests in the measured window
        # (/workers' counts come with the workers' periodic status, too coarse for perf's).
        per_worker = result.get("per_worker")
        share = per_worker[0]["requests"] / max(1, delta["answers"]) if per_worker else 1.0
        result["profile"] = perf_profile(perf_data)
        result["syscalls_per_request"] = syscalls_per_request(perf_counts, share * profiled_answers)
    result["checks"] = checks(result, args.tokens)
    return result


def checks(result: dict[str, Any], tokens: int) -> list[str]:
    """What went wrong in a run, in words (empty: nothing)."""
    problems = []
    if result["client"]["errors"]:
        problems.append(f"{result['client']['errors']} client errors")
    if not result["client_alive_at_end"]:
        problems.append("the load client exited early")
    n_out = result["records"]["n_out_mean"]
    if n_out is None or abs(n_out - tokens) > 1e-9:
        problems.append(f"records' mean output tokens {n_out}, wanted {tokens}")
    if result["records"]["estimated"]:
        problems.append(f"{result['records']['estimated']:.0f} records with estimated tokens")
    for acc in result.get("accounting", []):
        if acc["dropped"] or acc["lost"]:
            reasons = ", ".join(f"{k} {v}" for k, v in acc.get("dropped_by_reason", {}).items())
            problems.append(
                f"worker {acc['worker']}: dropped {acc['dropped']}"
                + (f" ({reasons})" if reasons else "")
                + f" lost {acc['lost']}"
            )
    for p in result.get("per_worker", []):
        if p["restarts"]:
            problems.append(f"worker {p['worker']} restarted {p['restarts']} times")
    return problems


# ---------------------------------------------------------------------------------------------
# Report


def fmt(value: Any, spec: str = "{:.2f}") -> str:
    return "-" if value is None else spec.format(value)


def placement_words(workers: int, place: dict[str, Any]) -> str:
    if place["upstream"] is None:
        return "float"
    if workers == 0:
        return f"sidecar c{place['collector']}; up c{place['upstream']}, cl c{place['client']}"
    ws = " ".join(f"w{i} c{c}" for i, c in enumerate(place["workers"]))
    return f"{ws}; coll c{place['collector']}, up c{place['upstream']}, cl c{place['client']}"


def stall_lines(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The stall table's rows, one per run."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{1e3 * value:.1f}"

    lines = []
    for r in runs:
        st = r.get("stalls", {})
        if st.get("unread"):
            lines.append(
                f"| {r['tag']} | {r['workers']} | not read: the collector's /metrics did not "
                "answer within 60 s under this load (its scrapes yield the CPU to traffic) "
                "| | | |"
            )
            continue
        lines.append(
            f"| {r['tag']} | {r['workers']} "
            f"| {st.get('gc0_count', 0):.0f}, {ms(st.get('gc0_s'))} "
            f"| {st.get('gc1_count', 0):.0f}, {ms(st.get('gc1_s'))} ({ms(st.get('gc1_max_s'))}) "
            f"| {st.get('gc2_count', 0):.0f}, {ms(st.get('gc2_s'))} ({ms(st.get('gc2_max_s'))}) "
            f"| {ms(st.get('loop_lag_max_s'))} |"
        )
    return lines


def report(meta: dict[str, Any], runs: Sequence[dict[str, Any]]) -> str:
    lines = [
        "# workers_scaling: N workers at saturation",
        "",
        f"# {meta['command']}",
        f"# {meta['machine']}",
        f"# stream: {meta['stream']['token_events']} token events + "
        f"{meta['stream']['events'] - meta['stream']['token_events']} others per request from "
        f"the upstream, {meta['stream']['token_events_with_usage']} with usage, "
        f"{meta['stream']['token_events_on_fast_path']} on the relay's fast path (the finish "
        f"chunk takes the general one); "
        f"step {meta['step_us']} µs, streams per worker "
        f"{', '.join(map(str, meta['streams_per_worker']))} (offered events/s = streams / step), "
        f"warm-up {meta['warmup_s']} s, window {meta['measure_s']} s",
        "",
        "## Runs",
        "",
        "| run | N | placement | conns | offered/s | events/s | worker CPU (cores) "
        "| events per worker-CPU-s "
        "| worker µs/event | sidecar µs/event | collector µs/record | collector core full at "
        "req/s | events per relay write (client read) | CPU: "
        + "upstream / client / collector / other | "
        "core busy | per worker: connections, requests, CPU | checks |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for r in runs:
        cpu = r["cpu_cores"]
        per_worker = r.get("per_worker", [])
        if per_worker:
            spread = " / ".join(
                f"{c} conns, {p['requests']} req, {fmt(p['cpu_cores'])} c"
                for c, p in zip(r["connections_per_worker"], per_worker, strict=True)
            )
        else:
            spread = f"{r['connections_per_worker'][0]} conns"
        cores = " / ".join(f"{v:.2f}" for v in r["core_busy"].values())
        others = (
            " / ".join(fmt(cpu.get(k)) for k in ("upstream", "client", "collector"))
            + f" / {r['other_cpu_cores']:.2f}"
        )
        worker_breakdown = " + ".join(
            fmt(cpu[k]) for k in sorted(cpu) if k.startswith("worker")
        ) or fmt(cpu.get("sidecar"))
        lines.append(
            f"| {r['tag']} | {r['workers']} | {placement_words(r['workers'], r['placement'])} "
            f"| {r['connections']} | {r['offered_events_per_s']:,.0f} "
            f"| {r['events_per_s']:,.0f} | {r['worker_cpu_cores']:.2f} "
            f"({worker_breakdown}) | {fmt(r['events_per_worker_cpu_s'], '{:,.0f}')} "
            f"| {r['worker_us_per_event']:.1f} | {r['sidecar_us_per_event']:.1f} "
            f"| {fmt(r.get('collector_us_per_record'), '{:.0f}')} "
            f"| {fmt(r.get('collector_saturates_at_records_per_s'), '{:,.0f}')} "
            f"| {r['events_per_relay_write']:.2f} ({r['events_per_client_read']:.2f}) "
            f"| {others} | {cores} | {spread} "
            f"| {'; '.join(r['checks']) or 'ok'} |"
        )
    lines += [
        "",
        "## Per request",
        "",
        "A request's worker CPU (all of it: its events included) and, with --perf, worker "
        "0's syscalls per request it answered (perf stat on the syscall tracepoints: the "
        "request's read, the upstream request's send, the upstream's recvmsg, the client's "
        "writes, the records' channel, the loop's epoll).",
        "",
        "| run | N | answers/s | worker µs/request | syscalls/request of worker 0 ("
        + ", ".join(SYSCALLS)
        + ", other; --perf) |",
        "|---|---:|---:|---:|---|",
    ]
    for r in runs:
        calls = r.get("syscalls_per_request")
        per_call = (
            f"{calls['all']:.2f}: "
            + ", ".join(f"{n} {calls.get(n, 0.0):.2f}" for n in (*SYSCALLS, "other"))
            if calls
            else "-"
        )
        lines.append(
            f"| {r['tag']} | {r['workers']} | {r['answers_per_s']:,.0f} "
            f"| {r['worker_us_per_request']:.0f} | {per_call} |"
        )
    lines += [
        "",
        "## Stalls (the workers' own figures, /metrics)",
        "",
        "Garbage-collection pauses per generation in the window (count, total ms) and the "
        "longest since the worker started; the longest loop lag since start (warm-up "
        "included). A pause stops every stream of the worker and is stamped into the gaps "
        "of the events behind it.",
        "",
        "| run | N | gen 0: n, ms | gen 1: n, ms (longest) | gen 2: n, ms (longest) "
        "| longest loop lag ms |",
        "|---|---:|---|---|---|---:|",
    ]
    lines += stall_lines(runs)
    profiled = [r for r in runs if r.get("profile")]
    if profiled:
        lines += [
            "",
            "## Profile of worker 0 (perf record -F 999 -g, a window after the measured one)",
            "",
            f'Shares of the worker\'s CPU samples. "loopback wake-up": samples whose kernel '
            f"stack holds `{WAKEUP_MARK}`: a write to a local socket does the receiving side's "
            "TCP work and wakes the reader, on the writer's CPU.",
        ]
        for r in profiled:
            prof = r["profile"]
            objects = ", ".join(f"{name} {share:.1f} %" for name, share in prof["by_object"][:6])
            symbols = ", ".join(
                f"`{name}` {share:.1f} %" for name, share in prof["top_symbols"][:8]
            )
            wakeup = prof["wakeup_share"]
            lines += [
                "",
                f"- {r['tag']} ({prof['samples']} samples): loopback wake-up "
                f"{fmt(None if wakeup is None else 100 * wakeup, '{:.1f}')} %; by object: "
                f"{objects}; top symbols: {symbols}",
            ]
    lines += ["", "## Summary (median [min-max] over the runs of each N and load)", ""]
    lines += [
        "| streams/worker | N | runs | events/s | worker CPU (cores) | events per worker-CPU-s "
        "| rate / N=1 "
        "| events per worker-CPU-s / N=1 | collector µs/record | events per relay write |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary = summarise(runs)
    for (streams, n), s in summary.items():
        lines.append(
            f"| {streams} | {n} | {s['runs']} | {spread_text(s['events_per_s'], '{:,.0f}')} "
            f"| {spread_text(s['worker_cpu_cores'])} "
            f"| {spread_text(s['events_per_worker_cpu_s'], '{:,.0f}')} "
            f"| {fmt(s.get('rate_vs_1'))} | {fmt(s.get('efficiency_vs_1'))} "
            f"| {spread_text(s['collector_us_per_record'], '{:.0f}')} "
            f"| {spread_text(s['events_per_relay_write'])} |"
        )
    fits = fit_costs(runs)
    if fits:
        lines += [
            "",
            "## Cost per event and per write, by N (least squares over every run of that N)",
            "",
            "worker µs/event = per_event + per_write x (writes per event): a relay pays per read"
            " (the recv, the loop's wake-up and dispatch, the framing and the client write) and"
            " per event (parsing, classifying, counting, cutting the usage); at saturation it"
            " falls behind and reads several events at once, which is why µs/event falls with"
            " the load. Events per worker-CPU-s at one event per write = 1e6 / (per_event +"
            " per_write): the per-worker cost to compare across N at the same batching.",
            "",
            "| N | runs | per_event µs | per_write µs | events per worker-CPU-s at 1 event/write "
            "| max abs residual µs |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for n, f in fits.items():
            lines.append(
                f"| {n} | {f['runs']} | {f['per_event_us']:.1f} | {f['per_write_us']:.1f} "
                f"| {f['events_per_worker_cpu_s_at_1']:,.0f} | {f['max_abs_residual_us']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def fit_costs(runs: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per N, worker µs/event = a + b / (events per relay write), fitted over its runs (at
    least two load levels)."""
    import numpy as np

    out: dict[int, dict[str, float]] = {}
    for n in sorted({r["workers"] for r in runs}):
        mine = [r for r in runs if r["workers"] == n and r["events_per_relay_write"] > 0]
        if len({r["streams_per_worker"] for r in mine}) < 2:
            continue
        x = np.array([1.0 / r["events_per_relay_write"] for r in mine])
        y = np.array([r["worker_us_per_event"] for r in mine])
        b, a = np.polyfit(x, y, 1)
        out[n] = {
            "runs": len(mine),
            "per_event_us": float(a),
            "per_write_us": float(b),
            "events_per_worker_cpu_s_at_1": 1e6 / float(a + b),
            "max_abs_residual_us": float(np.max(np.abs(y - (a + b * x)))),
        }
    return out


def spread_text(values: Sequence[float], spec: str = "{:.2f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return spec.format(med)
    return f"{spec.format(med)} [{spec.format(min(values))}-{spec.format(max(values))}]"


def summarise(runs: Sequence[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """Per (streams per worker, N): each quantity's values, and the medians' ratios to N = 1
    at the same streams per worker."""
    keys = (
        "events_per_s",
        "worker_cpu_cores",
        "events_per_worker_cpu_s",
        "collector_us_per_record",
        "events_per_relay_write",
    )
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for r in runs:
        key = (r["streams_per_worker"], r["workers"])
        s = out.setdefault(key, {"runs": 0, **{k: [] for k in keys}})
        s["runs"] += 1
        for k in keys:
            if r.get(k) is not None:
                s[k].append(r[k])
    for (streams, _n), s in out.items():
        base = out.get((streams, 1))
        if base and s["events_per_s"] and base["events_per_s"]:
            s["rate_vs_1"] = statistics.median(s["events_per_s"]) / statistics.median(
                base["events_per_s"]
            )
            s["efficiency_vs_1"] = statistics.median(
                s["events_per_worker_cpu_s"]
            ) / statistics.median(base["events_per_worker_cpu_s"])
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------
# Main


def run(args: argparse.Namespace) -> int:
    po.AUTOGROUP_NICE = args.nice
    command = "python benchmarks/workers_scaling.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="workers-scaling-") as tmp:
        workdir = Path(tmp)
        load = build_load(workdir)
        if load is None:
            print(f"SKIPPED: no C compiler for the load program ({CC_HINT})")
            if args.json_out:
                Path(args.json_out).write_text(json.dumps({"skipped": CC_HINT}) + "\n")
            return 0
        events = capture_stream(args.tokens, workdir)
        stream = check_stream(events, args.tokens)
        units = workdir / "units.bin"
        write_units(events, units)
        meta: dict[str, Any] = {
            "command": command,
            "machine": po.machine_line(),
            "stream": stream,
            "step_us": args.step_us,
            "streams_per_worker": args.streams_per_worker,
            "tokens": args.tokens,
            "warmup_s": args.warmup_s,
            "measure_s": args.measure_s,
            "placement": args.placement,
            "nice": args.nice,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        runs: list[dict[str, Any]] = []
        for rnd in range(args.repeats):
            order = args.workers if rnd % 2 == 0 else list(reversed(args.workers))
            for streams, n in ((st, n) for st in args.streams_per_worker for n in order):
                background = (
                    po.wait_quiet([], args.quiet_below, args.quiet_wait_s)
                    if args.quiet_below > 0
                    else None
                )
                tag = f"r{rnd + 1}-s{streams}-n{n}"
                result = run_once(args, load, units, n, streams, workdir, tag)
                result["round"] = rnd + 1
                result["background_before_cores"] = background
                runs.append(result)
                print(
                    f"# {tag}: {result['events_per_s']:,.0f} events/s, worker CPU "
                    f"{result['worker_cpu_cores']:.2f} cores, "
                    f"{fmt(result['events_per_worker_cpu_s'], '{:,.0f}')} events/worker-CPU-s, "
                    f"background before {fmt(background)} cores, "
                    f"checks: {'; '.join(result['checks']) or 'ok'}",
                    flush=True,
                )
    text = report(meta, runs)
    print(text, end="")
    if args.json_out:
        summary = {f"streams{k[0]}-n{k[1]}": v for k, v in summarise(runs).items()}
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "meta": meta,
                    "runs": runs,
                    "summary": summary,
                    "cost_fit": {str(k): v for k, v in fit_costs(runs).items()},
                },
                indent=1,
            )
            + "\n"
        )
    if args.md_out:
        Path(args.md_out).write_text(text)
    failed = [r["tag"] for r in runs if r["checks"]]
    if failed:
        print(f"# runs with failed checks: {', '.join(failed)}")
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[1, 2],
        help="worker counts to run, in this order (reversed every other round) [1,2]",
    )
    parser.add_argument("--repeats", type=int, default=2, help="rounds [2]")
    parser.add_argument("--tokens", type=int, default=128, help="token chunks per stream [128]")
    parser.add_argument(
        "--streams-per-worker",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[10, 20, 40, 80],
        help="client connections per worker, one load level each [10,20,40,80]",
    )
    parser.add_argument(
        "--step-us", type=int, default=1000, help="the upstream's step: one chunk per stream [1000]"
    )
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--measure-s", type=float, default=8.0)
    parser.add_argument("--placement", choices=("pinned", "float"), default="pinned")
    parser.add_argument(
        "--nice", type=int, default=0, help="autogroup nice of every process (as proxy_overhead)"
    )
    po.add_quiet_arguments(parser, 0.3, 20.0, "run")
    parser.add_argument("--json-out", help="write every run and the summary as JSON")
    parser.add_argument("--md-out", help="write the printed report here too")
    parser.add_argument(
        "--perf",
        action="store_true",
        help="profile the (first) worker with perf record over each window (report: shares "
        "by object, top symbols, the loopback wake-up's share); skipped without perf",
    )
    parser.add_argument("--smoke", action="store_true", help="CI: seconds, tiny load")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.tokens, args.streams_per_worker, args.repeats = 8, [2], 1
        args.warmup_s, args.measure_s, args.quiet_below = 0.5, 0.5, 0.0
    po.exit_on_sigterm()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
