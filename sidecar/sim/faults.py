"""Fault injection for the simulator: parse and describe what should go wrong with one request.

Syntax (one header value or one ``--fault`` flag): faults separated by ``;``, each
``name=value``; whitespace around parts is ignored; ``none`` (or an empty value) means no fault.

    error_status=CODE        answer HTTP CODE with a vLLM-shaped error body, before any engine work
    error_event_after=K      after K token-carrying chunks, send a mid-stream error event and
                             ``[DONE]`` (non-streaming: HTTP 500 InternalServerError at that point)
    reset_after=K            after K token-carrying chunks, abort the TCP connection (RST)
    close_after=K            after K token-carrying chunks, end the HTTP body cleanly without
                             ``[DONE]`` (a truncated stream)
    stall_ms=MS[@after=K]    after K token-carrying chunks (default 0: before the first), write
                             nothing for MS milliseconds; the engine keeps generating, so the
                             tokens produced meanwhile arrive merged in the next chunk
    malformed_after=K        after K token-carrying chunks, write one event whose JSON is cut
                             short, then carry on normally
    slow_headers_ms=MS       hold the response headers back MS milliseconds (the engine starts
                             at once; outputs produced meanwhile are flushed after the headers)

K counts chunks that carry at least one token (role chunks, keep-alives and usage chunks are not
counted). Example: ``X-Sim-Fault: stall_ms=500@after=2; error_event_after=5``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FAULT_HEADER = "X-Sim-Fault"

_COUNT_FIELDS = (
    "error_event_after",
    "reset_after",
    "close_after",
    "malformed_after",
)


class FaultSpecError(ValueError):
    """The fault text does not follow the documented syntax."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    error_status: int | None = None
    error_event_after: int | None = None
    reset_after: int | None = None
    close_after: int | None = None
    stall_ms: float | None = None
    stall_after: int = 0
    malformed_after: int | None = None
    slow_headers_ms: float | None = None
    text: str = ""

    @property
    def is_empty(self) -> bool:
        return self == FaultSpec(text=self.text)


NO_FAULT = FaultSpec()


def _parse_count(name: str, value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        raise FaultSpecError(f"{name} needs an integer chunk count, got {value!r}") from None
    if count < 0:
        raise FaultSpecError(f"{name} must be >= 0, got {count}")
    return count


def _parse_ms(name: str, value: str) -> float:
    try:
        ms = float(value)
    except ValueError:
        raise FaultSpecError(f"{name} needs milliseconds, got {value!r}") from None
    if ms < 0:
        raise FaultSpecError(f"{name} must be >= 0, got {ms}")
    return ms


def parse_fault_spec(text: str) -> FaultSpec:
    """Parse ``name=value; name=value``; raise FaultSpecError on anything unknown."""
    stripped = text.strip()
    if not stripped or stripped.lower() == "none":
        return NO_FAULT
    values: dict[str, object] = {"text": stripped}
    for raw_part in stripped.split(";"):
        part = raw_part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        value = value.strip()
        if not sep or not value:
            raise FaultSpecError(f"fault {part!r} is not name=value")
        if name == "error_status":
            status = _parse_count(name, value)
            if not 400 <= status <= 599:
                raise FaultSpecError(f"error_status must be 400..599, got {status}")
            values[name] = status
        elif name in _COUNT_FIELDS:
            values[name] = _parse_count(name, value)
        elif name == "stall_ms":
            ms_text, at, after_text = value.partition("@")
            values["stall_ms"] = _parse_ms(name, ms_text.strip())
            if at:
                after_name, eq, count_text = after_text.partition("=")
                if after_name.strip().lower() != "after" or not eq:
                    raise FaultSpecError(f"stall_ms takes MS or MS@after=K, got {value!r}")
                values["stall_after"] = _parse_count("stall_ms@after", count_text.strip())
        elif name == "slow_headers_ms":
            values[name] = _parse_ms(name, value)
        else:
            raise FaultSpecError(f"unknown fault {name!r}")
    return FaultSpec(**values)  # type: ignore[arg-type]


class FaultPlan:
    """Which fault each request gets: its own header wins, else the global one with a probability.

    The random draw is seeded, so a run with the same seed and the same request order injects
    faults into the same requests.
    """

    def __init__(self, default: FaultSpec = NO_FAULT, rate: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be within [0, 1], got {rate}")
        self.default = default
        self.rate = rate
        self._random = random.Random(seed)

    def for_request(self, header_value: str | None) -> FaultSpec:
        if header_value is not None:
            return parse_fault_spec(header_value)
        if self.default.is_empty or self.rate <= 0.0:
            return NO_FAULT
        if self.rate >= 1.0 or self._random.random() < self.rate:
            return self.default
        return NO_FAULT
