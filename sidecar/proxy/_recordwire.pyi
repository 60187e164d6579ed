# The C encoder of a record's wire form (_recordwire.c); recordwire.py is its specification.
from sidecar.record import EngineTiming, Int64s, Outcome, RequestRecord, Timeline, TokenSource

def configure(
    outcome_index: dict[Outcome, int], source_index: dict[TokenSource, int], version: int, /
) -> None: ...
def encode(record: RequestRecord, /) -> bytes | None: ...
def configure_decoder(
    record: type[RequestRecord],
    timeline: type[Timeline],
    engine: type[EngineTiming],
    int64s: type[Int64s],
    wire_error: type[ValueError],
    outcomes: tuple[Outcome, ...],
    token_sources: tuple[TokenSource, ...],
    /,
) -> None: ...
def decode(data: bytes, /) -> RequestRecord | None: ...
