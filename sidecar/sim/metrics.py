"""The simulated replica's ``/metrics``: vLLM v1 metric names, labels and buckets.

One `ReplicaMetrics` per replica, on its own `CollectorRegistry` (never the global one), so
several replicas in one process and tests running side by side never share a series.

Per-request histograms are observed by the engine driver (`sidecar.sim.driver`) as the engine
reports progress (the same instants vLLM's engine core stamps: arrival, first scheduled, each
step that produced tokens, finish); the engine's running totals (tokens, preemptions, prefix
cache, KV usage, queue sizes) are read from `EngineModel.stats()` at scrape time by a custom
collector.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString as _untyped_float_to_go_string

from sidecar.sim.engine import EngineStats

# prometheus-client leaves it untyped: the `le` label text of a bucket bound.
_go_float: Callable[[float], str] = _untyped_float_to_go_string

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket families of vLLM's v1/metrics (spec A3).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

# vLLM 0.10-era names for the series that were renamed later (spec A3, "Renamed metrics").
LEGACY_NAMES: dict[str, str] = {
    "vllm:inter_token_latency_seconds": "vllm:time_per_output_token_seconds",
    "vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries": "vllm:gpu_prefix_cache_queries",
    "vllm:prefix_cache_hits": "vllm:gpu_prefix_cache_hits",
}

# The labels of vLLM 0.32's ``vllm:cache_config_info`` (its CacheConfig fields), with the values
# the CPU server reports where the simulator has no counterpart. `vllm_cache_config_info` fills
# in the ones the engine model knows.
_CACHE_CONFIG_DEFAULTS: dict[str, str] = {
    "_block_size_resolved": "True",
    "block_size": "16",
    "cache_dtype": "auto",
    "cache_hit_alignment_tokens": "None",
    "effective_attention_block_size": "16",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.9",
    "hash_block_size": "None",
    "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]",
    "kv_cache_layout": "None",
    "kv_cache_max_concurrency": "None",
    "kv_cache_memory_bytes": "None",
    "kv_cache_size_tokens": "None",
    "kv_offloading_backend": "native",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "float32",
    "num_cpu_blocks": "None",
    "num_gpu_blocks": "None",
    "num_gpu_blocks_override": "None",
    "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256",
    "prefix_match_unit": "None",
    "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None",
    "sliding_window": "None",
    "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False",
    "use_replayssm": "False",
    "user_specified_block_size": "False",
}


def vllm_cache_config_info(cache_info: Mapping[str, str], max_model_len: int) -> dict[str, str]:
    """``cache_info`` (the server's, 0.10-era keys) as vLLM 0.32's label set: its keys that
    0.32 still has keep their values, the KV-cache size is derived from the block count, and
    every other label takes the value a default vLLM 0.32 reports."""
    info = dict(_CACHE_CONFIG_DEFAULTS)
    info.update((key, value) for key, value in cache_info.items() if key in info)
    info["effective_attention_block_size"] = info["block_size"]
    if info["num_gpu_blocks"].isdigit() and info["block_size"].isdigit():
        tokens = int(info["num_gpu_blocks"]) * int(info["block_size"])
        info["kv_cache_size_tokens"] = str(tokens)
        if max_model_len > 0:
            info["kv_cache_max_concurrency"] = str(tokens / max_model_len)
    return info


def one_two_five_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's ``build_1_2_5_buckets``)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class FastHistogram:
    """One labelled histogram series, observed without locks or a linear bucket scan.

    prometheus_client's Histogram takes a lock and walks every bucket per observation; the
    inter-token histogram is observed once per token, so here an observation is one
    ``bisect`` and two additions (the event loop is single-threaded, scrapes included). The
    exposition is what prometheus_client's Histogram writes: ``_bucket`` (cumulative, ``le``
    inclusive), ``_count``, ``_sum``, and a separate ``_created`` gauge family.
    """

    __slots__ = ("name", "documentation", "_bounds", "_le", "_counts", "_sum", "_created")

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = [float(bound) for bound in buckets]
        self._le = [_go_float(bound) for bound in self._bounds] + ["+Inf"]
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0
        self._created = time.time()

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    @property
    def count(self) -> int:
        return sum(self._counts)

    def families(self, label_names: list[str], label_values: list[str]) -> Iterator[Metric]:
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for le, count in zip(self._le, self._counts, strict=True):
            cumulative += count
            buckets.append((le, float(cumulative)))
        histogram = HistogramMetricFamily(self.name, self.documentation, labels=label_names)
        histogram.add_metric(label_values, buckets, self._sum)
        yield histogram
        created = GaugeMetricFamily(self.name + "_created", self.documentation, labels=label_names)
        created.add_metric(label_values, self._created)
        yield created


class _HistogramCollector:
    def __init__(self, histograms: list[FastHistogram], labels: tuple[str, str]) -> None:
        self._histograms = histograms
        self._labels = list(labels)

    def collect(self) -> Iterator[Metric]:
        for histogram in self._histograms:
            yield from histogram.families(["model_name", "engine"], self._labels)


class _EngineStatsCollector:
    """Reads the engine's totals and gauges when Prometheus scrapes."""

    def __init__(
        self,
        stats_source: Callable[[], EngineStats],
        labels: tuple[str, str],
        created: float,
        cache_info: Mapping[str, str],
        name: Callable[[str], str],
        legacy: bool,
    ) -> None:
        self._legacy = legacy
        self._stats_source = stats_source
        self._labels = list(labels)
        self._created = created
        self._cache_info = dict(cache_info)
        self._name = name

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(self._name(name), documentation, labels=["model_name", "engine"])
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(
            self._name(name), documentation, labels=["model_name", "engine"]
        )
        family.add_metric(self._labels, value, created=self._created)
        return family

    def _by_label(
        self,
        family: CounterMetricFamily | GaugeMetricFamily,
        values: Mapping[str, float],
    ) -> CounterMetricFamily | GaugeMetricFamily:
        for label, value in values.items():
            if isinstance(family, CounterMetricFamily):
                family.add_metric([*self._labels, label], value, created=self._created)
            else:
                family.add_metric([*self._labels, label], value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_source()
        yield from self._scheduler_state(stats)
        yield from self._cache_counters(stats)
        yield from self._token_counters(stats)

    def _scheduler_state(self, stats: EngineStats) -> Iterator[Metric]:
        """The gauges of the queue, the engine's sleep and the KV cache, and its config."""
        labelled = ["model_name", "engine"]
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            stats.num_running,
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            stats.num_waiting,
        )
        if not self._legacy:
            # No LoRA budget or KV transfer to defer a request: every waiting one waits for
            # capacity.
            yield self._by_label(
                GaugeMetricFamily(
                    "vllm:num_requests_waiting_by_reason",
                    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting "
                    "for scheduling capacity; 'deferred' = deferred by transient constraints "
                    "(LoRA budget, KV transfer, blocked status). Sum of all reasons equals "
                    "vllm:num_requests_waiting.",
                    labels=[*labelled, "reason"],
                ),
                {"capacity": stats.num_waiting, "deferred": 0},
            )
            # The simulator never sleeps (no /sleep endpoint).
            yield self._by_label(
                GaugeMetricFamily(
                    "vllm:engine_sleep_state",
                    "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means "
                    "engine is awake; weights_offloaded = 1 means sleep level 1; "
                    "discard_all = 1 means sleep level 2.",
                    labels=[*labelled, "sleep_state"],
                ),
                {"awake": 1, "weights_offloaded": 0, "discard_all": 0},
            )
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_cache_usage,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*self._cache_info.keys(), "engine"],
        )
        info.add_metric([*self._cache_info.values(), self._labels[1]], 1.0)
        yield info

    def _cache_counters(self, stats: EngineStats) -> Iterator[Metric]:
        """Prefix (and, zero here, external and multi-modal) cache queries and hits."""
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries_total,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits_total,
        )
        if not self._legacy:
            # No KV connector and a text-only model: vLLM serves these at 0 then too.
            yield self._counter(
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, "
                "in terms of number of queried tokens.",
                0,
            )
            yield self._counter(
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, in "
                "terms of number of cached tokens.",
                0,
            )
            yield self._counter(
                "vllm:mm_cache_queries",
                "Multi-modal cache queries, in terms of number of queried items.",
                0,
            )
            yield self._counter(
                "vllm:mm_cache_hits",
                "Multi-modal cache hits, in terms of number of cached items.",
                0,
            )

    def _token_counters(self, stats: EngineStats) -> Iterator[Metric]:
        """Preemptions, and prompt (by source) and generation tokens."""
        labelled = ["model_name", "engine"]
        yield self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            stats.num_preemptions_total,
        )
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens_total
        )
        if not self._legacy:
            cached = stats.prompt_tokens_cached_total
            yield self._by_label(
                CounterMetricFamily(
                    "vllm:prompt_tokens_by_source",
                    "Number of prompt tokens by source.",
                    labels=[*labelled, "source"],
                ),
                {
                    "local_compute": stats.prompt_tokens_total - cached,
                    "local_cache_hit": cached,
                    "external_kv_transfer": 0,
                },
            )
            yield self._counter(
                "vllm:prompt_tokens_cached",
                "Number of cached prompt tokens (local + external).",
                cached,
            )
            # Counted at admission, like vllm:prefix_cache_hits; all from the device's cache.
            yield self._by_label(
                CounterMetricFamily(
                    "vllm:prompt_tokens_cached_by_source",
                    "Prefix-cache hit tokens by the cache tier that supplied them: device (local "
                    "HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM "
                    "instance) or external_unspecified. Counted at admission; sums to "
                    "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
                    labels=[*labelled, "source"],
                ),
                {
                    "device": stats.prefix_cache_hits_total,
                    "host": 0,
                    "p2p": 0,
                    "disk": 0,
                    "external_unspecified": 0,
                },
            )
        yield self._counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            stats.generation_tokens_total,
        )


class ReplicaMetrics:
    """All series of one simulated replica (labels ``model_name``, ``engine``)."""

    def __init__(
        self,
        *,
        model_name: str,
        engine_index: int,
        max_model_len: int,
        stats_source: Callable[[], EngineStats],
        cache_info: Mapping[str, str],
        legacy_names: bool = False,
        tool_parser: bool = False,
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.engine_label = str(engine_index)
        self._legacy_names = legacy_names
        labels = (model_name, self.engine_label)
        self._declare_counters(tool_parser)
        histograms = self._declare_histograms(max_model_len)
        self.registry.register(_HistogramCollector(histograms, labels))
        if not legacy_names:
            cache_info = vllm_cache_config_info(cache_info, max_model_len)
        self.registry.register(
            _EngineStatsCollector(
                stats_source, labels, time.time(), cache_info, self._name, legacy_names
            )
        )

    def _declare_counters(self, tool_parser: bool) -> None:
        """The per-request counters (prometheus_client's), their fixed label sets at 0."""
        model_name = self.model_name
        label_names = ["model_name", "engine"]
        registry = self.registry
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*label_names, "finished_reason"],
            registry=registry,
        )
        self._success_by_reason = {
            reason: self._request_success.labels(model_name, self.engine_label, reason)
            for reason in ("stop", "length", "abort", "error", "repetition")
        }
        self._admission_rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=registry,
        )
        # Expose the series at 0 from the start, so a scrape before the first 503 sees it.
        # (The simulator has no max_num_queued_tokens limit: that series stays at 0.)
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            self._admission_rejections.labels(model_name, reason)
        # vLLM registers it when started with --tool-call-parser (api_server/app_state.py),
        # every label set at 0 (vllm/parser/metrics.py init_parser_metrics).
        self._tool_parser_invocations: Counter | None = None
        if tool_parser:
            self._tool_parser_invocations = Counter(
                "vllm:tool_call_parser_invocations",
                "Total number of ToolParser invocations. Non-streaming increments once per "
                "choice; streaming increments once per delta.",
                ["model_name", "mode", "outcome", "request_type"],
                registry=registry,
            )
            for mode in ("streaming", "non_streaming"):
                for outcome in ("tool_call", "no_tool_call"):
                    for request_type in ("chat_completions", "responses", "other"):
                        self._tool_parser_invocations.labels(
                            model_name, mode, outcome, request_type
                        )

    def _declare_histograms(self, max_model_len: int) -> list[FastHistogram]:
        """The per-request and per-step histograms, in exposition order."""
        token_buckets = one_two_five_buckets(max_model_len)
        histograms: list[FastHistogram] = []

        def histogram(name: str, documentation: str, buckets: Sequence[float]) -> FastHistogram:
            series = FastHistogram(self._name(name), documentation, buckets)
            histograms.append(series)
            return series

        self._prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self._generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self._max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self._params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self._iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_BUCKETS,
        )
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self._itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self._tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LATENCY_BUCKETS,
        )
        self._queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        )
        self._prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            LATENCY_BUCKETS,
        )
        self._decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            LATENCY_BUCKETS,
        )
        self._inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            LATENCY_BUCKETS,
        )
        self._preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            PREEMPTION_BUCKETS,
        )
        return histograms

    def _name(self, name: str) -> str:
        if self._legacy_names:
            return LEGACY_NAMES.get(name, name)
        return name

    # Hot path: called by the engine loop for every step / request output.
    def observe_iteration(self, num_tokens: int) -> None:
        self._iteration_tokens.observe(num_tokens)

    def observe_time_to_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_token_latency(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_finished(
        self,
        *,
        finished_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        max_tokens: int,
        n: int | None,
        arrival_s: float,
        scheduled_s: float | None,
        first_token_s: float | None,
        last_token_s: float | None,
        finished_s: float,
        num_preemptions: int = 0,
    ) -> None:
        """One finished engine request (any reason), with vLLM's interval definitions."""
        counter = self._success_by_reason.get(finished_reason)
        if counter is None:
            counter = self._request_success.labels(
                self.model_name, self.engine_label, finished_reason
            )
        counter.inc()
        self._prompt_tokens.observe(prompt_tokens)
        self._generation_tokens.observe(generation_tokens)
        self._max_tokens.observe(max_tokens)
        if n is not None:
            self._params_n.observe(n)
        self._e2e.observe(max(0.0, finished_s - arrival_s))
        self._preemptions.observe(num_preemptions)
        if scheduled_s is not None:
            self._queue.observe(max(0.0, scheduled_s - arrival_s))
            if first_token_s is not None:
                self._prefill.observe(max(0.0, first_token_s - scheduled_s))
            if last_token_s is not None:
                self._inference.observe(max(0.0, last_token_s - scheduled_s))
        if first_token_s is not None and last_token_s is not None:
            decode_s = max(0.0, last_token_s - first_token_s)
            self._decode.observe(decode_s)
            if generation_tokens > 1:
                self._tpot.observe(decode_s / (generation_tokens - 1))

    def count_tool_parser_invocations(self, streaming: bool, count: int = 1) -> None:
        """The tool parser read a chat answer under tool_choice "auto" (once per delta
        streamed, once per choice whole) and found no call: the simulated model answers in
        text."""
        if self._tool_parser_invocations is not None:
            self._tool_parser_invocations.labels(
                self.model_name,
                "streaming" if streaming else "non_streaming",
                "no_tool_call",
                "chat_completions",
            ).inc(count)

    def count_admission_rejection(self, reason: str) -> None:
        self._admission_rejections.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
