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
    split_end_ms=MS          write a stream's end in four turns MS milliseconds apart: the last
                             token chunk, the usage chunk, ``[DONE]``, the body's last chunk
                             (a real vLLM's end often reaches a proxy in several reads; the
                             simulator otherwise writes it in one turn)

K counts chunks that carry at least one token (role chunks, keep-alives and usage chunks are not
counted). Example: ``X-Sim-Fault: stall_ms=500@after=2; error_event_after=5``.

Below the syntax, how a fault is served: `request_fault` and `status_error` before any engine
work, then a `FaultInjector` while the answer is written (sidecar.sim.answers calls it at the
points the faults above name).
"""

from __future__ import annotations

import asyncio
import http
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from sidecar.sim.requests import (
    BAD_REQUEST_ERROR,
    ENGINE_DEAD_MESSAGE,
    GENERATION_ERROR_MESSAGE,
    RequestError,
    bad_request,
)
from sidecar.sim.shapes import DONE_EVENT, StreamFormatter

if TYPE_CHECKING:  # annotations only: `sidecar sim --help` needs FAULT_HEADER, not aiohttp
    from aiohttp import web

    from sidecar.sim.groundtruth import GroundTruthRecord

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
    split_end_ms: float | None = None
    text: str = ""

    @property
    def is_empty(self) -> bool:
        return self == FaultSpec(text=self.text)


NO_FAULT = FaultSpec()


_Number = TypeVar("_Number", int, float)


def _parse_non_negative(
    name: str, value: str, convert: Callable[[str], _Number], what: str
) -> _Number:
    try:
        number = convert(value)
    except ValueError:
        raise FaultSpecError(f"{name} needs {what}, got {value!r}") from None
    if number < 0:
        raise FaultSpecError(f"{name} must be >= 0, got {number}")
    return number


def _parse_count(name: str, value: str) -> int:
    return _parse_non_negative(name, value, int, "an integer chunk count")


def _parse_ms(name: str, value: str) -> float:
    return _parse_non_negative(name, value, float, "milliseconds")


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
        elif name in ("slow_headers_ms", "split_end_ms"):
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


# ---------------------------------------------------------------------- serving a fault

# Error `type` for an injected error status: vLLM's names where it has one, else the phrase.
_ERROR_TYPES = {
    400: BAD_REQUEST_ERROR,
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "Service Unavailable",
}


class ResetConnection(Exception):
    """Raised inside a handler after a fault aborted the TCP connection."""


def request_fault(plan: FaultPlan, header_value: str | None) -> FaultSpec:
    """The fault of one request; a fault header that does not parse is the request's 400."""
    try:
        return plan.for_request(header_value)
    except FaultSpecError as exc:
        raise bad_request(f"Invalid {FAULT_HEADER} header: {exc}") from None


def status_error(fault: FaultSpec) -> RequestError | None:
    """``error_status=CODE``: the vLLM-shaped error to answer instead of any engine work."""
    code = fault.error_status
    if code is None:
        return None
    message = ENGINE_DEAD_MESSAGE if code == 500 else f"Simulated HTTP {code} error"
    err_type = _ERROR_TYPES.get(code) or http.HTTPStatus(code).phrase
    return RequestError(code, message, err_type)


class FaultInjector:
    """Serves one request's (non-empty) fault while its answer is written.

    ``written`` is what the answer has written so far: token-carrying chunks for a stream, the
    engine outputs collected for a whole answer. ``abort(reason)`` stops the request's engine
    work; the ground-truth ``record`` (if any) gets the outcome a fault causes.
    """

    __slots__ = (
        "spec",
        "cut_body",
        "_request",
        "_record",
        "_abort",
        "_stall_pending",
        "_malformed_pending",
    )

    def __init__(
        self,
        spec: FaultSpec,
        request: web.Request,
        record: GroundTruthRecord | None,
        abort: Callable[[str], None],
    ) -> None:
        self.spec = spec
        self.cut_body = False  # a whole answer: send half of the body
        self._request = request
        self._record = record
        self._abort = abort
        self._stall_pending = spec.stall_ms is not None
        self._malformed_pending = spec.malformed_after is not None

    async def delay_headers(self) -> None:
        if self.spec.slow_headers_ms:
            await asyncio.sleep(self.spec.slow_headers_ms / 1000)

    async def end_gap(self) -> None:
        """``split_end_ms``: a pause between two of a stream's last writes."""
        if self.spec.split_end_ms is not None:
            await asyncio.sleep(self.spec.split_end_ms / 1000)

    async def stall(self, written: int) -> None:
        if self._stall_pending and written >= self.spec.stall_after:
            self._stall_pending = False
            # Silence on the wire while the engine keeps going: what piles up meanwhile goes
            # out merged in the next chunk.
            await asyncio.sleep((self.spec.stall_ms or 0.0) / 1000)

    def _reset_if_due(self, written: int) -> None:
        reset_after = self.spec.reset_after
        if reset_after is not None and written >= reset_after:
            if self._record is not None:
                self._record.outcome = "reset"
            self._abort("abort")
            transport = self._request.transport
            if transport is not None:
                transport.abort()
            raise ResetConnection()

    async def before_stream_chunk(
        self,
        response: web.StreamResponse,
        formatter: StreamFormatter,
        written: int,
        choice_index: int,
    ) -> bool:
        """Apply what is due before token chunk ``written + 1``; True if the answer ended."""
        self._reset_if_due(written)
        spec = self.spec
        record = self._record
        if spec.error_event_after is not None and written >= spec.error_event_after:
            self._abort("error")
            await response.write(
                formatter.error_event(GENERATION_ERROR_MESSAGE, "InternalServerError", 500)
            )
            if record is not None:
                record.stamp(0, "error")
            await response.write(DONE_EVENT)
            if record is not None:
                record.stamp(0, "done")
                record.outcome = "error_event"
            await response.write_eof()
            return True
        if spec.close_after is not None and written >= spec.close_after:
            self._abort("abort")
            if record is not None:
                record.outcome = "truncated"
            await response.write_eof()
            return True
        if self._malformed_pending and written >= (spec.malformed_after or 0):
            self._malformed_pending = False
            await response.write(formatter.malformed_event(choice_index))
            if record is not None:
                record.stamp(0, "malformed")
        return False

    def before_whole_output(self, written: int) -> None:
        """Apply what is due before a whole answer's engine output ``written + 1``: a reset or
        an error now (raised), or a body to cut when it is sent."""
        self._reset_if_due(written)
        spec = self.spec
        if spec.error_event_after is not None and written >= spec.error_event_after:
            self._abort("error")
            raise RequestError(500, GENERATION_ERROR_MESSAGE, "InternalServerError")
        for cut_after in (spec.close_after, spec.malformed_after):
            if cut_after is not None and written >= cut_after:
                self.cut_body = True

    def cut(self, body: bytes) -> bytes:
        """A whole answer's body as sent: half of it after a close or malformed fault."""
        if not self.cut_body:
            return body
        if self._record is not None:
            self._record.outcome = "truncated"
        return body[: len(body) // 2]
