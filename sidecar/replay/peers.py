"""The same requests under other tools' definitions (spec/peer-tools.md), named by formula.

Tools give one name to different quantities ("ITL" is a pooled per-chunk gap in vLLM, a
per-request mean in AIPerf and GuideLLM; "TPOT" includes TTFT in GuideLLM). To answer "what
would tool X have said?", each metric here is computed from our client-side records with that
tool's formula, and keyed ``tool.name`` with the formula beside it. A peer metric that is one of
ours (`SAME_AS_OURS`) takes our value and our definition (docs/metrics.md section 4); the
others are stated only by where they differ from ours (`DIFFERENCES`).

Where a tool re-tokenises text on the client, we use the server's usage counts instead (stated
in `NOTES`); per-token timestamps are derived from per-chunk stamps and token counts exactly as
those tools do (every token of a chunk gets the chunk's instant).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from sidecar import stats
from sidecar.record import RequestRecord, Vantage
from sidecar.replay.runner import SentRequest

NS = 1e9

# Peer metrics that are one of ours under the tool's name: their values are ours
# (`stats.request_samples`), and their definition is ours (docs/metrics.md section 4).
SAME_AS_OURS = {
    "vllm.ttft": "ttft",
    "aiperf.ttft": "ttft",
    "guidellm.ttft": "ttft",
    "vllm.itl": "itl",
    "aiperf.icl": "itl",
    "vllm.tpot": "tpot",
    "guidellm.itl": "tpot",
    "vllm.e2el": "e2e",
    "aiperf.request_latency": "e2e",
}
# The others: each stated by where it differs from ours (N: the output tokens; per-token
# instants: every token of a chunk at the chunk's instant, as those tools do).
DIFFERENCES = {
    "inference_perf.ttft": "our TTFT, but only for requests with >= 2 tokens",
    "inference_perf.tpot": "our TPOT over per-token instants: N counted per chunk, not usage",
    "inference_perf.itl": "our ITL between tokens, not chunks: the tokens of one chunk share "
    "its instant, so zeros",
    "inference_perf.ntpot": "(end - send) / N: our E2E to the stream's end, over N, TTFT included",
    "aiperf.ttst": "second token chunk - first",
    "aiperf.itl": "(E2E - TTFT) / (N - the first chunk's tokens), per request",
    "guidellm.tpot": "our E2E / N, per request (includes TTFT)",
    "guidellm.request_latency": "end - send: to the stream's end, not the last token chunk",
}
FORMULAS = {
    **{
        name: f"= our {ours.upper()} (docs/metrics.md section 4)"
        for name, ours in SAME_AS_OURS.items()
    },
    **DIFFERENCES,
}

NOTES = (
    "Token counts are the server's usage (inference-perf and AIPerf would re-tokenise the "
    "text on the client). Timestamps are ours (perf_counter_ns per read); GuideLLM uses "
    "the wall clock. Failed requests are excluded, as all four tools do by default."
)


def _per_token_instants(record: RequestRecord) -> list[int]:
    out: list[int] = []
    for offset, n_tokens in zip(record.client.offsets_ns, record.client.tokens, strict=True):
        out.extend([offset] * max(n_tokens, 0))
    return out


def peer_values(records: Iterable[RequestRecord]) -> dict[str, list[float]]:
    """Each peer metric's samples (seconds) over the successful requests."""
    kept = [record for record in records if record.ok]
    samples = stats.request_samples(kept, Vantage.CLIENT)
    ours = {
        "ttft": samples.defined("ttft").tolist(),
        "tpot": samples.defined("tpot").tolist(),
        "itl": samples.itl_s.tolist(),
        "e2e": samples.defined("e2e").tolist(),
    }
    values: dict[str, list[float]] = {
        name: list(ours[metric]) for name, metric in SAME_AS_OURS.items()
    }
    values.update({name: [] for name in DIFFERENCES})

    def add(name: str, value: float | None) -> None:
        if value is not None:
            values[name].append(value)

    for record in kept:
        offsets = record.client.offsets_ns
        n_out = stats.output_tokens(record, record.client)
        end = record.client.end_ns
        if end is not None:
            add("guidellm.request_latency", end / NS)
        if not offsets:
            continue
        first, last = offsets[0], offsets[-1]
        if end is not None and n_out > 0:
            add("inference_perf.ntpot", end / n_out / NS)
        if len(offsets) > 1:
            add("aiperf.ttst", (offsets[1] - first) / NS)
        denominator = n_out - record.client.tokens[0]
        if denominator > 0:
            add("aiperf.itl", (last - first) / denominator / NS)
        if n_out > 0:
            add("guidellm.tpot", last / n_out / NS)
        tokens = _per_token_instants(record)
        if len(tokens) >= 2:
            add("inference_perf.ttft", tokens[0] / NS)
            add("inference_perf.tpot", (tokens[-1] - tokens[0]) / (len(tokens) - 1) / NS)
            values["inference_perf.itl"].extend(
                (b - a) / NS for a, b in zip(tokens, tokens[1:], strict=False)
            )
    return values


def peer_report(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Every peer metric's summary in milliseconds, with its formula."""
    out: dict[str, Any] = {"notes": NOTES, "metrics": {}}
    for name, samples in peer_values(records).items():
        summary = stats.summarize([s * 1000 for s in samples])
        out["metrics"][name] = {"formula": FORMULAS[name], "unit": "ms", **summary.to_dict()}
    return out


# -- `vllm bench serve --save-result --save-detailed` ----------------------------------------
#
# Read from vLLM 0.32.0's vllm/benchmarks/serve.py (the wheel `sidecar vllm up` installs):
# `main_async` writes the setup keys, then `benchmark()`'s result dict; `calculate_metrics`
# defines each value. vllm bench's backend names for the two APIs replay sends to
# (lib/endpoint_request_func.py, ASYNC_REQUEST_FUNCS):
VLLM_BENCH_BACKENDS = {"completions": "openai", "chat": "openai-chat"}

VLLM_BENCH_NOTE = (
    "written by `sidecar replay --export-vllm-bench`: vllm bench serve's keys (as with "
    "--save-result --save-detailed --percentile-metrics ttft,tpot,itl,e2el "
    "--metric-percentiles 50,90,95,99,99.9), each with vllm bench's meaning, measured by the "
    "sidecar's replayer as a client; token counts are the server's usage. Keys starting "
    "sidecar_ are the sidecar's own (vllm bench writes --metadata keys the same way)."
)


def vllm_bench_peaks(sent: Sequence[SentRequest]) -> tuple[float, int]:
    """vllm bench's ``max_output_tokens_per_s`` and ``max_concurrent_requests``
    (`calculate_metrics`): over successful requests only, time cut into one-second buckets from
    the earliest send; each token-carrying chunk counts one "token" in the bucket it arrived in
    (vllm bench rebuilds chunk instants as start + ttft + the itls), and a request counts as
    concurrent in every bucket from the one it was sent in to the one its last chunk arrived in,
    both included. Both are maxima over buckets; the concurrency one is at least the exact
    instantaneous maximum of those requests and usually more."""
    ok = [s for s in sent if s.record.ok]
    if not ok:
        return 0.0, 0
    origin = min(s.actual_ns for s in ok)
    spans: list[tuple[float, float]] = []
    token_times: list[float] = []
    for s in ok:
        start = (s.actual_ns - origin) / 1e9
        metrics = stats.request_metrics(s.record, Vantage.CLIENT)
        latency = (metrics.e2e_s or 0.0) if metrics is not None else 0.0
        spans.append((start, start + latency))
        timeline = s.record.client
        chunks = [(offset - timeline.start_ns) / 1e9 for offset in timeline.offsets_ns]
        token_times.extend(start + c for c in (chunks or [0.0]))
    buckets = int(math.ceil(max(end for _start, end in spans))) + 1
    tokens = np.zeros(buckets)
    concurrent = np.zeros(buckets)
    for at in token_times:
        second = int(at)
        if 0 <= second < buckets:
            tokens[second] += 1
    for start, end in spans:
        concurrent[int(start) : int(end) + 1] += 1
    return float(tokens.max()), int(concurrent.max())


def offered_arrivals(
    envelope: Mapping[str, Any], sent: Sequence[SentRequest]
) -> tuple[float | str, float, str]:
    """vllm bench's ``request_rate`` (a float, or "inf" when every request is released at
    once) and ``burstiness`` (the Gamma shape of the gaps between arrivals) for this run, and
    how they were obtained."""
    if envelope.get("mode") == "closed":
        return (
            "inf",
            1.0,
            (
                "closed loop: every request released at the start, at most "
                "max_concurrency outstanding (vllm bench's --request-rate inf "
                "--max-concurrency N; its burstiness then has no effect)"
            ),
        )
    rate = envelope.get("rate")
    if isinstance(rate, (int, float)):
        burstiness = envelope.get("burstiness")
        return (
            float(rate),
            float(burstiness if burstiness is not None else 1.0),
            "--rate and --burstiness: a Gamma arrival process, as vllm bench's",
        )
    times = np.sort(np.array([s.scheduled_ns for s in sent], dtype=np.float64)) / 1e9
    gaps = np.diff(times)
    span = float(times[-1] - times[0]) if len(times) else 0.0
    how = (
        "the trace's own arrival times (scaled by --time-scale): request_rate is their mean "
        "rate, (n - 1) / span; burstiness the moment estimate of the Gamma shape of their "
        "gaps, mean^2 / variance (1 for Poisson arrivals)"
    )
    if span <= 0:
        return "inf", 1.0, how + "; here every request is scheduled at one instant"
    variance = float(np.var(gaps))
    burstiness = float(np.mean(gaps)) ** 2 / variance if variance > 0 else math.inf
    return len(gaps) / span, burstiness, how


# The server counters vllm bench reads from /metrics before and after a run
# (`fetch_spec_decode_metrics`, `fetch_diffusion_metrics`): every `_total` sample of a family,
# summed over its labels (per position for the accepted tokens per draft position).
SPEC_DECODE_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
DIFFUSION_COUNTERS = ("num_denoising_steps", "num_canvas_positions", "num_committed_tokens")


def vllm_bench_counters(text: str) -> dict[str, Any]:
    """The speculative-decoding and diffusion counters in a /metrics exposition, as vllm bench
    reads them: ``{"spec_decode": {...} | None, "diffusion": {...} | None}`` (None: the family
    is absent, e.g. no speculative decoding)."""
    spec: dict[str, Any] | None = None
    diffusion: dict[str, int] | None = None
    for raw in text.split("\n"):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        name = parts[0].split("{")[0]
        if not name.endswith("_total"):
            continue
        try:
            value = int(float(parts[-1].split()[0]))
        except ValueError:
            continue
        if line.startswith("vllm:spec_decode"):
            if spec is None:
                spec = {**dict.fromkeys(SPEC_DECODE_COUNTERS, 0), "accepted_per_pos": {}}
            if "num_drafts" in name:
                spec["num_drafts"] += value
            elif "num_draft_tokens" in name:
                spec["num_draft_tokens"] += value
            elif "num_accepted_tokens_per_pos" in name:
                label = 'position="'
                if label in line:
                    begin = line.index(label) + len(label)
                    try:
                        position = int(line[begin : line.index('"', begin)])
                    except ValueError:
                        continue
                    per_pos = spec["accepted_per_pos"]
                    per_pos[position] = per_pos.get(position, 0) + value
            elif "num_accepted_tokens" in name:
                spec["num_accepted_tokens"] += value
        elif line.startswith("vllm:diffusion"):
            if diffusion is None:
                diffusion = dict.fromkeys(DIFFUSION_COUNTERS, 0)
            for counter in DIFFUSION_COUNTERS:
                if counter in name:
                    diffusion[counter] += value
                    break
    return {"spec_decode": spec, "diffusion": diffusion}


def vllm_bench_server_keys(
    before: Mapping[str, Any] | None, after: Mapping[str, Any] | None, duration_s: float
) -> dict[str, Any]:
    """vllm bench's ``spec_decode_*`` and ``diffusion_*`` keys from the counters before and
    after a run (`vllm_bench_counters`), as its `benchmark()` computes them; empty when the
    server has neither (vllm bench then writes none of them)."""
    out: dict[str, Any] = {}
    spec_a = (before or {}).get("spec_decode")
    spec_b = (after or {}).get("spec_decode")
    if spec_a is not None and spec_b is not None:
        drafts = spec_b["num_drafts"] - spec_a["num_drafts"]
        draft_tokens = spec_b["num_draft_tokens"] - spec_a["num_draft_tokens"]
        accepted = spec_b["num_accepted_tokens"] - spec_a["num_accepted_tokens"]
        per_pos: list[float] = []
        if drafts > 0:
            pos_a, pos_b = spec_a["accepted_per_pos"], spec_b["accepted_per_pos"]
            for position in sorted(set(pos_a) | set(pos_b)):
                start = pos_a.get(position, 0)
                per_pos.append((pos_b.get(position, start) - start) / drafts)
        if draft_tokens > 0:
            out.update(
                {
                    "spec_decode_acceptance_rate": accepted / draft_tokens * 100,
                    "spec_decode_acceptance_length": 1 + accepted / drafts if drafts > 0 else 0.0,
                    "spec_decode_num_drafts": int(drafts),
                    "spec_decode_draft_tokens": int(draft_tokens),
                    "spec_decode_accepted_tokens": int(accepted),
                    "spec_decode_per_position_acceptance_rates": per_pos,
                }
            )
    diff_a = (before or {}).get("diffusion")
    diff_b = (after or {}).get("diffusion")
    if diff_a is not None and diff_b is not None:
        steps = diff_b["num_denoising_steps"] - diff_a["num_denoising_steps"]
        positions = diff_b["num_canvas_positions"] - diff_a["num_canvas_positions"]
        committed = diff_b["num_committed_tokens"] - diff_a["num_committed_tokens"]
        if steps > 0 and committed > 0 and duration_s > 0:
            canvases = committed / (positions / steps)
            denoising = steps - canvases
            out.update(
                {
                    "diffusion_committed_throughput": committed / duration_s,
                    "diffusion_steps_per_canvas": denoising / canvases,
                    "diffusion_committed_per_step": committed / denoising,
                    "diffusion_committed_tokens": int(committed),
                    "diffusion_denoising_steps": int(denoising),
                    "diffusion_canvas_positions": int(positions),
                }
            )
    return out


def _percentile_stats(report: Mapping[str, Any]) -> dict[str, float]:
    """mean_/median_/std_/pN_<metric>_ms, a float each: vllm bench writes 0.0 for an empty
    sample (`np.mean(values or 0)`) where the report has null."""
    out: dict[str, float] = {}
    for key, value in report.items():
        head = key.split("_")[0]
        if key.endswith("_ms") and (
            head in ("mean", "median", "std")
            or (head.startswith("p") and head[1:].replace(".", "", 1).isdigit())
        ):
            out[key] = float(value) if isinstance(value, (int, float)) else 0.0
    return out


def vllm_bench_json(
    report: Mapping[str, Any],
    sent: Sequence[SentRequest],
    *,
    requested_input: Mapping[int, int | None] | None = None,
    server: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None] = (None, None),
    now: datetime | None = None,
) -> dict[str, Any]:
    """The run as `vllm bench serve --save-result --save-detailed` writes it: every key its
    generation benchmark writes by default, in its order and with its types and meaning.

    ``report`` is the run's report with its envelope; ``sent`` the run's requests (in plan
    order); ``requested_input`` the planned prompt length of each request index (vllm bench's
    ``input_lens`` keeps the dataset's length for a request the server never counted);
    ``server`` the target's `vllm_bench_counters` before and after the run.
    """
    envelope: Mapping[str, Any] = report.get("envelope") or {}
    records = [s.record for s in sent]
    endpoints = Counter(r.endpoint for r in records)
    if len(endpoints) == 1:
        (endpoint,) = endpoints
        backend = VLLM_BENCH_BACKENDS.get(endpoint, str(endpoint))
    else:
        backend = "mixed"  # vllm bench sends one API per run; a trace may hold both
    request_rate, burstiness, arrivals = offered_arrivals(envelope, sent)
    out: dict[str, Any] = {
        "date": (now or datetime.now()).strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": None,  # vllm bench's --label, unset
        "model_id": envelope.get("model"),
        "tokenizer_id": None,  # no client tokenizer: as vllm bench --skip-tokenizer-init
        "num_prompts": len(sent),
        "request_rate": request_rate,
        "burstiness": burstiness,
        "max_concurrency": envelope.get("max_concurrency"),
    }
    closed = envelope.get("mode") == "closed"
    out.update(_vllm_bench_results(report, sent, closed, requested_input or {}))
    out.update(vllm_bench_server_keys(*server, float(report.get("duration") or 0.0)))
    out.update(_percentile_stats(report))
    out.update(_sidecar_keys(report, arrivals, endpoints, closed))
    return out


def _sidecar_keys(
    report: Mapping[str, Any], arrivals: str, endpoints: Counter[str], closed: bool
) -> dict[str, Any]:
    """The keys vllm bench does not write, ``sidecar_``-prefixed: what the run also knows,
    and what it could not measure."""
    not_measured = {"generated_texts": "the replayer keeps no response text: every entry is empty"}
    if not closed:
        not_measured["queue_times"] = (
            "open loop has no client concurrency limit to wait "
            "for: 0.0 each (the sender's lateness against its "
            "schedule, which vllm bench does not record, is in "
            "sidecar_lateness_ms)"
        )
    return {
        "sidecar_note": VLLM_BENCH_NOTE,
        "sidecar_arrivals": arrivals,
        "sidecar_endpoints": dict(sorted(endpoints.items())),
        "sidecar_max_in_flight_requests": report.get("max_in_flight_requests"),
        "sidecar_lateness_ms": report.get("lateness_ms"),
        "sidecar_degraded": report.get("degraded", False),
        "sidecar_degraded_reason": report.get("degraded_reason"),
        "sidecar_not_measured": not_measured,
    }


def _vllm_bench_results(
    report: Mapping[str, Any],
    sent: Sequence[SentRequest],
    closed: bool,
    planned: Mapping[int, int | None],
) -> dict[str, Any]:
    """vllm bench's result keys, in its order: the totals from ``report``, the per-request
    lists from ``sent`` (client vantage)."""
    records = [s.record for s in sent]
    metrics = [stats.request_metrics(r, Vantage.CLIENT) for r in records]
    max_tokens_per_s, max_concurrent = vllm_bench_peaks(sent)
    return {
        "duration": report.get("duration"),
        "completed": report.get("completed"),
        "failed": report.get("failed"),
        "total_input_tokens": report.get("total_input_tokens"),
        "total_output_tokens": report.get("total_output_tokens"),
        "request_throughput": report.get("request_throughput"),
        "request_goodput": report.get("request_goodput"),
        "output_throughput": report.get("output_throughput"),
        "total_token_throughput": report.get("total_token_throughput"),
        "input_lens": [
            r.n_in if r.n_in is not None else (planned.get(s.index) or 0)
            for s, r in zip(sent, records, strict=True)
        ],
        "output_lens": [stats.output_tokens(r, r.client) if r.ok else 0 for r in records],
        "ttfts": [(m.ttft_s or 0.0) if m is not None else 0.0 for m in metrics],
        "itls": [list(m.itl_s) if m is not None else [] for m in metrics],
        # vllm bench: the last chunk's instant - send for a success, 0.0 for a failure.
        "latencies": [
            ((m.e2e_s or 0.0) if m is not None else 0.0) if r.ok else 0.0
            for r, m in zip(records, metrics, strict=True)
        ],
        # Its clock's origin is arbitrary (perf_counter); ours is the run's start.
        "start_times": [s.actual_ns / 1e9 for s in sent],
        # Time spent waiting for the client's concurrency limit: closed loop, from the start
        # (when vllm bench releases every request) to the send; open loop has no limit.
        "queue_times": [s.actual_ns / 1e9 if closed else 0.0 for s in sent],
        "generated_texts": ["" for _ in sent],
        "errors": ["" if r.ok else (r.error_type or r.outcome.value) for r in records],
        "max_output_tokens_per_s": max_tokens_per_s,
        "max_concurrent_requests": max_concurrent,
        "rtfx": 0.0,  # audio input seconds / duration: no audio here
    }
