"""What a replay or a sweep is asked to do, as one typed, frozen object each.

`sidecar replay` parses its command line into a `ReplayOptions` (`from_namespace`); `sidecar
sweep`, `sidecar demo` and scripts build one directly, and all of them plan and send with the
same functions (replay/load.py, a whole replay: replay/session.py). `sidecar sweep` parses its
own into a `SweepOptions` (`from_args`), which a script builds directly as well and gives to
`sweep_session.run_sweep`. Field names are the flags' (``--no-captured-bodies`` is
``no_captured_bodies``), so that an option reads the same in the docs, the CLI and a script.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

# The sender lateness p99 above which a run is degraded (report.py says why 50 ms). Defined
# here, not in report.py (numpy): the parser of `sidecar replay` needs it, and stays cheap.
DEFAULT_MAX_LATENESS_MS = 50.0
# --max-lateness's default as the flag spells it.
DEFAULT_MAX_LATENESS = f"{DEFAULT_MAX_LATENESS_MS:g}ms"


class UsageError(Exception):
    """Options that cannot make a replay, with a message that names the flag and the fix."""


class Refused(Exception):
    """Inputs that would not make one experiment (the commands exit 3; ``force`` goes on):
    ``reasons``, each a sentence."""

    def __init__(self, reasons: Sequence[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = list(reasons)


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


def admin_token_from_environment() -> str | None:
    """`sidecar sweep --admin-token`'s default, and a script's."""
    return os.environ.get("SIDECAR_ADMIN_TOKEN")


@dataclass(frozen=True)
class SweepOptions:
    """The options of `sidecar sweep`, with its defaults: the requests from one of ``trace``
    and ``dataset``, the loads from one of ``rates`` and ``auto``. Loads are req/s in open loop,
    concurrent requests with ``mode="closed"``; ``step_duration`` is read with the package's
    duration grammar when the sweep runs, as on the command line."""

    target: str
    slo: str  # thresholds judged at slo_percentile, e.g. "ttft=500ms,tpot=50ms"
    trace: str | None = None
    dataset: str | None = None  # "synthetic:in=N,out=M[,shared=K]"
    slo_percentile: float = 90.0
    max_error_rate: float = 0.01
    keep_up: float = 0.9  # open loop: minimum completion rate / offered rate
    rates: tuple[float, ...] | None = None  # explicit loads, run in increasing order
    auto: bool = False  # double from `start` until a step fails, then bisect
    start: float = 1.0
    bisect_steps: int = 3
    mode: str = "open"  # or "closed"
    step_duration: str = "10s"  # open loop: arrivals per step
    min_requests: int = 20
    burstiness: float = 1.0
    warmup: int = 2  # per step
    repeats: int = 1  # per step; the median run counts
    model: str | None = None  # None: the target's first
    seed: int = 0
    request_timeout: float = 300.0  # seconds
    output_dir: str | None = None
    sidecar_admin: str | None = None  # the admin URL of the sidecar the target is
    quiet: bool = False
    # The flag's default too: the variable, which other local users cannot see in the process
    # list. Never shown in a repr (a log line, a traceback).
    admin_token: str | None = field(default_factory=admin_token_from_environment, repr=False)

    def __post_init__(self) -> None:
        # The command line's argument groups hold these; a script's options are checked here.
        if (self.trace is None) == (self.dataset is None):
            raise UsageError("a sweep needs one of --trace and --dataset")
        if (self.rates is None) == (not self.auto):
            raise UsageError("a sweep needs one of --rates and --auto")
        if self.mode not in ("open", "closed"):
            raise UsageError(f"--mode must be open or closed: {self.mode!r}")
        if self.rates is not None:
            if any(not math.isfinite(r) or r <= 0 for r in self.rates):
                raise UsageError("--rates: every load must be a number > 0")
            object.__setattr__(self, "rates", tuple(sorted(float(r) for r in self.rates)))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SweepOptions:
        """The options of a parsed `sidecar sweep` command line (sweep_cli.add_arguments)."""
        given: dict[str, Any] = vars(args)
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})
