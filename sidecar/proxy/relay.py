"""The measuring relay: one handler for every request, one record for every request.

Stamps (all ``time.perf_counter_ns()``, see clock.py), as docs/metrics.md names them:
t_arrive (the request's first byte; when the body was read whole is kept beside it as
``request_read_ns``), t_up_send (just before the request goes to the upstream;
includes taking a pooled connection, or connecting when the pool has none), upstream response
headers, every upstream read (all events parsed from one read share its stamp: that is when their
bytes arrived), every write of an event to the client (after the write call returned: the bytes
are in the kernel's socket buffer), and the end of the stream on each side.

The per-read path runs inside the upstream connection's callback (upstream.py, then
stream_relay.py): the measuring core (meter.py) parses, classifies, counts and stamps, and what
it returns is written to the client's transport (listener.py) in the same callback. Events are
forwarded as the upstream's bytes unless the proxy itself changed the request (usage injection),
in which case only what it added is cut out (protocol/rewrite.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp

from sidecar import clock
from sidecar.config import ProxyConfig, RoutePolicy, read_capture_key
from sidecar.hooks import SinkFanout
from sidecar.meter import StreamMeter, choices_text
from sidecar.protocol.assemble import StreamAssembler
from sidecar.protocol.openai import (
    MAX_TOKEN_COUNT,
    ErrorInfo,
    Usage,
    endpoint_for_path,
    error_body,
    safe_error_type,
    stream_usage_options,
)
from sidecar.protocol.rewrite import (
    NO_CHANGE,
    UsagePlan,
    request_with_usage,
    usage_plan,
)
from sidecar.protocol.sse import DONE_EVENT, encode_data_event
from sidecar.proxy.basemetrics import CONTENT_TYPE as BASE_METRICS_CONTENT_TYPE
from sidecar.proxy.basemetrics import merge_expositions
from sidecar.proxy.builder import RecordBuilder
from sidecar.proxy.headers import (
    REQUEST_ID_HEADER,
    has_dot_segment,
    new_request_id,
    request_id_from,
    response_header_block,
    upstream_header_block,
)
from sidecar.proxy.listener import (
    ClientExchange,
    IncomingRequest,
    Rejection,
)
from sidecar.proxy.probes import check_health, scrape_engine
from sidecar.proxy.requesthead import read_head, read_whole
from sidecar.proxy.routing import Replica, Router
from sidecar.proxy.shape import PrefixHasher, chat_text, request_shape
from sidecar.proxy.stream_relay import MeteredRead, write_paced
from sidecar.proxy.timeouts import Timeouts
from sidecar.proxy.upstream import (
    UpstreamError,
    UpstreamExchange,
    UpstreamPool,
    serialize_request_head,
)
from sidecar.record import EngineTiming, Outcome, TokenSource

# The clock as a C static in compiled code (`clock.monotonic_ns` is a lookup of the module
# global and then of its attribute, at every reading).
_monotonic_ns: Final = clock.monotonic_ns

log = logging.getLogger("sidecar.proxy")

MAX_NON_SSE_BODY = 64 * 1024 * 1024  # an upstream's non-streamed answer is read whole
# A model name longer than this (or with control characters) is not kept on the record: it
# would become a metric label and a log field. The request still goes upstream as sent (vLLM
# answers 404 for a name it does not serve).
MAX_MODEL_NAME_LEN: Final = 256
# How long the proxy tries to hand a failed stream its error event and [DONE] before it cuts
# the connection instead (a client that does not read must not hold the request open).
ERROR_TAIL_WRITE_S: Final = 2.0


class UpstreamFailure(Exception):
    def __init__(
        self,
        outcome: Outcome,
        error_type: str,
        status: int,
        message: str,
        err_type: str = "BadGateway",
    ) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.error_type = error_type  # the record's short cause
        self.status = status
        self.message = message
        self.err_type = err_type  # the `type` of the vLLM-shaped error the client gets


def prompt_prefix_key(body: Mapping[str, Any], chars: int, tokens: int) -> bytes | None:
    """The prompt's first block, for prefix affinity: text (first ``chars`` characters; chat
    messages in the capture's canonical form, `shape.chat_text`) or token ids (first
    ``tokens``)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, str):
        return prompt[:chars].encode("utf-8", "replace")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt[:tokens]):
        return b",".join(str(t).encode() for t in prompt[:tokens])
    messages = body.get("messages")
    if isinstance(messages, list):
        text = chat_text(messages, limit=chars)
        if text:
            return text[:chars].encode("utf-8", "replace")
    return None


def error_event(endpoint: str, message: str, err_type: str, code: int) -> bytes:
    """A mid-stream error event the way vLLM writes it (chat compact, completions spaced)."""
    body = error_body(message, err_type, code)
    if endpoint == "chat":
        return encode_data_event(json.dumps(body, separators=(",", ":")))
    return encode_data_event(json.dumps(body))


class Proxy:
    """Holds the upstream pool, routing and sinks; `handle` serves one request of the traffic
    listener (listener.py), `reject` records one the listener refused."""

    def __init__(
        self,
        config: ProxyConfig,
        fanout: SinkFanout | None = None,
        *,
        capture_salt: bytes | None = None,
    ) -> None:
        self.config = config
        self.fanout = fanout or SinkFanout()
        self.router = Router(
            [Replica(url, i) for i, url in enumerate(config.upstreams)], config.route_policy
        )
        self.in_flight = 0
        self.requests_total = 0
        self.records_total = 0
        self.rewritten_events = 0  # events re-encoded because they could not be edited as text
        self._slo_class_names = frozenset(config.slo_thresholds())
        # Each record names the policy: read once (an enum's `value` is a descriptor call).
        self._route_policy_name: str = config.route_policy.value
        # ... and which keys routing needs, for the same reason (an enum member read off its
        # class is a lookup through the metaclass).
        self._session_routing = config.route_policy is RoutePolicy.SESSION
        self._prefix_routing = config.route_policy is RoutePolicy.PREFIX
        # Capture needs each request's shape (lengths asked, prefix hashes); text only opt-in.
        # ``capture_salt``: a key given by the process that owns the capture (a worker gets its
        # collector's, so that every worker's hashes and pseudonyms agree).
        if capture_salt is None and config.capture_key_file:
            capture_salt = read_capture_key(config.capture_key_file)
        self._hasher = (
            PrefixHasher(config.capture_block_chars, config.capture_block_tokens, salt=capture_salt)
            if config.capture_dir
            else None
        )
        # The data path's own HTTP/1.1 client (upstream.py); health checks and engine scrapes
        # are not on the hot path and keep aiohttp's.
        self.pool = UpstreamPool(kernel_stamps=config.server_stamps == "kernel")
        # Each replica's (host, port, Host header, path prefix, TLS), parsed once.
        self._addresses = {r.index: _address(r.url) for r in self.router.replicas}
        if any(tls for *_, tls in self._addresses.values()):
            self.pool.prepare_tls()
        # The system_fingerprint each replica sent last (one entry per configured replica):
        # a finish chunk held for it must sometimes leave before the stream gives it (n > 1).
        self._fingerprints: dict[str | None, str] = {}
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._engine_task: asyncio.Task[None] | None = None

    @property
    def capture_key_id(self) -> str | None:
        """Names the capture key (never the key): equal in captures that can be merged."""
        return self._hasher.key_id if self._hasher is not None else None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=30
        )
        # auto_decompress off: bytes go to the client as the upstream sent them. The proxy asks
        # for identity encoding on the endpoints it parses.
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None)
        )
        if self.config.health_interval > 0:
            self._health_task = asyncio.create_task(self._health_loop(), name="health-checks")
        if self.config.engine_scrape_interval > 0:
            self._engine_task = asyncio.create_task(self._engine_loop(), name="engine-scrapes")

    async def close(self) -> None:
        for task in (self._health_task, self._engine_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._session is not None:
            await self._session.close()
        await self.pool.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Proxy.start() was not awaited")
        return self._session

    async def _health_loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        while True:
            await asyncio.gather(*(self._check(r, timeout) for r in self.router.replicas))
            await asyncio.sleep(self.config.health_interval)

    async def _engine_loop(self) -> None:
        while True:
            await self.scrape_engines()
            await asyncio.sleep(self.config.engine_scrape_interval)

    async def scrape_engines(self) -> None:
        """Read every replica's /metrics once (the engine's own view: queue, KV, cache)."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        await asyncio.gather(*(self._scrape(r, timeout) for r in self.router.replicas))

    async def _scrape(self, replica: Replica, timeout: aiohttp.ClientTimeout) -> None:
        await scrape_engine(self.session, replica, timeout)

    async def _check(self, replica: Replica, timeout: aiohttp.ClientTimeout) -> None:
        await check_health(self.session, replica, timeout, self.config.eject_after)

    # -- the handler ----------------------------------------------------------------------

    def reject(self, rejection: Rejection) -> tuple[bytes, list[tuple[str, str]]] | None:
        """A request the listener refused before any handler saw it (malformed, too large,
        too slow, over the connection cap, or a client gone mid-request): its one record, and
        the answer's body and headers (None for a client that is gone)."""
        headers = rejection.headers
        request_id = request_id_from(headers) if headers is not None else new_request_id()
        wall, arrive = clock.anchor()
        endpoint = None
        if rejection.method == "POST" and rejection.path is not None:
            endpoint = endpoint_for_path(rejection.path)
        builder = RecordBuilder(
            request_id, wall, arrive, endpoint or rejection.path or "(unparsed)"
        )
        builder.route_policy = self._route_policy_name
        self.requests_total += 1
        answer: tuple[bytes, list[tuple[str, str]]] | None = None
        if rejection.status == 499:
            builder.fail(Outcome.CLIENT_CANCELLED, rejection.error_type)
        else:
            builder.fail(Outcome.REJECTED, rejection.error_type, rejection.status)
            answer = (
                _json_error_body(rejection.status, rejection.message, rejection.err_type),
                [("Content-Type", "application/json"), (REQUEST_ID_HEADER, request_id)],
            )
        builder.down_end_ns = builder.offset(_monotonic_ns())
        self._emit(builder)
        return answer

    async def handle(self, request: IncomingRequest, exchange: ClientExchange) -> None:
        if has_dot_segment(request.path):
            self._refuse_path(request, exchange)
            return
        endpoint = endpoint_for_path(request.path) if request.method == "POST" else None
        request_id = request_id_from(request.headers)
        # t_arrive is the request's first byte (the client's wait began then, its upload
        # included); t_read, now, is when the listener had read it whole. Offsets count from
        # t_arrive; t_read is kept, so that upload time and proxy time can be told apart.
        wall, read = clock.anchor()
        began = request.began_ns
        arrive = began if began is not None and began <= read else read
        builder = RecordBuilder(
            request_id, wall - (read - arrive), arrive, endpoint or request.path
        )
        builder.request_read_ns = read - arrive
        builder.route_policy = self._route_policy_name
        self.requests_total += 1
        self.in_flight += 1
        try:
            if self.in_flight > self.config.max_concurrency:
                builder.fail(Outcome.REJECTED, "max_concurrency", 429)
                self._respond_error(
                    exchange,
                    builder,
                    429,
                    f"The sidecar is at its limit of {self.config.max_concurrency} concurrent "
                    "requests; retry later.",
                    "TooManyRequests",
                )
                return
            if (
                endpoint is None
                and request.path == "/metrics"
                and (
                    request.method == "HEAD"
                    or (request.method == "GET" and len(self.router.replicas) > 1)
                )
            ):
                await self._base_metrics(request, exchange, builder)
            elif endpoint is None:
                await self._pass_through(request, exchange, builder)
            else:
                await self._generate(request, exchange, endpoint, builder)
        except asyncio.CancelledError:
            # The client went away (the listener cancels the handler on disconnect).
            builder.fail(Outcome.CLIENT_CANCELLED, "client_disconnected")
            raise
        except ConnectionResetError:
            builder.fail(Outcome.CLIENT_CANCELLED, "client_disconnected")
            exchange.abort()
        except Exception as exc:
            # A proxy bug must still end in a record and an answer; say what it was.
            log.exception("request %s failed inside the proxy", request_id)
            builder.fail(Outcome.UPSTREAM_ERROR, f"proxy_error:{type(exc).__name__}", 500)
            if not exchange.prepared and not exchange.client_gone:
                self._respond_error(
                    exchange,
                    builder,
                    500,
                    "The sidecar failed while relaying this request.",
                    "InternalServerError",
                )
            else:
                exchange.abort()
        finally:
            self.in_flight -= 1
            if builder.down_end_ns is None:
                builder.down_end_ns = builder.offset(_monotonic_ns())
            self._emit(builder)

    def _refuse_path(self, request: IncomingRequest, exchange: ClientExchange) -> None:
        """A path with ``.`` or ``..`` segments (also percent-encoded): a server that
        normalises it would serve another path than the one measured and routed here
        (``/v1/../../etc/passwd`` became ``/etc/passwd``). Refused, with a record."""
        wall, arrive = clock.anchor()
        builder = RecordBuilder(request_id_from(request.headers), wall, arrive, "other")
        builder.route_policy = self._route_policy_name
        self.requests_total += 1
        builder.fail(Outcome.REJECTED, "dot_segment_path", 400)
        self._respond_error(
            exchange,
            builder,
            400,
            "The request path has '.' or '..' segments; the sidecar relays "
            "only paths as they are meant.",
            "BadRequestError",
        )
        self._emit(builder)

    def _emit(self, builder: RecordBuilder) -> None:
        if builder.frozen:
            return
        record = builder.freeze()
        self.records_total += 1
        self.fanout.on_record(record)
        if self.config.log_requests:
            log.info(
                "request %s %s model=%s replica=%s outcome=%s status=%s n_in=%s n_out=%s",
                record.request_id,
                record.endpoint,
                record.model,
                record.replica,
                record.outcome.value,
                record.http_status,
                record.n_in,
                record.n_out,
            )

    def _respond_error(
        self,
        exchange: ClientExchange,
        builder: RecordBuilder,
        status: int,
        message: str,
        err_type: str,
    ) -> None:
        body = _json_error_body(status, message, err_type)
        builder.http_status = status
        exchange.start(
            status,
            None,
            [("Content-Type", "application/json"), (REQUEST_ID_HEADER, builder.request_id)],
            len(body),
            body,
        )
        exchange.end()
        builder.down_end_ns = builder.offset(_monotonic_ns())

    def _slo_class(self, request: IncomingRequest, model: str | None) -> str | None:
        """The request's SLO class: named by the class header, else by its model, else none
        (sinks then use the default class). Unknown header values are ignored, so a client
        cannot invent classes (and labels)."""
        if not self._slo_class_names:
            return None
        header = self.config.slo_class_header
        if header is not None:
            named = request.headers.get(header)
            if named is not None and named in self._slo_class_names:
                return named
        if model is not None:
            return self.config.slo_model_classes.get(model)
        return None

    # -- upstream connection with retry ---------------------------------------------------

    def _upstream_headers(
        self,
        request: IncomingRequest,
        request_id: str,
        parsed: bool,
        traceparent: str | None = None,
    ) -> bytes:
        """The upstream request's header lines: the client's end-to-end headers, the request
        id, X-Forwarded-For with the client's address last (the de facto standard append,
        nginx's $proxy_add_x_forwarded_for: a server that trusts this hop, as uvicorn trusts
        127.0.0.1 by default, reads the real client there), for a body the proxy reads
        (``parsed``) ``Accept-Encoding: identity``, and the proxy's ``traceparent`` when
        given."""
        return upstream_header_block(
            request.raw_headers, request_id, request.peer, parsed, traceparent
        )

    async def _open_upstream(
        self,
        request: IncomingRequest,
        body: bytes,
        headers: bytes,
        builder: RecordBuilder,
        *,
        session_key: str | None = None,
        prefix_key: bytes | None = None,
    ) -> tuple[UpstreamExchange, Replica]:
        """Send the request to a replica and wait for its response head. Retried only where
        the request cannot have reached the engine: a failure to connect is tried on another
        replica; a pooled connection reset before any answer (the replica had closed it
        without reading the request: its keep-alive ran out) is sent again once on a new
        connection to the same replica. A replica that closed the connection after the request
        went out, without answering, may have started generating: 502, never a second run."""
        tried: list[Replica] = []
        last_error = "no replica"
        timed_out = False
        head_method = request.method == "HEAD"
        while len(tried) <= self.config.retry_connect:
            replica = self.router.choose(
                session_key=session_key, prefix_key=prefix_key, exclude=tried
            )
            if replica is None:
                break
            replica.outstanding += 1
            replica.requests_total += 1
            builder.replica = replica.label
            host, port, host_header, prefix, tls = self._addresses[replica.index]
            head = serialize_request_head(
                request.method, prefix + request.target, host_header, headers, len(body)
            )
            builder.up_send_ns = builder.offset(_monotonic_ns())
            try:
                upstream = await self._exchange(host, port, tls, head, body, head_method)
            except UpstreamError as exc:
                replica.outstanding -= 1
                if exc.kind == "protocol_error":
                    raise UpstreamFailure(
                        Outcome.UPSTREAM_ERROR,
                        "upstream_protocol_error",
                        502,
                        "The upstream answered with a malformed HTTP response.",
                    ) from None
                if exc.kind == "disconnected":
                    # The request went out and the replica dropped the connection without an
                    # answer: it may be generating. Sending it to another replica would run
                    # the same request twice. Not a mark against the replica's health either:
                    # a server that accepted and then dropped one request is not dead.
                    raise UpstreamFailure(
                        Outcome.UPSTREAM_ERROR,
                        "upstream_closed_before_response",
                        502,
                        f"The upstream replica {replica.label} closed the connection after "
                        "the request was sent, without answering. It was not retried on "
                        "another replica, since this one may have started it.",
                    ) from None
                # No connection: the request never left. Try another replica.
                timed_out = exc.kind == "connect_timeout"
                if replica.record_failure(self.config.eject_after):
                    log.warning("replica %s ejected after connect failures", replica.label)
                tried.append(replica)
                last_error = _CONNECT_ERROR_NAMES.get(exc.kind, exc.kind)
                continue
            except BaseException:
                replica.outstanding -= 1
                raise
            builder.up_headers_ns = builder.offset(_monotonic_ns())
            return upstream, replica
        if timed_out:
            raise UpstreamFailure(
                Outcome.TIMEOUT,
                "connect_timeout",
                504,
                "The sidecar timed out connecting to the upstream replicas.",
                "GatewayTimeout",
            )
        raise UpstreamFailure(
            Outcome.UPSTREAM_ERROR,
            f"connect_failed:{last_error}",
            502,
            "The sidecar could not connect to any upstream replica.",
        )

    async def _exchange(
        self, host: str, port: int, tls: bool, head: bytes, body: bytes, head_method: bool
    ) -> UpstreamExchange:
        """One request to one replica, its response head awaited. On failure the exchange is
        closed and the `UpstreamError` raised, except once: a pooled connection the replica
        closed while we picked it (its keep-alive ran out) is reset by its kernel, since
        nothing read our request; that is sent again on a new connection to the same
        replica, not counted as a try. (An orderly close instead could follow a read.)"""
        reuse = True
        while True:
            upstream: UpstreamExchange | None = None
            try:
                upstream = await self.pool.exchange(
                    host,
                    port,
                    head,
                    body,
                    connect_timeout=self.config.connect_timeout,
                    head_method=head_method,
                    tls=tls,
                    reuse=reuse,
                )
                await upstream.response()
                return upstream
            except UpstreamError as exc:
                if upstream is not None:
                    self.pool.close_exchange(upstream)
                if (
                    reuse
                    and upstream is not None
                    and upstream.reused
                    and exc.reset
                    and exc.kind == "disconnected"
                    and exc.before_response
                ):
                    reuse = False
                    continue
                raise
            except BaseException:
                if upstream is not None:
                    self.pool.close_exchange(upstream)
                raise

    # -- /metrics on the traffic port (basemetrics.py) -------------------------------------

    async def _base_metrics(
        self, request: IncomingRequest, exchange: ClientExchange, builder: RecordBuilder
    ) -> None:
        """Every replica's /metrics, merged with a ``replica`` label (one replica: its own
        text as it is); HEAD gets the GET answer's head. Not a generation request: its record
        says /metrics, and a replica that does not answer only leaves its part out."""
        builder.client_stream = builder.upstream_stream = False
        replicas = self.router.replicas
        timeout = aiohttp.ClientTimeout(total=max(self.config.health_timeout, 1.0))

        async def fetch(replica: Replica) -> tuple[str, str | None, str]:
            try:
                async with self.session.get(replica.url + "/metrics", timeout=timeout) as got:
                    if got.status != 200:
                        return replica.label, None, f"HTTP {got.status}"
                    return replica.label, await got.text(), ""
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                return replica.label, None, type(exc).__name__

        results = await asyncio.gather(*(fetch(r) for r in replicas))
        texts = [(label, text) for label, text, _ in results if text is not None]
        failed = [(label, why) for label, text, why in results if text is None]
        if not texts:
            builder.fail(Outcome.UPSTREAM_ERROR, "metrics_unavailable", 502)
            self._respond_error(
                exchange,
                builder,
                502,
                "No upstream replica answered /metrics: "
                + ", ".join(f"{label} ({why})" for label, why in failed),
                "BadGateway",
            )
            return
        if len(replicas) == 1:
            body = texts[0][1].encode()
        else:
            try:
                body = merge_expositions(texts, failed)
            except ValueError as unmergeable:
                builder.fail(Outcome.UPSTREAM_ERROR, "metrics_unmergeable", 502)
                self._respond_error(
                    exchange,
                    builder,
                    502,
                    f"The replicas' /metrics could not be merged: {unmergeable}",
                    "BadGateway",
                )
                return
        builder.http_status = 200
        headers = [
            ("Content-Type", BASE_METRICS_CONTENT_TYPE),
            (REQUEST_ID_HEADER, builder.request_id),
        ]
        if request.method == "HEAD":
            exchange.start(200, None, headers, len(body), b"")
        else:
            exchange.start(200, None, headers, len(body), body)
        exchange.end()
        builder.down_end_ns = builder.offset(_monotonic_ns())

    # -- pass-through paths ---------------------------------------------------------------

    async def _pass_through(
        self, request: IncomingRequest, exchange: ClientExchange, builder: RecordBuilder
    ) -> None:
        """Other paths, relayed as they are, with the idle timeout as their read timeout."""
        builder.client_stream = builder.upstream_stream = False
        headers = self._upstream_headers(request, builder.request_id, parsed=False)
        idle = Timeouts(idle_s=self.config.idle_timeout, alarms=exchange.connection.alarms)
        idle.start_idle()
        upstream: UpstreamExchange | None = None
        replica: Replica | None = None
        try:
            try:
                upstream, replica = await self._open_upstream(
                    request, request.body, headers, builder
                )
            except UpstreamFailure as failure:
                builder.fail(failure.outcome, failure.error_type, failure.status)
                self._respond_error(
                    exchange, builder, failure.status, failure.message, failure.err_type
                )
                return
            except asyncio.CancelledError:
                if idle.fired is None:
                    raise
                idle.absorb()
                builder.fail(Outcome.TIMEOUT, "read_timeout", 504)
                self._respond_error(
                    exchange,
                    builder,
                    504,
                    "The upstream did not answer in time (read timeout).",
                    "GatewayTimeout",
                )
                return
            exchange.start_block(
                upstream.status,
                upstream.reason,
                response_header_block(upstream.raw_headers, builder.request_id),
                upstream.content_length,
            )
            builder.http_status = upstream.status
            body_done = upstream.stream_body(self._client_writer(exchange, upstream, idle))
            try:
                await body_done
            except UpstreamError as exc:
                builder.fail(Outcome.UPSTREAM_ERROR, _upstream_error_type(exc), upstream.status)
                exchange.abort()  # headers are out: cut the connection, not a false end
                return
            except asyncio.CancelledError:
                if idle.fired is None:
                    raise
                idle.absorb()
                builder.fail(Outcome.TIMEOUT, "TimeoutError", upstream.status)
                exchange.abort()
                return
            builder.up_end_ns = builder.offset(_monotonic_ns())
            exchange.end()
            builder.down_end_ns = builder.offset(_monotonic_ns())
            if upstream.status >= 400:
                builder.fail(Outcome.HTTP_ERROR, f"http_{upstream.status}", upstream.status)
            # Not a no-op under mypyc: with no way to fall off the end of the try, mypy checks
            # the finally once, with `upstream` and `replica` still Optional. Otherwise its
            # second look (the fall-through, where both are set) is what mypyc compiles, and
            # the finally reads them as set: a cancellation before the upstream answered then
            # raised TypeError there, and left the replica's outstanding count one too high
            # (tests/test_compiled.py holds every compiled try whose finally reads what the
            # try assigns to having no fall-through).
            return
        finally:
            idle.disarm()
            if upstream is not None:
                self.pool.release(upstream)
            if replica is not None:
                replica.outstanding -= 1

    @staticmethod
    def _client_writer(
        exchange: ClientExchange, upstream: UpstreamExchange, idle: Timeouts
    ) -> Callable[[bytes, int], None]:
        """Body reads of a pass-through answer, written to the client as they come, the
        upstream paused while the client's buffer is full."""

        def write(data: bytes, at_ns: int) -> None:
            idle.last_ns = at_ns
            try:
                write_paced(exchange, upstream, data)
            except ConnectionResetError:
                upstream.connection.abort()

        return write

    # -- generation endpoints -------------------------------------------------------------

    def _prepare_generation(self, request: IncomingRequest, builder: RecordBuilder) -> _Generation:
        """Read a generation request (the record's model, max_tokens, stream flags, SLO class,
        shape, trace ids) and decide what goes upstream: the body (with usage asked for, or as
        a stream to assemble), the headers, the routing keys."""
        config = self.config
        body = request.body
        # The members the proxy reads, not the prompt (proxy/requesthead.py: a long prompt
        # decoded here would hold every stream on this loop). The paths that need the prompt
        # (assembling, prefix routing, capture) decode the body whole.
        parsed: Any = read_head(body)
        whole: Any = None
        gen = _Generation(body)
        if isinstance(parsed, dict):
            model = parsed.get("model")
            builder.model = (
                model
                if isinstance(model, str)
                and len(model) <= MAX_MODEL_NAME_LEN
                and model.isprintable()
                else None
            )
            max_tokens = parsed.get("max_completion_tokens", parsed.get("max_tokens"))
            if type(max_tokens) is int and 0 <= max_tokens <= MAX_TOKEN_COUNT:
                builder.attributes["request_max_tokens"] = str(max_tokens)
            # vLLM reads `stream` as pydantic does ("true", 1, ... stream too).
            stream, include, continuous = stream_usage_options(parsed)
            builder.client_stream = stream
            if stream:
                gen.plan = usage_plan(include, continuous, config.inject_usage)
                if gen.plan.modifies:
                    gen.upstream_body = request_with_usage(body, parsed, gen.plan)
            elif (
                config.assemble_nonstream
                and not parsed.get("use_beam_search")
                and isinstance(whole := read_whole(body), dict)
            ):
                gen.assemble = True
                gen.upstream_body = _dumps(
                    {
                        **whole,
                        "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                    }
                )
            if self._session_routing:
                gen.session_key = request.headers.get(config.session_header) or (
                    parsed.get("user") if isinstance(parsed.get("user"), str) else None
                )
            elif self._prefix_routing:
                whole = whole if whole is not None else read_whole(body)
                if isinstance(whole, dict):
                    gen.prefix_key = prompt_prefix_key(
                        whole, config.prefix_block_chars, config.prefix_block_tokens
                    )
            gen.tools_required = parsed.get("tool_choice") == "required"
        builder.upstream_stream = builder.client_stream or gen.assemble
        if gen.assemble:
            builder.attributes["assembled"] = "true"
        slo_class = self._slo_class(request, builder.model)
        if slo_class is not None:
            builder.attributes["slo_class"] = slo_class
        if self._hasher is not None and isinstance(parsed, dict) and whole is None:
            whole = read_whole(body)  # the capture's prefix hashes need the prompt
        if self._hasher is not None and isinstance(whole, dict):
            session = request.headers.get(config.session_header)
            if session is None and isinstance(parsed.get("user"), str):
                session = parsed["user"]
            if session is not None and not config.capture_text:
                session = self._hasher.pseudonym(session)  # ids are personal data too
            builder.shape = request_shape(
                whole,
                self._hasher,
                session_id=session,
                raw_body=body if config.capture_text else None,
            )
            if config.capture_text:
                builder.text_parts = []
        gen.headers = self._upstream_headers(
            request, builder.request_id, True, self._trace_context(request, builder)
        )
        return gen

    def _trace_context(self, request: IncomingRequest, builder: RecordBuilder) -> str | None:
        """The client's W3C trace context, kept on the record (ids, not content), and with
        OpenTelemetry on, the upstream's traceparent naming the sidecar's span (returned;
        None: the client's, if any, goes upstream as it came)."""
        traceparent = request.headers.get("traceparent")
        if traceparent is not None and _TRACEPARENT.fullmatch(traceparent):
            # Kept so that a tracing sink can parent its span; it is an id, not content.
            builder.attributes["traceparent"] = traceparent
            tracestate = request.headers.get("tracestate")
            if tracestate is not None and len(tracestate) <= 512 and tracestate.isprintable():
                builder.attributes["tracestate"] = tracestate
        else:
            traceparent = None
        if self.config.otel_traces:
            # The sidecar's CLIENT span is built after the fact (the OTel sink, from the
            # record), but the upstream must name it as its parent now: its id is chosen here,
            # sent in the upstream's traceparent, and the sink gives the span that id. vLLM's
            # own spans (--otlp-traces-endpoint) are then children of the sidecar's.
            trace_id = traceparent[3:35] if traceparent else secrets.token_hex(16)
            flags = traceparent[-2:] if traceparent else "01"
            span_id = secrets.token_hex(8)
            builder.attributes["span_ids"] = f"{trace_id}-{span_id}"
            return f"00-{trace_id}-{span_id}-{flags}"
        return None

    async def _generate(
        self,
        request: IncomingRequest,
        exchange: ClientExchange,
        endpoint: str,
        builder: RecordBuilder,
    ) -> None:
        config = self.config
        gen = self._prepare_generation(request, builder)
        timeouts = Timeouts.for_generation(
            config, builder.upstream_stream, exchange.connection.alarms
        )
        upstream: UpstreamExchange | None = None
        replica: Replica | None = None
        completed = False
        try:
            try:
                upstream, replica = await self._open_upstream(
                    request,
                    gen.upstream_body,
                    gen.headers,
                    builder,
                    session_key=gen.session_key,
                    prefix_key=gen.prefix_key,
                )
            except UpstreamFailure as failure:
                builder.fail(failure.outcome, failure.error_type, failure.status)
                self._respond_error(
                    exchange, builder, failure.status, failure.message, failure.err_type
                )
                return
            if upstream.status in _VALIDATION_STATUSES and gen.rewritten:
                # The replica refused the body the proxy rewrote (usage injected, streaming for
                # an assembled answer). Its message may describe that body (vLLM: "<dict of 7
                # items>" for the client's 6): ask again with the client's own, so that the
                # client reads vLLM's answer to what it sent. A refusal generated nothing.
                await upstream.read_body(MAX_NON_SSE_BODY)
                self.pool.release(upstream)
                upstream = None
                replica.outstanding -= 1
                replica = None
                gen.assemble = False
                builder.upstream_stream = builder.client_stream
                builder.attributes.pop("assembled", None)
                upstream, replica = await self._open_upstream(
                    request,
                    request.body,
                    gen.headers,
                    builder,
                    session_key=gen.session_key,
                    prefix_key=gen.prefix_key,
                )
            # Answered: nothing reads the request again. Held for the whole stream, the body,
            # its parsed form and the copy with usage injected came to 3x the prompt per
            # in-flight stream (310 KiB each at a 100 KB prompt; tracemalloc), the header
            # maps to ~1.5 KiB.
            request.release()
            gen.release()
            await self._relay_answer(exchange, upstream, endpoint, builder, gen, timeouts)
            completed = True
            # No way out of this try but a return or a raise: see _pass_through's.
            return
        except asyncio.CancelledError:
            fired = timeouts.fired
            if fired is None:
                raise  # the client disconnected: handled (and re-raised) by `handle`
            timeouts.absorb()
            if upstream is not None:
                # Stop the relay before the error tail: a read arriving while the tail drains
                # would otherwise put an event after [DONE].
                self.pool.close_exchange(upstream)
                upstream = None
            await self._answer_timeout(exchange, endpoint, builder, fired)
            return
        except UpstreamFailure as failure:
            if upstream is not None:
                self.pool.close_exchange(upstream)  # as above: nothing after the error tail
                upstream = None
            await self._fail_open(
                exchange,
                endpoint,
                builder,
                failure.outcome,
                failure.error_type,
                failure.status,
                failure.message,
                failure.err_type,
            )
            return
        except ConnectionResetError:
            # Writing to the client failed: the client is gone (`handle` records that).
            raise
        except UpstreamError as exc:
            await self._fail_open(
                exchange,
                endpoint,
                builder,
                Outcome.UPSTREAM_ERROR,
                _upstream_error_type(exc),
                502,
                "The upstream connection broke mid-response.",
                "BadGateway",
            )
            return
        finally:
            timeouts.disarm()
            if upstream is not None:
                if completed:
                    self.pool.release(upstream)
                else:
                    # Closing (not releasing) drops the connection, so vLLM sees the disconnect
                    # and aborts the request, freeing its KV cache.
                    self.pool.close_exchange(upstream)
            if replica is not None:
                replica.outstanding -= 1

    def _relay_answer(
        self,
        exchange: ClientExchange,
        upstream: UpstreamExchange,
        endpoint: str,
        builder: RecordBuilder,
        gen: _Generation,
        timeouts: Timeouts,
    ) -> Coroutine[Any, Any, None]:
        """The replica's answer to a generation request, by its kind: an error or any body
        that is not a stream, relayed whole; a stream assembled into one JSON answer for a
        client that did not ask to stream; a stream, relayed and measured read by read.
        Returns the relay to await (a plain function choosing it, not a coroutine awaiting
        it: every stream in flight holds one coroutine less, ~0.3 KiB)."""
        timeouts.start_idle()
        builder.http_status = upstream.status
        coding = upstream.header(b"content-encoding")
        if coding is not None and coding.strip().lower() not in ("", "identity"):
            # Asked for identity (`_upstream_headers`): a compressed answer can be neither
            # measured nor given an error event the client could read. Refused whole.
            raise UpstreamFailure(
                Outcome.UPSTREAM_ERROR,
                "content_encoding",
                502,
                f"The upstream answered with Content-Encoding: {coding[:32]!r} although "
                "the sidecar asked for none; it cannot measure a compressed answer.",
            )
        content_type = upstream.header(b"content-type") or ""
        if upstream.status != 200 or not content_type.startswith("text/event-stream"):
            timeouts.first_token()  # no stream: the total timeout alone bounds it
            return self._relay_whole(exchange, upstream, builder)
        if gen.assemble:
            return self._assemble(
                exchange, upstream, endpoint, builder, timeouts, gen.tools_required
            )
        # Held for the events that came with the upstream's head (`MeteredRead.start`).
        exchange.start_block(
            200,
            upstream.reason,
            response_header_block(upstream.raw_headers, builder.request_id),
            None,
            hold=True,
        )
        upstream.raw_headers = []  # rendered, not read again: a stream in flight lets go
        return self._relay_stream(upstream, exchange, builder, gen.plan, timeouts)

    async def _answer_timeout(
        self, exchange: ClientExchange, endpoint: str, builder: RecordBuilder, fired: str
    ) -> None:
        """A generation timeout fired (``fired`` names it): the client gets the error as its
        answer, or as an error event closing its stream."""
        if exchange.prepared and exchange.write_buffer_size:
            # Bytes were still waiting for the client when the timeout fired: the relay was
            # held up by a client that stopped reading, not by the upstream. It cannot be
            # sent an error event either: cut it loose.
            builder.fail(Outcome.TIMEOUT, "client_stalled")
            exchange.abort()
            return
        await self._fail_open(
            exchange,
            endpoint,
            builder,
            Outcome.TIMEOUT,
            fired,
            504,
            f"The upstream did not answer in time ({fired.replace('_', ' ')}).",
            "GatewayTimeout",
        )

    async def _fail_open(
        self,
        exchange: ClientExchange,
        endpoint: str,
        builder: RecordBuilder,
        outcome: Outcome,
        error_type: str,
        status: int,
        message: str,
        err_type: str,
    ) -> None:
        """End a failed request the way the client can understand: a JSON error before any
        byte went out, else an error event and [DONE] on the open stream."""
        builder.fail(outcome, error_type, status)
        if builder.up_end_ns is None:
            builder.up_end_ns = builder.offset(_monotonic_ns())
        if exchange.client_gone:
            raise ConnectionResetError("the client is gone")
        if not exchange.prepared:
            self._respond_error(exchange, builder, status, message, err_type)
            return
        exchange.write(error_event(endpoint, message, err_type, status) + DONE_EVENT)
        try:
            # Bounded: a client that does not read would otherwise hold this request forever.
            await asyncio.wait_for(exchange.drain(), ERROR_TAIL_WRITE_S)
        except (asyncio.TimeoutError, ConnectionError):
            exchange.abort()
        else:
            exchange.end()
        builder.down_end_ns = builder.offset(_monotonic_ns())

    async def _relay_whole(
        self, exchange: ClientExchange, upstream: UpstreamExchange, builder: RecordBuilder
    ) -> None:
        """A non-SSE answer (a non-streaming response, or an error before the stream)."""
        try:
            data = await upstream.read_body(MAX_NON_SSE_BODY)
        except UpstreamError as exc:
            if exc.kind == "too_large":
                raise UpstreamFailure(
                    Outcome.UPSTREAM_ERROR,
                    "oversized_body",
                    502,
                    f"The upstream's response body exceeds the sidecar's "
                    f"limit of {MAX_NON_SSE_BODY} bytes.",
                ) from None
            raise
        builder.up_end_ns = builder.offset(_monotonic_ns())
        try:
            obj: Any = json.loads(data)
        except (ValueError, RecursionError):
            obj = None
        if 200 <= upstream.status < 300 and not isinstance(obj, dict):
            # A success whose body is not a JSON object (cut short, garbage): the client could
            # not use it; say so in vLLM's shape rather than pass a broken 200 on.
            raise UpstreamFailure(
                Outcome.UPSTREAM_ERROR,
                "malformed_body",
                502,
                "The upstream sent a malformed response body.",
            )
        exchange.start_block(
            upstream.status,
            upstream.reason,
            response_header_block(upstream.raw_headers, builder.request_id),
            len(data),
            data,
        )
        exchange.end()
        builder.down_end_ns = builder.offset(_monotonic_ns())
        if upstream.status >= 400:
            error = ErrorInfo.from_obj(obj.get("error")) if isinstance(obj, dict) else None
            builder.fail(
                Outcome.HTTP_ERROR, safe_error_type(error, upstream.status), upstream.status
            )
        elif isinstance(obj, dict):
            fingerprint = obj.get("system_fingerprint")
            if isinstance(fingerprint, str):
                self._fingerprints[builder.replica] = fingerprint
            for key, name in (("model", "response_model"), ("id", "response_id")):
                value = obj.get(key)
                if isinstance(value, str) and len(value) <= 256 and value.isprintable():
                    builder.attributes[name] = value
            usage = Usage.from_obj(obj.get("usage"))
            if usage is not None:
                builder.n_in, builder.n_out = usage.prompt_tokens, usage.completion_tokens
                builder.n_cached = usage.cached_tokens
                builder.token_source = TokenSource.USAGE_TOTAL
            choices = obj.get("choices")
            if isinstance(choices, list) and choices and isinstance(choices[0], dict):
                reason = choices[0].get("finish_reason")
                builder.finish_reason = reason if isinstance(reason, str) else None
            if builder.text_parts is not None and isinstance(choices, list):
                builder.text_parts.append(choices_text(choices))
            builder.engine = _engine_timing(obj.get("metrics")) or builder.engine

    async def _relay_stream(
        self,
        upstream: UpstreamExchange,
        exchange: ClientExchange,
        builder: RecordBuilder,
        plan: UsagePlan,
        timeouts: Timeouts,
    ) -> None:
        """The streaming relay: whatever a read yields for the client goes out at once in one
        write, stamped on the client side with that write's instant (see `MeteredRead`)."""
        meter = StreamMeter(
            builder.arrive_ns,
            plan,
            max_event_bytes=self.config.max_event_bytes,
            max_events=self.config.max_stream_events,
            keep_text=builder.text_parts is not None,
            fingerprint=self._fingerprints.get(builder.replica),
        )
        run = MeteredRead(upstream, meter, builder, timeouts, exchange)
        try:
            # `MeteredRead.body`'s steps, taken here: one coroutine fewer per stream in flight.
            try:
                await run.start()
            except UpstreamError as exc:
                run.end(exc)
            else:
                run.end(None)
        finally:
            run.settle()
            self.rewritten_events += meter.rewritten
            if meter.fingerprint is not None:
                self._fingerprints[builder.replica] = meter.fingerprint
        if meter.fatal is not None:
            raise UpstreamFailure(*meter.fatal)
        await exchange.drain()
        exchange.end()
        builder.down_end_ns = builder.offset(_monotonic_ns())

    async def _assemble(
        self,
        exchange: ClientExchange,
        upstream: UpstreamExchange,
        endpoint: str,
        builder: RecordBuilder,
        timeouts: Timeouts,
        tool_choice_required: bool,
    ) -> None:
        """Stream from the upstream, answer the non-streaming client with one JSON body."""
        assembler = StreamAssembler(endpoint, tool_choice_required=tool_choice_required)
        meter = StreamMeter(
            builder.arrive_ns,
            forward=False,
            max_event_bytes=self.config.max_event_bytes,
            max_events=self.config.max_stream_events,
            keep_text=builder.text_parts is not None,
            assembler=assembler,
        )
        await MeteredRead(upstream, meter, builder, timeouts, None).body()
        failure = meter.failure
        headers = [("Content-Type", "application/json"), (REQUEST_ID_HEADER, builder.request_id)]
        if failure is not None and failure.outcome is Outcome.HTTP_ERROR:
            # The upstream's own error event: the client gets it as the JSON error it is.
            body = _json_error_body(failure.status, failure.message, failure.err_type)
            exchange.start(failure.status, None, headers, len(body), body)
        elif meter.fatal is not None:
            raise UpstreamFailure(*meter.fatal)
        else:
            body = assembler.body()
            exchange.start(200, None, headers, len(body), body)
        exchange.end()
        builder.down_end_ns = builder.offset(_monotonic_ns())


class _Generation:
    """What `Proxy._prepare_generation` decided for one generation request."""

    __slots__ = (
        "upstream_body",
        "plan",
        "assemble",
        "session_key",
        "prefix_key",
        "tools_required",
        "headers",
    )

    def __init__(self, body: bytes) -> None:
        self.upstream_body = body  # what goes upstream: the client's body, or a rewrite of it
        self.plan: UsagePlan = NO_CHANGE
        self.assemble = False  # a non-streaming request asked for as a stream, then assembled
        self.session_key: str | None = None
        self.prefix_key: bytes | None = None
        self.tools_required = False  # tool_choice "required" (the assembler's arguments)
        self.headers = b""  # the upstream's header lines (`Proxy._upstream_headers`)

    @property
    def rewritten(self) -> bool:
        return self.plan.modifies or self.assemble

    def release(self) -> None:
        """Sent and answered: the body and headers are not needed any more."""
        self.upstream_body = b""
        self.headers = b""


# Statuses of a request refused for its content (vLLM answers validation errors 400; 422 is
# FastAPI's own): resent unmodified when the proxy had rewritten it.
_VALIDATION_STATUSES: Final = frozenset({400, 422})

_CONNECT_ERROR_NAMES: Final = {
    "connect_refused": "ClientConnectorError",
    # A certificate that does not verify (SSL_CERT_FILE: docs/deploy.md), another TLS failure.
    "tls_certificate": "ClientConnectorCertificateError",
    "tls_handshake": "ClientConnectorSSLError",
    "connect_timeout": "ConnectionTimeoutError",
    "disconnected": "ServerDisconnectedError",
}


def _upstream_error_type(exc: UpstreamError) -> str:
    """The record's cause for a connection that broke mid-response (names kept from the
    aiohttp client this replaced, so that dashboards and alerts keep matching)."""
    if exc.kind == "disconnected":
        return "upstream_ClientPayloadError"
    return f"upstream_{exc.kind}"


def _address(url: str) -> tuple[str, int, str, str, bool]:
    """(host, port, Host header, path prefix, TLS) of a replica's base URL."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if tls else 80)
    return host, port, parts.netloc, parts.path.rstrip("/"), tls


def _json_error_body(status: int, message: str, err_type: str) -> bytes:
    return json.dumps(error_body(message, err_type, status)).encode("utf-8")


_TRACEPARENT: Final = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _engine_timing(obj: Any) -> EngineTiming | None:
    if not isinstance(obj, dict):
        return None
    return EngineTiming.from_dict(obj)
