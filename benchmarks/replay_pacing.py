"""How precisely the open-loop replayer keeps its schedule, and the highest rate it sustains.

    python benchmarks/replay_pacing.py            # ~2 minutes; needs nginx (Debian nginx-light)
    python benchmarks/replay_pacing.py --smoke    # CI: a few seconds, results format only
    python benchmarks/replay_pacing.py --seconds 40 --rates 2000 --search 2000 --workers 1
                                                  # a long replay: what grows with its length

The target is nginx answering every request at once with a fixed, tiny vLLM-shaped stream
(one token chunk, a usage chunk, [DONE]), so the sender, not the server, is what is measured.
For each rate the replayer sends a Poisson schedule for a few seconds and reports lateness
(actual - scheduled send) p50/p99/max and the achieved send rate; then it searches the highest
rate at which lateness p99 stays <= 1 ms and the achieved rate keeps >= 97% of the requested one,
with 1 and with 2 sender processes (--workers). A few seconds per rate cannot show what grows
with a replay's length: Python's full garbage collections scanned every planned and finished
request and held every send while they ran, 240 ms pauses by 80,000 requests (benchmarks/
RESULTS.md, "Session 30: a long replay's pace"); the long command above is their check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from proxy_overhead import free_port

from sidecar.replay import load
from sidecar.replay.options import ReplayOptions
from sidecar.replay.runner import SentRequest
from sidecar.tracefile import TraceRequest

STREAM = (
    'data: {"id":"cmpl-x","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
    '"text":" a","logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{'
    '"prompt_tokens":8,"total_tokens":9,"completion_tokens":1}}\\n\\n'
    'data: {"id":"cmpl-x","object":"text_completion","created":1,"model":"m","choices":[],'
    '"usage":{"prompt_tokens":8,"total_tokens":9,"completion_tokens":1}}\\n\\n'
    "data: [DONE]\\n\\n"
)


def find_nginx() -> str | None:
    for candidate in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def start_nginx(directory: Path, port: int) -> subprocess.Popen[bytes]:
    nginx = find_nginx()
    if nginx is None:
        raise RuntimeError("nginx not found: install Debian nginx-light")
    conf = directory / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {directory}/nginx.pid;
error_log {directory}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {directory}/body;
    keepalive_requests 1000000;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            default_type text/event-stream;
            return 200 '{STREAM}';
        }}
    }}
}}
""")
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(directory)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("nginx did not start")


def measure(target: str, rate: float, seconds: float, workers: int) -> dict[str, Any]:
    n = max(50, int(rate * seconds))
    requests = [TraceRequest(t=0.0, n_in=8, n_out=1) for _ in range(n)]
    options = ReplayOptions("unused", target, rate=rate, workers=workers, quiet=True, seed=1)
    plan = load.plan(requests, options, "m")
    sent: Sequence[SentRequest] = asyncio.run(load.run(plan, options, quiet=True))
    lateness = np.array([s.lateness_ns for s in sent]) / 1e6
    actual = np.sort(np.array([s.actual_ns for s in sent])) / 1e9
    achieved = (len(actual) - 1) / (actual[-1] - actual[0]) if len(actual) > 1 else 0.0
    scheduled = np.sort(np.array([s.scheduled_ns for s in sent])) / 1e9
    requested = (len(scheduled) - 1) / (scheduled[-1] - scheduled[0])
    failed = sum(1 for s in sent if not s.record.ok)
    return {
        "rate": rate,
        "workers": workers,
        "requests": len(sent),
        "failed": failed,
        "requested_rate": requested,
        "achieved_rate": achieved,
        "p50_ms": float(np.percentile(lateness, 50)),
        "p99_ms": float(np.percentile(lateness, 99)),
        "max_ms": float(lateness.max()),
    }


def sustains(row: dict[str, Any]) -> bool:
    return bool(
        row["p99_ms"] <= 1.0
        and row["achieved_rate"] >= 0.97 * row["requested_rate"]
        and row["failed"] == 0
    )


def main(argv: Sequence[str] | None = None) -> int:
    cli = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.add_argument("--seconds", type=float, default=3.0, help="schedule length per rate")
    cli.add_argument("--rates", default="100,1000,5000")
    cli.add_argument("--search", default="250,500,1000,1500,2000,3000,4000,6000,8000")
    cli.add_argument("--workers", default="1,2", help="sender processes to try [1,2]")
    cli.add_argument("--json-out", help="write the rows and the search results as JSON here")
    cli.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke run: 1 worker, 100 and 200 req/s, 0.5 s schedules",
    )
    options = cli.parse_args(argv)
    if options.smoke:
        options.seconds, options.rates, options.search, options.workers = 0.5, "100", "100,200", "1"
    worker_counts = [int(w) for w in options.workers.split(",")]
    if find_nginx() is None:
        print(
            "replay_pacing: nginx not found (the target): install Debian nginx-light",
            file=sys.stderr,
        )
        return 2
    rows: list[dict[str, Any]] = []
    best_rates: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="pacing-") as tmp:
        port = free_port()
        nginx = start_nginx(Path(tmp), port)
        target = f"http://127.0.0.1:{port}"
        try:
            print(
                f"# replay pacing: python {platform.python_version()}, {os.cpu_count()} "
                f"cores, target nginx on {target}"
            )
            print(
                "| rate req/s | workers | requests | achieved req/s | lateness p50 ms | "
                "p99 ms | max ms | failed |"
            )
            print("|---:|---:|---:|---:|---:|---:|---:|---:|")
            for workers in worker_counts:
                for rate in (float(r) for r in options.rates.split(",")):
                    row = measure(target, rate, options.seconds, workers)
                    rows.append(row)
                    print(
                        f"| {rate:g} | {workers} | {row['requests']} | "
                        f"{row['achieved_rate']:.0f} | {row['p50_ms']:.3f} | "
                        f"{row['p99_ms']:.3f} | {row['max_ms']:.3f} | {row['failed']} |",
                        flush=True,
                    )
            print("\n| workers | highest rate with lateness p99 <= 1 ms and >= 97% achieved |")
            print("|---:|---:|")
            for workers in worker_counts:
                best = 0.0
                for rate in (float(r) for r in options.search.split(",")):
                    row = measure(target, rate, options.seconds, workers)
                    if not sustains(row):
                        break
                    best = rate
                best_rates[workers] = best
                print(f"| {workers} | {best:g} req/s |", flush=True)
        finally:
            nginx.terminate()
            nginx.wait(timeout=10)
    if options.json_out:
        Path(options.json_out).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "highest_sustained_rate": {str(k): v for k, v in best_rates.items()},
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
