"""The proxy's request handling on its own (a socketpair stands in for the
sandbox's side; the only server is the test's, on 127.0.0.1). The container
tests in test_egress_proxy.py cover it bound inside a real sandbox."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_runner import proxy as proxy_module
from sandbox_runner.egress import parse_destination
from sandbox_runner.proxy import EgressProxy
from tests.sandbox_runner.test_egress_proxy import _Server
from tests.sandbox_runner.test_tls import client_hello, hello_with_hidden_name, split_into_records


@pytest.fixture
def upstream():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(4096)
                conn.sendall(b"echo:" + data)

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def ask(proxy: EgressProxy, payload: bytes) -> bytes:
    mine, theirs = socket.socketpair()
    handler = threading.Thread(target=proxy._handle, args=(theirs,))
    handler.start()
    mine.sendall(payload)
    mine.shutdown(socket.SHUT_WR)
    answer = b""
    while chunk := mine.recv(4096):
        answer += chunk
    handler.join(timeout=5)
    mine.close()
    return answer


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"GET /relative HTTP/1.1\r\nHost: x\r\n\r\n", "bad_destination"),
        (b"CONNECT 127.0.0.1:1 HTTP/1.1\r\n\r\n", "not_allowlisted"),
        (b"GET http://127.0.0.2:80/ HTTP/1.1\r\n\r\n", "not_allowlisted"),
    ],
)
def test_every_refused_attempt_is_reported_once(upstream, payload, reason):
    reports = []
    proxy = EgressProxy([parse_destination(f"127.0.0.1:{upstream}")], report=reports.append)
    answer = ask(proxy, payload)
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert [r.reason for r in reports] == [reason]
    assert not reports[0].allowed


CUT = "CONNECT evil.example:443 HTTP/1.1"


@pytest.mark.parametrize(
    ("payload", "line"),
    [
        (CUT.encode() + b"\r\nHost: x\r\n", CUT),
        (b"GET http://evil.example/ HTTP/1.1\n\n", "GET http://evil.example/ HTTP/1.1"),
        (CUT.encode() + b"\r\nX: " + b"a" * 20_000, CUT),
    ],
    ids=["closed_before_the_end", "bare_newlines", "too_long"],
)
def test_a_head_never_finished_is_still_an_attempt_on_record(upstream, payload, line):
    """A request head cut short (sent, then closed), ended by bare newlines or longer
    than MAX_HEADER went unrecorded: an attempt to reach evil.example left no trace.
    Each is now refused as bad_request, with the first line it sent; a connection that
    sent nothing at all is no request and stays unrecorded."""
    reports = []
    proxy = EgressProxy([parse_destination(f"127.0.0.1:{upstream}")], report=reports.append)
    answer = ask(proxy, payload)
    assert answer.startswith(b"HTTP/1.1 400 ") or answer == b""
    assert [(r.allowed, r.reason, r.host, r.port) for r in reports] == [
        (False, "bad_request", line, 0)
    ]
    ask(proxy, b"")
    assert len(reports) == 1


def test_an_allowed_connect_tunnels_to_the_resolved_address(upstream):
    reports = []
    proxy = EgressProxy([parse_destination(f"127.0.0.1:{upstream}")], report=reports.append)
    answer = ask(proxy, f"CONNECT 127.0.0.1:{upstream} HTTP/1.1\r\n\r\nhello".encode())
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\necho:hello"
    assert [(r.allowed, r.address, r.port) for r in reports] == [(True, "127.0.0.1", upstream)]


def test_an_allowed_plain_request_goes_out_in_origin_form(upstream):
    reports = []
    proxy = EgressProxy([parse_destination(f"127.0.0.1:{upstream}")], report=reports.append)
    answer = ask(
        proxy,
        f"GET http://127.0.0.1:{upstream}/p?q=1 HTTP/1.1\r\nAccept: */*\r\n\r\n".encode(),
    )
    assert (
        answer
        == (
            f"echo:GET /p?q=1 HTTP/1.1\r\nAccept: */*\r\nHost: 127.0.0.1:{upstream}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
    )
    assert len(reports) == 1 and reports[0].allowed


@pytest.fixture
def order(monkeypatch):
    """What happened, in order: the proxy's reports and its outbound connections."""
    steps: list[str] = []
    connect = proxy_module.socket.create_connection

    def counted(*args, **kwargs):
        steps.append("connect")
        return connect(*args, **kwargs)

    monkeypatch.setattr(proxy_module.socket, "create_connection", counted)
    return steps


def test_an_allowed_attempt_is_on_record_before_the_proxy_connects(upstream, order):
    proxy = EgressProxy(
        [parse_destination(f"127.0.0.1:{upstream}")], report=lambda d: order.append("report")
    )
    answer = ask(proxy, f"CONNECT 127.0.0.1:{upstream} HTTP/1.1\r\n\r\nhello".encode())
    assert answer.endswith(b"echo:hello")
    assert order == ["report", "connect"]


def test_an_attempt_that_cannot_be_recorded_is_refused_before_connecting(upstream, order):
    def report(decision):
        raise RuntimeError("the audit log is down")

    proxy = EgressProxy([parse_destination(f"127.0.0.1:{upstream}")], report=report)
    answer = ask(proxy, f"CONNECT 127.0.0.1:{upstream} HTTP/1.1\r\n\r\nhello".encode())
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert b"could not be recorded" in answer
    assert order == []  # nothing went out


def test_a_plain_request_goes_to_the_checked_host_only(upstream):
    """A forged Host (another virtual host behind the allowed address) is replaced by
    the checked one, and keep-alive is refused: the server closes after this request."""
    proxy = EgressProxy([parse_destination(f"127.0.0.1:{upstream}")], report=lambda d: None)
    answer = ask(
        proxy,
        (
            f"GET http://127.0.0.1:{upstream}/a HTTP/1.1\r\nHost: internal.example\r\n"
            "Connection: keep-alive\r\nProxy-Connection: keep-alive\r\nX-Kept: yes\r\n\r\n"
        ).encode(),
    )
    assert (
        answer
        == (
            f"echo:GET /a HTTP/1.1\r\nX-Kept: yes\r\nHost: 127.0.0.1:{upstream}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
    )


# The reviewer's payload: one request whose header line hides, behind bare LFs, a second
# request to another virtual host (servers that end a line at a bare LF read two).
SMUGGLED = (
    "GET http://127.0.0.1:{port}/ HTTP/1.0\r\n"
    "X: a\nConnection: keep-alive\n\n"
    "GET /secret HTTP/1.1\nHost: other-tenant.example\nConnection: close\n\n"
    "\r\n\r\n"
)


@pytest.mark.parametrize(
    "head",
    [
        SMUGGLED,
        "GET http://127.0.0.1:{port}/ HTTP/1.1\nHost: other-tenant.example\r\n\r\n",
        "GET http://127.0.0.1:{port}/ HTTP/1.1\r\nX: a\rHost: other-tenant.example\r\n\r\n",
        "GET http://127.0.0.1:{port}/ HTTP/1.1\r\nX: a\x00b\r\n\r\n",
        "GET http://127.0.0.1:{port}/ HTTP/1.1\r\nX: a\r\n b\r\n\r\n",  # obs-fold
        "GET http://127.0.0.1:{port}/ HTTP/1.1\r\nHost : other-tenant.example\r\n\r\n",
        "G(T http://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n",
        "GET http://127.0.0.1:{port}/\x0b HTTP/1.1\r\n\r\n",
        "GET http://127.0.0.1:{port}/ HTTP/1.2\r\n\r\n",
        "GET http://127.0.0.1:{port}/ http/1.1\r\n\r\n",
        "GET  http://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n",
        "\r\nGET http://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n",
        "garbage\r\n\r\n",
        "POST http://127.0.0.1:{port}/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "POST http://127.0.0.1:{port}/ HTTP/1.1\r\nContent-Length: 0\r\nContent-Length: 40\r\n\r\n",
        "POST http://127.0.0.1:{port}/ HTTP/1.1\r\nContent-Length: +5\r\n\r\nhello",
    ],
    ids=[
        "bare-lf-smuggling",
        "bare-lf",
        "bare-cr",
        "nul",
        "obs-fold",
        "space-before-colon",
        "method-not-a-token",
        "control-in-target",
        "http-1.2",
        "lower-case-version",
        "two-spaces",
        "blank-line-first",
        "not-a-request-line",
        "transfer-encoding",
        "two-lengths",
        "length-not-digits",
    ],
)
def test_a_request_head_servers_could_read_otherwise_is_refused_and_never_sent(head):
    """The proxy checks one request and pins its Host; a head a server could split
    differently (a bare LF ends a line for many) carried a second request to any
    Host. Refused (400) on record; the server receives nothing."""
    server = _Server("upstream")
    try:
        reports: list = []
        proxy = EgressProxy([parse_destination(f"127.0.0.1:{server.port}")], report=reports.append)
        answer = ask(proxy, head.format(port=server.port).encode("latin-1"))
        time.sleep(0.2)  # time for the server to log what it was sent, had it been
        assert server.hits == []
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert answer.endswith(b"egress refused: bad_request\n")
        assert [(r.allowed, r.reason, r.port) for r in reports] == [(False, "bad_request", 0)]
    finally:
        server.close()


def test_a_body_is_forwarded_to_its_length_and_not_a_byte_more():
    """A second request behind the first one's body (any server reading on after the
    body would take it as the next request, to any Host) never reaches the server."""
    received = bytearray()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(0.5)
            with contextlib.suppress(OSError):
                while chunk := conn.recv(4096):
                    received.extend(chunk)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    try:
        reports: list = []
        proxy = EgressProxy([parse_destination(f"127.0.0.1:{port}")], report=reports.append)
        smuggled = b"GET /secret HTTP/1.1\r\nHost: other-tenant.example\r\n\r\n"
        answer = ask(
            proxy,
            f"POST http://127.0.0.1:{port}/in HTTP/1.1\r\nContent-Length: 5\r\n\r\n".encode()
            + b"hello"
            + smuggled,
        )
        thread.join(timeout=5)
        assert answer.endswith(b"\r\n\r\nok")
        head, _, body = bytes(received).partition(b"\r\n\r\n")
        assert head.startswith(b"POST /in HTTP/1.1\r\n") and b"Connection: close" in head
        assert body == b"hello"  # the second request stayed with the proxy
        assert [r.reason for r in reports] == ["allowed"]
    finally:
        server.close()


def test_a_well_formed_request_head_is_forwarded_with_its_headers():
    server = _Server("upstream")
    try:
        reports: list = []
        proxy = EgressProxy([parse_destination(f"127.0.0.1:{server.port}")], report=reports.append)
        answer = ask(
            proxy,
            f"GET http://127.0.0.1:{server.port}/ok HTTP/1.0\r\nX-A: b\tc \xe9\r\n\r\n".encode(
                "latin-1"
            ),
        )
        assert answer.startswith(b"HTTP/1.0 200 ") and answer.endswith(b"upstream")
        assert server.hits == ["/ok"]
        assert [r.reason for r in reports] == ["allowed"]
    finally:
        server.close()


# --- TLS down a tunnel to a named host: the ClientHello must name that host -----------------


def named_proxy(port: int, reports: list) -> EgressProxy:
    """A grant for api.example:port, a name that resolves (here) to the test's own
    server on 127.0.0.1; the grant names that address too, so it is not refused
    as internal."""
    allowlist = [parse_destination(f"api.example:{port}"), parse_destination(f"127.0.0.1:{port}")]
    return EgressProxy(allowlist, report=reports.append, resolve=lambda host, p: ["127.0.0.1"])


def test_tls_naming_the_allowed_host_goes_through(upstream):

    reports: list = []
    hello = client_hello("api.example")
    answer = ask(
        named_proxy(upstream, reports),
        f"CONNECT api.example:{upstream} HTTP/1.1\r\n\r\n".encode() + hello,
    )
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\necho:" + hello
    assert [(r.allowed, r.reason) for r in reports] == [(True, "allowed")]


def test_tls_naming_another_server_is_refused_on_record_and_never_sent(upstream):

    for hello in (
        client_hello("evil.example"),
        split_into_records(client_hello("evil.example"), 40),
    ):
        reports: list = []
        answer = ask(
            named_proxy(upstream, reports),
            f"CONNECT api.example:{upstream} HTTP/1.1\r\n\r\n".encode() + hello,
        )
        assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n"  # then closed: no echo
        assert [(r.allowed, r.reason, r.host) for r in reports] == [
            (True, "allowed", "api.example"),
            (False, "sni_mismatch", "evil.example"),
        ]


@pytest.fixture
def listener():
    """A server on 127.0.0.1 that keeps every byte each connection sent it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    received: list[bytes] = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                with contextlib.suppress(OSError):
                    while chunk := conn.recv(65536):
                        data += chunk
                received.append(data)

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1], received
    server.close()


def tunnel(proxy: EgressProxy, port: int, *pieces: bytes, pause: float = 0.0) -> bytes:
    """CONNECT api.example:port, then the pieces, `pause` seconds apart."""
    mine, theirs = socket.socketpair()
    handler = threading.Thread(target=proxy._handle, args=(theirs,))
    handler.start()
    mine.settimeout(30)
    mine.sendall(f"CONNECT api.example:{port} HTTP/1.1\r\n\r\n".encode())
    for i, piece in enumerate(pieces):
        if i:
            time.sleep(pause)
        with contextlib.suppress(OSError):  # the proxy may have closed already
            mine.sendall(piece)
    with contextlib.suppress(OSError):
        mine.shutdown(socket.SHUT_WR)
    answer = b""
    with contextlib.suppress(OSError):
        while chunk := mine.recv(4096):
            answer += chunk
    handler.join(timeout=30)
    mine.close()
    return answer


def wait_for(received: list[bytes]) -> list[bytes]:
    """What the listener was sent, once its connection has ended."""
    deadline = time.monotonic() + 5
    while not received and time.monotonic() < deadline:
        time.sleep(0.05)
    return received


PLAIN_HTTP = b"GET /x HTTP/1.1\r\nHost: other-tenant.example\r\n\r\n"
# Well-formed records carrying a hello that says it is 60000 bytes long: whole only
# past tls.MAX_HELLO, so never whole.
OVERSIZED_HELLO = b"".join(
    b"\x16\x03\x01\x40\x00" + body
    for body in [b"\x01" + (60000).to_bytes(3, "big") + bytes(16380)] + [bytes(16384)] * 3
)


@pytest.mark.parametrize(
    ("pieces", "pause"),
    [
        ((b"\r\n" + PLAIN_HTTP,), 0.0),  # a blank line first hid the request line
        ((PLAIN_HTTP[:6], PLAIN_HTTP[6:]), 1.0),  # a pause past the timeout, mid-line
        ((b"GET /" + b"a" * 9000, b" HTTP/1.1\r\nHost: other-tenant.example\r\n\r\n"), 0.2),
        ((PLAIN_HTTP,), 0.0),
        ((b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",), 0.0),
        ((b"SSH-2.0-client\r\n",), 0.0),
        ((b"\x00\x01binary",), 0.0),
        ((client_hello("api.example")[:20], client_hello("api.example")[20:]), 1.0),
        ((b"\x16\x03\x01\xff\xff" + b"\x00" * 70000,), 0.0),  # a record too long
        ((OVERSIZED_HELLO,), 0.0),
        ((), 0.0),  # nothing at all: the sandbox closed its side
    ],
    ids=[
        "blank-line-first",
        "paused-request-line",
        "long-request-line",
        "http",
        "http2",
        "ssh",
        "binary",
        "paused-hello",
        "malformed-hello",
        "oversized-hello",
        "nothing",
    ],
)
def test_a_tunnel_to_a_named_host_carries_only_a_hello_naming_it(
    listener, monkeypatch, pieces, pause
):
    """Plain HTTP down a tunnel can name any Host behind the address (and send many);
    any other protocol has no name to check. Only a whole ClientHello naming the host
    opens it: everything else is refused on record (not_tls) and the server receives
    nothing. Recognising HTTP by its shape was bypassed three ways (a blank line
    first, a pause past the read timeout, a line past the length read)."""
    monkeypatch.setattr(proxy_module, "CONNECT_TIMEOUT", 0.5)
    port, received = listener
    reports: list = []
    answer = tunnel(named_proxy(port, reports), port, *pieces, pause=pause)
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n"  # then closed
    assert wait_for(received) == [b""]  # connected, then closed: not a byte sent
    assert [(r.allowed, r.reason, r.host) for r in reports] == [
        (True, "allowed", "api.example"),
        (False, "not_tls", "api.example"),
    ]


def test_a_hello_naming_the_host_sent_in_pieces_goes_through(listener):
    port, received = listener
    reports: list = []
    hello = client_hello("api.example")
    answer = tunnel(named_proxy(port, reports), port, hello[:20], hello[20:], pause=0.2)
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n"
    assert [r.reason for r in reports] == ["allowed"]
    assert wait_for(received) == [hello]


def test_a_tunnel_that_could_reach_another_site_on_the_address_is_refused(upstream):
    """A hello with no server name lets the server pick a site: refused on record,
    never sent."""
    reports: list = []
    answer = ask(
        named_proxy(upstream, reports),
        f"CONNECT api.example:{upstream} HTTP/1.1\r\n\r\n".encode() + client_hello(None),
    )
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n"  # then closed
    assert [(r.allowed, r.reason, r.host) for r in reports] == [
        (True, "allowed", "api.example"),
        (False, "sni_missing", "api.example"),
    ]


def test_a_port_that_is_not_ascii_digits_is_a_logged_refusal():
    """'²' passes str.isdigit(); int('²') would raise and end the handler unlogged."""
    reports: list = []
    proxy = EgressProxy([parse_destination("127.0.0.1:9")], report=reports.append)
    answer = ask(proxy, "CONNECT 127.0.0.1:\u00b2 HTTP/1.1\r\n\r\n".encode("latin-1"))
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert [(r.allowed, r.reason) for r in reports] == [(False, "bad_destination")]


def test_a_refused_host_is_reported_as_printable_text_of_bounded_length():
    """What the sandbox sent goes on record, escaped (a NUL made the record unwritable,
    and the run's end went unrecorded) and cut to MAX_REPORTED_HOST characters."""
    reports: list = []
    proxy = EgressProxy([parse_destination("127.0.0.1:9")], report=reports.append)
    for host in ("\xe9\xff" * 150, "a\\x00b"):
        answer = ask(proxy, f"CONNECT {host}:9 HTTP/1.1\r\n\r\n".encode("latin-1"))
        assert answer.startswith(b"HTTP/1.1 403 ")
    assert [(r.allowed, r.reason, r.host) for r in reports] == [
        (False, "bad_destination", "\\xe9\\xff" * 25 + "..."),
        (False, "bad_destination", "a\\\\x00b"),  # a backslash the sandbox sent, escaped
    ]


def test_a_grant_that_names_an_address_is_not_held_to_a_name(upstream):

    reports: list = []
    proxy = EgressProxy([parse_destination(f"127.0.0.1:{upstream}")], report=reports.append)
    hello = client_hello("anything.example")
    answer = ask(proxy, f"CONNECT 127.0.0.1:{upstream} HTTP/1.1\r\n\r\n".encode() + hello)
    assert answer.endswith(b"echo:" + hello)
    assert [r.reason for r in reports] == ["allowed"]


def test_a_server_that_speaks_first_is_reached_through_a_grant_naming_its_address():
    """SSH or SMTP: the server's banner comes before any byte from the sandbox. A
    grant that names the address holds the tunnel to no name (to a named host, no
    ClientHello comes: refused above)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"220 banner\r\n")
            conn.sendall(b"echo:" + conn.recv(100))

    threading.Thread(target=serve, daemon=True).start()
    reports: list = []
    mine, theirs = socket.socketpair()
    proxy = EgressProxy([parse_destination(f"127.0.0.1:{port}")], report=reports.append)
    handler = threading.Thread(target=proxy._handle, args=(theirs,))
    handler.start()
    mine.settimeout(5)
    mine.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    seen = b""
    while b"220 banner" not in seen:
        seen += mine.recv(4096)
    mine.sendall(b"EHLO x\r\n")
    while b"echo:EHLO x" not in seen:
        seen += mine.recv(4096)
    mine.close()
    handler.join(timeout=5)
    server.close()
    assert [r.reason for r in reports] == ["allowed"]


def test_a_hello_with_an_encrypted_server_name_is_refused_on_record(listener):
    """ECH names the allowed host in the clear and the real one inside: a front end
    shared by many sites routes on the inner one. Refused, never sent."""
    port, received = listener
    reports: list = []
    tunnel(named_proxy(port, reports), port, hello_with_hidden_name("api.example"))
    assert wait_for(received) == [b""]
    # The CONNECT was allowed (the name is on the grant); what came down it was not.
    assert [(r.allowed, r.reason) for r in reports] == [(True, "allowed"), (False, "sni_hidden")]


def test_a_connection_still_waiting_when_the_run_ends_is_on_record(monkeypatch):
    """Every handler slot busy with a slow allowed server; one more attempt waits in
    the listen backlog. When the run ends it is put on record as refused (never
    served), and no handler outlives the run waiting on its slow server."""
    monkeypatch.setattr(proxy_module, "MAX_HANDLERS", 2)
    slow = socket.socket()
    slow.bind(("127.0.0.1", 0))
    slow.listen(16)  # accepts (the kernel does) and never answers
    slow_port = slow.getsockname()[1]
    reports: list = []
    proxy = EgressProxy([parse_destination(f"127.0.0.1:{slow_port}")], report=reports.append)
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(64)
    proxy.sock = listening
    serve = threading.Thread(target=proxy._serve, daemon=True)
    serve.start()
    port = listening.getsockname()[1]
    sandbox = []
    try:
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(f"GET http://127.0.0.1:{slow_port}/poll HTTP/1.1\r\n\r\n".encode())
            sandbox.append(s)
        deadline = time.monotonic() + 5
        while len(reports) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        evil = socket.create_connection(("127.0.0.1", port))
        evil.sendall(b"CONNECT evil.example:443 HTTP/1.1\r\n\r\n")
        sandbox.append(evil)
        time.sleep(0.2)
        for s in sandbox:
            s.close()
        proxy.drain()
        started = time.monotonic()
        proxy.stop()
        assert time.monotonic() - started < 4  # the slow upstreams were cut, not waited on
        assert [(r.allowed, r.reason) for r in reports] == [
            (True, "allowed"),
            (True, "allowed"),
            (False, "not_served"),
        ]
        assert reports[-1].host == "CONNECT evil.example:443 HTTP/1.1"
    finally:
        slow.close()


def test_an_attempt_refused_for_want_of_a_record_is_recorded_as_refused(monkeypatch):
    """The handler stopped waiting for its record and refused: it connected nowhere,
    and the record written later says so (not `allowed`)."""
    from sandbox_runner import runner as runner_module
    from sandbox_runner.egress import EgressDecision

    monkeypatch.setattr(runner_module._EgressLog, "WAIT", 0.2)
    log = runner_module._EgressLog(wake=threading.Event())
    allowed = EgressDecision(True, "allowed", "api.example", 443, "127.0.0.1")
    with pytest.raises(runner_module.EgressNotRecorded):
        log.record(allowed)
    recorded: list = []

    class Authorizer:
        def egress(self, spec, decision):
            recorded.append(decision)

    log.close(Authorizer(), None)
    assert [(d.allowed, d.reason, d.host) for d in recorded] == [
        (False, "not_recorded_in_time", "api.example")
    ]


@pytest.mark.parametrize(
    "payload", [b"\r\n\r\n", b"\r\nGET / HTTP/1.1\r\n\r\n", b"CONNECT :443 HTTP/1.1\r\n\r\n"]
)
def test_a_request_that_names_no_host_is_on_record_as_none(payload):
    """A blank head or `CONNECT :443` was reported with an empty host, which the REST
    API's egress record refuses (400): over HTTP the run then failed, and every attempt
    still queued behind it (the sandbox's other refusals) went unrecorded."""
    reports: list = []
    assert ask(EgressProxy([], report=reports.append), payload).startswith(b"HTTP/1.1 4")
    assert [(r.allowed, r.host) for r in reports] == [(False, "(none)")]


def _as_the_api_reads_it(decision) -> dict:
    """What HttpAuthorizer.egress posts, through the API's own serializer."""
    from governance.api.sandbox_views import EgressIn

    body = {
        "decision_id": "d" * 36,
        "reason": decision.reason,
        "host": decision.host[:300],
        "port": decision.port,
        "address": decision.address,
    }
    serializer = EgressIn(data=body)
    return {} if serializer.is_valid() else dict(serializer.errors)


def _never_resolve(host: str, port: int) -> list[str]:
    raise AssertionError(f"nothing is allowlisted: {host} was looked up")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from([b"CONNECT", b"GET", b"POST", b"", b"connect"]),
    target=st.binary(max_size=60),
    tail=st.sampled_from([b" HTTP/1.1\r\n\r\n", b" HTTP/1.0\r\nHost: x\r\n\r\n", b"\r\n", b""]),
    lead=st.sampled_from([b"", b"\r\n", b" "]),
)
def test_every_refusal_the_proxy_can_make_is_one_the_api_records(method, target, tail, lead):
    reports: list = []
    proxy = EgressProxy([], report=reports.append, resolve=_never_resolve)
    ask(proxy, lead + method + b" " + target + tail)
    assert len(reports) <= 1
    for decision in reports:
        assert not decision.allowed
        assert _as_the_api_reads_it(decision) == {}, decision


def _stop_as_the_runner_does(proxy: EgressProxy, recorded: list) -> None:
    """runner.execute's ending: drain the backlog, stop while flushing, close the log."""

    class Authorizer:
        def egress(self, spec, decision):
            recorded.append(decision)

    log = proxy.log
    proxy.drain()
    proxy.stop(pump=lambda: log.flush(Authorizer(), None))
    log.close(Authorizer(), None)


def _proxy_on_a_log(resolve=None) -> EgressProxy:
    from sandbox_runner import runner as runner_module

    log = runner_module._EgressLog(wake=threading.Event())
    kwargs = {"resolve": resolve} if resolve else {}
    proxy = EgressProxy(
        [parse_destination("slow.test:443")], report=log.record, note=log.note, **kwargs
    )
    proxy.log = log
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(16)
    proxy.sock = listening
    threading.Thread(target=proxy._serve, daemon=True).start()
    return proxy


def test_an_attempt_still_being_decided_when_the_run_ends_is_on_record():
    """The sandbox asked for an allowlisted name and exited while the name was being
    looked up: the log was closed before the handler finished, and its refusal was
    dropped (or, allowed, answered 503 with no record). The lookup's answer (an
    internal address) is refused, on record, after the stop."""
    looking = threading.Event()

    def slow_lookup(host: str, port: int) -> list[str]:
        looking.set()
        time.sleep(0.5)
        return ["127.0.0.1"]

    proxy = _proxy_on_a_log(slow_lookup)
    sandbox = socket.create_connection(proxy.sock.getsockname())
    sandbox.sendall(b"CONNECT slow.test:443 HTTP/1.1\r\n\r\n")
    assert looking.wait(5)
    sandbox.close()  # the sandbox exits
    recorded: list = []
    _stop_as_the_runner_does(proxy, recorded)
    assert [(d.allowed, d.reason, d.host) for d in recorded] == [
        (False, "internal_address", "slow.test")
    ]


def test_an_attempt_allowed_after_the_run_ended_is_refused_and_never_dialled(monkeypatch):
    """Decided "allowed" only after the stop: nothing is dialled after the run, and the
    record says the run never served it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    deciding = threading.Event()
    decide = proxy_module.decide

    def slow_allow(host, port_, allowlist, resolve):
        deciding.set()
        time.sleep(0.5)
        return decide("127.0.0.1", port, (parse_destination(f"127.0.0.1:{port}"),), resolve)

    monkeypatch.setattr(proxy_module, "decide", slow_allow)
    proxy = _proxy_on_a_log()
    sandbox = socket.create_connection(proxy.sock.getsockname())
    sandbox.sendall(b"CONNECT slow.test:443 HTTP/1.1\r\n\r\n")
    assert deciding.wait(5)
    sandbox.close()
    recorded: list = []
    try:
        _stop_as_the_runner_does(proxy, recorded)
        assert [(d.allowed, d.reason) for d in recorded] == [(False, "not_served")]
        with pytest.raises(TimeoutError):
            server.accept()  # never dialled
    finally:
        server.close()
