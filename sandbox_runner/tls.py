"""The server name a TLS ClientHello asks for (SNI), read as a server reads it.

The egress proxy lets a CONNECT tunnel through to an allowlisted host:port. A
client that then opens TLS naming another server (SNI) reaches whichever site
shares that address: any tenant of a CDN behind an allowlisted name (domain
fronting). The proxy reads the first bytes the sandbox sends down the tunnel
and, when they are a ClientHello, compares its server name with the CONNECT
host. Pure functions, no I/O.

A ClientHello may be split over several TLS records; they are joined, up to
MAX_HELLO bytes, before it is read. Anything a server would reject as a
ClientHello (bad lengths, two server names, a name that is not ASCII) is
"malformed", and the proxy refuses it rather than guess.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_HELLO = 64 * 1024
_HANDSHAKE = 0x16
_CLIENT_HELLO = 0x01
_SERVER_NAME = 0x0000
_HOST_NAME = 0x00


@dataclass(frozen=True)
class Hello:
    """kind: "more" (send more bytes), "not_tls", "tls" (name: the SNI or None), "malformed",
    "hidden" (the server name is encrypted: ECH)."""

    kind: str
    name: str | None = None


MORE = Hello("more")
NOT_TLS = Hello("not_tls")
MALFORMED = Hello("malformed")
# Encrypted Client Hello (and its drafts, and ESNI before it): the name in the clear is
# only the front end's; the server the client really asks for is encrypted inside, and
# a front end routes on that one. No name to check, so nothing the allowlist can pass.
HIDDEN = Hello("hidden")
_HIDDEN_NAME = frozenset({0xFE0D, 0xFE0C, 0xFE0B, 0xFE0A, 0xFE09, 0xFE08, 0xFFCE})


def read_client_hello(data: bytes) -> Hello:
    """What the first bytes a client sent say about the server it wants."""
    if not data:
        return MORE
    if data[0] != _HANDSHAKE:
        return NOT_TLS
    handshake = b""
    pos = 0
    while True:
        if len(data) < pos + 5:
            return MORE if len(data) < MAX_HELLO else MALFORMED
        if data[pos] != _HANDSHAKE or data[pos + 1] != 3:
            return MALFORMED
        length = int.from_bytes(data[pos + 3 : pos + 5], "big")
        if length == 0 or length > 1 << 14:
            return MALFORMED
        if len(data) < pos + 5 + length:
            return MORE if pos + 5 + length <= MAX_HELLO else MALFORMED
        handshake += data[pos + 5 : pos + 5 + length]
        pos += 5 + length
        if len(handshake) >= 4:
            if handshake[0] != _CLIENT_HELLO:
                return MALFORMED
            need = 4 + int.from_bytes(handshake[1:4], "big")
            if need > MAX_HELLO:
                return MALFORMED
            if len(handshake) >= need:
                return _server_name(handshake[4:need])


def _server_name(body: bytes) -> Hello:
    reader = _Reader(body)
    try:
        reader.take(2 + 32)  # legacy_version, random
        reader.vector(1, limit=32)  # legacy_session_id
        suites = reader.vector(2)
        if not suites or len(suites) % 2:
            return MALFORMED
        if not reader.vector(1):  # legacy_compression_methods
            return MALFORMED
        if reader.done():
            return Hello("tls")  # no extensions at all: no name
        extensions = _Reader(reader.vector(2))
        if not reader.done():
            return MALFORMED
        name: str | None = None
        seen: set[int] = set()
        while not extensions.done():
            kind = int.from_bytes(extensions.take(2), "big")
            data = extensions.vector(2)
            if kind in seen:
                return MALFORMED  # a server refuses a repeated extension
            seen.add(kind)
            if kind == _SERVER_NAME:
                name = _host_name(data)
                if name is None:
                    return MALFORMED
            elif kind in _HIDDEN_NAME:
                return HIDDEN
        return Hello("tls", name)
    except ValueError:
        return MALFORMED


def _host_name(data: bytes) -> str | None:
    """RFC 6066 server_name: exactly one host_name entry, ASCII, no NUL."""
    outer = _Reader(data)
    names = _Reader(outer.vector(2))
    if not outer.done():
        return None
    found: str | None = None
    while not names.done():
        kind = names.take(1)[0]
        value = names.vector(2)
        if kind != _HOST_NAME or found is not None or not value:
            return None
        try:
            found = value.decode("ascii")
        except UnicodeDecodeError:
            return None
        if "\x00" in found:
            return None
    return None if found is None else normalise(found)


def normalise(host: str) -> str:
    """Host names compare without case and without a final dot."""
    return host.lower().removesuffix(".")


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, count: int) -> bytes:
        if self.pos + count > len(self.data):
            raise ValueError("truncated")
        out = self.data[self.pos : self.pos + count]
        self.pos += count
        return out

    def vector(self, width: int, limit: int | None = None) -> bytes:
        length = int.from_bytes(self.take(width), "big")
        if limit is not None and length > limit:
            raise ValueError("too long")
        return self.take(length)

    def done(self) -> bool:
        return self.pos == len(self.data)
