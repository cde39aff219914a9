"""Egress policy: the pure decision the runner's proxy makes for every connection.

Network is closed unless the grant lists destinations. A destination is allowed
only if its `host:port` is on the grant's list, exactly. Names are resolved by
the proxy itself (the sandbox has no DNS), and a name that resolves into
loopback, private, link-local, carrier-grade NAT, multicast, reserved or cloud
metadata ranges is refused, unless the grant names that exact address: a
DNS answer must never turn an allowlisted name into a path to the host's own
services or the metadata endpoint.

No Django here: the runner's core imports nothing from governance.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]

_HOST = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")
# Metadata endpoints are link-local already; named here so the reason says so.
_METADATA = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
# IETF protocol assignments: Python 3.11 counts only some of the /24 as private (newer
# ones all of it), and 192.0.0.192 has been a cloud's metadata address. Not public,
# whichever Python runs the proxy.
_IETF_PROTOCOL = ipaddress.ip_network("192.0.0.0/24")


@dataclass(frozen=True)
class Destination:
    """One allowlist entry: a lower-case host name or a literal address, and a port."""

    host: str
    port: int

    @property
    def address(self) -> Address | None:
        try:
            return ipaddress.ip_address(self.host)
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class EgressDecision:
    allowed: bool
    # allowed | not_allowlisted | bad_destination | unresolvable | internal_address |
    # bad_request (the proxy's: a request head it does not forward, see proxy._parse_head),
    # sni_mismatch, sni_missing, sni_hidden, not_tls (the proxy's: a tunnel to an
    # allowed name whose first bytes are a ClientHello for another, no or an encrypted
    # server name, or are not a whole ClientHello at all)
    reason: str
    host: str
    port: int
    address: str | None = None


def parse_destination(entry: str) -> Destination:
    """`host:port` or `[v6]:port`, strictly; raises ValueError otherwise."""
    if not isinstance(entry, str) or not entry.isascii():
        raise ValueError(f"{entry!r} is not host:port")
    if entry.startswith("["):
        host, sep, port = entry[1:].partition("]:")
        if not sep:
            raise ValueError(f"{entry!r} is not [address]:port")
        if not isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            raise ValueError(f"{entry!r}: brackets are for IPv6 addresses")
    else:
        host, sep, port = entry.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"{entry!r} is not host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r} has no valid port")
    host = host.lower()
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        if not _HOST.fullmatch(host) or len(host) > 253:
            raise ValueError(f"{entry!r} has no valid host") from None
    return Destination(host, int(port))


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def internal_reason(address: Address) -> str | None:
    """Why an address must not be reached through a name, or None if public."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return internal_reason(address.ipv4_mapped)
        # IPv4 carried inside IPv6 (6to4, Teredo's client, NAT64's well-known prefix):
        # a host with such routes reaches the IPv4 address, so it is judged as that.
        carried = address.sixtofour or (address.teredo[1] if address.teredo else None)
        if carried is None and address in _NAT64:
            carried = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if carried is not None and (reason := internal_reason(carried)):
            return reason
        if address.is_site_local:  # fec0::/10, deprecated but still routed by some
            return "private"
    if address in _METADATA:
        return "metadata"
    for name in ("loopback", "link_local", "unspecified", "multicast", "private", "reserved"):
        if getattr(address, f"is_{name}"):
            return name
    if isinstance(address, ipaddress.IPv4Address) and address in _CGNAT:
        return "cgnat"
    if isinstance(address, ipaddress.IPv4Address) and address in _IETF_PROTOCOL:
        return "reserved"
    return None


def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for host (the proxy's own lookup)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def destination_of(host: str, port: int) -> Destination:
    """A destination from a host (a name, or an address of either family) and a port,
    as an allowlist entry spells it; raises ValueError otherwise."""
    return parse_destination(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")


def decide(
    host: str,
    port: int,
    allowlist: Iterable[Destination],
    resolve: Resolver = system_resolver,
) -> EgressDecision:
    """May the sandbox connect to host:port? Returns the address to dial if so.

    Exact matching only: a different port, a sub-domain or a differently
    spelled address is not on the list. Every address a name resolves to is
    checked, so a name with one public and one internal record is refused.
    """
    try:
        wanted = destination_of(host, port)
    except ValueError:
        return EgressDecision(False, "bad_destination", host, port)
    allowed = set(allowlist)
    if wanted not in allowed:
        return EgressDecision(False, "not_allowlisted", wanted.host, port)
    literal = wanted.address
    if literal is not None:
        # The grant names this exact address: that is the explicit exception.
        return EgressDecision(True, "allowed", wanted.host, port, str(literal))
    try:
        addresses = [ipaddress.ip_address(a.split("%")[0]) for a in resolve(wanted.host, port)]
    except (OSError, ValueError):
        return EgressDecision(False, "unresolvable", wanted.host, port)
    if not addresses:
        return EgressDecision(False, "unresolvable", wanted.host, port)
    for address in addresses:
        if internal_reason(address) is not None and Destination(str(address), port) not in allowed:
            return EgressDecision(False, "internal_address", wanted.host, port, str(address))
    return EgressDecision(True, "allowed", wanted.host, port, str(addresses[0]))
