"""The import rules of design.md, held by parsing every module's imports."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sidecar"

# top-level unit -> sidecar units it may import (itself always allowed). "*" = anything.
ALLOWED: dict[str, set[str]] = {
    # Which modules mypyc compiled, and the switch to their source (before any is imported).
    "__init__": {"_compiled"},
    "_compiled": set(),
    "__main__": {"*"},
    "cli": {"*"},
    "config": set(),
    "clock": set(),
    # Its types where C pays (sidecar/_recordtypes.c, an extension module of its own).
    "record": {"_recordtypes"},
    "stats": {"record"},
    "hooks": {"record"},
    "protocol": set(),
    "tracefile": {"record"},
    "engine_metrics": set(),
    "meter": {"protocol", "record"},
    "proxy": {"protocol", "record", "clock", "hooks", "config", "stats", "engine_metrics", "meter"},
    "sinks": {"record", "stats", "hooks", "config", "clock", "tracefile"},
    "replay": {
        "protocol",
        "tracefile",
        "record",
        "stats",
        "clock",
        "engine_metrics",
        "config",
        "meter",
    },
    "sim": {"protocol"},
    "demo": {"*"},
    # The proxy built with its sinks wired (build_proxy_server, build_collector), for the
    # commands (cli, demo), the tests and scripts alike: no command lives there.
    "serve": {"config", "hooks", "proxy", "sinks", "stats", "tracefile"},
    # A real vLLM in a venv of its own, driven through subprocesses (docs/real-vllm.md).
    "realvllm": set(),
}

# Third-party packages each unit may use (the standard library is always allowed).
THIRD_PARTY: dict[str, set[str]] = {
    # msgspec: JSON bodies decoded as `json` decodes them, faster (protocol/jsonbody.py).
    "protocol": {"msgspec"},
    "meter": set(),
    "record": set(),
    "clock": set(),
    "stats": {"numpy"},
}


def unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    package_parts = ["sidecar", *path.relative_to(PACKAGE).parent.parts]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.append(module)
            if module == "sidecar":  # `from sidecar import stats`
                names.extend(f"sidecar.{alias.name}" for alias in node.names)
    return names


def violations(unit: str, modules: list[str]) -> list[str]:
    """Why each import of ``modules`` by ``unit`` breaks the rules (empty when none does)."""
    problems: list[str] = []
    allowed = ALLOWED[unit]
    for module in modules:
        parts = module.split(".")
        top = parts[0]
        if top == "vllm":
            problems.append("imports vllm: the sidecar never imports the engine it measures")
        elif top == "sidecar":
            target = parts[1] if len(parts) > 1 else "__init__"
            if target not in ("__init__", unit) and "*" not in allowed and target not in allowed:
                problems.append(f"unit {unit!r} may not import sidecar.{target}")
        elif unit in THIRD_PARTY and top not in sys.stdlib_module_names:
            if top not in THIRD_PARTY[unit]:
                problems.append(f"unit {unit!r} may not depend on {top!r}")
    return problems


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_follow_the_design(path: Path) -> None:
    unit = unit_of(path)
    assert unit in ALLOWED, f"{path}: new top-level unit {unit!r}: add it to the design rules"
    assert violations(unit, imported_modules(path)) == []


def test_the_rules_catch_violations() -> None:
    assert violations("sim", ["sidecar.proxy.app", "sidecar.protocol.sse"]) == [
        "unit 'sim' may not import sidecar.proxy"
    ]
    assert violations("protocol", ["aiohttp", "json"]) == [
        "unit 'protocol' may not depend on 'aiohttp'"
    ]
    assert violations("cli", ["vllm.engine"]) != []


# -- the commands are the library's callers, never its parts ----------------------------------

# The modules that may import a command module (`cli.py` of the package or of a unit, or a
# `*_cli.py`): the front door, and `python -m sidecar`. A command only parses, calls the
# library (replay/session.py, replay/sweep_session.py, serve.py, ...) and prints: what another
# module would want from it belongs in the library.
COMMAND_IMPORTERS = {"cli.py", "__main__.py"}


def is_command_module(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return module.startswith("sidecar") and (last == "cli" or last.endswith("_cli"))


def command_imports(source: str) -> list[str]:
    """The command modules ``source`` imports, with ``from package import x_cli`` too."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.extend(name for name in names if is_command_module(name))
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_front_door_imports_a_command(path: Path) -> None:
    if str(path.relative_to(PACKAGE)) in COMMAND_IMPORTERS:
        return
    assert command_imports(path.read_text()) == []


def test_the_command_rule_catches_violations() -> None:
    assert command_imports("from sidecar.replay import replay_cli, load") == [
        "sidecar.replay.replay_cli"
    ]
    assert command_imports("import sidecar.replay.sweep_cli") == ["sidecar.replay.sweep_cli"]
    assert command_imports("from sidecar.sim import cli as sim_cli") == ["sidecar.sim.cli"]
    assert command_imports("from sidecar.replay import session, sweep_session") == []


# A module that declares a command (what the front door wires: a top-level `add_arguments`
# and `run`) is named as one (`cli.py` or `*_cli.py`), so that the rule above holds for it;
# its work lives in a library module named for what it holds (`sweep_cli.py` and
# `sweep_session.py`, `merge_cli.py` and `shardmerge.py`, `compare_cli.py` and `compare.py`).
# `demo.py` (`sidecar demo`) is still both the command and its work.
UNNAMED_COMMANDS = {"demo.py"}


def declares_command(source: str) -> bool:
    tree = ast.parse(source)
    defined = {
        node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    return {"add_arguments", "run"} <= defined


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_command_module_is_named_as_one(path: Path) -> None:
    relative = path.relative_to(PACKAGE)
    if str(relative) in UNNAMED_COMMANDS or not declares_command(path.read_text()):
        return
    assert is_command_module(".".join(["sidecar", *relative.with_suffix("").parts]))


def test_the_naming_rule_catches_violations() -> None:
    command = "def add_arguments(parser): ...\nasync def run(args): return 0\n"
    assert declares_command(command)
    assert not declares_command("def run(args): ...\n")
    assert not declares_command(
        "class X:\n    def add_arguments(self): ...\n    def run(self): ...\n"
    )
    assert is_command_module("sidecar.replay.merge_cli")
    assert not is_command_module("sidecar.replay.merge")
