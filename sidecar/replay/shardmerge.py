"""One report from the shards of one sharded replay: the library of ``sidecar merge SHARD_DIR...``
(whose command is ``merge_cli.py``).

A trace replayed by several senders (``--shard-index/--shard-count``, e.g. a Kubernetes indexed
Job) leaves one ``--output-dir`` per shard, each with its own report. Percentiles cannot be
combined from those reports (a mean of p99s is no p99 of anything): the merge reads every
shard's raw per-request records and computes the report again over their union, with the same
code and definitions as a single replay.

That union is one experiment only if the shards ran one plan together, so the merge refuses
(``MergeRefused``; `sidecar merge` exits 3) when their envelopes differ in anything but the
shard itself, when shards are missing or repeated, or when they did not share one start instant
(``--start-at``): without it each shard's times count from its own start, and the union's
duration, throughput, concurrency and lateness would mix clocks. ``force`` merges anyway and
says so in the report.

``merge_shards`` is the whole merge as one call (``MergeError``: an input that cannot be read
or an SLO that cannot be parsed, exit 2); ``write_outputs`` writes its report.json and
records-runN.jsonl.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.config import ConfigError, parse_slo_spec
from sidecar.record import RequestRecord
from sidecar.replay.compare import NOT_DESIGN
from sidecar.replay.options import Refused
from sidecar.replay.report import DEFAULT_MAX_LATENESS_MS, mark_degraded, median_run, run_report
from sidecar.replay.runner import SentRequest
from sidecar.stats import SLO, SLOPolicy

# Envelope members that differ between the shards of one replay by construction.
PER_SHARD = frozenset(
    {
        "requests",
        "shard",
        "input_tokens_requested",
        "output_tokens_requested",
        "prompt_text_calibration",
        "engine_version",
    }
)


class MergeError(Exception):
    """A shard that cannot be read, or an SLO that cannot be parsed (`sidecar merge` exits 2)."""


class MergeRefused(Refused):
    """The shards are not one experiment (`sidecar merge` exits 3; ``force`` merges)."""


@dataclass(frozen=True, slots=True)
class Shard:
    path: Path
    report: dict[str, Any]
    runs: list[list[SentRequest]]

    @property
    def envelope(self) -> dict[str, Any]:
        envelope: dict[str, Any] = self.report["envelope"]
        return envelope

    @property
    def index(self) -> int | None:
        shard = self.envelope.get("shard")
        return shard.get("index") if isinstance(shard, dict) else None

    @property
    def count(self) -> int | None:
        shard = self.envelope.get("shard")
        return shard.get("count") if isinstance(shard, dict) else None


def load_shard(path: str | os.PathLike[str]) -> Shard:
    directory = Path(path)
    try:
        report = json.loads((directory / "report.json").read_text())
    except (OSError, ValueError) as exc:
        raise MergeError(f"{directory}: no readable report.json ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("envelope"), dict):
        raise MergeError(f"{directory}/report.json: not a `sidecar replay` report")
    n_runs = len(report.get("runs", [])) or 1
    runs: list[list[SentRequest]] = []
    for i in range(n_runs):
        file = directory / f"records-run{i}.jsonl"
        sent: list[SentRequest] = []
        try:
            with file.open() as handle:
                for line_no, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        data = json.loads(line)
                        sent.append(
                            SentRequest(
                                int(data["index"]),
                                int(data["scheduled_ns"]),
                                int(data["actual_ns"]),
                                RequestRecord.from_dict(data["record"]),
                            )
                        )
                    except (ValueError, KeyError, TypeError) as exc:
                        raise MergeError(f"{file}:{line_no}: not a replay record ({exc})") from None
        except OSError as exc:
            raise MergeError(
                f"{directory}: the raw records of run {i} are missing ({exc}); "
                "a merge needs them (`sidecar replay --output-dir`)"
            ) from None
        runs.append(sent)
    return Shard(directory, report, runs)


def problems(shards: Sequence[Shard]) -> list[str]:
    """Why these shards are not one experiment (empty when they are)."""
    found: list[str] = []
    base = shards[0].envelope
    ignored = NOT_DESIGN | PER_SHARD
    for shard in shards[1:]:
        keys = (set(base) | set(shard.envelope)) - ignored
        for key in sorted(keys):
            if base.get(key) != shard.envelope.get(key):
                found.append(
                    f"{shard.path}: envelope {key!r} is {shard.envelope.get(key)!r}, "
                    f"{shards[0].path} has {base.get(key)!r}"
                )
    counts = {shard.count for shard in shards}
    if None in counts:
        found.append("a report has no shard information (written by an older sidecar)")
    elif len(counts) > 1:
        found.append(f"different --shard-count values: {sorted(c for c in counts if c)}")
    else:
        (count,) = counts
        indices = [shard.index for shard in shards]
        repeated = sorted({i for i in indices if indices.count(i) > 1 and i is not None})
        missing = sorted(set(range(count or 0)) - set(indices))
        if repeated:
            found.append(f"shard(s) {repeated} given more than once")
        if missing:
            found.append(f"shard(s) {missing} of {count} missing")
    starts = {shard.envelope.get("start_at") for shard in shards}
    if None in starts or len(starts) > 1:
        found.append(
            "the shards did not share one --start-at instant: their times count from "
            "different starts, so the union's duration, throughput, concurrency and "
            "lateness would mix clocks"
        )
    if len({len(shard.runs) for shard in shards}) > 1:
        found.append("the shards have different numbers of runs (--repeats)")
    return found


def slo_policy_for(spec: str | None) -> SLOPolicy | None:
    if not spec:
        return None
    try:
        slo = SLO(**parse_slo_spec(spec).slo_arguments())
    except ConfigError as exc:
        raise MergeError(f"--slo: {exc}") from None
    return SLOPolicy({"default": slo})


TaggedRun = list[tuple[int, SentRequest]]  # one run's requests, each with its shard index


@dataclass(frozen=True, slots=True)
class MergedReplay:
    report: dict[str, Any]  # report.json: every metric over the union of the shards' records
    runs: list[TaggedRun]  # each run's requests in schedule order, tagged with their shard
    warnings: tuple[str, ...]  # what made the shards not one experiment (merged with force)


def merge_shards(
    directories: Sequence[str | os.PathLike[str]],
    *,
    slo: str | None = None,
    force: bool = False,
) -> MergedReplay:
    """Read the shards' output directories, judge them one experiment (``MergeRefused`` if
    not, unless ``force``) and merge them; ``slo``: the SLO for goodput, by default the one the
    shards were run with."""
    shards = [load_shard(directory) for directory in directories]
    found = problems(shards)
    if found and not force:
        raise MergeRefused(found)
    return merge(shards, slo=slo, warnings=found)


def merge(
    shards: Sequence[Shard], *, slo: str | None = None, warnings: Sequence[str] = ()
) -> MergedReplay:
    """The merged report of loaded shards (unjudged: ``problems`` says what ``warnings``
    should keep), and each run's requests tagged with their shard index."""
    slo_spec = slo or shards[0].envelope.get("slo")
    policy = slo_policy_for(slo_spec)
    mode = shards[0].report.get("mode", "open")
    n_runs = min(len(shard.runs) for shard in shards)
    merged_runs: list[TaggedRun] = []
    reports: list[dict[str, Any]] = []
    for i in range(n_runs):
        tagged = [
            (shard.index if shard.index is not None else k, sent)
            for k, shard in enumerate(shards)
            for sent in shard.runs[i]
        ]
        tagged.sort(key=lambda item: (item[1].scheduled_ns, item[0]))
        merged_runs.append(tagged)
        reports.append(run_report([sent for _, sent in tagged], mode=mode, slo_policy=policy))
    chosen = median_run(reports)
    envelope = {k: v for k, v in shards[0].envelope.items() if k not in PER_SHARD}
    envelope["requests"] = sum(len(shard.runs[chosen]) for shard in shards)
    envelope["shard"] = {
        "count": shards[0].count,
        "merged": sorted(shard.index for shard in shards if shard.index is not None),
    }
    envelope["slo"] = slo_spec
    result = dict(reports[chosen])
    result["envelope"] = envelope
    result["median_run"] = chosen
    result["runs"] = reports
    # The union's lateness, judged by the threshold the shards were run with.
    threshold = shards[0].report.get("max_lateness_ms", DEFAULT_MAX_LATENESS_MS)
    mark_degraded(result, threshold if isinstance(threshold, (int, float)) else None)
    result["merged_from"] = [
        {
            "path": str(shard.path),
            "shard_index": shard.index,
            "requests": len(shard.runs[chosen]),
            "input_tokens_requested": shard.envelope.get("input_tokens_requested"),
            "output_tokens_requested": shard.envelope.get("output_tokens_requested"),
            "engine_version": shard.envelope.get("engine_version"),
        }
        for shard in shards
    ]
    if warnings:
        result["merge_warnings"] = list(warnings)  # --force: what makes this union suspect
    result["definitions"] = {
        **result.get("definitions", {}),
        "merge": "every metric recomputed over the union of the shards' "
        "raw records, times on the shards' common start",
    }
    return MergedReplay(result, merged_runs, tuple(warnings))


def write_outputs(merged: MergedReplay, output_dir: str | os.PathLike[str]) -> Path:
    """report.json and records-runN.jsonl in ``output_dir`` (made if missing), like a single
    replay's (each record line also names its shard); returns report.json's path."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(merged.report, indent=2, default=str))
    for i, tagged in enumerate(merged.runs):
        with (out / f"records-run{i}.jsonl").open("w") as handle:
            for shard_index, s in tagged:
                handle.write(
                    json.dumps(
                        {
                            "shard": shard_index,
                            "index": s.index,
                            "scheduled_ns": s.scheduled_ns,
                            "actual_ns": s.actual_ns,
                            "record": s.record.to_dict(),
                        }
                    )
                    + "\n"
                )
    return out / "report.json"
