"""Micro-benchmarks of the sidecar's hot paths, one process, no sockets.

    python benchmarks/hot_paths.py            # prints a Markdown table, then one JSON line
    python benchmarks/hot_paths.py --smoke    # CI: one repeat (the harness runs; no timings)

Per streamed event: SSE parsing, chunk classification, token counting, the usage strip the
proxy does when it injected usage, and the record builder's two appends. Per request: reading the
request body's head (against json.loads of the whole body), freezing the record, and each
sink's on_record (Prometheus, live window, OpenTelemetry when available).
Per report: percentile math over 1M samples, and /stats of a full live window (100,000
records of 32-token streams: 3.2M gaps per vantage). Each figure is the best of 5 repeats (the least
disturbed by the other core's work), in microseconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from sidecar import stats
from sidecar.hooks import SinkFanout, ThreadedSink
from sidecar.meter import StreamMeter
from sidecar.protocol.fastchunk import fast_chunk
from sidecar.protocol.openai import TokenCounter, classify_chunk
from sidecar.protocol.rewrite import UsagePlan, without_usage
from sidecar.protocol.sse import SSEParser
from sidecar.proxy import heap
from sidecar.proxy.builder import RecordBuilder
from sidecar.proxy.headers import response_header_block, upstream_header_block
from sidecar.proxy.recordwire import decode_record, encode_record
from sidecar.proxy.requesthead import read_head
from sidecar.proxy.upstream import serialize_request_head
from sidecar.record import Outcome, RequestShape, TokenSource
from sidecar.sinks.capture import CaptureSink
from sidecar.sinks.prometheus import PrometheusSink
from sidecar.sinks.window import WindowSink
from sidecar.tracefile import TraceHeader

TOKENS = 256


def chunk(i: int, usage: bool) -> str:
    body = (
        '{"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1700000000,'
        '"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":'
        f'" word{i}"}},"logprobs":null,"finish_reason":null,"token_ids":null}}]'
    )
    if usage:
        body += (
            f',"usage":{{"prompt_tokens":512,"total_tokens":{513 + i},'
            f'"completion_tokens":{i + 1},"completion_tokens_details":null}}'
        )
    return body + ',"kv_transfer_params":null}'


REPEATS = 5  # --repeats; best of this many runs of each operation


def best_of(fn: Callable[[], int], repeats: int | None = None) -> float:
    """Microseconds per unit of work (fn returns how many units it did)."""
    best = float("inf")
    for _ in range(REPEATS if repeats is None else min(repeats, REPEATS)):
        start = time.perf_counter_ns()
        units = fn()
        best = min(best, (time.perf_counter_ns() - start) / 1000 / units)
    return best


def capture_writes(make_record: Callable[[], object]) -> Callable[[], int]:
    """Records through a real CaptureSink into a temporary directory: from the first
    `on_record` until `close` returns (everything written and flushed). 1 / this = records
    written per second by the capture thread."""

    def run() -> int:
        count = 2_000
        record = replace(
            make_record(),
            shape=RequestShape(  # type: ignore[type-var]
                max_tokens=TOKENS,
                ignore_eos=True,
                temperature=0.0,
                prefix_unit="chars",
                prefix_size=256,
                prefix_hashes=tuple(range(40)),
            ),
        )
        with tempfile.TemporaryDirectory() as directory:
            capture = CaptureSink(
                directory,
                TraceHeader(source="capture", start_wall_ns=time.time_ns()),
                queue_size=count + 1,
            )
            for _ in range(count):
                capture.on_record(record)  # type: ignore[arg-type]
            capture.close()
            assert capture.written == count, capture.written
        return count

    return run


def full_window(records: int, tokens: int) -> WindowSink:
    """A live window holding ``records`` streamed records of ``tokens`` one-token events on
    both sides (2,000 distinct records, repeated), all ended within its 120 s, each decoded
    from its wire form as the collector's are."""
    rng = np.random.default_rng(1)
    now = time.time_ns()
    distinct = []
    for i in range(2_000):
        builder = RecordBuilder(f"r{i}", now - 60_000_000_000, 0, "chat")
        builder.up_send_ns = 100
        builder.model = "m"
        server = StreamMeter(0)
        at = 50_000_000 + int(rng.integers(0, 10_000_000))
        for gap in rng.integers(5_000_000, 12_000_000, tokens):
            at += int(gap)
            server.mark(at, 1)
            builder.client_token_writes(at + 20_000, 1)
        builder.take_stream(server)
        builder.n_in, builder.n_out, builder.token_source = 512, tokens, TokenSource.USAGE
        builder.up_end_ns = builder.down_end_ns = at + 100_000
        builder.outcome = Outcome.OK
        distinct.append(builder.freeze())
    wires = [encode_record(record) for record in distinct]
    window = WindowSink(120.0, records)
    for i in range(records):
        window.on_record(decode_record(wires[i % len(wires)]))
    return window


def main(argv: Sequence[str] | None = None) -> None:
    global REPEATS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="best of N repeats [5]")
    parser.add_argument("--smoke", action="store_true", help="CI smoke run: 1 repeat")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="the /stats row with the collector's heap as SIDECAR_KEEP_FREED_MEMORY=1 sets it",
    )
    args = parser.parse_args(argv)
    REPEATS = 1 if args.smoke else max(1, args.repeats)
    stream = b"".join(f"data: {chunk(i, True)}\n\n".encode() for i in range(TOKENS))
    events = SSEParser().feed(stream)
    payloads = [e.data or "" for e in events]

    def parse() -> int:
        parser = SSEParser()
        n = 0
        for i in range(TOKENS):  # one event per read, as vLLM usually arrives
            n += len(parser.feed(events[i].raw))
        return n

    def classify() -> int:
        for payload in payloads:
            classify_chunk(payload)
        return len(payloads)

    infos = [classify_chunk(p) for p in payloads]

    def count() -> int:
        counter = TokenCounter()
        for info in infos:
            counter.observe(info)
        return len(infos)

    def strip() -> int:
        for event in events:
            without_usage(event.raw, event.data or "")
        return len(events)

    def build() -> int:
        builder = RecordBuilder("r", 0, 0, "chat")
        for i in range(TOKENS):
            builder.client_token_writes(1000 * i + 50, 1)
        return TOKENS

    def record_of() -> object:
        builder = RecordBuilder("r", 0, 0, "chat")
        builder.up_send_ns = 100
        builder.model = "meta-llama/Llama-3.1-8B-Instruct"
        builder.replica = "10.0.0.5:8000"
        server = StreamMeter(0)  # the server-side columns, as the measuring core fills them
        for i in range(TOKENS):
            server.mark(50_000_000 + 8_000_000 * i, 1)
            builder.client_token_writes(50_020_000 + 8_000_000 * i, 1)
        builder.take_stream(server)
        builder.n_in, builder.n_out, builder.token_source = 512, TOKENS, TokenSource.USAGE
        builder.up_end_ns = builder.down_end_ns = 50_100_000 + 8_000_000 * TOKENS
        builder.outcome = Outcome.OK
        return builder.freeze()

    def freeze() -> int:
        for _ in range(200):
            record_of()
        return 200

    record = record_of()
    policy = stats.SLOPolicy({"default": stats.SLO(ttft_s=0.5, tpot_s=0.05)})
    prometheus = PrometheusSink(CollectorRegistry(), policy)
    # `record` ended in 1970: a window drops it by age as soon as the next one comes.
    window = WindowSink(60.0, 100_000)
    # A full window at a steady rate: records of now, 1,000 at most, so every record that
    # comes makes the oldest leave over the cap.
    recent: Any = replace(record, wall_time_ns=time.time_ns())  # type: ignore[type-var]
    full = WindowSink(60.0, 1_000)
    for _ in range(1_000):
        full.on_record(recent)

    def sink(
        s: object, then: Callable[[], None] | None = None, given: object = record
    ) -> Callable[[], int]:
        def run() -> int:
            for _ in range(200):
                s.on_record(given)  # type: ignore[attr-defined]
            if then is not None:
                then()
            return 200

        return run

    raws = [e.raw for e in events]
    injected = UsagePlan(
        client_include_usage=False,
        client_continuous=False,
        add_include_usage=True,
        add_continuous=True,
    )

    def fast() -> int:
        for raw in raws:
            fast_chunk(raw)
        return len(raws)

    def meter() -> int:
        m = StreamMeter(0, injected)  # one event per read, usage cut out, as the relay runs it
        for i, raw in enumerate(raws):
            m.feed(raw, 1000 * i)
        return len(raws)

    rows = [
        (
            "per event",
            "StreamMeter.feed: the whole measuring core (parse, classify, count, "
            "stamp, cut the injected usage), one event per read",
            best_of(meter),
        ),
        (
            "per event",
            "fast_chunk (the common chunk's classification + usage span)",
            best_of(fast),
        ),
        ("per event", "SSE parse (one event per read)", best_of(parse)),
        ("per event", "classify_chunk (json.loads + shape)", best_of(classify)),
        ("per event", "TokenCounter.observe", best_of(count)),
        ("per event", "strip injected usage (text edit)", best_of(strip)),
        (
            "per event",
            "RecordBuilder: client stamp (the server stamp is in StreamMeter.feed)",
            best_of(build),
        ),
        ("per request (256 tokens)", "build + freeze the record", best_of(freeze)),
        (
            "per request (256 tokens)",
            "PrometheusSink.on_record + bin_held (a scrape per 200 records)",
            # What the sink holds back, binned as a scrape would (every 200 records).
            best_of(sink(prometheus, prometheus.bin_held)),
        ),
        ("per request (256 tokens)", "WindowSink.on_record", best_of(sink(window))),
        (
            "per request (256 tokens)",
            "WindowSink.on_record, the window full (each record makes one leave)",
            best_of(sink(full, given=recent)),
        ),
    ]

    # Reading a generation request: the members the proxy needs (proxy/requesthead.py)
    # against decoding the whole body, for a short chat body and a Mooncake-sized prompt.
    short_body = json.dumps(
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "messages": [{"role": "user", "content": "Say something about the sea."}],
            "stream": True,
            "max_tokens": 128,
        }
    ).encode()
    long_body = json.dumps(
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "messages": [{"role": "user", "content": "word " * 116_000}],
            "stream": True,
            "max_tokens": 128,
        }
    ).encode()

    def reads(read: Callable[[bytes], object], body: bytes, times: int) -> Callable[[], int]:
        def run() -> int:
            for _ in range(times):
                read(body)
            return times

        return run

    for label, body, times in (("200 B", short_body, 20_000), ("580 KB", long_body, 20)):
        rows.append(
            (
                "per request",
                f"read_head ({label} chat body)",
                best_of(reads(read_head, body, times)),
            )
        )
        rows.append(
            (
                "per request",
                f"json.loads ({label} chat body)",
                best_of(reads(json.loads, body, times)),
            )
        )

    # The upstream request's head from the client's header pairs: what an OpenAI Python
    # client sends (17 headers), as the relay builds it for a generation request.
    openai_headers = [
        (b"Host", b"127.0.0.1:8000"),
        (b"Accept-Encoding", b"gzip, deflate"),
        (b"Connection", b"keep-alive"),
        (b"Accept", b"application/json"),
        (b"Content-Type", b"application/json"),
        (b"User-Agent", b"OpenAI/Python 1.54.0"),
        (b"X-Stainless-Lang", b"python"),
        (b"X-Stainless-Package-Version", b"1.54.0"),
        (b"X-Stainless-OS", b"Linux"),
        (b"X-Stainless-Arch", b"x64"),
        (b"X-Stainless-Runtime", b"CPython"),
        (b"X-Stainless-Runtime-Version", b"3.11.7"),
        (b"Authorization", b"Bearer sk-abcdefabcdefabcdef"),
        (b"X-Stainless-Async", b"async:asyncio"),
        (b"x-stainless-retry-count", b"0"),
        (b"x-stainless-read-timeout", b"600"),
        (b"Content-Length", b"180"),
    ]

    def upstream_head() -> int:
        for _ in range(20_000):
            block = upstream_header_block(openai_headers, "0" * 32, "127.0.0.1", True)
            serialize_request_head("POST", "/v1/chat/completions", "127.0.0.1:8000", block, 180)
        return 20_000

    rows.append(
        (
            "per request",
            "upstream request head (an OpenAI client's 17 headers)",
            best_of(upstream_head),
        )
    )

    # The client's response head from the upstream's header pairs: what vLLM's API server
    # (uvicorn) sends with a stream, as the relay filters it for the client.
    vllm_headers = [
        (b"date", b"Thu, 03 Dec 2026 14:00:00 GMT"),
        (b"server", b"uvicorn"),
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"transfer-encoding", b"chunked"),
    ]

    def client_head() -> int:
        for _ in range(20_000):
            response_header_block(vllm_headers, "0" * 32)
        return 20_000

    rows.append(
        (
            "per request",
            "client response head lines (vLLM's 4 streaming headers)",
            best_of(client_head),
        )
    )

    # The fan-out as `build_proxy_server` wires it, on the event loop: the live window, the
    # Prometheus sink and the hand-off to a threaded sink (OpenTelemetry, capture); what the
    # thread then does is off the loop (its own rows).
    class Discard:
        name = "discard"

        def on_record(self, _record: object) -> None:
            return None

    threaded = ThreadedSink(Discard(), queue_size=1_000_000)
    fanout = SinkFanout([WindowSink(60.0, 100_000), prometheus, threaded])
    rows.append(
        (
            "per request (256 tokens)",
            "SinkFanout.on_record (window + Prometheus + threaded hand-off)",
            best_of(sink(fanout, prometheus.bin_held)),
        )
    )
    threaded.close()
    rows.append(
        (
            "capture",
            "CaptureSink: µs per record written (writer thread, JSONL, flushed)",
            best_of(capture_writes(record_of), 3),
        )
    )
    try:
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        from sidecar.sinks.otel import build_otel_sink  # noqa: PLC0415 - optional, may be absent

        otel = build_otel_sink(endpoint=None, slo_policy=policy, readers=[InMemoryMetricReader()])
        rows.append(("per request (256 tokens)", "OTelSink.on_record", best_of(sink(otel))))
        otel.shutdown()
    except ImportError:
        pass
    samples = np.random.default_rng(0).lognormal(-4, 1, 1_000_000)

    def percentiles() -> int:
        stats.summarize(samples)
        return 1

    rows.append(("per report", "summarize 1M samples (numpy)", best_of(percentiles, 3)))
    window_records = 2_000 if args.smoke else 100_000
    # What the collector's start leaves out of the cycle collector's reach (gcpolicy.settle);
    # --keep-freed-memory: and the heap settings SIDECAR_KEEP_FREED_MEMORY=1 gives it.
    gc.collect()
    gc.freeze()
    if args.keep_freed_memory:
        heap.keep_freed_memory()
    full = full_window(window_records, 32)
    rows.append(
        (
            "per report",
            f"/stats of a live window: {window_records:,} records x 32 token events "
            "(`WindowSink.snapshot` + JSON"
            + ("; SIDECAR_KEEP_FREED_MEMORY=1)" if args.keep_freed_memory else ")"),
            best_of(lambda: bool(json.dumps(full.snapshot(policy))), 3),
        )
    )

    def collect() -> int:
        gc.collect()
        return 1

    rows.append(
        (
            "per full collection",
            f"gc.collect() in a collector holding that window ({window_records:,} records "
            "decoded from the wire)",
            best_of(collect, 3),
        )
    )
    print(f"python {sys.version.split()[0]}, {platform.machine()}, numpy {np.__version__}")
    print("| scope | operation | µs |\n|---|---|---:|")
    for scope, name, micros in rows:
        print(f"| {scope} | {name} | {micros:.2f} |")
    # The measuring core as a whole plus the client-side stamp; the other per-event rows are
    # its parts (and the general path the fast one replaces for the common chunk).
    per_event = rows[0][2] + next(m for _, name, m in rows if name.startswith("RecordBuilder"))
    print(f"\nper-event total (StreamMeter.feed + client stamp): {per_event:.2f} µs")
    print(json.dumps({name: round(m, 3) for _, name, m in rows}))


if __name__ == "__main__":
    main()
