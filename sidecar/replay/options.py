"""What a replay is asked to do, as one typed, frozen object.

`sidecar replay` parses its command line into a `ReplayOptions` (`from_namespace`); `sidecar
sweep`, `sidecar demo` and scripts build one directly, and all of them plan and send with the
same functions (replay/load.py). Field names are the replay flags' (``--no-captured-bodies`` is
``no_captured_bodies``), so that an option reads the same in the docs, the CLI and a script.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from sidecar.replay.report import DEFAULT_MAX_LATENESS_MS

# --max-lateness's default as the flag spells it.
DEFAULT_MAX_LATENESS = f"{DEFAULT_MAX_LATENESS_MS:g}ms"


class UsageError(Exception):
    """Options that cannot make a replay, with a message that names the flag and the fix."""


@dataclass(frozen=True)
class ReplayOptions:
    """The options of `sidecar replay`, with its defaults. Durations given as text
    (``max_lateness``, ``metrics_linger``) are read with the package's duration grammar when
    the replay runs, as on the command line."""

    trace: str
    target: str
    model: str | None = None  # None: the trace's, else the target's first model
    endpoint: str | None = None  # "chat" or "completions"; None: each line's own
    time_scale: float = 1.0
    rate: float | None = None  # synthetic arrivals (req/s) instead of the trace's times
    burstiness: float = 1.0  # Gamma shape for `rate`: 1 = Poisson
    max_concurrency: int | None = None  # closed loop: at most this many outstanding
    limit: int | None = None
    warmup: int = 0
    repeats: int = 3
    workers: int = 1
    shard_index: int = 0
    shard_count: int = 1
    start_at: float | None = None  # wall-clock instant (Unix seconds) of the trace's t=0
    slo: str | None = None
    seed: int = 0
    request_timeout: float = 600.0  # seconds
    no_captured_bodies: bool = False
    token_id_range: str | None = None  # "LOW:HIGH"
    output_dir: str | None = None
    quiet: bool = False
    peer_definitions: bool = False
    export_vllm_bench: str | None = None
    max_lateness: str = DEFAULT_MAX_LATENESS  # or "off"
    metrics_listen: str | None = None  # "HOST:PORT"
    metrics_linger: str = "0s"
    export_llmd: str | None = None

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ReplayOptions:
        """The options of a parsed `sidecar replay` command line (replay_cli.add_arguments)."""
        given: dict[str, Any] = vars(args)
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})
