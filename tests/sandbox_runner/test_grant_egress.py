"""Grants and the runner read an egress entry with one parser
(sandbox_runner.egress.parse_destination): an entry a grant accepts is one the
proxy can enforce, and one the proxy would refuse never makes it into a grant."""

from __future__ import annotations

import pytest

from governance.errors import GovernanceError
from governance.models import AuditEvent, Grant
from governance.services.grants import validate_shape

GOOD = ["api.example.com:443", "API.Example.com:443", "127.0.0.1:8080", "[::1]:8080", "a-b.c:1"]
# Each of these passed the old pattern (or would slip past a regex) but is not
# something the proxy can match: brackets around IPv4, bad labels, empty
# labels, port 0 or too large, no port, a path.
BAD = [
    "[127.0.0.1]:80",
    "-api.example.com:443",
    "api-.example.com:443",
    "api..example.com:443",
    "api.example.com:0",
    "api.example.com:65536",
    "api.example.com",
    "api.example.com:443/x",
    "::1:80",
    "héllo.example:443",
    7,
]


@pytest.mark.parametrize("entry", GOOD)
def test_a_host_port_entry_is_accepted(make_tool, entry):
    validate_shape(tool=make_tool(), actions=["execute"], scope="sandbox:*", egress=[entry])


@pytest.mark.parametrize("entry", BAD)
def test_an_entry_the_proxy_cannot_enforce_is_refused(make_tool, entry):
    with pytest.raises(GovernanceError) as caught:
        validate_shape(tool=make_tool(), actions=["execute"], scope="sandbox:*", egress=[entry])
    assert caught.value.code == "invalid_grant"
    assert "egress" in caught.value.fields


def test_a_refused_entry_writes_nothing(make_agent, make_tool, make_grant):
    agent, tool = make_agent(), make_tool()
    before = (Grant.objects.count(), AuditEvent.objects.count())
    with pytest.raises(GovernanceError):
        make_grant(agent, tool, actions=("execute",), scope="sandbox:*", egress=["[10.0.0.1]:80"])
    assert (Grant.objects.count(), AuditEvent.objects.count()) == before
