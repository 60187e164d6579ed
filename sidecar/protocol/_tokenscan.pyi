from collections.abc import Callable

# The C scanner (_tokenscan.c); fastchunk.TokenScan names the parts of its answer.
_Scan = tuple[int, int | None, int | None, int | None, int, int, int, int, int]

def scan(data: bytes | bytearray | memoryview, /) -> _Scan | None: ...
def cut(data: bytes, start: int, end: int, /) -> bytes: ...
def chunk_payload(read: bytes, /) -> bytes | None: ...

# What `Lane.take` hands over: up offsets, down offsets, tokens per event (native int64 bytes;
# None: one each), their sum, choice 0's cumulative count, whether every event carried usage,
# the last usage (prompt, total, completion).
_Taken = tuple[bytes, bytes, bytes | None, int, int, bool, tuple[int, int, int] | None]

class Lane:
    def __init__(
        self,
        write: Callable[[bytes], object],
        buffer_size: Callable[[], int],
        is_closing: Callable[[], bool],
        on_full: Callable[[], object],
        timeouts: object,
        origin_ns: int,
        high_water: int,
        max_event_bytes: int,
        strip: bool,
    ) -> None: ...
    @property
    def armed(self) -> bool: ...
    @property
    def pending(self) -> int: ...
    def relay(self, read: bytes, at_ns: int, /) -> bool: ...
    def arm(self, events_left: int, last_cumulative: int, /) -> None: ...
    def take(self) -> _Taken | None: ...
    def close(self) -> None: ...
