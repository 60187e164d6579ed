"""The one thing pyproject.toml cannot say without an experimental table: the compiled modules.

The C extensions: `sidecar.protocol._tokenscan` recognises the common token chunk in C
(fastchunk.py says why); `sidecar.proxy._recvstamp` reads an upstream socket with the kernel's
receive timestamp (rxstamp.py); `sidecar.proxy._recordwire` writes a record's wire form
(recordwire.py); `sidecar.proxy._headerblock` writes a request's and a response's end-to-end
header lines (headers.py); `sidecar._recordtypes` holds a timeline's packed column type
(record.Int64s) and builds the record's dataclasses without their per-field __init__
(record.slots_constructor).

The request path compiled by mypyc (`COMPILED`): the same Python source, its type hints (held to
mypy --strict) turned into C, so that a request's attribute reads, calls and objects cost what
they cost in C (benchmarks/RESULTS.md, "The request path compiled"). The .py files stay the
specification and what runs where nothing was compiled.

All are optional: where no C compiler is at hand, or mypyc cannot build, the package installs
without them and runs the same logic in Python, slower (`sidecar proxy` says what it runs).
``SIDECAR_PURE_PYTHON=1`` at install time leaves the request path interpreted (the C extensions
are still built).
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The modules of a request's path through a worker, compiled by mypyc (sidecar/_compiled.py names
# them as modules: tests/test_compiled.py holds the two lists together, and the pitfalls of
# compiled code it has met). Not in this list: msgspec structs (requesthead.py: mypyc would
# compile the struct's class), the SSE parser (tests subclass it), and the collector's side
# (its cost is per record, not per event).
COMPILED = [
    "sidecar/proxy/timeouts.py",
    "sidecar/proxy/builder.py",
    "sidecar/proxy/headers.py",
    "sidecar/proxy/listener.py",
    "sidecar/proxy/relay.py",
    "sidecar/proxy/upstream.py",
    "sidecar/proxy/channel.py",
    "sidecar/proxy/stream_relay.py",
    "sidecar/proxy/routing.py",
    "sidecar/proxy/rxstamp.py",
    "sidecar/meter.py",
    "sidecar/protocol/rewrite.py",
    "sidecar/protocol/openai.py",
]


# The build's type check sees no installed package (the build environment has none of the
# dependencies, and a build must not depend on what else is installed): what they give is Any to
# mypyc, which then checks nothing about it; the checks strict mode makes of Any are off here
# (`mypy sidecar` in CI keeps them, with the dependencies installed).
MYPY_FLAGS = ["--no-site-packages", "--allow-subclassing-any", "--no-warn-return-any"]

# mypyc puts the compiled code of all of COMPILED in one library, and one small module per file
# that imports it.
GROUP_LIBRARY = "sidecar__mypyc"


def compiled_request_path() -> list[Extension]:
    if os.environ.get("SIDECAR_PURE_PYTHON", "") not in ("", "0"):
        return []
    try:
        from mypyc.build import mypycify

        extensions = mypycify([*MYPY_FLAGS, *COMPILED], opt_level="3", group_name="sidecar")
    except (Exception, SystemExit) as exc:  # a type error, no mypyc: the build goes on
        print(f"setup.py: the request path stays interpreted (mypyc: {exc!r})", file=sys.stderr)
        return []
    for extension in extensions:
        extension.optional = True  # no compiler: installed without them, as the C extensions
    # The library first: its modules are built only after it was (`BuildExtensions`).
    return sorted(extensions, key=lambda e: e.name != GROUP_LIBRARY)


COMPILED_NAMES = {path.removesuffix(".py").replace("/", ".") for path in COMPILED}


class BuildExtensions(build_ext):
    """Builds each optional extension as setuptools does (a failure is reported and skipped),
    but a module of the compiled request path only once its library was built: a module without
    it would fail to import, where the .py beside it would have run."""

    def build_extension(self, ext: Extension) -> None:
        if ext.name in COMPILED_NAMES and not getattr(self, "_group_built", False):
            print(f"setup.py: {ext.name} stays interpreted", file=sys.stderr)
            return
        super().build_extension(ext)
        if ext.name == GROUP_LIBRARY:
            self._group_built = True


setup(
    cmdclass={"build_ext": BuildExtensions},
    ext_modules=[
        Extension(
            "sidecar.protocol._tokenscan",
            sources=["sidecar/protocol/_tokenscan.c"],
            depends=["sidecar/_methodcache.h", "sidecar/protocol/_laneapi.h"],
            optional=True,
        ),
        Extension(
            "sidecar.proxy._recvstamp",
            sources=["sidecar/proxy/_recvstamp.c"],
            depends=["sidecar/protocol/_laneapi.h"],
            optional=True,
        ),
        Extension(
            "sidecar.proxy._recordwire",
            sources=["sidecar/proxy/_recordwire.c"],
            optional=True,
        ),
        Extension(
            "sidecar.proxy._headerblock",
            sources=["sidecar/proxy/_headerblock.c"],
            optional=True,
        ),
        Extension(
            "sidecar._recordtypes",
            sources=["sidecar/_recordtypes.c"],
            optional=True,
        ),
        *compiled_request_path(),
    ],
)
