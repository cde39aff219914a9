"""The egress decision, as a pure function. The resolver is a table passed in
(DNS does not exist on this machine); the system resolver is exercised on
'localhost' only, which never leaves the host."""

import pytest

from sandbox_runner.egress import decide, internal_reason, parse_destination, system_resolver

DNS = {
    "api.example.com": ["93.184.216.34"],
    "rebind.example.com": ["93.184.216.34", "127.0.0.1"],
    "meta.example.com": ["169.254.169.254"],
    "lan.example.com": ["10.1.2.3"],
    "v6.example.com": ["2606:4700::1111"],
    "mapped.example.com": ["::ffff:127.0.0.1"],
    "cgnat.example.com": ["100.64.0.7"],
}


def table(host, port):
    if host not in DNS:
        raise OSError("no such name")
    return DNS[host]


def allow(*entries):
    return [parse_destination(e) for e in entries]


@pytest.mark.parametrize(
    ("host", "port", "entries", "allowed", "reason"),
    [
        ("api.example.com", 443, ["api.example.com:443"], True, "allowed"),
        ("API.example.com", 443, ["api.example.com:443"], True, "allowed"),
        ("api.example.com", 80, ["api.example.com:443"], False, "not_allowlisted"),
        ("evil.api.example.com", 443, ["api.example.com:443"], False, "not_allowlisted"),
        ("api.example.com.evil", 443, ["api.example.com:443"], False, "not_allowlisted"),
        ("93.184.216.34", 443, ["api.example.com:443"], False, "not_allowlisted"),
        ("rebind.example.com", 443, ["rebind.example.com:443"], False, "internal_address"),
        ("meta.example.com", 80, ["meta.example.com:80"], False, "internal_address"),
        ("lan.example.com", 22, ["lan.example.com:22"], False, "internal_address"),
        ("mapped.example.com", 80, ["mapped.example.com:80"], False, "internal_address"),
        ("cgnat.example.com", 80, ["cgnat.example.com:80"], False, "internal_address"),
        ("v6.example.com", 443, ["v6.example.com:443"], True, "allowed"),
        ("127.0.0.1", 8080, ["127.0.0.1:8080"], True, "allowed"),  # named exactly
        ("127.0.0.1", 8081, ["127.0.0.1:8080"], False, "not_allowlisted"),
        ("::1", 8080, ["[::1]:8080"], True, "allowed"),
        ("gone.example.com", 443, ["gone.example.com:443"], False, "unresolvable"),
        ("bad host", 443, ["api.example.com:443"], False, "bad_destination"),
        ("api.example.com", 0, ["api.example.com:443"], False, "bad_destination"),
        ("api.example.com", 443, [], False, "not_allowlisted"),
    ],
)
def test_decide(host, port, entries, allowed, reason):
    decision = decide(host, port, allow(*entries), resolve=table)
    assert (decision.allowed, decision.reason) == (allowed, reason)
    if allowed:
        assert decision.address is not None


def test_an_internal_name_is_allowed_only_when_its_address_is_named_too():
    entries = allow("lan.example.com:22", "10.1.2.3:22")
    decision = decide("lan.example.com", 22, entries, resolve=table)
    assert (decision.allowed, decision.address) == (True, "10.1.2.3")


@pytest.mark.parametrize(
    "entry",
    ["example.com", "example.com:", "example.com:0", "example.com:65536", "example.com:8o",
     "[127.0.0.1]:80", "::1:80", "exa mple.com:80", "exämple.com:80", "example.com:443\n",
     "-bad.com:80", "a..b:80"],
)  # fmt: skip
def test_bad_allowlist_entries_are_refused(entry):
    with pytest.raises(ValueError):
        parse_destination(entry)


@pytest.mark.parametrize(
    ("address", "reason"),
    [("127.0.0.1", "loopback"), ("10.0.0.1", "private"), ("192.168.1.1", "private"),
     ("172.16.0.1", "private"), ("169.254.169.254", "metadata"), ("169.254.1.1", "link_local"),
     ("::1", "loopback"), ("fe80::1", "link_local"), ("fc00::1", "private"),
     ("224.0.0.1", "multicast"), ("0.0.0.0", "unspecified"), ("100.64.0.1", "cgnat"),
     ("192.0.0.192", "reserved"), ("192.0.0.9", "reserved"),  # not private to Python 3.11
     ("8.8.8.8", None), ("2606:4700::1111", None),
     # IPv4 inside IPv6 is judged as the IPv4 it carries.
     ("2002:a9fe:a9fe::", "metadata"), ("2002:7f00:1::", "loopback"), ("2002:808:808::", None),
     ("2001:0:4136:e378:8000:63bf:5601:5601", "metadata"), ("64:ff9b::a00:1", "private"),
     ("fec0::1", "private")],
)  # fmt: skip
def test_internal_reason(address, reason):
    import ipaddress

    assert internal_reason(ipaddress.ip_address(address)) == reason


def test_the_system_resolver_is_used_by_default_and_localhost_is_internal():
    assert "127.0.0.1" in system_resolver("localhost", 80) or "::1" in system_resolver(
        "localhost", 80
    )
    decision = decide("localhost", 80, allow("localhost:80"))
    assert (decision.allowed, decision.reason) == (False, "internal_address")
