"""CPU per relayed event by stream length: what each relay costs per request and per event.

    python benchmarks/cpu_by_length.py --nice -10                     # the full run (~8 min)
    python benchmarks/cpu_by_length.py --nice -10 --trace conv.jsonl  # ... and at a trace's mix
    python benchmarks/cpu_by_length.py --smoke                        # CI: seconds, the harness

`proxy_overhead.py` reports a relay's CPU per relayed SSE event at one stream length. But a
relay pays twice: once per request (parse the request, route, open or reuse the upstream, the
response head, the record) and once per event (read, frame, count, write). Per event it costs

    CPU per event = per request / events per request + per event

so a comparison at 32-token streams says little about 200-token ones. This harness runs the same
closed-loop streaming client at several stream lengths against each relay, alternating relays and
lengths within each repeat, and fits each relay's CPU per request against its events per request
(least squares over every run): the intercept is its CPU per request, the slope its CPU per
event. From the fit it says, for each pair of relays, the stream length where their CPU per event
crosses, and with ``--trace`` (a sidecar trace file, e.g. a public trace converted by
``sidecar trace import``) the CPU per event at that trace's mean output length, the workload
envelope that matters for a deployment like it.

A relay's CPU per event also holds its sleeps: each time it finds no work it sleeps in
``epoll_wait``, and each wake-up costs CPU, how much depends on the host (~8 µs on this
project's microVM, where a context switch goes through the hypervisor). The runs count each
relay's wake-ups per event (its voluntary context switches); before each repeat
`wakeup_cost.py` measures the price of one on the relays' core (``--wakeup-messages``), and the
report gives each relay's CPU per event less its wake-ups at that price: its own work per event
apart from what its sleeps cost on this host.

The processes, their placement and the CPU accounting are `proxy_overhead.py`'s (its docstring
says them): the simulator and the client on core 0, each relay alone on core 1, its CPU
utime+stime from /proc (the sidecar's worker and collector summed), over the client's measured
window, divided by the events the client read in it. The engine step is the same at every length
(``--min-step-ms`` / ``--target-rate``, as there), so every length relays about the same events
per second and only the request rate changes with the length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po  # noqa: E402  (the processes, the client, the CPU accounting)

from sidecar.tracefile import TraceFormatError, TraceReader  # noqa: E402

DEFAULT_LENGTHS = [8, 32, 128, 256]
DEFAULT_MODES = ["sidecar", "envoy", "nginx"]


@dataclass(frozen=True)
class CostFit:
    """CPU per request = ``per_request_us`` + ``per_event_us`` x events per request."""

    per_request_us: float
    per_event_us: float
    runs: int
    r_squared: float

    def us_per_event(self, events_per_request: float) -> float:
        """CPU per relayed event of a workload whose requests average ``events_per_request``."""
        return self.per_request_us / events_per_request + self.per_event_us


def fit_cost(points: Sequence[tuple[float, float]]) -> CostFit:
    """Least-squares line through (events per request, CPU per event in µs) points, fitted as
    CPU per request (= CPU per event x events) against events. Needs two distinct lengths."""
    if len({e for e, _ in points}) < 2:
        raise ValueError("fitting a cost per request and per event needs two stream lengths")
    events = np.array([e for e, _ in points], dtype=np.float64)
    per_request = np.array([e * us for e, us in points], dtype=np.float64)
    slope, intercept = np.polyfit(events, per_request, 1)
    predicted = intercept + slope * events
    spread = float(((per_request - per_request.mean()) ** 2).sum())
    residual = float(((per_request - predicted) ** 2).sum())
    return CostFit(
        per_request_us=float(intercept),
        per_event_us=float(slope),
        runs=len(points),
        r_squared=1.0 - residual / spread if spread > 0 else float("nan"),
    )


def crossover_events(a: CostFit, b: CostFit) -> float | None:
    """Events per request at which ``a`` and ``b`` cost the same per event: the lengths above it
    favour the relay with the lower per-event cost. None when the lines do not cross at a
    positive length (one is cheaper at every length, or both are parallel)."""
    slope_gap = b.per_event_us - a.per_event_us
    if slope_gap == 0:
        return None
    events = (a.per_request_us - b.per_request_us) / slope_gap
    return events if events > 0 else None


def trace_mean_tokens(path: Path) -> tuple[float, int]:
    """Mean output tokens per request of a sidecar trace (``n_out``, else ``max_tokens``; the
    requests with neither are left out), and how many requests had one."""
    counts = []
    for request in TraceReader(path):
        n = request.n_out if request.n_out is not None else request.max_tokens
        if n is not None:
            counts.append(n)
    if not counts:
        raise TraceFormatError(f"{path}: no request says its output length (n_out, max_tokens)")
    return statistics.fmean(counts), len(counts)


def events_per_request(result: Mapping[str, Any]) -> float:
    """Median SSE events per completed request of one client run."""
    events = [r["events"] for r in result["requests"] if r["ok"]]
    if not events:
        raise RuntimeError("no request completed in the run")
    return float(statistics.median(events))


def run_client(
    port: int,
    concurrency: int,
    length: int,
    warmup_s: float,
    measure_s: float,
    request_s: float,
    out: Path,
    tag: str,
    relay_pids: Sequence[int],
    sim_pid: int,
    other_pids: Sequence[int],
    core: int | None,
) -> dict[str, Any]:
    argv = po.client_argv(
        f"http://{po.HOST}:{port}",
        concurrency,
        length,
        warmup_s,
        measure_s,
        request_s,
        out,
        tag,
        watch_pid=relay_pids,
        sim_pid=sim_pid,
        other_pids=other_pids,
    )
    subprocess.run(
        argv,
        check=True,
        timeout=warmup_s + measure_s + request_s + 60,
        cwd=po.REPO_ROOT,
        stdin=subprocess.DEVNULL,
        preexec_fn=po._pinner(core),
    )
    result = json.loads(out.read_text())
    summary = po.analyse_run(result)
    summary["events_per_request"] = events_per_request(result)
    return summary


def rotated(items: Sequence[Any], by: int) -> list[Any]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every (repeat, length, relay) run; the relays and the simulator started once."""
    po.AUTOGROUP_NICE = args.nice
    po.exit_on_sigterm()
    place = po.Placement(args)
    modes, skipped = po.select_modes(args.modes)
    relays = [m for m in modes if m != "direct"]
    if not relays:
        raise SystemExit(
            "no relay to measure: " + "; ".join(f"{k}: {v}" for k, v in skipped.items())
        )
    workdir = Path(tempfile.mkdtemp(prefix="cpu-by-length-"))
    c = args.concurrency
    step = po.step_s_for(c, args.min_step_ms, args.target_rate)
    print(f"# {po.machine_line()}", flush=True)
    print(
        f"# pinning: {place.describe()}; autogroup nice {args.nice}; {c} streams, engine step "
        f"{step * 1e3:.2f} ms; logs and raw client output in {workdir}",
        flush=True,
    )
    for mode, reason in skipped.items():
        print(f"# mode {mode} skipped: {reason}", flush=True)
    runs: list[dict[str, Any]] = []
    wakeup_prices: list[float] = []
    procs: dict[str, subprocess.Popen[bytes]] = {}
    pids: dict[str, list[int]] = {}
    ports: dict[str, int] = {}
    sim_port = po.free_port()
    try:
        procs["sim"] = po.start_sim(sim_port, step, workdir / "sim.log", place.sim)
        pids["sim"] = [procs["sim"].pid]
        for mode in relays:
            ports[mode] = po.free_port()
            procs[mode], pids[mode] = po.start_relay(
                mode, sim_port, ports[mode], workdir, "len", place.proxy, args.proxy_arg
            )
        ours = [pid for group in pids.values() for pid in group]
        for rep in range(args.repeats):
            po.probe_round(args, place, ours, workdir, rep)
            # Placed as the traffic is: read on the relays' core, written from the
            # simulator's (the relays idle meanwhile).
            price = po.measure_sleep_price(args, place)
            if price is not None:
                wakeup_prices.append(price)
            # Lengths and relays in a different order each repeat: a drift of the host over the
            # run falls on all of them alike.
            for length in rotated(args.lengths, rep):
                request_s = step * (length + 1)
                warmup_s = max(args.warmup_s, 1.5 * request_s)
                for mode in rotated(relays, rep):
                    summary = run_client(
                        ports[mode],
                        c,
                        length,
                        warmup_s,
                        args.measure_s,
                        request_s,
                        workdir / f"{mode}-{length}-{rep}.json",
                        f"{mode}{length}r{rep}",
                        pids[mode],
                        procs["sim"].pid,
                        [p for k, group in pids.items() if k not in ("sim", mode) for p in group],
                        place.client,
                    )
                    runs.append({"mode": mode, "length": length, "repeat": rep, **summary})
                    print(
                        f"{mode:8} {length:>4} tokens rep {rep}: {summary['n_ok']} ok "
                        f"({summary['n_err']} failed), {summary['events_per_request']:.0f} "
                        f"events/request, {summary['events_s']:.0f} events/s, relay "
                        f"{summary['proxy_us_event']:.1f} µs/event (kernel "
                        f"{summary['proxy_sys_share']:.0%}, {summary['proxy_wakeups_event']:.3f} "
                        f"wake-ups/event), others {summary['background']:.2f}",
                        flush=True,
                    )
    finally:
        for proc in reversed(list(procs.values())):
            po.stop(proc)
    return {
        "relays": relays,
        "skipped": skipped,
        "step_s": step,
        "runs": runs,
        "wakeup_prices_us": wakeup_prices,
    }


def paired_ratios(
    runs: Sequence[Mapping[str, Any]], relays: Sequence[str], lengths: Sequence[int], key: str
) -> dict[str, dict[int, list[float]]]:
    """Per relay other than Envoy and per length, its runs' ``key`` over Envoy's of the same
    repeat and length (no Envoy: empty)."""
    ratios: dict[str, dict[int, list[float]]] = {}
    if "envoy" not in relays:
        return ratios
    for mode in relays:
        if mode == "envoy":
            continue
        for length in lengths:
            pairs = {
                r["repeat"]: r[key] for r in runs if r["mode"] == "envoy" and r["length"] == length
            }
            ratios.setdefault(mode, {})[length] = [
                r[key] / pairs[r["repeat"]]
                for r in runs
                if r["mode"] == mode and r["length"] == length and r["repeat"] in pairs
            ]
    return ratios


def analyse(measured: Mapping[str, Any], traces: Mapping[str, tuple[float, int]]) -> dict[str, Any]:
    """Per relay and length the median CPU per event, the paired ratios to Envoy, the fit, the
    crossovers and the trace envelopes."""
    relays: list[str] = list(measured["relays"])
    runs: list[dict[str, Any]] = [r for r in measured["runs"] if r["n_ok"] > 0]
    lengths = sorted({r["length"] for r in runs})
    by_length: dict[str, dict[int, dict[str, Any]]] = {}
    for mode in relays:
        for length in lengths:
            mine = [r for r in runs if r["mode"] == mode and r["length"] == length]
            if mine:
                values = [r["proxy_us_event"] for r in mine]
                by_length.setdefault(mode, {})[length] = {
                    "us_event_median": statistics.median(values),
                    "us_event_min": min(values),
                    "us_event_max": max(values),
                    "events_per_request": statistics.median(r["events_per_request"] for r in mine),
                    "kernel_share": statistics.median(r["proxy_sys_share"] for r in mine),
                    "wakeups_event": statistics.median(r["proxy_wakeups_event"] for r in mine),
                }
    # The price of one sleep on this host (wakeup_cost.py, once per repeat): a run's sleeps
    # cost its wake-ups per event x the price; what is left is the relay's work per event.
    prices: list[float] = list(measured.get("wakeup_prices_us", []))
    price = statistics.median(prices) if prices else None
    if price is not None:
        for r in runs:
            r["proxy_us_event_less_sleeps"] = po.less_sleeps(r, price)
        for mode, rows in by_length.items():
            for length, row in rows.items():
                values = [
                    r["proxy_us_event_less_sleeps"]
                    for r in runs
                    if r["mode"] == mode and r["length"] == length
                ]
                row["less_sleeps_median"] = statistics.median(values)
                row["less_sleeps_min"] = min(values)
                row["less_sleeps_max"] = max(values)
    ratios = paired_ratios(runs, relays, lengths, "proxy_us_event")
    ratios_less_sleeps = (
        paired_ratios(runs, relays, lengths, "proxy_us_event_less_sleeps")
        if price is not None
        else {}
    )
    fits: dict[str, CostFit] = {}
    for mode in relays:
        points = [(r["events_per_request"], r["proxy_us_event"]) for r in runs if r["mode"] == mode]
        if len({e for e, _ in points}) >= 2:
            fits[mode] = fit_cost(points)
    # Events per request beyond the tokens (the role chunk, the usage/finish chunk, [DONE]...),
    # as the runs counted them: to turn a trace's output tokens into events.
    extra = statistics.median(r["events_per_request"] - r["length"] for r in runs) if runs else 0
    crossings = {
        f"{a}/{b}": crossover_events(fits[a], fits[b])
        for i, a in enumerate(relays)
        for b in relays[i + 1 :]
        if a in fits and b in fits
    }
    envelopes = {
        name: {
            "mean_tokens": mean_tokens,
            "requests": n,
            "events_per_request": mean_tokens + extra,
            "us_event": {mode: fit.us_per_event(mean_tokens + extra) for mode, fit in fits.items()},
        }
        for name, (mean_tokens, n) in traces.items()
    }
    return {
        "lengths": lengths,
        "by_length": {m: {str(k): v for k, v in d.items()} for m, d in by_length.items()},
        "ratio_to_envoy": {m: {str(k): v for k, v in d.items()} for m, d in ratios.items()},
        "wakeup_price_us": price,
        "wakeup_prices_us": prices,
        "ratio_to_envoy_less_sleeps": {
            m: {str(k): v for k, v in d.items()} for m, d in ratios_less_sleeps.items()
        },
        "fits": {m: vars(f) for m, f in fits.items()},
        "extra_events_per_request": extra,
        "crossover_events": crossings,
        "envelopes": envelopes,
    }


def ratio_cell(ratios: Sequence[float]) -> str:
    """A paired-ratio column's cell: median [min-max], and in how many pairs below 1."""
    below = sum(1 for v in ratios if v < 1)
    return (
        f" {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}], "
        f"{below} of {len(ratios)} |"
    )


def report(analysis: Mapping[str, Any], relays: Sequence[str], repeats: int) -> str:
    lengths = analysis["lengths"]
    lines = [
        f"CPU per relayed event (µs; utime+stime of the relay's processes over the client's "
        f"window / events read), median [min-max] of {repeats} repeats:",
        "",
        "| tokens per stream | events per request | "
        + " | ".join(relays)
        + (
            " | sidecar / Envoy, paired (median [min-max], below in) |"
            if "sidecar" in analysis["ratio_to_envoy"]
            else " |"
        ),
        "|---:|---:|"
        + "---:|" * len(relays)
        + ("---|" if "sidecar" in analysis["ratio_to_envoy"] else ""),
    ]
    for length in lengths:
        key = str(length)
        cells = []
        events = None
        for mode in relays:
            row = analysis["by_length"].get(mode, {}).get(key)
            if row is None:
                cells.append("-")
                continue
            events = row["events_per_request"]
            low, high = row["us_event_min"], row["us_event_max"]
            cells.append(f"{row['us_event_median']:.1f} [{low:.1f}-{high:.1f}]")
        line = f"| {length} | {events if events is not None else '-'} | " + " | ".join(cells) + " |"
        ratio = analysis["ratio_to_envoy"].get("sidecar", {}).get(key)
        if ratio:
            line += ratio_cell(ratio)
        lines.append(line)
    lines += [
        "",
        "Kernel share of that CPU (ticks) and wake-ups per event (voluntary context switches: "
        "each a sleep in epoll_wait that ended), medians:",
        "",
        "| tokens per stream | " + " | ".join(relays) + " |",
        "|---:|" + "---:|" * len(relays),
    ]
    for length in lengths:
        cells = []
        for mode in relays:
            row = analysis["by_length"].get(mode, {}).get(str(length))
            cells.append(
                "-" if row is None else f"{row['kernel_share']:.2f} / {row['wakeups_event']:.3f}"
            )
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    price = analysis.get("wakeup_price_us")
    if price is not None:
        ratio_rows = analysis["ratio_to_envoy_less_sleeps"].get("sidecar", {})
        lines += [
            "",
            f"Less its sleeps: CPU per event - wake-ups per event x {price:.1f} µs, the price "
            "of one sleep and wake-up to the woken process on the relays' core (wakeup_cost.py, "
            f"once per repeat: {', '.join(f'{p:.1f}' for p in analysis['wakeup_prices_us'])}); "
            "what is left is the relay's own work per event, median [min-max]:",
            "",
            "| tokens per stream | "
            + " | ".join(relays)
            + (" | sidecar / Envoy, paired (median [min-max], below in) |" if ratio_rows else " |"),
            "|---:|" + "---:|" * len(relays) + ("---|" if ratio_rows else ""),
        ]
        for length in lengths:
            cells = []
            for mode in relays:
                row = analysis["by_length"].get(mode, {}).get(str(length))
                cells.append(
                    "-"
                    if row is None
                    else f"{row['less_sleeps_median']:.1f} "
                    f"[{row['less_sleeps_min']:.1f}-{row['less_sleeps_max']:.1f}]"
                )
            line = f"| {length} | " + " | ".join(cells) + " |"
            ratio = ratio_rows.get(str(length))
            if ratio:
                line += ratio_cell(ratio)
            lines.append(line)
    fits = analysis["fits"]
    if fits:
        lines += [
            "",
            "Fitted, CPU per request = per request + per event x events per request (least "
            "squares over every run of the relay):",
            "",
            "| relay | per request (µs) | per event (µs) | R² | runs |",
            "|---|---:|---:|---:|---:|",
        ]
        for mode in relays:
            if mode in fits:
                f = fits[mode]
                lines.append(
                    f"| {mode} | {f['per_request_us']:.0f} | {f['per_event_us']:.2f} | "
                    f"{f['r_squared']:.3f} | {f['runs']} |"
                )
        for pair, events in analysis["crossover_events"].items():
            a, b = pair.split("/")
            if events is None:
                lines.append(f"\n{a} and {b}: the fitted lines do not cross at a positive length.")
            else:
                cheaper_long = a if fits[a]["per_event_us"] < fits[b]["per_event_us"] else b
                lines.append(
                    f"\n{a} and {b} cost the same per event at {events:.0f} events per request "
                    f"(~{events - analysis['extra_events_per_request']:.0f} tokens); "
                    f"longer streams favour {cheaper_long}."
                )
    for name, env in analysis["envelopes"].items():
        fitted = ", ".join(f"{mode} {us:.1f}" for mode, us in env["us_event"].items())
        lines.append(
            f"\nAt the mean output of {name} ({env['mean_tokens']:.1f} tokens over "
            f"{env['requests']} requests, {env['events_per_request']:.1f} events per request), "
            f"fitted µs per event: {fitted}."
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    def int_list(text: str) -> list[int]:
        values = [int(x) for x in text.split(",") if x]
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
        return values

    parser.add_argument(
        "--lengths",
        type=int_list,
        default=DEFAULT_LENGTHS,
        help="tokens per stream, comma-separated [8,32,128,256]",
    )
    parser.add_argument("--concurrency", type=int, default=16, help="streams in flight [16]")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every length [3]")
    parser.add_argument(
        "--modes",
        type=lambda s: [m for m in s.split(",") if m],
        default=DEFAULT_MODES,
        help="relays, comma-separated, of proxy_overhead.py's modes [sidecar,envoy,nginx]",
    )
    parser.add_argument("--measure-s", type=float, default=6.0, help="measured window [6 s]")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="warm-up, at least [1 s]")
    parser.add_argument("--min-step-ms", type=float, default=2.0, help="engine step floor [2]")
    parser.add_argument(
        "--target-rate", type=float, default=8000.0, help="aggregate token rate [8000/s]"
    )
    parser.add_argument(
        "--trace",
        type=Path,
        action="append",
        default=[],
        help="a sidecar trace file (sidecar trace import): report the CPU per event at its mean "
        "output length (repeatable)",
    )
    parser.add_argument(
        "--base-tree",
        type=Path,
        default=None,
        help="for mode sidecar-base: the source tree of another sidecar (its C extensions "
        "built), measured beside this one, e.g. a commit before a change",
    )
    parser.add_argument("--proxy-arg", action="append", default=[], help="passed to the sidecar")
    po.add_quiet_arguments(parser, 0.15, 3.0, "repeat")
    parser.add_argument("--probe-s", type=float, default=0.5, help="wake-up probe per repeat")
    po.add_wakeup_arguments(parser)
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--nice", type=int, default=0, help="autogroup nice of the processes")
    parser.add_argument("--json-out", type=Path, help="every run's summary and the fits as JSON")
    parser.add_argument(
        "--smoke", action="store_true", help="CI: two short lengths, one repeat (the harness only)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.base_tree is not None:
        po.use_base_tree(args.base_tree)
    if args.smoke:
        args.lengths, args.repeats, args.concurrency = [4, 8], 1, 4
        args.warmup_s, args.measure_s, args.quiet_below, args.probe_s = 0.2, 0.6, 0.0, 0.0
        args.wakeup_messages = min(args.wakeup_messages, po.SMOKE_WAKEUP_MESSAGES)
    if len(set(args.lengths)) < 2:
        raise SystemExit("--lengths: give at least two stream lengths to fit")
    traces: dict[str, tuple[float, int]] = {}
    for path in args.trace:
        try:
            traces[path.name] = trace_mean_tokens(path)
        except TraceFormatError as exc:
            raise SystemExit(str(exc)) from None
    started = time.monotonic()
    measured = measure(args)
    analysis = analyse(measured, traces)
    print()
    print(report(analysis, measured["relays"], args.repeats))
    print(f"\n(total wall time {time.monotonic() - started:.0f} s)")
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {
                    "machine": po.machine_line(),
                    "concurrency": args.concurrency,
                    "repeats": args.repeats,
                    "step_s": measured["step_s"],
                    "skipped": measured["skipped"],
                    **analysis,
                    "runs": measured["runs"],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
