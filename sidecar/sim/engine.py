"""The simulated engine's timing model: continuous batching, pure and seeded, no I/O, no clock.

INTERFACE CONTRACT (the engine driver in sim/driver.py drives this; keep these names and meanings):

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

ADDITIONS beyond the contract (all optional to use):

- ``EngineModel.validate(request)`` raises the same ValueError ``add_request`` would, without
  adding anything, so the server can turn it into a 400 first.
- ``abort_request`` returns True if the request was live (False: unknown or already finished).
- ``EngineModel.check_invariants()``: O(cache) self-check of the block accounting, for tests.
- Config: ``natural_length_median`` / ``natural_length_sigma`` (the seeded output length),
  ``vocab_size``.
- ``EngineConfig.step_duration_s(num_tokens)``: the step-time formula below.
- ``RequestOutput.num_preemptions`` and ``RequestOutput.step_times_s``; ``StepResult`` and
  ``EngineStats`` gained counters (see the comments on their fields).

The model, in one place (each rule mirrors vLLM v1's scheduler, simplified):

Scheduling (``step``), FCFS, one step at a time:
  1. Running requests, in admission order, get their tokens first: a decoding request needs
     ``1 + num_speculative_tokens`` tokens of the step budget (the last sampled token plus the
     drafts to verify); a request still in (chunked) prefill needs the rest of its prompt. Each
     is trimmed to the budget left. If its KV blocks cannot grow, the most recently admitted
     running request is preempted (possibly itself, which ends this phase).
  2. Only if nothing was preempted in this step, waiting requests are admitted from the front
     while ``max_num_seqs`` and the token budget allow and their blocks fit; the first one that
     does not fit stops admission (strict FCFS, no skipping ahead).
  A prompt longer than the budget left is prefilled in chunks over several steps; with
  ``enable_chunked_prefill=False`` it waits until a step has budget for all of it (vLLM
  then requires ``max_num_batched_tokens >= max_model_len``, and so does this config).

Step time (roofline): with ``T`` = tokens in the step (prefill chunks + ``1 + k`` per decode),
  ``duration_s = step_floor_s + max(0, T - saturation_tokens) * per_token_s``.
  Below saturation a step is memory-bound (reading the weights once costs the same for 1 or
  512 tokens); above it every extra token costs compute. Attention cost growing with context
  length is not modelled. Defaults: an 8 ms floor (an 8B bf16 model reads ~16 GB of weights
  per step: ~5 ms at H100 bandwidth plus overheads) gives ~125 tok/s per stream at low batch;
  15 us/token above 512 tokens gives a 2000-token prefill 8 + 1488 * 0.015 = 30.3 ms, and the
  two pieces meet near 533 tokens, consistent with the 512-token knee. That marginal rate
  (~67k tokens/s, ~1 PFLOP/s at 2 FLOP per parameter per token) is FP8-class; for a bf16
  deployment 30-40 us/token is more realistic.

Token emission: the step that completes a request's prefill samples its first token, at the
  step's end instant ``now_s + duration_s``. A decode step samples ``1 + a`` tokens, where
  ``a`` is the number of accepted drafts: each of the (budget-trimmed) drafts is accepted with
  probability ``spec_acceptance`` until the first rejection. Rejected draft slots are rolled
  back. Token ids are seeded pseudo-tokens in ``[3, vocab_size)`` (0..2 are the usual
  unk/bos/eos ids), drawn from a per-request stream (keyed by the request id, or by its
  ``sampling_key`` when the server gives one: greedy and seeded requests), so the i-th token
  of a request does not depend on batching or preemption; the last token of a request that
  finishes "stop" is EOS (id 2) instead, as a model's is: it counts as a completion token,
  decodes to no text, and its delta is what carries the finish (vLLM's final chunk with empty
  content).

Output length ``L`` (generated tokens), decided when the request is added:
  ``cap = max(1, min(max_tokens, max_model_len - prompt_len))`` (vLLM stops at
  ``num_tokens >= max_model_len``; its length check runs before its EOS check).
  - ``ignore_eos``: ``L = cap``, finish "length".
  - otherwise ``n = natural_length`` if given (values < 1 count as 1: an immediate EOS is
    still one completion token), else a seeded draw ``round(lognormvariate(ln(median),
    sigma))`` (at least 1) from ``random.Random`` seeded with a stable blake2b hash of
    ``(seed, request_id)``; then ``n = max(n, min_tokens)`` (EOS is blocked before
    min_tokens); if ``n >= cap``: ``L = cap``, "length", else ``L = n``, "stop".

KV cache: ``num_gpu_blocks`` blocks of ``block_size`` tokens (no block is reserved). A request
  holds ``ceil((num_computed + num_scheduled) / block_size)`` blocks while it runs (vLLM's
  ``allocate_slots``: the last sampled token gets its slot in the step that computes it;
  speculative lookahead slots are allocated up front). Preemption is recompute-style: the
  victim's blocks are freed, it goes to the FRONT of the waiting queue and later re-prefills
  prompt + already generated tokens; tokens already emitted are not emitted again.
  ``kv_cache_usage`` = blocks not in the free queue / ``num_gpu_blocks`` (cached but unused
  blocks count as free, as in vLLM's ``BlockPool.get_usage``).

Prefix cache (``enable_prefix_caching``): every full, computed block (prompt or generated
  tokens) is hashed by chaining, ``h_i = hash((h_{i-1}, block_i_token_ids))``, ``h_{-1} = 0``,
  and registered hash -> block. On admission the longest run of leading blocks whose hashes are
  registered counts as computed; like vLLM at most ``num_tokens - 1`` tokens can hit (one token
  must be computed to get logits), so an identical prompt of P tokens hits
  ``((P - 1) // block_size) * block_size`` tokens. Freed blocks keep their hash and sit in the
  free queue (LRU: freed blocks join the tail, a request's blocks tail-first; allocation evicts
  from the head), so the cache is bounded by ``num_gpu_blocks``. ``prefix_cache_queries`` /
  ``prefix_cache_hits`` count tokens at a request's first admission only (vLLM keeps lookups
  of re-admitted, preempted requests in separate counters; this model does not count them).
  Python's ``hash`` of int tuples is not salted, so hashes are deterministic across runs.

Streaming: with ``stream_interval = N`` a request's tokens become visible when nothing has been
  shown yet (the first token goes out at once), when ``N`` or more are pending, and at finish
  (vLLM's ``RequestState.make_request_output``). Steps that compute only part of a prompt
  produce no output.

Abort: ``abort_request`` removes the request at once and frees its blocks; no output with
  finish_reason "abort" is produced (the server already knows it aborted), and buffered tokens
  are dropped. It is counted in ``EngineStats.request_success_total["abort"]``.

Cost: ``step`` is O(number of scheduled requests) plus O(block_size) per newly filled block and,
  for the request at the head of the waiting queue, O(its blocks) for the prefix lookup; nothing
  scans history or the whole cache.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

# Pseudo-token ids are drawn from [_FIRST_TOKEN_ID, vocab_size): 0, 1, 2 are unk/bos/eos in the
# Llama-2 style vocabularies this mimics; EOS (id 2) only ends a request that finishes "stop".
EOS_TOKEN_ID = 2
_FIRST_TOKEN_ID = 3
# Root of the block-hash chain (vLLM uses a random NONE_HASH; a constant keeps runs repeatable).
_ROOT_HASH = 0
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Knobs of the simulated engine. Defaults look like a small (~8B) model on one modern GPU.

    32768 blocks x 16 tokens = 524k tokens of KV: Llama-3-8B needs 128 KiB per token in bf16,
    so that is ~64 GiB, about what an 80 GB GPU has left after the weights at 0.9 utilisation.
    """

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
    # ADDED. The seeded output length when a request has no natural_length: lognormal with this
    # median and log-space sigma. Median 128 and sigma 1.0 give a mean of ~211 tokens, close to
    # ShareGPT's ~215-token mean completion used by vLLM's own serving benchmark.
    natural_length_median: float = 128.0
    natural_length_sigma: float = 1.0
    vocab_size: int = 32000

    def __post_init__(self) -> None:
        positive_ints = (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "block_size",
            "num_gpu_blocks",
            "stream_interval",
        )
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("saturation_tokens", "num_speculative_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 0, got {value!r}")
        # `not (x > 0)` rather than `x <= 0` so that NaN is rejected too.
        if not (self.step_floor_s > 0 and math.isfinite(self.step_floor_s)):
            raise ValueError(
                f"EngineConfig.step_floor_s must be a finite number > 0, got {self.step_floor_s!r}"
            )
        if not (self.per_token_s >= 0 and math.isfinite(self.per_token_s)):
            raise ValueError(
                f"EngineConfig.per_token_s must be a finite number >= 0, got {self.per_token_s!r}"
            )
        if not (0.0 <= self.spec_acceptance <= 1.0):
            raise ValueError(
                f"EngineConfig.spec_acceptance must be in [0, 1], got {self.spec_acceptance!r}"
            )
        if not (self.natural_length_median >= 1 and math.isfinite(self.natural_length_median)):
            raise ValueError(
                "EngineConfig.natural_length_median must be a finite number >= 1, "
                f"got {self.natural_length_median!r}"
            )
        if not (self.natural_length_sigma >= 0 and math.isfinite(self.natural_length_sigma)):
            raise ValueError(
                "EngineConfig.natural_length_sigma must be a finite number >= 0, "
                f"got {self.natural_length_sigma!r}"
            )
        if not isinstance(self.vocab_size, int) or self.vocab_size <= _FIRST_TOKEN_ID:
            raise ValueError(
                f"EngineConfig.vocab_size must be an integer > {_FIRST_TOKEN_ID}, "
                f"got {self.vocab_size!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Same rule as vLLM's SchedulerConfig: without chunking a prompt (or a preempted
            # request's prompt + output) must fit in one step, or it would wait forever.
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller "
                f"than max_model_len ({self.max_model_len}) with chunked prefill disabled: "
                "longer prompts could never be scheduled. Increase max_num_batched_tokens, "
                "decrease max_model_len or enable chunked prefill."
            )

    def step_duration_s(self, num_tokens: int) -> float:
        """ADDED. The roofline step time for a step that processes ``num_tokens`` tokens."""
        excess = num_tokens - self.saturation_tokens
        if excess <= 0:
            return self.step_floor_s
        return self.step_floor_s + excess * self.per_token_s


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
    # ADDED. What the token ids and the seeded length are drawn from, when not the request id:
    # a greedy request's answer is a function of its prompt, a seeded one's of its seed, as a
    # real model's is (the server derives the key; None: the request id, a fresh draw).
    sampling_key: str | None = None


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
    # ADDED. Preemptions of this request so far (vllm:request_num_preemptions at finish).
    num_preemptions: int = 0
    # ADDED. End instants of the engine steps that produced the tokens in `new_token_ids`, one
    # per step, in order. vLLM's inter_token_latency histogram observes one gap per engine step
    # (not per visible chunk), which stream_interval > 1 would otherwise hide.
    step_times_s: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class StepResult:
    duration_s: float
    outputs: tuple[RequestOutput, ...]
    num_batched_tokens: int = 0  # tokens processed in this step (prefill + decode)
    # ADDED: the split of num_batched_tokens, and how many requests this step preempted.
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0  # 1 + drafts per decoding request
    num_preemptions: int = 0


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
    # ADDED (vLLM names in brackets):
    # prompt tokens served from cache, counted with prompt_tokens at a request's first token
    # [vllm:prompt_tokens_cached; prompt_tokens_by_source{source=local_cache_hit}]
    prompt_tokens_cached_total: int = 0
    # finished requests by reason: stop, length, abort [vllm:request_success{finished_reason}]
    request_success_total: dict[str, int] = field(default_factory=dict)
    # [vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens /
    #  _num_accepted_tokens_per_pos{position}] (per_pos has num_speculative_tokens entries)
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    num_steps_total: int = 0
    num_free_blocks: int = 0  # includes cached-but-unused (evictable) blocks
    num_cached_blocks: int = 0  # blocks currently holding a registered prefix hash


def _stable_seed(seed: int, request_id: str, stream: str) -> int:
    """A 64-bit seed from (seed, stream, request_id), stable across runs and processes.

    ``hash(str)`` is salted per process, so it cannot be used for reproducible traces.
    """
    data = f"{seed}\x00{stream}\x00{request_id}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class _Req:
    """Mutable per-request state, private to the engine."""

    __slots__ = (
        "req",
        "rid",
        "prompt",
        "prompt_len",
        "target_len",
        "finish_reason",
        "output",
        "num_computed",
        "decoding",
        "blocks",
        "block_hashes",
        "num_registered",
        "arrival_s",
        "scheduled_s",
        "first_token_s",
        "num_cached_tokens",
        "cached_reported",
        "num_preemptions",
        "num_sent",
        "pending_steps",
        "tok_rng",
        "spec_rng",
        "live",
    )

    def __init__(
        self, req: EngineRequest, target_len: int, finish_reason: str, now_s: float, seed: int
    ) -> None:
        self.req = req
        self.rid = req.request_id
        self.prompt = req.prompt_token_ids
        self.prompt_len = len(req.prompt_token_ids)
        self.target_len = target_len
        self.finish_reason = finish_reason
        self.output: list[int] = []
        # Tokens whose KV is in the cache. Decoding: num_computed == num_tokens - 1 (the last
        # sampled token is computed by the next step).
        self.num_computed = 0
        # True once a step since the last (re)admission sampled a token: the next step is a
        # decode with speculative drafts, not a prefill chunk.
        self.decoding = False
        self.blocks: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks known so far
        self.num_registered = 0  # leading blocks of self.blocks already in the prefix cache
        self.arrival_s = now_s
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.num_cached_tokens = 0
        self.cached_reported = False
        self.num_preemptions = 0
        self.num_sent = 0  # output tokens already made visible
        self.pending_steps: list[float] = []  # step end instants of not yet visible tokens
        # Separate streams so token ids never depend on how drafts were trimmed by the budget.
        key = req.request_id if req.sampling_key is None else req.sampling_key
        self.tok_rng = random.Random(_stable_seed(seed, key, "tokens"))
        self.spec_rng = random.Random(_stable_seed(seed, req.request_id, "spec"))
        self.live = True

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output)


class EngineModel:
    """A vLLM-v1-like continuous-batching engine whose only output is timing (module doc)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._bs = config.block_size
        self._k = config.num_speculative_tokens
        self._requests: dict[str, _Req] = {}
        self._running: list[_Req] = []  # admission order; preemption pops from the end
        # Waiting requests; aborted ones are dropped lazily when they reach the front, so an
        # abort storm costs O(1) each instead of O(queue).
        self._waiting: deque[_Req] = deque()
        self._num_waiting = 0
        # Block pool: reference counts, the prefix hash a block holds (or None), and the free
        # queue in eviction order (head evicted first). OrderedDict gives O(1) pop-head,
        # append and removal from the middle (a cache hit on a free block).
        n = config.num_gpu_blocks
        self._ref = [0] * n
        self._block_hash: list[int | None] = [None] * n
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))
        self._hash_to_block: dict[int, int] = {}
        # Counters.
        self._preemptions = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._prompt_tokens = 0
        self._prompt_tokens_cached = 0
        self._generation_tokens = 0
        self._success: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self._spec_drafts = 0
        self._spec_draft_tokens = 0
        self._spec_accepted = 0
        self._spec_accepted_per_pos = [0] * self._k
        self._steps = 0

    # ------------------------------------------------------------------ requests in and out

    def _target(self, request: EngineRequest) -> tuple[int, str]:
        """Output length and finish reason (module docstring, "Output length")."""
        cfg = self.config
        cap = max(1, min(request.max_tokens, cfg.max_model_len - len(request.prompt_token_ids)))
        if request.ignore_eos:
            return cap, "length"
        if request.natural_length is not None:
            n = max(1, request.natural_length)
        else:
            key = request.request_id if request.sampling_key is None else request.sampling_key
            rng = random.Random(_stable_seed(cfg.seed, key, "length"))
            draw = rng.lognormvariate(math.log(cfg.natural_length_median), cfg.natural_length_sigma)
            n = max(1, round(draw)) if math.isfinite(draw) else cap
        n = max(n, request.min_tokens)
        if n >= cap:
            return cap, "length"
        return n, "stop"

    def validate(self, request: EngineRequest) -> None:
        """ADDED. Raise ValueError if ``add_request`` would refuse this request."""
        cfg = self.config
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("the prompt must contain at least one token")
        if prompt_len > cfg.max_model_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens is longer than max_model_len ({cfg.max_model_len})"
            )
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if request.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {request.min_tokens}")
        if request.min_tokens > request.max_tokens:
            raise ValueError(
                f"min_tokens ({request.min_tokens}) must be <= max_tokens ({request.max_tokens})"
            )
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        # The most KV the request can ever hold: all but its last token computed, plus the
        # speculative lookahead slots of its last decode step.
        length, _ = self._target(request)
        most_tokens = prompt_len + length - 1 + self._k
        blocks = -(-most_tokens // self._bs)
        if blocks > cfg.num_gpu_blocks:
            raise ValueError(
                f"request needs up to {blocks} KV blocks ({most_tokens} tokens) but the cache "
                f"only has {cfg.num_gpu_blocks} blocks of {self._bs} tokens"
            )

    def add_request(self, request: EngineRequest, now_s: float) -> None:
        self.validate(request)
        length, reason = self._target(request)
        state = _Req(request, length, reason, now_s, self.config.seed)
        if self.config.enable_prefix_caching:
            # Hash the prompt's full blocks once here, so admission only does dict lookups.
            self._extend_hashes(state, state.prompt_len // self._bs)
        self._requests[request.request_id] = state
        self._waiting.append(state)
        self._num_waiting += 1

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Remove a request now and free its blocks; no "abort" output is produced.

        Returns True if the request was live (ADDED; the contract returned nothing). ADDED:
        ``reason`` "stop" for a request its stop string ended (counted as a stop, as vLLM's
        output processor finishes it).
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        state.live = False
        if state.blocks:
            self._running.remove(state)
            self._free_blocks(state)
        elif state in self._running:
            self._running.remove(state)
        else:
            self._num_waiting -= 1  # stays in the deque until it reaches the front
        self._success[reason] += 1
        return True

    def has_work(self) -> bool:
        return bool(self._running) or self._num_waiting > 0

    # ------------------------------------------------------------------ block pool

    def _allocate(self, state: _Req, count: int) -> None:
        """Give ``state`` ``count`` blocks from the free queue's head, evicting cached ones."""
        free = self._free
        for _ in range(count):
            block, _ = free.popitem(last=False)
            h = self._block_hash[block]
            if h is not None:
                if self._hash_to_block.get(h) == block:
                    del self._hash_to_block[h]
                self._block_hash[block] = None
            self._ref[block] = 1
            state.blocks.append(block)

    def _free_blocks(self, state: _Req) -> None:
        # Tail blocks first, so a request's last blocks are evicted before its prefix (vLLM).
        for block in reversed(state.blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
        state.blocks = []
        state.num_registered = 0

    def _block_tokens(self, state: _Req, j: int) -> tuple[int, ...]:
        bs = self._bs
        start, end = j * bs, (j + 1) * bs
        p = state.prompt_len
        if end <= p:
            return state.prompt[start:end]
        if start >= p:
            return tuple(state.output[start - p : end - p])
        return state.prompt[start:] + tuple(state.output[: end - p])

    def _extend_hashes(self, state: _Req, num_blocks: int) -> None:
        hashes = state.block_hashes
        parent = hashes[-1] if hashes else _ROOT_HASH
        for j in range(len(hashes), num_blocks):
            parent = hash((parent, self._block_tokens(state, j)))
            hashes.append(parent)

    def _register_full_blocks(self, state: _Req) -> None:
        full = min(state.num_computed // self._bs, len(state.blocks))
        if full <= state.num_registered:
            return
        self._extend_hashes(state, full)
        for j in range(state.num_registered, full):
            h = state.block_hashes[j]
            block = state.blocks[j]
            # A block whose contents another block already caches stays unregistered (a plain
            # block); the one mapping per hash keeps the cache bounded by num_gpu_blocks.
            if h not in self._hash_to_block and self._block_hash[block] is None:
                self._hash_to_block[h] = block
                self._block_hash[block] = h
        state.num_registered = full

    def _cached_prefix(self, state: _Req) -> list[int]:
        """Blocks of the longest cached run of leading full blocks (at most num_tokens - 1)."""
        max_blocks = (state.num_tokens - 1) // self._bs
        self._extend_hashes(state, max_blocks)
        hits: list[int] = []
        lookup = self._hash_to_block
        for j in range(max_blocks):
            block = lookup.get(state.block_hashes[j])
            if block is None:
                break
            hits.append(block)
        return hits

    # ------------------------------------------------------------------ the step

    def _preempt(self, victim: _Req) -> None:
        self._free_blocks(victim)
        victim.num_computed = 0
        victim.decoding = False
        victim.num_preemptions += 1
        self._preemptions += 1
        # The front: it was admitted before everything still waiting.
        self._waiting.appendleft(victim)
        self._num_waiting += 1

    def step(self, now_s: float) -> StepResult:
        cfg = self.config
        if not self.has_work():
            # The caller should not ask, but an idle step must still take time (no busy loop).
            return StepResult(duration_s=cfg.step_floor_s, outputs=())
        # (request, tokens scheduled, whether it was a decode step for it)
        scheduled: list[tuple[_Req, int, bool]] = []
        budget, prefill_tokens, decode_tokens, preempted = self._schedule_running(scheduled)
        if not preempted:
            # Waiting requests only if this step preempted nobody (vLLM does the same:
            # admitting work while evicting other work would thrash).
            prefill_tokens += self._schedule_waiting(scheduled, budget, now_s)
        self._steps += 1
        total = prefill_tokens + decode_tokens
        duration = cfg.step_duration_s(total)
        outputs = self._run_scheduled(scheduled, now_s + duration)
        return StepResult(
            duration_s=duration,
            outputs=tuple(outputs),
            num_batched_tokens=total,
            num_prefill_tokens=prefill_tokens,
            num_decode_tokens=decode_tokens,
            num_preemptions=preempted,
        )

    def _schedule_running(
        self, scheduled: list[tuple[_Req, int, bool]]
    ) -> tuple[int, int, int, int]:
        """Schedule the running requests first, preempting from the back when blocks run out.

        Returns (token budget left, prefill tokens, decode tokens, requests preempted).
        """
        bs = self._bs
        k = self._k
        budget = self.config.max_num_batched_tokens
        running = self._running
        free = self._free
        prefill_tokens = 0
        decode_tokens = 0
        preempted = 0
        i = 0
        while i < len(running) and budget > 0:
            state = running[i]
            decoding = state.decoding
            want = 1 + k if decoding else state.num_tokens - state.num_computed
            num_new = want if want <= budget else budget
            need = -(-(state.num_computed + num_new) // bs) - len(state.blocks)
            can_run = True
            while need > len(free):
                victim = running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is state:
                    can_run = False
                    break
            if not can_run:
                break
            if need > 0:
                self._allocate(state, need)
            scheduled.append((state, num_new, decoding))
            if decoding:
                decode_tokens += num_new
            else:
                prefill_tokens += num_new
            budget -= num_new
            i += 1
        return budget, prefill_tokens, decode_tokens, preempted

    def _schedule_waiting(
        self, scheduled: list[tuple[_Req, int, bool]], budget: int, now_s: float
    ) -> int:
        """Admit waiting requests, FCFS, while budget, sequences and blocks allow; returns the
        prefill tokens scheduled for them."""
        cfg = self.config
        bs = self._bs
        running = self._running
        free = self._free
        waiting = self._waiting
        caching = cfg.enable_prefix_caching
        prefill_tokens = 0
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            state = waiting[0]
            if not state.live:
                waiting.popleft()
                continue
            hits = self._cached_prefix(state) if caching else []
            num_computed = len(hits) * bs
            num_new = state.num_tokens - num_computed
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break
                num_new = budget
            need = -(-(num_computed + num_new) // bs) - len(hits)
            # Hit blocks nobody holds are in the free queue: touching them removes them.
            evictable_hits = sum(1 for b in hits if self._ref[b] == 0)
            if need > len(free) - evictable_hits:
                break
            waiting.popleft()
            self._num_waiting -= 1
            for b in hits:
                if self._ref[b] == 0:
                    del free[b]
                self._ref[b] += 1
            state.blocks = hits
            state.num_registered = len(hits)
            state.num_computed = num_computed
            self._allocate(state, need)
            if state.scheduled_s is None:
                # First admission: the only one that counts for cache stats and for
                # num_cached_tokens (vLLM sets request.num_cached_tokens once).
                state.scheduled_s = now_s
                state.num_cached_tokens = num_computed
                if caching:
                    self._prefix_queries += state.num_tokens
                    self._prefix_hits += num_computed
            running.append(state)
            scheduled.append((state, num_new, False))
            prefill_tokens += num_new
            budget -= num_new
        return prefill_tokens

    def _run_scheduled(
        self, scheduled: list[tuple[_Req, int, bool]], end_s: float
    ) -> list[RequestOutput]:
        """What the step computed for each scheduled request, visible at ``end_s``: tokens
        sampled (speculative drafts accepted or not), finished requests freed, and an output
        per request that has something to show under the stream interval."""
        cfg = self.config
        bs = self._bs
        running = self._running
        outputs: list[RequestOutput] = []
        finished_any = False
        caching = cfg.enable_prefix_caching
        interval = cfg.stream_interval
        token_lo = _FIRST_TOKEN_ID
        token_span = cfg.vocab_size - _FIRST_TOKEN_ID
        for state, num_new, decoding in scheduled:
            out = state.output
            if decoding:
                drafts = num_new - 1
                produced = 1 + self._accept_drafts(state, drafts) if drafts > 0 else 1
            else:
                state.num_computed += num_new
                if state.num_computed < state.prompt_len + len(out):
                    # A prefill chunk that does not finish the prompt: nothing to show.
                    if caching and state.num_computed // bs > state.num_registered:
                        self._register_full_blocks(state)
                    continue
                produced = 1  # prefill (or recompute) complete: sample a token
                state.decoding = True
            remaining = state.target_len - len(out)
            if produced > remaining:
                produced = remaining
            if decoding:
                # The last token and the kept drafts are now computed; the KV of rejected (or
                # past-the-end) draft slots is rolled back, so num_tokens == num_computed + 1.
                state.num_computed += produced
            if state.first_token_s is None:
                state.first_token_s = end_s
                self._prompt_tokens += state.prompt_len
                self._prompt_tokens_cached += state.num_cached_tokens
            # Uniform ids in [3, vocab_size); random() * span stays far below 2**53, so the
            # truncation is unbiased enough and much cheaper than randrange.
            tok_random = state.tok_rng.random
            if produced == 1:
                out.append(token_lo + int(tok_random() * token_span))
            else:
                out.extend(token_lo + int(tok_random() * token_span) for _ in range(produced))
            self._generation_tokens += produced
            state.pending_steps.append(end_s)
            num_out = len(out)
            finished = num_out >= state.target_len
            if finished and state.finish_reason == "stop":
                out[-1] = EOS_TOKEN_ID  # drawn all the same, so the other ids do not move
            if caching and state.num_computed // bs > state.num_registered:
                # Finished requests too: their full blocks are worth keeping for a next turn.
                self._register_full_blocks(state)
            sent = state.num_sent
            if finished or sent == 0 or num_out - sent >= interval:
                outputs.append(self._output(state, finished))
            if finished:
                finished_any = True
                state.live = False
                self._free_blocks(state)
                del self._requests[state.rid]
                self._success[state.finish_reason] += 1
        if finished_any:
            self._running = [s for s in running if s.live]
        return outputs

    def _accept_drafts(self, state: _Req, drafts: int) -> int:
        """How many of a decode step's ``drafts`` speculative tokens are accepted: each in turn
        with the configured probability, until the first rejection."""
        p_accept = self.config.spec_acceptance
        per_pos = self._spec_accepted_per_pos
        spec_random = state.spec_rng.random
        accepted = 0
        while accepted < drafts and spec_random() < p_accept:
            per_pos[accepted] += 1
            accepted += 1
        self._spec_drafts += 1
        self._spec_draft_tokens += drafts
        self._spec_accepted += accepted
        return accepted

    def _output(self, state: _Req, finished: bool) -> RequestOutput:
        """What the request shows now: its tokens since the last output, and the step end
        instants that made them."""
        cached = 0
        if not state.cached_reported:
            cached = state.num_cached_tokens
            state.cached_reported = True
        out = state.output
        output = RequestOutput(
            request_id=state.rid,
            new_token_ids=tuple(out[state.num_sent :]),
            finished=finished,
            finish_reason=state.finish_reason if finished else None,
            num_cached_tokens=cached,
            arrival_s=state.arrival_s,
            scheduled_s=state.scheduled_s,
            first_token_s=state.first_token_s,
            num_preemptions=state.num_preemptions,
            step_times_s=tuple(state.pending_steps),
        )
        state.num_sent = len(out)
        state.pending_steps = []
        return output

    # ------------------------------------------------------------------ observability

    def stats(self) -> EngineStats:
        n = self.config.num_gpu_blocks
        return EngineStats(
            num_running=len(self._running),
            num_waiting=self._num_waiting,
            kv_cache_usage=(n - len(self._free)) / n,
            num_preemptions_total=self._preemptions,
            prefix_cache_queries_total=self._prefix_queries,
            prefix_cache_hits_total=self._prefix_hits,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            prompt_tokens_cached_total=self._prompt_tokens_cached,
            request_success_total=dict(self._success),
            spec_decode_num_drafts_total=self._spec_drafts,
            spec_decode_num_draft_tokens_total=self._spec_draft_tokens,
            spec_decode_num_accepted_tokens_total=self._spec_accepted,
            spec_decode_num_accepted_tokens_per_pos=tuple(self._spec_accepted_per_pos),
            num_steps_total=self._steps,
            num_free_blocks=len(self._free),
            num_cached_blocks=len(self._hash_to_block),
        )

    def check_invariants(self) -> None:
        """ADDED. Verify the block accounting; O(num_gpu_blocks), meant for tests only."""
        counts = [0] * self.config.num_gpu_blocks
        for state in self._running:
            for b in state.blocks:
                counts[b] += 1
            if len(state.blocks) * self._bs < state.num_computed:
                raise AssertionError(f"{state.rid}: fewer block slots than computed tokens")
        for state in self._waiting:
            if state.live and state.blocks:
                raise AssertionError(f"{state.rid}: waiting request holds blocks")
        if counts != self._ref:
            raise AssertionError("reference counts disagree with the blocks requests hold")
        for b in range(self.config.num_gpu_blocks):
            if (self._ref[b] == 0) != (b in self._free):
                raise AssertionError(f"block {b}: free-queue membership disagrees with refcount")
        for h, b in self._hash_to_block.items():
            if self._block_hash[b] != h:
                raise AssertionError(f"block {b}: hash map entry disagrees with the block")
        live_waiting = sum(1 for s in self._waiting if s.live)
        if live_waiting != self._num_waiting:
            raise AssertionError("waiting counter disagrees with the queue")
        if len(self._running) > self.config.max_num_seqs:
            raise AssertionError("more running requests than max_num_seqs")
