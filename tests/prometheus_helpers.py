"""A real Prometheus server (Debian's package) for tests, and the binaries that come with it.

The pattern of tests/test_sinks_prometheus.py, generalised to a whole configuration file (scrape
jobs with relabeling, rule files): ``require_binary`` fails in CI when a binary is missing and
skips elsewhere; ``start_prometheus`` starts a server on a free 127.0.0.1 port and waits until
it is ready.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# One free_port for every test: it never hands out the same port twice in a process.
from sidecar.realvllm.server import free_port as free_port


def require_binary(name: str, hint: str = "apt-get install prometheus") -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed: .ci/run must install it ({hint})")
        pytest.skip(f"{name} not installed ({hint})")
    return path


def require_module(name: str, package: str) -> Any:
    """Import ``name``; fail in CI when it is missing, skip elsewhere (pip install package)."""
    try:
        return __import__(name, fromlist=["_"])
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not importable: .ci/run must `pip install {package}`")
        pytest.skip(f"{name} not installed (pip install {package})")


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; raises (with Prometheus's message) when the expression is invalid."""
        query = urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}", timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{expr}\n-> {exc.read().decode(errors='replace')}") from None
        assert body["status"] == "success", body
        data = body["data"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


@contextmanager
def running_prometheus(config_text: str, directory: Path) -> Iterator[Prometheus]:
    """Start ``prometheus`` with this configuration; stopped when the block ends."""
    binary = require_binary("prometheus")
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "prometheus.yml"
    config.write_text(config_text)
    port = free_port()
    log_path = directory / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={directory / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    "prometheus did not become ready: " + log_path.read_text()[-2000:]
                )
            time.sleep(0.1)
        yield Prometheus(url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
