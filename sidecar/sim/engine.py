"""The simulated engine's timing model: continuous batching, pure and seeded, no I/O, no clock.

INTERFACE CONTRACT (the server in sim/server.py drives this; keep these names and meanings):

    model = EngineModel(EngineConfig(...))
    model.add_request(EngineRequest(...), now_s)      # a request arrives (admission already done)
    model.abort_request(request_id)                    # client went away: free its KV blocks
    model.has_work() -> bool                           # anything running or waiting?
    result = model.step(now_s) -> StepResult           # plan ONE engine step starting at now_s
        result.duration_s                              # how long the step takes (> 0)
        result.outputs: tuple[RequestOutput, ...]      # what becomes visible at now_s + duration_s
    model.stats() -> EngineStats                       # gauges/counters for /metrics

The caller sleeps until ``now_s + duration_s`` and then delivers ``outputs``. Time is whatever
the caller passes (seconds, float, monotonic); the model never reads a clock, so a test can run
thousands of steps in microseconds and get the same answer for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Knobs of the simulated engine. Defaults look like a small (~8B) model on one modern GPU."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    block_size: int = 16
    num_gpu_blocks: int = 32768
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Step time: flat at `step_floor_s` while the step's tokens stay under `saturation_tokens`
    # (memory-bound decode), then growing linearly with `per_token_s` per token above it
    # (compute-bound: the roofline shape).
    step_floor_s: float = 0.008
    saturation_tokens: int = 512
    per_token_s: float = 0.000015
    stream_interval: int = 1
    # Speculative decoding: up to `num_speculative_tokens` extra tokens per step, each accepted
    # with probability `spec_acceptance` (seeded).
    num_speculative_tokens: int = 0
    spec_acceptance: float = 0.7
    seed: int = 0


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # cap on generated tokens (already resolved by the server)
    min_tokens: int = 0
    ignore_eos: bool = False
    # The length at which the simulated model would emit EOS if allowed (None: the model picks a
    # seeded length). With ignore_eos the request generates exactly max_tokens.
    natural_length: int | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]  # tokens made visible by this step (may be > 1)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" when finished
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first output only)
    # Engine-internal instants (seconds, the caller's time base) for per-request metrics:
    arrival_s: float = 0.0
    scheduled_s: float | None = None  # first time the request was scheduled
    first_token_s: float | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    duration_s: float
    outputs: tuple[RequestOutput, ...]
    num_batched_tokens: int = 0  # tokens processed in this step (prefill + decode)


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_preemptions_total: int
    prefix_cache_queries_total: int  # tokens
    prefix_cache_hits_total: int  # tokens
    prompt_tokens_total: int
    generation_tokens_total: int


class EngineModel:
    def __init__(self, config: EngineConfig) -> None:
        raise NotImplementedError

    def add_request(self, request: EngineRequest, now_s: float) -> None:
        raise NotImplementedError

    def abort_request(self, request_id: str) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self, now_s: float) -> StepResult:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError
