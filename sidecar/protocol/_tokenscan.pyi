from typing import Any, Protocol

# The C scanner (_tokenscan.c); fastchunk.TokenScan names the parts of its answer.
_Scan = tuple[int, int | None, int | None, int | None, int, int, int, int, int]

def scan(data: bytes | bytearray | memoryview, /) -> _Scan | None: ...

# fastchunk.ChunkScan names the parts of this one.
_ChunkScan = tuple[
    int, int | None, int | None, int | None, int | None, int, int, int, int, int, int, int, int, int
]

def scan_chunk(data: bytes | bytearray | memoryview, /) -> _ChunkScan | None: ...
def configure(
    chunk_info: type[tuple[object, ...]],
    usage: type[tuple[int, int, int, int | None]],
    kinds: tuple[object, object, object, object],
    /,
) -> None: ...
def fast_chunk(data: bytes, /) -> tuple[Any, int, int] | None: ...
def cut(data: bytes, start: int, end: int, /) -> bytes: ...
def configure_events(sse_event: type[tuple[object, ...]], /) -> None: ...

# sse.data_events, in C: the events (sse.SSEEvent) and where the rest of the read begins.
def data_events(data: bytes, max_event_size: int, /) -> tuple[list[Any], int]: ...
def chunk_payload(read: bytes, /) -> bytes | None: ...

# What `Lane.take` hands over: up offsets, down offsets, tokens per event (native int64 bytes;
# None: one each), their sum, choice 0's cumulative count, whether every event carried usage,
# the last usage (prompt, total, completion), the events without a token (empty texts), the
# tokens they carry to the next token event.
_Taken = tuple[bytes, bytes, bytes | None, int, int, bool, tuple[int, int, int] | None, int, int]
# What `Lane.take_end` hands over: how far it took a stream's end (END_*), the finish reason,
# the usage chunk's fingerprint, the finish chunk held for it (usage cut), where it was cut,
# and whether it is a token event (else its text is empty).
_TakenEnd = tuple[int, str, str | None, bytes | None, int, int]

class _Client(Protocol):
    def write(self, data: bytes, /) -> object: ...
    def get_write_buffer_size(self) -> int: ...
    def is_closing(self) -> bool: ...

class _Relay(Protocol):
    def on_client_full(self) -> object: ...
    def first_in_lane(
        self, model: str | None, response_id: str | None, other_events: int, first_token: bool, /
    ) -> object: ...
    def end_in_lane(
        self, out: bytes, at_ns: int, finish_reason: str, fingerprint: str | None, usage: bool, /
    ) -> object: ...

LANE_END_OK: int
LANE_END_FINGERPRINT_KNOWN: int
LANE_FIRST: int
END_FINISH: int
END_USAGE: int
END_DONE: int

class Lane:
    def __init__(
        self,
        client: _Client,
        relay: _Relay,
        origin_ns: int,
        high_water: int,
        max_event_bytes: int,
        strip: bool,
        drop_usage_chunk: bool = False,
        client_fd: int = -1,
    ) -> None: ...
    @property
    def armed(self) -> bool: ...
    @property
    def pending(self) -> int: ...
    @property
    def reads_taken(self) -> int: ...
    @property
    def events_handed(self) -> int: ...
    @property
    def last_read_ns(self) -> int: ...
    @property
    def end_stage(self) -> int: ...
    def relay(self, read: bytes, at_ns: int, /) -> bool: ...
    def arm(self, events_left: int, last_cumulative: int, end_flags: int = 0, /) -> None: ...
    def take(self) -> _Taken | None: ...
    def take_end(self) -> _TakenEnd | None: ...
    def close(self) -> None: ...
