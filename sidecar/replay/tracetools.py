"""Trace tools: ``lint`` (is this trace fit to replay?) and ``stats`` (what load is in it?).

Both read a sidecar trace file (plain or .gz) once, line by line, and keep line numbers so
that every finding can point at the lines to look at.

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

Stats: duration, request count, arrivals per bin (the bin is chosen from the duration: ~60
bins of a round width), mean and peak rate, burstiness (CV of the inter-arrival times: 1 for
Poisson, 0 for a constant rate), n_in / n_out distributions (p50/p90/p99/max/mean; numpy's
linear percentiles, as `sidecar.stats`), prefix reuse (see `PrefixReuse`), sessions, models,
endpoints and outcomes.

Memory: lint and stats keep t, n_in and n_out of every request in compact arrays (about 24
bytes a request) for medians and percentiles; prefix reuse keeps one entry per distinct block
(the cache an infinite prefix cache would need); duplicate detection keeps one hash per request
of the current t only.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from array import array
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from sidecar.stats import summarize
from sidecar.tracefile import (
    FORMAT_VERSION,
    MIGRATIONS,
    PrefixBlocks,
    TraceFormatError,
    TraceHeader,
    TraceReader,
    TraceRequest,
    unreplayable_reason,
)

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
TARGET_BINS = 60
NICE_BINS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0,
               30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 7200.0, 10800.0,
               21600.0, 43200.0, 86400.0, 172800.0, 604800.0)


# ---------------------------------------------------------------------------------------------
# Reading with line numbers


@dataclass(frozen=True, slots=True)
class TraceLine:
    """One request line: its number in the file, and the request or why it is unreadable."""

    line: int
    request: TraceRequest | None
    error: str | None = None
    partial: bool = False  # the unreadable last line of a file cut short
    text: str = ""  # the line as written (duplicate detection compares lines, not objects)


def _open_trace(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115 - caller closes


def read_header(path: str | os.PathLike[str]) -> TraceHeader:
    """The header (TraceFormatError when the file is not a sidecar trace this build reads)."""
    return TraceReader(path).header


def iter_trace_lines(path: str | os.PathLike[str]) -> Iterator[TraceLine]:
    """Every request line with its line number (header = line 1); unreadable lines included.

    Like `TraceReader`, but a bad line is reported and reading goes on, so that lint can list
    every bad line rather than stop at the first.
    """
    trace_path = Path(path)
    version = TraceReader(trace_path).header.version
    pending: TraceLine | None = None
    line_no = 1
    try:
        with _open_trace(trace_path) as handle:
            handle.readline()
            for text in handle:
                line_no += 1
                if pending is not None:
                    yield pending
                    pending = None
                if not text.strip():
                    continue
                try:
                    data = json.loads(text)
                except json.JSONDecodeError as exc:
                    # Unreadable unless it is the last line: then a crash cut it short.
                    pending = TraceLine(line_no, None, f"not valid JSON ({exc.msg})")
                    continue
                try:
                    if not isinstance(data, dict):
                        raise TraceFormatError("not a JSON object")
                    for step in range(version, FORMAT_VERSION):  # as TraceReader migrates
                        data = MIGRATIONS[step](data)
                    yield TraceLine(line_no, TraceRequest.from_dict(data), text=text.strip())
                except (TraceFormatError, TypeError, ValueError, KeyError) as exc:
                    yield TraceLine(line_no, None, str(exc) or type(exc).__name__)
    except (EOFError, gzip.BadGzipFile, OSError):
        if pending is not None:
            yield pending
        yield TraceLine(line_no, None, "compressed stream ends early", partial=True)
        return
    if pending is not None:
        yield TraceLine(pending.line, None, pending.error, partial=True)


# ---------------------------------------------------------------------------------------------
# Lint


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
        return {"code": self.code, "severity": self.severity, "what": self.what,
                "count": self.count, "examples": list(self.examples), "fix": self.fix}

    def format(self) -> str:
        where = "; ".join(self.examples)
        more = f" (+{self.count - len(self.examples)} more)" if self.count > len(self.examples) \
            else ""
        return (f"{self.severity}: {self.code}: {self.what} [{self.count} "
                f"{'time' if self.count == 1 else 'times'}]\n"
                f"    where: {where}{more}\n    fix: {self.fix}")


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
        return {"path": self.path, "requests": self.requests, "errors": self.errors,
                "warnings": self.warnings, "findings": [f.to_dict() for f in self.findings]}

    def format(self) -> str:
        lines = [f.format() for f in self.findings]
        verdict = ("clean" if not self.findings
                   else f"{self.errors} error(s), {self.warnings} warning(s)")
        lines.append(f"{self.path}: {self.requests} requests: {verdict}")
        return "\n".join(lines)


# code -> (severity, what, fix)
RULES: dict[str, tuple[str, str, str]] = {
    "unreadable-line": (ERROR, "line is not a readable request",
                        "repair or delete the line; re-import or re-capture if many are bad"),
    "partial-last-line": (WARNING, "the last line is cut short (a crash mid-write?); readers "
                          "skip it", "nothing, if losing that request is fine; else re-capture"),
    "t-not-finite": (ERROR, "t is NaN or infinite", "fix the arrival time of these lines"),
    "t-negative": (ERROR, "t is negative (seconds since the trace start)",
                   "rebase t so the first request is at t = 0"),
    "t-absurd": (ERROR, f"t beyond a year ({ABSURD_T_S:g} s)",
                 "t must be seconds since the trace start: check the units (ms? us?) and that "
                 "the clock was rebased; re-import with the right --format or --time-scale"),
    "t-non-monotonic": (WARNING, "request earlier than one before it (t not sorted)",
                        "sort the lines by t (sidecar trace import sorts by default); a "
                        "replayer that sends in file order would send these late"),
    "t-large-start": (WARNING, f"the first request comes more than {LARGE_START_S:g} s after "
                      "t = 0: a replay would idle that long first",
                      "rebase t so the first request is at t = 0"),
    "t-looks-like-ms": (WARNING, "t looks like milliseconds, not seconds",
                        "re-import with the right units, or scale t by 0.001 "
                        "(sidecar trace import --time-scale 0.001)"),
    "cannot-replay": (WARNING, "sidecar replay skips these lines: it cannot rebuild their "
                      "requests",
                      "nothing, if they are requests that failed before the server counted "
                      "their prompt (a 404 for a mistyped model); else fill in n_in (and n_out "
                      "or max_tokens), or capture with --capture-text so bodies are sent as "
                      "captured"),
    "nothing-to-replay": (ERROR, "no line can be replayed: sidecar replay refuses this trace",
                          "see cannot-replay: every line lacks a prompt size or an output "
                          "length"),
    "length-missing": (WARNING, "n_in or n_out is missing",
                       "a replay sends these lines but cannot reproduce their work exactly; "
                       "fill in the lengths or drop the lines"),
    "length-negative": (ERROR, "a token count is negative",
                        "fix the lengths (n_in, n_out, n_cached, max_tokens are token counts)"),
    "length-absurd": (ERROR, f"n_in or n_out above {ABSURD_TOKENS:,} tokens",
                      "check the units (bytes? characters?) and the source columns"),
    "n-cached-over-n-in": (ERROR, "n_cached exceeds n_in",
                           "n_cached counts prompt tokens served from cache: at most n_in"),
    "lengths-look-like-chars": (WARNING, "lengths look like characters or bytes, not tokens",
                                "convert to tokens (about 4 characters a token in English) or "
                                "re-import from a token-count column"),
    "prefix-size-mismatch": (ERROR, "len(prefix.hashes) != ceil(n_in / prefix.size)",
                             "the declared block size does not match the hashes (Mooncake "
                             "hash_ids are 512-token blocks, Bailian 16): re-import with the "
                             "right --format, or fix prefix.size"),
    "over-max-model-len": (ERROR, "n_in + the longest choice's output (max(n_out / n, "
                           "max_tokens)) exceeds --max-model-len",
                           "the server will refuse these (HTTP 400): drop them, cap max_tokens, "
                           "or serve with a larger --max-model-len"),
    "max-tokens-below-n-out": (WARNING, "max_tokens x n < n_out: a replay cannot reach n_out "
                               "(n_out counts the tokens of all n choices)",
                               "set max_tokens = n_out / n (and ignore_eos) to reproduce "
                               "lengths"),
    "empty-prompt": (WARNING, "n_in = 0 on a line sent with its captured body (vLLM refuses "
                     "an empty prompt)",
                     "drop these requests or give them a prompt length"),
    "zero-output": (WARNING, "n_out = 0 on a request not marked failed_in_source",
                    "mark failed requests with outcome failed_in_source, or drop them"),
    "duplicate": (WARNING, "request identical to another one at the same t",
                  "look for a doubled import or a join that repeated rows; drop the copies"),
    "unknown-endpoint": (ERROR, "endpoint is not 'chat' or 'completions'",
                         "set endpoint to 'chat' or 'completions'"),
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
        return tuple(sorted(self.by_code.values(),
                            key=lambda f: (f.severity != ERROR, order.index(f.code))))


def _check_lengths(found: _Findings, line: int, request: TraceRequest,
                   max_model_len: int | None) -> bool:
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
    if request.n_in is not None and request.n_cached is not None \
            and request.n_cached > request.n_in >= 0:
        found.add("n-cached-over-n-in", f"{where}: n_cached={request.n_cached} > "
                  f"n_in={request.n_in}")
    if request.n_in == 0 and reason is None:
        found.add("empty-prompt", where)
    if request.n_out == 0 and request.outcome != FAILED_IN_SOURCE:
        found.add("zero-output", where)
    # n_out counts the tokens of all n choices; max_tokens bounds each choice.
    choices = max(1, request.n)
    if request.max_tokens is not None and request.n_out is not None \
            and 0 <= request.max_tokens * choices < request.n_out:
        times_n = f" x n={choices}" if choices > 1 else ""
        found.add("max-tokens-below-n-out", f"{where}: max_tokens={request.max_tokens}"
                  f"{times_n} < n_out={request.n_out}")
    if max_model_len is not None and request.n_in is not None:
        output = max(math.ceil((request.n_out or 0) / choices), request.max_tokens or 0)
        if request.n_in + output > max_model_len:
            found.add("over-max-model-len", f"{where}: {request.n_in} + {output} = "
                      f"{request.n_in + output} > {max_model_len}")
    return reason is None


def _check_prefix(found: _Findings, line: int, prefix: PrefixBlocks, n_in: int | None,
                  covered_ratios: array[float]) -> None:
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
    found.add("prefix-size-mismatch",
              f"line {line}: {blocks} hashes of size {prefix.size} for n_in={n_in} (expected "
              f"{math.ceil(n_in / prefix.size)}{implied})")


def lint_trace(path: str | os.PathLike[str], max_model_len: int | None = None) -> LintReport:
    """Every finding of `RULES` in one pass over the file (TraceFormatError: no header)."""
    found = _Findings()
    read_header(path)  # a file that is not a trace fails here, with the reason
    times = array("d")
    n_in_values = array("q")
    n_out_values = array("q")
    covered_ratios = array("d")  # n_in / tokens covered by the prefix blocks
    latest_t = -math.inf
    latest_line = 0
    worst_back: tuple[float, int] = (0.0, 0)  # (seconds back, line)
    same_t: float | None = None
    same_t_seen: dict[int, int] = {}  # hash of the line -> line number, at t == same_t
    requests = 0
    unreplayable = 0
    for entry in iter_trace_lines(path):
        if entry.request is None:
            code = "partial-last-line" if entry.partial else "unreadable-line"
            found.add(code, f"line {entry.line}: {entry.error}")
            continue
        request = entry.request
        requests += 1
        line = entry.line
        t = request.t
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
        if not math.isfinite(t):
            found.add("t-not-finite", f"line {line}: t={t}")
            continue
        times.append(t)
        if t < 0:
            found.add("t-negative", f"line {line}: t={t:g}")
        if t > ABSURD_T_S:
            found.add("t-absurd", f"line {line}: t={t:g} s ({t / 86400:.0f} days)")
        if t < latest_t:
            found.add("t-non-monotonic", f"line {line}: t={t:g} after t={latest_t:g} "
                      f"(line {latest_line}), {latest_t - t:g} s back")
            worst_back = max(worst_back, (latest_t - t, line))
        else:
            latest_t, latest_line = t, line
        if t != same_t:
            same_t, same_t_seen = t, {}
        # Writers serialise deterministically, so equal requests are equal lines; a 64-bit
        # hash keeps memory small when many requests share one t (a false match ~ 1e-8).
        identity = hash(entry.text)
        if identity in same_t_seen:
            found.add("duplicate", f"line {line} = line {same_t_seen[identity]}")
        else:
            same_t_seen[identity] = line
    _check_units(found, times)
    _check_char_lengths(found, n_in_values, n_out_values, covered_ratios)
    if requests and unreplayable == requests:
        found.add("nothing-to-replay", f"all {requests} request lines are cannot-replay")
    if "t-non-monotonic" in found.by_code:
        finding = found.by_code["t-non-monotonic"]
        finding.what += f"; worst jump back {worst_back[0]:g} s (line {worst_back[1]})"
    return LintReport(str(path), requests, found.ordered())


def _check_units(found: _Findings, times: array[float]) -> None:
    if not times:
        return
    values = np.frombuffer(times, dtype=np.float64)
    first = float(values.min())
    if first > LARGE_START_S:
        found.add("t-large-start", f"first request at t={first:g} s "
                  f"({first / 86400:.1f} days)")
    if values.size >= 3:
        gaps = np.diff(np.sort(values))
        median_gap = float(np.median(gaps))
        if median_gap > MS_MEDIAN_GAP_S:
            found.add("t-looks-like-ms", f"median inter-arrival {median_gap:g} s over "
                      f"{values.size} requests")
            return
    whole = bool(np.all(values == np.floor(values)))
    if values.size >= 2 and whole and float(values.max()) > MS_INTEGER_T:
        found.add("t-looks-like-ms", f"every t is a whole number and the largest is "
                  f"{float(values.max()):g}")


def _check_char_lengths(found: _Findings, n_in_values: array[int], n_out_values: array[int],
                        covered_ratios: array[float]) -> None:
    if n_in_values and n_out_values:
        median_in = float(np.median(np.frombuffer(n_in_values, dtype=np.int64)))
        median_out = float(np.median(np.frombuffer(n_out_values, dtype=np.int64)))
        if median_in > 32768 and median_out > 4096:
            found.add("lengths-look-like-chars", f"median n_in {median_in:g}, median n_out "
                      f"{median_out:g}")
    if covered_ratios:
        ratio = float(np.median(np.frombuffer(covered_ratios, dtype=np.float64)))
        if 2.5 <= ratio <= 8:
            found.add("lengths-look-like-chars",
                      f"median n_in is {ratio:.1f}x the tokens the prefix blocks cover "
                      f"({len(covered_ratios)} requests with token blocks)")


# ---------------------------------------------------------------------------------------------
# Stats


@dataclass(frozen=True, slots=True)
class Distribution:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None
    min: float | None
    total: float

    @classmethod
    def of(cls, values: array[int]) -> Distribution:
        summary = summarize(np.frombuffer(values, dtype=np.int64).astype(np.float64)
                            if values else np.empty(0), (50.0, 90.0, 99.0))
        return cls(count=summary.count, mean=summary.mean, p50=summary.p(50.0),
                   p90=summary.p(90.0), p99=summary.p(99.0), max=summary.max,
                   min=summary.min, total=float(sum(values)))

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "p50": self.p50, "p90": self.p90,
                "p99": self.p99, "max": self.max, "min": self.min, "sum": self.total}


@dataclass(frozen=True, slots=True)
class Arrivals:
    duration_s: float
    first_t: float | None
    last_t: float | None
    mean_rate_rps: float | None  # requests / duration
    bin_s: float
    counts: tuple[int, ...]  # requests per bin, bin i = [first_t + i*bin_s, +bin_s)
    peak_rate_rps: float | None
    peak_bin_start_s: float | None
    interarrival_mean_s: float | None
    interarrival_p50_s: float | None
    burstiness_cv: float | None  # std / mean of the inter-arrival times (1 = Poisson)
    sorted_in_file: bool

    def to_dict(self) -> dict[str, Any]:
        return {"duration_s": self.duration_s, "first_t": self.first_t, "last_t": self.last_t,
                "mean_rate_rps": self.mean_rate_rps, "bin_s": self.bin_s,
                "counts": list(self.counts), "peak_rate_rps": self.peak_rate_rps,
                "peak_bin_start_s": self.peak_bin_start_s,
                "interarrival_mean_s": self.interarrival_mean_s,
                "interarrival_p50_s": self.interarrival_p50_s,
                "burstiness_cv": self.burstiness_cv, "sorted_in_file": self.sorted_in_file}


@dataclass(frozen=True, slots=True)
class PrefixReuse:
    """Prefix sharing in file order, as an infinite prefix cache would see it.

    A block is identified by its whole chain (the block and every block before it in its
    prompt), so "block i repeats" means "the first i+1 blocks of this prompt were all seen
    together in an earlier request": exactly a prefix-cache hit. ``hit_ratio_tokens`` =
    sum over requests of min(hit blocks x size, n_in) / sum of n_in (unit "tokens" with n_in
    known): an upper bound on what any real, finite cache could reuse.
    """

    requests_with_prefix: int
    block_sizes: Mapping[str, int]  # "tokens/512" -> requests
    blocks: int
    reused_blocks: int
    block_reuse_fraction: float | None
    hit_ratio_tokens: float | None
    distinct_blocks: int  # blocks an infinite cache ends up holding
    distinct_prompts: int  # distinct whole chains
    distinct_first_blocks: int  # distinct roots (e.g. system prompts)

    def to_dict(self) -> dict[str, Any]:
        return {"requests_with_prefix": self.requests_with_prefix,
                "block_sizes": dict(self.block_sizes), "blocks": self.blocks,
                "reused_blocks": self.reused_blocks,
                "block_reuse_fraction": self.block_reuse_fraction,
                "hit_ratio_tokens_infinite_cache": self.hit_ratio_tokens,
                "distinct_blocks": self.distinct_blocks,
                "distinct_prompts": self.distinct_prompts,
                "distinct_first_blocks": self.distinct_first_blocks}


class _PrefixTrie:
    """Chains of block hashes as a trie: a node id stands for a whole prefix."""

    def __init__(self) -> None:
        self.roots: dict[tuple[str, int, int], int] = {}  # (unit, size, first hash) -> node
        self.children: dict[tuple[int, int], int] = {}  # (parent node, hash) -> node
        self.prompts: set[int] = set()  # the last node of each whole chain
        self.blocks = 0
        self.reused = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.requests = 0
        self.sizes: Counter[str] = Counter()

    def _node(self, table: dict[Any, int], key: Any) -> tuple[int, bool]:
        known = table.get(key)
        if known is not None:
            return known, True
        node = table[key] = len(self.roots) + len(self.children)
        return node, False

    def add(self, prefix: PrefixBlocks, n_in: int | None) -> None:
        self.requests += 1
        self.sizes[f"{prefix.unit}/{prefix.size}"] += 1
        node = -1
        hit_blocks = 0
        for position, block in enumerate(prefix.hashes):
            if position == 0:
                node, seen = self._node(self.roots, (prefix.unit, prefix.size, block))
            else:
                node, seen = self._node(self.children, (node, block))
            # A new node has no children yet, so after the first miss every block misses:
            # the hits are always a prefix of the prompt, as in a real prefix cache.
            hit_blocks += seen
        self.blocks += len(prefix.hashes)
        self.reused += hit_blocks
        if node != -1:
            self.prompts.add(node)
        if prefix.unit == "tokens" and n_in is not None and n_in > 0:
            self.prompt_tokens += n_in
            self.hit_tokens += min(hit_blocks * prefix.size, n_in)

    def result(self) -> PrefixReuse | None:
        if not self.requests:
            return None
        return PrefixReuse(
            requests_with_prefix=self.requests,
            block_sizes=dict(sorted(self.sizes.items())),
            blocks=self.blocks,
            reused_blocks=self.reused,
            block_reuse_fraction=self.reused / self.blocks if self.blocks else None,
            hit_ratio_tokens=(self.hit_tokens / self.prompt_tokens if self.prompt_tokens
                              else None),
            distinct_blocks=len(self.children) + len(self.roots),
            distinct_prompts=len(self.prompts),
            distinct_first_blocks=len(self.roots),
        )


@dataclass(frozen=True, slots=True)
class Sessions:
    sessions: int
    requests_with_session: int
    requests_per_session: Distribution

    def to_dict(self) -> dict[str, Any]:
        return {"sessions": self.sessions, "requests_with_session": self.requests_with_session,
                "requests_per_session": self.requests_per_session.to_dict()}


@dataclass(frozen=True, slots=True)
class TraceStats:
    path: str
    source: str
    requests: int
    unreadable_lines: int
    arrivals: Arrivals
    n_in: Distribution
    n_out: Distribution
    prefix: PrefixReuse | None
    sessions: Sessions | None
    models: Mapping[str, int]
    endpoints: Mapping[str, int]
    outcomes: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "source": self.source, "requests": self.requests,
                "unreadable_lines": self.unreadable_lines, "arrivals": self.arrivals.to_dict(),
                "n_in": self.n_in.to_dict(), "n_out": self.n_out.to_dict(),
                "prefix": self.prefix.to_dict() if self.prefix else None,
                "sessions": self.sessions.to_dict() if self.sessions else None,
                "models": dict(self.models), "endpoints": dict(self.endpoints),
                "outcomes": dict(self.outcomes)}


def choose_bin_s(duration_s: float) -> float:
    """The smallest round bin width that splits the duration in at most ~60 bins."""
    if duration_s <= 0:
        return 1.0
    for width in NICE_BINS_S:
        if duration_s / width <= TARGET_BINS:
            return width
    return math.ceil(duration_s / TARGET_BINS / 86400) * 86400.0


def arrival_stats(times: np.ndarray[Any, np.dtype[np.float64]], sorted_in_file: bool) -> Arrivals:
    if times.size == 0:
        return Arrivals(0.0, None, None, None, 1.0, (), None, None, None, None, None,
                        sorted_in_file)
    ordered = np.sort(times)
    first, last = float(ordered[0]), float(ordered[-1])
    duration = last - first
    bin_s = choose_bin_s(duration)
    # Bins are counted from the first arrival; the epsilon keeps 0.3/0.1 from landing in bin 2.
    index = np.floor((ordered - first) / bin_s + 1e-9).astype(np.int64)
    counts = np.bincount(index, minlength=int(index[-1]) + 1)
    peak = int(np.argmax(counts))
    gaps = np.diff(ordered)
    gap_mean = float(gaps.mean()) if gaps.size else None
    cv = None
    if gaps.size >= 2 and gap_mean:
        cv = float(gaps.std() / gap_mean)
    return Arrivals(
        duration_s=duration,
        first_t=first,
        last_t=last,
        mean_rate_rps=times.size / duration if duration > 0 else None,
        bin_s=bin_s,
        counts=tuple(int(c) for c in counts),
        peak_rate_rps=float(counts[peak]) / bin_s,
        peak_bin_start_s=first + peak * bin_s,
        interarrival_mean_s=gap_mean,
        interarrival_p50_s=float(np.median(gaps)) if gaps.size else None,
        burstiness_cv=cv,
        sorted_in_file=sorted_in_file,
    )


def trace_stats(path: str | os.PathLike[str]) -> TraceStats:
    header = read_header(path)
    times = array("d")
    n_in_values = array("q")
    n_out_values = array("q")
    trie = _PrefixTrie()
    sessions: Counter[str] = Counter()
    models: Counter[str] = Counter()
    endpoints: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    unreadable = 0
    requests = 0
    latest = -math.inf
    sorted_in_file = True
    for entry in iter_trace_lines(path):
        request = entry.request
        if request is None:
            unreadable += 1
            continue
        requests += 1
        if math.isfinite(request.t):
            times.append(request.t)
            if request.t < latest:
                sorted_in_file = False
            latest = max(latest, request.t)
        if request.n_in is not None:
            n_in_values.append(request.n_in)
        if request.n_out is not None:
            n_out_values.append(request.n_out)
        if request.prefix is not None and request.prefix.hashes:
            trie.add(request.prefix, request.n_in)
        if request.session_id is not None:
            sessions[request.session_id] += 1
        models[request.model if request.model is not None else "(none)"] += 1
        endpoints[request.endpoint] += 1
        outcomes[request.outcome if request.outcome is not None else "(none)"] += 1
    session_stats = None
    if sessions:
        session_stats = Sessions(
            sessions=len(sessions), requests_with_session=sum(sessions.values()),
            requests_per_session=Distribution.of(array("q", sessions.values())))
    return TraceStats(
        path=str(path), source=header.source, requests=requests, unreadable_lines=unreadable,
        arrivals=arrival_stats(np.frombuffer(times, dtype=np.float64), sorted_in_file),
        n_in=Distribution.of(n_in_values), n_out=Distribution.of(n_out_values),
        prefix=trie.result(), sessions=session_stats,
        models=dict(models.most_common()), endpoints=dict(endpoints.most_common()),
        outcomes=dict(outcomes.most_common()),
    )


_SPARK = " .:-=+*#%@"


def sparkline(counts: tuple[int, ...]) -> str:
    """ASCII sparkline of per-bin counts (safe on any terminal encoding)."""
    top = max(counts, default=0)
    if top == 0:
        return ""
    return "".join(_SPARK[0 if c == 0 else 1 + (c * (len(_SPARK) - 2)) // top] for c in counts)


def sparkline_legend(bin_s: float, top: int) -> str:
    """What the sparkline's characters mean, under it."""
    return (f"{'legend':<12}one character per {_num(bin_s)} s: ' ' no request, "
            f"{_SPARK[1:]} fewest to most ({_SPARK[-1]} = {top})")


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value)}"
    if abs(value) >= 10 ** digits:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def format_stats(stats: TraceStats) -> str:
    a = stats.arrivals
    lines = [
        f"trace       {stats.path}  (source {stats.source})",
        f"requests    {stats.requests}"
        + (f"  ({stats.unreadable_lines} unreadable lines skipped)"
           if stats.unreadable_lines else ""),
        f"duration    {_num(a.duration_s)} s  (t {_num(a.first_t)} .. {_num(a.last_t)})",
        f"arrivals    mean {_num(a.mean_rate_rps)} req/s, peak {_num(a.peak_rate_rps)} req/s "
        f"(bin of {_num(a.bin_s)} s at t={_num(a.peak_bin_start_s)}), "
        f"burstiness (CV of gaps) {_num(a.burstiness_cv, 3)}",
        f"per {_num(a.bin_s)} s   |{sparkline(a.counts)}|  ({len(a.counts)} bins, max "
        f"{max(a.counts, default=0)} requests)",
    ]
    if a.counts:
        lines.append(sparkline_legend(a.bin_s, max(a.counts)))
    if not a.sorted_in_file:
        lines.append("            (t is not sorted in the file: arrivals use sorted t; prefix "
                     "reuse uses file order)")
    lines.append(f"{'':12}{'count':>9}{'mean':>10}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}")
    for name, dist in (("n_in", stats.n_in), ("n_out", stats.n_out)):
        lines.append(f"{name:<12}{dist.count:>9}{_num(dist.mean, 5):>10}{_num(dist.p50):>9}"
                     f"{_num(dist.p90):>9}{_num(dist.p99):>9}{_num(dist.max):>9}")
    p = stats.prefix
    if p is None:
        lines.append("prefix      no prefix information")
    else:
        reuse = f"{p.block_reuse_fraction:.1%}" if p.block_reuse_fraction is not None else "-"
        hit = f"{p.hit_ratio_tokens:.1%}" if p.hit_ratio_tokens is not None else "-"
        sizes = ", ".join(f"{k} ({v})" for k, v in p.block_sizes.items())
        lines.append(f"prefix      {p.requests_with_prefix} requests, blocks {sizes}; "
                     f"{p.blocks} blocks, {p.reused_blocks} repeat an earlier prefix ({reuse})")
        lines.append(f"            infinite-cache hit ratio {hit} of prompt tokens; distinct: "
                     f"{p.distinct_blocks} blocks, {p.distinct_prompts} prompts, "
                     f"{p.distinct_first_blocks} first blocks")
    s = stats.sessions
    if s is not None:
        r = s.requests_per_session
        lines.append(f"sessions    {s.sessions} ({s.requests_with_session} requests); requests "
                     f"per session mean {_num(r.mean)}, p50 {_num(r.p50)}, max {_num(r.max)}")
    for name, counts in (("models", stats.models), ("endpoints", stats.endpoints),
                         ("outcomes", stats.outcomes)):
        shown = ", ".join(f"{k} {v}" for k, v in list(counts.items())[:8])
        more = f", +{len(counts) - 8} more" if len(counts) > 8 else ""
        lines.append(f"{name:<12}{shown}{more}")
    return "\n".join(lines)


def stats_json(stats: TraceStats) -> str:
    return json.dumps(stats.to_dict(), indent=2)
