"""``sidecar merge SHARD_DIR...``: the command; the merge itself is ``shardmerge.py``'s library.

It declares the flags, calls ``shardmerge.merge_shards`` and ``write_outputs`` and prints: the
refusal (exit 3) or the input error (exit 2) on stderr, else the merged report's table.
"""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Merge the output directories of a sharded replay (`sidecar replay --shard-index I --shard-count N
--start-at T --output-dir DIR`) into one report: every metric recomputed over the union of the
shards' raw records (never from their percentiles), written as report.json and records-runN.jsonl
like a single replay's, so `sidecar compare` reads it.
"""

EPILOG = """\
examples:
  sidecar merge shard-0/ shard-1/ shard-2/ --output-dir merged/
  sidecar merge results/shard-*/ --output-dir merged/ --slo ttft=500ms,tpot=50ms

refused (exit 3) unless --force: envelopes that differ (but for the shard), shards missing or
given twice, shards without one common --start-at, different numbers of runs.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "shards",
        nargs="+",
        metavar="SHARD_DIR",
        help="output directories of the shards (report.json + records-run*.jsonl)",
    )
    parser.add_argument(
        "--output-dir",
        required=True,
        metavar="DIR",
        help="where the merged report.json and records go",
    )
    parser.add_argument("--slo", help="SLO for goodput [the one the shards were run with]")
    parser.add_argument(
        "--force",
        action="store_true",
        help="merge even what is refused (the report says why it is suspect)",
    )


async def run(args: argparse.Namespace) -> int:
    # Here, not at import: start-up time of the CLI (aiohttp, numpy).
    from sidecar.replay.report import console_table
    from sidecar.replay.shardmerge import MergeError, MergeRefused, merge_shards, write_outputs

    try:
        merged = merge_shards(args.shards, slo=args.slo, force=args.force)
    except MergeRefused as exc:
        print("sidecar merge: these shards are not one experiment:", file=sys.stderr)
        for problem in exc.reasons:
            print(f"  {problem}", file=sys.stderr)
        print(
            "fix the inputs, or --force to merge anyway (the report keeps the warnings)",
            file=sys.stderr,
        )
        return 3
    except MergeError as exc:
        print(f"sidecar merge: {exc}", file=sys.stderr)
        return 2
    # Files first: a closed stdout (`| head`) must not cost the report.
    path = write_outputs(merged, args.output_dir)
    if merged.warnings:
        print("WARNING (--force): " + "; ".join(merged.warnings), file=sys.stderr)
    print(console_table(merged.report))
    print(f"report: {path}")
    return 0
