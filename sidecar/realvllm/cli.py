"""``sidecar vllm up | down | status``: a real vLLM server on this machine, on CPU.

Wired like every command: module-level DESCRIPTION and EPILOG, ``add_arguments(parser)`` and
``async def run(args) -> int``. The work is synchronous (subprocesses and waits); nothing
else shares the event loop. Ctrl-C or SIGTERM at any point leaves no server behind, except
after a detached ``up`` has returned, which is the point of it.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from sidecar.realvllm.install import (
    HOME_ENV,
    TORCH_VERSION,
    VLLM_DIST,
    VLLM_VERSION,
    Home,
    RealVLLMError,
    describe,
    ensure_model,
    ensure_venv,
)
from sidecar.realvllm.server import (
    SERVED_MODEL,
    START_TIMEOUT_S,
    TOOL_CALL_ARGS,
    ServerHandle,
    ServerStartError,
    check_port_free,
    log_tail,
    running_server,
    start_server,
)

DESCRIPTION = f"""\
Bring up vLLM's own OpenAI-compatible server on this machine, without a GPU or a model
hub: {VLLM_DIST} {VLLM_VERSION} (vLLM built for x86 CPUs) with torch {TORCH_VERSION} in a
venv of its own, serving a tiny random-weight Llama built offline as model "{SERVED_MODEL}"
on 127.0.0.1. The venv (about 4 minutes and 3.4 GB the first time) and the model (seconds)
are made once under the home directory and reused.

  up      install what is missing, start the server, wait until GET /health answers (~1 min)
  down    stop the home's server (its whole process group)
  status  where things are and whether a server runs (exit 0: running, 3: not)

The home is --home, else ${HOME_ENV}, else ~/.cache/sidecar/vllm-cpu. The engine
busy-spins about two cores even when idle: stop it when done. See docs/real-vllm.md.
"""

EPILOG = """\
examples:
  sidecar vllm up
      on 127.0.0.1:8000, detached; prints the URL and how to stop it
  sidecar vllm up --port 8100 --per-request-metrics --foreground
      per-request metrics on; Ctrl-C stops it
  sidecar vllm up --tool-calls
      with a tool parser: named and "required" tool_choice answer with tool calls
  sidecar vllm down
  pytest tests/conformance --real-vllm=http://127.0.0.1:8000
      the conformance suite against the running server (started with --tool-calls, as CI
      starts it)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(vllm_parser=parser)
    actions = parser.add_subparsers(dest="vllm_command", metavar="ACTION")
    home_help = (
        f"where the venv, model, logs and state live [${HOME_ENV}, else ~/.cache/sidecar/vllm-cpu]"
    )

    up = actions.add_parser(
        "up",
        help="install what is missing and start the server",
        description="Install the venv and build the model if missing, start vLLM's OpenAI "
        "server on 127.0.0.1 and wait until it is ready. Without --foreground it "
        "keeps running after this command returns; `sidecar vllm down` stops it.",
    )
    up.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 [8000]")
    up.add_argument(
        "--per-request-metrics",
        action="store_true",
        help="start vLLM with --enable-per-request-metrics",
    )
    up.add_argument("--home", metavar="DIR", help=home_help)
    up.add_argument(
        "--foreground",
        action="store_true",
        help="stay attached; Ctrl-C or SIGTERM stops the server",
    )
    up.add_argument(
        "--timeout",
        type=float,
        default=START_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long to wait for GET /health [{START_TIMEOUT_S:.0f}]",
    )
    up.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="vLLM exports its request spans here (OTLP/HTTP, e.g. "
        "http://127.0.0.1:4318/v1/traces); with `sidecar proxy --otel-traces` in "
        "front they are children of the sidecar's spans",
    )
    up.add_argument(
        "--tool-calls",
        action="store_true",
        help="serve tool calls: start vLLM with "
        f"{' '.join(shlex.quote(arg) for arg in TOOL_CALL_ARGS)} "
        "(docs/real-vllm.md)",
    )
    up.add_argument(
        "--vllm-arg",
        dest="vllm_args",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for vLLM's server, e.g. --vllm-arg=--enforce-eager (repeat)",
    )

    down = actions.add_parser(
        "down",
        help="stop the server",
        description="Stop the home's vLLM server: SIGTERM to its process "
        "group, SIGKILL to what is left after 20 s.",
    )
    down.add_argument("--home", metavar="DIR", help=home_help)

    status = actions.add_parser(
        "status",
        help="where things are; is a server running",
        description="Print the home's venv, model and server state. "
        "Exit status 0 when a server runs, 3 when none.",
    )
    status.add_argument("--home", metavar="DIR", help=home_help)


async def run(args: argparse.Namespace) -> int:
    command = getattr(args, "vllm_command", None)
    actions: dict[str, Callable[[argparse.Namespace], int]] = {
        "up": _up,
        "down": _down,
        "status": _status,
    }
    if command not in actions:
        parser = getattr(args, "vllm_parser", None)
        if parser is not None:
            parser.print_help(sys.stderr)
        return 2
    try:
        with _signals_interrupt():
            return actions[command](args)
    except RealVLLMError as exc:
        print(f"sidecar vllm {command}: {exc.summary}", file=sys.stderr)
        for line in exc.tail:  # the tool's own words on why (pip's, vLLM's log)
            print(f"    {line}", file=sys.stderr)
        return 2
    except OSError as exc:  # a home that cannot be written, and the like
        print(f"sidecar vllm {command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sidecar vllm {command}: interrupted (nothing left running)", file=sys.stderr)
        return 130


@contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the blocking code below (the event
    loop's own handlers would only run once that code returns)."""

    def interrupt(_signum: int, _frame: Any) -> NoReturn:
        raise KeyboardInterrupt

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say(line: str) -> None:
    print(line, flush=True)


def _timed(what: Callable[[], Any]) -> float:
    began = time.monotonic()
    what()
    return time.monotonic() - began


def _ensure_installed(home: Home) -> None:
    """The home's venv and tiny model, made where missing, each step said on stderr."""
    if home.venv_ready():
        _say(f"venv:  {home.venv} (reused)")
    else:
        _say(
            f"venv:  installing {VLLM_DIST}=={VLLM_VERSION} and torch=={TORCH_VERSION} into "
            f"{home.venv} (about 4 minutes, 3.4 GB; log: {home.logs / 'install.log'})"
        )
        _say(f"venv:  installed in {_timed(lambda: ensure_venv(home)):.0f} s")
    if home.model_ready():
        _say(f"model: {home.model} (reused)")
    else:
        _say(f"model: building the tiny model into {home.model}")
        _say(f"model: built in {_timed(lambda: ensure_model(home)):.1f} s")


def _up(args: argparse.Namespace) -> int:
    home = Home.resolve(args.home)
    check_port_free(args.port)  # before minutes of installing, not after
    existing = running_server(home)
    if existing is not None:
        raise RealVLLMError(
            f"a vLLM server from {home.root} is already running (pid "
            f"{existing.pid}, {existing.url}); stop it with "
            f"`{_down_command(home, args)}`"
        )
    _ensure_installed(home)
    _say(
        f"vLLM:  starting on 127.0.0.1:{args.port} (about a minute; per-request metrics "
        f"{'on' if args.per_request_metrics else 'off'})"
    )
    began = time.monotonic()
    vllm_args = [*(TOOL_CALL_ARGS if args.tool_calls else ()), *args.vllm_args]
    handle = start_server(
        args.port,
        args.per_request_metrics,
        vllm_args,
        home=home,
        timeout_s=args.timeout,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    elapsed = time.monotonic() - began
    try:
        version = handle.version()
        _say(
            f"vLLM:  ready in {elapsed:.0f} s: {handle.url} (version {version}, model "
            f'"{SERVED_MODEL}", pid {handle.pid})'
        )
        _say(f"log:   {handle.log_path}")
        if not args.foreground:
            _say(f"stop:  {_down_command(home, args)}")
            handle.detach()
            return 0
        _say("stop:  Ctrl-C (or SIGTERM to this process)")
        while handle.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        _stop(handle)
        if args.foreground:
            return 0
        raise
    except BaseException:  # `up` did not finish: leave nothing running
        _stop(handle)
        raise
    code = handle.process.poll() if handle.process is not None else None
    handle.stop()
    raise ServerStartError(
        f"vLLM exited by itself (code {code}); log: {handle.log_path}", log_tail(handle.log_path)
    )


def _stop(handle: ServerHandle) -> None:
    began = time.monotonic()
    handle.stop()
    _say(f"vLLM:  stopped (pid {handle.pid}, {handle.url}) in {time.monotonic() - began:.1f} s")


def _down_command(home: Home, args: argparse.Namespace) -> str:
    return "sidecar vllm down" + (f" --home {home.root}" if args.home else "")


def _down(args: argparse.Namespace) -> int:
    home = Home.resolve(args.home)
    handle = running_server(home)
    if handle is None:
        _say(f"no vLLM server running from {home.root}")
        return 0
    _stop(handle)
    return 0


def _status(args: argparse.Namespace) -> int:
    home = Home.resolve(args.home)
    for line in describe(home):
        _say(line)
    handle = running_server(home)
    if handle is None:
        _say("server: not running")
        return 3
    state = "ready" if handle.healthy() else "not answering GET /health"
    if not handle.ready and state != "ready":
        state = "starting"
    _say(
        f"server: running, {state}: {handle.url} (pid {handle.pid}, per-request metrics "
        f"{'on' if handle.per_request_metrics else 'off'})"
    )
    _say(f"log:    {handle.log_path}")
    return 0
