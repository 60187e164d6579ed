"""A replay run as an llm-d benchmark report, schema v0.2 ("BR v0.2").

The schema is llm-d-benchmark's ``benchmark_report/schema_v0_2.py`` (pydantic models; all but
three of them refuse fields they do not define, ``extra="forbid"``). This module writes a plain
dict that loads as ``BenchmarkReportV02``, without their code (pydantic and PyYAML are not our
dependencies); it is written as JSON, which their loader reads as well as YAML.

Where our numbers go:

- ``results.request_performance.aggregate``: request counts and lengths, latency statistics
  (TTFT and E2E in ms, TPOT, ITL and NTPOT in ms/token, the only units the schema allows
  there) and throughput (tokens/s, queries/s). All client vantage (the replayer), by our
  definitions (`report.DEFINITIONS`). Our ITL is per event (SSE chunk), as in ``vllm bench``;
  with per-token chunks, the usual case with vLLM, that is per token too.
- ``scenario.load``: the workload (tool ``vllm-sidecar``, requested lengths, rate or
  concurrency, stage = the step of a sweep); ``native`` holds our arguments (the SLO among
  them; never a credential) and the workload envelope.
- Goodput, SLO attainment, the SLO, outcomes, a sweep step's verdict and the sidecar's server
  vantage: ``results.observability.vllm_sidecar`` (`EXTENSION_KEY`). Not in the aggregate:
  BR v0.2 has no goodput field, and its ``Statistics`` ignores unknown fields (it sets no
  ``extra``), so a value put there would be dropped on load. ``results.observability`` is the
  one results section the schema leaves open (``extra="allow"``, "permissive until schema
  defined"); a vendor-named key there keeps ours apart from anything llm-d defines later.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import sidecar
from sidecar import stats
from sidecar.record import Outcome, Vantage
from sidecar.replay.report import DEFINITIONS, replay_goodput
from sidecar.replay.runner import SentRequest

SCHEMA_VERSION = "0.2"
COMPONENT_SCHEMA_VERSION = "0.0.1"
TOOL = "vllm-sidecar"
EXTENSION_KEY = "vllm_sidecar"
EXTENSION_VERSION = 1
# Statistics keys of BR v0.2 (p0p1 = 0.1th percentile, p99p9 = 99.9th).
PERCENTILES = (0.1, 1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.9)
# Units, spelled as BR v0.2's `Units` enum serialises them.
COUNT, MS, MS_PER_TOKEN = "count", "ms", "ms/token"
TOKENS_PER_S, QUERIES_PER_S, FRACTION = "tokens/s", "queries/s", "fraction"

EXTENSION_DEFINITIONS = {
    **DEFINITIONS,
    "ntpot": "E2E / N_out per request (includes TTFT); sample = request",
    "itl_units": "BR v0.2 allows only ms/token for ITL: ours is per token-carrying event "
    "(SSE chunk), per token when each chunk carries one token",
}


def stat_key(q: float) -> str:
    """0.1 -> 'p0p1', 50 -> 'p50', 99.9 -> 'p99p9' (BR v0.2's Statistics keys)."""
    return f"p{q:g}".replace(".", "p")


def statistics(values: Sequence[float], units: str) -> dict[str, Any] | None:
    """A BR v0.2 ``Statistics`` of a sample; None when empty (``mean`` is required)."""
    summary = stats.summarize(values, PERCENTILES)
    if summary.count == 0:
        return None
    out: dict[str, Any] = {
        "units": units,
        "mean": summary.mean,
        "stddev": summary.std,
        "min": summary.min,
    }
    for q in PERCENTILES:
        out[stat_key(q)] = summary.p(q)
    out["max"] = summary.max
    return out


def single_value(value: float | None, units: str) -> dict[str, Any] | None:
    """A run-level rate as ``Statistics`` with its mean only (as llm-d's importers do)."""
    return None if value is None else {"units": units, "mean": value}


def sequence_length(lengths: Sequence[int | None]) -> dict[str, Any] | None:
    """A BR v0.2 ``SequenceLength`` of requested lengths: fixed when they are all the same,
    else "other" with mean, min and max (the schema requires value >= 1)."""
    known = [n for n in lengths if n is not None]
    if not known or max(known) < 1:
        return None
    low, high = min(known), max(known)
    if low == high:
        return {"distribution": "fixed", "value": low}
    return {
        "distribution": "other",
        "value": max(1.0, sum(known) / len(known)),
        "min": low,
        "max": high,
    }


def iso_time(wall_ns: int) -> str:
    at = datetime.datetime.fromtimestamp(wall_ns / 1e9, tz=datetime.timezone.utc)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def iso_duration(seconds: float) -> str:
    return f"PT{seconds:.3f}S"


def cfg_id(config: Any) -> str:
    """A hash of a configuration: SHA-256 of its canonical JSON (sorted keys)."""
    canonical = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def component(
    label: str,
    tool: str,
    tool_version: str | None,
    *,
    description: str,
    details: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A stack component of kind ``generic`` (the one kind whose standardized section takes
    extra fields; ``inference_engine`` requires accelerator details we cannot know)."""
    standardized = {"tool": tool, "tool_version": tool_version or "unknown", **(details or {})}
    return {
        "metadata": {
            "kind": "generic",
            "schema_version": COMPONENT_SCHEMA_VERSION,
            "label": label,
            "cfg_id": cfg_id(standardized),
            "description": description,
        },
        "standardized": standardized,
        "native": {},
    }


@dataclass(frozen=True, slots=True)
class Workload:
    """What the run asked for, as BR v0.2's ``scenario.load`` describes it."""

    input_lengths: Sequence[int | None]  # requested, one per measured request
    output_lengths: Sequence[int | None]
    sampled: bool  # captured request bodies sent verbatim (else generated prompts)
    rate_qps: float | None = None  # open loop on a synthetic process at this rate
    concurrency: int | None = None  # closed loop
    stage: int = 0
    shared_prefix_tokens: int = 0  # every request shares this many leading tokens
    description: str = ""
    args: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)


# Arguments never written into a report: credentials.
SECRET_ARGS = frozenset({"admin_token"})


def native_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """Command-line arguments as ``--flag: value`` (plain values only; never a secret)."""
    return {
        f"--{name.replace('_', '-')}": value
        for name, value in sorted(args.items())
        if name not in SECRET_ARGS and isinstance(value, (str, int, float, bool, list, type(None)))
    }


def _load(workload: Workload, sent: Sequence[SentRequest]) -> dict[str, Any]:
    standardized: dict[str, Any] = {
        "tool": TOOL,
        "tool_version": sidecar.__version__,
        "source": "sampled" if workload.sampled else "random",
        "stage": workload.stage,
    }
    # Requested lengths describe the workload; where the trace had none (captured bodies
    # without lengths), the measured ones of the completed requests stand in.
    measured = [s.record for s in sent if s.record.ok]
    input_len = sequence_length(workload.input_lengths) or sequence_length(
        [r.n_in for r in measured if r.n_in is not None]
    )
    if input_len is None:
        raise ValueError(
            "an llm-d benchmark report needs input lengths: none were requested or measured"
        )
    standardized["input_seq_len"] = input_len
    output_len = sequence_length(workload.output_lengths)
    if output_len is not None:
        standardized["output_seq_len"] = output_len
    if workload.shared_prefix_tokens > 0 and sent:
        standardized["prefix"] = {
            "prefix_len": {"distribution": "fixed", "value": workload.shared_prefix_tokens},
            "num_groups": 1,
            "num_users_per_group": len(sent),
            "num_prefixes": 1,
        }
    if workload.rate_qps is not None and workload.rate_qps > 0:
        standardized["rate_qps"] = workload.rate_qps
    if workload.concurrency is not None:
        standardized["concurrency"] = int(workload.concurrency)
    native = {"args": dict(workload.args), "config": dict(workload.config)}
    metadata = {
        "schema_version": COMPONENT_SCHEMA_VERSION,
        "cfg_id": cfg_id(native),
        "description": workload.description or "sidecar replay",
    }
    return {"metadata": metadata, "standardized": standardized, "native": native}


def _latencies_ms(sent: Sequence[SentRequest]) -> dict[str, list[float]]:
    """The run's latency samples in ms, from `stats.request_samples` (successful requests,
    client vantage); ``ntpot``: E2E / N_out per request with N_out >= 1."""
    samples = stats.request_samples((s.record for s in sent), Vantage.CLIENT)
    e2e_ms = samples.e2e_s * 1e3
    with_output = ~np.isnan(e2e_ms) & (samples.n_out >= 1)
    return {
        "ttft": (samples.defined("ttft") * 1e3).tolist(),
        "tpot": (samples.defined("tpot") * 1e3).tolist(),
        "itl": (samples.itl_s * 1e3).tolist(),
        "e2el": (samples.defined("e2e") * 1e3).tolist(),
        "ntpot": (e2e_ms[with_output] / samples.n_out[with_output]).tolist(),
    }


def _goodput(
    sent: Sequence[SentRequest], slo_policy: stats.SLOPolicy, duration_s: float
) -> dict[str, Any]:
    goodput = replay_goodput([s.record for s in sent], slo_policy, duration_s)
    return {
        "slo": {name: slo.describe() for name, slo in slo_policy.classes.items()},
        "vantage": Vantage.CLIENT.value,
        "good_requests": goodput.good_requests,
        "requests": goodput.requests,
        "attainment": {"units": FRACTION, "value": goodput.attainment},
        "request_goodput": {"units": QUERIES_PER_S, "value": goodput.good_requests_per_s},
        "good_output_token_rate": {
            "units": TOKENS_PER_S,
            "value": goodput.good_output_tokens_per_s,
        },
    }


def _drop_none(value: Any) -> Any:
    """BR v0.2 is written without null members (their exporter dumps with exclude_none)."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _aggregate(sent: Sequence[SentRequest], duration_s: float) -> dict[str, Any]:
    """BR v0.2's ``request_performance.aggregate``: request counts and lengths, latency
    statistics, and rates per ``duration_s``."""
    records = [s.record for s in sent]
    completed = [r for r in records if r.outcome is Outcome.OK]
    total_in = sum(r.n_in or 0 for r in completed)
    total_out = sum(stats.output_tokens(r, r.client) for r in completed)
    rate = 1.0 / duration_s if duration_s > 0 else 0.0
    latency = _latencies_ms(sent)
    return {
        "requests": {
            "total": len(records),
            "failures": len(records) - len(completed),
            "input_length": statistics([r.n_in for r in completed if r.n_in is not None], COUNT),
            "output_length": statistics(
                [stats.output_tokens(r, r.client) for r in completed], COUNT
            ),
        },
        "latency": {
            "time_to_first_token": statistics(latency["ttft"], MS),
            "normalized_time_per_output_token": statistics(latency["ntpot"], MS_PER_TOKEN),
            "time_per_output_token": statistics(latency["tpot"], MS_PER_TOKEN),
            "inter_token_latency": statistics(latency["itl"], MS_PER_TOKEN),
            "request_latency": statistics(latency["e2el"], MS),
        },
        "throughput": {
            "input_token_rate": single_value(total_in * rate, TOKENS_PER_S),
            "output_token_rate": single_value(total_out * rate, TOKENS_PER_S),
            "total_token_rate": single_value((total_in + total_out) * rate, TOKENS_PER_S),
            "request_rate": single_value(len(completed) * rate, QUERIES_PER_S),
        },
    }


def benchmark_report(
    sent: Sequence[SentRequest],
    *,
    duration_s: float,
    workload: Workload,
    slo_policy: stats.SLOPolicy | None = None,
    stack: Sequence[Mapping[str, Any]] = (),
    extension: Mapping[str, Any] | None = None,
    uid: str | None = None,
    eid: str | None = None,
) -> dict[str, Any]:
    """One run (the median run of a replay, or one sweep step) as a BR v0.2 dict.

    ``duration_s``: from the run's start (its first scheduled instant) to the last response's
    end, as in the replay report; every rate here is per that duration. ``extension``: more
    members of ``results.observability.vllm_sidecar`` (a sweep step's verdict, ...).
    """
    start_ns = min((s.record.wall_time_ns - s.actual_ns for s in sent), default=None)
    ours: dict[str, Any] = {
        "extension_version": EXTENSION_VERSION,
        "about": "vllm-sidecar's goodput, SLO attainment and other results that BR v0.2 has "
        "no field for; definitions below",
        "outcomes": {o.value: n for o, n in stats.outcome_counts(s.record for s in sent).items()},
        "definitions": EXTENSION_DEFINITIONS,
    }
    if slo_policy is not None:
        ours["goodput"] = _goodput(sent, slo_policy, duration_s)
    ours.update(extension or {})
    report: dict[str, Any] = {
        "version": SCHEMA_VERSION,
        "run": {
            "uid": uid or uuid.uuid4().hex,
            "eid": eid,
            "time": None
            if start_ns is None
            else {
                "start": iso_time(start_ns),
                "end": iso_time(start_ns + int(duration_s * 1e9)),
                "duration": iso_duration(duration_s),
            },
        },
        "scenario": {
            "stack": list(stack) or None,
            "load": _load(workload, sent),
        },
        "results": {
            "request_performance": {"aggregate": _aggregate(sent, duration_s)},
            "observability": {EXTENSION_KEY: ours},
        },
    }
    pruned: dict[str, Any] = _drop_none(report)
    return pruned
