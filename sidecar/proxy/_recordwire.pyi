# The C encoder of a record's wire form (_recordwire.c); recordwire.py is its specification.
from collections.abc import Callable

from sidecar.record import EngineTiming, Int64s, Outcome, RequestRecord, Timeline, TokenSource

def configure(
    outcome_index: dict[Outcome, int], source_index: dict[TokenSource, int], version: int, /
) -> None: ...
def configure_slots(record: type[RequestRecord], timeline: type[Timeline], /) -> int: ...
def encode(record: RequestRecord, /) -> bytes | None: ...
def configure_decoder(
    record: Callable[..., RequestRecord],
    timeline: Callable[..., Timeline],
    engine: Callable[..., EngineTiming],
    column: Callable[[bytes], Int64s],
    wire_error: type[ValueError],
    outcomes: tuple[Outcome, ...],
    token_sources: tuple[TokenSource, ...],
    /,
) -> None: ...
def decode(data: bytes, /) -> RequestRecord | None: ...
