from __future__ import annotations

import dataclasses
import gc
import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_helpers import require_module
from random_records import random_records

from sidecar.record import (
    EMPTY,
    ChunkMark,
    EngineTiming,
    Int64s,
    Outcome,
    PyInt64s,
    RequestRecord,
    RequestShape,
    Timeline,
    TokenSource,
    Vantage,
    new_record,
    new_timeline,
    slots_constructor,
    untrack_finished,
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


COLUMN_TYPES = ["native", "python"]


def native_record_types() -> Any:
    """The C module (_recordtypes.c): built by `pip install -e .` wherever a C compiler is
    (fails in CI, skips elsewhere without it)."""
    return require_module("sidecar._recordtypes", "-e . (with a C compiler: gcc)")


def native_column_type() -> type[Int64s]:
    native: type[Int64s] = native_record_types().Int64s
    return native


def column_type(name: str) -> type[Int64s]:
    return PyInt64s if name == "python" else native_column_type()


def test_the_column_type_in_use_is_the_native_one_where_built() -> None:
    assert Int64s is native_column_type()
    assert isinstance(Int64s(), Sequence) and isinstance(PyInt64s(), Sequence)


@pytest.mark.parametrize("kind", COLUMN_TYPES)
def test_packed_columns_behave_as_immutable_int_sequences(kind: str) -> None:
    import pickle

    import numpy as np

    Int64s = column_type(kind)  # noqa: N806
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


@pytest.mark.parametrize("kind", COLUMN_TYPES)
def test_packed_columns_take_what_array_q_takes(kind: str) -> None:
    from array import array

    Int64s = column_type(kind)  # noqa: N806
    expected = [1, -2, 3]
    packed = array("q", expected).tobytes()
    for values in (
        expected,
        tuple(expected),
        (v for v in expected),
        array("q", expected),
        array("i", expected),
        memoryview(array("q", expected)),
        packed,
    ):
        assert Int64s(values).tolist() == expected, values
    # Other bytes-like objects are packed values too, as array("q", ...) reads them.
    assert Int64s(bytearray(packed)).tolist() == expected
    with pytest.raises(ValueError, match="multiple of item size"):
        Int64s(bytearray(b"\x01\x02"))
    assert Int64s(values=packed).data == packed
    with pytest.raises(OverflowError):
        Int64s([2**63])
    with pytest.raises(TypeError):
        Int64s(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple of 8"):
        Int64s(b"1234567")
    with pytest.raises(IndexError):
        Int64s(expected)[3]
    with pytest.raises(TypeError):
        Int64s(expected)["0"]  # type: ignore[call-overload]
    column = Int64s(expected)
    assert column.index(3) == 2 and column.count(-2) == 1 and column.count(7) == 0
    assert column.index(-2, -2) == 1 and 3 in column and list(reversed(column)) == [3, -2, 1]
    with pytest.raises(ValueError):
        column.index(1, 1)


@settings(max_examples=300)
@given(
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20),
    st.integers(-25, 25),
    st.one_of(st.none(), st.integers(-25, 25)),
    st.one_of(st.none(), st.integers(-25, 25)),
    st.one_of(st.none(), st.integers(-4, 4).filter(bool)),
)
def test_the_native_column_is_the_python_one(
    values: list[int], index: int, start: int | None, stop: int | None, step: int | None
) -> None:
    import pickle

    native_type = native_column_type()
    native, python = native_type(values), PyInt64s(values)
    assert native.data == python.data and len(native) == len(python)
    assert list(native) == list(python) == native.tolist() == values
    assert repr(native) == repr(python) and hash(native) == hash(python)
    assert bool(native) == bool(python)
    assert (native == values) and (native == tuple(values)) and native != values + [0]
    assert native == native_type(values) and native != native_type(values + [1])
    assert native != "x" and python != "x"
    try:
        expected = python[index]
    except IndexError:
        with pytest.raises(IndexError):
            native[index]
    else:
        assert native[index] == expected
    window = slice(start, stop, step)
    assert native[window].data == python[window].data
    assert pickle.loads(pickle.dumps(native)) == native
    if values:
        needle = values[len(values) // 2]
        assert native.index(needle) == python.index(needle)
        assert native.count(needle) == python.count(needle)


def _record_fields(seed: int) -> dict[str, Any]:
    record = random_records(seed, 1)[0]
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(RequestRecord)}


def test_records_built_by_their_slots_constructor_are_the_dataclasses() -> None:
    """`new_record` / `new_timeline` (C, where built) take what RequestRecord and Timeline
    take, fill the same defaults and factories, run __post_init__ and raise the same errors."""
    native_record_types()
    assert new_record is not RequestRecord and new_timeline is not Timeline
    for seed in range(20):
        fields = _record_fields(seed)
        made = new_record(**fields)
        assert type(made) is RequestRecord and made == RequestRecord(**fields)
        assert new_record(*fields.values()) == made  # positional, in field order
        client = fields["client"]
        timeline = {f.name: getattr(client, f.name) for f in dataclasses.fields(Timeline)}
        assert new_timeline(**timeline) == client
    least = new_record(request_id="r", wall_time_ns=1, outcome=Outcome.OK, endpoint="chat")
    assert least == RequestRecord(
        request_id="r", wall_time_ns=1, outcome=Outcome.OK, endpoint="chat"
    )
    assert least.attributes == {} and least.client == Timeline(start_ns=0)
    other = new_record(request_id="s", wall_time_ns=1, outcome=Outcome.OK, endpoint="chat")
    assert other.attributes is not least.attributes  # a factory's value per record
    with pytest.raises(dataclasses.FrozenInstanceError):
        least.model = "m"  # type: ignore[misc]
    # Timeline's __post_init__ runs: it packs plain sequences and refuses columns that differ.
    assert type(new_timeline(start_ns=0, offsets_ns=[1, 2], tokens=[1, 1]).tokens) is Int64s
    with pytest.raises(ValueError, match="one token count per event"):
        new_timeline(start_ns=0, offsets_ns=[1, 2], tokens=[1])
    with pytest.raises(TypeError, match="missing required argument: 'start_ns'"):
        new_timeline(offsets_ns=[1])
    with pytest.raises(TypeError, match="unexpected keyword argument 'start'"):
        new_timeline(start=0)
    with pytest.raises(TypeError, match="multiple values for argument 'start_ns'"):
        new_timeline(0, start_ns=0)
    with pytest.raises(TypeError, match="at most 6 positional"):
        new_timeline(0, (), (), None, 0, None, 7)


def test_packed_columns_skip_only_a_post_init_that_would_change_nothing() -> None:
    """Given packed columns (exact Int64s, None where allowed) of one length, the constructor
    leaves out the __post_init__ (Timeline's: pack, then hold to one length); anything else,
    and it runs: plain sequences packed, columns of two lengths refused, as before."""
    constructor = native_record_types().SlotsConstructor
    calls: list[object] = []

    @dataclasses.dataclass(frozen=True, slots=True)
    class Columns:
        a: Any
        b: Any = EMPTY
        c: Any = None

        def __post_init__(self) -> None:
            calls.append(self)

    make = constructor(
        Columns,
        ("a", "b", "c"),
        (dataclasses.MISSING, EMPTY, None),
        (None, None, None),
        dataclasses.MISSING,
        ("a", "b"),
        ("c",),
    )
    two, three = Int64s([1, 2]), Int64s([1, 2, 3])
    skipped: list[tuple[Any, Any, Any]] = [(two, two, None), (two, two, two), (EMPTY, EMPTY, None)]
    for a, b, c in skipped:
        made = make(a, b, c)
        assert (made.a, made.b, made.c) == (a, b, c) and calls == [], (a, b, c)
    ran: list[tuple[Any, Any, Any]] = [
        (two, three, None),  # two lengths
        (two, two, three),
        ([1, 2], two, None),  # not packed
        (two, None, None),  # None where a column is required
        (two, two, [1, 2]),
    ]
    for a, b, c in ran:
        made = make(a, b, c)
        assert calls == [made], (a, b, c)
        calls.clear()
    # Timeline's, through new_timeline: the same timelines and errors either way.
    packed = new_timeline(start_ns=0, offsets_ns=Int64s([1, 2]), tokens=Int64s([1, 1]))
    assert packed == Timeline(0, [1, 2], [1, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one token count per event"):
        new_timeline(start_ns=0, offsets_ns=Int64s([1, 2]), tokens=Int64s([1]))
    with pytest.raises(ValueError, match="one choice index per event"):
        new_timeline(start_ns=0, offsets_ns=Int64s([1]), tokens=Int64s([1]), choices=Int64s([0, 0]))
    with pytest.raises(ValueError, match="is not a field"):
        constructor(Columns, ("a",), (dataclasses.MISSING,), (None,), dataclasses.MISSING, ("z",))
    with pytest.raises(ValueError, match="twice"):
        constructor(
            Columns, ("a",), (dataclasses.MISSING,), (None,), dataclasses.MISSING, ("a",), ("a",)
        )


def test_a_class_the_slots_constructor_cannot_build_is_refused() -> None:
    constructor = native_record_types().SlotsConstructor

    @dataclasses.dataclass
    class NoSlots:
        x: int

    with pytest.raises(TypeError, match="not a slot"):
        constructor(NoSlots, ("x",), (dataclasses.MISSING,), (None,), dataclasses.MISSING)
    with pytest.raises(ValueError, match="one name, default and factory per field"):
        constructor(Timeline, ("start_ns",), (), (None,), dataclasses.MISSING)

    @dataclasses.dataclass(slots=True)
    class NotInInit:
        x: int
        y: int = dataclasses.field(default=0, init=False)

    assert slots_constructor(NotInInit) is NotInInit  # its own __init__, not ours


def test_a_finished_record_leaves_the_cycle_collector_only_when_it_cannot_be_in_a_cycle() -> None:
    require_module("sidecar._recordtypes", "-e . (with a C compiler: gcc)")
    record = dataclasses.replace(
        full_record(), engine=EngineTiming(queue_time_ms=1.0), shape=RequestShape(max_tokens=4)
    )
    parts = [record, record.client, record.server, record.engine, record.shape]
    assert all(gc.is_tracked(part) for part in parts)
    assert untrack_finished(record)
    assert not any(gc.is_tracked(part) for part in parts)
    assert dataclasses.replace(record) == record  # still a record like any other
    # What could close a cycle, or is not this module's: left as it is.
    odd_value = dataclasses.replace(full_record(), attributes={"slo_class": ["x"]})  # type: ignore[dict-item]

    class Derived(RequestRecord):
        __slots__ = ()

    derived = Derived(
        **{f.name: getattr(full_record(), f.name) for f in dataclasses.fields(RequestRecord)}
    )
    for kept in (odd_value, derived):
        assert not untrack_finished(kept)
        assert gc.is_tracked(kept)
