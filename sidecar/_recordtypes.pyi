# The record's types in C (_recordtypes.c); record.py holds their specifications.
from collections.abc import Callable
from typing import Any

from sidecar.record import PyInt64s

Int64s = PyInt64s

def from_bytes(data: bytes, /) -> PyInt64s: ...
def untrack(obj: object, /) -> None: ...

class SlotsConstructor:
    def __init__(
        self,
        cls: type[Any],
        names: tuple[str, ...],
        defaults: tuple[object, ...],
        factories: tuple[Callable[[], object] | None, ...],
        missing: object,
        columns: tuple[str, ...] = (),
        optional_columns: tuple[str, ...] = (),
        /,
    ) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
