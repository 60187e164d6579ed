"""`sidecar proxy` as an operator runs it: a process, flags, signals."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest


@contextmanager
def process(*args: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def read_url(proc: subprocess.Popen[str], pattern: str) -> str:
    assert proc.stdout is not None
    for _ in range(10):
        line = proc.stdout.readline()
        match = re.search(pattern, line)
        if match:
            return match.group(1)
    raise AssertionError(f"no line matching {pattern!r}")


def stats_when(
    admin: str, ready: Callable[[dict[str, Any]], bool], timeout_s: float = 10.0
) -> dict[str, Any]:
    """/stats once ``ready`` holds for it (or the last one seen, after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(admin + "/stats", timeout=10) as response:
            stats: dict[str, Any] = json.load(response)
        if ready(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_proxy_process_serves_and_stops_cleanly_on_sigterm() -> None:
    with process("sim", "--replicas", "1", "--port", "0") as sim:
        upstream = read_url(sim, r"listening on (http://\S+)")
        with process(
            "proxy",
            "--upstream",
            upstream,
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--health-interval",
            "0",
        ) as proxy:
            url = read_url(proxy, r"proxy listening on (http://\S+)")
            admin = read_url(proxy, r"admin on (http://\S+)")
            body = json.dumps(
                {"model": "sim-model", "prompt": "hi", "max_tokens": 3, "stream": True}
            ).encode()
            request = urllib.request.Request(
                url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.read().endswith(b"data: [DONE]\n\n")
            # With worker processes the record reaches the collector's window a few ms after
            # the response (the channel batches); it must get there, and only once.
            assert stats_when(admin, lambda s: s["outcomes"]["ok"] >= 1)["outcomes"]["ok"] == 1
            proxy.send_signal(signal.SIGTERM)
            assert proxy.wait(timeout=15) == 0
            assert proxy.stdout is not None
            rest = proxy.stdout.read()
            assert "proxy stopping: in-flight requests finish, then the sinks flush" in rest
            assert rest.endswith("proxy stopped\n"), rest
        sim.send_signal(signal.SIGINT)
        assert sim.wait(timeout=15) == 0


@pytest.mark.slow
def test_the_start_up_lines_name_slos_capture_and_workers_and_sigterm_says_what_it_flushed(
    tmp_path: Path,
) -> None:
    """An operator reads at start what the proxy measures and keeps (its SLOs, its capture
    directory, its processes), and at a SIGTERM what the capture flushed: records written,
    records dropped."""
    capture = tmp_path / "capture"
    with process("sim", "--replicas", "1", "--port", "0") as sim:
        upstream = read_url(sim, r"listening on (http://\S+)")
        for workers, processes in (("2", "2 worker processes"), ("0", "one process (--workers 0)")):
            folder = capture / workers
            with process(
                "proxy",
                "--upstream",
                upstream,
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--health-interval",
                "0",
                "--workers",
                workers,
                "--slo",
                "ttft=500ms,tpot=50ms",
                "--capture",
                str(folder),
            ) as proxy:
                url = read_url(proxy, r"proxy listening on (http://\S+)")
                admin = read_url(proxy, r"admin on (http://\S+)")
                measuring = read_url(proxy, r"^(measuring: .*)$")
                assert measuring == (
                    f"measuring: SLO ttft<=500ms, tpot<=50ms; capture to "
                    f"{folder} (no text); {processes}; live window 60 s"
                )
                body = json.dumps(
                    {"model": "sim-model", "prompt": "hi", "max_tokens": 3, "stream": True}
                ).encode()
                for _ in range(3):
                    request = urllib.request.Request(
                        url + "/v1/completions",
                        data=body,
                        headers={"Content-Type": "application/json"},
                    )
                    with urllib.request.urlopen(request, timeout=10) as response:
                        response.read()
                # Workers batch their records to the collector: all three reach its sinks.
                assert stats_when(admin, lambda s: s["outcomes"]["ok"] >= 3)["outcomes"]["ok"] == 3
                proxy.send_signal(signal.SIGTERM)
                assert proxy.wait(timeout=15) == 0
                assert proxy.stdout is not None
                rest = proxy.stdout.read()
                assert rest.endswith(
                    f"proxy stopped; capture flushed: 3 records written to "
                    f"{folder} (1 file), 0 dropped\n"
                ), rest
        sim.send_signal(signal.SIGINT)
        assert sim.wait(timeout=15) == 0
    with process(
        "proxy",
        "--upstream",
        "http://127.0.0.1:9",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--health-interval",
        "0",
        "--workers",
        "0",
    ) as proxy:
        measuring = read_url(proxy, r"^(measuring: .*)$")
        assert measuring == (
            "measuring: no SLO (no goodput); capture off; one process "
            "(--workers 0); live window 60 s"
        )
        stamps = read_url(proxy, r"^(server-side stamps: .*)$")
        assert stamps == "server-side stamps: the kernel's receive timestamps (SO_TIMESTAMPNS)"
        scanner = read_url(proxy, r"^(token chunks: .*)$")
        assert scanner == "token chunks: scanned in C (sidecar.protocol._tokenscan)"
        proxy.send_signal(signal.SIGTERM)
        assert proxy.wait(timeout=15) == 0


def test_sigterm_right_after_the_listening_line_is_a_graceful_stop() -> None:
    """The signal handlers are in place before the proxy says it listens, so an orchestrator
    that stops it at once gets exit 0, not death by the default SIGTERM action (-15)."""
    with process(
        "proxy",
        "--upstream",
        "http://127.0.0.1:9",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--health-interval",
        "0",
    ) as proxy:
        read_url(proxy, r"proxy listening on (http://\S+)")
        proxy.send_signal(signal.SIGTERM)
        assert proxy.wait(timeout=15) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "at least one upstream"),
        (("--upstream", "localhost:8000"), "http(s) URL"),
        (("--upstream", "http://127.0.0.1:1", "--ttft-timeout", "soon"), "not a duration"),
        (("--upstream", "http://127.0.0.1:1", "--slo", "ttft=1s,latency=2s"), "bad SLO term"),
    ],
)
def test_bad_settings_exit_2_with_the_reason(args: tuple[str, ...], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "proxy", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2
    assert message in done.stderr
