"""What a user sees when a command cannot do what it was asked: one line on stderr that names
the path, address or flag and the cause, and the exit status of the convention in
`sidecar --help` (2: usage or input error; 1: ran but failed) -- never a traceback. Every case
runs the command as a user does: `python -m sidecar ...` in a process of its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_proxy_cli import read_url

from sidecar.tracefile import TraceHeader, TraceRequest, write_trace

DATA = Path(__file__).resolve().parent / "data" / "traces"


def sidecar(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def sidecars(*argvs: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    """``sidecar(*argv)`` for each of ``argvs``, all at once (they must not depend on each
    other); the results in the same order."""
    with ThreadPoolExecutor(len(argvs)) as pool:
        return list(pool.map(lambda argv: sidecar(*argv), argvs))


def one_line(stderr: str) -> str:
    """The whole of stderr, which must be one line."""
    assert "Traceback" not in stderr, stderr
    assert stderr.count("\n") == 1 and stderr.endswith("\n"), stderr
    return stderr.rstrip("\n")


@contextmanager
def port_in_use() -> Iterator[int]:
    """A port another program listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


# -- item 3: a port in use, a capture directory that cannot be one, an output nowhere ----------


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_port_in_use_is_one_line_naming_the_listener(workers: str) -> None:
    """Both listeners, in one process (--workers 0) and with worker processes."""
    upstream = ("--upstream", "http://127.0.0.1:9", "--workers", workers)
    with port_in_use() as port:
        done = sidecar(
            "proxy", *upstream, "--listen", f"127.0.0.1:{port}", "--metrics-listen", "127.0.0.1:0"
        )
        assert done.returncode == 2
        assert one_line(done.stderr) == (
            f"sidecar proxy: cannot listen on 127.0.0.1:{port} "
            "(traffic, --listen): Address already in use"
        )
        done = sidecar(
            "proxy", *upstream, "--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{port}"
        )
        assert done.returncode == 2
        assert one_line(done.stderr) == (
            f"sidecar proxy: cannot listen on 127.0.0.1:{port} "
            "(admin, --metrics-listen): Address already in use"
        )


def test_a_simulator_port_in_use_is_one_line() -> None:
    with port_in_use() as port:
        done = sidecar("sim", "--port", str(port))
        assert done.returncode == 2
        assert one_line(done.stderr) == (
            f"sidecar sim: error: cannot listen on 127.0.0.1:{port}: Address already in use"
        )


def test_a_replay_metrics_port_in_use_is_one_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, TraceHeader(source="test"), [TraceRequest(t=0, n_in=5, n_out=2)])
    with port_in_use() as port:
        done = sidecar(
            "replay",
            str(trace),
            "--target",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--no-progress",
            "--metrics-listen",
            f"127.0.0.1:{port}",
        )
        assert done.returncode == 2
        assert one_line(done.stderr) == (
            f"sidecar replay: cannot listen on 127.0.0.1:{port} "
            "(--metrics-listen): Address already in use"
        )


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_capture_path_that_cannot_be_a_directory_is_one_line(
    tmp_path: Path, workers: str
) -> None:
    a_file = tmp_path / "capture"
    a_file.write_text("a file, not a directory")
    done = sidecar(
        "proxy",
        "--upstream",
        "http://127.0.0.1:9",
        "--workers",
        workers,
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--capture",
        str(a_file),
    )
    assert done.returncode == 2
    assert one_line(done.stderr) == (
        f"sidecar proxy: --capture {a_file}: not a directory (a file is there)"
    )


def proxy_with_env(name: str, value: str) -> subprocess.CompletedProcess[str]:
    """`sidecar proxy` on free ports with one setting of the environment: for the settings
    read from the environment only, which stop the start when their value is bad."""
    return sidecar(
        "proxy",
        "--upstream",
        "http://127.0.0.1:9",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        env={**os.environ, name: value},
    )


@pytest.mark.parametrize("value", ["700,2", "700,0,500", "a,b,c"])
def test_garbage_collector_thresholds_that_are_not_three_positive_integers_are_one_line(
    value: str,
) -> None:
    done = proxy_with_env("SIDECAR_GC_THRESHOLDS", value)
    assert done.returncode == 2
    assert one_line(done.stderr) == (
        f"sidecar proxy: SIDECAR_GC_THRESHOLDS={value!r}: want three positive integers, "
        "gc.set_threshold's generation 0, 1 and 2 thresholds (e.g. 700,2,500, the default; "
        "700,10,10 is CPython's)"
    )


def test_a_heap_switch_that_is_not_on_or_off_is_one_line() -> None:
    done = proxy_with_env("SIDECAR_KEEP_FREED_MEMORY", "maybe")
    assert done.returncode == 2
    assert one_line(done.stderr) == (
        "sidecar proxy: SIDECAR_KEEP_FREED_MEMORY must be 1 or 0 (true/false, yes/no, on/off): "
        "'maybe'"
    )


@pytest.mark.slow
def test_trace_import_into_a_folder_that_cannot_be_is_one_line(tmp_path: Path) -> None:
    a_file = tmp_path / "results"
    a_file.write_text("a file, not a folder")
    output = a_file / "sub" / "out.jsonl"
    made = tmp_path / "new" / "out.jsonl"
    sample = str(DATA / "azure_2023_sample.csv")
    # Three independent imports, side by side.
    into_a_file, into_a_folder, done = sidecars(
        ("trace", "import", "--format", "azure", sample, "-o", str(output)),
        ("trace", "import", "--format", "azure", sample, "-o", str(tmp_path), "--force"),
        ("trace", "import", "--format", "azure", sample, "-o", str(made)),
    )
    assert into_a_file.returncode == 2
    assert one_line(into_a_file.stderr) == (
        f"sidecar trace import: error: cannot write {output}: {a_file} is a file, not a folder"
    )
    assert into_a_folder.returncode == 2
    assert one_line(into_a_folder.stderr) == (
        f"sidecar trace import: error: -o {tmp_path} is a directory: give the file to write"
    )
    # A folder that is missing is made (as before), by import and merge alike.
    assert done.returncode == 0 and made.is_file(), done.stderr
    merged = tmp_path / "newer" / "merged.jsonl"
    done = sidecar("trace", "merge", str(made), "-o", str(merged))
    assert done.returncode == 0 and merged.is_file(), done.stderr
    done = sidecar("trace", "merge", str(made), "-o", str(output))
    assert done.returncode == 2
    assert one_line(done.stderr) == (
        f"sidecar trace merge: error: cannot write {output}: {a_file} is a file, not a folder"
    )


# -- item 11: wording and consistency ----------------------------------------------------------


@contextmanager
def proxy_with(env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """`sidecar proxy` on ephemeral ports, its upstream from ``env`` alone."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--workers",
            "0",
            "--health-interval",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_sidecar_upstream_in_the_singular_is_accepted() -> None:
    """SIDECAR_UPSTREAM (the flag is --upstream) used to be ignored: "at least one upstream"."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SIDECAR_")}
    env["SIDECAR_UPSTREAM"] = "http://127.0.0.1:9"
    with proxy_with(env) as proxy:
        assert read_url(proxy, r"proxy listening on \S+ -> (\S+)") == "http://127.0.0.1:9"
        proxy.send_signal(signal.SIGTERM)
        assert proxy.wait(timeout=15) == 0
    # Both spellings, set differently: refused rather than one chosen in silence.
    done = sidecar("proxy", env={**env, "SIDECAR_UPSTREAMS": "http://127.0.0.1:8"})
    assert done.returncode == 2
    assert one_line(done.stderr) == (
        "sidecar proxy: SIDECAR_UPSTREAMS and SIDECAR_UPSTREAM "
        "are the same setting, set differently: keep one"
    )
    # A misspelt variable is named in a warning (and ignored).
    with proxy_with({**env, "SIDECAR_TTFT_TIMOUT": "30s"}) as proxy:
        read_url(proxy, r"proxy listening on (\S+)")
        proxy.send_signal(signal.SIGTERM)
        _, err = proxy.communicate(timeout=15)
    assert (
        "sidecar proxy: warning: SIDECAR_TTFT_TIMOUT is not a setting (did you mean "
        "SIDECAR_TTFT_TIMEOUT?): ignored"
    ) in err


@pytest.mark.parametrize(
    ("argv", "usage", "message"),
    [
        (
            ("proxy", "--upstrem", "http://127.0.0.1:9"),
            "usage: sidecar proxy ",
            "sidecar proxy: error: unrecognized arguments: --upstrem http://127.0.0.1:9 "
            "(did you mean --upstream?)",
        ),
        (
            ("trace", "stats", "t.jsonl", "--jsn"),
            "usage: sidecar trace stats ",
            "sidecar trace stats: error: unrecognized arguments: --jsn (did you mean --json?)",
        ),
        (
            ("replay", "t.jsonl", "--target", "http://127.0.0.1:9", "--ratee", "2"),
            "usage: sidecar replay ",
            "(did you mean --rate?)",
        ),
    ],
)
def test_a_mistyped_flag_shows_its_commands_usage(
    argv: tuple[str, ...], usage: str, message: str
) -> None:
    done = sidecar(*argv)
    assert done.returncode == 2
    assert done.stderr.startswith(usage), done.stderr
    assert message in done.stderr


def test_sweep_rates_that_are_not_numbers_say_what_is_expected() -> None:
    done = sidecar(
        "sweep",
        "--target",
        "http://127.0.0.1:9",
        "--dataset",
        "synthetic:in=8,out=4",
        "--slo",
        "ttft=1s",
        "--rates",
        "fast",
    )
    assert done.returncode == 2
    assert "could not convert" not in done.stderr
    assert (
        "sidecar sweep: error: argument --rates: 'fast': give loads as numbers separated "
        "by commas, e.g. 1,2,4,8 (req/s; concurrent requests with --mode closed)"
    ) in done.stderr


def test_trace_import_of_a_directory_says_it_is_one(tmp_path: Path) -> None:
    done = sidecar(
        "trace", "import", "--format", "mooncake", str(DATA), "-o", str(tmp_path / "out.jsonl")
    )
    assert done.returncode == 2
    assert one_line(done.stderr) == (
        f"sidecar trace import: error: {DATA} is a directory: give the trace file in it"
    )


@pytest.mark.slow
def test_every_command_exits_2_on_input_errors_and_1_when_it_ran_but_failed(tmp_path: Path) -> None:
    """The convention of `sidecar --help` (trace used to exit 1 on unreadable input)."""
    missing = str(tmp_path / "absent.jsonl")
    exists = tmp_path / "exists.jsonl"
    exists.write_text("")
    imported = tmp_path / "mooncake.jsonl"
    sample = str(DATA / "mooncake_sample.jsonl")
    input_errors = (
        ("trace", "lint", missing),
        ("trace", "stats", missing),
        ("trace", "import", "--format", "mooncake", missing, "-o", str(tmp_path / "o.jsonl")),
        ("trace", "merge", missing, "-o", str(tmp_path / "m.jsonl")),
        ("replay", missing, "--target", "http://127.0.0.1:9"),
    )
    # The commands are independent of each other (each writes, if anything, a file of its
    # own): they run side by side, one process each as before, and are checked one by one.
    *missing_runs, refused, imported_run, help_run = sidecars(
        *input_errors,
        ("trace", "import", "--format", "mooncake", sample, "-o", str(exists)),
        ("trace", "import", "--format", "mooncake", sample, "-o", str(imported)),
        ("--help",),
    )
    for argv, done in zip(input_errors, missing_runs, strict=True):
        assert done.returncode == 2, (argv, done.stderr)
        assert "absent.jsonl" in one_line(done.stderr)
    assert refused.returncode == 2 and "exists (use --force to overwrite)" in refused.stderr
    # Ran, and found errors: 1 (the Mooncake sample's hash lists are too short for n_in).
    assert imported_run.returncode == 0, imported_run.stderr
    done = sidecar("trace", "lint", str(imported))
    assert done.returncode == 1 and "error: prefix-size-mismatch" in done.stdout
    help_text = help_run.stdout
    assert "exit status, every command:" in help_text
    assert "2    a usage or input error" in help_text and "1    it ran but failed" in help_text


def test_trace_stats_explains_its_histogram(tmp_path: Path) -> None:
    imported = tmp_path / "azure.jsonl"
    assert (
        sidecar(
            "trace",
            "import",
            "--format",
            "azure",
            str(DATA / "azure_2023_sample.csv"),
            "-o",
            str(imported),
        ).returncode
        == 0
    )
    done = sidecar("trace", "stats", str(imported))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    (bars,) = [i for i, line in enumerate(lines) if line.startswith("per ")]
    assert lines[bars + 1].startswith("legend      one character per ")
    assert "' ' no request, .:-=+*#%@ fewest to most (@ = " in lines[bars + 1]
