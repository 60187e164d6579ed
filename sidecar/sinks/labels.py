"""The cap on the distinct values of one metric label (attribute), shared by every sink.

Model names come from client request bodies and replica names from configuration: without a
cap one misbehaving client creates series without end. The Prometheus and OpenTelemetry sinks
apply this one rule, so a value reads the same in both.
"""

from __future__ import annotations

from typing import Final

OTHER: Final = "other"  # the value every value past the cap collapses to
MAX_VALUE_CHARS: Final = 128  # a longer value is OTHER: no 10 kB label values


class BoundedLabel:
    """Admits the first ``cap`` distinct values of one label; later ones read `OTHER`.

    The first values seen are kept as they are because they are the ones dashboards already
    show. A value takes a slot only when ``admit`` is true: the sinks pass whether the upstream
    confirmed the model (`RequestRecord.model_confirmed`), so that junk names (each a 404)
    cannot fill the cap and make the real model read `OTHER` for the life of the process.
    Values longer than ``max_chars`` are `OTHER` too. ``cap`` 0: every value is `OTHER`.
    """

    __slots__ = ("_admitted", "cap", "max_chars", "overflowed")

    def __init__(self, cap: int, max_chars: int = MAX_VALUE_CHARS) -> None:
        if cap < 0:
            raise ValueError(f"a label cap must be >= 0, got {cap}")
        self.cap = cap
        self.max_chars = max_chars
        self._admitted: set[str] = set()
        self.overflowed = 0  # observations that read OTHER

    def __call__(self, value: str, admit: bool = True) -> str:
        if value in self._admitted:
            return value
        if admit and len(self._admitted) < self.cap and len(value) <= self.max_chars:
            self._admitted.add(value)
            return value
        self.overflowed += 1
        return OTHER
