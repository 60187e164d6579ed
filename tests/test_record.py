from __future__ import annotations

import dataclasses
import json

import pytest

from sidecar.record import (
    ChunkMark,
    EngineTiming,
    Int64s,
    Outcome,
    RequestRecord,
    RequestShape,
    Timeline,
    TokenSource,
    Vantage,
)


def full_record() -> RequestRecord:
    return RequestRecord(
        request_id="req-1",
        wall_time_ns=1_700_000_000_000_000_000,
        outcome=Outcome.OK,
        endpoint="chat",
        model="m",
        # Tuples on purpose: a Timeline packs any sequence of ints it is given (its fields are
        # annotated with the packed type only).
        client=Timeline(
            start_ns=0,
            offsets_ns=(120, 150),  # type: ignore[arg-type]
            tokens=(1, 3),  # type: ignore[arg-type]
            end_ns=160,
            events_total=4,
        ),
        server=Timeline.from_marks(
            start_ns=5, marks=(ChunkMark(119, 1), ChunkMark(149, 3)), end_ns=158, events_total=5
        ),
        engine=EngineTiming(time_to_first_token_ms=1.5, queue_time_ms=0.25),
        n_in=12,
        n_out=4,
        n_cached=0,
        token_source=TokenSource.USAGE,
        finish_reason="length",
        http_status=200,
        replica="http://127.0.0.1:8100",
        route_policy="least_outstanding",
        attributes={"slo_class": "default"},
        shape=RequestShape(
            max_tokens=4,
            ignore_eos=True,
            temperature=0.0,
            session_id="s",
            prefix_unit="chars",
            prefix_size=256,
            prefix_hashes=(1, 2),
        ),
    )


def test_round_trip_through_json() -> None:
    record = full_record()
    text = json.dumps(record.to_dict())
    assert RequestRecord.from_dict(json.loads(text)) == record


def test_record_is_frozen() -> None:
    record = full_record()
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.outcome = Outcome.TIMEOUT  # type: ignore[misc]


def test_timeline_columns_and_marks_agree() -> None:
    timeline = full_record().server
    assert timeline is not None
    assert timeline.offsets_ns == (119, 149) and timeline.tokens == (1, 3)
    assert timeline.marks == (ChunkMark(119, 1), ChunkMark(149, 3))
    assert timeline.n_marks == 2
    assert timeline.to_dict()["marks"] == [[119, 1], [149, 3]]
    # A count missing for an event is refused rather than silently paired with the next one.
    with pytest.raises(ValueError, match="one token count per event"):
        Timeline(start_ns=0, offsets_ns=Int64s((1, 2)), tokens=Int64s((1,)))


def test_packed_columns_behave_as_immutable_int_sequences() -> None:
    import pickle

    import numpy as np

    from sidecar.record import Int64s

    column = Int64s([5, -3, 2**40])
    assert len(column) == 3 and column[0] == 5 and column[-1] == 2**40
    assert list(column) == [5, -3, 2**40] and column.tolist() == [5, -3, 2**40]
    assert column[1:] == (-3, 2**40) and isinstance(column[1:], Int64s)
    assert column == [5, -3, 2**40] and column != (5, -3) and column == Int64s((5, -3, 2**40))
    assert len(column.data) == 24  # 8 bytes per value
    assert pickle.loads(pickle.dumps(column)) == column  # replay workers send records back
    assert np.frombuffer(column.data, dtype=np.int64).tolist() == [5, -3, 2**40]
    assert hash(column) == hash(Int64s([5, -3, 2**40]))
    assert not Int64s() and Int64s().tolist() == []
    with pytest.raises(TypeError):
        column[0] = 1  # type: ignore[index]
    with pytest.raises(ValueError, match="multiple of 8"):
        Int64s(b"123")


def test_timeline_by_vantage() -> None:
    record = full_record()
    assert record.timeline(Vantage.CLIENT) is record.client
    assert record.timeline(Vantage.SERVER) is record.server
    assert record.timeline(Vantage.ENGINE) is None
    assert record.ok


def test_unknown_version_is_refused_clearly() -> None:
    data = full_record().to_dict()
    data["v"] = 99
    with pytest.raises(ValueError, match="unsupported record version 99"):
        RequestRecord.from_dict(data)


def test_outcomes_are_the_six_of_the_spec() -> None:
    assert {o.value for o in Outcome} == {
        "ok",
        "http_error",
        "upstream_error",
        "timeout",
        "client_cancelled",
        "rejected",
    }
