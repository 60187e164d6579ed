"""The per-request timing record: built once by the proxy (or a load generator), then frozen.

One `RequestRecord` per request that reached the measuring process, whatever happened to it.
Instants are monotonic nanosecond offsets from one anchor, the moment the whole request had
arrived (``t_arrive`` in spec/metrics.md, offset 0); a single wall-clock reading (`wall_time_ns`)
ties that anchor to calendar time. Offsets, not absolute monotonic values, keep records small,
comparable across processes and serialisable without leaking a host's uptime.

Each vantage point has its own `Timeline` (spec/metrics.md section 1):

- ``client``: instants on the client-facing socket. ``start_ns`` is 0 (t_arrive).
- ``server``: instants on the upstream socket. ``start_ns`` is t_up_send.

A timeline's events (``offsets_ns`` and ``tokens``) are only those that carried at least one
output token (the spec says role-only, empty, usage-only chunks and comments are not tokens);
the count of every other event is kept in ``events_total`` so nothing is silently lost.
"""

from __future__ import annotations

import dataclasses
import enum
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar, overload

RECORD_VERSION = 1


class Outcome(str, enum.Enum):
    """How a request ended. Every request ends in exactly one of these (spec section 4)."""

    OK = "ok"
    HTTP_ERROR = "http_error"  # the upstream answered with an error status or an error event
    UPSTREAM_ERROR = "upstream_error"  # connect refused, reset, malformed stream
    TIMEOUT = "timeout"
    CLIENT_CANCELLED = "client_cancelled"
    REJECTED = "rejected"  # refused by the measuring process's own limits


class Vantage(str, enum.Enum):
    CLIENT = "client"
    SERVER = "server"
    ENGINE = "engine"


class TokenSource(str, enum.Enum):
    """Where the output-token counts came from."""

    USAGE = "usage"  # N_out and every per-event count from the upstream's usage (exact)
    USAGE_TOTAL = "usage_total"  # N_out from usage (exact); per-event counts estimated (1/event)
    CHUNK_COUNT = "chunk_count"  # no usage at all: one token per token-carrying event (estimate)
    NONE = "none"  # no token-carrying event and no usage

    @property
    def total_exact(self) -> bool:
        return self is SOURCE_USAGE or self is SOURCE_USAGE_TOTAL


# Members the per-request code reads, as module constants: on CPython 3.10 and 3.11 reading a
# member off its class (`Outcome.OK`) goes through the slow attribute hook that EnumType's
# __getattr__ installs (~55 ns and ~850 instructions, against ~4 ns for a global; 3.12 dropped
# that __getattr__). protocol/openai.py does the same for ChunkKind.
OUTCOME_OK: Final = Outcome.OK
OUTCOME_REJECTED: Final = Outcome.REJECTED
OUTCOME_HTTP_ERROR: Final = Outcome.HTTP_ERROR
OUTCOME_CLIENT_CANCELLED: Final = Outcome.CLIENT_CANCELLED
VANTAGE_CLIENT: Final = Vantage.CLIENT
VANTAGE_SERVER: Final = Vantage.SERVER
VANTAGE_ENGINE: Final = Vantage.ENGINE
SOURCE_USAGE: Final = TokenSource.USAGE
SOURCE_USAGE_TOTAL: Final = TokenSource.USAGE_TOTAL
SOURCE_CHUNK_COUNT: Final = TokenSource.CHUNK_COUNT
SOURCE_NONE: Final = TokenSource.NONE


class ChunkMark(NamedTuple):
    """One token-carrying event: when it was seen (ns since t_arrive) and how many tokens."""

    offset_ns: int
    n_tokens: int


class PyInt64s(Sequence[int]):
    """An immutable sequence of 64-bit ints, stored packed: 8 bytes per value in one bytes
    object, whatever the length (a tuple costs ~40 bytes per value and one int object each).
    `Int64s` is this class's behaviour written in C (``sidecar/_recordtypes.c``) where the package
    was built with it, else this class: this is the specification the C type is tested
    against.

    A timeline's columns are these: a record kept in the live window, queued for the
    OpenTelemetry thread or for capture then costs 8 bytes per event per column, and gives the
    garbage collector nothing per event to track. Iterating, indexing, ``len`` and ``tolist``
    run in C (through a memoryview); ``numpy.frombuffer(x.data, dtype=np.int64)`` reads it
    without a copy. Equal to a tuple or list with the same values.
    """

    __slots__ = ("_data", "_view")

    def __init__(self, values: Iterable[int] | bytes = b"") -> None:
        if isinstance(values, bytes):
            data = values
        elif isinstance(values, array) and values.typecode == "q":
            data = values.tobytes()
        else:
            data = array("q", values).tobytes()
        if len(data) % 8:
            raise ValueError("Int64s needs a multiple of 8 bytes")
        self._data = data
        self._view = memoryview(data).cast("q")

    @property
    def data(self) -> bytes:
        """The packed values (native byte order)."""
        return self._data

    def __len__(self) -> int:
        return len(self._view)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> PyInt64s: ...

    def __getitem__(self, index: int | slice) -> int | PyInt64s:
        if isinstance(index, slice):
            return PyInt64s(self._view[index].tobytes())
        value: int = self._view[index]
        return value

    def __iter__(self) -> Iterator[int]:
        return iter(self._view)

    def tolist(self) -> list[int]:
        values: list[int] = self._view.tolist()
        return values

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PyInt64s):
            return self._data == other._data
        if isinstance(other, (tuple, list)):
            return self.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._data)

    def __repr__(self) -> str:
        return f"Int64s({self.tolist()!r})"

    def __reduce__(self) -> tuple[type[PyInt64s], tuple[bytes]]:
        return (PyInt64s, (self._data,))


# `int64s_from_bytes(data)`: an Int64s of exact packed bytes, without the constructor's
# argument parsing where Int64s is the C type (the record's wire decoder makes three per record).
_SlotsConstructor: Any = None
_untrack: Callable[[object], None] | None = None
if TYPE_CHECKING:
    Int64s = PyInt64s
    int64s_from_bytes: Callable[[bytes], PyInt64s] = PyInt64s
else:
    try:
        from sidecar._recordtypes import Int64s
        from sidecar._recordtypes import SlotsConstructor as _SlotsConstructor
        from sidecar._recordtypes import from_bytes as int64s_from_bytes
        from sidecar._recordtypes import untrack as _untrack

        Sequence.register(Int64s)
    except ImportError:  # built without a C compiler
        Int64s = int64s_from_bytes = PyInt64s


EMPTY = Int64s()


@dataclass(frozen=True, slots=True)
class Timeline:
    """What one vantage point saw of a request.

    ``start_ns``: the vantage's origin (0 for the client, t_up_send for the server side).
    ``offsets_ns`` and ``tokens``: the token-carrying events in order of arrival, as two
    parallel packed columns (`Int64s`: when each was seen, and how many tokens it carried;
    any sequence of ints given is packed). Columns rather than one object per event: cheap to
    build on the proxy, 16 bytes per event, nothing per event for the garbage collector.
    ``marks`` gives the same events as `ChunkMark` pairs, for readability off the hot path.
    ``end_ns``: the stream's end (last byte / close / error) as seen from this side, or None if
    the request never got that far (e.g. rejected before it was sent upstream).
    ``events_total``: every SSE event seen on this side, token-carrying or not ([DONE] excluded).
    ``choices``: with n > 1, the choice index of each event (a third parallel column): each
    choice is a sequence of its own, and ITL and TPOT are taken per sequence
    (`sidecar.stats`). None: one sequence (n = 1, or every event of choice 0).
    """

    start_ns: int
    offsets_ns: Int64s = EMPTY
    tokens: Int64s = EMPTY
    end_ns: int | None = None
    events_total: int = 0
    choices: Int64s | None = None

    def __post_init__(self) -> None:
        # Accept any sequence of ints (tests, importers); keep the packed form.
        if type(self.offsets_ns) is not Int64s:
            object.__setattr__(self, "offsets_ns", Int64s(self.offsets_ns))
        if type(self.tokens) is not Int64s:
            object.__setattr__(self, "tokens", Int64s(self.tokens))
        if len(self.offsets_ns) != len(self.tokens):
            raise ValueError(
                f"a timeline needs one token count per event: "
                f"{len(self.offsets_ns)} offsets, {len(self.tokens)} counts"
            )
        if self.choices is not None:
            if type(self.choices) is not Int64s:
                object.__setattr__(self, "choices", Int64s(self.choices))
            if len(self.choices) != len(self.offsets_ns):
                raise ValueError(
                    f"a timeline needs one choice index per event: "
                    f"{len(self.offsets_ns)} offsets, {len(self.choices)} choices"
                )

    @classmethod
    def from_marks(
        cls,
        start_ns: int,
        marks: Iterable[tuple[int, int]] = (),
        end_ns: int | None = None,
        events_total: int = 0,
    ) -> Timeline:
        pairs = tuple(marks)
        return cls(
            start_ns=start_ns,
            offsets_ns=Int64s(int(p[0]) for p in pairs),
            tokens=Int64s(int(p[1]) for p in pairs),
            end_ns=end_ns,
            events_total=events_total,
        )

    @property
    def marks(self) -> tuple[ChunkMark, ...]:
        return tuple(map(ChunkMark, self.offsets_ns, self.tokens))

    @property
    def n_marks(self) -> int:
        return len(self.offsets_ns)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "start_ns": self.start_ns,
            "marks": [[o, n] for o, n in zip(self.offsets_ns, self.tokens, strict=True)],
            "end_ns": self.end_ns,
            "events_total": self.events_total,
        }
        if self.choices is not None:
            out["choices"] = self.choices.tolist()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Timeline:
        timeline = cls.from_marks(
            start_ns=int(data["start_ns"]),
            marks=data.get("marks", ()),
            end_ns=None if data.get("end_ns") is None else int(data["end_ns"]),
            events_total=int(data.get("events_total", 0)),
        )
        choices = data.get("choices")
        if choices is not None:
            object.__setattr__(timeline, "choices", Int64s(int(c) for c in choices))
            timeline.__post_init__()
        return timeline


@dataclass(frozen=True, slots=True)
class EngineTiming:
    """vLLM's own per-request timings (``metrics`` in the final usage chunk with
    ``--enable-per-request-metrics``), kept as reported, in milliseconds. vLLM's fields, from
    its engine's stamps (queued, scheduled, first token, last token):

    - ``queue_time_ms``: queued -> scheduled;
    - ``time_to_first_token_ms``: scheduled -> first token (the queue excluded, unlike vLLM's
      own Prometheus TTFT and unlike TTFT at every other vantage);
    - ``generation_time_ms``: first token -> last token;
    - ``mean_itl_ms``: generation_time / (N_out - 1), which is TPOT as defined here.

    `ttft_ms` and `e2e_ms` are the engine's intervals that carry those names at every vantage:
    from the request's start (here: queued in the engine) to its first and last token."""

    time_to_first_token_ms: float | None = None
    generation_time_ms: float | None = None
    queue_time_ms: float | None = None
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None

    @property
    def ttft_ms(self) -> float | None:
        """Queued -> first token: TTFT at the engine vantage."""
        if self.queue_time_ms is None or self.time_to_first_token_ms is None:
            return None
        return self.queue_time_ms + self.time_to_first_token_ms

    @property
    def e2e_ms(self) -> float | None:
        """Queued -> last token: E2E at the engine vantage."""
        ttft = self.ttft_ms
        if ttft is None or self.generation_time_ms is None:
            return None
        return ttft + self.generation_time_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "time_to_first_token_ms": self.time_to_first_token_ms,
            "generation_time_ms": self.generation_time_ms,
            "queue_time_ms": self.queue_time_ms,
            "mean_itl_ms": self.mean_itl_ms,
            "tokens_per_second": self.tokens_per_second,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineTiming:
        def num(key: str) -> float | None:
            value = data.get(key)
            return None if value is None else float(value)

        return cls(
            time_to_first_token_ms=num("time_to_first_token_ms"),
            generation_time_ms=num("generation_time_ms"),
            queue_time_ms=num("queue_time_ms"),
            mean_itl_ms=num("mean_itl_ms"),
            tokens_per_second=num("tokens_per_second"),
        )


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the request asked for that shapes the work, kept when the proxy captures traffic.

    Never text: the prompt is represented by chained, salted hashes of its leading blocks
    (``prefix_unit`` "tokens" for token-id prompts, "chars" for text), so that shared prefixes
    are visible and nothing can be read back. ``body`` and ``completion_text`` are filled only
    when the operator opted in to storing text.
    """

    max_tokens: int | None = None
    ignore_eos: bool | None = None
    n: int = 1
    temperature: float | None = None
    session_id: str | None = None
    prefix_unit: str | None = None
    prefix_size: int = 0
    prefix_hashes: tuple[int, ...] = ()
    body: str | None = None  # opt-in: the request body as received (UTF-8 text)
    completion_text: str | None = None  # opt-in: the generated text, choices concatenated

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "n": self.n,
            "temperature": self.temperature,
            "session_id": self.session_id,
            "prefix_unit": self.prefix_unit,
            "prefix_size": self.prefix_size,
            "prefix_hashes": list(self.prefix_hashes),
            "body": self.body,
            "completion_text": self.completion_text,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestShape:
        return cls(
            max_tokens=data.get("max_tokens"),
            ignore_eos=data.get("ignore_eos"),
            n=int(data.get("n", 1)),
            temperature=data.get("temperature"),
            session_id=data.get("session_id"),
            prefix_unit=data.get("prefix_unit"),
            prefix_size=int(data.get("prefix_size", 0)),
            prefix_hashes=tuple(int(h) for h in data.get("prefix_hashes", ())),
            body=data.get("body"),
            completion_text=data.get("completion_text"),
        )


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """Everything measured about one request. Immutable; built by a builder, then frozen.

    Token counts: ``n_in``/``n_out``/``n_cached`` come from the upstream's usage when
    ``token_source`` is USAGE; otherwise ``n_out`` is an estimate (or None) and says so.
    """

    request_id: str
    # time.time_ns() at t_arrive: the first byte of the request reached the proxy. Every
    # offset in the record counts from this instant.
    wall_time_ns: int
    outcome: Outcome
    endpoint: str  # "chat" | "completions" | the path, for pass-through requests
    model: str | None = None
    client_stream: bool = True  # did the client ask for a stream?
    upstream_stream: bool = True  # was the upstream asked for a stream?
    client: Timeline = field(default_factory=lambda: Timeline(start_ns=0))
    server: Timeline | None = None
    engine: EngineTiming | None = None
    n_in: int | None = None
    n_out: int | None = None
    n_cached: int | None = None
    token_source: TokenSource = SOURCE_NONE
    finish_reason: str | None = None
    http_status: int | None = None
    error_type: str | None = None  # short machine-readable cause, never free text from a body
    replica: str | None = None
    route_policy: str | None = None
    attributes: Mapping[str, str] = field(default_factory=dict)  # bounded extras (slo class, ...)
    shape: RequestShape | None = None  # only when the proxy captures traffic
    # t_read: the whole request (head and body) had been read, as an offset from t_arrive.
    # The upload's share of what the client waited for; None when not measured.
    request_read_ns: int | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is OUTCOME_OK

    @property
    def model_confirmed(self) -> bool:
        """The upstream accepted this request's model name: it answered 2xx (vLLM answers
        404 for a model it does not serve). Only such names take a metric label slot, so that
        junk names cannot crowd the real ones out."""
        status = self.http_status
        return status is not None and 200 <= status < 300 and self.outcome is not OUTCOME_REJECTED

    def timeline(self, vantage: Vantage) -> Timeline | None:
        if vantage is VANTAGE_CLIENT:
            return self.client
        if vantage is VANTAGE_SERVER:
            return self.server
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": RECORD_VERSION,
            "request_id": self.request_id,
            "wall_time_ns": self.wall_time_ns,
            "outcome": self.outcome.value,
            "endpoint": self.endpoint,
            "model": self.model,
            "client_stream": self.client_stream,
            "upstream_stream": self.upstream_stream,
            "client": self.client.to_dict(),
            "server": None if self.server is None else self.server.to_dict(),
            "engine": None if self.engine is None else self.engine.to_dict(),
            "n_in": self.n_in,
            "n_out": self.n_out,
            "n_cached": self.n_cached,
            "token_source": self.token_source.value,
            "finish_reason": self.finish_reason,
            "http_status": self.http_status,
            "error_type": self.error_type,
            "replica": self.replica,
            "route_policy": self.route_policy,
            "attributes": dict(self.attributes),
            "shape": None if self.shape is None else self.shape.to_dict(),
            "request_read_ns": self.request_read_ns,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestRecord:
        version = data.get("v", RECORD_VERSION)
        if version != RECORD_VERSION:
            raise ValueError(
                f"unsupported record version {version!r} (this build reads {RECORD_VERSION})"
            )

        def opt_int(key: str) -> int | None:
            value = data.get(key)
            return None if value is None else int(value)

        server = data.get("server")
        engine = data.get("engine")
        return cls(
            request_id=str(data["request_id"]),
            wall_time_ns=int(data["wall_time_ns"]),
            outcome=Outcome(data["outcome"]),
            endpoint=str(data["endpoint"]),
            model=data.get("model"),
            client_stream=bool(data.get("client_stream", True)),
            upstream_stream=bool(data.get("upstream_stream", True)),
            client=Timeline.from_dict(data["client"]),
            server=None if server is None else Timeline.from_dict(server),
            engine=None if engine is None else EngineTiming.from_dict(engine),
            n_in=opt_int("n_in"),
            n_out=opt_int("n_out"),
            n_cached=opt_int("n_cached"),
            token_source=TokenSource(data.get("token_source", SOURCE_NONE.value)),
            finish_reason=data.get("finish_reason"),
            http_status=opt_int("http_status"),
            error_type=data.get("error_type"),
            replica=data.get("replica"),
            route_policy=data.get("route_policy"),
            attributes={str(k): str(v) for k, v in (data.get("attributes") or {}).items()},
            shape=None if data.get("shape") is None else RequestShape.from_dict(data["shape"]),
            request_read_ns=opt_int("request_read_ns"),
        )


_T = TypeVar("_T")


def slots_constructor(
    cls: type[_T], columns: tuple[str, ...] = (), optional_columns: tuple[str, ...] = ()
) -> Callable[..., _T]:
    """``cls`` (a dataclass with slots and no init-only or ``init=False`` fields) built as its
    __init__ builds it, then its __post_init__ run: the same arguments, defaults, factories and
    errors. In C (`_recordtypes.SlotsConstructor`) each field goes straight to its slot,
    without the generated __init__'s ``object.__setattr__`` per field of a frozen class (a
    record and its two timelines were ~190 bytecodes of each request in the worker, as many
    in the collector); where that is not built, ``cls`` itself.

    ``columns`` (and ``optional_columns``, which may be None): packed columns that a
    __post_init__ only packs and holds to one length, as Timeline's does. Given already
    packed (exact `Int64s`) and of one length, that __post_init__ would change nothing, and
    the C constructor does not call it."""
    if _SlotsConstructor is None:
        return cls
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    every = getattr(cls, "__dataclass_fields__", {})
    if len(every) != len(fields) or not all(f.init for f in fields):
        return cls  # init-only or init=False fields: the dataclass's own __init__
    constructor: Callable[..., _T] = _SlotsConstructor(
        cls,
        tuple(f.name for f in fields),
        tuple(f.default for f in fields),
        tuple(
            None if f.default_factory is dataclasses.MISSING else f.default_factory for f in fields
        ),
        dataclasses.MISSING,
        columns,
        optional_columns,
    )
    return constructor


new_timeline = slots_constructor(Timeline, ("offsets_ns", "tokens"), ("choices",))
new_record = slots_constructor(RequestRecord)
new_engine_timing = slots_constructor(EngineTiming)


def untrack_finished(record: RequestRecord) -> bool:
    """Leave a finished record, its timelines, engine timings and shape out of CPython's cycle
    collector, when none of them can be in a reference cycle: exact types of this module
    whose fields are strings, numbers, enum members, packed columns, a tuple of ints and an
    attributes dict of strings. Whoever keeps many records for long (a replay's results)
    then costs every full collection nothing for them; reference counting still frees them.
    False (nothing done) for anything else, or where the C helper is not built. The record
    must not be changed afterwards (its attributes dict above all: a value put in it could
    close a cycle the collector would not see)."""
    untrack = _untrack
    if untrack is None or type(record) is not RequestRecord:
        return False
    attributes = record.attributes
    if type(attributes) is not dict or not all(
        type(key) is str and type(value) is str for key, value in attributes.items()
    ):
        return False
    parts: list[object] = [record]
    checks: tuple[tuple[object, type], ...] = (
        (record.client, Timeline),
        (record.server, Timeline),
        (record.engine, EngineTiming),
        (record.shape, RequestShape),
    )
    for part, kind in checks:
        if part is None:
            continue
        if type(part) is not kind:
            return False
        parts.append(part)
    shape = record.shape
    if shape is not None and type(shape.prefix_hashes) is not tuple:
        return False
    for part in parts:
        untrack(part)
    return True


# What a frozen record costs beyond its columns (the record, its timelines, ids, strings).
# Measured with tracemalloc on proxy records: 2.4 KiB at 32 tokens, 7.7 KiB at 256; this
# estimate gives 2.8 and 8.0.
RECORD_BASE_BYTES = 2048


def approx_record_bytes(record: RequestRecord) -> int:
    """Memory a kept record holds, approximately: a fixed part, 8 bytes per instant on each
    side, and 8 per token count (one column, which the two sides share). What bounds the live
    window's memory (sinks.window) and the records waiting for a scrape (hooks.SinkFanout)."""
    client = record.client.n_marks
    server = record.server.n_marks if record.server else 0
    return RECORD_BASE_BYTES + 8 * (client + server) + 8 * max(client, server)
