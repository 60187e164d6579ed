"""The CLI's parser and every command's ``--help`` load only what they need: the heavy
libraries (aiohttp, numpy, the proxy, the sinks, ...) are imported when a command runs.
Dozens of tests and every user start the CLI; a module-level import brought back into the
parser's path costs each of them a few hundred milliseconds."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Third-party packages and sidecar modules that building the parser must not import.
HEAVY = (
    "aiohttp",
    "numpy",
    "opentelemetry",
    "prometheus_client",
    "uvloop",
    "rich",
    "yarl",
    "multidict",
    "sidecar.serve",
    "sidecar.stats",
    "sidecar.proxy.app",
    "sidecar.sim.server",
    "sidecar.replay.session",
)


def modules_after(code: str) -> list[str]:
    """The HEAVY modules imported, in a fresh interpreter, once ``code`` has run."""
    script = textwrap.dedent(code) + textwrap.dedent(f"""
        import json, sys
        heavy = {HEAVY!r}
        print(json.dumps(sorted(m for m in heavy if m in sys.modules)))
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    loaded: list[str] = json.loads(done.stdout.splitlines()[-1])
    return loaded


def test_building_the_parser_imports_no_heavy_module() -> None:
    assert modules_after("import sidecar.cli; sidecar.cli.build_parser()") == []


def test_help_of_every_command_imports_no_heavy_module() -> None:
    code = """
        import contextlib, io
        import sidecar.cli
        for argv in (
            ["--help"], ["proxy", "--help"], ["sim", "--help"], ["replay", "--help"],
            ["sweep", "--help"], ["compare", "--help"], ["merge", "--help"],
            ["trace", "--help"], ["trace", "import", "--help"], ["demo", "--help"],
            ["vllm", "--help"],
        ):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                sidecar.cli.main(argv)
    """
    assert modules_after(code) == []
