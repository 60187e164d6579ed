"""The engine's own view of a replica, read from its /metrics (vLLM v1, legacy, SGLang).

Shared by the proxy (periodic scrapes per replica) and the replayer (before/after a run).

Queue depth, running requests, KV-cache usage, prefix-cache hit rate and preemptions belong in
every report's workload envelope, and they explain latency the proxy sees. The sidecar keeps
them per replica for its JSON endpoints and reports; it never re-exports them to Prometheus
(Prometheus scrapes vLLM itself, and the dashboards join the two by replica).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# What we keep -> the family names that carry it, in order of preference. Counter families are
# named without `_total` by the parser.
GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_cache_usage": (
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
    ),
    "sglang_cache_hit_rate": ("sglang:cache_hit_rate",),
}
COUNTERS: dict[str, tuple[str, ...]] = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "preemptions": ("vllm:num_preemptions", "sglang:num_retracted_requests"),
    "prompt_tokens": ("vllm:prompt_tokens", "sglang:prompt_tokens"),
    "generation_tokens": ("vllm:generation_tokens", "sglang:generation_tokens"),
    "cached_tokens": ("sglang:cached_tokens",),
}


def parse_engine_metrics(text: str) -> tuple[dict[str, float], str | None]:
    """(values, flavour) from a /metrics text: gauges and counters summed over label sets
    (engines/DP ranks). flavour: "vllm", "vllm-legacy", "sglang" or None."""
    # Summed by *sample* name, so that a counter reads the same whether its exposition's TYPE
    # line names it with or without `_total`.
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isfinite(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    values: dict[str, float] = {}
    for key, names in GAUGES.items():
        found = next((name for name in names if name in sums), None)
        if found is not None:
            values[key] = sums[found]
    for key, names in COUNTERS.items():
        found = next((name + "_total" for name in names if name + "_total" in sums), None)
        if found is not None:
            values[key] = sums[found]
    flavour: str | None = None
    if any(name.startswith("sglang:") for name in sums):
        flavour = "sglang"
    elif "vllm:gpu_cache_usage_perc" in sums or "vllm:gpu_prefix_cache_queries_total" in sums:
        flavour = "vllm-legacy"
    elif any(name.startswith("vllm:") for name in sums):
        flavour = "vllm"
    return values, flavour


def histogram_totals(text: str, families: Iterable[str]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each named histogram family in a /metrics text, over its label sets
    (0, 0 for a family that is absent): a mean over an interval is the difference of two."""
    out = {name: (0.0, 0.0) for name in families}
    for family in text_string_to_metric_families(text):
        if family.name in out:
            total, count = out[family.name]
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
            out[family.name] = (total, count)
    return out


@dataclass(slots=True)
class EngineView:
    """The latest scrape of one replica, and the prefix hit rate since the previous one."""

    scrapes: int = 0
    failures: int = 0
    last_error: str | None = None
    flavour: str | None = None
    values: dict[str, float] = field(default_factory=dict)
    prefix_hit_rate_recent: float | None = None  # hits/queries between the last two scrapes

    def update(self, values: dict[str, float], flavour: str | None) -> None:
        previous = self.values
        queries = values.get("prefix_cache_queries")
        hits = values.get("prefix_cache_hits")
        before_q = previous.get("prefix_cache_queries")
        before_h = previous.get("prefix_cache_hits")
        if None not in (queries, hits, before_q, before_h):
            dq = queries - before_q  # type: ignore[operator]
            dh = hits - before_h  # type: ignore[operator]
            # A counter that went down means the engine restarted: no rate for this interval.
            self.prefix_hit_rate_recent = (dh / dq) if dq > 0 and dh >= 0 else None
        self.values = values
        self.flavour = flavour
        self.scrapes += 1
        self.last_error = None

    def fail(self, error: str) -> None:
        self.failures += 1
        self.last_error = error

    def to_dict(self) -> dict[str, Any]:
        values = self.values
        queries = values.get("prefix_cache_queries")
        hits = values.get("prefix_cache_hits")
        lifetime = (hits / queries) if queries and hits is not None else None
        if lifetime is None and "sglang_cache_hit_rate" in values:
            lifetime = values["sglang_cache_hit_rate"]
        return {
            "flavour": self.flavour,
            "scrapes": self.scrapes,
            "failures": self.failures,
            "last_error": self.last_error,
            "running": values.get("running"),
            "waiting": values.get("waiting"),
            "kv_cache_usage": values.get("kv_cache_usage"),
            "prefix_cache_hit_rate": lifetime,
            "prefix_cache_hit_rate_recent": self.prefix_hit_rate_recent,
            "preemptions_total": values.get("preemptions"),
            "prompt_tokens_total": values.get("prompt_tokens"),
            "generation_tokens_total": values.get("generation_tokens"),
        }


def merge_views(views: Iterable[EngineView]) -> dict[str, Any]:
    """Totals across replicas for a report's envelope (hit rate from summed counters)."""
    queries = hits = 0.0
    preemptions = 0.0
    for view in views:
        queries += view.values.get("prefix_cache_queries", 0.0)
        hits += view.values.get("prefix_cache_hits", 0.0)
        preemptions += view.values.get("preemptions", 0.0)
    return {
        "prefix_cache_hit_rate": (hits / queries) if queries else None,
        "preemptions_total": preemptions,
    }
