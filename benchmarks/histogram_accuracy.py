"""How far `histogram_quantile` lands from the exact percentiles, per bucket layout, and what
each layout costs in series (issue #15 item 3).

    python benchmarks/histogram_accuracy.py --json-out benchmarks/results/histogram_accuracy.json
    python benchmarks/histogram_accuracy.py --no-sim        # synthetic workloads only, ~1 min
    python benchmarks/histogram_accuracy.py --smoke         # CI: small, a few seconds

What is compared. For each workload and latency metric (TTFT, ITL, TPOT, E2E), the exact
percentile (numpy's linear interpolation, as `sidecar.stats` and the window gauges compute it)
against the estimate Prometheus's `histogram_quantile(q, ...)` returns from the bucket counts
of each candidate layout, at q = 0.5, 0.9, 0.99. The estimate is computed here the way
Prometheus 2.42 does it for classic buckets (promql/quantile.go `bucketQuantile`: the bucket
holding rank q * n, linear interpolation inside it, the lowest bucket starting at 0, a rank in
+Inf answering the highest finite bound); tests/test_sinks_prometheus.py checks the estimate
against a real Prometheus. Where a quantile falls relative to the bounds decides the error, so
every workload is evaluated at ``--shifts`` scales 10**(j / shifts), j = 0 .. shifts - 1
(the same latencies on faster or slower hardware: every position within a decade, hence
within every bucket of a layout that repeats per decade or per doubling); the tables give the
largest |error| over the scales, and its mean.

Workloads (``--requests`` requests each, default 5,000: a 5-minute rate window at ~17
requests/s):

- chat: prompt and output lengths bootstrapped from the first 100 rows of the Mooncake
  conversation trace (tests/data/traces, median 10.4k prompt / 381 output tokens; each drawn
  length times a lognormal factor, sigma 0.2: a smoothed bootstrap); a vLLM-like
  GPU: 10k prefill tokens/s, decode step 12 ms with a per-request level (lognormal, sigma 0.15:
  the batch size it met) and per-step jitter (gamma, CV 0.1), 3 % of steps stalled by another
  request's prefill chunk (+2..10 steps); queueing: 40 % of requests wait, exponential, mean
  200 ms;
- code: the same engine, lengths from the first 200 rows of the Azure LLM inference trace 2023
  (code): long prompts, short outputs (median 1.6k / 13 tokens);
- fixed: a `vllm bench serve --random-input-len 1024 --random-output-len 256 --ignore-eos`
  run at steady load: every request alike, step level sigma 0.03, no queue, 1 % stalls: the
  tight distributions where one bucket holds most of the mass;
- mixed: 70 % code-like, 30 % long generations (Mooncake outputs x 2): bimodal E2E;
- sim (unless ``--no-sim``): the simulator (`sidecar sim`'s engine model: continuous batching,
  chunked prefill, roofline step time, 8 ms step floor) behind the real proxy, in this process,
  ``--sim-requests`` Poisson arrivals at ``--sim-rate``/s, lengths bootstrapped from both
  traces (prompts / 4); the records' client and server vantages, from `sidecar.stats`.

Layouts, 100 µs .. 1000 s: E6 (`--histogram-buckets e6`, the layout before this benchmark),
E12, E24 (IEC 60063 series, each containing the one before), E48 (3 digits; not nested), and
the log-linear bounds of native histograms, 2**(2**-schema) apart, for schemas 2, 3, 4
(`--histogram-buckets schema3`, `schema4`: as the sink builds them, 4 significant digits);
linear interpolation inside a bucket as Prometheus 2.42 does for classic and native buckets
alike, schema 3 also with the exponential interpolation later versions use for native
histograms. "rank q*n" is no histogram: the sample at Prometheus's rank itself, i.e. the error
no layout can remove (numpy interpolates at rank q * (n - 1)).

Series: a classic histogram costs its finite bounds + 3 series (+Inf, _sum, _count) per label
set; the sidecar has 4 latency histograms per (model, replica, vantage) for client and server
(3 for engine: no ITL) and the engine queue time per (model, replica): 12 per (model, replica),
plus the request read time per model. A native histogram is 1 series per label set whatever
its buckets (the populated buckets ride inside each sample).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
import math
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRACES = ROOT / "tests" / "data" / "traces"
QUANTILES = (0.5, 0.9, 0.99)
METRICS = ("ttft", "itl", "tpot", "e2e")
LOW, HIGH = 1e-4, 1e3
HISTOGRAMS_PER_MODEL_REPLICA = 4 + 4 + 3 + 1  # client, server, engine, engine queue
Floats = npt.NDArray[np.float64]

E_SERIES = {
    "e6": (1.0, 1.5, 2.2, 3.3, 4.7, 6.8),
    "e12": (1.0, 1.2, 1.5, 1.8, 2.2, 2.7, 3.3, 3.9, 4.7, 5.6, 6.8, 8.2),
    "e24": (
        1.0,
        1.1,
        1.2,
        1.3,
        1.5,
        1.6,
        1.8,
        2.0,
        2.2,
        2.4,
        2.7,
        3.0,
        3.3,
        3.6,
        3.9,
        4.3,
        4.7,
        5.1,
        5.6,
        6.2,
        6.8,
        7.5,
        8.2,
        9.1,
    ),
    "e48": (
        1.00,
        1.05,
        1.10,
        1.15,
        1.21,
        1.27,
        1.33,
        1.40,
        1.47,
        1.54,
        1.62,
        1.69,
        1.78,
        1.87,
        1.96,
        2.05,
        2.15,
        2.26,
        2.37,
        2.49,
        2.61,
        2.74,
        2.87,
        3.01,
        3.16,
        3.32,
        3.48,
        3.65,
        3.83,
        4.02,
        4.22,
        4.42,
        4.64,
        4.87,
        5.11,
        5.36,
        5.62,
        5.90,
        6.19,
        6.49,
        6.81,
        7.15,
        7.50,
        7.87,
        8.25,
        8.66,
        9.09,
        9.53,
    ),
}


@dataclass(frozen=True)
class Layout:
    name: str
    bounds: Floats  # finite upper bounds, ascending
    exponential: bool = False  # interpolate in log space inside a bucket
    native: bool = False  # the bounds of a native histogram schema
    exact: bool = False  # no buckets: the sample at Prometheus's rank

    @property
    def series_per_histogram(self) -> int:
        return len(self.bounds) + 3

    @property
    def max_ratio(self) -> float:
        return float(np.max(self.bounds[1:] / self.bounds[:-1])) if len(self.bounds) > 1 else 0


def e_bounds(series: tuple[float, ...]) -> Floats:
    low, high = round(math.log10(LOW)), round(math.log10(HIGH))
    values = [round(m * 10.0**e, 10) for e in range(low, high) for m in series] + [HIGH]
    return np.array(values)


def layouts() -> list[Layout]:
    """E6 .. E48, then the log-linear layouts of native histogram schemas 2 .. 4: e6, schema3
    and schema4 exactly as the sink builds them (`--histogram-buckets`)."""
    from sidecar.sinks.prometheus import latency_buckets, log_linear_buckets

    found = [Layout("E6 (e6)", np.array(latency_buckets(layout="e6")))]
    found += [Layout(name.upper(), e_bounds(E_SERIES[name])) for name in ("e12", "e24", "e48")]
    found.append(Layout("schema2", np.array(log_linear_buckets(2)), native=True))
    for schema in (3, 4):
        bounds = np.array(latency_buckets(layout=f"schema{schema}"))
        found.append(Layout(f"schema{schema}", bounds, native=True))
    found.append(
        Layout(
            "schema3, exp. interp.",
            np.array(latency_buckets(layout="schema3")),
            exponential=True,
            native=True,
        )
    )
    found.append(Layout("rank q*n", np.empty(0), exact=True))
    return found


# --- Prometheus's histogram_quantile ---------------------------------------------------------


def histogram_quantile(
    q: float, bounds: Floats, cumulative: Floats, exponential: bool = False
) -> float:
    """Prometheus 2.42's bucketQuantile: ``cumulative[i]`` counts the samples <= ``bounds[i]``
    and ``cumulative[-1]`` (one longer than ``bounds``) is the +Inf bucket, the total."""
    total = float(cumulative[-1])
    if total == 0:
        return math.nan
    rank = q * total
    # The first bucket whose cumulative count reaches the rank (sort.Search over all but +Inf).
    b = int(np.searchsorted(cumulative[:-1], rank, side="left"))
    if b == len(bounds):
        return float(bounds[-1])
    end = float(bounds[b])
    start = float(bounds[b - 1]) if b > 0 else 0.0
    below = float(cumulative[b - 1]) if b > 0 else 0.0
    count = float(cumulative[b]) - below
    fraction = (rank - below) / count
    if exponential and start > 0:
        growth: float = (end / start) ** fraction
        return start * growth
    return start + (end - start) * fraction


def estimate(layout: Layout, ordered: Floats, scale: float, q: float) -> float:
    """The estimate for samples ``ordered * scale`` (``ordered`` sorted ascending)."""
    if layout.exact:
        index = max(0, math.ceil(q * len(ordered)) - 1)
        return float(ordered[index]) * scale
    # Samples x with x * scale <= bound, for every bound (le: upper bound inclusive).
    cumulative = np.searchsorted(ordered, layout.bounds / scale, side="right").astype(float)
    cumulative = np.append(cumulative, float(len(ordered)))
    return histogram_quantile(q, layout.bounds, cumulative, layout.exponential)


def errors(
    samples: dict[str, Floats], shifts: int, all_layouts: list[Layout]
) -> dict[str, dict[str, dict[str, Any]]]:
    """layout -> "metric/q" -> {max_abs, mean_abs, worst (signed), exact_p at scale 1}."""
    scales = [10.0 ** (j / shifts) for j in range(shifts)]
    out: dict[str, dict[str, dict[str, Any]]] = {layout.name: {} for layout in all_layouts}
    for metric, values in samples.items():
        ordered = np.sort(values)
        for q in QUANTILES:
            exact = float(np.percentile(ordered, q * 100))
            for layout in all_layouts:
                relative = [
                    estimate(layout, ordered, scale, q) / (exact * scale) - 1 for scale in scales
                ]
                worst = max(relative, key=abs)
                out[layout.name][f"{metric}/p{q * 100:g}"] = {
                    "max_abs": abs(worst),
                    "worst": worst,
                    "mean_abs": float(np.mean(np.abs(relative))),
                    "exact": exact,
                    "n": len(ordered),
                }
    return out


# --- synthetic workloads ---------------------------------------------------------------------


def trace_lengths() -> dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
    rows = [
        json.loads(line)
        for line in (TRACES / "mooncake_conversation_first100.jsonl").read_text().splitlines()
        if line
    ]
    mooncake = (
        np.array([r["input_length"] for r in rows]),
        np.array([r["output_length"] for r in rows]),
    )
    with open(TRACES / "azure_code_2023_first200.csv", newline="") as handle:
        code_rows = list(csv.DictReader(handle))
    azure = (
        np.array([int(r["ContextTokens"]) for r in code_rows]),
        np.array([int(r["GeneratedTokens"]) for r in code_rows]),
    )
    return {"mooncake": mooncake, "azure_code": azure}


@dataclass(frozen=True)
class Engine:
    prefill_tok_s: float = 10_000.0
    step_s: float = 0.012
    level_sigma: float = 0.15  # per request: the batch it met
    jitter_cv: float = 0.10  # per step
    stall_p: float = 0.03
    stall_steps: tuple[float, float] = (2.0, 10.0)
    queue_p: float = 0.4
    queue_mean_s: float = 0.2


def simulate(
    rng: np.random.Generator,
    n_in: npt.NDArray[np.int64],
    n_out: npt.NDArray[np.int64],
    engine: Engine,
) -> dict[str, Floats]:
    """Per-request TTFT, TPOT, E2E and every ITL gap of a vLLM-like engine (one token per
    streamed event)."""
    n = len(n_in)
    n_out = np.maximum(n_out, 1)
    level = engine.step_s * rng.lognormal(0.0, engine.level_sigma, n)
    queued = rng.random(n) < engine.queue_p
    queue = np.where(queued, rng.exponential(engine.queue_mean_s, n), 0.0)
    ttft = queue + n_in / engine.prefill_tok_s + level * rng.gamma(100.0, 0.01, n)
    gaps_per_request = n_out - 1
    owner = np.repeat(np.arange(n), gaps_per_request)
    shape = 1.0 / engine.jitter_cv**2
    gaps = level[owner] * rng.gamma(shape, 1.0 / shape, len(owner))
    stalled = rng.random(len(owner)) < engine.stall_p
    gaps[stalled] += level[owner][stalled] * rng.uniform(*engine.stall_steps, int(stalled.sum()))
    decode = np.bincount(owner, weights=gaps, minlength=n)
    e2e = ttft + decode
    has_tpot = n_out > 1
    tpot = decode[has_tpot] / (n_out[has_tpot] - 1)
    return {"ttft": ttft, "itl": gaps, "tpot": tpot, "e2e": e2e}


def synthetic_workloads(requests: int, seed: int) -> dict[str, dict[str, Floats]]:
    rng = np.random.default_rng(seed)
    lengths = trace_lengths()

    def draw(name: str, n: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        # A smoothed bootstrap: 100 or 200 rows are few, real lengths are not 100 values.
        n_in, n_out = lengths[name]
        index = rng.integers(0, len(n_in), n)
        jitter = rng.lognormal(0.0, 0.2, (2, n))
        return (
            np.maximum(1, n_in[index] * jitter[0]).astype(np.int64),
            np.maximum(1, n_out[index] * jitter[1]).astype(np.int64),
        )

    gpu = Engine()
    out = {
        "chat": simulate(rng, *draw("mooncake", requests), gpu),
        "code": simulate(rng, *draw("azure_code", requests), gpu),
    }
    fixed = Engine(level_sigma=0.03, stall_p=0.01, queue_p=0.0)
    out["fixed"] = simulate(rng, np.full(requests, 1024), np.full(requests, 256), fixed)
    short = int(requests * 0.7)
    code_in, code_out = draw("azure_code", short)
    long_in, long_out = draw("mooncake", requests - short)
    out["mixed"] = simulate(
        rng, np.concatenate([code_in, long_in // 4]), np.concatenate([code_out, long_out * 2]), gpu
    )
    return out


# --- the simulator behind the real proxy -----------------------------------------------------


async def sim_workload(
    requests: int, rate: float, seed: int, step_s: float | None = None
) -> dict[str, Floats]:
    """``step_s``: the simulated engine's step (None: the simulator's default; --smoke runs a
    faster engine so that the trace's longest outputs finish in about a second)."""
    import aiohttp

    from sidecar import stats
    from sidecar.config import build_config
    from sidecar.record import Outcome, RequestRecord, Vantage
    from sidecar.serve import build_proxy_server
    from sidecar.sim.server import SimConfig, close_replicas, start_replicas

    class Keep:
        name = "keep"

        def __init__(self) -> None:
            self.records: list[RequestRecord] = []

        def on_record(self, record: RequestRecord) -> None:
            self.records.append(record)

    rng = random.Random(seed)
    lengths = trace_lengths()
    config = SimConfig(model="m")
    if step_s is not None:
        config = dataclasses.replace(
            config, engine=dataclasses.replace(config.engine, step_floor_s=step_s)
        )
    replicas = await start_replicas(config, 1)
    flags = {
        "upstreams": [replicas[0].url],
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "health_interval": "0",
    }
    server, _window = build_proxy_server(build_config(flags, {}))
    keep = Keep()
    server.proxy.fanout.add(keep)
    await server.start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

            async def one(n_in: int, n_out: int) -> None:
                body = {
                    "model": "m",
                    "stream": True,
                    "max_tokens": n_out,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": "w " * n_in}],
                }
                async with session.post(server.url + "/v1/chat/completions", json=body) as response:
                    await response.read()

            tasks = []
            for i in range(requests):
                name = "mooncake" if i % 2 else "azure_code"
                n_in_all, n_out_all = lengths[name]
                index = rng.randrange(len(n_in_all))
                n_in = int(n_in_all[index]) // (4 if name == "mooncake" else 1)
                tasks.append(asyncio.create_task(one(max(1, n_in), int(n_out_all[index]))))
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
        for _ in range(100):
            if len(keep.records) >= requests:
                break
            await asyncio.sleep(0.05)
    finally:
        await server.close()
        await close_replicas(replicas)
    samples: dict[str, list[float]] = {}
    for record in keep.records:
        if record.outcome is not Outcome.OK:
            continue
        for vantage in (Vantage.CLIENT, Vantage.SERVER):
            m = stats.request_metrics(record, vantage)
            if m is None:
                continue
            for metric in METRICS:
                if metric == "itl":
                    samples.setdefault(f"itl {vantage.value}", []).extend(m.itl_s)
                else:
                    value = getattr(m, f"{metric}_s")
                    if value is not None:
                        samples.setdefault(f"{metric} {vantage.value}", []).append(value)
    return {name: np.array(values) for name, values in samples.items()}


# --- what a scrape costs --------------------------------------------------------------------


def scrape_cost(layout: str, repeats: int) -> dict[str, float]:
    """Series, bytes and `generate_latest` time of the latency histograms for one (model,
    replica) pair with every vantage (and the request read time of its model), as the sink
    exposes them with ``layout``."""
    from prometheus_client import CollectorRegistry, generate_latest

    from sidecar.record import (
        ChunkMark,
        EngineTiming,
        Outcome,
        RequestRecord,
        Timeline,
        TokenSource,
    )
    from sidecar.sinks.prometheus import PrometheusSink

    ms = 1_000_000
    marks = tuple(ChunkMark(t * ms, 1) for t in (120, 150, 190, 230))
    record = RequestRecord(
        request_id="r",
        wall_time_ns=0,
        outcome=Outcome.OK,
        endpoint="chat",
        model="m",
        client=Timeline.from_marks(0, marks, 230 * ms, 4),
        server=Timeline.from_marks(ms, marks, 230 * ms, 4),
        n_in=10,
        n_out=4,
        token_source=TokenSource.USAGE,
        replica="vllm-0:8000",
        request_read_ns=ms,
        engine=EngineTiming(
            time_to_first_token_ms=90.0,
            generation_time_ms=100.0,
            queue_time_ms=20.0,
            mean_itl_ms=33.0,
        ),
    )
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, histogram_buckets=layout)
    sink.on_record(record)
    latency = [sink.ttft, sink.itl, sink.tpot, sink.e2e, sink.engine_queue, sink.request_read]
    only = CollectorRegistry()
    for histogram in latency:
        only.register(histogram)
    text = generate_latest(only)
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        generate_latest(only)
        timings.append(time.perf_counter() - started)
    series = sum(1 for line in text.decode().splitlines() if line and line[0] != "#")
    return {"series": series, "bytes": len(text), "ms": 1000 * float(np.median(timings))}


# --- report ----------------------------------------------------------------------------------


def summarise(
    results: dict[str, dict[str, dict[str, dict[str, Any]]]], all_layouts: list[Layout]
) -> list[dict[str, Any]]:
    rows = []
    for layout in all_layouts:
        worst: tuple[float, str] = (0.0, "")
        by_q = {q: 0.0 for q in QUANTILES}
        mean_all = []
        for workload, per_layout in results.items():
            for key, cell in per_layout[layout.name].items():
                q = float(key.rsplit("/p", 1)[1]) / 100
                by_q[q] = max(by_q[q], cell["max_abs"])
                mean_all.append(cell["mean_abs"])
                if cell["max_abs"] > worst[0]:
                    worst = (cell["max_abs"], f"{workload} {key} ({cell['worst']:+.1%})")
        per_set = 4 * layout.series_per_histogram
        rows.append(
            {
                "layout": layout.name,
                "bounds": len(layout.bounds),
                "max_ratio": layout.max_ratio,
                "series_per_histogram": layout.series_per_histogram,
                "series_per_model_replica_vantage": per_set,
                "series_per_model_replica": HISTOGRAMS_PER_MODEL_REPLICA
                * layout.series_per_histogram,
                "max_abs_p50": by_q[0.5],
                "max_abs_p90": by_q[0.9],
                "max_abs_p99": by_q[0.99],
                "mean_abs": float(np.mean(mean_all)),
                "worst": worst[1],
            }
        )
    return rows


def markdown(
    rows: list[dict[str, Any]], results: dict[str, Any], scrapes: dict[str, Any], header: str
) -> str:
    lines = [
        header,
        "",
        "| layout | bounds | max ratio | classic series / histogram | per (model, "
        "replica, vantage) | per (model, replica) | max err p50 | max err p90 | "
        "max err p99 | mean err | worst case |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        exact = r["layout"] == "rank q*n"
        dash = "-"
        lines.append(
            f"| {r['layout']} | {dash if exact else r['bounds']} | "
            f"{dash if exact else format(r['max_ratio'], '.3f')} | "
            f"{dash if exact else r['series_per_histogram']} | "
            f"{dash if exact else r['series_per_model_replica_vantage']} | "
            f"{dash if exact else r['series_per_model_replica']} | "
            f"{r['max_abs_p50']:.1%} | {r['max_abs_p90']:.1%} | {r['max_abs_p99']:.1%} | "
            f"{r['mean_abs']:.2%} | {r['worst']} |"
        )
    lines += [
        "",
        "The schema rows as native histograms instead (Prometheus >= 2.40 with "
        "--enable-feature=native-histograms, protobuf scrapes only): 1 series per label "
        "set, same accuracy (2.42 interpolates linearly in native buckets too).",
        "",
    ]
    if scrapes:
        lines += [
            "The sink's latency histograms for one (model, replica) with every vantage, "
            "as `generate_latest` writes them (text format, uncompressed):",
            "",
            "| --histogram-buckets | series | bytes | generate_latest ms |",
            "|---|---:|---:|---:|",
        ]
        for name, cost in scrapes.items():
            lines.append(f"| {name} | {cost['series']} | {cost['bytes']:,} | {cost['ms']:.2f} |")
        lines.append("")
    lines.append("Max |error| per workload and metric (all quantiles), per layout:")
    lines.append("")
    names = list(next(iter(results.values())))
    lines.append("| workload | metric | n | " + " | ".join(names) + " |")
    lines.append("|---|---|---:|" + "---:|" * len(names))
    for workload, per_layout in results.items():
        metrics = sorted(
            {key.rsplit("/p", 1)[0] for key in per_layout[names[0]]},
            key=lambda m: (METRICS.index(m.split()[0]), m),
        )
        for metric in metrics:
            cells = []
            n = 0
            for name in names:
                worst = 0.0
                for q in QUANTILES:
                    cell = per_layout[name][f"{metric}/p{q * 100:g}"]
                    worst = max(worst, cell["max_abs"])
                    n = cell["n"]
                cells.append(f"{worst:.1%}")
            lines.append(f"| {workload} | {metric} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def git_head() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=ROOT,
                text=True,
                capture_output=True,
                timeout=10,
            ).stdout.strip()
            or "?"
        )
    except OSError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--shifts", type=int, default=48)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-sim", action="store_true")
    parser.add_argument("--sim-requests", type=int, default=600)
    parser.add_argument("--sim-rate", type=float, default=12.0)
    parser.add_argument("--smoke", action="store_true", help="small and quick (CI)")
    parser.add_argument("--json-out")
    parser.add_argument("--md-out")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.shifts, args.sim_requests, args.sim_rate = 300, 6, 20, 40.0
    started = time.monotonic()
    all_layouts = layouts()
    workloads: dict[str, dict[str, Floats]] = synthetic_workloads(args.requests, args.seed)
    if not args.no_sim:
        step_s = 0.002 if args.smoke else None
        workloads["sim"] = asyncio.run(
            sim_workload(args.sim_requests, args.sim_rate, args.seed, step_s)
        )
    results = {
        name: errors(samples, args.shifts, all_layouts) for name, samples in workloads.items()
    }
    rows = summarise(results, all_layouts)
    header = (
        f"# benchmarks/histogram_accuracy.py: {args.requests} requests per synthetic "
        f"workload, {args.shifts} scales per decade"
        + ("" if args.no_sim else f", sim {args.sim_requests} requests at {args.sim_rate:g}/s")
        + f"; Python {platform.python_version()}, numpy {np.__version__}, "
        f"checkout HEAD {git_head()}; {time.monotonic() - started:.0f} s"
    )
    scrapes = {
        name: scrape_cost(name, 3 if args.smoke else 30) for name in ("e6", "schema3", "schema4")
    }
    text = markdown(rows, results, scrapes, header)
    print(text)
    if args.md_out:
        Path(args.md_out).write_text(text)
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "summary": rows,
                    "results": results,
                    "scrapes": scrapes,
                    "layouts": {
                        layout.name: layout.bounds.tolist()
                        for layout in all_layouts
                        if not layout.exact
                    },
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
