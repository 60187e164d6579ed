"""`sidecar proxy --workers N`: worker processes on one port, one collector, one view.

Real processes and sockets on 127.0.0.1: the simulator, the collector and its workers. Waits
poll the collector's own account (/workers) until it settles; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from sidecar import stats
from sidecar.config import ConfigError, build_config, cgroup_cpu_quota, default_workers
from sidecar.hooks import Sink, SinkFanout, dropped_by_reason
from sidecar.proxy import channel
from sidecar.proxy.channel import ChannelSink, FrameProtocol, Kind
from sidecar.proxy.recordwire import decode_record
from sidecar.proxy.worker import config_from_wire, config_to_wire
from sidecar.record import Outcome, RequestRecord
from sidecar.tracefile import TraceReader

TOKEN = "workers-test-token"
FAST_SIM = ("--step-floor-s", "0.002")


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    stderr: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def line(self, pattern: str) -> str:
        assert self.popen.stdout is not None
        for _ in range(10):
            line = self.popen.stdout.readline()
            match = re.search(pattern, line)
            if match:
                return match.group(1)
        raise AssertionError(f"no line matching {pattern!r}; stderr:\n{self.stderr.read_text()}")


@contextmanager
def process(
    tmp_path: Path, name: str, *args: str, env: dict[str, str] | None = None
) -> Iterator[Proc]:
    # stderr to a file: the workers share it, and a pipe nobody reads could fill and block them.
    err = tmp_path / f"{name}.stderr"
    with open(err, "w") as handle:
        popen = subprocess.Popen(
            [sys.executable, "-m", "sidecar", *args],
            stdout=subprocess.PIPE,
            stderr=handle,
            text=True,
            env={**os.environ, **(env or {})},
        )
    try:
        yield Proc(popen, err)
    finally:
        if popen.poll() is None:
            popen.kill()  # SIGKILL works on a stopped process too
        popen.wait(timeout=30)
        if popen.stdout is not None:
            popen.stdout.close()


@contextmanager
def simulator(tmp_path: Path) -> Iterator[str]:
    with process(tmp_path, "sim", "sim", "--port", "0", *FAST_SIM) as sim:
        yield sim.line(r"listening on (http://\S+)")
        sim.popen.send_signal(signal.SIGINT)
        sim.popen.wait(timeout=15)


@contextmanager
def proxy(
    tmp_path: Path, upstreams: list[str], *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[Proc, str, str]]:
    flags = [flag for url in upstreams for flag in ("--upstream", url)]
    with process(
        tmp_path,
        "proxy",
        "proxy",
        *flags,
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--health-interval",
        "0",
        *args,
        env=env,
    ) as proc:
        url = proc.line(r"proxy listening on (http://\S+)")
        admin = proc.line(r"admin on (http://\S+)")
        yield proc, url, admin


def get(url: str, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=headers), timeout=10
    ) as response:
        body = response.read()
    return json.loads(body) if body.startswith((b"{", b"[")) else body.decode()


def send(
    url: str, i: int, prompt: str = "the same prompt for every request", max_tokens: int = 4
) -> bytes:
    """One request on a connection of its own (urllib does not keep connections), so that the
    kernel spreads them over the workers."""
    stream = i % 2 == 0
    chat = i % 3 == 0
    path, body = (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})
        if chat
        else ("/v1/completions", {"prompt": prompt})
    )
    payload = json.dumps(
        {"model": "sim-model", "max_tokens": max_tokens, "stream": stream, **body}
    ).encode()
    request = urllib.request.Request(
        url + path, data=payload, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        data: bytes = response.read()
    assert data.endswith(b"data: [DONE]\n\n") if stream else data.startswith(b"{")
    return data


def until(read: Callable[[], Any], done: Callable[[Any], bool], deadline_s: float = 20.0) -> Any:
    """What ``read`` returns once ``done`` holds for it (or at the deadline, for the caller's
    assertion to show)."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def settle(
    admin: str,
    done: Callable[[dict[str, Any]], bool],
    token: str | None = None,
    deadline_s: float = 20.0,
) -> dict[str, Any]:
    """/workers once ``done`` holds (statuses arrive every 0.25 s)."""
    view: dict[str, Any] = until(lambda: get(admin + "/workers", token), done, deadline_s)
    return view


def total(view: dict[str, Any], key: str) -> int:
    return sum(int(w[key]) for w in view["workers"])


def dropped(view: dict[str, Any]) -> int:
    return sum(sum(w["dropped"].values()) + w["lost"] for w in view["workers"])


def metric(exposition: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels``."""
    found = 0.0
    for line in exposition.splitlines():
        match = re.fullmatch(rf"{name}(?:{{(.*)}})? (\S+)", line)
        if match is None:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            found += float(match.group(2))
    return found


def accounted(view: dict[str, Any], requests: int) -> bool:
    """Every request a worker counted ended in a record the collector has, or a counted drop."""
    return total(view, "requests_total") == requests and all(
        w["requests_total"] == w["records_received"] + sum(w["dropped"].values()) + w["lost"]
        for w in view["workers"]
    )


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie that only its (new) parent can reap."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_two_workers_one_port_one_view_and_a_clean_stop(tmp_path: Path) -> None:
    capture = tmp_path / "capture"
    with (
        simulator(tmp_path) as upstream,
        proxy(
            tmp_path,
            [upstream],
            "--workers",
            "2",
            "--capture",
            str(capture),
            env={"SIDECAR_ADMIN_TOKEN": TOKEN},
        ) as (proc, url, admin),
    ):
        requests = 40
        for i in range(requests):
            send(url, i)
        view = settle(admin, lambda v: accounted(v, requests), TOKEN)
        workers = view["workers"]
        assert accounted(view, requests), view
        # Both processes served (SO_REUSEPORT spread 40 connections over them), none dropped.
        assert view["alive"] == 2 and len({w["pid"] for w in workers}) == 2
        assert all(w["requests_total"] > 0 for w in workers), workers
        assert dropped(view) == 0 and total(view, "records_received") == requests

        # /metrics: the counters are the sum over the workers.
        exposition = get(admin + "/metrics", TOKEN)
        assert metric(exposition, "sidecar_requests_total") == requests
        assert metric(exposition, "sidecar_workers_alive") == 2
        assert metric(exposition, "sidecar_channel_records_total") == requests
        assert metric(exposition, "sidecar_channel_dropped_records_total") == 0
        # Each worker's own CPU and context switches, as of its last status: at least what
        # starting an interpreter and importing the relay took, and no more than the kernel
        # says the process has used by now (its /proc ticks truncate to 10 ms, hence the slack).
        for w in workers:
            name = str(w["worker"])
            reported = sum(
                metric(exposition, "sidecar_worker_cpu_seconds_total", worker=name, mode=mode)
                for mode in ("user", "system")
            )
            fields = Path(f"/proc/{w['pid']}/stat").read_text().rsplit(")", 1)[1].split()
            used = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            assert 0.05 < reported <= used + 0.02, (w, reported, used)
            sleeps = metric(
                exposition, "sidecar_worker_context_switches_total", worker=name, kind="voluntary"
            )
            assert sleeps > 0, w  # a relay between requests sleeps in epoll_wait
            assert w["cpu_seconds"]["user"] + w["cpu_seconds"]["system"] <= reported + 1e-9
            assert 0 < w["context_switches"]["voluntary"] <= sleeps
        # The collector's sinks say what they took and dropped (their own counters)...
        assert metric(exposition, "sidecar_sink_records_taken_total", sink="capture") == requests
        assert metric(exposition, "sidecar_sink_records_dropped_total") == 0
        # ... and /metrics speaks OpenMetrics to whoever asks for it (Prometheus does).
        scrape = urllib.request.Request(
            admin + "/metrics",
            headers={"Authorization": f"Bearer {TOKEN}", "Accept": "application/openmetrics-text"},
        )
        with urllib.request.urlopen(scrape, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("application/openmetrics-text")
            openmetrics = response.read().decode()
        assert openmetrics.endswith("# EOF\n")
        assert metric(openmetrics, "sidecar_requests_total") == requests
        # Per-replica figures come with each worker's status (every 0.25 s): wait for them. A
        # status sent between a request's start (counted) and its end (outstanding back to 0)
        # is a moment, not the settled view: wait for both.
        replicas = until(
            lambda: get(admin + "/replicas", TOKEN),
            lambda r: (
                r["replicas"][0]["requests_total"] == requests
                and r["replicas"][0]["outstanding"] == 0
            ),
        )
        assert replicas["requests_total"] == requests == replicas["records_received"]
        # Reads that came without the kernel's stamp: summed over the workers, as counted.
        assert replicas["upstream_reads_unstamped"] == sum(
            w["upstream_reads_unstamped"] for w in settle(admin, lambda v: True, TOKEN)["workers"]
        )
        assert replicas["replicas"][0]["requests_total"] == requests
        assert replicas["replicas"][0]["outstanding"] == 0
        # The admin listener keeps its bearer token; /healthz stays open for probes.
        with pytest.raises(urllib.error.HTTPError) as refused:
            get(admin + "/workers")
        assert refused.value.code == 401
        refused.value.close()
        assert get(admin + "/healthz") == {
            "status": "ok",
            "in_flight": 0,
            "workers_alive": 2,
            "workers": 2,
        }
        snapshot = get(admin + "/stats", TOKEN)
        assert snapshot["outcomes"]["ok"] == requests

        # A stream still going when SIGTERM comes is finished, and its record kept.
        request = urllib.request.Request(
            url + "/v1/completions",
            headers={"Content-Type": "application/json"},
            data=json.dumps(
                {"model": "sim-model", "prompt": "long", "max_tokens": 300, "stream": True}
            ).encode(),
        )
        with urllib.request.urlopen(request, timeout=20) as response:
            assert response.readline().startswith(b"data: ")
            proc.popen.send_signal(signal.SIGTERM)
            assert response.read().endswith(b"data: [DONE]\n\n")
        assert proc.popen.wait(timeout=30) == 0
        assert all(gone(w["pid"]) for w in workers)  # reaped by the collector: no zombie
        assert "Traceback" not in proc.stderr.read_text()

    # The capture, flushed at exit, holds every record of both workers...
    files = sorted(capture.glob("*.jsonl"))
    lines = [line for path in files for line in TraceReader(path)]
    assert len(lines) == requests + 1 and all(line.outcome == "ok" for line in lines)
    # ... with one key for both: the same prompt has the same prefix hashes whichever served.
    hashes = {
        (line.endpoint, line.prefix.hashes if line.prefix else None)
        for line in lines
        if line.max_tokens == 4
    }
    assert len(hashes) == 2 and all(h for _endpoint, h in hashes)  # chat, completions
    assert TraceReader(files[0]).header.notes["capture_key_id"]
    # /stats percentiles are over all records: the same numbers from the captured requests.
    captured = [line for line in lines if line.max_tokens == 4]
    for metric_name, values in (
        ("ttft", [x.ttft_s for x in captured if x.ttft_s is not None]),
        ("e2e", [x.e2e_s for x in captured if x.e2e_s is not None]),
    ):
        summary = stats.summarize(values)
        expected = summary.to_dict()
        shown = snapshot["vantages"]["client"][metric_name]
        assert shown["count"] == summary.count > 0
        for key in ("p50", "p90", "p99", "mean", "max"):
            assert shown[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-12), key


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_traffic_goes_on(tmp_path: Path) -> None:
    with (
        simulator(tmp_path) as upstream,
        proxy(tmp_path, [upstream], "--workers", "2") as (proc, url, admin),
    ):
        for i in range(10):
            send(url, i)
        before = settle(admin, lambda v: accounted(v, 10))
        victim = before["workers"][0]
        victim_cpu = victim["cpu_seconds"]["user"] + victim["cpu_seconds"]["system"]
        assert victim_cpu > 0, victim
        os.kill(victim["pid"], signal.SIGKILL)
        after = settle(admin, lambda v: v["alive"] == 2 and v["restarts"] == 1)
        assert after["alive"] == 2 and after["restarts"] == 1, after
        reborn = after["workers"][0]
        assert reborn["pid"] != victim["pid"] and reborn["last_exit"] == "killed by SIGKILL"
        assert gone(victim["pid"])
        for i in range(20):
            send(url, i)

        def cpu(v: dict[str, Any]) -> float:
            seconds = v["workers"][0]["cpu_seconds"]
            return float(seconds["user"] + seconds["system"])

        # (and the new incarnation's first status, 0.25 s after its start, carries its CPU:
        # an interpreter's start and the relay's imports, well over 0.05 s)
        view = settle(admin, lambda v: accounted(v, 30) and cpu(v) > victim_cpu + 0.05)
        assert accounted(view, 30), view
        # The dead incarnation's counts are kept: nothing it recorded was lost (it was idle).
        assert total(view, "records_received") == 30 and dropped(view) == 0
        exposition = get(admin + "/metrics")
        assert metric(exposition, "sidecar_worker_restarts_total", worker="0") == 1
        # ... and its CPU: the slot's counter goes on from the dead one's last status.
        assert metric(exposition, "sidecar_worker_cpu_seconds_total", worker="0") >= cpu(view)
        assert cpu(view) > victim_cpu + 0.05
        assert metric(exposition, "sidecar_requests_total") == 30
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 0
        assert "killed by SIGKILL; starting it again" in proc.stderr.read_text()


def healthz(admin: str, path: str = "/healthz") -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(admin + path, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


def test_healthz_is_503_while_no_worker_serves(tmp_path: Path) -> None:
    with (
        simulator(tmp_path) as upstream,
        proxy(tmp_path, [upstream], "--workers", "1") as (proc, _url, admin),
    ):
        assert healthz(admin)[0] == 200
        (worker,) = get(admin + "/workers")["workers"]
        os.kill(worker["pid"], signal.SIGKILL)
        # Until it is started again (after a 0.5 s backoff at least), nothing serves.
        seen: list[tuple[int, dict[str, Any]]] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
            not seen or seen[-1][0] != 200 or all(code == 200 for code, _ in seen)
        ):
            seen.append(healthz(admin))
            time.sleep(0.02)
        down = [body for code, body in seen if code == 503]
        assert down and down[0] == {
            "status": "no_workers",
            "in_flight": 0,
            "workers_alive": 0,
            "workers": 1,
        }
        assert seen[-1] == (200, {"status": "ok", "in_flight": 0, "workers_alive": 1, "workers": 1})
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 0


def test_a_full_channel_drops_and_counts_and_never_blocks_traffic(tmp_path: Path) -> None:
    """The collector stops reading (SIGSTOP); the worker goes on relaying, and what does not
    fit its (tiny) channel bound is dropped and counted, never waited for."""
    with (
        simulator(tmp_path) as upstream,
        proxy(tmp_path, [upstream], "--workers", "1", "--channel-buffer-bytes", "1") as (
            proc,
            url,
            admin,
        ),
    ):
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            requests = 60
            for i in range(requests):
                send(url, i, prompt=f"prompt {i} " + "x" * 200, max_tokens=16)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        view = settle(admin, lambda v: accounted(v, requests))
        assert accounted(view, requests), view
        (worker,) = view["workers"]
        full = worker["dropped"]["channel_full"]
        assert full > 0 and worker["records_received"] == requests - full
        exposition = get(admin + "/metrics")
        assert (
            metric(exposition, "sidecar_channel_dropped_records_total", reason="channel_full")
            == full
        )
        # The request counters count what arrived; with the drops, they add up to the traffic.
        assert metric(exposition, "sidecar_requests_total") == requests - full
        assert get(admin + "/stats")["records"] == requests - full
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 0


def test_workers_exit_when_the_collector_dies(tmp_path: Path) -> None:
    with (
        simulator(tmp_path) as upstream,
        proxy(tmp_path, [upstream], "--workers", "2") as (proc, _url, admin),
    ):
        pids = [w["pid"] for w in get(admin + "/workers")["workers"]]
        proc.popen.kill()
        proc.popen.wait(timeout=10)
        deadline = time.monotonic() + 20
        while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(gone(pid) for pid in pids)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_port_in_use_is_one_line_and_exit_2(tmp_path: Path, workers: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "sidecar",
                "proxy",
                "--upstream",
                "http://127.0.0.1:9",
                "--listen",
                f"127.0.0.1:{port}",
                "--metrics-listen",
                "127.0.0.1:0",
                "--health-interval",
                "0",
                "--workers",
                workers,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use" in lines[0] and str(port) in lines[0], done.stderr
    assert done.stdout == ""


def test_an_ejection_by_one_worker_reaches_every_worker(tmp_path: Path) -> None:
    """A connect failure seen by one worker takes the replica out of every worker's rotation
    (through the collector), as one process shares one view of its replicas."""
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))  # bound, never listening: connecting is refused
        dead = f"http://127.0.0.1:{hole.getsockname()[1]}"
        with (
            simulator(tmp_path) as upstream,
            proxy(
                tmp_path,
                [upstream, dead],
                "--workers",
                "2",
                "--eject-after",
                "1",
                "--retry-connect",
                "1",
            ) as (proc, url, admin),
        ):
            # least_outstanding's first pick is the second replica: the dead one. The retry
            # on the live one answers.
            send(url, 1)

            def everywhere(view: dict[str, Any]) -> bool:
                return all(
                    w["replicas"] and not w["replicas"][1]["healthy"] for w in view["workers"]
                )

            view = settle(admin, everywhere)
            assert everywhere(view), view
            served = [w for w in view["workers"] if w["requests_total"]]
            idle = [w for w in view["workers"] if not w["requests_total"]]
            assert len(served) == 1 and served[0]["replicas"][1]["ejections"] == 1
            # The other worker never tried the dead replica: it learnt from the collector.
            assert len(idle) == 1 and idle[0]["replicas"][1]["ejections"] == 0
            replicas = get(admin + "/replicas")
            assert [r["healthy"] for r in replicas["replicas"]] == [True, False]
            assert healthz(admin, "/readyz") == (
                200,
                {"status": "ready", "healthy_replicas": 1, "replicas": 2},
            )
            assert replicas["replicas"][1]["ejections"] == 1
            exposition = get(admin + "/metrics")
            assert metric(exposition, "sidecar_replica_healthy", replica=dead.split("://")[1]) == 0
            proc.popen.send_signal(signal.SIGTERM)
            assert proc.popen.wait(timeout=30) == 0


def test_readyz_is_503_while_no_replica_is_healthy(tmp_path: Path) -> None:
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))  # bound, never listening: health checks fail
        dead = f"http://127.0.0.1:{hole.getsockname()[1]}"
        with proxy(
            tmp_path, [dead], "--workers", "1", "--eject-after", "1", "--health-interval", "50ms"
        ) as (proc, _url, admin):
            status = until(lambda: healthz(admin, "/readyz"), lambda got: got[0] == 503)
            assert status == (
                503,
                {"status": "no_healthy_replica", "healthy_replicas": 0, "replicas": 1},
            )
            assert healthz(admin)[0] == 200  # alive: a liveness probe must not restart it
            proc.popen.send_signal(signal.SIGTERM)
            assert proc.popen.wait(timeout=30) == 0


class _CountingUpstream(http.server.BaseHTTPRequestHandler):
    hits: dict[str, int] = {}
    lock = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        with self.lock:
            self.hits[self.path] = self.hits.get(self.path, 0) + 1
        body = b"vllm:num_requests_running 0\n" if self.path == "/metrics" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_health_checks_and_engine_scrapes_run_once_not_per_worker(tmp_path: Path) -> None:
    _CountingUpstream.hits = {}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CountingUpstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    upstream = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with proxy(
            tmp_path,
            [upstream],
            "--workers",
            "3",
            "--health-interval",
            "50ms",
            "--engine-scrape-interval",
            "50ms",
        ) as (proc, _url, admin):

            def counts() -> tuple[int, int]:
                (replica,) = get(admin + "/replicas")["replicas"]
                return replica["health_checks"], replica["engine"]["scrapes"] + replica["engine"][
                    "failures"
                ]

            deadline = time.monotonic() + 20
            while min(counts()) < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            checks_before, scrapes_before = counts()
            with _CountingUpstream.lock:
                health_hits = _CountingUpstream.hits.get("/health", 0)
                metrics_hits = _CountingUpstream.hits.get("/metrics", 0)
            checks_after, scrapes_after = counts()
            # What the upstream saw is what the collector sent (one may be on its way): three
            # workers checking too would have tripled it.
            assert min(checks_before, scrapes_before) >= 5
            assert checks_before - 1 <= health_hits <= checks_after
            assert scrapes_before <= metrics_hits <= scrapes_after + 1
            proc.popen.send_signal(signal.SIGTERM)
            assert proc.popen.wait(timeout=30) == 0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_the_workers_setting_flag_env_file_and_default(tmp_path: Path) -> None:
    base = {"upstreams": ["http://127.0.0.1:1"]}
    assert build_config(base, {}).workers is None  # `sidecar proxy` decides: default_workers()
    assert build_config({**base, "workers": 3}, {}).workers == 3
    assert build_config(base, {"SIDECAR_WORKERS": "0"}).workers == 0
    assert (
        build_config(base, {}, file_settings={"workers": 2, "channel_buffer_bytes": 4096}).workers
        == 2
    )
    with pytest.raises(ConfigError, match="workers must be >= 0"):
        build_config({**base, "workers": -1}, {})
    with pytest.raises(ConfigError, match="channel_buffer_bytes must be > 0"):
        build_config({**base, "channel_buffer_bytes": 0}, {})
    assert 1 <= default_workers() <= (os.cpu_count() or 1)
    # The settings travel to a worker exactly (durations, mappings, enums, secrets stripped
    # elsewhere).
    config = build_config(
        {
            **base,
            "slo": "ttft=250ms",
            "slo_classes": ["x:ttft=1s"],
            "route_policy": "prefix",
            "ttft_timeout": "1.25s",
        },
        {},
    )
    assert config_from_wire(json.loads(json.dumps(config_to_wire(config)))) == config


def test_a_cgroup_cpu_limit_bounds_the_default(tmp_path: Path) -> None:
    own = (
        next(
            (
                line[3:]
                for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.startswith("0::")
            ),
            "/",
        )
        if Path("/proc/self/cgroup").exists()
        else "/"
    )
    directory = tmp_path / own.lstrip("/")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cpu.max").write_text("150000 100000\n")
    if not Path("/proc/self/cgroup").exists():
        pytest.skip("no /proc/self/cgroup")
    assert cgroup_cpu_quota(tmp_path) == 2
    (directory / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None


# -- the worker's sink ------------------------------------------------------------------------


def channel_record(i: int) -> RequestRecord:
    return RequestRecord(request_id=f"c{i}", wall_time_ns=i, outcome=Outcome.OK, endpoint="chat")


def split_frames(data: bytes) -> list[tuple[int, bytes]]:
    frames, pos = [], 0
    while pos < len(data):
        length, kind = channel.HEADER.unpack_from(data, pos)
        pos += channel.HEADER.size
        frames.append((kind, data[pos : pos + length]))
        pos += length
    assert pos == len(data)
    return frames


async def test_the_channel_batches_frames_by_time_and_by_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frames wait in the sender until the batch's delay passes (one write, one wake-up of the
    collector, per batch), or leave at once when ``FLUSH_BYTES`` are queued; either way whole
    and in order."""
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(channel, "FLUSH_BYTES", 4096)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(False)
    transport, sender = await loop.create_unix_connection(
        lambda: FrameProtocol(lambda _kind, _payload: None, lambda: None), sock=ours
    )
    try:
        small = [channel.frame(Kind.RECORD, bytes([i]) * 1000) for i in range(3)]
        for data in small:
            assert sender.send(data)
        # Nothing written yet (no loop iteration ran, and the batch is below FLUSH_BYTES).
        with pytest.raises(BlockingIOError):
            theirs.recv(1 << 16)
        assert sender.buffered() == sum(map(len, small))
        large = channel.frame(Kind.RECORD, b"L" * 2000)  # the queue reaches FLUSH_BYTES
        assert sender.send(large)
        got = theirs.recv(1 << 16)  # written by send itself
        assert split_frames(got) == [
            (Kind.RECORD, f[channel.HEADER.size :]) for f in [*small, large]
        ]
        assert sender.buffered() == 0
        # Below the size, the timer writes the batch.
        monkeypatch.setattr(channel, "FLUSH_DELAY_S", 0.001)
        tail = channel.frame(Kind.STATUS, b"{}")
        assert sender.send(tail)
        with pytest.raises(BlockingIOError):
            theirs.recv(1 << 16)
        got = await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), 5)
        assert split_frames(got) == [(Kind.STATUS, b"{}")]
        # A control frame the other side waits for leaves at once, after what was queued.
        monkeypatch.setattr(channel, "FLUSH_DELAY_S", 60.0)
        record = channel.frame(Kind.RECORD, b"r" * 10)
        health = channel.json_frame(Kind.HEALTH, {"passed": [True]})
        assert sender.send(record)
        with pytest.raises(BlockingIOError):
            theirs.recv(1 << 16)
        assert sender.send(health, now=True)
        got = theirs.recv(1 << 16)  # written by send itself, no timer
        assert split_frames(got) == [
            (Kind.RECORD, b"r" * 10),
            (Kind.HEALTH, health[channel.HEADER.size :]),
        ]
        assert sender.buffered() == 0
    finally:
        transport.close()
        theirs.close()


async def test_the_channel_sink_lifecycle_on_a_real_socket() -> None:
    """The worker's ChannelSink keeps the sink contract: flush hands its frames to the kernel
    (waiting for it only off the loop's thread), close refuses later records, and its counters
    add up: taken == written + every drop."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    received: list[str] = []
    arrived = asyncio.Event()

    def on_frame(kind: int, payload: bytes) -> None:
        if kind == Kind.RECORD:
            received.append(decode_record(payload).request_id)
            arrived.set()

    _, sender = await loop.create_unix_connection(
        lambda: FrameProtocol(lambda _kind, _payload: None, lambda: None), sock=ours
    )
    reader_transport, _reader = await loop.create_unix_connection(
        lambda: FrameProtocol(on_frame, lambda: None), sock=theirs
    )
    try:
        sink = ChannelSink(sender, bound=1 << 20)
        assert isinstance(sink, Sink)
        sink.on_record(channel_record(0))
        assert sink.flush(1)  # on the loop: written at once, nothing left in the transport
        sink.on_record(channel_record(1))
        assert await asyncio.to_thread(sink.flush, 5)  # from a thread: via the loop
        fanout = SinkFanout([sink])
        fanout.on_record(channel_record(2))
        assert await asyncio.to_thread(fanout.close, 5) == []
        sink.close()  # idempotent
        sink.on_record(channel_record(3))  # closed: dropped and counted
        while len(received) < 3:
            arrived.clear()
            await asyncio.wait_for(arrived.wait(), 5)
        assert received == ["c0", "c1", "c2"]
        assert sink.counters() == {
            "taken": 4,
            "written": 3,
            "dropped_channel_full": 0,
            "dropped_channel_closed": 1,
            "dropped_encode_error": 0,
        }
        full = ChannelSink(sender, bound=-1)  # any byte waiting is over this bound
        full.on_record(channel_record(4))
        assert dropped_by_reason(full.counters()) == {
            "channel_full": 1,
            "channel_closed": 0,
            "encode_error": 0,
        }
    finally:
        assert sender.transport is not None
        sender.transport.close()
        reader_transport.close()


@dataclass(frozen=True, slots=True)
class SubRecord(RequestRecord):
    """A record of a subclass: the C encoder leaves it to the Python one."""


async def test_the_channel_sink_drops_and_counts_a_record_the_wire_cannot_hold() -> None:
    """A record the wire format cannot hold (a count beyond 64 bits) is counted and dropped,
    whichever encoder met it; the records around it go out whole, a subclass's through the
    Python encoder."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(False)
    _, sender = await loop.create_unix_connection(
        lambda: FrameProtocol(lambda _kind, _payload: None, lambda: None), sock=ours
    )
    try:
        sink = ChannelSink(sender, bound=1 << 20)
        sink.on_record(channel_record(0))
        sink.on_record(replace(channel_record(1), n_out=2**70))
        plain = channel_record(2)
        sub = SubRecord(**{f: getattr(plain, f) for f in plain.__dataclass_fields__})
        sink.on_record(sub)
        sink.on_record(replace(sub, n_in=-(2**70)))
        assert sink.flush(1)
        got = await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), 5)
        frames = split_frames(got)
        assert [decode_record(payload).request_id for _, payload in frames] == ["c0", "c2"]
        assert dropped_by_reason(sink.counters()) == {
            "channel_full": 0,
            "channel_closed": 0,
            "encode_error": 2,
        }
        assert sink.counters()["written"] == 2
    finally:
        assert sender.transport is not None
        sender.transport.close()
        theirs.close()


async def test_a_record_dropped_behind_a_starved_scrape_is_counted_for_its_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Records that reach the collector while a scrape holds its sinks and the backlog is
    full are dropped, counted for the worker that sent them (`scrape_backlog` in /workers and
    in sidecar_channel_dropped_records_total), and the worker's accounts still add up. The
    collector's own objects over the real frame parser, without processes: the worker's frames
    fed to its protocol while this test holds the sinks' lock, as a starved scrape would."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    import sidecar.hooks as hooks
    from sidecar.config import ProxyConfig
    from sidecar.proxy.collector import Collector, WorkerProcess
    from sidecar.proxy.recordwire import encode_record
    from sidecar.sinks.prometheus import WorkerCollector, WorkerState

    monkeypatch.setattr(hooks, "BACKLOG_MAX", 2)
    lock = threading.Lock()
    taken: list[str] = []
    window = SimpleNamespace(name="window", on_record=lambda r: taken.append(r.request_id))
    fanout = SinkFanout([window], lock=lock)
    collector = Collector(ProxyConfig(upstreams=("http://127.0.0.1:9",)), fanout, workers=1)
    worker = WorkerProcess(0, SimpleNamespace(pid=1), collector._on_frame, 1)  # type: ignore[arg-type]
    collector.slots[0].current = worker
    worker.status = {"requests_total": 5}
    frames = b"".join(
        channel.frame(Kind.RECORD, encode_record(channel_record(i))) for i in range(5)
    )
    with lock:  # a scrape holds the sinks
        worker.protocol.data_received(frames)
    assert fanout.waiting == 2 and taken == []
    fanout.drain()
    assert taken == ["c0", "c1"]

    view = collector.worker_view(collector.slots[0])
    assert view["records_received"] == 2 and view["dropped"]["scrape_backlog"] == 3
    assert view["requests_total"] == 5
    assert accounted({"workers": [view]}, 5)
    registry = CollectorRegistry()
    registry.register(
        WorkerCollector(lambda: [WorkerState(**state) for state in collector.worker_states()])
    )
    exposition = generate_latest(registry).decode()
    assert metric(exposition, "sidecar_channel_dropped_records_total", reason="scrape_backlog") == 3
    assert metric(exposition, "sidecar_channel_records_total") == 2
