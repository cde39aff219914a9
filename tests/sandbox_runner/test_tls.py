"""sandbox_runner.tls: the server name in a real ClientHello (made by Python's ssl
module in memory: no network), split over records, truncated and forged."""

from __future__ import annotations

import ssl

import pytest

from sandbox_runner.tls import MALFORMED, MORE, NOT_TLS, Hello, read_client_hello


def client_hello(name: str | None) -> bytes:
    """The first flight of a real TLS client asking for `name` (None: no SNI)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    return outgoing.read()


def split_into_records(hello: bytes, size: int) -> bytes:
    """The same handshake message carried by several records of `size` bytes."""
    header, body = hello[:5], hello[5:]
    out = b""
    for start in range(0, len(body), size):
        chunk = body[start : start + size]
        out += header[:3] + len(chunk).to_bytes(2, "big") + chunk
    return out


def test_the_name_a_real_client_asks_for_is_read():
    assert read_client_hello(client_hello("api.example.com")) == Hello("tls", "api.example.com")
    assert read_client_hello(client_hello("API.Example.COM.")) == Hello("tls", "api.example.com")


def test_a_hello_without_a_name_says_so():
    assert read_client_hello(client_hello(None)) == Hello("tls", None)


def test_a_hello_split_over_records_is_joined_first():
    hello = client_hello("api.example.com")
    split = split_into_records(hello, 50)
    assert split != hello and split.count(b"\x16\x03") > 3
    assert read_client_hello(split) == Hello("tls", "api.example.com")


def test_a_partial_hello_asks_for_more():
    hello = client_hello("api.example.com")
    for cut in (1, 4, 5, 40, len(hello) - 1):
        assert read_client_hello(hello[:cut]) is MORE
    assert read_client_hello(b"") is MORE


def test_bytes_that_are_not_tls_are_said_to_be_so():
    for first in (b"SSH-2.0-OpenSSH_9.2\r\n", b"GET / HTTP/1.1\r\n", b"\x00\x00\x00\x08"):
        assert read_client_hello(first) is NOT_TLS


def test_a_hello_a_server_would_refuse_is_malformed():
    hello = bytearray(client_hello("api.example.com"))
    assert read_client_hello(bytes(hello[:5]) + b"\x02" + bytes(hello[6:])) is MALFORMED
    wrong_record = bytearray(hello)
    wrong_record[1] = 2  # SSL 2 record version
    assert read_client_hello(bytes(wrong_record)) is MALFORMED
    short = bytearray(hello)
    short[8] -= 1  # the handshake claims fewer bytes than its fields hold
    assert read_client_hello(bytes(short)) is MALFORMED
    # Two host names in one server_name extension (RFC 6066 allows one).
    name = b"api.example.com"
    at = bytes(hello).index(name)
    entry = b"\x00" + len(name).to_bytes(2, "big") + name
    doubled = _grow_server_name(bytes(hello), at, entry)
    assert read_client_hello(doubled) is MALFORMED


def _grow_server_name(hello: bytes, at: int, extra: bytes) -> bytes:
    """Append `extra` to the server_name list whose first name starts at `at`,
    fixing every enclosing length (list, extension, extensions, handshake, record)."""
    name_len = int.from_bytes(hello[at - 2 : at], "big")
    end = at + name_len
    out = bytearray(hello[:end] + extra + hello[end:])
    grow = len(extra)
    list_len_at = at - 5  # list length (2), then type (1) and name length (2)
    ext_len_at = list_len_at - 2
    for pos in (list_len_at, ext_len_at):
        value = int.from_bytes(out[pos : pos + 2], "big") + grow
        out[pos : pos + 2] = value.to_bytes(2, "big")
    # The extensions block's length: walk the ClientHello to find it.
    body = 9
    pos = body + 2 + 32
    pos += 1 + out[pos]
    pos += 2 + int.from_bytes(out[pos : pos + 2], "big")
    pos += 1 + out[pos]
    value = int.from_bytes(out[pos : pos + 2], "big") + grow
    out[pos : pos + 2] = value.to_bytes(2, "big")
    handshake = int.from_bytes(out[6:9], "big") + grow
    out[6:9] = handshake.to_bytes(3, "big")
    record = int.from_bytes(out[3:5], "big") + grow
    out[3:5] = record.to_bytes(2, "big")
    return bytes(out)


def _extension(kind: int, body: bytes) -> bytes:
    return kind.to_bytes(2, "big") + len(body).to_bytes(2, "big") + body


def hello_with_hidden_name(outer_name: str, kind: int = 0xFE0D) -> bytes:
    """A ClientHello naming `outer_name` in the clear, the real server name encrypted
    in an Encrypted Client Hello extension (`kind`: ECH, its drafts, or ESNI)."""
    import os

    name = outer_name.encode()
    names = b"\x00" + len(name).to_bytes(2, "big") + name
    sni = _extension(0x0000, len(names).to_bytes(2, "big") + names)
    enc, payload = os.urandom(32), os.urandom(200)
    ech = _extension(
        kind,
        b"\x00\x00\x01\x00\x01\x2a" + len(enc).to_bytes(2, "big") + enc
        + len(payload).to_bytes(2, "big") + payload,
    )  # fmt: skip
    extensions = sni + ech + _extension(0x002B, b"\x02\x03\x04")
    body = (
        b"\x03\x03" + os.urandom(32) + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00"
        + len(extensions).to_bytes(2, "big") + extensions
    )  # fmt: skip
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + len(handshake).to_bytes(2, "big") + handshake


@pytest.mark.parametrize("kind", [0xFE0D, 0xFE0A, 0xFFCE])
def test_a_hello_whose_server_name_is_encrypted_is_hidden(kind):
    assert read_client_hello(hello_with_hidden_name("api.example", kind)).kind == "hidden"
    # The same hello without the encrypted name is an ordinary one.
    assert read_client_hello(hello_with_hidden_name("api.example", 0x0017)) == Hello(
        "tls", "api.example"
    )
