"""Does a large prompt on one simulated replica disturb another, and is the ground truth exact?

    python benchmarks/sim_isolation.py --json-out benchmarks/results/sim_isolation.json
    python benchmarks/sim_isolation.py --src /tmp/before      # the same run against older code
    python benchmarks/sim_isolation.py --smoke                 # a few seconds

Setup: ``sidecar sim --replicas 2 --ground-truth FILE`` (its default process layout, or
``--one-process`` when this script is given ``--one-process``), run from ``--src`` (a directory
holding a ``sidecar`` package; default: this checkout), engine step ``--step-ms``, context long
enough for the largest prompt. The load client is this process (raw HTTP/1.1 over asyncio
streams, so that the instant a request is sent is the instant its bytes were handed to the
kernel).

Per round and prompt size: one non-streamed completion with a SIZE KB prompt (fresh random
words each round) goes to replica 0; ``--offsets-ms`` later, one short streamed completion each
(``--victim-tokens`` tokens, ignore_eos) goes to replica 1. A control round sends the victims
without the large prompt. Per victim, against the simulator's ground-truth line for it:

- received lag: ground truth ``received_ns`` - the client's send instant (what the stamp
  misses of the request's arrival; the proxy's "server TTFT" starts at its send);
- TTFT error: ground-truth TTFT (first token write - received) - the client's TTFT (first
  token read - send). Negative: the ground truth says the replica was faster than it was;
- E2E error: ground-truth (done - received) - the client's (``[DONE]`` read - send);
- stall: per round, one ``--long-tokens`` stream is already running on replica 1 when the
  large prompt is sent: the largest gap between its consecutive token writes, minus the step
  time (replica 1's own engine does not slow down: anything above a fraction of a ms is
  another replica's work holding replica 1 up).

Cold start (``--cold-runs`` fresh single-replica simulators): the client E2E of the first
streamed chat request after start against the median of the next ``--cold-requests - 1``.

All instants are ``time.perf_counter_ns()`` (CLOCK_MONOTONIC, shared by the processes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
MODEL = "sim-model"
WORDS = [
    "".join(random.Random(i).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(2 + i % 8))
    for i in range(5000)
]


def big_prompt(kb: int, seed: int) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < kb * 1000:
        word = rng.choice(WORDS)
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[: kb * 1000]


def start_sim(
    src: Path, replicas: int, truth: Path, step_ms: float, log: Path, extra: list[str]
) -> tuple[subprocess.Popen[bytes], list[str]]:
    argv = [
        sys.executable,
        "-m",
        "sidecar",
        "sim",
        "--replicas",
        str(replicas),
        "--port",
        "0",
        "--host",
        HOST,
        "--model",
        MODEL,
        "--ground-truth",
        str(truth),
        "--step-floor-s",
        str(step_ms / 1000),
        "--per-token-s",
        "0",
        "--max-model-len",
        "262144",
        "--max-num-batched-tokens",
        "16384",
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(src))
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, cwd=src, env=env, stdout=subprocess.PIPE, stderr=err)
    urls: list[str] = []
    assert proc.stdout is not None
    while len(urls) < replicas:
        line = proc.stdout.readline().decode()
        if not line:
            raise RuntimeError(f"simulator exited: see {log}")
        urls.append(line.strip().rsplit(" ", 1)[1])
    return proc, urls


def stop_sim(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def read_truth(path: Path) -> dict[str, dict[str, Any]]:
    lines: dict[str, dict[str, Any]] = {}
    for text in path.read_text().splitlines():
        line = json.loads(text)
        lines[line["request_id"]] = line
    return lines


async def send(url: str, path: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """One request on a fresh connection; the send instant and each read's instant."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nX-Request-Id: {request_id}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    writer.write(head + payload)
    sent_ns = time.perf_counter_ns()
    await writer.drain()
    data = b""
    first_ns = 0
    while True:
        piece = await reader.read(1 << 16)
        now = time.perf_counter_ns()
        if not piece:
            break
        data += piece
        if not first_ns and b"data: {" in data:
            first_ns = now
        if b"data: [DONE]" in data or (not body.get("stream") and b"\r\n0\r\n\r\n" in data):
            break
    done_ns = time.perf_counter_ns()
    writer.close()
    return {
        "id": request_id,
        "sent_ns": sent_ns,
        "first_ns": first_ns,
        "done_ns": done_ns,
        "ok": data.startswith(b"HTTP/1.1 200"),
    }


def victim_body(tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "a short prompt",
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
    }


async def run_load(urls: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    victims: list[dict[str, Any]] = []
    offsets = [float(x) for x in args.offsets_ms.split(",")]
    sizes = [0] + [int(x) for x in args.sizes_kb.split(",")]
    for round_index in range(args.rounds):
        for kb in sizes:
            tag = f"r{round_index}-kb{kb}"
            big: asyncio.Task[dict[str, Any]] | None = None
            # A stream already running on replica 1 when the large prompt arrives.
            long_stream = asyncio.create_task(
                send(urls[1], "/v1/completions", victim_body(args.long_tokens), f"long-{tag}")
            )
            await asyncio.sleep(3 * args.step_ms / 1000)
            if kb:
                body = {
                    "model": MODEL,
                    "prompt": big_prompt(kb, round_index * 1000 + kb),
                    "max_tokens": 1,
                    "stream": False,
                }
                big = asyncio.create_task(send(urls[0], "/v1/completions", body, f"big-{tag}"))
            start = time.perf_counter()
            tasks = [long_stream]
            for i, offset in enumerate(offsets):
                delay = start + offset / 1000 - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(
                    asyncio.create_task(
                        send(
                            urls[1],
                            "/v1/completions",
                            victim_body(args.victim_tokens),
                            f"victim-{tag}-{i}",
                        )
                    )
                )
            for result in await asyncio.gather(*tasks):
                result["kb"] = kb
                victims.append(result)
            if big is not None:
                await big
            await asyncio.sleep(0.05)
    return victims


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {
        "n": len(values),
        "p50": statistics.median(values),
        "p95": p95,
        "min": ordered[0],
        "max": ordered[-1],
    }


def analyse(
    victims: list[dict[str, Any]], truth: dict[str, dict[str, Any]], step_ms: float
) -> dict[str, dict[str, Any]]:
    by_size: dict[int, dict[str, list[float]]] = {}
    for victim in victims:
        line = truth.get(victim["id"])
        if line is None or not victim["ok"] or line["outcome"] != "ok":
            continue
        tokens = [
            t for t, k in zip(line["chunk_ns"], line["chunk_kinds"], strict=True) if k == "token"
        ]
        if not tokens or not victim["first_ns"]:
            continue
        errs = by_size.setdefault(
            victim["kb"],
            {"received_lag_ms": [], "ttft_err_ms": [], "e2e_err_ms": [], "stall_ms": []},
        )
        if victim["id"].startswith("long-"):
            gaps = [b - a for a, b in zip(tokens, tokens[1:], strict=False)]
            errs["stall_ms"].append(max(gaps, default=0) / 1e6 - step_ms)
            continue
        received = line["received_ns"]
        errs["received_lag_ms"].append((received - victim["sent_ns"]) / 1e6)
        errs["ttft_err_ms"].append(
            ((tokens[0] - received) - (victim["first_ns"] - victim["sent_ns"])) / 1e6
        )
        errs["e2e_err_ms"].append(
            ((line["done_ns"] - received) - (victim["done_ns"] - victim["sent_ns"])) / 1e6
        )
    return {
        str(kb): {name: summarize(v) for name, v in errs.items()}
        for kb, errs in sorted(by_size.items())
    }


async def cold_start(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    firsts: list[float] = []
    rests: list[float] = []
    for run in range(args.cold_runs):
        proc, urls = start_sim(
            Path(args.src),
            1,
            workdir / f"cold-{run}.jsonl",
            2.0,
            workdir / f"cold-{run}.log",
            args.sim_args,
        )
        try:
            for i in range(args.cold_requests):
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi there"}],
                    "max_tokens": 8,
                    "stream": True,
                    "ignore_eos": True,
                }
                result = await send(urls[0], "/v1/chat/completions", body, f"cold-{run}-{i}")
                e2e = (result["done_ns"] - result["sent_ns"]) / 1e6
                (firsts if i == 0 else rests).append(e2e)
        finally:
            stop_sim(proc)
    return {
        "first_e2e_ms": summarize(firsts),
        "later_e2e_ms": summarize(rests),
        "engine_ms": 8 * 2.0,
    }


def describe(src: Path) -> str:
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        head = "?"
    return (
        f"# nproc {os.cpu_count()}, Python {platform.python_version()}, src {src}, "
        f"checkout HEAD {head}"
    )


def print_table(result: dict[str, Any]) -> None:
    print(
        "| prompt KB | victims | received lag ms p50 / p95 / max | TTFT err ms p50 / min "
        "| E2E err ms p50 / min | stall ms p50 / max |"
    )
    print("|---:|---:|---|---|---|---|")
    for kb, stats in result["isolation"].items():
        lag, ttft, e2e, stall = (
            stats[k] for k in ("received_lag_ms", "ttft_err_ms", "e2e_err_ms", "stall_ms")
        )
        print(
            f"| {kb} | {lag['n']} | {lag['p50']:.2f} / {lag['p95']:.2f} / {lag['max']:.2f} "
            f"| {ttft['p50']:+.2f} / {ttft['min']:+.2f} | {e2e['p50']:+.2f} / {e2e['min']:+.2f} "
            f"| {stall['p50']:.2f} / {stall['max']:.2f} |"
        )
    cold = result.get("cold")
    if cold:
        print(
            f"cold start: first request E2E {cold['first_e2e_ms']['p50']:.1f} ms "
            f"(max {cold['first_e2e_ms']['max']:.1f}) vs later "
            f"{cold['later_e2e_ms']['p50']:.1f} ms; engine time {cold['engine_ms']:.0f} ms"
        )


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="sim-isolation-"))
    truth_path = workdir / "truth.jsonl"
    proc, urls = start_sim(
        Path(args.src), 2, truth_path, args.step_ms, workdir / "sim.log", args.sim_args
    )
    try:
        # Warm both replicas and this client (not measured).
        for url in urls:
            await send(url, "/v1/completions", victim_body(2), f"warm-{url}")
        victims = await run_load(urls, args)
    finally:
        stop_sim(proc)
    result: dict[str, Any] = {
        "describe": describe(Path(args.src)),
        "args": {k: v for k, v in vars(args).items() if k != "json_out"},
        "isolation": analyse(victims, read_truth(truth_path), args.step_ms),
    }
    if args.cold_runs:
        result["cold"] = await cold_start(args, workdir)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default=str(ROOT), help="directory holding the sidecar package")
    parser.add_argument("--sizes-kb", default="40,120,370")
    parser.add_argument("--offsets-ms", default="1,3,6,10,20,40")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--victim-tokens", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=30)
    parser.add_argument("--cold-runs", type=int, default=3)
    parser.add_argument("--cold-requests", type=int, default=6)
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="serve both replicas from one process (sidecar sim --one-process)",
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    args.sim_args = ["--one-process"] if args.one_process else []
    if args.smoke:
        args.rounds, args.sizes_kb, args.cold_runs = 1, "120", 1
    print(describe(Path(args.src)))
    result = asyncio.run(main_async(args))
    print_table(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
