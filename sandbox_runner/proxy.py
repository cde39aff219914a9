"""The per-run egress proxy (HTTP and CONNECT), listening inside the sandbox.

The sandbox has no network of its own: its namespace holds only a loopback
interface. The runner binds this proxy's listening socket on 127.0.0.1:3128
*inside that namespace* (a thread enters it with setns(2), binds, and comes
back), while every outbound connection the proxy makes comes from the
runner's own namespace. So the only path out is this proxy, and there is no
DNS inside: names are resolved here, by egress.decide(), which also refuses
internal addresses unless the grant names them exactly.

A tunnel to a named host carries TLS for that host only: the first bytes the
sandbox sends down it are held until they are a whole TLS ClientHello that names
that host (SNI, see sandbox_runner.tls). Anything else (another name, no name,
bytes that are not a ClientHello, or no whole one in time) is refused and never
sent: the proxy does not try to tell which other protocol it might be.

Every attempt, allowed or denied, is reported (destination, resolved address,
reason) to `report`, which the runner turns into one audit event each. `report`
returns once the attempt is on record and raises if it cannot be recorded: an
allowed attempt is reported *before* the proxy connects anywhere, and one that
could not be recorded is refused (no record, no connection).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable

from sandbox_runner.egress import Destination, EgressDecision, Resolver, decide, system_resolver
from sandbox_runner.tls import normalise as tls_normalise
from sandbox_runner.tls import read_client_hello

CLONE_NEWNET = 0x40000000
LISTEN_PORT = 3128
MAX_HEADER = 16 * 1024
CONNECT_TIMEOUT = 10.0
IDLE_TIMEOUT = 120.0
MAX_HANDLERS = 32  # connections served at once

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def listen_in_netns(pid: int, port: int = LISTEN_PORT) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:port in the network namespace of `pid`.

    Runs in a throwaway thread: setns() changes only the calling thread, and a
    thread that fails to come back must not go on serving anything else.
    """
    box: dict[str, object] = {}

    def work() -> None:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        try:
            _setns(target)
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(64)
                box["sock"] = sock
            finally:
                _setns(home)
        except BaseException as exc:
            box["error"] = exc
        finally:
            os.close(home)
            os.close(target)

    thread = threading.Thread(target=work, name="netns-bind")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["sock"]  # type: ignore[return-value]


def _read_head(conn: socket.socket) -> tuple[bytes, bool]:
    """The bytes read, and whether they hold a whole request head: not when the sandbox
    closed, went quiet past CONNECT_TIMEOUT, or sent more than MAX_HEADER first."""
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = conn.recv(4096)
        except OSError:  # timed out
            return data, False
        if not chunk:
            return data, False
        data += chunk
        if len(data) > MAX_HEADER:
            return data, False
    return data, True


_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_METHOD = re.compile(_TOKEN)
_TARGET = re.compile(rb"[^\x00-\x20\x7f]+")  # no control character, no space
# name:value, the name a token (no space before the colon), the value with no control
# character but HTAB; a line that starts with a space or HTAB (obs-fold) has no name.
_FIELD = re.compile(_TOKEN + rb":[\t\x20-\x7e\x80-\xff]*")
_VERSIONS = (b"HTTP/1.0", b"HTTP/1.1")


def _parse_head(head: bytes) -> tuple[str, str, str, list[bytes], int] | None:
    """The method, target, version, header lines and body length of a request head (up
    to its blank line), or None if servers could read it otherwise than the proxy does:
    a bare CR or LF (many servers end a line at a bare LF, so a second request,
    to any Host, could hide inside one header line and pass the proxy's checks), any
    other control character, a folded line (obs-fold), a header name that is not a
    token (a space before its colon), a method that is not a token, a version other
    than HTTP/1.0 or HTTP/1.1, or a body whose end is not one plain Content-Length
    (Transfer-Encoding, two lengths, a length that is not digits: where the proxy and
    a server disagree on the body's end, the rest is a second request)."""
    line, *fields = head.split(b"\r\n")
    parts = line.split(b" ")
    if len(parts) != 3:
        return None
    method, target, version = parts
    if not (_METHOD.fullmatch(method) and _TARGET.fullmatch(target) and version in _VERSIONS):
        return None
    if not all(_FIELD.fullmatch(field) for field in fields):
        return None
    named = [field.split(b":", 1) for field in fields]
    if any(name.lower() == b"transfer-encoding" for name, _ in named):
        return None
    lengths = [value.strip(b" \t") for name, value in named if name.lower() == b"content-length"]
    if len(lengths) > 1 or (lengths and not re.fullmatch(rb"[0-9]{1,15}", lengths[0])):
        return None
    length = int(lengths[0]) if lengths else 0
    return method.decode(), target.decode("latin-1"), version.decode(), fields, length


MAX_REPORTED_HOST = 200  # characters of a refused host kept on record


def _printable(text: str) -> str:
    """Text as Python's ascii() shows it: control characters, backslashes and
    anything beyond ASCII escaped (\\x00, \\n, \\xe9), cut at MAX_REPORTED_HOST."""
    shown = ascii(text)[1:-1]
    return shown if len(shown) <= MAX_REPORTED_HOST else shown[:MAX_REPORTED_HOST] + "..."


def _split_hostport(authority: str, default_port: int) -> tuple[str, int] | None:
    if authority.startswith("["):
        host, _, rest = authority[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else str(default_port)
    elif authority.count(":") == 1:
        host, _, port = authority.partition(":")
    else:
        host, port = authority, str(default_port)
    # ASCII digits only: "²".isdigit() is true, and int() would then raise.
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        return None
    return host, int(port)


# Dropped from a forwarded request: the proxy sets Host and Connection itself.
_HOP_HEADERS = {b"host", b"connection", b"proxy-connection", b"keep-alive", b"proxy-authorization"}


def _pinned_headers(fields: list[bytes], host: str, port: int) -> bytes:
    """The request's header block with Host set to the checked destination and
    `Connection: close`; `fields` are the header lines _parse_head checked."""
    kept = [line for line in fields if line.split(b":", 1)[0].lower() not in _HOP_HEADERS]
    authority = f"[{host}]" if ":" in host else host
    if port != 80:
        authority += f":{port}"
    kept += [f"Host: {authority}".encode("latin-1"), b"Connection: close"]
    return b"\r\n".join(kept) + b"\r\n\r\n"


_STATUS = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway", 503: "Service Unavailable"}


def _answer(conn: socket.socket, status: int, text: str) -> None:
    body = f"{text}\n".encode()
    conn.sendall(
        f"HTTP/1.1 {status} {_STATUS[status]}\r\nConnection: close\r\n".encode()
        + f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def _copy(src: socket.socket, dst: socket.socket, count: int | None) -> None:
    """Copy `count` bytes (None: until src closes) from src to dst; stops early if src
    closes or stays silent for IDLE_TIMEOUT (the sockets' timeout)."""
    while count is None or count > 0:
        data = src.recv(65536 if count is None else min(65536, count))
        if not data:
            return
        dst.sendall(data)
        if count is not None:
            count -= len(data)


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways until both sides are done; a half-close is passed on."""
    peer = {a: b, b: a}
    reading = [a, b]
    while reading:
        readable, _, _ = select.select(reading, [], [], IDLE_TIMEOUT)
        if not readable:
            return
        for s in readable:
            data = s.recv(65536)
            if data:
                peer[s].sendall(data)
                continue
            reading.remove(s)
            with contextlib.suppress(OSError):
                peer[s].shutdown(socket.SHUT_WR)


class EgressProxy:
    """Allows exactly the grant's destinations; reports every attempt."""

    def __init__(
        self,
        allowlist: Iterable[Destination],
        report: Callable[[EgressDecision], None],
        resolve: Resolver = system_resolver,
        note: Callable[[EgressDecision], None] | None = None,
    ) -> None:
        """`report` puts an attempt on record and returns once it is (an allowed one
        connects only then); `note`, when given, puts a refusal on its way to the
        record without waiting (the proxy refuses either way)."""
        self.allowlist = tuple(allowlist)
        self.report = report
        self.note = note or report
        self.resolve = resolve
        self.sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_HANDLERS)
        self._stopped = threading.Event()

    def bind_in(self, pid: int) -> None:
        """The backend's network hook: listen inside the sandbox's namespace, serve."""
        self.sock = listen_in_netns(pid)
        thread = threading.Thread(target=self._serve, name="egress-proxy", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _serve(self) -> None:
        assert self.sock is not None
        while not self._stopped.is_set():
            # At most MAX_HANDLERS connections are served at once; the rest wait in the
            # listen backlog (a flood from the sandbox cannot grow the runner's threads).
            self._slots.acquire()
            try:
                conn, _ = self.sock.accept()
            except OSError:
                self._slots.release()
                return
            thread = threading.Thread(target=self._handle_in_slot, args=(conn,), daemon=True)
            with self._lock:
                self._open.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _handle_in_slot(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        finally:
            self._slots.release()

    def _handle(self, conn: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            conn.settimeout(CONNECT_TIMEOUT)
            head, whole = _read_head(conn)
            if not head:
                return  # connected and sent nothing: no request, nowhere asked for
            head, _, early = head.partition(b"\r\n\r\n")  # early: bytes sent after it
            request = _parse_head(head) if whole else None
            if request is None:  # not forwarded, still an attempt: logged as one (a head
                # cut short, too long or never finished too: `CONNECT host` then close)
                line = re.split(rb"\r?\n", head, maxsplit=1)[0][:100].decode("latin-1")
                self._refuse(conn, EgressDecision(False, "bad_request", line, 0), status=400)
                return
            method, target, version, fields, length = request
            if method == "CONNECT":
                where, path = _split_hostport(target, 443), ""
            elif target.startswith("http://"):
                authority, slash, path = target[len("http://") :].partition("/")
                where, path = _split_hostport(authority, 80), slash + path
            else:
                where, path = None, ""
            if where is None:
                self._refuse(conn, EgressDecision(False, "bad_destination", target, 0))
                return
            decision = decide(where[0], where[1], self.allowlist, self.resolve)
            if decision.allowed and self._stopped.is_set():
                # Decided after the run ended (a slow lookup): refused and on record as
                # a connection the run never got to serve; nothing is dialled after it.
                decision = dataclasses.replace(decision, allowed=False, reason="not_served")
            if not decision.allowed:
                self._refuse(conn, decision)
                return
            assert decision.address is not None
            try:
                self.report(decision)  # on record first: no record, no connection
            except Exception:
                _answer(conn, 503, "egress refused: the attempt could not be recorded")
                return
            try:
                upstream = socket.create_connection(
                    (decision.address, decision.port), timeout=CONNECT_TIMEOUT
                )
            except OSError:
                # Allowed and on record; the destination did not answer.
                _answer(conn, 502, "egress allowed, but the destination did not answer")
                return
            with self._lock:  # stop() cuts it too: no handler outlives the run
                self._open.add(upstream)
            if self._stopped.is_set():
                return
            if method == "CONNECT":
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                if Destination(decision.host, decision.port).address is None:
                    first = self._client_hello(conn, early, decision)
                    if first is None:
                        return  # not TLS for the host allowed: refused, nothing sent
                    early = first
                upstream.sendall(early)
            else:
                # Origin-form to the server, for the checked host only: Host is the
                # allowed one (no other virtual host behind the same address) and the
                # server closes after this one request (no second request, to any Host,
                # down an already-checked connection). Other headers pass as they are.
                # The body is forwarded to its Content-Length and not a byte more:
                # whatever the sandbox sends after it never reaches the server.
                request_line = f"{method} {path or '/'} {version}\r\n".encode("latin-1")
                headers = _pinned_headers(fields, decision.host, decision.port)
                upstream.sendall(request_line + headers + early[:length])
                conn.settimeout(IDLE_TIMEOUT)
                upstream.settimeout(IDLE_TIMEOUT)
                _copy(conn, upstream, length - min(len(early), length))
                _copy(upstream, conn, None)
                return
            conn.settimeout(None)
            upstream.settimeout(None)
            _pipe(conn, upstream)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(conn)
                self._open.discard(upstream)  # type: ignore[arg-type]
            for s in (conn, upstream):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()

    def _client_hello(
        self, conn: socket.socket, early: bytes, decision: EgressDecision
    ) -> bytes | None:
        """What the sandbox sends first down a tunnel to a named host, held back until
        it is a whole TLS ClientHello naming that host (then returned, to be sent on).
        Anything else is reported as refused, never sent, and None is returned:

        - a hello naming another server is `sni_mismatch`; one naming none is
          `sni_missing` (the server would pick any site behind the address); one whose
          real server name is encrypted (ECH, ESNI) is `sni_hidden` (a front end routes
          on that name, not on the one in the clear);
        - anything that is not a whole, well-formed ClientHello within CONNECT_TIMEOUT
          of the tunnel opening (plain HTTP, SSH, a malformed or oversized hello, a
          pause, the sandbox closing, a server that speaks first) is `not_tls`. Which
          protocol it might be is not guessed: every guess was a way around the check.
          Plain HTTP goes through the forwarding path, which pins Host; other
          protocols need a grant that names the address."""
        data = early
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while (hello := read_client_hello(data)).kind == "more":
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([conn], [], [], remaining)[0]:
                break
            try:
                chunk = conn.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            data += chunk
        reason, named = None, decision.host
        if hello.kind == "hidden":
            reason = "sni_hidden"
        elif hello.kind != "tls":
            reason = "not_tls"
        elif hello.name is None:
            reason = "sni_missing"
        elif hello.name != tls_normalise(decision.host):
            reason, named = "sni_mismatch", hello.name
        if reason is not None:
            self._record_refusal(
                EgressDecision(False, reason, named, decision.port, decision.address)
            )
            return None
        return data

    def _record_refusal(self, decision: EgressDecision) -> None:
        # Refused either way; a refusal that could not be recorded fails the run (the
        # runner, whose write failed, stops it). Its host is what the sandbox sent, as
        # printable text of a bounded length (a NUL in it made the record unwritable).
        # A request with no host at all (a blank head, `CONNECT :443`) is on record as
        # "(none)": an empty host is not a record the log accepts.
        host = _printable(decision.host) or "(none)"
        with contextlib.suppress(Exception):
            self.note(dataclasses.replace(decision, host=host))

    def _refuse(self, conn: socket.socket, decision: EgressDecision, status: int = 403) -> None:
        self._record_refusal(decision)
        _answer(conn, status, f"egress refused: {decision.reason}")

    def drain(self) -> None:
        """The run is over: connections still waiting in the listen backlog (every
        handler slot was busy) were never served, and are put on record as refused
        (`not_served`, with their request line), not dropped unseen. Before the
        runner closes the egress log; refusals are noted without waiting."""
        if self.sock is None:
            return
        with contextlib.suppress(OSError):
            self.sock.setblocking(False)
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # nothing more waiting (or the socket is gone)
                return
            try:
                conn.settimeout(0.2)  # what it has sent already: it is not waited for
                head, _ = _read_head(conn)
            except OSError:
                head = b""
            finally:
                with contextlib.suppress(OSError):
                    conn.close()
            if head:  # connected and sent nothing: nowhere asked for, as in _handle
                line = re.split(rb"\r?\n", head, maxsplit=1)[0][:100].decode("latin-1")
                self._record_refusal(EgressDecision(False, "not_served", line, 0))

    def stop(self, pump: Callable[[], None] | None = None, wait: float = 10.0) -> None:
        """Stop listening, cut open tunnels, wait (at most `wait` seconds in all) for
        every handler to report. `pump` is called while waiting: the runner's flush of
        the egress log, which a handler still deciding (a slow lookup) or waiting for
        its record needs; an attempt made before the stop is then on record too."""
        self._stopped.set()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
        with self._lock:
            for conn in list(self._open):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            threads = list(self._threads)
        deadline = time.monotonic() + wait
        for thread in threads:
            while thread.is_alive() and time.monotonic() < deadline:
                if pump is not None:
                    with contextlib.suppress(Exception):  # a failed write fails the run
                        pump()
                thread.join(timeout=0.02 if pump is not None else deadline - time.monotonic())
        if pump is not None:
            with contextlib.suppress(Exception):
                pump()
