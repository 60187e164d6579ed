"""Tests of the simulated engine's timing model (sidecar/sim/engine.py).

Expected numbers are worked out by hand from the rules in the module docstring; the defaults
give an 8 ms step floor, a 512-token knee and 15 us per token above it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.sim.engine import (
    EOS_TOKEN_ID,
    EngineConfig,
    EngineModel,
    EngineRequest,
    RequestOutput,
    StepResult,
)

FLOOR = 0.008
PER_TOKEN = 0.000015


def prompt(n: int, start: int = 1000) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def req(
    rid: str,
    n_prompt: int = 10,
    max_tokens: int = 5,
    *,
    ignore_eos: bool = True,
    tokens: tuple[int, ...] | None = None,
    min_tokens: int = 0,
    natural_length: int | None = None,
) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=tokens if tokens is not None else prompt(n_prompt),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        natural_length=natural_length,
    )


@dataclasses.dataclass
class Trace:
    """What a driver saw: every step (start, result) and every output with its delivery time."""

    steps: list[tuple[float, StepResult]]
    outputs: list[tuple[float, RequestOutput]]

    def of(self, rid: str) -> list[tuple[float, RequestOutput]]:
        return [(t, o) for t, o in self.outputs if o.request_id == rid]

    def tokens(self, rid: str) -> list[int]:
        return [tok for _, o in self.of(rid) for tok in o.new_token_ids]

    def chunks(self, rid: str) -> list[int]:
        return [len(o.new_token_ids) for _, o in self.of(rid)]

    def times(self, rid: str) -> list[float]:
        return [t for t, _ in self.of(rid)]

    def durations(self) -> list[float]:
        return [r.duration_s for _, r in self.steps]


def drive(
    model: EngineModel,
    arrivals: Sequence[tuple[float, EngineRequest]],
    *,
    max_steps: int = 100_000,
    check: bool = False,
) -> Trace:
    """Run the model like the server would: add arrivals due by each step's start, step, sleep."""
    pending = sorted(arrivals, key=lambda a: a[0])
    trace = Trace([], [])
    now = 0.0
    i = 0
    for _ in range(max_steps):
        while i < len(pending) and pending[i][0] <= now + 1e-12:
            model.add_request(pending[i][1], pending[i][0])
            i += 1
        if not model.has_work():
            if i == len(pending):
                return trace
            now = pending[i][0]
            continue
        result = model.step(now)
        trace.steps.append((now, result))
        now += result.duration_s
        trace.outputs.extend((now, o) for o in result.outputs)
        if check:
            model.check_invariants()
            usage = model.stats().kv_cache_usage
            assert 0.0 <= usage <= 1.0
    raise AssertionError(f"still busy after {max_steps} steps")


# ---------------------------------------------------------------------------- timing basics


def test_single_request_exact_steps_durations_and_emission_times() -> None:
    model = EngineModel(EngineConfig())
    trace = drive(model, [(0.0, req("a", 100, 5))])
    # Step 1 prefills 100 tokens (< 512: the floor) and samples token 1; steps 2..5 decode one
    # token each at the floor.
    assert [r.num_batched_tokens for _, r in trace.steps] == [100, 1, 1, 1, 1]
    assert trace.durations() == pytest.approx([FLOOR] * 5)
    assert trace.times("a") == pytest.approx([0.008, 0.016, 0.024, 0.032, 0.040])
    assert trace.chunks("a") == [1, 1, 1, 1, 1]
    outs = [o for _, o in trace.of("a")]
    assert [o.finished for o in outs] == [False] * 4 + [True]
    assert outs[-1].finish_reason == "length"
    assert all(o.finish_reason is None for o in outs[:-1])
    assert outs[0].arrival_s == 0.0 and outs[0].scheduled_s == 0.0
    assert outs[0].first_token_s == pytest.approx(0.008)
    assert [len(o.step_times_s) for o in outs] == [1] * len(outs)
    assert [o.step_times_s[0] for o in outs] == pytest.approx(trace.times("a"))
    assert not model.has_work()
    stats = model.stats()
    assert stats.prompt_tokens_total == 100
    assert stats.generation_tokens_total == 5
    assert stats.request_success_total == {"stop": 0, "length": 1, "abort": 0}
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert stats.num_steps_total == 5


def test_arrival_and_queue_instants_are_reported_in_callers_time_base() -> None:
    model = EngineModel(EngineConfig())
    model.add_request(req("a", 100, 2), 5.0)
    result = model.step(5.25)  # the server's loop noticed it a bit later
    (out,) = result.outputs
    assert out.arrival_s == 5.0
    assert out.scheduled_s == 5.25
    assert out.first_token_s == pytest.approx(5.25 + FLOOR)


def test_two_requests_arriving_together_decode_in_the_same_steps() -> None:
    model = EngineModel(EngineConfig())
    trace = drive(model, [(0.0, req("a", 100, 3)), (0.0, req("b", 100, 3))])
    assert [r.num_batched_tokens for _, r in trace.steps] == [200, 2, 2]
    assert [[o.request_id for o in r.outputs] for _, r in trace.steps] == [["a", "b"]] * 3
    assert trace.times("a") == trace.times("b") == pytest.approx([0.008, 0.016, 0.024])


def test_step_time_follows_the_roofline_formula() -> None:
    cfg = EngineConfig()
    assert cfg.step_duration_s(1) == FLOOR
    assert cfg.step_duration_s(512) == FLOOR
    assert cfg.step_duration_s(513) == pytest.approx(FLOOR + PER_TOKEN)
    # The defaults' advertised shape: a 2000-token prefill takes ~30 ms.
    assert cfg.step_duration_s(2000) == pytest.approx(0.008 + 1488 * 0.000015)
    assert 0.030 <= cfg.step_duration_s(2000) <= 0.040


def test_long_prompt_is_chunked_over_the_token_budget() -> None:
    model = EngineModel(EngineConfig())  # budget 8192
    trace = drive(model, [(0.0, req("a", 10_000, 1))])
    assert [r.num_batched_tokens for _, r in trace.steps] == [8192, 1808]
    assert [r.num_prefill_tokens for _, r in trace.steps] == [8192, 1808]
    step1 = 0.008 + (8192 - 512) * 0.000015  # 123.2 ms
    step2 = 0.008 + (1808 - 512) * 0.000015  # 27.44 ms
    assert trace.durations() == pytest.approx([step1, step2])
    # The first chunk produces no output; the token comes at the end of the second step.
    assert trace.steps[0][1].outputs == ()
    assert trace.times("a") == pytest.approx([step1 + step2])
    (out,) = [o for _, o in trace.of("a")]
    assert out.first_token_s == pytest.approx(0.15064)
    assert out.finished and out.finish_reason == "length"


def _chunking_scenario(chunked: bool) -> Trace:
    # A decodes and takes 1 token of the 1024 budget each step; B's 1024-token prompt arrives
    # after A's prefill.
    cfg = EngineConfig(
        max_num_batched_tokens=1024, max_model_len=1024, enable_chunked_prefill=chunked
    )
    model = EngineModel(cfg)
    return drive(model, [(0.0, req("a", 10, 3)), (0.008, req("b", 1024, 1))])


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room_for_all_of_it() -> None:
    trace = _chunking_scenario(chunked=False)
    # Steps: A prefill | A decode (B needs 1024 > 1023 left) | A decode, A done | B whole.
    assert [r.num_batched_tokens for _, r in trace.steps] == [10, 1, 1, 1024]
    b_step = 0.008 + 512 * 0.000015
    assert trace.times("a") == pytest.approx([0.008, 0.016, 0.024])
    assert trace.times("b") == pytest.approx([0.024 + b_step])
    (out,) = [o for _, o in trace.of("b")]
    assert out.scheduled_s == pytest.approx(0.024)
    assert out.arrival_s == pytest.approx(0.008)


def test_with_chunked_prefill_the_same_prompt_is_split_across_steps() -> None:
    trace = _chunking_scenario(chunked=True)
    # Step 2: A decode (1) + B chunk (1023); step 3: A decode + B's last token (2 tokens).
    assert [r.num_batched_tokens for _, r in trace.steps] == [10, 1024, 2]
    step2 = 0.008 + 512 * 0.000015
    assert trace.times("a") == pytest.approx([0.008, 0.008 + step2, 0.016 + step2])
    assert trace.times("b") == pytest.approx([0.016 + step2])
    (out,) = [o for _, o in trace.of("b")]
    assert out.scheduled_s == pytest.approx(0.008)


def test_config_without_chunking_requires_budget_for_a_whole_context() -> None:
    with pytest.raises(ValueError, match="chunked prefill disabled"):
        EngineConfig(enable_chunked_prefill=False)  # 8192 < 32768


def test_max_num_seqs_makes_the_third_request_wait() -> None:
    model = EngineModel(EngineConfig(max_num_seqs=2))
    for rid in "abc":
        model.add_request(req(rid, 10, 2), 0.0)
    r1 = model.step(0.0)
    assert [o.request_id for o in r1.outputs] == ["a", "b"]
    stats = model.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    r2 = model.step(0.008)  # A and B finish in this step, C still could not be admitted
    assert [(o.request_id, o.finished) for o in r2.outputs] == [("a", True), ("b", True)]
    assert r2.num_batched_tokens == 2
    assert (model.stats().num_running, model.stats().num_waiting) == (0, 1)
    r3 = model.step(0.016)
    (c1,) = r3.outputs
    assert c1.request_id == "c" and c1.scheduled_s == pytest.approx(0.016)
    assert c1.first_token_s == pytest.approx(0.024)
    r4 = model.step(0.024)
    assert [(o.request_id, o.finished) for o in r4.outputs] == [("c", True)]
    assert not model.has_work()


def test_idle_step_takes_the_floor_and_outputs_nothing() -> None:
    model = EngineModel(EngineConfig())
    result = model.step(1.0)
    assert result.duration_s == FLOOR
    assert result.outputs == ()
    assert result.num_batched_tokens == 0


# ---------------------------------------------------------------------------- KV cache


def _kv_small() -> EngineConfig:
    # 8 blocks of 4 tokens = 32 token slots; no prefix cache so block counts are plain.
    return EngineConfig(block_size=4, num_gpu_blocks=8, enable_prefix_caching=False)


def test_kv_exhaustion_preempts_the_newest_request_which_still_emits_its_exact_tokens() -> None:
    model = EngineModel(_kv_small())
    trace = drive(model, [(0.0, req("a", 8, 12)), (0.0, req("b", 8, 12))], check=True)
    # Hand-worked: each holds ceil(computed/4) blocks. Step 1: 2+2; step 2: 3+3; step 6: 4+4.
    # Step 10: A needs a 5th block, none free -> B (admitted last) is preempted; 1 + 4 free.
    # Steps 11-12: B (17 tokens to recompute, 5 blocks) does not fit beside A's 5 blocks.
    # Step 12: A finishes. Step 13: B re-prefills 8 prompt + 9 generated tokens, samples its
    # 10th token; steps 14, 15: tokens 11, 12.
    assert len(trace.steps) == 15
    assert [r.num_preemptions for _, r in trace.steps].index(1) == 9
    assert sum(r.num_preemptions for _, r in trace.steps) == 1
    assert [r.num_batched_tokens for _, r in trace.steps] == ([16] + [2] * 8 + [1, 1, 1, 17, 1, 1])
    assert trace.durations() == pytest.approx([FLOOR] * 15)
    assert trace.times("a") == pytest.approx([0.008 * s for s in range(1, 13)])
    expected_b = [0.008 * s for s in range(1, 10)] + [0.104, 0.112, 0.120]
    assert trace.times("b") == pytest.approx(expected_b)
    b_outs = [o for _, o in trace.of("b")]
    assert [o.num_preemptions for o in b_outs] == [0] * 9 + [1] * 3
    assert b_outs[-1].finished and b_outs[-1].finish_reason == "length"
    assert model.stats().num_preemptions_total == 1
    # Exactly its tokens, in order, no duplicates: the same as B running alone.
    alone = drive(EngineModel(_kv_small()), [(0.0, req("b", 8, 12))])
    assert trace.tokens("b") == alone.tokens("b")
    assert len(trace.tokens("b")) == 12
    assert trace.tokens("a") == drive(EngineModel(_kv_small()), [(0.0, req("a", 8, 12))]).tokens(
        "a"
    )
    assert model.stats().kv_cache_usage == 0.0


def test_preempted_request_goes_back_in_front_of_earlier_waiting_requests() -> None:
    # As in the test above, plus C (4-token prompt, 1 block) arriving at 50 ms, when the cache
    # is full (from step 6). Step 10 preempts B; B (front) does not fit in steps 11-12, and
    # FCFS keeps C behind it. Step 13 (starting at 96 ms) admits B, then C.
    model = EngineModel(_kv_small())
    arrivals = [(0.0, req("a", 8, 12)), (0.0, req("b", 8, 12)), (0.05, req("c", 4, 1))]
    trace = drive(model, arrivals, check=True)
    (c_out,) = [o for _, o in trace.of("c")]
    assert c_out.arrival_s == 0.05
    assert c_out.scheduled_s == pytest.approx(0.096)
    assert c_out.first_token_s == pytest.approx(0.104)
    assert trace.times("b")[9] == pytest.approx(0.104)


def test_a_step_that_preempts_admits_nobody() -> None:
    # With a 4-token budget B can come back with a 1-block chunk as soon as it is preempted;
    # vLLM (and this model) wait for the next step rather than thrash.
    cfg = dataclasses.replace(_kv_small(), max_num_batched_tokens=4)
    model = EngineModel(cfg)
    trace = drive(model, [(0.0, req("a", 8, 12)), (0.0, req("b", 8, 12))], check=True)
    preempting = [i for i, (_, r) in enumerate(trace.steps) if r.num_preemptions]
    assert preempting
    for i in preempting:
        assert trace.steps[i][1].num_prefill_tokens == 0
        assert trace.steps[i + 1][1].num_prefill_tokens > 0  # back on the next step
    assert len(trace.tokens("b")) == 12
    alone = drive(EngineModel(cfg), [(0.0, req("b", 8, 12))])
    assert trace.tokens("b") == alone.tokens("b")


def test_kv_usage_gauge_counts_held_blocks() -> None:
    model = EngineModel(_kv_small())
    model.add_request(req("a", 8, 12), 0.0)
    model.step(0.0)
    assert model.stats().kv_cache_usage == pytest.approx(2 / 8)
    model.step(0.008)  # the 9th token gets its slot: a 3rd block
    assert model.stats().kv_cache_usage == pytest.approx(3 / 8)


def test_waiting_request_is_admitted_only_when_its_blocks_fit() -> None:
    model = EngineModel(_kv_small())
    model.add_request(req("a", 24, 3), 0.0)  # 6 blocks
    model.add_request(req("b", 12, 1), 0.0)  # 3 blocks: 6 + 3 > 8
    r1 = model.step(0.0)
    assert [o.request_id for o in r1.outputs] == ["a"]
    assert model.stats().num_waiting == 1


def test_abort_frees_blocks_and_removes_the_request() -> None:
    model = EngineModel(_kv_small())
    model.add_request(req("a", 8, 12), 0.0)
    model.add_request(req("b", 8, 12), 0.0)
    model.step(0.0)
    assert model.stats().kv_cache_usage == pytest.approx(4 / 8)
    assert model.abort_request("a") is True
    assert model.stats().kv_cache_usage == pytest.approx(2 / 8)
    assert model.stats().num_running == 1
    result = model.step(0.008)
    assert [o.request_id for o in result.outputs] == ["b"]
    assert model.abort_request("a") is False  # already gone
    assert model.abort_request("nobody") is False
    assert model.abort_request("b") is True
    assert model.stats().kv_cache_usage == 0.0
    assert not model.has_work()
    assert model.stats().request_success_total["abort"] == 2
    model.check_invariants()


def test_abort_of_a_waiting_request_lets_the_next_one_in() -> None:
    model = EngineModel(EngineConfig(max_num_seqs=1))
    for rid in "abc":
        model.add_request(req(rid, 10, 1), 0.0)
    assert model.abort_request("b") is True
    assert model.stats().num_waiting == 2
    assert [o.request_id for o in model.step(0.0).outputs] == ["a"]
    assert [o.request_id for o in model.step(0.008).outputs] == ["c"]
    assert not model.has_work()
    # The id can be used again once it is gone.
    model.add_request(req("b", 10, 1), 0.016)
    assert [o.request_id for o in model.step(0.016).outputs] == ["b"]


# ---------------------------------------------------------------------------- prefix cache


def test_identical_prompt_hits_the_cache_and_gets_its_first_token_sooner() -> None:
    model = EngineModel(EngineConfig())
    first = 0.008 + (2000 - 512) * 0.000015  # 30.32 ms for the full prefill
    trace = drive(model, [(0.0, req("a", 2000, 1)), (first, req("b", 2000, 1))])
    (a_out,) = [o for _, o in trace.of("a")]
    (b_out,) = [o for _, o in trace.of("b")]
    assert a_out.num_cached_tokens == 0
    # At most num_tokens - 1 can hit, in whole blocks: (1999 // 16) * 16 = 1984; 16 computed.
    assert b_out.num_cached_tokens == 1984
    assert [r.num_batched_tokens for _, r in trace.steps] == [2000, 16]
    assert a_out.first_token_s is not None and a_out.scheduled_s is not None
    assert b_out.first_token_s is not None and b_out.scheduled_s is not None
    # TTFT from scheduling: the full prefill for A, one floor step for B's 16 tokens.
    assert a_out.first_token_s - a_out.scheduled_s == pytest.approx(first)
    assert b_out.first_token_s - b_out.scheduled_s == pytest.approx(FLOOR)
    stats = model.stats()
    assert stats.prefix_cache_queries_total == 4000
    assert stats.prefix_cache_hits_total == 1984
    assert stats.prompt_tokens_cached_total == 1984
    assert stats.prompt_tokens_total == 4000


def test_prompt_of_whole_blocks_leaves_its_last_block_to_compute() -> None:
    model = EngineModel(EngineConfig())
    drive(model, [(0.0, req("a", 32, 1)), (1.0, req("b", 32, 1))])
    assert model.stats().prefix_cache_hits_total == 16  # (31 // 16) * 16


def test_shared_prefix_hits_up_to_the_first_differing_block() -> None:
    shared = prompt(48)  # three full blocks
    a = req("a", tokens=shared + prompt(20, start=5000), max_tokens=1)
    b = req("b", tokens=shared + prompt(20, start=7000), max_tokens=1)
    trace = drive(EngineModel(EngineConfig()), [(0.0, a), (1.0, b)])
    (b_out,) = [o for _, o in trace.of("b")]
    assert b_out.num_cached_tokens == 48


def test_generated_tokens_are_cached_for_a_follow_up_turn() -> None:
    model = EngineModel(EngineConfig())
    trace = drive(model, [(0.0, req("a", 20, 30))])
    # Turn 2's prompt = turn 1's prompt + answer + 10 new tokens (62 tokens). The first 49
    # tokens (20 + 29 computed) were computed, so 3 full blocks (48 tokens) are cached.
    turn2 = prompt(20) + tuple(trace.tokens("a")) + prompt(10, start=9000)
    trace2 = drive(model, [(1.0, req("b", tokens=turn2, max_tokens=1))])
    (b_out,) = [o for _, o in trace2.of("b")]
    assert b_out.num_cached_tokens == 48


def test_cache_is_bounded_and_evicts_least_recently_freed_blocks() -> None:
    cfg = EngineConfig(block_size=4, num_gpu_blocks=4)
    model = EngineModel(cfg)
    drive(model, [(0.0, req("a", 9, 1))])  # 2 full blocks stay cached, 3rd was partial
    assert model.stats().num_cached_blocks == 2
    assert model.stats().kv_cache_usage == 0.0  # cached but unused blocks count as free
    # A 16-token prompt needs all 4 blocks: both cached blocks are evicted.
    drive(model, [(1.0, req("c", tokens=prompt(16, start=50_000), max_tokens=1))])
    assert model.stats().num_cached_blocks == 4  # C's prefill computed all 16 tokens
    drive(model, [(2.0, req("a2", 9, 1))])
    assert model.stats().prefix_cache_hits_total == 0
    model.check_invariants()


def test_cache_hit_on_blocks_that_are_in_use_shares_them() -> None:
    model = EngineModel(EngineConfig(block_size=4, num_gpu_blocks=8))
    model.add_request(req("a", 16, 10), 0.0)
    model.step(0.0)  # A computed 16 tokens: 4 blocks, all registered
    model.add_request(req("b", 16, 10), 0.008)
    result = model.step(0.008)
    b_out = next(o for o in result.outputs if o.request_id == "b")
    assert b_out.num_cached_tokens == 12
    # A grew a 5th block, B holds A's 3 shared blocks + 1 new: 4 + 1 + 1 = 6 distinct.
    assert model.stats().kv_cache_usage == pytest.approx(6 / 8)
    model.check_invariants()


def test_eviction_takes_the_least_recently_freed_blocks_first() -> None:
    model = EngineModel(EngineConfig(block_size=4, num_gpu_blocks=6))
    x = prompt(9, start=10_000)
    y = prompt(9, start=20_000)
    # Free queue, head first (blocks 0..5). X takes 0,1,2, caches 0,1 and frees tail-first:
    # [3,4,5,2,1,0]. Y takes 3,4,5, caches 3,4: [2,1,0,5,4,3]. Z (8 tokens) takes 2 and 1,
    # evicting X's second block: [0,5,4,3,1,2].
    drive(model, [(0.0, req("x", tokens=x, max_tokens=1))])
    drive(model, [(1.0, req("y", tokens=y, max_tokens=1))])
    drive(model, [(2.0, req("z", tokens=prompt(8, start=30_000), max_tokens=1))])
    # X again: its first block is still cached; its 2 new blocks (5, 4) evict Y's second.
    trace = drive(model, [(3.0, req("x2", tokens=x, max_tokens=1))])
    assert [o.num_cached_tokens for _, o in trace.of("x2")] == [4]
    trace = drive(model, [(4.0, req("y2", tokens=y, max_tokens=1))])
    assert [o.num_cached_tokens for _, o in trace.of("y2")] == [4]
    model.check_invariants()


def test_prefix_caching_disabled_counts_nothing() -> None:
    model = EngineModel(EngineConfig(enable_prefix_caching=False))
    trace = drive(model, [(0.0, req("a", 100, 1)), (1.0, req("b", 100, 1))])
    assert [r.num_batched_tokens for _, r in trace.steps] == [100, 100]
    stats = model.stats()
    assert stats.prefix_cache_queries_total == 0 and stats.prefix_cache_hits_total == 0


# ---------------------------------------------------------------------------- streaming


def test_stream_interval_buffers_tokens_after_the_first() -> None:
    model = EngineModel(EngineConfig(stream_interval=4))
    trace = drive(model, [(0.0, req("a", 10, 11))])
    assert len(trace.steps) == 11
    assert trace.chunks("a") == [1, 4, 4, 2]
    assert trace.times("a") == pytest.approx([0.008, 0.040, 0.072, 0.088])
    outs = [o for _, o in trace.of("a")]
    assert outs[1].step_times_s == pytest.approx((0.016, 0.024, 0.032, 0.040))
    assert outs[-1].finished and outs[-1].step_times_s == pytest.approx((0.080, 0.088))
    # The same tokens as unbuffered streaming, just grouped.
    plain = drive(EngineModel(EngineConfig()), [(0.0, req("a", 10, 11))])
    assert trace.tokens("a") == plain.tokens("a")


def test_num_cached_tokens_is_reported_on_the_first_output_only() -> None:
    model = EngineModel(EngineConfig())
    trace = drive(model, [(0.0, req("a", 40, 1)), (1.0, req("b", 40, 3))])
    assert [o.num_cached_tokens for _, o in trace.of("b")] == [32, 0, 0]


# ---------------------------------------------------------------------------- speculative decoding


def test_spec_decode_with_certain_acceptance_emits_k_plus_one_per_step() -> None:
    cfg = EngineConfig(num_speculative_tokens=3, spec_acceptance=1.0)
    model = EngineModel(cfg)
    trace = drive(model, [(0.0, req("a", 10, 9))])
    assert trace.chunks("a") == [1, 4, 4]
    assert [r.num_decode_tokens for _, r in trace.steps] == [0, 4, 4]
    assert trace.durations() == pytest.approx([FLOOR] * 3)
    stats = model.stats()
    assert stats.spec_decode_num_drafts_total == 2
    assert stats.spec_decode_num_draft_tokens_total == 6
    assert stats.spec_decode_num_accepted_tokens_total == 6
    assert stats.spec_decode_num_accepted_tokens_per_pos == (2, 2, 2)
    assert stats.generation_tokens_total == 9


def test_spec_decode_stops_at_max_tokens_mid_draft() -> None:
    model = EngineModel(EngineConfig(num_speculative_tokens=3, spec_acceptance=1.0))
    trace = drive(model, [(0.0, req("a", 10, 7))])
    assert trace.chunks("a") == [1, 4, 2]
    assert model.stats().generation_tokens_total == 7


def test_spec_decode_with_no_acceptance_still_pays_for_the_drafts() -> None:
    model = EngineModel(EngineConfig(num_speculative_tokens=3, spec_acceptance=0.0))
    trace = drive(model, [(0.0, req("a", 10, 4))])
    assert trace.chunks("a") == [1, 1, 1, 1]
    assert [r.num_batched_tokens for _, r in trace.steps] == [10, 4, 4, 4]
    assert model.stats().spec_decode_num_accepted_tokens_total == 0


def test_spec_drafts_are_trimmed_by_the_token_budget() -> None:
    cfg = EngineConfig(num_speculative_tokens=3, spec_acceptance=1.0, max_num_batched_tokens=2)
    model = EngineModel(cfg)
    trace = drive(model, [(0.0, req("a", 2, 5))])
    # Prefill 2 tokens -> 1; then each step has room for the last token and one draft -> 2.
    assert trace.chunks("a") == [1, 2, 2]
    assert model.stats().spec_decode_num_draft_tokens_total == 2


def _spec_trace(seed: int) -> list[tuple[float, str, tuple[int, ...]]]:
    cfg = EngineConfig(num_speculative_tokens=4, spec_acceptance=0.6, seed=seed)
    model = EngineModel(cfg)
    arrivals = [(0.002 * i, req(f"r{i}", 50 + i, 40)) for i in range(6)]
    trace = drive(model, arrivals)
    return [(t, o.request_id, o.new_token_ids) for t, o in trace.outputs]


def test_spec_decode_chunks_are_seeded_and_sum_to_max_tokens() -> None:
    a = _spec_trace(seed=7)
    assert a == _spec_trace(seed=7)
    assert a != _spec_trace(seed=8)
    for i in range(6):
        chunks = [len(toks) for _, rid, toks in a if rid == f"r{i}"]
        assert sum(chunks) == 40
        assert all(1 <= c <= 5 for c in chunks)
        assert any(c > 1 for c in chunks)  # p=0.6 over ~20 steps: several accepted drafts


# ---------------------------------------------------------------------------- lengths and tokens


def _finish(model: EngineModel, request: EngineRequest) -> tuple[int, str | None]:
    trace = drive(model, [(0.0, request)])
    outs = [o for _, o in trace.of(request.request_id)]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    return len(trace.tokens(request.request_id)), outs[-1].finish_reason


@pytest.mark.parametrize(
    ("max_tokens", "min_tokens", "natural", "ignore_eos", "expected"),
    [
        (10, 0, 5, False, (5, "stop")),
        (5, 0, 10, False, (5, "length")),
        (5, 0, 5, False, (5, "length")),  # vLLM checks the length cap before EOS
        (10, 6, 3, False, (6, "stop")),  # EOS blocked until min_tokens
        (6, 6, 3, False, (6, "length")),
        (7, 0, 3, True, (7, "length")),  # ignore_eos: exactly max_tokens
        (7, 0, 0, False, (1, "stop")),  # an immediate EOS is still one completion token
    ],
)
def test_length_rules(
    max_tokens: int, min_tokens: int, natural: int, ignore_eos: bool, expected: tuple[int, str]
) -> None:
    request = req(
        "a",
        10,
        max_tokens,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        natural_length=natural,
    )
    assert _finish(EngineModel(EngineConfig()), request) == expected


def test_max_model_len_caps_generation() -> None:
    model = EngineModel(EngineConfig(max_model_len=64))
    assert _finish(model, req("a", 60, 10)) == (4, "length")
    assert _finish(model, req("b", 64, 10)) == (1, "length")


def test_seeded_length_is_stable_bounded_and_plausible() -> None:
    def lengths(seed: int) -> list[int]:
        model = EngineModel(EngineConfig(seed=seed))
        arrivals = [(0.0, req(f"r{i}", 10, 100_000, ignore_eos=False)) for i in range(401)]
        trace = drive(model, arrivals)
        assert model.stats().request_success_total["stop"] == 401
        counts = dict.fromkeys((f"r{i}" for i in range(401)), 0)
        for _, o in trace.outputs:
            counts[o.request_id] += len(o.new_token_ids)
        return list(counts.values())

    a = lengths(0)
    assert a == lengths(0)
    assert a != lengths(1)
    assert 100 <= sorted(a)[200] <= 160  # lognormal, median 128
    assert 150 <= sum(a) / len(a) <= 280  # mean 128 * e^0.5 = 211
    model = EngineModel(EngineConfig())
    for i in range(200):
        n, reason = _finish(model, req(f"s{i}", 10, 40, ignore_eos=False, min_tokens=5))
        assert 5 <= n <= 40
        assert reason == ("length" if n == 40 else "stop")


def test_a_stop_finish_ends_with_eos_and_the_other_ids_do_not_move() -> None:
    # The model "emits" EOS as its last token (no text, one completion token), as a real one
    # does; a length finish has none. Every other id is what ignore_eos would have drawn.
    stop = drive(
        EngineModel(EngineConfig()), [(0.0, req("x", 10, 50, ignore_eos=False, natural_length=6))]
    )
    length = drive(EngineModel(EngineConfig()), [(0.0, req("x", 10, 6))])
    assert stop.of("x")[-1][1].finish_reason == "stop"
    assert length.of("x")[-1][1].finish_reason == "length"
    assert stop.tokens("x")[-1] == EOS_TOKEN_ID and len(stop.tokens("x")) == 6
    assert stop.tokens("x")[:-1] == length.tokens("x")[:-1]
    assert EOS_TOKEN_ID not in length.tokens("x")


def test_token_ids_are_seeded_pseudo_tokens_independent_of_batching() -> None:
    alone = drive(EngineModel(EngineConfig()), [(0.0, req("x", 10, 200))])
    crowd = [(0.0, req(f"o{i}", 30 + i, 150)) for i in range(20)] + [(0.004, req("x", 10, 200))]
    busy = drive(EngineModel(EngineConfig()), crowd)
    assert alone.tokens("x") == busy.tokens("x")
    toks = alone.tokens("x")
    assert all(3 <= t < 32000 for t in toks) and EOS_TOKEN_ID not in toks
    assert len(set(toks)) > 150  # not a constant or a short cycle
    other_seed = drive(EngineModel(EngineConfig(seed=1)), [(0.0, req("x", 10, 200))])
    assert other_seed.tokens("x") != toks


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"block_size": 0}, "block_size"),
        ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"spec_acceptance": 1.5}, "spec_acceptance"),
        ({"spec_acceptance": -0.1}, "spec_acceptance"),
        ({"spec_acceptance": float("nan")}, "spec_acceptance"),
        ({"step_floor_s": 0.0}, "step_floor_s"),
        ({"per_token_s": -1e-6}, "per_token_s"),
        ({"saturation_tokens": -1}, "saturation_tokens"),
        ({"natural_length_median": 0.5}, "natural_length_median"),
        ({"vocab_size": 3}, "vocab_size"),
    ],
)
def test_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (req("a", tokens=()), "at least one token"),
        (req("a", 65, 1), "longer than max_model_len"),
        (req("a", 10, 0), "max_tokens"),
        (req("a", 10, 5, min_tokens=6), "min_tokens"),
        (req("a", 60, 4), "KV blocks"),  # 60 + 4 - 1 = 63 tokens: 16 blocks of 4 > 15
    ],
)
def test_add_request_validation(request_: EngineRequest, message: str) -> None:
    model = EngineModel(EngineConfig(max_model_len=64, block_size=4, num_gpu_blocks=15))
    with pytest.raises(ValueError, match=message):
        model.add_request(request_, 0.0)
    assert not model.has_work()


def test_request_exactly_filling_the_cache_is_accepted_and_finishes() -> None:
    # 56 + 5 - 1 = 60 tokens = 15 blocks of 4: the whole cache.
    model = EngineModel(EngineConfig(max_model_len=64, block_size=4, num_gpu_blocks=15))
    assert _finish(model, req("a", 56, 5)) == (5, "length")


def test_duplicate_live_request_id_is_rejected() -> None:
    model = EngineModel(EngineConfig())
    model.add_request(req("a"), 0.0)
    with pytest.raises(ValueError, match="already"):
        model.add_request(req("a"), 0.0)


# ---------------------------------------------------------------------------- properties


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[EngineConfig, list[tuple[float, EngineRequest]], int]:
    chunked = draw(st.booleans())
    budget = draw(st.integers(8, 64))
    max_model_len = draw(st.integers(16, 128)) if chunked else budget
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    k = draw(st.integers(0, 3))
    # From half of what the largest possible request needs (so some are refused) to three
    # times that: small caches make preemption common.
    largest = -(-(max_model_len + k) // block_size)
    cfg = EngineConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=block_size,
        num_gpu_blocks=draw(st.integers(max(1, largest // 2), 3 * largest)),
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=chunked,
        stream_interval=draw(st.integers(1, 4)),
        num_speculative_tokens=k,
        spec_acceptance=draw(st.sampled_from([0.0, 0.5, 1.0])),
        seed=draw(st.integers(0, 3)),
    )
    # A few shared prefixes make prefix-cache hits likely.
    prefixes = [prompt(n, start=100 * i) for i, n in enumerate((0, 8, 20))]
    arrivals = []
    for i in range(draw(st.integers(1, 12))):
        base = draw(st.sampled_from(prefixes))
        tail = tuple(draw(st.lists(st.integers(3, 50), min_size=1, max_size=80)))
        tokens = (base + tail)[: cfg.max_model_len]
        max_tokens = draw(st.integers(1, 30))
        request = EngineRequest(
            request_id=f"r{i}",
            prompt_token_ids=tokens,
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens)),
            ignore_eos=draw(st.booleans()),
            natural_length=draw(st.none() | st.integers(1, 40)),
        )
        arrivals.append((draw(st.floats(0.0, 0.2)), request))
    abort_after = draw(st.integers(0, 40))
    return cfg, arrivals, abort_after


def _expected_length(cfg: EngineConfig, r: EngineRequest) -> tuple[int, str] | None:
    cap = max(1, min(r.max_tokens, cfg.max_model_len - len(r.prompt_token_ids)))
    if r.ignore_eos:
        return cap, "length"
    if r.natural_length is None:
        return None  # seeded: only bounds can be checked
    n = max(r.natural_length, r.min_tokens)
    return (cap, "length") if n >= cap else (n, "stop")


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_request_finishes_with_its_exact_token_count(
    scenario: tuple[EngineConfig, list[tuple[float, EngineRequest]], int],
) -> None:
    cfg, arrivals, abort_after = scenario
    model = EngineModel(cfg)
    # Requests the cache could never hold are refused up front (the server's 400).
    accepted: list[tuple[float, EngineRequest]] = []
    for t, r in arrivals:
        try:
            model.validate(r)
        except ValueError:
            continue
        accepted.append((t, r))
    # Abort the last request after `abort_after` steps, if it is still in the engine.
    victim = accepted[-1][1].request_id if accepted else None
    aborted = False
    trace = Trace([], [])
    pending = sorted(accepted, key=lambda a: a[0])
    now, i, steps = 0.0, 0, 0
    while i < len(pending) or model.has_work():
        while i < len(pending) and pending[i][0] <= now:
            model.add_request(pending[i][1], pending[i][0])
            i += 1
        if not model.has_work():
            now = pending[i][0]
            continue
        if steps == abort_after and victim is not None:
            aborted = model.abort_request(victim)
        result = model.step(now)
        steps += 1
        assert steps < 20_000, "a request starved"
        now += result.duration_s
        trace.outputs.extend((now, o) for o in result.outputs)
        model.check_invariants()
        stats = model.stats()
        assert 0.0 <= stats.kv_cache_usage <= 1.0
        assert stats.num_running <= cfg.max_num_seqs
    assert model.stats().kv_cache_usage == 0.0
    for t, r in accepted:
        rid = r.request_id
        outs = [o for _, o in trace.of(rid)]
        if aborted and rid == victim:
            assert not any(o.finished for o in outs)
            continue
        assert outs, f"{rid} produced nothing"
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert all(len(o.new_token_ids) >= 1 for o in outs)
        n = len(trace.tokens(rid))
        expected = _expected_length(cfg, r)
        if expected is None:
            cap = max(1, min(r.max_tokens, cfg.max_model_len - len(r.prompt_token_ids)))
            assert min(max(r.min_tokens, 1), cap) <= n <= cap
        else:
            assert (n, outs[-1].finish_reason) == expected
        first = outs[0]
        assert first.arrival_s == t
        assert first.scheduled_s is not None and first.first_token_s is not None
        assert t <= first.scheduled_s < first.first_token_s
        assert first.first_token_s == pytest.approx(trace.times(rid)[0])
        assert [s for o in outs for s in o.step_times_s] == sorted(
            s for o in outs for s in o.step_times_s
        )
    stats = model.stats()
    assert stats.generation_tokens_total >= sum(len(o.new_token_ids) for _, o in trace.outputs)


# --------------------------------------------------------------------------- a full batch


def test_a_full_batch_of_256_keeps_decoding() -> None:
    # The cost of this per step is measured in benchmarks/engine_step.py, not asserted here.
    model = EngineModel(EngineConfig(seed=1))
    for i in range(256):
        model.add_request(req(f"r{i}", 200, 5000, tokens=prompt(200, start=i * 1000)), 0.0)
    now = 0.0
    for _ in range(10):  # 256 x 200 prompt tokens take 7 steps of 8192 to admit
        now += model.step(now).duration_s
    assert model.stats().num_running == 256
    for _ in range(50):
        result = model.step(now)
        now += result.duration_s
        assert len(result.outputs) == 256
    assert model.stats().num_running == 256
