"""How accurate the sidecar's stamps are: its records vs the simulator's ground truth.

    python benchmarks/proxy_accuracy.py                       # C=1 and C=128, about 40 s
    python benchmarks/proxy_accuracy.py --concurrency 1,16,128 --measure-s 8
    python benchmarks/proxy_accuracy.py --smoke               # CI: C=4, 0.5 s, a few seconds

Processes (pinned on a 2-core host):

- the simulator (``python -m sidecar sim --ground-truth FILE``): core 0; it appends, per request,
  ``received_ns`` (the request's last bytes arrived) and ``chunk_ns`` (right after each write
  to the socket), all ``time.perf_counter_ns()``;
- the load client (``proxy_overhead.py client``, the same client as the overhead benchmark,
  sending ``X-Request-Id``): core 0;
- the sidecar, *in this process* (``sidecar.serve.build_proxy_server`` with the default settings,
  token accounting on, health checks off, plus a sink that keeps every record): core 1, alone.
  This process does nothing else while the load runs (it waits on the client's exit).

perf_counter_ns is CLOCK_MONOTONIC on Linux, shared by every process of the host, so the
simulator's and the client's stamps can be compared with the proxy's. The record stores offsets
from the proxy's t_arrive and only the wall-clock instant of t_arrive (``wall_time_ns``), not the
monotonic one. ``wall_time_ns - (time_ns - perf_counter_ns)`` would recover it only while the
wall clock is not stepped, and on a VM whose wall clock is adjusted in steps it is not (the run
prints how far the wall-minus-monotonic offset moved across requests). So this benchmark wraps
``sidecar.clock.anchor`` in its own process: the wrapper calls the original and remembers the
monotonic reading paired with each wall reading it returns (one dict store per call; what the
proxy records is unchanged), and each record's absolute t_arrive is looked up by its
``wall_time_ns``.

Compared per request (measured requests only, i.e. those started in the measured window):

- server TTFT: ``server.marks[0].offset_ns - server.start_ns`` (proxy: upstream socket, from
  t_up_send) vs ``first token chunk_ns - received_ns`` (simulator);
- server ITL: every gap between consecutive server marks vs the gap between the same two token
  chunks in the ground truth (chunk counts and per-chunk token counts are checked equal);
- absolute lag of each server mark: proxy read stamp - simulator write stamp (>= 0), and of
  t_up_send: simulator body-read instant - proxy send instant;
- the client vantage, for reference: the proxy's client marks (after its write returned) vs the
  load client's read stamps, and the proxy's client TTFT (from t_arrive) vs the client's own
  TTFT (from just before its send).

Also printed: the proxy process's garbage-collector pauses during the window (``gc.callbacks``),
since a pause stalls every stream at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proxy_overhead as po  # noqa: E402  (the shared client and process helpers)

from sidecar import clock as sidecar_clock  # noqa: E402
from sidecar.proxy.recordwire import decode_record, encode_record  # noqa: E402
from sidecar.record import RequestRecord  # noqa: E402

ANCHORS: dict[int, int] = {}  # wall_ns -> mono_ns of every anchor the proxy read
_original_anchor = sidecar_clock.anchor


def _recording_anchor() -> tuple[int, int]:
    wall_ns, mono_ns = _original_anchor()
    ANCHORS[wall_ns] = mono_ns
    return wall_ns, mono_ns


class KeepSink:
    """Keeps every record (the proxy calls on_record on its loop, once per request), encoded as
    a worker encodes it for its collector (`recordwire`), and decodes them when asked.

    Why encoded: a worker does not keep its records, it ships them. Kept as objects in the
    proxy's process, thousands of records made every generation-2 collection scan them
    (67-96 ms pauses at 128 streams, in every run's window), a stall this harness made and
    no deployed worker has; bytes are not tracked by the collector."""

    name = "accuracy-bench"

    def __init__(self) -> None:
        self._encoded: list[bytes] = []

    def on_record(self, record: RequestRecord) -> None:
        self._encoded.append(encode_record(record))

    @property
    def records(self) -> dict[str, RequestRecord]:
        decoded = (decode_record(data) for data in self._encoded)
        return {record.request_id: record for record in decoded}


class GCWatch:
    """Pauses of this process's garbage collector, by generation."""

    def __init__(self) -> None:
        self.active = False
        self._start = 0
        self.pauses: list[tuple[int, int]] = []  # (generation, ns)

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        elif self.active:
            self.pauses.append((info["generation"], time.perf_counter_ns() - self._start))


def clock_offset_ns(samples: int = 2000) -> tuple[int, int]:
    """time_ns - perf_counter_ns, read in the order `sidecar.clock.anchor` uses; the median
    and the spread (p99 - p1) over samples."""
    deltas = []
    for _ in range(samples):
        wall = time.time_ns()
        mono = time.perf_counter_ns()
        deltas.append(wall - mono)
    arr = np.asarray(deltas)
    return int(np.median(arr)), int(np.percentile(arr, 99) - np.percentile(arr, 1))


def summarize_us(values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64) / 1e3
    if arr.size == 0:
        return {"n": 0}
    mag = np.abs(arr)
    return {
        "n": int(arr.size),
        "p50": float(np.percentile(arr, 50)),
        "p1": float(np.percentile(arr, 1)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "abs_p50": float(np.percentile(mag, 50)),
        "abs_p90": float(np.percentile(mag, 90)),
        "abs_p99": float(np.percentile(mag, 99)),
        "abs_max": float(mag.max()),
    }


def compare(
    records: dict[str, RequestRecord], truth: dict[str, dict[str, Any]], client: dict[str, Any]
) -> dict[str, Any]:
    errs: dict[str, list[float]] = {
        k: []
        for k in (
            "server_ttft",
            "server_itl",
            "server_mark_lag",
            "up_send_lag",
            "client_ttft",
            "client_itl",
            "client_mark_lag",
        )
    }
    problems: dict[str, int] = {
        "no_record": 0,
        "no_truth": 0,
        "not_ok": 0,
        "count_mismatch": 0,
        "token_mismatch": 0,
        "no_anchor": 0,
    }
    wall_minus_mono: list[int] = []
    matched = 0
    for req in client["requests"]:
        rid = req["id"]
        rec = records.get(rid)
        gt = truth.get(rid)
        if rec is None:
            problems["no_record"] += 1
            continue
        if gt is None:
            problems["no_truth"] += 1
            continue
        if not (req["ok"] and rec.ok and gt["outcome"] == "ok" and rec.server is not None):
            problems["not_ok"] += 1
            continue
        g = [t for t, k in zip(gt["chunk_ns"], gt["chunk_kinds"], strict=True) if k == "token"]
        g_tok = [
            n for n, k in zip(gt["chunk_tokens"], gt["chunk_kinds"], strict=True) if k == "token"
        ]
        server = rec.server
        m = [mark.offset_ns for mark in server.marks]
        if len(m) != len(g) or not m:
            problems["count_mismatch"] += 1
            continue
        if [mark.n_tokens for mark in server.marks] != g_tok:
            problems["token_mismatch"] += 1
        matched += 1
        wall_minus_mono.append(gt["wall_time_ns"] - gt["received_ns"])
        errs["server_ttft"].append((m[0] - server.start_ns) - (g[0] - gt["received_ns"]))
        errs["server_itl"].extend((m[i + 1] - m[i]) - (g[i + 1] - g[i]) for i in range(len(m) - 1))
        # The proxy reads its anchor at t_read (the request read whole) and dates the record
        # back to t_arrive (the first byte) by request_read_ns: undo that to find the anchor.
        read = rec.request_read_ns or 0
        anchor = ANCHORS.get(rec.wall_time_ns + read)
        if anchor is None:
            problems["no_anchor"] += 1
            continue
        arrive = anchor - read  # absolute monotonic t_arrive (see docstring)
        errs["server_mark_lag"].extend(arrive + m[i] - g[i] for i in range(len(m)))
        errs["up_send_lag"].append(gt["received_ns"] - (arrive + server.start_ns))
        c = [mark.offset_ns for mark in rec.client.marks]
        k = req["tok"]
        if len(c) == len(k) and c:
            errs["client_ttft"].append(c[0] - (k[0] - req["t_send"]))
            errs["client_itl"].extend(
                (c[i + 1] - c[i]) - (k[i + 1] - k[i]) for i in range(len(c) - 1)
            )
            errs["client_mark_lag"].extend(k[i] - (arrive + c[i]) for i in range(len(c)))
    spread = (max(wall_minus_mono) - min(wall_minus_mono)) if wall_minus_mono else 0
    return {
        "matched": matched,
        "problems": problems,
        "wall_minus_mono_range_ns": spread,
        "stats": {name: summarize_us(v) for name, v in errs.items()},
    }


async def run_level(c: int, args: argparse.Namespace, workdir: Path, pin: bool) -> dict[str, Any]:
    from sidecar.config import build_config
    from sidecar.proxy.gcpolicy import settle as settle_gc
    from sidecar.serve import build_proxy_server

    step = po.step_s_for(c, args.min_step_ms, args.target_rate)
    request_s = step * (args.max_tokens + 1)
    warmup_s = max(args.warmup_s, 1.5 * request_s)
    gt_path = workdir / f"truth-c{c}.jsonl"
    sim_port = po.free_port()
    sim = po.start_sim(
        sim_port,
        step,
        workdir / f"sim-c{c}.log",
        po.SIM_CORE if pin else None,
        ground_truth=str(gt_path),
    )
    sink = KeepSink()
    watch = GCWatch()
    server = None
    client_proc: asyncio.subprocess.Process | None = None
    try:
        config = build_config(
            {
                "upstreams": [f"http://{po.HOST}:{sim_port}"],
                "listen": f"{po.HOST}:0",
                "metrics_listen": f"{po.HOST}:0",
                "health_interval": "0",
                "server_stamps": args.server_stamps,
            },
            environ={},
        )
        server, _window = build_proxy_server(config)
        server.proxy.fanout.add(sink)
        sidecar_clock.anchor = _recording_anchor
        await server.start()
        settle_gc()  # as `sidecar proxy` does once it listens
        if args.quiet_below > 0:
            bg = po.wait_quiet([os.getpid(), sim.pid], args.quiet_below, args.quiet_wait_s)
            print(f"  (background load before C={c}: {bg:.2f} cores)", flush=True)
        delta_before, spread_before = clock_offset_ns()
        out = workdir / f"client-c{c}.json"
        argv = po.client_argv(
            server.url,
            c,
            args.max_tokens,
            warmup_s,
            args.measure_s,
            request_s,
            out,
            f"acc{c}",
            watch_pid=os.getpid(),
            sim_pid=sim.pid,
        )
        client_core = po.CLIENT_CORE if pin else None
        gc.callbacks.append(watch)
        client_proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=po.REPO_ROOT,
            stdin=asyncio.subprocess.DEVNULL,
            preexec_fn=po._pinner(client_core),
        )
        loop = asyncio.get_running_loop()
        # GC pauses are counted over the measured window only (the client's warm-up excluded).
        loop.call_later(warmup_s, setattr, watch, "active", True)
        loop.call_later(warmup_s + args.measure_s, setattr, watch, "active", False)
        rc = await asyncio.wait_for(client_proc.wait(), warmup_s + args.measure_s + 60)
        client_proc = None
        gc.callbacks.remove(watch)
        tracked = len(gc.get_objects())
        if rc != 0:
            raise RuntimeError(f"load client exited with {rc}")
        delta_after, spread_after = clock_offset_ns()
    finally:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(watch)
        if client_proc is not None and client_proc.returncode is None:
            client_proc.kill()
            await client_proc.wait()
        if server is not None:
            await server.close()
        sidecar_clock.anchor = _original_anchor
        po.stop(sim)
    client = json.loads(out.read_text())
    truth: dict[str, dict[str, Any]] = {}
    with open(gt_path) as f:
        for line in f:
            obj = json.loads(line)
            truth[obj["request_id"]] = obj
    result = compare(sink.records, truth, client)
    run = po.analyse_run(client)
    pauses: dict[int, list[int]] = {}
    for gen, ns in watch.pauses:
        pauses.setdefault(gen, []).append(ns)
    result.update(
        {
            "concurrency": c,
            "step_s": step,
            "measured": len(client["requests"]),
            "clock_delta_drift_ns": delta_after - delta_before,
            "gc_tracked_objects": tracked,
            "background": run["background"],
            "proxy_us_event": run.get("proxy_us_event"),
            "chunks_s": run["chunks_s"],
            "clock_delta_spread_ns": max(spread_before, spread_after),
            "gc": {
                gen: {"n": len(v), "total_ms": sum(v) / 1e6, "max_ms": max(v) / 1e6}
                for gen, v in sorted(pauses.items())
            },
        }
    )
    return result


LABELS = {
    "server_ttft": "server TTFT: proxy − truth",
    "server_itl": "server ITL gap: proxy − truth (per event)",
    "server_mark_lag": "server mark, absolute: proxy read − simulator write",
    "up_send_lag": "t_up_send, absolute: simulator body read − proxy send",
    "client_ttft": "client TTFT: proxy (from t_arrive) − load client (from its send)",
    "client_itl": "client ITL gap: proxy write − load client read (per event)",
    "client_mark_lag": "client mark, absolute: load client read − proxy write returned",
}


def report(results: Sequence[dict[str, Any]]) -> str:
    lines: list[str] = []
    add = lines.append
    add(
        "Errors in µs. Signed p1/p50/p99, and p50/p99/max of the absolute value. "
        "TTFT: sample = request; ITL and marks: sample = token event."
    )
    add("")
    add("| C | step ms | quantity | n | p1 | p50 | p99 | abs p50 | abs p99 | abs max |")
    add("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
        for key, label in LABELS.items():
            s = res["stats"][key]
            if not s.get("n"):
                continue
            add(
                f"| {res['concurrency']} | {res['step_s'] * 1e3:g} | {label} | {s['n']} | "
                f"{s['p1']:.1f} | {s['p50']:.1f} | {s['p99']:.1f} | {s['abs_p50']:.1f} | "
                f"{s['abs_p99']:.1f} | {s['abs_max']:.1f} |"
            )
    add("")
    for res in results:
        gc_text = (
            "; ".join(
                f"gen{gen}: {v['n']} pauses, total {v['total_ms']:.1f} ms, max {v['max_ms']:.2f} ms"
                for gen, v in res["gc"].items()
            )
            or "none"
        )
        add(
            f"- C={res['concurrency']}: {res['chunks_s']:.0f} token chunks/s, proxy "
            f"{res['proxy_us_event']:.1f} µs CPU/event; "
            f"{res['measured']} measured requests, {res['matched']} "
            f"compared, problems {res['problems']}; wall − monotonic offset: moved "
            f"{res['clock_delta_drift_ns'] / 1e6:.3f} ms in the proxy's process over the run, "
            f"range {res['wall_minus_mono_range_ns'] / 1e6:.3f} ms across the simulator's "
            f"per-request readings; proxy GC pauses in the window: {gc_text}; "
            f"objects tracked by the GC at the end: {res['gc_tracked_objects']}; "
            f"other processes' CPU in the window: {res['background']:.2f} cores"
        )
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> int:
    # SIGTERM cancels this task: run_level's `finally` stops the simulator and the client.
    task = asyncio.current_task()
    if task is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    pin = po.can_pin() and not args.no_pin
    if pin:
        os.sched_setaffinity(0, {po.PROXY_CORE})
    workdir = Path(tempfile.mkdtemp(prefix="proxy-accuracy-"))
    print(f"# {po.machine_line()}", flush=True)
    where = "simulator + client core 0, proxy (this process) core 1" if pin else "off"
    print(
        f"# pinning: {where}; autogroup nice {args.nice}; server stamps: {args.server_stamps}; "
        "ground truth and "
        f"raw client output in {workdir}",
        flush=True,
    )
    results = []
    for c in args.concurrency:
        res = await run_level(c, args, workdir, pin)
        results.append(res)
        s = res["stats"]
        print(
            f"C={c}: server TTFT err |p99| {s['server_ttft'].get('abs_p99', float('nan')):.1f}"
            f" µs, server ITL err |p99| {s['server_itl'].get('abs_p99', float('nan')):.1f} µs"
            f", compared {res['matched']}/{res['measured']}",
            flush=True,
        )
    print()
    print(report(results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 128],
        help="comma-separated load levels [1,128]",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per stream [32]")
    parser.add_argument("--measure-s", type=float, default=8.0, help="measured window [8]")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="warm-up [1]")
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
    po.add_quiet_arguments(parser, 0.15, 5.0, "level")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="autogroup nice of every benchmark process, each in a session of "
        "its own (negative needs root) [0: leave scheduling alone]",
    )
    parser.add_argument(
        "--server-stamps",
        choices=("kernel", "read"),
        default="kernel",
        help="the proxy's --server-stamps: kernel receive timestamps or read instants [kernel]",
    )
    parser.add_argument("--json-out", help="write the results as JSON here")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke run: C=4, 8 tokens, 0.2 s warm-up, 0.5 s window, no "
        "quiet wait (the harness runs; no timing claims)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.concurrency, args.max_tokens, args.warmup_s, args.measure_s = [4], 8, 0.2, 0.5
        args.quiet_below = 0.0
    status = po.rerun_in_own_session(args.nice)
    if status is not None:
        return status
    po.AUTOGROUP_NICE = args.nice
    import uvloop

    try:
        return uvloop.run(amain(args))
    except asyncio.CancelledError:  # SIGTERM: everything started has been stopped
        print("proxy_accuracy: terminated", file=sys.stderr)
        return 143


if __name__ == "__main__":
    sys.exit(main())
