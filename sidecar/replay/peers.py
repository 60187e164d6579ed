"""The same requests under other tools' definitions (spec/peer-tools.md), named by formula.

Tools give one name to different quantities ("ITL" is a pooled per-chunk gap in vLLM, a
per-request mean in AIPerf and GuideLLM; "TPOT" includes TTFT in GuideLLM). To answer "what
would tool X have said?", each metric here is computed from our client-side records with that
tool's formula, and keyed ``tool.name`` with the formula beside it. Our own definitions are in
`report.DEFINITIONS`; these never replace them.

Where a tool re-tokenises text on the client, we use the server's usage counts instead (stated
in `NOTES`); per-token timestamps are derived from per-chunk stamps and token counts exactly as
those tools do (every token of a chunk gets the chunk's instant).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sidecar import stats
from sidecar.record import RequestRecord

NS = 1e9

FORMULAS = {
    "vllm.ttft": "first token chunk - send",
    "vllm.itl": "gaps between consecutive token chunks, pooled",
    "vllm.tpot": "(e2el - ttft) / (N_out - 1), N_out > 1",
    "vllm.e2el": "last token chunk - send",
    "inference_perf.ttft": "first token - send, only with >= 2 token timestamps",
    "inference_perf.tpot": "(t_last_token - t_first_token) / (N - 1)",
    "inference_perf.itl": "gaps between consecutive tokens (tokens of a chunk share its "
                          "instant: zeros included), pooled",
    "inference_perf.ntpot": "(end - send) / N",
    "aiperf.ttft": "first content chunk - send",
    "aiperf.ttst": "second content chunk - first",
    "aiperf.itl": "(latency - ttft) / (OSL - first_chunk_tokens), per request",
    "aiperf.icl": "gaps between consecutive content chunks, pooled",
    "aiperf.request_latency": "last content chunk - send",
    "guidellm.ttft": "first content line - send",
    "guidellm.itl": "(t_last - t_first) / (N - 1), per request (= vLLM's TPOT)",
    "guidellm.tpot": "(t_last - send) / N, per request (includes TTFT)",
    "guidellm.request_latency": "end - send",
}

NOTES = ("Token counts are the server's usage (inference-perf and AIPerf would re-tokenise the "
         "text on the client). Timestamps are ours (perf_counter_ns per read); GuideLLM uses "
         "the wall clock. Failed requests are excluded, as all four tools do by default.")


def _per_token_instants(record: RequestRecord) -> list[int]:
    out: list[int] = []
    for offset, n_tokens in zip(record.client.offsets_ns, record.client.tokens, strict=True):
        out.extend([offset] * max(n_tokens, 0))
    return out


def peer_values(records: Iterable[RequestRecord]) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {name: [] for name in FORMULAS}

    def add(name: str, value: float | None) -> None:
        if value is not None:
            values[name].append(value)

    for record in records:
        if not record.ok:
            continue
        offsets = record.client.offsets_ns
        n_out = stats.output_tokens(record, record.client)
        end = record.client.end_ns
        if not offsets:
            if end is not None:
                add("guidellm.request_latency", end / NS)
            continue
        first, last = offsets[0], offsets[-1]
        add("vllm.ttft", first / NS)
        add("aiperf.ttft", first / NS)
        add("guidellm.ttft", first / NS)
        add("vllm.e2el", last / NS)
        add("aiperf.request_latency", last / NS)
        if end is not None:
            add("guidellm.request_latency", end / NS)
            if n_out > 0:
                add("inference_perf.ntpot", end / n_out / NS)
        gaps = [(b - a) / NS for a, b in zip(offsets, offsets[1:], strict=False)]
        values["vllm.itl"].extend(gaps)
        values["aiperf.icl"].extend(gaps)
        if len(offsets) > 1:
            add("aiperf.ttst", (offsets[1] - first) / NS)
        if n_out > 1:
            add("vllm.tpot", (last - first) / (n_out - 1) / NS)
            add("guidellm.itl", (last - first) / (n_out - 1) / NS)
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
                (b - a) / NS for a, b in zip(tokens, tokens[1:], strict=False))
    return values


def peer_report(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Every peer metric's summary in milliseconds, with its formula."""
    out: dict[str, Any] = {"notes": NOTES, "metrics": {}}
    for name, samples in peer_values(records).items():
        summary = stats.summarize([s * 1000 for s in samples])
        out["metrics"][name] = {"formula": FORMULAS[name], "unit": "ms", **summary.to_dict()}
    return out


def vllm_bench_json(report: dict[str, Any], records: Sequence[RequestRecord]) -> dict[str, Any]:
    """`vllm bench serve`'s result JSON (with --save-detailed arrays), from a replay run."""
    keys = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
            "request_throughput", "request_goodput", "output_throughput",
            "total_token_throughput", "max_concurrent_requests")
    out: dict[str, Any] = {k: report.get(k) for k in keys}
    for key, value in report.items():
        if key.endswith("_ms") and key.split("_")[0] in ("mean", "median", "std") or (
                key.startswith("p") and key.endswith("_ms")):
            out[key] = value
    ok = list(records)
    out["input_lens"] = [r.n_in or 0 for r in ok]
    out["output_lens"] = [stats.output_tokens(r, r.client) if r.ok else 0 for r in ok]
    out["ttfts"] = [(m.ttft_s or 0.0) if (m := stats.request_metrics(r, stats.Vantage.CLIENT))
                    else 0.0 for r in ok]
    out["itls"] = [list(m.itl_s) if (m := stats.request_metrics(r, stats.Vantage.CLIENT))
                   else [] for r in ok]
    out["errors"] = ["" if r.ok else (r.error_type or r.outcome.value) for r in ok]
    out["backend"] = "openai"
    out["note"] = ("written by sidecar replay; same definitions as vllm bench serve for these "
                   "keys, measured by the sidecar's replayer")
    return out
