"""The sidecar in front of a real vLLM (CPU build, tiny model): the same requests seen by the
OpenAI SDK client, by the sidecar's three vantages and by vLLM itself, and what the sidecar
costs the replica in throughput.

    sidecar vllm up [--per-request-metrics]          # a real vLLM on 127.0.0.1:8000
    python benchmarks/real_vllm.py --target http://127.0.0.1:8000 \\
        --json-out benchmarks/results/real_vllm.json > benchmarks/results/real_vllm.out.md
    python benchmarks/real_vllm.py --smoke --target URL   # seconds: the harness works

For each concurrency C (default 1, 8, 32), closed loop, chat streams of ``--max-tokens`` tokens
(``ignore_eos``), ``--requests`` requests per stream slot:

1. direct: C OpenAI SDK clients straight to vLLM; the SDK side's TTFT (first chunk with
   content), ITL (gaps between such chunks), E2E (last such chunk) and output tokens/s (vLLM's
   generation counter over the run's wall time);
2. proxied: the same through ``sidecar proxy --workers 1`` (its own processes, as deployed);
   the same SDK figures, then the sidecar's own per vantage (``/stats`` selected by the run's
   request-id prefix: client, server, and engine when vLLM runs with
   --enable-per-request-metrics), and vLLM's own histograms over the run (mean = sum / count:
   vLLM's buckets are too coarse for percentiles); token totals, the sidecar's against vLLM's
   counters.

The throughput cost is 1 - proxied tokens/s / direct tokens/s, per C. On a 2-core machine
the vLLM engine busy-spins both cores, and the sidecar, the client and the API server share
them: read the cost as an upper bound for a host with a core to spare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai

from sidecar.engine_metrics import histogram_totals, parse_engine_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proxy_overhead as po  # noqa: E402  (free ports, waiting for a port)

LATENCY = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}


async def vllm_snapshot(session: aiohttp.ClientSession, target: str) -> dict[str, float]:
    async with session.get(target + "/metrics") as response:
        text = await response.text()
    values, _ = parse_engine_metrics(text)
    out = {
        "prompt_tokens": values.get("prompt_tokens", 0.0),
        "generation_tokens": values.get("generation_tokens", 0.0),
    }
    totals = histogram_totals(text, LATENCY.values())
    for key, family_name in LATENCY.items():
        out[key + "_sum"], out[key + "_count"] = totals[family_name]
    return out


async def sdk_stream(
    client: openai.AsyncOpenAI, model: str, max_tokens: int, request_id: str, prompt: str
) -> dict[str, Any]:
    started = time.perf_counter()
    stamps: list[float] = []
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": request_id},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    if not stamps:
        return {"ok": False}
    return {
        "ok": True,
        "ttft": stamps[0] - started,
        "e2e": stamps[-1] - started,
        "itl": list(np.diff(stamps)),
    }


async def run_clients(
    base_url: str, model: str, concurrency: int, requests: int, max_tokens: int, prefix: str
) -> tuple[list[dict[str, Any]], float]:
    client = openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="not-used", max_retries=0, timeout=120
    )
    results: list[dict[str, Any]] = []

    async def slot(index: int) -> None:
        for i in range(requests):
            prompt = f"Tell story {index}-{i} about the river and the bridge, please."
            results.append(
                await sdk_stream(client, model, max_tokens, f"{prefix}{index}-{i}", prompt)
            )

    started = time.perf_counter()
    try:
        await asyncio.gather(*(slot(i) for i in range(concurrency)))
    finally:
        await client.close()
    return results, time.perf_counter() - started


def summary_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    data = np.asarray(values) * 1e3
    return {
        "mean": float(data.mean()),
        "p50": float(np.percentile(data, 50)),
        "p99": float(np.percentile(data, 99)),
    }


def sdk_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    return {
        "requests": len(results),
        "ok": len(ok),
        "ttft": summary_ms([r["ttft"] for r in ok]),
        "itl": summary_ms([g for r in ok for g in r["itl"]]),
        "e2e": summary_ms([r["e2e"] for r in ok]),
    }


def vllm_means(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in LATENCY:
        count = after[key + "_count"] - before[key + "_count"]
        total = after[key + "_sum"] - before[key + "_sum"]
        out[key] = {"mean": total / count * 1e3 if count else None, "count": count}
    out["prompt_tokens"] = after["prompt_tokens"] - before["prompt_tokens"]
    out["generation_tokens"] = after["generation_tokens"] - before["generation_tokens"]
    return out


def start_sidecar(target: str, port: int, admin_port: int, log: Path) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "sidecar",
        "proxy",
        "--upstream",
        target,
        "--listen",
        f"127.0.0.1:{port}",
        "--metrics-listen",
        f"127.0.0.1:{admin_port}",
        "--workers",
        "1",
        "--health-interval",
        "0",
        "--engine-scrape-interval",
        "0",
        "--window",
        "3600s",
    ]
    proc = subprocess.Popen(
        argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    po.wait_port(port, proc)
    po.wait_port(admin_port, proc)
    return proc


async def sidecar_view(admin: str, prefix: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(admin + f"/stats?request_id_prefix={prefix}") as response,
    ):
        view = await response.json()
    out: dict[str, Any] = {}
    for vantage, report in view.get("vantages", {}).items():
        entry: dict[str, Any] = {}
        # The engine vantage has no per-event ITL: vLLM's per-request mean ITL stands in.
        keys = {"ttft": "ttft", "itl": "mean_itl" if vantage == "engine" else "itl", "e2e": "e2e"}
        for key, name in keys.items():
            summary = report.get(name)
            if isinstance(summary, dict) and summary.get("count"):
                entry[key] = {"count": summary["count"]}
                for q in ("mean", "p50", "p99"):
                    value = summary.get(q)
                    entry[key][q] = None if value is None else value * 1e3
        out[vantage] = entry
    out["throughput"] = view.get("throughput")
    return out


async def sidecar_tokens(admin: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(admin + "/metrics") as response:
        text = await response.text()
    totals = {"prompt": 0.0, "generation": 0.0}
    for line in text.splitlines():
        if line.startswith("sidecar_prompt_tokens_total{"):
            totals["prompt"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("sidecar_generation_tokens_total{"):
            totals["generation"] += float(line.rsplit(" ", 1)[1])
    return totals


async def settled_sidecar_tokens(admin: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The sidecar's token totals once they stop moving: a worker's last records reach the
    collector (and its /metrics) a moment after the clients have their answers."""
    deadline = time.monotonic() + timeout_s
    totals = await sidecar_tokens(admin)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.3)
        again = await sidecar_tokens(admin)
        if again == totals:
            break
        totals = again
    return totals


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    target = args.target.rstrip("/")
    async with aiohttp.ClientSession() as session:
        async with session.get(target + "/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        async with session.get(target + "/version") as response:
            version = (await response.json()).get("version")
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"real-vllm-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    port, admin_port = po.free_port(), po.free_port()
    proxy = start_sidecar(target, port, admin_port, workdir / "sidecar.log")
    proxy_url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    runs: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession() as session:
            # Warm-up: the first requests down a path on a fresh vLLM are slow.
            await run_clients(target, model, 2, 2, args.max_tokens, "warm-")
            await run_clients(proxy_url, model, 2, 2, args.max_tokens, "warm-")
            for c in args.concurrency:
                row: dict[str, Any] = {"concurrency": c}
                for mode, url in (("direct", target), ("proxied", proxy_url)):
                    prefix = f"bench-{mode}-c{c}-"
                    before = await vllm_snapshot(session, target)
                    tokens_before = await sidecar_tokens(admin)
                    results, wall = await run_clients(
                        url, model, c, args.requests, args.max_tokens, prefix
                    )
                    after = await vllm_snapshot(session, target)
                    tokens_after = await settled_sidecar_tokens(admin)
                    vllm = vllm_means(before, after)
                    entry = {
                        "sdk": sdk_summary(results),
                        "vllm": vllm,
                        "wall_s": wall,
                        "output_tokens_per_s": vllm["generation_tokens"] / wall,
                    }
                    if mode == "proxied":
                        entry["sidecar"] = await sidecar_view(admin, prefix)
                        entry["sidecar_tokens"] = {
                            key: tokens_after[key] - tokens_before[key] for key in tokens_after
                        }
                    row[mode] = entry
                direct_rate = row["direct"]["output_tokens_per_s"]
                row["throughput_cost"] = (
                    1.0 - row["proxied"]["output_tokens_per_s"] / direct_rate
                    if direct_rate
                    else None
                )
                runs.append(row)
                print(
                    f"  C={c}: direct {direct_rate:.0f} tok/s, proxied "
                    f"{row['proxied']['output_tokens_per_s']:.0f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        os.killpg(proxy.pid, signal.SIGTERM)
        proxy.wait(timeout=20)
    return {
        "target": target,
        "model": model,
        "vllm_version": version,
        "max_tokens": args.max_tokens,
        "requests_per_slot": args.requests,
        "code": po.code_line(),
        "runs": runs,
        "workdir": str(workdir),
    }


def fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(result: dict[str, Any]) -> str:
    lines = [
        f"# {result['code']}",
        f"# target {result['target']} (vLLM {result['vllm_version']}, model "
        f"{result['model']}), chat streams of {result['max_tokens']} tokens, "
        f"{result['requests_per_slot']} requests per slot, closed loop",
        "",
    ]
    lines += [
        "Per concurrency C: mean / p50 / p99 in ms (vLLM: mean = histogram sum / count). "
        "ITL sample = event, except the engine vantage's: vLLM's per-request mean ITL "
        "(with --enable-per-request-metrics; engine TTFT and E2E run from queued in the "
        "engine).",
        "",
        "| C | seen by | TTFT | ITL | E2E |",
        "|---:|---|---|---|---|",
    ]

    def cells(entry: dict[str, Any] | None) -> list[str]:
        out = []
        for key in ("ttft", "itl", "e2e"):
            s = (entry or {}).get(key) or {}
            out.append(f"{fmt(s.get('mean'))} / {fmt(s.get('p50'))} / {fmt(s.get('p99'))}")
        return out

    for row in result["runs"]:
        c = row["concurrency"]
        direct, proxied = row["direct"], row["proxied"]
        lines.append(f"| {c} | OpenAI SDK, direct | " + " | ".join(cells(direct["sdk"])) + " |")
        lines.append(
            f"| {c} | vLLM histograms, direct run | "
            + " | ".join(fmt(direct["vllm"][k]["mean"]) for k in LATENCY)
            + " |"
        )
        lines.append(
            f"| {c} | OpenAI SDK, through the sidecar | " + " | ".join(cells(proxied["sdk"])) + " |"
        )
        for vantage in ("client", "server", "engine"):
            lines.append(
                f"| {c} | sidecar, {vantage} vantage | "
                + " | ".join(cells(proxied["sidecar"].get(vantage)))
                + " |"
            )
        lines.append(
            f"| {c} | vLLM histograms, proxied run | "
            + " | ".join(fmt(proxied["vllm"][k]["mean"]) for k in LATENCY)
            + " |"
        )
    lines += [
        "",
        "| C | output tok/s direct | through the sidecar | cost | sidecar prompt / "
        "generation tokens | vLLM's counters |",
        "|---:|---:|---:|---:|---|---|",
    ]
    for row in result["runs"]:
        d, p = row["direct"], row["proxied"]
        lines.append(
            f"| {row['concurrency']} | {d['output_tokens_per_s']:.0f} | "
            f"{p['output_tokens_per_s']:.0f} | {fmt((row['throughput_cost'] or 0) * 100, 1)} % | "
            f"{p['sidecar_tokens']['prompt']:.0f} / {p['sidecar_tokens']['generation']:.0f} | "
            f"{p['vllm']['prompt_tokens']:.0f} / {p['vllm']['generation_tokens']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="base URL of a running vLLM")
    parser.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8, 32],
        help="comma-separated [1,8,32]",
    )
    parser.add_argument("--requests", type=int, default=6, help="requests per slot [6]")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per stream [64]")
    parser.add_argument("--json-out", help="write the raw result here")
    parser.add_argument("--smoke", action="store_true", help="C=1,2, 2 requests, 8 tokens")
    args = parser.parse_args(argv)
    if args.smoke:
        args.concurrency, args.requests, args.max_tokens = [1, 2], 2, 8
    result = asyncio.run(measure(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
