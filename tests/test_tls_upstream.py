"""An https:// upstream, end to end over real sockets on 127.0.0.1 (sidecar/proxy/upstream.py).

The proxy reaches a TLS upstream through uvloop's TLS transport with the context of
`ssl.create_default_context()`: the system's trust store, which OpenSSL lets an operator replace
with ``SSL_CERT_FILE`` (how a private CA is trusted). The proxy makes that context when it is
made (with an https:// upstream), so each test sets the variable (monkeypatch) before that. Reads
of a TLS connection are stamped when the proxy reads them (`ArrivalBatch`), never by the kernel
(`rxstamp.StampedTransport` is for plain TCP only), and are not counted as kernel reads that
lost their stamp (``upstream_reads_unstamped``).

The certificates are made once for the module with the ``openssl`` command: a private CA, a
leaf it signed for IP 127.0.0.1, a leaf it signed for another name, and an unrelated CA. The
upstream is `RawUpstream` on a TLS listener: it writes the bytes a test gives it, and counts
the connections whose handshake completed and the requests read on them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import aiohttp
import pytest
from reliability_helpers import (
    RawAnswer,
    RawUpstream,
    assert_json_error,
    assert_stream_error,
    proxy_to,
    settle,
)
from test_meter import INJECTED

from sidecar import clock
from sidecar.proxy import rxstamp
from sidecar.record import Outcome, RequestRecord, TokenSource

CHAT = "/v1/chat/completions"
# A client that asks for usage on every chunk itself: the proxy injects nothing, so nothing is
# cut out of what it relays, and the upstream's bytes reach the client as they were sent.
BODY = json.dumps(
    {
        "model": "M",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 3,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
).encode()
# What vLLM streams for it (tests/test_meter.py): role (0 tokens), "Hello" (2), "!" (3 in all),
# the usage chunk (12 prompt tokens), [DONE].
ROLE, HELLO, BANG, USAGE, DONE = INJECTED
STREAM = b"".join(INJECTED)

HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
END = b"0\r\n\r\n"

# One xdist worker runs the whole module (pyproject.toml: --dist loadgroup): its
# certificates (`pki`, module-scoped) are made once.
pytestmark = pytest.mark.xdist_group("test_tls_upstream")

SPIN_NS = 60_000_000  # a loop kept busy this long: a read stamp and an arrival stamp differ


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk, as uvicorn frames each event."""
    return b"%x\r\n%s\r\n" % (len(data), data)


# -- certificates ----------------------------------------------------------------------------

OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[leaf_127]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[leaf_elsewhere]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:elsewhere.invalid
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""
NEW_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


@dataclass(frozen=True)
class Pki:
    ca: Path  # the private CA that signed both leaves
    other_ca: Path  # a CA that signed neither
    server: ssl.SSLContext  # the upstream's side, with the leaf for IP 127.0.0.1
    misnamed: ssl.SSLContext  # the upstream's side, with the leaf for elsewhere.invalid


def openssl(directory: Path, *args: str) -> None:
    done = subprocess.run(
        ["openssl", *args], cwd=directory, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"openssl {' '.join(args)}: {done.stderr}"


def server_context(directory: Path, leaf: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(directory / f"{leaf}.pem", directory / f"{leaf}.key")
    return context


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The module's certificates (P-256 keys, valid two days), made off the event loop."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes the test certificates: not on PATH")
    directory = tmp_path_factory.mktemp("pki")
    (directory / "openssl.cnf").write_text(OPENSSL_CONFIG)
    for ca in ("ca", "other_ca"):
        openssl(
            directory,
            *("req", "-x509", "-config", "openssl.cnf", "-extensions", "ca", *NEW_EC_KEY),
            *("-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN={ca}"),
        )
    for serial, leaf in enumerate(("leaf_127", "leaf_elsewhere"), start=1):
        openssl(
            directory,
            *("req", "-new", "-config", "openssl.cnf", *NEW_EC_KEY, "-subj", f"/CN={leaf}"),
            *("-keyout", f"{leaf}.key", "-out", f"{leaf}.csr"),
        )
        openssl(
            directory,
            *("x509", "-req", "-in", f"{leaf}.csr", "-CA", "ca.pem", "-CAkey", "ca.key"),
            *("-set_serial", str(serial), "-days", "2", "-out", f"{leaf}.pem"),
            *("-extfile", "openssl.cnf", "-extensions", leaf),
        )
    return Pki(
        ca=directory / "ca.pem",
        other_ca=directory / "other_ca.pem",
        server=server_context(directory, "leaf_127"),
        misnamed=server_context(directory, "leaf_elsewhere"),
    )


def trust(monkeypatch: pytest.MonkeyPatch, ca: Path | None) -> None:
    """The proxy's trust store from now on: ``ca`` alone (None: the system's)."""
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    if ca is None:
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    else:
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))


# -- the upstream and the client -------------------------------------------------------------


class TlsUpstream(RawUpstream):
    """`RawUpstream` behind TLS; its ``connections`` count completed handshakes only."""

    def __init__(self, answer: RawAnswer, context: ssl.SSLContext) -> None:
        super().__init__(answer)
        self.context = context

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context)
        return f"https://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


def streaming(events: Sequence[bytes], heads: list[bytes] | None = None) -> RawAnswer:
    """An answer that streams ``events``, one chunk each, a little apart in time, and keeps
    the connection; the request heads go to ``heads``."""

    async def answer(_c: int, _n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        if heads is not None:
            heads.append(head)
        writer.write(HEAD)
        for event in events:
            writer.write(chunk(event))
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.write(END)
        return True

    return answer


async def post(session: aiohttp.ClientSession, url: str, request_id: str) -> tuple[int, bytes]:
    async with session.post(
        url + CHAT,
        data=BODY,
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
        timeout=aiohttp.ClientTimeout(total=10),
    ) as response:
        return response.status, await response.read()


def assert_in_order(offsets: Sequence[int], start: int, end: int | None) -> None:
    """Non-decreasing, and within [start, end]."""
    assert end is not None and offsets, (offsets, end)
    assert start <= offsets[0] and offsets[-1] <= end, (start, list(offsets), end)
    assert all(a <= b for a, b in pairwise(offsets)), list(offsets)


# -- the tests -------------------------------------------------------------------------------


async def test_a_stream_from_an_https_upstream_reaches_the_client_whole_and_is_measured(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trusted through SSL_CERT_FILE, the upstream gets the client's request (its length: no
    usage option injected), the client gets the upstream's body byte for byte, and the record
    is ok, with usage's token counts and server-side stamps in order within the request."""
    trust(monkeypatch, pki.ca)
    heads: list[bytes] = []
    upstream = TlsUpstream(streaming(INJECTED, heads), pki.server)
    async with (
        upstream as url,
        proxy_to([url], engine_scrape_interval="0") as p,
        aiohttp.ClientSession() as session,
    ):
        status, body = await post(session, p.url, "tls-stream")
        (record,) = await settle(p.server, p.records, 1)
    assert status == 200
    assert body == STREAM
    (head,) = heads
    assert f"content-length: {len(BODY)}\r\n".encode() in head.lower()
    assert (upstream.connections, upstream.requests) == (1, 1)
    assert record.request_id == "tls-stream"
    assert record.outcome is Outcome.OK and record.error_type is None
    assert record.http_status == 200
    assert (record.n_in, record.n_out) == (12, 3)
    assert record.token_source is TokenSource.USAGE
    server = record.server
    assert server is not None
    assert server.tokens == [2, 1] and record.client.tokens == [2, 1]
    assert server.start_ns >= 0
    assert_in_order(server.offsets_ns, server.start_ns, server.end_ns)
    assert_in_order(record.client.offsets_ns, 0, record.client.end_ns)


@pytest.mark.parametrize(
    "scheme",
    [
        "https",
        pytest.param(
            "http",
            marks=pytest.mark.skipif(
                not rxstamp.SUPPORTED, reason="kernel receive stamps: Linux (the contrast)"
            ),
        ),
    ],
)
async def test_reads_from_an_https_upstream_are_stamped_when_read_not_by_the_kernel(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """The upstream sends "!" and then keeps the loop it shares with the proxy busy for
    SPIN_NS. Over TLS the proxy stamps "!" when it reads it, after the spin: its server-side
    stamp comes SPIN_NS or more after Hello's, and ``upstream_reads_unstamped`` in /replicas
    stays 0 (these are not kernel-stamped reads that lost their stamp). The same exchange
    over plain TCP, the contrast that shows the test can tell them apart: the kernel stamped
    "!" when it arrived, before the spin."""
    trust(monkeypatch, pki.ca)
    hello_relayed, bang_relayed = asyncio.Event(), asyncio.Event()

    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(HEAD + chunk(ROLE) + chunk(HELLO))
        await writer.drain()
        await hello_relayed.wait()  # the proxy read Hello and relayed it
        writer.write(chunk(BANG))  # out on the socket at once (uvloop writes before returning)
        end = clock.monotonic_ns() + SPIN_NS
        while clock.monotonic_ns() < end:
            pass  # the loop is busy: nothing reads "!" meanwhile
        # The rest only once "!" was read alone: a read of several segments carries the
        # kernel's stamp of the last one (rxstamp.py), which would be after the spin.
        await bang_relayed.wait()
        writer.write(chunk(USAGE) + chunk(DONE) + END)
        return True

    upstream = TlsUpstream(answer, pki.server) if scheme == "https" else RawUpstream(answer)
    async with (
        upstream as url,
        proxy_to([url], engine_scrape_interval="0") as p,
        aiohttp.ClientSession() as session,
    ):
        assert url.startswith(f"{scheme}://")
        async with session.post(
            p.url + CHAT,
            data=BODY,
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=10),
        ) as response:
            got = b""
            while HELLO not in got:
                got += await response.content.readany()
            hello_relayed.set()
            while BANG not in got:
                got += await response.content.readany()
            bang_relayed.set()
            got += await response.read()
        (record,) = await settle(p.server, p.records, 1)
        async with session.get(p.server.admin_url + "/replicas") as replicas:
            unstamped = (await replicas.json())["upstream_reads_unstamped"]
    assert got == STREAM
    assert record.outcome is Outcome.OK
    server = record.server
    assert server is not None and server.tokens == [2, 1]
    hello_at, bang_at = server.offsets_ns
    if scheme == "https":
        assert bang_at - hello_at >= SPIN_NS, (hello_at, bang_at)
        assert unstamped == 0
    else:
        assert bang_at - hello_at < SPIN_NS // 2, (hello_at, bang_at)
    # The client side is stamped when the proxy wrote "!": after the spin, either way.
    client_hello, client_bang = record.client.offsets_ns
    assert client_bang - client_hello >= SPIN_NS


@pytest.mark.parametrize(
    "case",
    [
        "a CA the proxy does not trust",
        "only the system's CAs trusted",
        "a certificate for another name",
    ],
)
async def test_an_upstream_certificate_that_does_not_verify_fails_before_the_request_leaves(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Certificate verification is on, the name (IP 127.0.0.1) included: the handshake fails,
    the request never reaches the upstream, the client gets a 502 in vLLM's shape at once, and
    the one record says the connection failed."""
    if case == "a CA the proxy does not trust":
        trust(monkeypatch, pki.other_ca)
        context = pki.server
    elif case == "only the system's CAs trusted":
        trust(monkeypatch, None)
        context = pki.server
    else:
        trust(monkeypatch, pki.ca)
        context = pki.misnamed
    upstream = TlsUpstream(streaming(INJECTED), context)
    async with (
        upstream as url,
        proxy_to([url], engine_scrape_interval="0") as p,
        aiohttp.ClientSession() as session,
    ):
        status, body = await post(session, p.url, "untrusted")
        (record,) = await settle(p.server, p.records, 1)
    error = assert_json_error(status, body, 502)
    assert "could not connect" in error["message"]
    assert (upstream.connections, upstream.requests) == (0, 0)
    assert record.outcome is Outcome.UPSTREAM_ERROR
    assert record.error_type == "connect_failed:ClientConnectorCertificateError"
    assert record.http_status == 502
    assert record.n_out is None and record.server is not None and not record.server.offsets_ns


async def test_the_trust_store_is_read_when_the_proxy_starts(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CA bundle is read when the proxy is made, not at its first TLS connection (there,
    on the event loop, the ~35-40 ms of reading it would stall every stream): a trust store
    changed after the start is not seen (docs/deploy.md: a new CA needs a restart)."""
    trust(monkeypatch, pki.ca)
    upstream = TlsUpstream(streaming(INJECTED), pki.server)
    async with (
        upstream as url,
        proxy_to([url], engine_scrape_interval="0") as p,
        aiohttp.ClientSession() as session,
    ):
        trust(monkeypatch, pki.other_ca)  # read at the first connection, this would fail it
        status, body = await post(session, p.url, "after-start")
        (record,) = await settle(p.server, p.records, 1)
    assert status == 200 and body == STREAM
    assert record.outcome is Outcome.OK


async def test_sequential_requests_to_an_https_upstream_share_one_tls_connection(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keep-alive over TLS: each request waits for the one before to be recorded (its
    connection back in the pool), and all three go over one handshake."""
    trust(monkeypatch, pki.ca)
    upstream = TlsUpstream(streaming(INJECTED), pki.server)
    records: list[RequestRecord] = []
    async with (
        upstream as url,
        proxy_to([url], engine_scrape_interval="0") as p,
        aiohttp.ClientSession() as session,
    ):
        for i in range(3):
            assert await post(session, p.url, f"r{i}") == (200, STREAM)
            records = await settle(p.server, p.records, i + 1)
        assert p.server.proxy.pool.open_connections == 1
    assert (upstream.connections, upstream.requests) == (1, 3)
    assert [r.outcome for r in records] == [Outcome.OK] * 3


@pytest.mark.parametrize("how", ["abort", "close"])
async def test_an_https_upstream_that_drops_the_connection_mid_stream_ends_the_stream_with_an_error(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The upstream sends Hello, then ends the connection with the HTTP body unfinished (an
    orderly TLS close, or an abort without close_notify): the client keeps what came, then
    gets an error event (502) and [DONE]; the one record is an upstream error with Hello's
    tokens counted."""
    trust(monkeypatch, pki.ca)

    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(HEAD + chunk(ROLE) + chunk(HELLO))
        await writer.drain()
        if how == "abort":
            writer.transport.abort()
        return False  # RawUpstream closes the connection

    upstream = TlsUpstream(answer, pki.server)
    async with (
        upstream as url,
        proxy_to([url], engine_scrape_interval="0") as p,
        aiohttp.ClientSession() as session,
    ):
        status, body = await post(session, p.url, "cut")
        (record,) = await settle(p.server, p.records, 1)
    assert body.startswith(ROLE + HELLO)
    assert_stream_error(status, body, 502)
    assert record.outcome is Outcome.UPSTREAM_ERROR
    assert record.error_type == "upstream_ClientPayloadError"
    server = record.server
    assert server is not None and server.tokens == [2]


async def test_an_https_upstream_that_answers_and_closes_the_connection_is_relayed_whole(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upstream that does not keep connections (``Connection: close``, an orderly TLS
    close right after the body's last chunk): the answer is whole and ok, and the next
    request opens a new connection."""
    trust(monkeypatch, pki.ca)

    async def answer(_c: int, _n: int, _head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(HEAD.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1))
        for event in INJECTED:
            writer.write(chunk(event))
            await writer.drain()
        writer.write(END)
        return False  # closed by RawUpstream: close_notify follows the last chunk at once

    upstream = TlsUpstream(answer, pki.server)
    async with (
        upstream as url,
        proxy_to([url], engine_scrape_interval="0") as p,
        aiohttp.ClientSession() as session,
    ):
        answers = [await post(session, p.url, f"r{i}") for i in range(2)]
        records = await settle(p.server, p.records, 2)
    assert answers == [(200, STREAM)] * 2
    assert [r.outcome for r in records] == [Outcome.OK] * 2
    assert (upstream.connections, upstream.requests) == (2, 2)
