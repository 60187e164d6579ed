"""The live window's selection: /stats restricted to one client's requests by request id."""

from __future__ import annotations

import gc
import struct
from dataclasses import replace

import aiohttp
import pytest
from proxy_stack import stack
from random_records import random_records

from sidecar import stats
from sidecar.hooks import Sink, SinkFanout
from sidecar.proxy.recordwire import decode_record, encode_record
from sidecar.record import Outcome, RequestRecord, Timeline, TokenSource, Vantage
from sidecar.sinks.window import Selection, WindowSink

MS = 1_000_000


def record(request_id: str, ttft_ms: float) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        wall_time_ns=1_000 * MS,
        outcome=Outcome.OK,
        endpoint="completions",
        client=Timeline.from_marks(
            0, [(int(ttft_ms * MS), 1), (int(ttft_ms * MS) + MS, 1)], int(ttft_ms * MS) + 2 * MS, 2
        ),
        n_in=4,
        n_out=2,
        token_source=TokenSource.USAGE,
    )


def test_a_selection_summarises_only_the_named_requests() -> None:
    window = WindowSink(window_s=60.0, wall_ns=lambda: 1_001 * MS)
    for request_id, ttft in (
        ("step-1-r0-0-a", 10),
        ("step-1-r0-1-b", 30),
        ("step-1-r10-0-c", 500),
        ("other", 900),
    ):
        window.on_record(record(request_id, ttft))
    everything = window.snapshot()
    assert everything["generation_requests"] == 4
    assert everything["selection"] == {"request_id_prefix": None}
    mine = window.snapshot(selection=Selection("step-1-r0-"))
    assert (
        mine["generation_requests"] == 2 and mine["selection"]["request_id_prefix"] == "step-1-r0-"
    )
    # The trailing separator keeps repeat 0 from selecting repeat 10.
    assert mine["vantages"]["client"]["ttft"]["max"] == pytest.approx(0.030)
    assert mine["vantages"]["client"]["ttft"]["mean"] == pytest.approx(0.020)
    assert window.snapshot(selection=Selection("nobody"))["generation_requests"] == 0


def test_the_window_lifecycle_keeps_what_it_holds_readable() -> None:
    window = WindowSink(window_s=60.0, max_records=2, wall_ns=lambda: 1_001 * MS)
    assert isinstance(window, Sink)
    fanout = SinkFanout([window])
    for i in range(3):
        fanout.on_record(record(f"r{i}", 10))
    assert window.counters() == {"taken": 3, "evicted_over_cap": 1}
    assert window.flush(0) is True
    assert fanout.close() == []
    window.close()  # idempotent: nothing to release
    # In memory only: /stats (a last scrape while the process stops) still reads it.
    assert [r.request_id for r in window.records()] == ["r1", "r2"]


def test_the_window_ages_records_by_their_end() -> None:
    """A record leaves the window window_s after it ended (stats.end_offset_ns), not after it
    arrived: a 50 s stream that ended 20 s ago is still in a 60 s window."""
    now = [200 * 1_000 * MS]
    window = WindowSink(window_s=60.0, wall_ns=lambda: now[0])
    long = RequestRecord(
        request_id="long",
        wall_time_ns=130 * 1_000 * MS,
        outcome=Outcome.OK,
        endpoint="completions",
        client=Timeline.from_marks(0, [(MS, 1)], 50 * 1_000 * MS, 1),
    )
    window.on_record(long)
    assert [r.request_id for r in window.records()] == ["long"]
    now[0] = 241 * 1_000 * MS  # 61 s after its end
    assert window.records() == []


def test_selection_queries_are_checked() -> None:
    assert Selection.from_query({}) == Selection()
    assert Selection.from_query({"request_id_prefix": "x-"}) == Selection("x-")
    with pytest.raises(ValueError, match="unknown /stats parameter"):
        Selection.from_query({"request_id_prefx": "x-"})  # a typo must not select everything
    with pytest.raises(ValueError, match="must not be empty"):
        Selection.from_query({"request_id_prefix": ""})


async def test_the_admin_stats_endpoint_selects_by_request_id() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}
    async with stack() as s, aiohttp.ClientSession() as session:
        for request_id in ("mine-1", "mine-2", "theirs-1"):
            async with session.post(
                s.url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}
            ) as response:
                assert response.status == 200
                await response.read()
        await s.records.wait_for(3)
        admin = s.server.admin_url + "/stats"
        async with session.get(admin, params={"request_id_prefix": "mine-"}) as response:
            mine = await response.json()
        async with session.get(admin) as response:
            everything = await response.json()
        async with session.get(admin, params={"request_prefix": "mine-"}) as response:
            assert response.status == 400
            assert "unknown /stats parameter" in (await response.json())["error"]
    assert mine["generation_requests"] == 2 and everything["generation_requests"] == 3
    assert mine["vantages"]["server"]["ttft"]["count"] == 2


# -- the columnar window equals the summaries of its records, computed record by record -------


def _reference_snapshot(
    window: WindowSink, policy: stats.SLOPolicy, selection: Selection
) -> dict[str, object]:
    """What /stats reports, from `window.records()` with the list-based stats functions."""
    records = [r for r in window.records() if selection.matches(r)]
    generation = [r for r in records if r.endpoint in ("chat", "completions")]
    interval = min(window.window_s, stats.measured_interval_s(generation)) if generation else 0.0
    vantages = {v: stats.vantage_report(generation, v) for v in (Vantage.CLIENT, Vantage.SERVER)}
    goodput = {}
    for name, slo in policy.classes.items():
        members = [r for r in generation if policy.class_of(r) == name]
        goodput[name] = stats.goodput(members, slo, interval)
    return {
        "records": len(records),
        "generation": len(generation),
        "interval": interval,
        "outcomes": stats.outcome_counts(generation),
        "vantages": vantages,
        "engine": stats.engine_report(generation),
        "relay": _reference_relay([r for r in generation if r.ok]),
        "throughput": stats.throughput(generation, interval),
        "goodput": goodput,
    }


def _reference_relay(records: list[RequestRecord]) -> stats.RelayReport:
    """The proxy's own delay, request by request (`stats.relay_delays_ns`)."""
    delays: list[float] = []
    paired = unpaired = 0
    for r in records:
        d = stats.relay_delays_ns(r)
        if d is None:
            server = r.server
            unpaired += bool(server is not None and len(server.offsets_ns)) and bool(
                len(r.client.offsets_ns)
            )
            continue
        paired += 1
        delays.extend(x / 1e9 for x in d)
    return stats.RelayReport(paired, unpaired, stats.summarize(delays))


@pytest.mark.parametrize("seed", range(6))
def test_the_columnar_window_equals_record_by_record_summaries(seed: int) -> None:
    now = [10**18 + 2_000 * 1_000_000]
    # A 1.5 s window over 2,000 records 1 ms apart, at most 1,200 kept: both bounds evict.
    window = WindowSink(1.5, max_records=1200, wall_ns=lambda: now[0])
    policy = stats.SLOPolicy(
        {"a": stats.SLO(ttft_s=0.5, tpot_s=0.02), "default": stats.SLO(e2e_s=0.9)}
    )
    # The last seed runs long enough for the columns to be compacted (4,096+ dropped).
    n = 9000 if seed == 5 else 2000
    now[0] = 10**18 + n * 1_000_000
    for record in random_records(seed, n):
        window.on_record(record)
    if seed == 5:
        assert window._table.stored < 4096 + 1200  # dropped records were compacted away
    for selection in (Selection(), Selection("run-a-")):
        for _ in range(2):  # and again after time moved on
            ref = _reference_snapshot(window, policy, selection)
            table = window._table
            _live, generation = window._mask(selection)
            assert len(window._records) == len(table)  # the deque and the columns agree
            got = window.snapshot(policy, selection)
            assert got["records"] == ref["records"]
            assert got["generation_requests"] == ref["generation"]
            assert got["interval_s"] == ref["interval"]
            assert table.outcome_counts(generation) == ref["outcomes"]
            for vantage, report in window.vantage_reports(selection).items():
                assert report == ref["vantages"][vantage]  # type: ignore[index]
            assert table.engine_report(generation) == ref["engine"]
            relay = table.relay_report(generation)
            assert relay == ref["relay"]
            assert got["relay"]["requests"] == relay.requests
            assert got["relay"]["delay"] == relay.delay.to_dict()
            assert table.throughput(generation, ref["interval"]) == ref["throughput"]  # type: ignore[arg-type]
            assert table.goodput(generation, policy, ref["interval"]) == ref["goodput"]  # type: ignore[arg-type]
            now[0] += 700_000_000


def test_records_leave_the_columns_in_batches_and_before_any_read() -> None:
    """A record that leaves the window (over a cap or by age) leaves its columns in batches of
    `DROP_BATCH`, or once those waiting hold `max_bytes` / `DROP_BYTES_SHARE`, and always
    before the columns are read: the lag is bounded and never seen."""
    from sidecar.sinks import window as window_module

    now = [10**18]
    window = WindowSink(60.0, max_records=10, wall_ns=lambda: now[0])
    batch = window_module.DROP_BATCH
    sample = random_records(3, 1)[0]
    for i in range(batch + 10 - 1):  # 10 kept, batch - 1 evicted and still in the columns
        window.on_record(replace(sample, request_id=f"r{i}", wall_time_ns=now[0] - 10**9))
    assert len(window._records) == 10 and window.evicted_over_cap == batch - 1
    assert len(window._table) == 10 + batch - 1
    window.on_record(replace(sample, request_id="last", wall_time_ns=now[0] - 10**9))
    assert len(window._table) == len(window._records) == 10  # the batch went at once
    for i in range(3):
        window.on_record(replace(sample, request_id=f"s{i}", wall_time_ns=now[0] - 10**9))
    assert len(window._table) == 13
    assert window.snapshot()["records"] == 10  # a read drops them first
    assert len(window._table) == 10 and window._table.ids()[-1] == "s2"
    # By age, with a byte cap whose 32nd part is below one record's estimate: each record
    # that leaves leaves the columns at once.
    small = WindowSink(1.0, max_bytes=32 * 1000, wall_ns=lambda: now[0])
    for i in range(5):
        small.on_record(replace(sample, request_id=f"a{i}", wall_time_ns=now[0] - 10**9 // 2))
    now[0] += 2 * 10**9
    small.on_record(replace(sample, request_id="b", wall_time_ns=now[0] - 10**9 // 2))
    assert len(small._records) == len(small._table) == 1


def test_a_window_of_decoded_records_gives_the_cycle_collector_nothing_to_scan() -> None:
    """What the collector process holds, 100,000 records by default, is not scanned by every
    full collection: its decoded records are not tracked (proxy/_recordwire.c), and the
    window keeps no tracked object per record beside them."""
    now = 10**18
    wires = [
        encode_record(replace(r, shape=None, wall_time_ns=now - 10**9))
        for r in random_records(4, 300)
    ]
    window = WindowSink(60.0, wall_ns=lambda: now)
    gc.collect()
    before = len(gc.get_objects())
    for wire in wires:
        window.on_record(decode_record(wire))
    gc.collect()
    assert len(window._records) == 300
    assert len(gc.get_objects()) - before < 30  # not one per record (3.8 each before)


def test_a_window_of_records_made_in_this_process_is_left_out_of_the_cycle_collector_too() -> None:
    """In one process (`--workers 0`) the window's records are the proxy's own, made tracked:
    the window leaves them out of the collector's scans itself."""
    now = 10**18
    records = [replace(r, wall_time_ns=now - 10**9) for r in random_records(5, 300)]

    def tracked() -> int:
        return sum(
            gc.is_tracked(part)
            for record in records
            for part in (record, record.client, record.server, record.engine, record.shape)
            if part is not None
        )

    assert tracked() >= 600  # each record and its client timeline at least
    window = WindowSink(60.0, wall_ns=lambda: now)
    for record in records:
        window.on_record(record)
    assert len(window._records) == 300
    assert tracked() == 0
    assert window.records() == records  # the same records, as they were


def test_a_record_the_columns_refuse_is_kept_nowhere() -> None:
    """A count beyond 64 bits cannot go in the columns: the window refuses the record whole,
    and the deque and the columns still agree."""
    now = 10**18
    window = WindowSink(60.0, wall_ns=lambda: now)
    sample = replace(random_records(6, 1)[0], wall_time_ns=now - 10**9)
    window.on_record(sample)
    with pytest.raises(struct.error):
        window.on_record(replace(sample, request_id="huge", n_out=2**64))
    assert len(window._records) == len(window._table) == 1
    assert window.snapshot()["records"] == 1
