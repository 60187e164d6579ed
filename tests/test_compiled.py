"""The request path compiled by mypyc (setup.py, sidecar/_compiled.py): what is compiled, the
switch back to the source, and the guard against running a build older than the source."""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar import _compiled

REPO = Path(__file__).resolve().parent.parent


def setup_compiled() -> list[str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "COMPILED" for t in node.targets
        ):
            return [str(ast.literal_eval(e)) for e in node.value.elts]  # type: ignore[attr-defined]
    raise AssertionError("setup.py has no COMPILED list")


def test_setup_compiles_the_modules_the_package_names() -> None:
    names = [p.removesuffix(".py").replace("/", ".") for p in setup_compiled()]
    assert names == list(_compiled.COMPILED_MODULES)


def imported_files(environ: dict[str, str]) -> dict[str, str]:
    code = (
        "import importlib, json, sys\n"
        "from sidecar import _compiled\n"
        "print(_compiled.request_path_text())\n"
        "print(json.dumps({n: importlib.import_module(n).__file__ "
        "for n in _compiled.COMPILED_MODULES}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    ).stdout.splitlines()

    files: dict[str, str] = json.loads(out[1])
    files["<text>"] = out[0]
    return files


@pytest.mark.skipif(
    os.environ.get("SIDECAR_PURE_PYTHON", "") not in ("", "0"),
    reason="installed with SIDECAR_PURE_PYTHON: nothing compiled",
)
def test_the_installed_request_path_is_compiled_and_the_switch_runs_the_source() -> None:
    environ = {k: v for k, v in os.environ.items() if k != _compiled.ENV}
    compiled = imported_files(environ)
    assert compiled.pop("<text>") == "compiled (mypyc)", (
        "the request path is not compiled: install with mypy available (setup.py)"
    )
    assert not any(f.endswith(".py") for f in compiled.values()), compiled
    interpreted = imported_files({**environ, _compiled.ENV: "1"})
    assert interpreted.pop("<text>") == f"interpreted ({_compiled.ENV} is set)"
    assert all(f.endswith(".py") for f in interpreted.values()), interpreted
    assert {Path(f).parent for f in interpreted.values()} == {
        Path(f).parent for f in compiled.values()
    }


def test_an_extension_older_than_its_source_or_left_over_is_found(tmp_path: Path) -> None:
    package = tmp_path / "sidecar"
    (package / "proxy").mkdir(parents=True)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    fresh = package / "proxy" / "relay.py"
    fresh.write_text("")
    old = package / "meter.py"
    old.write_text("")
    leftover = package / "proxy" / "stalls.py"  # not compiled (any more)
    leftover.write_text("")
    (package / "proxy" / "_tokenscan.so").write_text("")  # a C extension: no .py twin
    earlier = time.time() - 60
    for source in (fresh, old, leftover):
        (source.with_name(source.stem + suffix)).write_text("")
    os.utime(old.with_name(old.stem + suffix), (earlier, earlier))
    os.utime(fresh, (earlier, earlier))
    assert _compiled.stale_extensions(package) == [
        f"sidecar/meter{suffix}",
        f"sidecar/proxy/stalls{suffix}",
    ]
    (package / "meter.py").unlink()
    (package / "proxy" / "stalls.py").unlink()
    assert _compiled.stale_extensions(package) == []


def test_no_compiled_function_binds_one_except_name_to_two_types() -> None:
    """mypyc gives a name one type per function: ``except A as exc`` then ``except B as exc``
    makes the second a TypeError at run time where B is not an A (it was: the upstream's
    malformed HTTP answered as a closed connection). Each except clause of a compiled function
    that catches another type binds another name."""
    clashes = []
    for path in setup_compiled():
        tree = ast.parse((REPO / path).read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            caught: dict[str, set[str]] = {}
            for node in ast.walk(function):
                if isinstance(node, ast.ExceptHandler) and node.name:
                    kind = ast.unparse(node.type) if node.type else "BaseException"
                    caught.setdefault(node.name, set()).add(kind)
            clashes += [
                f"{path}:{function.name}: {name} {sorted(kinds)}"
                for name, kinds in caught.items()
                if len(kinds) > 1
            ]
    assert clashes == []


def _stored_names(nodes: list[ast.stmt] | list[ast.ExceptHandler]) -> set[str]:
    return {
        sub.id
        for node in nodes
        for sub in ast.walk(node)
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)
    }


def _ends_in_exit(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise))


def finally_hazards(source: str) -> list[str]:
    """Each ``finally`` of the source's functions that reads a name its try assigns, while the
    try can be left by falling off its end (its body, a handler or its else not ending in a
    return or a raise)."""
    hazards = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if not isinstance(node, ast.Try) or not node.finalbody:
                continue
            assigned = _stored_names(node.body) | _stored_names(node.handlers)
            assigned |= _stored_names(node.orelse)
            read = {
                sub.id
                for stmt in node.finalbody
                for sub in ast.walk(stmt)
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)
            }
            exits = [node.orelse or node.body, *(h.body for h in node.handlers)]
            if assigned & read and not all(_ends_in_exit(body) for body in exits):
                hazards.append(f"{function.name}:{node.lineno}: {sorted(assigned & read)}")
    return hazards


def test_no_compiled_finally_reads_what_its_try_narrowed() -> None:
    """mypy checks a ``finally`` twice, for the ways out of the try and then for its fall-through
    alone, and mypyc compiles the second: ``x: T | None = None; try: x = f() ... finally: if x
    is not None`` read ``x`` as a T, and raised TypeError in the finally when f raised (it did:
    a client gone before the upstream answered a relayed request). A compiled try whose
    finally reads what the try assigns has no fall-through: each way out returns or raises."""
    hazards = []
    for path in setup_compiled():
        hazards += [f"{path}:{h}" for h in finally_hazards((REPO / path).read_text())]
    assert hazards == []


def test_the_finally_guard_sees_a_fall_through() -> None:
    narrowed = (
        "def f() -> None:\n    x = None\n    try:\n        x = g()\n    finally:\n"
        "        if x is not None:\n            x.close()\n"
    )
    assert finally_hazards(narrowed) == ["f:3: ['x']"]
    returned = narrowed.replace("x = g()\n", "x = g()\n        return\n")
    assert finally_hazards(returned) == []
    handled = returned.replace(
        "    finally:", "    except ValueError:\n        x = None\n    finally:"
    )
    assert finally_hazards(handled) == ["f:3: ['x']"]
    assert finally_hazards(handled.replace("x = None\n    finally", "raise\n    finally")) == []


# Dataclasses of the compiled modules, each built once or for a refused request only.
DATACLASSES_OFF_THE_REQUEST_PATH = {
    "sidecar/proxy/listener.py": {"ListenerLimits", "Rejection"},
    "sidecar/proxy/routing.py": {"Replica"},
    "sidecar/protocol/rewrite.py": {"UsagePlan"},
}


def test_no_class_built_for_every_request_is_a_dataclass() -> None:
    """mypyc compiles a class's own __init__, but a dataclass's is generated when the module
    is imported and runs interpreted (IncomingRequest's was 36 bytecodes of every request):
    a class the request path builds per request is a plain class. The dataclasses left are
    listed, each built once (settings, a replica, a usage plan) or for a refused request."""
    found: dict[str, set[str]] = {}
    for path in setup_compiled():
        for node in ast.walk(ast.parse((REPO / path).read_text())):
            if isinstance(node, ast.ClassDef) and any(
                (d.func if isinstance(d, ast.Call) else d).id == "dataclass"  # type: ignore[attr-defined]
                for d in node.decorator_list
                if isinstance(d.func if isinstance(d, ast.Call) else d, ast.Name)
            ):
                found.setdefault(path, set()).add(node.name)
    assert found == DATACLASSES_OFF_THE_REQUEST_PATH
