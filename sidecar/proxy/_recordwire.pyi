# The C encoder of a record's wire form (_recordwire.c); recordwire.py is its specification.
from sidecar.record import Outcome, RequestRecord, TokenSource

def configure(
    outcome_index: dict[Outcome, int], source_index: dict[TokenSource, int], version: int, /
) -> None: ...
def encode(record: RequestRecord, /) -> bytes | None: ...
