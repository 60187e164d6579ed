"""The README's main job, `sidecar demo`, run as a user would run it (short)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_end_to_end_and_summarises() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "demo",
            # 1 s of load at 10 req/s (6 requests with this seed): the run, then its replay,
            # take about twice the duration plus the longest request.
            "--duration",
            "1s",
            "--rate",
            "10",
            "--replicas",
            "2",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "proxy:" in out and "TTFT p50" in out
    assert "t: seconds since the load began; TTFT, ITL, TPOT, E2E: milliseconds" in out
    ok = re.search(r"outcomes: ok=(\d+), http_error=0, upstream_error=0, timeout=0", out)
    assert ok is not None and int(ok.group(1)) > 0
    assert "[client]" in out and "[server]" in out
    assert "[the sidecar's own delay] per token event" in out
    assert re.search(r"goodput under SLO \(ttft<=500ms, tpot<=50ms, e2e<=20000ms", out)
    # The capture was replayed and the two runs compared: same requests, same output tokens.
    assert "captured run vs its replay" in out
    ok_line = re.search(r"requests ok\s+(\d+)\s+(\d+)", out)
    out_line = re.search(r"output tokens\s+(\d+)\s+(\d+)", out)
    assert ok_line is not None and ok_line.group(1) == ok_line.group(2) == ok.group(1)
    assert out_line is not None and out_line.group(1) == out_line.group(2)


def test_demo_refuses_bad_arguments() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "demo", "--slo", "ttft=fast"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "not a duration" in done.stderr


def test_demo_on_a_real_vllm_that_is_not_there_says_so() -> None:
    for target, message in (
        ("bogus", "give 'start' or the server's URL"),
        ("http://127.0.0.1:9", "no vLLM: http://127.0.0.1:9 is unreachable"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "sidecar", "demo", "--real-vllm", target, "--duration", "1s"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr
