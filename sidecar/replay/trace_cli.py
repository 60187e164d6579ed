"""``sidecar trace``: import public traces, lint a trace before replaying it, summarise one.

Wired like every command: module-level DESCRIPTION and EPILOG, ``add_arguments(parser)`` and
``async def run(args) -> int``. ``python -m sidecar.replay.trace_cli ...`` runs it standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

from sidecar.config import parse_duration
from sidecar.replay.importers import (
    ENDPOINTS,
    FORMATS,
    ImportOptions,
    ImportResult,
    TraceImportError,
    import_trace,
)
from sidecar.tracefile import TraceFormatError

DESCRIPTION = """\
Work with trace files (versioned JSONL, optionally .gz: one header line, one line per request;
t in seconds since the trace start, lengths in tokens).

  import   convert a public LLM-inference trace into a sidecar trace: Mooncake (FAST'25 JSONL,
           AIPerf Mooncake+), Alibaba Bailian (JSONL), Azure LLM inference 2023/2024 (CSV),
           BurstGPT v1.1/v2 (CSV). Columns are read by name, units are converted (Mooncake's
           ms timestamps become seconds; Azure's calendar timestamps, 7 fractional digits or
           none, become seconds since the earliest row), rows are sorted by time, and the
           header notes record the source file, the mapping, the row counts and every
           skipped row's reason.
  lint     check a trace before replaying it: unsorted or negative t, units that look wrong
           (ms for s, characters for tokens), prefix block sizes that do not match n_in,
           requests too long for --max-model-len, duplicates, empty or missing lengths, and
           the lines `sidecar replay` skips (cannot-replay: the same rule, the same reasons).
           Exit status 1 when there are errors, 0 with only warnings.
  stats    summarise the load: duration, arrival rate over time, burstiness, n_in/n_out
           percentiles, prefix reuse (the hit ratio of an infinite prefix cache), sessions,
           models.
  merge    several traces as one (a fleet's captures, rotated parts): every request on the
           earliest file's clock, ordered by arrival; refused when clocks cannot be lined up
           or prefix hashes come from different keys (--capture-key-file shares one).
"""

EPILOG = """\
examples:
  sidecar trace import --format mooncake conversation_trace.jsonl -o mooncake.jsonl.gz
      Mooncake: timestamp ms -> t s, hash_ids -> 512-token prefix blocks
  sidecar trace import --format azure AzureLLMInferenceTrace_code_1week.csv -o code.jsonl.gz \\
      --start-at '2024-05-10 12:00:00' --duration 1h --endpoint chat --model my-model
      one hour of the 2024 week-long trace, as chat requests to my-model
  sidecar trace import --format burstgpt BurstGPT_1.csv -o burst.jsonl --drop-failed \\
      --time-scale 0.5
      BurstGPT without its failed requests (Response tokens = 0), twice as fast
  sidecar trace lint mooncake.jsonl.gz --max-model-len 32768
  sidecar trace stats mooncake.jsonl.gz --json > mooncake-stats.json
  sidecar trace merge captures/*/capture-*.jsonl -o fleet.jsonl.gz
      every pod's capture as one trace (pods sharing --capture-key-file)

exit status: 0 done; 1 lint found errors; 2 a usage or input error (an unreadable file, an
output that exists or cannot be written); 3 merge refused (--force merges anyway).
"""

IMPORT_DESCRIPTION = """\
Convert a public trace into a sidecar trace file. Every request gets endpoint --endpoint,
stream true, max_tokens = n_out and ignore_eos true (so a replay reproduces the output lengths
exactly), the source's model when it has one (BurstGPT) else --model.

t = the source's time in seconds, rebased so that the earliest imported request is at 0, then
multiplied by --time-scale. Source clocks, on which --start-at and --duration select a window:
  mooncake  timestamp in ms since the first request (t = timestamp / 1000)
  bailian   timestamp in s
  azure     TIMESTAMP, calendar time (no zone = UTC): seconds since the file's first row;
            --start-at also takes a timestamp ('2024-05-10 12:00:00')
  burstgpt  Timestamp in s since 0:00 of day 1
"""


# What add_subparsers returns (generic only to the type checker).
_Actions: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(trace_parser=parser)
    actions = parser.add_subparsers(dest="trace_command", metavar="ACTION")
    _add_import(actions)
    _add_lint(actions)
    _add_merge(actions)
    _add_stats(actions)


def _action(actions: _Actions, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """The subcommand ``name``'s parser, named as the parser of its errors (command_parser)."""
    action: argparse.ArgumentParser = actions.add_parser(name, **kwargs)
    action.set_defaults(command_parser=action)
    return action


def _add_import(actions: _Actions) -> None:
    """`sidecar trace import`: a public trace converted to a sidecar trace."""
    importing = _action(
        actions,
        "import",
        help="convert a public trace (mooncake, bailian, azure, burstgpt) to a sidecar trace",
        description=IMPORT_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    importing.add_argument("input", metavar="INPUT", help="the public trace (.gz is read too)")
    importing.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUTPUT",
        help="the sidecar trace to write (.gz: compressed)",
    )
    importing.add_argument(
        "--format", dest="source_format", required=True, choices=FORMATS, help="the input's format"
    )
    importing.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="completions",
        help="endpoint of every request (default: %(default)s)",
    )
    importing.add_argument(
        "--model", default=None, help="model of requests whose source names none (default: none)"
    )
    importing.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="multiply t by F after the conversion to seconds; 0.5 = twice as fast (default: 1)",
    )
    importing.add_argument(
        "--start-at",
        default=None,
        metavar="WHEN",
        help="skip requests before WHEN on the source clock: seconds (90, "
        "15m, 2h, 1d); azure also a timestamp",
    )
    importing.add_argument(
        "--duration",
        default=None,
        metavar="SECONDS",
        help="keep requests up to this long after --start-at (or after the "
        "first row): 3600, 60m, 1h",
    )
    importing.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="keep the first N requests (file order) that pass the window",
    )
    importing.add_argument(
        "--drop-failed",
        action="store_true",
        help="burstgpt: drop the requests that failed in the source "
        "(Response tokens = 0) instead of marking them failed_in_source",
    )
    importing.add_argument(
        "--no-sort",
        dest="sort",
        action="store_false",
        help="keep the file order even when rows are out of time order",
    )
    importing.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="skip unreadable rows (counted, with examples, in the header "
        "notes) instead of stopping at the first",
    )
    importing.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")


def _add_lint(actions: _Actions) -> None:
    """`sidecar trace lint`: a trace checked before it is replayed."""
    linting = _action(
        actions,
        "lint",
        help="check a trace before replaying it (exit 1 on errors)",
        description="Check a sidecar trace for problems that would spoil a replay. Each "
        "finding says what, where (line numbers), how many and how to fix it; "
        "cannot-replay lists exactly the lines `sidecar replay` skips, with the "
        "same reasons. Exit status 1 when there are errors, 0 with only warnings, "
        "2 when the file cannot be read.",
    )
    linting.add_argument("trace", metavar="TRACE")
    linting.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="flag requests with n_in + n_out above N tokens",
    )
    linting.add_argument("--json", action="store_true", help="print the findings as JSON")


def _add_merge(actions: _Actions) -> None:
    """`sidecar trace merge`: several traces as one, ordered by arrival."""
    merging = _action(
        actions,
        "merge",
        help="several traces (a fleet's captures, rotated parts) as one, ordered by arrival",
        description="Merge trace files into one: every request on the earliest file's clock "
        "(from the headers' calendar starts), ordered by arrival. Refused (exit "
        "3) when files have no calendar start or their prefix hashes come from "
        "different keys (pods without a shared --capture-key-file); --force "
        "merges anyway and notes why in the header.",
    )
    merging.add_argument("traces", nargs="+", metavar="TRACE")
    merging.add_argument(
        "-o", "--output", required=True, metavar="OUTPUT", help="the merged trace (.gz: compressed)"
    )
    merging.add_argument(
        "--force", action="store_true", help="merge what is refused (the header notes the reasons)"
    )
    merging.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")


def _add_stats(actions: _Actions) -> None:
    """`sidecar trace stats`: the load a trace holds, summarised."""
    summarising = _action(
        actions,
        "stats",
        help="summarise a trace: rate over time, burstiness, lengths, prefix reuse, sessions",
        description="Summarise the load in a sidecar trace.",
    )
    summarising.add_argument("trace", metavar="TRACE")
    summarising.add_argument("--json", action="store_true", help="print JSON")


def _options(args: argparse.Namespace) -> ImportOptions:
    duration = None
    if args.duration is not None:
        try:
            duration = parse_duration(args.duration, bare_unit="s")
        except ValueError as exc:
            raise TraceImportError(f"--duration: {exc}") from None
    return ImportOptions(
        endpoint=args.endpoint,
        model=args.model,
        time_scale=args.time_scale,
        limit=args.limit,
        start_at=args.start_at,
        duration_s=duration,
        drop_failed=args.drop_failed,
        sort=args.sort,
        skip_bad_rows=args.skip_bad_rows,
    )


def _import_summary(result: ImportResult, source: str) -> str:
    notes = result.header.notes
    lines = [
        f"imported {result.requests} requests from {source} ({result.rows_read} rows "
        f"read; source {result.header.source}) -> {result.output}",
        f"  units: {notes.get('units')}",
        f"  order: {notes.get('order')}",
    ]
    for title, key in (("skipped", "rows_skipped"), ("remark", "remarks")):
        for reason, detail in dict(notes.get(key) or {}).items():
            examples = ", ".join(detail.get("examples", [])[:3])
            lines.append(
                f"  {title}: {detail['count']} x {reason}"
                + (f" (e.g. {examples})" if examples else "")
            )
    return "\n".join(lines)


def _output_problem(output: Path, may_replace: bool, how_to_replace: str) -> str | None:
    """Why ``-o output`` cannot be written, checked before any work; None when it can."""
    if output.is_dir():
        return f"-o {output} is a directory: give the file to write"
    if output.exists() and not may_replace:
        return f"{output} exists ({how_to_replace})"
    return unwritable(output)


def _run_import(args: argparse.Namespace) -> int:
    source, output = Path(args.input), Path(args.output)
    problem = (
        f"{source} is a directory: give the trace file in it"
        if source.is_dir()
        else _output_problem(output, args.force, "use --force to overwrite")
    )
    if problem is not None:
        print(f"sidecar trace import: error: {problem}", file=sys.stderr)
        return 2
    try:
        result = import_trace(args.source_format, args.input, output, _options(args))
    except TraceImportError as exc:
        print(f"sidecar trace import: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"sidecar trace import: error: {os_error(exc)}", file=sys.stderr)
        return 2
    print(_import_summary(result, args.input))
    return 0


def unwritable(output: Path) -> str | None:
    """Why ``output`` cannot be written (its folder is made when missing), or None: checked
    before a long import rather than at its end."""
    folder = output.parent
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return f"cannot write {output}: {blocker} is a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".sidecar-write-check-"):
            pass
    except OSError as exc:
        return f"cannot write {output}: {folder}: {exc.strerror or exc}"
    return None


def os_error(exc: OSError) -> str:
    """An OSError as one line: the path, then the cause."""
    cause = exc.strerror or str(exc)
    return f"{exc.filename}: {cause}" if exc.filename else cause


def _run_lint(args: argparse.Namespace) -> int:
    from sidecar.replay.tracelint import lint_trace  # here: start-up time of the CLI (numpy)

    try:
        report = lint_trace(args.trace, max_model_len=args.max_model_len)
    except TraceFormatError as exc:
        print(f"sidecar trace lint: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"sidecar trace lint: error: {os_error(exc)}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return report.exit_code


def _run_stats(args: argparse.Namespace) -> int:
    # Here, not at import: start-up time of the CLI (numpy).
    from sidecar.replay.tracestats import format_stats, stats_json, trace_stats

    try:
        stats = trace_stats(args.trace)
    except TraceFormatError as exc:
        print(f"sidecar trace stats: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"sidecar trace stats: error: {os_error(exc)}", file=sys.stderr)
        return 2
    print(stats_json(stats) if args.json else format_stats(stats))
    return 0


def _run_merge(args: argparse.Namespace) -> int:
    # Here, not at import: start-up time of the CLI (aiohttp, numpy).
    from sidecar.replay.tracemerge import MergeRefused, merge_traces

    output = Path(args.output)
    problem = _output_problem(output, args.overwrite, "use --overwrite to replace it")
    if problem is not None:
        print(f"sidecar trace merge: error: {problem}", file=sys.stderr)
        return 2
    try:
        merged = merge_traces(args.traces, output, force=args.force)
    except MergeRefused as exc:
        print("sidecar trace merge: refused:", file=sys.stderr)
        for reason in exc.reasons:
            print(f"  {reason}", file=sys.stderr)
        print("--force merges anyway (the merged header keeps these reasons)", file=sys.stderr)
        return 3
    except OSError as exc:
        print(f"sidecar trace merge: error: {os_error(exc)}", file=sys.stderr)
        return 2
    except (TraceFormatError, ValueError) as exc:
        print(f"sidecar trace merge: error: {exc}", file=sys.stderr)
        return 2
    for warning in merged.warnings:
        print(f"WARNING (--force): {warning}", file=sys.stderr)
    print(f"merged {merged.requests} requests from {len(args.traces)} files -> {merged.output}")
    return 0


async def run(args: argparse.Namespace) -> int:
    # The work is synchronous file processing; nothing else shares this event loop.
    command = getattr(args, "trace_command", None)
    if command == "import":
        return _run_import(args)
    if command == "lint":
        return _run_lint(args)
    if command == "stats":
        return _run_stats(args)
    if command == "merge":
        return _run_merge(args)
    parser = getattr(args, "trace_parser", None)
    if parser is not None:
        parser.print_help(sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone ``sidecar trace`` parser (the main CLI registers add_arguments itself)."""
    parser = argparse.ArgumentParser(
        prog="sidecar trace",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import asyncio  # here, not at import: start-up time of the CLI

    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
