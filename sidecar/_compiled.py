"""Which of the package's modules mypyc compiled (setup.py's ``COMPILED``), and the switch that
runs them from their source instead.

The compiled request path is the same Python source turned into C (setup.py says why). Where it
was built, Python imports a module's extension before its .py; ``SIDECAR_INTERPRETED=1`` in the
environment, set before the process imports ``sidecar``, makes these modules load from their .py
files: to tell whether a behaviour is the compiled code's (an escape hatch, and how benchmarks
compare both on one tree), and to count a request's bytecodes (benchmarks/request_instructions.py
--opcodes), which compiled code has none of. No effect on the C extensions (`_tokenscan` and the
others), which have no .py twin.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from pathlib import Path
from types import ModuleType

ENV = "SIDECAR_INTERPRETED"

# setup.py's COMPILED as module names (tests/test_compiled.py holds the two lists together).
COMPILED_MODULES = (
    "sidecar.proxy.timeouts",
    "sidecar.proxy.builder",
    "sidecar.proxy.headers",
    "sidecar.proxy.listener",
    "sidecar.proxy.relay",
    "sidecar.proxy.upstream",
    "sidecar.proxy.channel",
    "sidecar.proxy.stream_relay",
    "sidecar.proxy.routing",
    "sidecar.proxy.rxstamp",
    "sidecar.meter",
    "sidecar.protocol.rewrite",
    "sidecar.protocol.openai",
)


def interpreted_requested(environ: dict[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    return value not in ("", "0", "false", "no")


class SourceFirst(MetaPathFinder):
    """Finds the compiled modules' .py files before their extensions."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None or spec.origin.endswith(".py"):
            return spec
        source = Path(spec.origin).with_name(fullname.rsplit(".", 1)[-1] + ".py")
        if not source.is_file():
            return spec
        return importlib.util.spec_from_file_location(fullname, source)


def install_source_first() -> None:
    if not any(isinstance(finder, SourceFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, SourceFirst())


def compiled_now() -> list[str]:
    """The compiled modules this process runs as extensions (those imported so far)."""
    return [
        name
        for name in COMPILED_MODULES
        if (module := sys.modules.get(name)) is not None
        and not str(getattr(module, "__file__", "")).endswith(".py")
    ]


def request_path_text() -> str:
    """One line for the start-up log: how the request path runs."""
    for name in COMPILED_MODULES:
        importlib.import_module(name)
    compiled = compiled_now()
    if len(compiled) == len(COMPILED_MODULES):
        return "compiled (mypyc)"
    if interpreted_requested():
        return f"interpreted ({ENV} is set)"
    if not compiled:
        return "interpreted (the package was installed without its compiled modules)"
    return f"partly compiled ({len(compiled)} of {len(COMPILED_MODULES)} modules)"


def stale_extensions(package: Path | None = None) -> list[str]:
    """Extensions beside this package's .py files that Python would run instead of the source
    as it is now: older than their .py (in a source tree installed in place, ``pip install -e
    .``, an edit runs only once rebuilt), or left from a build that compiled a module no longer
    compiled. Rebuild with ``pip install -e . --no-deps`` (or install with
    ``SIDECAR_PURE_PYTHON=1``; remove a leftover extension by hand)."""
    package = package or Path(__file__).resolve().parent
    stale = []
    for source in sorted(package.rglob("*.py")):
        name = ".".join(source.relative_to(package.parent).with_suffix("").parts)
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            built = source.with_name(source.stem + suffix)
            if built.is_file() and (
                name not in COMPILED_MODULES or source.stat().st_mtime > built.stat().st_mtime
            ):
                stale.append(str(built.relative_to(package.parent)))
    return stale
