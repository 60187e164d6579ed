"""``sidecar trace merge``: several trace files (the captures of a fleet's pods, or one pod's
rotated parts) as one trace, on one clock.

Each file's ``t`` counts from its own header's ``start_wall_ns``; the merge puts every request
on the earliest of those instants and orders them by arrival (captures are written in
completion order). It holds the merged lines in memory.

Merging is refused (``MergeRefused``) when the result would mislead a replay:

- files without a calendar start (``start_wall_ns`` 0, e.g. most imported traces): their
  clocks cannot be lined up;
- prefix hashes made with different keys (``capture_key_id`` in the header notes): two pods
  with per-process keys hash the same prompt differently, so sharing across them would be
  invisible to the replay. A fleet that shares ``--capture-key-file`` has one key id;
- prefix hashes from different sources (a capture's and an importer's hash spaces).

``force`` merges anyway (files without a start are taken at 0) and writes the reasons into the
merged header's notes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sidecar.replay.options import Refused
from sidecar.tracefile import TraceHeader, TraceReader, TraceRequest, open_text

NS = 1_000_000_000


class MergeRefused(Refused):
    """The files would not make one trace a replay can trust (`sidecar trace merge`)."""


@dataclass(frozen=True, slots=True)
class MergedTrace:
    output: Path
    requests: int
    header: TraceHeader
    warnings: tuple[str, ...]


def _key_space(header: TraceHeader) -> str:
    """Which hash space a file's prefix hashes live in."""
    key_id = header.notes.get("capture_key_id") if isinstance(header.notes, dict) else None
    if key_id:
        return f"capture key {key_id}"
    return f"source {header.source}"


def problems(
    headers: Sequence[tuple[str, TraceHeader]], with_prefixes: Sequence[bool]
) -> list[str]:
    found: list[str] = []
    no_start = [path for path, header in headers if header.start_wall_ns <= 0]
    if no_start:
        found.append(
            f"no calendar start (start_wall_ns) in {', '.join(no_start)}: their "
            "clocks cannot be lined up with the others"
        )
    spaces = {
        _key_space(header) for (_, header), has in zip(headers, with_prefixes, strict=True) if has
    }
    if len(spaces) > 1:
        found.append(
            f"prefix hashes from different keys or sources ({', '.join(sorted(spaces))})"
            ": equal prompts hash differently across them, so the merged trace would "
            "hide prefix sharing between files (give the fleet one --capture-key-file)"
        )
    return found


def merge_traces(
    paths: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str], *, force: bool = False
) -> MergedTrace:
    if not paths:
        raise ValueError("nothing to merge")
    readers = [TraceReader(path) for path in paths]
    starts = [r.header.start_wall_ns for r in readers if r.header.start_wall_ns > 0]
    start_wall = min(starts) if starts else 0
    loaded: list[tuple[int, int, TraceRequest]] = []  # (arrival ns, file, request)
    with_prefixes: list[bool] = []
    counts: list[int] = []
    for index, reader in enumerate(readers):
        # A file without a calendar start (merged only with force) starts with the earliest.
        start = reader.header.start_wall_ns if reader.header.start_wall_ns > 0 else start_wall
        has_prefix = False
        count = 0
        for request in reader.requests():
            loaded.append((start + round(request.t * NS), index, request))
            has_prefix = has_prefix or request.prefix is not None
            count += 1
        with_prefixes.append(has_prefix)
        counts.append(count)
    named = [(str(path), reader.header) for path, reader in zip(paths, readers, strict=True)]
    found = problems(named, with_prefixes)
    if found and not force:
        raise MergeRefused(found)
    # Arrival order; ties keep file order, then each file's own order.
    loaded.sort(key=lambda item: (item[0], item[1]))
    headers = [h for _, h in named]
    models: list[str] = []
    for header in headers:
        models.extend(m for m in header.models if m not in models)
    policies = {h.route_policy for h in headers}
    slos = [dict(h.slos) for h in headers]
    key_ids = {h.notes.get("capture_key_id") for h in headers if isinstance(h.notes, dict)}
    notes: dict[str, object] = {
        "merged_from": [
            {"path": path, "requests": n, "source": h.source, "start_wall_ns": h.start_wall_ns}
            for (path, h), n in zip(named, counts, strict=True)
        ],
        "order": "arrival (t), over every file",
    }
    if len(key_ids) == 1 and None not in key_ids:
        notes["capture_key_id"] = key_ids.pop()
    if len(policies) > 1:
        notes["route_policies"] = sorted(str(p) for p in policies)
    if any(s != slos[0] for s in slos):
        notes["slos_per_file"] = slos
    if found:
        notes["merge_warnings"] = found
    sources = {h.source for h in headers}
    header = TraceHeader(
        source=sources.pop() if len(sources) == 1 else "merged",
        start_wall_ns=start_wall,
        sidecar_version=headers[0].sidecar_version,
        models=tuple(models),
        route_policy=policies.pop() if len(policies) == 1 else None,
        slos=slos[0] if all(s == slos[0] for s in slos) else {},
        text_included=any(h.text_included for h in headers),
        notes=notes,
    )
    out = Path(output)
    with open_text(out, "w") as handle:
        handle.write(json.dumps(header.to_dict(), separators=(",", ":")) + "\n")
        for at, _index, request in loaded:
            line = request.to_dict()
            line["t"] = (at - start_wall) / NS  # from the earliest file's start
            handle.write(json.dumps(line, separators=(",", ":"), ensure_ascii=False) + "\n")
    return MergedTrace(out, len(loaded), header, tuple(found))
