# The C pass over a request's or a response's header pairs (_headerblock.c); headers.py's
# `_kept_python` is its specification.
from collections.abc import Sequence
from types import EllipsisType

def kept(
    pairs: Sequence[tuple[bytes, bytes]], dropped: tuple[bytes, ...], /
) -> tuple[bytes, list[bytes] | None, list[bytes] | None, bool] | None: ...
def lowered_index(pairs: Sequence[tuple[bytes, bytes]], /) -> dict[bytes, bytes] | None: ...
def first_value(
    pairs: Sequence[tuple[bytes, bytes]], name: bytes, /
) -> bytes | None | EllipsisType: ...
