"""Instructions per request of the sidecar's worker and collector, counted by callgrind.

    python benchmarks/request_instructions.py                   # ~1 minute
    python benchmarks/request_instructions.py --tree /tmp/before   # another tree, for an A/B
    python benchmarks/request_instructions.py --top 25          # and the C functions that cost
    python benchmarks/request_instructions.py --opcodes         # Python bytecodes per function
    python benchmarks/request_instructions.py --profile         # cProfile per function
    python benchmarks/request_instructions.py --by-function     # instructions per function
    python benchmarks/request_instructions.py --compiled-functions   # ... per compiled function
    python benchmarks/request_instructions.py --smoke           # CI: the harness, no valgrind
    python benchmarks/request_instructions.py --sim-fault split_end_ms=20   # ends over 4 reads

`meter_instructions.py` counts one read's path in one process; this counts everything the
proxy's two processes execute per request, as users run them: ``sidecar proxy --workers 1``
(its collector and one worker; health checks and engine scrapes off, periodic work that is not
per request; each under ``valgrind --tool=callgrind``, counting switched on only for the
measured windows) in front of the simulator, a streaming chat client in this process (not
counted) sending N requests with C in flight (4), ``max_tokens`` tokens each (32). Each window
ends with one Prometheus scrape of the collector (what the histograms leave for the read is work
per request too), and its count is dumped with ``callgrind_control``; then

    per request = (count(2N) - count(N) - idle rate x (seconds(2N) - seconds(N))) / N

for each process: the idle rate (instructions per second with no traffic: timers, status
frames, the stall probe) comes from a third window without a scrape, and is taken out because
the 2N window runs longer than the N one (everything runs ~50x slower under callgrind than at
speed); the scrape is a fixed cost of both traffic windows and cancels. Full collections are
held off (``SIDECAR_GC_THRESHOLDS``: one falls in a window or not by chance), and the engine
step is 10 ms, so that a worker slowed by callgrind still reads one event per read. So set, runs
of one tree agree within 1.5-3.7 % (benchmarks/RESULTS.md, "Per request, counted").

The worker's count holds the per-read path (``meter_instructions.py --scope read``, plus the
receive) times the reads of a request, and everything done once per request: the request's
parsing, routing, the upstream request, the role, finish and usage chunks (the general path),
the record, its encoding and hand-off. The collector's is the record's decoding, the live window
and Prometheus. Not counted: the kernel (syscalls, loopback TCP), which no relay escapes.

``--opcodes`` and ``--profile``: no valgrind; each process traces its main thread (a
``sitecustomize`` on its path, switched per window by SIGUSR1/SIGUSR2) for the same two
windows: the Python bytecodes each function executes per request (exact; the tracing slows the
worker, hence the same 10 ms step), or cProfile's calls and own time per request (its own cost
inflates small functions: read the calls first, the times as a ranking). Both run the
package's compiled request path from its source (``SIDECAR_INTERPRETED=1``, sidecar/_compiled.py):
compiled code executes no bytecodes and makes no Python calls to profile. With ``--as-built``
they run the tree as built instead, and then list exactly what the compiled request path
still hands to the interpreter per request (a dataclass's generated ``__init__``, a
``__post_init__`` a C constructor calls, an interpreted sink or transport, asyncio's task
registry): session 28 found its interpreted per-request code this way
(benchmarks/RESULTS.md, "Session 28").

``--by-function``: instructions per request spent in each Python function and what it calls
(inclusive), which neither the bytecodes nor callgrind's C functions give: the windows run on a
copy of the tree whose modules Cython compiled as they are (no types declared, so the code does
what the interpreter does, through the same C API: per request within ~1 % of the interpreted
tree's count for the worker and ~7 % for the collector, measured in session 18), each Python
function then a C function callgrind can name. A ranking of where a request's instructions
go, not an account: the idle rate is not taken out, and a coroutine's count is that of its
steps, with what they awaited without suspending. Modules that must stay Python are left to
the interpreter (`BY_FUNCTION_SKIP`). Needs Cython (``pip install cython``, not a dependency of
the project) and a C compiler.

``--compiled-functions``: the same ranking for the tree as built, mypyc's compiled request path
(`setup.py`'s COMPILED): each compiled function is a C function (``CPyDef_...``) callgrind
names, its callees included; the interpreted rest is only seen through the compiled code that
calls it.

``--tree``: the processes run in that directory (``python -m`` puts its working directory first
on the path), with its C extensions built in place.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import marshal
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
from proxy_overhead import free_port

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
MODEL = "bench-model"


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before listening on {port}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listened on {port} within {timeout_s:.0f} s")


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(child) for child in text]
    return found


async def stream_requests(url: str, n: int, concurrency: int, max_tokens: int) -> int:
    """N streamed chat requests, C at a time; returns the SSE events read (all must be 200)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something long."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    events = 0
    todo = iter(range(n))
    async with aiohttp.ClientSession() as session:

        async def one_worker() -> None:
            nonlocal events
            for _ in todo:
                async with session.post(url, json=body) as response:
                    if response.status != 200:
                        raise RuntimeError(f"{response.status}: {await response.text()}")
                    data = await response.read()
                    events += data.count(b"\n\n")
                    if not data.rstrip().endswith(b"data: [DONE]"):
                        raise RuntimeError("a stream ended without [DONE]")

        await asyncio.gather(*(one_worker() for _ in range(concurrency)))
    return events


def callgrind_control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, text=True)


_TOTALS = re.compile(r"^totals:\s+(\d+)", re.M)


def fresh_file(
    out_dir: Path, pattern: str, before: set[Path], ready: Callable[[Path], bool], what: str
) -> Path:
    """The first file matching ``pattern`` in ``out_dir``, not in ``before``, that is
    ``ready``: what a process was just told to write (a minute at most)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for path in sorted(set(out_dir.glob(pattern)) - before):
            if ready(path):
                return path
        time.sleep(0.1)
    raise RuntimeError(f"no {what} was written")


def dumped_total(out_dir: Path, pid: int, before: set[Path]) -> tuple[int, Path]:
    """The dump of ``pid`` not in ``before`` (its instruction total, its path), once callgrind
    wrote it whole."""

    def total(path: Path) -> re.Match[str] | None:
        return _TOTALS.search(path.read_text(errors="replace"))

    path = fresh_file(
        out_dir, f"callgrind.{pid}*", before, lambda p: total(p) is not None, f"dump of {pid}"
    )
    found = total(path)
    assert found is not None
    return int(found.group(1)), path


def traffic(url: str, n: int, concurrency: int, max_tokens: int, metrics_url: str | None) -> int:
    """N requests, the time for their last records to reach the collector, then one scrape of
    ``metrics_url`` (None: none): what every counted window holds. The events read."""
    events = asyncio.run(stream_requests(url, n, concurrency, max_tokens))
    time.sleep(1.0)
    if metrics_url is not None:
        asyncio.run(scrape(metrics_url))
    return events


class Window:
    """One counted window: each process's instructions and dump, the events read, and how
    long counting was on for each process."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self.dumps: dict[str, Path] = {}
        self.seconds: dict[str, float] = {}
        self.events = 0


async def scrape(metrics_url: str) -> int:
    """One Prometheus scrape of the collector's /metrics; its size in bytes."""
    async with aiohttp.ClientSession() as session, session.get(metrics_url) as response:
        if response.status != 200:
            raise RuntimeError(f"/metrics answered {response.status}")
        return len(await response.read())


def window(
    out_dir: Path,
    pids: dict[str, int],
    url: str,
    n: int,
    concurrency: int,
    max_tokens: int,
    idle_s: float = 0.0,
    metrics_url: str | None = None,
) -> Window:
    """Counting on for N requests (N = 0: ``idle_s`` of no traffic), then one scrape of
    ``metrics_url``: what the histograms leave for the read (`BulkHistogram.flush`) is work
    per request too. A scrape ends both traffic windows, so its fixed cost cancels out."""
    result = Window()
    started: dict[str, float] = {}
    for name, pid in pids.items():
        callgrind_control("--zero", str(pid))
        callgrind_control("--instr=on", str(pid))
        started[name] = time.monotonic()
    if n:
        result.events = traffic(url, n, concurrency, max_tokens, metrics_url)
    else:
        time.sleep(idle_s)
    for name, pid in pids.items():
        callgrind_control("--instr=off", str(pid))
        result.seconds[name] = time.monotonic() - started[name]
        before = set(out_dir.glob(f"callgrind.{pid}*"))
        callgrind_control("--dump", str(pid))
        result.totals[name], result.dumps[name] = dumped_total(out_dir, pid, before)
    return result


def annotated(path: Path, inclusive: bool = False) -> list[tuple[int, str]]:
    """callgrind_annotate's rows of a dump: (instructions, function), self or inclusive."""
    flags = ["--inclusive=yes"] if inclusive else []
    proc = subprocess.run(
        ["callgrind_annotate", *flags, "--threshold=100", "--auto=no", str(path)],
        check=True,
        capture_output=True,
        text=True,
    )
    rows = []
    for line in proc.stdout.splitlines():
        found = re.match(r"^\s*([\d,]+)\s+\([\s\d.]+%\)\s+(\S.*)$", line)
        if found and "PROGRAM TOTALS" not in line and "=>" not in line:
            rows.append((int(found.group(1).replace(",", "")), found.group(2)))
    return rows


def ranked_per_request(
    first: dict[str, int], second: dict[str, int], n_requests: int, top: int
) -> list[tuple[str, int]]:
    """The second window's counts minus the first's, over N, largest first (the idle rate not
    taken out: a ranking, not an account)."""
    per_request = {
        name: (second.get(name, 0) - first.get(name, 0)) / n_requests
        for name in set(first) | set(second)
    }
    ranked = sorted(per_request.items(), key=lambda item: -item[1])[:top]
    return [(name, round(value)) for name, value in ranked]


def top_functions(first: Path, second: Path, n_requests: int, top: int) -> list[tuple[str, int]]:
    """Self instructions per request by C function."""

    def self_costs(path: Path) -> dict[str, int]:
        return {function: count for count, function in annotated(path)}

    return ranked_per_request(self_costs(first), self_costs(second), n_requests, top)


# --by-function: the modules compiled (paths under sidecar/), and those left to the
# interpreter: package __init__ modules, app.py, whose aiohttp middlewares must be Python
# functions (aiohttp sets an attribute on them; a compiled one has no __dict__), and worker.py,
# which runs as ``python -m`` (runpy needs its code object).
BY_FUNCTION_DIRS = ("proxy", "protocol", "sinks")
BY_FUNCTION_FILES = ("meter.py", "stats.py", "hooks.py", "clock.py")
BY_FUNCTION_SKIP = ("__init__.py", "app.py", "worker.py")


def compiled_copy(tree: Path, dest: Path) -> list[Path]:
    """``tree``'s sidecar package copied to ``dest`` (its built C extensions with it), the
    per-request modules compiled there by Cython, untyped (`BY_FUNCTION_DIRS`); returns the
    generated C files, which name each function's source line (`function_lines`)."""
    shutil.copytree(
        tree / "sidecar", dest / "sidecar", ignore=shutil.ignore_patterns("__pycache__")
    )
    package = dest / "sidecar"
    sources = [package / name for name in BY_FUNCTION_FILES]
    for sub in BY_FUNCTION_DIRS:
        sources += sorted((package / sub).glob("*.py"))
    sources = [path for path in sources if path.name not in BY_FUNCTION_SKIP and path.exists()]
    include = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()

    def run(argv: list[str]) -> None:
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-4000:]}")

    def build(source: Path) -> Path:
        module = ".".join(source.relative_to(dest).with_suffix("").parts)
        c_file = source.with_suffix(".c")
        run(
            [sys.executable, "-m", "cython", "-3", "--module-name", module,
             "--directive", "annotation_typing=False,binding=False",
             str(source), "-o", str(c_file)]
        )  # fmt: skip
        run(
            [*compiler, "-O2", "-fPIC", "-shared", "-fwrapv", "-DNDEBUG", f"-I{include}",
             str(c_file), "-o", str(source.with_name(source.stem + suffix))]
        )  # fmt: skip
        return c_file

    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        return list(pool.map(build, sources))


_SOURCE_COMMENT = re.compile(r'^/\* "([^"]+)":(\d+)$')
_WRAPPER = re.compile(r"^static PyObject \*(__pyx_pw_\w+)\(")
_BODY = re.compile(r"\(__pyx_coroutine_body_t\) (__pyx_gb_\w+),.*__PYX_ERR\(\d+, (\d+),")
_DEF = re.compile(r"(?:async\s+)?def\s+(\w+)|(lambda)")


def function_lines(c_files: Sequence[Path], root: Path) -> dict[str, str]:
    """Cython's C function of each Python function (its wrapper, ``__pyx_pw_*``, and a
    coroutine's or generator's body, ``__pyx_gb_*``) -> ``file.py:line(name)``, as --opcodes
    names them."""
    names: dict[str, str] = {}

    def label(path: str, line: int) -> str:
        source = (root / path).read_text().splitlines()
        at = line
        # A decorated function's wrapper is named by its first decorator's line.
        while 0 < at < len(source) and source[at - 1].lstrip().startswith("@"):
            at += 1
        found = _DEF.search(source[at - 1]) if 0 < at <= len(source) else None
        name = (found.group(1) or "<lambda>") if found else "<genexpr>"
        return f"{Path(path).name}:{at}({name})"

    for c_file in c_files:
        module_path = str(c_file.relative_to(root).with_suffix(".py"))
        where: tuple[str, int] | None = None
        for text in c_file.read_text().splitlines():
            comment = _SOURCE_COMMENT.match(text)
            if comment:
                where = (comment.group(1), int(comment.group(2)))
                continue
            wrapper = _WRAPPER.match(text)
            if wrapper and where is not None and wrapper.group(1) not in names:
                names[wrapper.group(1)] = label(*where)
                continue
            body = _BODY.search(text)
            if body and body.group(1) not in names:
                names[body.group(1)] = label(module_path, int(body.group(2)))
    return names


def inclusive_by_function(
    first: Path, second: Path, n_requests: int, names: dict[str, str], top: int
) -> list[tuple[str, int]]:
    """Inclusive instructions per request of each compiled Python function: the second
    window's minus the first's, over N (callgrind's level-1 entries: a recursion's deeper
    levels are inside them)."""

    def inclusive(path: Path) -> dict[str, int]:
        costs: dict[str, int] = {}
        for count, function in annotated(path, inclusive=True):
            found = re.match(r"\S*?:?(__pyx_[pg][wb]_\w+)(?:\s|$)", function)
            if found and found.group(1) in names:
                label = names[found.group(1)]
                costs[label] = costs.get(label, 0) + count
        return costs

    return ranked_per_request(inclusive(first), inclusive(second), n_requests, top)


def inclusive_by_compiled_function(
    first: Path, second: Path, n_requests: int, top: int
) -> list[tuple[str, int]]:
    """Inclusive instructions per request of each function mypyc compiled (`setup.py`'s
    COMPILED), by its C name (``CPyDef_<module>___<class>___<method>``): the second window's
    minus the first's, over N. Work the windows do by time rather than by request (a worker's
    status report, `channel.json_frame`) shows too: the idle rate is not taken out."""

    def inclusive(path: Path) -> dict[str, int]:
        costs: dict[str, int] = {}
        for count, function in annotated(path, inclusive=True):
            found = re.search(r"\b(CPyDef_\w+)", function)
            if found:
                costs[found.group(1)] = costs.get(found.group(1), 0) + count
        return costs

    return ranked_per_request(inclusive(first), inclusive(second), n_requests, top)


def print_ranked(by_process: dict[str, list[tuple[str, int]]], what: str) -> None:
    """Each process's ranking, under ``<process>: <what>``."""
    for name, ranked in by_process.items():
        print(f"\n{name}: {what}")
        for function, value in ranked:
            print(f"{value:>10,}  {function}")


# Put on the processes' path by ``--profile``: cProfile on from the start, switched per window
# by signals (SIGUSR1: reset and enable; SIGUSR2: disable and dump to $PROFILE_DIR/<pid>.<n>).
SITECUSTOMIZE = r"""
import cProfile, collections, marshal, os, signal, sys
_dumps = [0]
def _part():
    return os.path.join(os.environ["PROFILE_DIR"], f"part-{os.getpid()}")
def _publish():  # the reader waits for the final name: it appears whole
    os.replace(_part(), os.path.join(os.environ["PROFILE_DIR"], f"{os.getpid()}.{_dumps[0]}"))
if os.environ.get("PROFILE_OPCODES"):
    # Bytecodes executed, by function (its own, not its callees'): exact, whatever the host.
    _counts = collections.Counter()
    def _local(frame, event, _arg):
        if event == "opcode":
            _counts[frame.f_code] += 1
        return _local
    def _global(frame, _event, _arg):
        frame.f_trace_opcodes = True
        return _local
    def _start(*_):
        _counts.clear()
        sys.settrace(_global)
    def _stop(*_):
        sys.settrace(None)
        _dumps[0] += 1
        table = {f"{os.path.basename(c.co_filename)}:{c.co_firstlineno}({c.co_name})": (n, 0.0)
                 for c, n in _counts.items()}
        with open(_part(), "wb") as f:
            marshal.dump(table, f)
        _publish()
else:
    _profile = cProfile.Profile()
    def _start(*_):
        _profile.disable()
        _profile.clear()
        _profile.enable()
    def _stop(*_):
        _profile.disable()
        _dumps[0] += 1
        _profile.dump_stats(_part())
        _publish()
signal.signal(signal.SIGUSR1, _start)
signal.signal(signal.SIGUSR2, _stop)
"""


def profile_window(
    out_dir: Path,
    pids: dict[str, int],
    url: str,
    n: int,
    concurrency: int,
    max_tokens: int,
    metrics_url: str,
) -> dict[str, Path]:
    """`window` under cProfile or the bytecode tracer, which see the main thread only (not
    the collector's scrape thread)."""
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)
    time.sleep(0.2)
    traffic(url, n, concurrency, max_tokens, metrics_url)
    dumps: dict[str, Path] = {}
    for name, pid in pids.items():
        before = set(out_dir.glob(f"{pid}.*"))
        os.kill(pid, signal.SIGUSR2)
        # Written under another name and renamed (SITECUSTOMIZE): there once it is whole.
        dumps[name] = fresh_file(out_dir, f"{pid}.*", before, lambda _p: True, f"profile of {pid}")
    return dumps


def profile_rows(
    first: Path, second: Path, n: int, top: int, opcodes: bool
) -> list[tuple[str, float, float]]:
    """(function, calls per request, own µs per request) by own time, second - first; with
    ``opcodes``, (function, bytecodes per request, 0) by bytecodes."""
    import pstats

    def table(path: Path) -> dict[str, tuple[int, float]]:
        if opcodes:
            with path.open("rb") as file:
                loaded: dict[str, tuple[int, float]] = marshal.load(file)
            return loaded
        stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
        return {
            f"{Path(file).name}:{line}({name})": (calls, own)
            for (file, line, name), (_prim, calls, own, _cum, _callers) in stats.items()
        }

    a, b = table(first), table(second)
    rows = []
    for key in set(a) | set(b):
        calls = b.get(key, (0, 0.0))[0] - a.get(key, (0, 0.0))[0]
        own = b.get(key, (0, 0.0))[1] - a.get(key, (0, 0.0))[1]
        rows.append((key, calls / n, own * 1e6 / n))
    rows.sort(key=lambda row: -row[1] if opcodes else -row[2])
    return rows[:top]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree", type=Path, default=REPO, help="the source tree to run (its C extensions built)"
    )
    parser.add_argument("--requests", type=int, default=100, help="N [100]")
    parser.add_argument(
        "--warmup", type=int, default=50, help="requests before any window, not counted [50]"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="C [4]: streams in flight, each still read one event at a time at the default "
        "step; more shortens the windows, and with them the share of the idle rate taken out",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per stream [32]")
    parser.add_argument(
        "--step-ms",
        type=float,
        default=None,
        help="the simulator's engine step [10 under callgrind and with --opcodes, 2 otherwise]: "
        "long enough that a worker slowed ~50x by callgrind (more by --opcodes' tracing) reads "
        "each event on its own, as it does at speed, instead of piling reads up by chance",
    )
    parser.add_argument(
        "--idle-s", type=float, default=10.0, help="the idle window, no traffic [10 s]"
    )
    parser.add_argument(
        "--sim-fault",
        metavar="SPEC",
        help="the simulator's fault for every request (sidecar sim --fault), e.g. "
        "split_end_ms=20: each stream's end in four writes, as a real vLLM's often comes",
    )
    parser.add_argument("--top", type=int, default=0, help="list the costliest C functions")
    parser.add_argument("--profile", action="store_true", help="cProfile, no valgrind")
    parser.add_argument(
        "--opcodes", action="store_true", help="bytecodes executed per function, no valgrind"
    )
    parser.add_argument(
        "--as-built",
        action="store_true",
        help="--opcodes / --profile on the tree as built (its compiled modules compiled): what "
        "the compiled request path still runs interpreted",
    )
    parser.add_argument(
        "--by-function",
        type=int,
        nargs="?",
        const=40,
        default=0,
        metavar="N",
        help="list the N [40] Python functions with the most instructions, their callees' "
        "included, on a copy of the tree compiled by Cython (pip install cython)",
    )
    parser.add_argument(
        "--compiled-functions",
        type=int,
        nargs="?",
        const=40,
        default=0,
        metavar="N",
        help="list the N [40] functions compiled by mypyc with the most instructions, their "
        "callees' included, on --tree as built (its compiled request path)",
    )
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CI: no valgrind, a few requests")
    args = parser.parse_args(argv)
    if args.by_function and (args.profile or args.opcodes or args.smoke):
        parser.error("--by-function counts with callgrind: not with --profile, --opcodes, --smoke")
    if args.compiled_functions and (args.profile or args.opcodes or args.smoke or args.by_function):
        parser.error(
            "--compiled-functions counts the compiled build with callgrind: not with "
            "--profile, --opcodes, --smoke, --by-function"
        )
    if args.compiled_functions and not list(args.tree.resolve().glob("sidecar__mypyc*")):
        parser.error(f"--compiled-functions: {args.tree} has no compiled request path (setup.py)")
    args.profile = args.profile or args.opcodes
    if args.as_built and not args.profile:
        parser.error("--as-built goes with --opcodes or --profile")
    if (args.profile and not args.as_built) or args.by_function:
        # Bytecodes and Python calls are the interpreted source's (and --by-function's copy
        # compiles that source itself): the processes started below inherit this.
        os.environ["SIDECAR_INTERPRETED"] = "1"
    if args.step_ms is None:
        args.step_ms = 2.0 if args.smoke or (args.profile and not args.opcodes) else 10.0
    if not (args.smoke or args.profile) and shutil.which("valgrind") is None:
        print("SKIPPED: valgrind is not installed (apt-get install valgrind)")
        return
    if args.by_function:
        try:
            import Cython  # noqa: F401
        except ImportError:
            print("--by-function needs Cython: pip install cython")
            raise SystemExit(2) from None
    work = Path(tempfile.mkdtemp(prefix="request-instructions-"))
    sim_port, port, admin_port = free_port(), free_port(), free_port()
    tree = args.tree.resolve()
    function_names: dict[str, str] = {}
    if args.by_function:
        compiled = work / "compiled"
        function_names = function_lines(compiled_copy(tree, compiled), compiled)
        tree = compiled
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # No full collection in a window: one scans every live object, and falls in a window or
    # not by chance; the young generations' collections, which do scale with requests, still
    # run. (Runs with full collections allowed, at a 2 ms step and without the scrape, spread
    # +-3 % at C = 1 and +-7 % at C = 4; which of the three did how much was not measured.)
    proxy_gc = {"SIDECAR_GC_THRESHOLDS": f"700,2,{10**9}"}
    if args.profile:
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (work / "profiles").mkdir()
        proxy_env = {
            **env,
            **proxy_gc,
            "PYTHONPATH": f"{work / 'site'}:{tree}",
            "PROFILE_DIR": str(work / "profiles"),
        }
        if args.opcodes:
            proxy_env["PROFILE_OPCODES"] = "1"
    else:
        proxy_env = {**env, **proxy_gc}
    fault = ["--fault", args.sim_fault, "--fault-rate", "1"] if args.sim_fault else []
    sim = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "sim", "--host", HOST, "--port", str(sim_port),
         "--model", MODEL, "--step-floor-s", f"{args.step_ms / 1e3:.6f}", "--max-num-seqs", "1024",
         *fault],
        env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=(work / "sim.log").open("wb"),
    )  # fmt: skip
    valgrind = [] if args.smoke or args.profile else [
        "valgrind", "--tool=callgrind", "--trace-children=yes", "--instr-atstart=no",
        f"--callgrind-out-file={work}/callgrind.%p",
    ]  # fmt: skip
    proxy = subprocess.Popen(
        [*valgrind, sys.executable, "-m", "sidecar", "proxy",
         "--upstream", f"http://{HOST}:{sim_port}", "--listen", f"{HOST}:{port}",
         "--metrics-listen", f"{HOST}:{admin_port}", "--health-interval", "0",
         "--engine-scrape-interval", "0", "--workers", "1"],
        env=proxy_env,
        # `python -m` puts its working directory first on the path: run in the tree itself,
        # or a sidecar/ in the caller's directory would be measured instead of --tree's.
        cwd=tree,
        stdout=(work / "proxy.out").open("wb"),
        stderr=(work / "proxy.log").open("wb"),
    )  # fmt: skip
    url = f"http://{HOST}:{port}/v1/chat/completions"
    try:
        wait_port(sim_port, sim, 60)
        wait_port(port, proxy, 600)
        if args.smoke:
            events = asyncio.run(stream_requests(url, 8, 2, args.max_tokens))
            print(f"request_instructions smoke: 8 requests, {events} events through the proxy")
            return
        asyncio.run(stream_requests(url, args.warmup, args.concurrency, args.max_tokens))
        worker_pids = [p for p in children(proxy.pid)]
        # The worker is the collector's child that serves the traffic port.
        if len(worker_pids) != 1:
            raise RuntimeError(f"expected one worker process, found {worker_pids}")
        pids = {"collector": proxy.pid, "worker": worker_pids[0]}
        n = args.requests
        if args.profile:
            profiles = [
                profile_window(
                    work / "profiles",
                    pids,
                    url,
                    size,
                    args.concurrency,
                    args.max_tokens,
                    f"http://{HOST}:{admin_port}/metrics",
                )
                for size in (n, 2 * n)
            ]
            rows = {
                name: profile_rows(profiles[0][name], profiles[1][name], n, 10**9, args.opcodes)
                for name in pids
            }
            report: dict[str, object] = {
                "requests": n,
                "concurrency": args.concurrency,
                "as_built": args.as_built,
            }
            for name, table in rows.items():
                top = table[: args.top or 40]
                if args.opcodes:
                    total = sum(row[1] for row in table)
                    print(f"\n{name}: bytecodes per request, by function ({total:,.0f} in all)")
                    for function, count, _ in top:
                        print(f"{count:>9,.0f}  {function}")
                    report[name] = {
                        "bytecodes_per_request": round(total),
                        "top": [{"function": f, "bytecodes": round(c)} for f, c, _ in top],
                    }
                    continue
                print(f"\n{name}: own µs per request under cProfile, calls per request")
                for function, calls, own in top:
                    print(f"{own:>9.1f}  {calls:>7.1f}  {function}")
                report[name] = {
                    "top": [
                        {"function": f, "calls": round(c, 2), "own_us": round(o, 2)}
                        for f, c, o in top
                    ]
                }
            if args.json_out is not None:
                args.json_out.write_text(json.dumps(report, indent=2) + "\n")
            return
        metrics = f"http://{HOST}:{admin_port}/metrics"
        asyncio.run(scrape(metrics))  # the warm-up's records binned before counting starts
        # No scrape after the idle window: its rate is what the processes do per second on
        # their own; a scrape is a fixed cost of each traffic window, and cancels there.
        idle = window(work, pids, url, 0, args.concurrency, args.max_tokens, args.idle_s)
        first = window(work, pids, url, n, args.concurrency, args.max_tokens, 0.0, metrics)
        second = window(work, pids, url, 2 * n, args.concurrency, args.max_tokens, 0.0, metrics)
    finally:
        for proc in (proxy, sim):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in (proxy, sim):
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    # What each process does per second with no traffic (timers, status frames, the stall
    # probe: ~50x more per request under callgrind than at full speed) is taken out first.
    idle_per_s = {name: idle.totals[name] / idle.seconds[name] for name in pids}
    per_request = {
        name: round(
            (
                second.totals[name]
                - first.totals[name]
                - idle_per_s[name] * (second.seconds[name] - first.seconds[name])
            )
            / n
        )
        for name in pids
    }
    events_per_request = (second.events - first.events) / n
    result: dict[str, object] = {
        "tree": str(args.tree.resolve()),
        "compiled_by_cython": bool(args.by_function),
        "requests": n,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "sim_fault": args.sim_fault,
        "events_per_request": events_per_request,
        "python": sys.version.split()[0],
        "counts": {"idle": idle.totals, "first": first.totals, "second": second.totals},
        "seconds": {"idle": idle.seconds, "first": first.seconds, "second": second.seconds},
        "idle_instructions_per_s": {name: round(value) for name, value in idle_per_s.items()},
        "instructions_per_request": per_request,
        "instructions_per_event": {
            name: round(value / events_per_request) for name, value in per_request.items()
        },
    }
    print(
        f"per request ({args.max_tokens} tokens, {events_per_request:.1f} SSE events to the "
        f"client): worker {per_request['worker']:,} instructions "
        f"({per_request['worker'] / events_per_request:,.0f} per event), collector "
        f"{per_request['collector']:,} ({per_request['collector'] / events_per_request:,.0f} "
        "per event)"
    )
    if args.top:
        tops = {
            name: top_functions(first.dumps[name], second.dumps[name], n, args.top) for name in pids
        }
        result["top_self_per_request"] = tops
        print_ranked(tops, "self instructions per request, by C function")
    if args.by_function:
        ranked_functions = {
            name: inclusive_by_function(
                first.dumps[name], second.dumps[name], n, function_names, args.by_function
            )
            for name in pids
        }
        result["inclusive_per_request_by_function"] = ranked_functions
        print_ranked(ranked_functions, "inclusive instructions per request, by Python function")
    if args.compiled_functions:
        ranked_compiled = {
            name: inclusive_by_compiled_function(
                first.dumps[name], second.dumps[name], n, args.compiled_functions
            )
            for name in pids
        }
        result["inclusive_per_request_by_compiled_function"] = ranked_compiled
        print_ranked(ranked_compiled, "inclusive instructions per request, by compiled function")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    if not os.environ.get("KEEP"):
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
