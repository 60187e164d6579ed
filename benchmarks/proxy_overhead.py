"""What the sidecar costs: the same closed-loop streaming client, direct vs through the proxy.

    python benchmarks/proxy_overhead.py --nice -10       # the full run (about 4 minutes)
    python benchmarks/proxy_overhead.py --quick          # a smoke run (about 30 s)

Separate OS processes, each pinned with ``sched_setaffinity`` (on a 2-core host):

- the simulator (``python -m sidecar sim``): core 0;
- the load client (this file, ``client`` sub-command, one process per run): core 0;
- the sidecar (``python -m sidecar proxy --health-interval 0``, token accounting on, i.e. the
  default usage injection and stripping): core 1, alone;
- the calibration relay (this file, ``bare-relay``: a minimal aiohttp relay that forwards bytes
  as read, no parsing, no stamps): core 1, idle unless its turn. It is not the sidecar; it shows
  what any aiohttp/uvloop relay costs on the same host.

The orchestrator (this file's main process) also sits on core 0 but sleeps while a run is on.

For each concurrency C one simulator, one sidecar and one calibration relay are started, and
runs alternate direct, sidecar, bare, direct, sidecar, bare, ... (``--repeats`` rounds). Each
run has its own warm-up (excluded), then a measured window; requests *started* in the window
are the measured ones, and the load is held (closed loop, C outstanding) until every measured
request has finished. Before each round: a bounded wait for other processes on the host to go
quiet, and a wake-up-latency probe on both cores (both printed). ``--nice N`` runs every
benchmark process in a session (scheduling autogroup) of its own at autogroup nice N.

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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

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
    fields = raw[raw.rindex(b")") + 2:].split()
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


def _pinner(core: int | None) -> Any:
    """preexec_fn for a child: its own session/autogroup when AUTOGROUP_NICE, then its core."""
    nice = AUTOGROUP_NICE
    if core is None and not nice:
        return None

    def prepare() -> None:
        if nice:
            os.setsid()
            set_own_autogroup_nice(nice)
        if core is not None:
            os.sched_setaffinity(0, {core})

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
    return {"p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99)),
            "max": float(arr.max())}


def probe_cores(cores: Sequence[int | None], workdir: Path) -> dict[str, dict[str, float]]:
    """Run sched_probe at once on each core, each in a child placed like the measured ones."""
    procs = []
    for i, core in enumerate(cores):
        out = workdir / f"probe-{i}.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "probe", "--out", str(out)]
        procs.append((core, out, spawn(argv, workdir / "probe.log", core)))
    result = {}
    for core, out, proc in procs:
        proc.wait(30)
        result[f"core{core}"] = json.loads(out.read_text())
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


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


def spawn(argv: Sequence[str], log_path: Path, core: int | None) -> subprocess.Popen[bytes]:
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed right after spawn
    try:
        return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                                preexec_fn=_pinner(core))
    finally:
        log.close()


def step_s_for(concurrency: int, min_step_ms: float, target_rate: float) -> float:
    return max(min_step_ms / 1e3, concurrency / target_rate)


def sim_argv(port: int, step_s: float, ground_truth: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "sidecar", "sim", "--host", HOST, "--port", str(port),
            "--model", MODEL, "--step-floor-s", f"{step_s:.6f}", "--max-num-seqs", "1024"]
    if ground_truth:
        argv += ["--ground-truth", ground_truth]
    return argv


def start_sim(port: int, step_s: float, log_path: Path, core: int | None,
              ground_truth: str | None = None) -> subprocess.Popen[bytes]:
    proc = spawn(sim_argv(port, step_s, ground_truth), log_path, core)
    try:
        wait_port(port, proc)
    except BaseException:
        stop(proc)
        raise
    return proc


def start_proxy(upstream_port: int, port: int, admin_port: int, log_path: Path,
                core: int | None, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "sidecar", "proxy", "--upstream",
            f"http://{HOST}:{upstream_port}", "--listen", f"{HOST}:{port}",
            "--metrics-listen", f"{HOST}:{admin_port}", "--health-interval", "0", *extra]
    proc = spawn(argv, log_path, core)
    try:
        wait_port(port, proc)
    except BaseException:
        stop(proc)
        raise
    return proc


def client_argv(url: str, concurrency: int, max_tokens: int, warmup_s: float, measure_s: float,
                stagger_s: float, out: Path, id_prefix: str, watch_pid: int | None = None,
                sim_pid: int | None = None, other_pids: Sequence[int] = ()) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "client", "--url", url,
            "--concurrency", str(concurrency), "--max-tokens", str(max_tokens),
            "--warmup-s", str(warmup_s), "--measure-s", str(measure_s),
            "--stagger-s", f"{stagger_s:.4f}", "--out", str(out), "--id-prefix", id_prefix]
    if watch_pid:
        argv += ["--watch-pid", str(watch_pid)]
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
    body = json.dumps({
        "model": MODEL, "stream": True, "max_tokens": args.max_tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
    }).encode()
    url = args.url.rstrip("/") + "/v1/chat/completions"
    c = args.concurrency
    t_start = perf()
    t0 = t_start + int(args.warmup_s * 1e9)
    t_end = t0 + int(args.measure_s * 1e9)
    measured: list[dict[str, Any]] = []
    state = {"pending": 0, "window_events": 0, "window_tokens": 0, "unmeasured": 0,
             "unmeasured_errors": 0}
    all_done = asyncio.Event()
    window: dict[str, Any] = {}

    def snapshot() -> dict[str, Any]:
        snap: dict[str, Any] = {"t": perf(), "client_cpu_ns": time.process_time_ns(),
                                "host_busy_ns": host_busy_ns(),
                                "others_cpu_ns": pids_cpu_ns(args.other_pids)}
        if args.watch_pid:
            snap["proxy_utime_ns"], snap["proxy_stime_ns"] = proc_cpu_split_ns(args.watch_pid)
            snap["proxy_cpu_ns"] = snap["proxy_utime_ns"] + snap["proxy_stime_ns"]
            snap["proxy_sched_ns"] = proc_sched_ns(args.watch_pid)
            snap["proxy_mem_kib"] = proc_mem_kib(args.watch_pid)
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
            return {"id": request_id, "t_send": t_send, "status": status, "ok": False,
                    "error": type(exc).__name__, "events": events, "tok": stamps}
        return {"id": request_id, "t_send": t_send, "status": status,
                "ok": status == 200 and done, "events": events, "tok": stamps}

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
        "concurrency": c, "max_tokens": args.max_tokens, "warmup_s": args.warmup_s,
        "measure_s": args.measure_s, "t0": t0, "t_end": t_end, "window": window,
        "window_events": state["window_events"], "window_tokens": state["window_tokens"],
        "unmeasured": state["unmeasured"], "unmeasured_errors": state["unmeasured_errors"],
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
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None))

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            async with session.post(upstream + request.path_qs, data=body,
                                    headers={"Content-Type": "application/json"}) as up:
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


def start_bare_relay(upstream_port: int, port: int, log_path: Path,
                     core: int | None) -> subprocess.Popen[bytes]:
    argv = [sys.executable, str(Path(__file__).resolve()), "bare-relay", "--upstream",
            f"http://{HOST}:{upstream_port}", "--port", str(port)]
    proc = spawn(argv, log_path, core)
    try:
        wait_port(port, proc)
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
        "n_req": len(reqs), "n_ok": len(ok), "n_err": len(reqs) - len(ok),
        "n_itl": len(itl),
        "merged": sum(1 for r in ok if len(r["tok"]) != result["max_tokens"]),
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "ttft_max": pct(ttft, 100),
        "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "itl_max": pct(itl, 100),
        "chunks_s": result["window_tokens"] / span_s,
        "events_s": result["window_events"] / span_s,
        "core0_load": ((w["end"]["client_cpu_ns"] - w["start"]["client_cpu_ns"])
                       + (w["end"].get("sim_cpu_ns", 0) - w["start"].get("sim_cpu_ns", 0)))
                      / (span_s * 1e9),
    }
    ours = ((w["end"]["client_cpu_ns"] - w["start"]["client_cpu_ns"])
            + (w["end"].get("sim_cpu_ns", 0) - w["start"].get("sim_cpu_ns", 0))
            + (w["end"].get("proxy_cpu_ns", 0) - w["start"].get("proxy_cpu_ns", 0))
            + (w["end"]["others_cpu_ns"] - w["start"]["others_cpu_ns"]))
    busy = w["end"]["host_busy_ns"] - w["start"]["host_busy_ns"]
    out["background"] = max(0.0, (busy - ours) / (span_s * 1e9))
    if "proxy_cpu_ns" in w["start"]:
        cpu = w["end"]["proxy_cpu_ns"] - w["start"]["proxy_cpu_ns"]
        stime = w["end"]["proxy_stime_ns"] - w["start"]["proxy_stime_ns"]
        sched = w["end"]["proxy_sched_ns"] - w["start"]["proxy_sched_ns"]
        events = max(1, result["window_events"])
        out.update({
            "proxy_us_event": cpu / 1e3 / events,
            "proxy_us_event_sched": sched / 1e3 / events,
            "proxy_us_token": cpu / 1e3 / max(1, result["window_tokens"]),
            "proxy_sys_share": stime / cpu if cpu else float("nan"),
            "proxy_load": cpu / (span_s * 1e9),
            "proxy_rss_mib": w["end"]["proxy_mem_kib"]["VmRSS"] / 1024,
            "proxy_hwm_mib": w["end"]["proxy_mem_kib"]["VmHWM"] / 1024,
        })
    return out


def med_spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    vals = [v for v in values if v == v]
    if not vals:
        return "-"
    med = statistics.median(vals)
    return f"{fmt.format(med)} [{fmt.format(min(vals))} – {fmt.format(max(vals))}]"


MODE_LABELS = {"direct": "direct", "sidecar": "sidecar", "bare": "bare relay (calibration)"}


def report(runs: dict[tuple[int, str], list[dict[str, Any]]], steps: dict[int, float],
           concurrencies: Sequence[int], modes: Sequence[str], repeats: int,
           max_tokens: int, probes: dict[int, list[dict[str, dict[str, float]]]]) -> str:
    lines: list[str] = []
    add = lines.append
    relays = [m for m in modes if m != "direct"]
    add(f"Per mode. Each cell: median of the {repeats} runs [min – max]; durations in ms, CPU "
        "in cores; TTFT sample = request, ITL sample = event (token chunk).")
    add("")
    add("| C | step ms | mode | requests/run | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | "
        "ITL max | token chunks/s | sim+client CPU | other procs CPU |")
    add("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in concurrencies:
        for mode in modes:
            rs = runs[(c, mode)]
            add(f"| {c} | {steps[c] * 1e3:g} | {MODE_LABELS[mode]} | "
                f"{med_spread([r['n_req'] for r in rs], '{:.0f}')} | "
                f"{med_spread([r['ttft_p50'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['ttft_p99'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['itl_p50'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['itl_p99'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['itl_max'] for r in rs], '{:.1f}')} | "
                f"{med_spread([r['chunks_s'] for r in rs], '{:.0f}')} | "
                f"{med_spread([r['core0_load'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['background'] for r in rs], '{:.2f}')} |")
    add("")
    add("Added latency: for each repeat, (relay run's percentile − the same repeat's direct "
        "run's percentile), i.e. *differences of percentiles*, not percentiles of per-request "
        f"differences; median of the {repeats} repeats [min – max], in µs.")
    add("")
    add("| C | relay | Δ TTFT p50 | Δ TTFT p99 | Δ ITL p50 | Δ ITL p99 |")
    add("|---:|---|---:|---:|---:|---:|")
    for c in concurrencies:
        for mode in relays:
            pairs = list(zip(runs[(c, "direct")], runs[(c, mode)], strict=True))
            cells = [med_spread([(s[k] - d[k]) * 1e3 for d, s in pairs], "{:.0f}")
                     for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")]
            add(f"| {c} | {MODE_LABELS[mode]} | " + " | ".join(cells) + " |")
    add("")
    add("Relay process CPU over the measured window: utime+stime from /proc/<pid>/stat "
        f"({1e3 / CLK_TCK:g} ms ticks) and, as a cross-check, the sum of "
        "/proc/<pid>/task/*/schedstat (ns). Per event = per SSE event written to the client "
        f"({max_tokens} token chunks + 1 role chunk + [DONE] per request; the sidecar also "
        "reads and drops the usage chunk it asked for). Memory read at the window's end, with "
        "C streams in flight.")
    add("")
    add("| C | relay | CPU load (cores) | µs/event | µs/event (schedstat) | µs/token chunk | "
        "kernel share | VmRSS MiB | VmHWM MiB |")
    add("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in concurrencies:
        for mode in relays:
            rs = runs[(c, mode)]
            add(f"| {c} | {MODE_LABELS[mode]} | "
                f"{med_spread([r['proxy_load'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['proxy_us_event'] for r in rs], '{:.1f}')} | "
                f"{med_spread([r['proxy_us_event_sched'] for r in rs], '{:.1f}')} | "
                f"{med_spread([r['proxy_us_token'] for r in rs], '{:.1f}')} | "
                f"{med_spread([r['proxy_sys_share'] for r in rs], '{:.2f}')} | "
                f"{med_spread([r['proxy_rss_mib'] for r in rs], '{:.1f}')} | "
                f"{med_spread([r['proxy_hwm_mib'] for r in rs], '{:.1f}')} |")
    add("")
    add("Host scheduling noise, measured before each repeat on the cores in use: lateness of "
        "1 ms sleeps of a process placed like the measured ones (p50 / p99 / max, µs):")
    add("")
    for c in concurrencies:
        cells = []
        for probe in probes.get(c, []):
            cells.append(", ".join(f"{k} {v['p50']:.0f}/{v['p99']:.0f}/{v['max']:.0f}"
                                   for k, v in probe.items()))
        add(f"- C={c}: " + "; ".join(cells))
    add("")
    add("Sanity, per run: measured requests / failed / streams whose token-chunk count was not "
        f"{max_tokens} (the simulator merged deltas) / ITL samples.")
    add("")
    for c in concurrencies:
        for mode in modes:
            cells = ", ".join(f"{r['n_req']}/{r['n_err']}/{r['merged']}/{r['n_itl']}"
                              for r in runs[(c, mode)])
            add(f"- C={c} {MODE_LABELS[mode]}: {cells}")
    return "\n".join(lines)


def code_line() -> str:
    """Which sidecar code was measured: the commit, whether sidecar/ differs from it, and a hash
    of every sidecar/*.py as it was read (the tree changes under parallel work)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((REPO_ROOT / "sidecar").rglob("*.py")):
        digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes())
    head = dirty = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "sidecar"],
                                 cwd=REPO_ROOT, capture_output=True, text=True,
                                 timeout=10).stdout.splitlines()
        dirty = f"{len(changed)} changed/untracked paths under sidecar/"
    return f"code: HEAD {head}, {dirty}, sha256(sidecar/**/*.py) {digest.hexdigest()[:12]}"


def machine_line() -> str:
    model = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import aiohttp
    import uvloop
    return (f"nproc {os.cpu_count()}, CPU {model}, Python {platform.python_version()}, "
            f"aiohttp {aiohttp.__version__}, uvloop {uvloop.__version__}, "
            f"numpy {np.__version__}, kernel {platform.release()}\n# {code_line()}")


def run_overhead(args: argparse.Namespace) -> int:
    global AUTOGROUP_NICE
    AUTOGROUP_NICE = args.nice
    exit_on_sigterm()
    pin = can_pin() and not args.no_pin
    if pin:
        os.sched_setaffinity(0, {CLIENT_CORE})
    sim_core = SIM_CORE if pin else None
    client_core = CLIENT_CORE if pin else None
    proxy_core = PROXY_CORE if pin else None
    modes = ["direct", *(m for m in args.modes if m != "direct")]
    workdir = Path(tempfile.mkdtemp(prefix="proxy-overhead-"))
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    raw: list[dict[str, Any]] = []
    steps: dict[int, float] = {}
    probes: dict[int, list[dict[str, dict[str, float]]]] = {}
    started = time.monotonic()
    print(f"# {machine_line()}", flush=True)
    print(f"# pinning: {'simulator + client on core 0, relays on core 1' if pin else 'off'}; "
          f"autogroup nice {args.nice}; logs and raw client output in {workdir}",
          flush=True)
    for c in args.concurrency:
        step = step_s_for(c, args.min_step_ms, args.target_rate)
        steps[c] = step
        request_s = step * (args.max_tokens + 1)
        warmup_s = max(args.warmup_s, 1.5 * request_s)
        sim_port = free_port()
        procs: dict[str, subprocess.Popen[bytes]] = {}
        ports = {"direct": sim_port}
        try:
            procs["sim"] = start_sim(sim_port, step, workdir / f"sim-{c}.log", sim_core)
            if "sidecar" in modes:
                ports["sidecar"] = free_port()
                procs["sidecar"] = start_proxy(sim_port, ports["sidecar"], free_port(),
                                               workdir / f"proxy-{c}.log", proxy_core,
                                               args.proxy_arg)
            if "bare" in modes:
                ports["bare"] = free_port()
                procs["bare"] = start_bare_relay(sim_port, ports["bare"],
                                                 workdir / f"bare-{c}.log", proxy_core)
            ours = [p.pid for p in procs.values()]
            for rep in range(args.repeats):
                if args.quiet_below > 0:
                    bg = wait_quiet(ours, args.quiet_below, args.quiet_wait_s)
                    print(f"  (background load before repeat {rep}: {bg:.2f} cores)", flush=True)
                probe = probe_cores(sorted({sim_core, proxy_core}, key=str), workdir)
                probes.setdefault(c, []).append(probe)
                print("  (wake-up lateness of 1 ms sleeps, µs: " + "; ".join(
                    f"{k} p50 {v['p50']:.0f} p99 {v['p99']:.0f} max {v['max']:.0f}"
                    for k, v in probe.items()) + ")", flush=True)
                for mode in modes:
                    out = workdir / f"c{c}-{mode}-{rep}.json"
                    relay = procs.get(mode) if mode != "direct" else None
                    argv = client_argv(f"http://{HOST}:{ports[mode]}", c, args.max_tokens,
                                       warmup_s, args.measure_s, request_s, out,
                                       f"{mode}{c}r{rep}",
                                       watch_pid=relay.pid if relay else None,
                                       sim_pid=procs["sim"].pid,
                                       other_pids=[p.pid for k, p in procs.items()
                                                   if k not in ("sim", mode)])
                    budget = warmup_s + args.measure_s + 60
                    subprocess.run(argv, check=True, timeout=budget, cwd=REPO_ROOT,
                                   stdin=subprocess.DEVNULL, preexec_fn=_pinner(client_core))
                    summary = analyse_run(json.loads(out.read_text()))
                    runs.setdefault((c, mode), []).append(summary)
                    raw.append({"concurrency": c, "mode": mode, "repeat": rep,
                                "step_s": step, "summary": summary})
                    extra = ""
                    if relay:
                        extra = (f", relay {summary['proxy_us_event']:.1f} µs/event, "
                                 f"{summary['proxy_rss_mib']:.0f} MiB")
                    print(f"C={c:<4} {mode:8} rep {rep}: {summary['n_req']} req "
                          f"({summary['n_err']} failed), TTFT p50/p99 "
                          f"{summary['ttft_p50']:.2f}/{summary['ttft_p99']:.2f} ms, ITL p50/p99 "
                          f"{summary['itl_p50']:.2f}/{summary['itl_p99']:.2f} ms, "
                          f"{summary['chunks_s']:.0f} chunks/s, sim+client CPU "
                          f"{summary['core0_load']:.2f}, others {summary['background']:.2f}"
                          f"{extra}", flush=True)
        finally:
            for proc in reversed(list(procs.values())):
                stop(proc)
    elapsed = time.monotonic() - started
    text = report(runs, steps, args.concurrency, modes, args.repeats, args.max_tokens, probes)
    print()
    print(text)
    print(f"\n(total wall time {elapsed:.0f} s)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"machine": machine_line(), "runs": raw},
                                                  indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    client.add_argument("--watch-pid", type=int, default=None)
    client.add_argument("--sim-pid", type=int, default=None)
    client.add_argument("--other-pids", type=lambda s: [int(x) for x in s.split(",") if x],
                        default=[], help="our other processes (idle relays, an in-process "
                        "proxy), counted as ours, not as background load")
    probe = sub.add_parser("probe", help="(internal) wake-up latency of 1 ms sleeps")
    probe.add_argument("--out", required=True)
    bare = sub.add_parser("bare-relay", help="(internal) a minimal aiohttp relay, calibration")
    bare.add_argument("--upstream", required=True)
    bare.add_argument("--port", type=int, required=True)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 16, 64, 256], help="comma-separated [1,16,64,256]")
    parser.add_argument("--repeats", type=int, default=3, help="direct/sidecar pairs [3]")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per stream [32]")
    parser.add_argument("--measure-s", type=float, default=4.0, help="measured window [4 s]")
    parser.add_argument("--warmup-s", type=float, default=1.0,
                        help="warm-up per run, at least 1.5 request durations [1]")
    parser.add_argument("--min-step-ms", type=float, default=2.0,
                        help="smallest engine step of the simulator [2 ms]")
    parser.add_argument("--target-rate", type=float, default=8000.0,
                        help="aggregate token chunks/s the step is sized for [8000]")
    parser.add_argument("--modes", type=lambda s: s.split(","),
                        default=["direct", "sidecar", "bare"],
                        help="direct plus relays to compare, in alternation order: sidecar, "
                        "bare (a minimal aiohttp relay, for calibration) [direct,sidecar,bare]")
    parser.add_argument("--proxy-arg", action="append", default=[],
                        help="extra flag for `sidecar proxy` (repeatable)")
    parser.add_argument("--quiet-below", type=float, default=0.15,
                        help="before each repeat, wait until other processes use less than "
                        "this many cores (0: don't wait) [0.15]")
    parser.add_argument("--quiet-wait-s", type=float, default=3.0,
                        help="longest such wait per repeat [3 s]")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--nice", type=int, default=0,
                        help="autogroup nice of every benchmark process, each in a session of "
                        "its own (negative needs root). On a host shared with other jobs, "
                        "e.g. -10 lets ours have the CPU first [0: leave scheduling alone]")
    parser.add_argument("--json-out", help="write every run's summary as JSON here")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: C=1,16, 1 pair, 2 s windows")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "client":
        return run_client(args)
    if args.command == "bare-relay":
        return run_bare_relay(args)
    if args.command == "probe":
        Path(args.out).write_text(json.dumps(sched_probe()))
        return 0
    if args.quick:
        args.concurrency, args.repeats, args.measure_s = [1, 16], 1, 2.0
    return run_overhead(args)


if __name__ == "__main__":
    sys.exit(main())
