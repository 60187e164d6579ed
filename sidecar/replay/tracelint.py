"""``sidecar trace lint``: is this trace fit to replay?

Reads a sidecar trace file (plain or .gz) once, line by line (`TraceReader.lines`, which keeps
line numbers and unreadable lines), so that every finding can point at the lines to look at.

Lint rules (code, severity; each finding says what, where, how many and how to fix):

    unreadable-line        error    a line that is not JSON or not a request (missing t, ...)
    partial-last-line      warning  the last line was cut short (a crash mid-write); skipped
    t-not-finite           error    t is NaN or infinite
    t-negative             error    t < 0
    t-absurd               error    t beyond a year: wrong units or an unrebased clock
    t-non-monotonic        warning  a request earlier than one before it (count, worst jump)
    t-large-start          warning  the first request comes more than a day after t = 0
    t-looks-like-ms        warning  median inter-arrival > 1000 s, or every t a whole number
                                    with t > 1e6: t in ms read as s?
    cannot-replay          warning  `sidecar replay` skips the line (no captured body and n_in
                                    missing or 0, or neither n_out nor max_tokens): the same
                                    rule replay applies (`tracefile.unreplayable_reason`)
    nothing-to-replay      error    every line is cannot-replay: replay refuses the trace
    length-missing         warning  n_in or n_out absent on a line replay can still send (its
                                    work is not reproduced exactly)
    length-negative        error    n_in, n_out, n_cached or max_tokens < 0
    length-absurd          error    n_in or n_out above 10M tokens
    n-cached-over-n-in     error    more cached prompt tokens than prompt tokens
    lengths-look-like-chars warning median n_in > 32k and median n_out > 4k, or n_in 2.5-8x
                                    what the token prefix blocks cover: characters, not tokens?
    prefix-size-mismatch   error    unit "tokens": len(hashes) != ceil(n_in / size), the
                                    convention of Mooncake and Bailian (the last, partial
                                    block has a hash too)
    over-max-model-len     error    n_in + the longest choice's output > --max-model-len (a
                                    choice: max(n_out / n, max_tokens); n_out counts all n)
    max-tokens-below-n-out warning  max_tokens x n < n_out: the replay cannot reach n_out
    empty-prompt           warning  n_in = 0 on a line sent with its captured body
    zero-output            warning  n_out = 0 on a request not marked failed_in_source
    duplicate              warning  a request identical to another at the same t
    unknown-endpoint       error    endpoint other than "chat" / "completions"

Memory: t, n_in and n_out of every request in compact arrays (about 24 bytes a request) for
medians; duplicate detection keeps one hash per request of the current t only.
"""

from __future__ import annotations

import math
import os
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sidecar.tracefile import PrefixBlocks, TraceReader, TraceRequest, unreplayable_reason

ERROR = "error"
WARNING = "warning"
MAX_EXAMPLES = 5
ENDPOINTS = ("chat", "completions")
FAILED_IN_SOURCE = "failed_in_source"
ABSURD_T_S = 366 * 86400.0
ABSURD_TOKENS = 10_000_000
MS_MEDIAN_GAP_S = 1000.0
MS_INTEGER_T = 1e6
LARGE_START_S = 86400.0


@dataclass(slots=True)
class Finding:
    """One lint rule that fired: what, where (line examples), how many, and how to fix."""

    code: str
    severity: str
    what: str
    fix: str
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, example: str) -> None:
        self.count += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(example)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity,
            "what": self.what,
            "count": self.count,
            "examples": list(self.examples),
            "fix": self.fix,
        }

    def format(self) -> str:
        where = "; ".join(self.examples)
        more = (
            f" (+{self.count - len(self.examples)} more)" if self.count > len(self.examples) else ""
        )
        return (
            f"{self.severity}: {self.code}: {self.what} [{self.count} "
            f"{'time' if self.count == 1 else 'times'}]\n"
            f"    where: {where}{more}\n    fix: {self.fix}"
        )


@dataclass(frozen=True, slots=True)
class LintReport:
    path: str
    requests: int
    findings: tuple[Finding, ...]

    @property
    def errors(self) -> int:
        return sum(1 for f in self.findings if f.severity == ERROR)

    @property
    def warnings(self) -> int:
        return sum(1 for f in self.findings if f.severity == WARNING)

    @property
    def exit_code(self) -> int:
        return 1 if self.errors else 0

    def codes(self) -> set[str]:
        return {f.code for f in self.findings}

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "requests": self.requests,
            "errors": self.errors,
            "warnings": self.warnings,
            "findings": [f.to_dict() for f in self.findings],
        }

    def format(self) -> str:
        lines = [f.format() for f in self.findings]
        verdict = (
            "clean" if not self.findings else f"{self.errors} error(s), {self.warnings} warning(s)"
        )
        lines.append(f"{self.path}: {self.requests} requests: {verdict}")
        return "\n".join(lines)


# code -> (severity, what, fix)
RULES: dict[str, tuple[str, str, str]] = {
    "unreadable-line": (
        ERROR,
        "line is not a readable request",
        "repair or delete the line; re-import or re-capture if many are bad",
    ),
    "partial-last-line": (
        WARNING,
        "the last line is cut short (a crash mid-write?); readers skip it",
        "nothing, if losing that request is fine; else re-capture",
    ),
    "t-not-finite": (ERROR, "t is NaN or infinite", "fix the arrival time of these lines"),
    "t-negative": (
        ERROR,
        "t is negative (seconds since the trace start)",
        "rebase t so the first request is at t = 0",
    ),
    "t-absurd": (
        ERROR,
        f"t beyond a year ({ABSURD_T_S:g} s)",
        "t must be seconds since the trace start: check the units (ms? us?) and that "
        "the clock was rebased; re-import with the right --format or --time-scale",
    ),
    "t-non-monotonic": (
        WARNING,
        "request earlier than one before it (t not sorted)",
        "sort the lines by t (sidecar trace import sorts by default); a "
        "replayer that sends in file order would send these late",
    ),
    "t-large-start": (
        WARNING,
        f"the first request comes more than {LARGE_START_S:g} s after "
        "t = 0: a replay would idle that long first",
        "rebase t so the first request is at t = 0",
    ),
    "t-looks-like-ms": (
        WARNING,
        "t looks like milliseconds, not seconds",
        "re-import with the right units, or scale t by 0.001 "
        "(sidecar trace import --time-scale 0.001)",
    ),
    "cannot-replay": (
        WARNING,
        "sidecar replay skips these lines: it cannot rebuild their requests",
        "nothing, if they are requests that failed before the server counted "
        "their prompt (a 404 for a mistyped model); else fill in n_in (and n_out "
        "or max_tokens), or capture with --capture-text so bodies are sent as "
        "captured",
    ),
    "nothing-to-replay": (
        ERROR,
        "no line can be replayed: sidecar replay refuses this trace",
        "see cannot-replay: every line lacks a prompt size or an output length",
    ),
    "length-missing": (
        WARNING,
        "n_in or n_out is missing",
        "a replay sends these lines but cannot reproduce their work exactly; "
        "fill in the lengths or drop the lines",
    ),
    "length-negative": (
        ERROR,
        "a token count is negative",
        "fix the lengths (n_in, n_out, n_cached, max_tokens are token counts)",
    ),
    "length-absurd": (
        ERROR,
        f"n_in or n_out above {ABSURD_TOKENS:,} tokens",
        "check the units (bytes? characters?) and the source columns",
    ),
    "n-cached-over-n-in": (
        ERROR,
        "n_cached exceeds n_in",
        "n_cached counts prompt tokens served from cache: at most n_in",
    ),
    "lengths-look-like-chars": (
        WARNING,
        "lengths look like characters or bytes, not tokens",
        "convert to tokens (about 4 characters a token in English) or "
        "re-import from a token-count column",
    ),
    "prefix-size-mismatch": (
        ERROR,
        "len(prefix.hashes) != ceil(n_in / prefix.size)",
        "the declared block size does not match the hashes (Mooncake "
        "hash_ids are 512-token blocks, Bailian 16): re-import with the "
        "right --format, or fix prefix.size",
    ),
    "over-max-model-len": (
        ERROR,
        "n_in + the longest choice's output (max(n_out / n, max_tokens)) exceeds --max-model-len",
        "the server will refuse these (HTTP 400): drop them, cap max_tokens, "
        "or serve with a larger --max-model-len",
    ),
    "max-tokens-below-n-out": (
        WARNING,
        "max_tokens x n < n_out: a replay cannot reach n_out "
        "(n_out counts the tokens of all n choices)",
        "set max_tokens = n_out / n (and ignore_eos) to reproduce lengths",
    ),
    "empty-prompt": (
        WARNING,
        "n_in = 0 on a line sent with its captured body (vLLM refuses an empty prompt)",
        "drop these requests or give them a prompt length",
    ),
    "zero-output": (
        WARNING,
        "n_out = 0 on a request not marked failed_in_source",
        "mark failed requests with outcome failed_in_source, or drop them",
    ),
    "duplicate": (
        WARNING,
        "request identical to another one at the same t",
        "look for a doubled import or a join that repeated rows; drop the copies",
    ),
    "unknown-endpoint": (
        ERROR,
        "endpoint is not 'chat' or 'completions'",
        "set endpoint to 'chat' or 'completions'",
    ),
}


class _Findings:
    def __init__(self) -> None:
        self.by_code: dict[str, Finding] = {}

    def add(self, code: str, example: str, *, what: str | None = None) -> None:
        finding = self.by_code.get(code)
        if finding is None:
            severity, default_what, fix = RULES[code]
            finding = Finding(code, severity, what or default_what, fix)
            self.by_code[code] = finding
        finding.add(example)

    def ordered(self) -> tuple[Finding, ...]:
        order = list(RULES)
        return tuple(
            sorted(self.by_code.values(), key=lambda f: (f.severity != ERROR, order.index(f.code)))
        )


def _check_lengths(
    found: _Findings, line: int, request: TraceRequest, max_model_len: int | None
) -> bool:
    """Length findings of one line; False when replay cannot send it (cannot-replay)."""
    where = f"line {line}"
    reason = unreplayable_reason(request)
    if reason is not None:
        # The line is reported as replay reports it; its missing or zero lengths are the
        # reason, not findings of their own.
        found.add("cannot-replay", f"{where}: {reason}")
    elif request.n_in is None or request.n_out is None:
        missing = " and ".join(n for n in ("n_in", "n_out") if getattr(request, n) is None)
        found.add("length-missing", f"{where}: no {missing}")
    for name in ("n_in", "n_out", "n_cached", "max_tokens"):
        value = getattr(request, name)
        if value is not None and value < 0:
            found.add("length-negative", f"{where}: {name}={value}")
    for name in ("n_in", "n_out"):
        value = getattr(request, name)
        if value is not None and value > ABSURD_TOKENS:
            found.add("length-absurd", f"{where}: {name}={value}")
    if (
        request.n_in is not None
        and request.n_cached is not None
        and request.n_cached > request.n_in >= 0
    ):
        found.add(
            "n-cached-over-n-in", f"{where}: n_cached={request.n_cached} > n_in={request.n_in}"
        )
    if request.n_in == 0 and reason is None:
        found.add("empty-prompt", where)
    if request.n_out == 0 and request.outcome != FAILED_IN_SOURCE:
        found.add("zero-output", where)
    # n_out counts the tokens of all n choices; max_tokens bounds each choice.
    choices = max(1, request.n)
    if (
        request.max_tokens is not None
        and request.n_out is not None
        and 0 <= request.max_tokens * choices < request.n_out
    ):
        times_n = f" x n={choices}" if choices > 1 else ""
        found.add(
            "max-tokens-below-n-out",
            f"{where}: max_tokens={request.max_tokens}{times_n} < n_out={request.n_out}",
        )
    if max_model_len is not None and request.n_in is not None:
        output = max(math.ceil((request.n_out or 0) / choices), request.max_tokens or 0)
        if request.n_in + output > max_model_len:
            found.add(
                "over-max-model-len",
                f"{where}: {request.n_in} + {output} = {request.n_in + output} > {max_model_len}",
            )
    return reason is None


def _check_prefix(
    found: _Findings,
    line: int,
    prefix: PrefixBlocks,
    n_in: int | None,
    covered_ratios: array[float],
) -> None:
    # (A unit other than tokens/chars, or a size <= 0, is refused by PrefixBlocks.from_dict:
    # such a line is reported as unreadable-line with that reason.)
    if prefix.unit != "tokens" or n_in is None or n_in < 0:
        return
    blocks = len(prefix.hashes)
    if blocks:
        covered_ratios.append(n_in / (blocks * prefix.size))
    if blocks == math.ceil(n_in / prefix.size):  # the last, partial block is hashed too
        return
    implied = f"; n_in / len(hashes) = {n_in / blocks:.0f} tokens a block" if blocks else ""
    found.add(
        "prefix-size-mismatch",
        f"line {line}: {blocks} hashes of size {prefix.size} for n_in={n_in} (expected "
        f"{math.ceil(n_in / prefix.size)}{implied})",
    )


class _TimeChecks:
    """The findings on the lines' t, one line after the other: its value, its order, and
    lines repeated at one t."""

    def __init__(self) -> None:
        self.times = array("d")
        self.latest_t = -math.inf
        self.latest_line = 0
        self.worst_back: tuple[float, int] = (0.0, 0)  # (seconds back, line)
        self.same_t: float | None = None
        self.same_t_seen: dict[int, int] = {}  # hash of the line -> line number, at t == same_t

    def check(self, found: _Findings, line: int, t: float, text: str) -> None:
        if not math.isfinite(t):
            found.add("t-not-finite", f"line {line}: t={t}")
            return
        self.times.append(t)
        if t < 0:
            found.add("t-negative", f"line {line}: t={t:g}")
        if t > ABSURD_T_S:
            found.add("t-absurd", f"line {line}: t={t:g} s ({t / 86400:.0f} days)")
        if t < self.latest_t:
            found.add(
                "t-non-monotonic",
                f"line {line}: t={t:g} after t={self.latest_t:g} "
                f"(line {self.latest_line}), {self.latest_t - t:g} s back",
            )
            self.worst_back = max(self.worst_back, (self.latest_t - t, line))
        else:
            self.latest_t, self.latest_line = t, line
        if t != self.same_t:
            self.same_t, self.same_t_seen = t, {}
        # Writers serialise deterministically, so equal requests are equal lines; a 64-bit
        # hash keeps memory small when many requests share one t (a false match ~ 1e-8).
        identity = hash(text)
        if identity in self.same_t_seen:
            found.add("duplicate", f"line {line} = line {self.same_t_seen[identity]}")
        else:
            self.same_t_seen[identity] = line


def lint_trace(path: str | os.PathLike[str], max_model_len: int | None = None) -> LintReport:
    """Every finding of `RULES` in one pass over the file (TraceFormatError: no header)."""
    found = _Findings()
    reader = TraceReader(path)  # a file that is not a trace fails here, with the reason
    times = _TimeChecks()
    n_in_values = array("q")
    n_out_values = array("q")
    covered_ratios = array("d")  # n_in / tokens covered by the prefix blocks
    requests = 0
    unreplayable = 0
    for entry in reader.lines():
        if entry.request is None:
            code = "partial-last-line" if entry.partial else "unreadable-line"
            found.add(code, f"line {entry.line}: {entry.error}")
            continue
        request = entry.request
        requests += 1
        line = entry.line
        if request.endpoint not in ENDPOINTS:
            found.add("unknown-endpoint", f"line {line}: {request.endpoint!r}")
        if not _check_lengths(found, line, request, max_model_len):
            unreplayable += 1
        if request.prefix is not None:
            _check_prefix(found, line, request.prefix, request.n_in, covered_ratios)
        if request.n_in is not None:
            n_in_values.append(request.n_in)
        if request.n_out is not None:
            n_out_values.append(request.n_out)
        times.check(found, line, request.t, entry.text)
    _check_units(found, times.times)
    _check_char_lengths(found, n_in_values, n_out_values, covered_ratios)
    if requests and unreplayable == requests:
        found.add("nothing-to-replay", f"all {requests} request lines are cannot-replay")
    if "t-non-monotonic" in found.by_code:
        finding = found.by_code["t-non-monotonic"]
        worst_back = times.worst_back
        finding.what += f"; worst jump back {worst_back[0]:g} s (line {worst_back[1]})"
    return LintReport(str(path), requests, found.ordered())


def _check_units(found: _Findings, times: array[float]) -> None:
    if not times:
        return
    values = np.frombuffer(times, dtype=np.float64)
    first = float(values.min())
    if first > LARGE_START_S:
        found.add("t-large-start", f"first request at t={first:g} s ({first / 86400:.1f} days)")
    if values.size >= 3:
        gaps = np.diff(np.sort(values))
        median_gap = float(np.median(gaps))
        if median_gap > MS_MEDIAN_GAP_S:
            found.add(
                "t-looks-like-ms",
                f"median inter-arrival {median_gap:g} s over {values.size} requests",
            )
            return
    whole = bool(np.all(values == np.floor(values)))
    if values.size >= 2 and whole and float(values.max()) > MS_INTEGER_T:
        found.add(
            "t-looks-like-ms",
            f"every t is a whole number and the largest is {float(values.max()):g}",
        )


def _check_char_lengths(
    found: _Findings,
    n_in_values: array[int],
    n_out_values: array[int],
    covered_ratios: array[float],
) -> None:
    if n_in_values and n_out_values:
        median_in = float(np.median(np.frombuffer(n_in_values, dtype=np.int64)))
        median_out = float(np.median(np.frombuffer(n_out_values, dtype=np.int64)))
        if median_in > 32768 and median_out > 4096:
            found.add(
                "lengths-look-like-chars", f"median n_in {median_in:g}, median n_out {median_out:g}"
            )
    if covered_ratios:
        ratio = float(np.median(np.frombuffer(covered_ratios, dtype=np.float64)))
        if 2.5 <= ratio <= 8:
            found.add(
                "lengths-look-like-chars",
                f"median n_in is {ratio:.1f}x the tokens the prefix blocks cover "
                f"({len(covered_ratios)} requests with token blocks)",
            )
