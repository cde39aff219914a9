"""The API schema's egress pattern and the server's parser say the same thing.

Schemathesis generates grant requests from EGRESS_PATTERN and flags any that the
server then refuses; this checks the agreement directly, both ways.
"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from governance.api.serializers import EGRESS_PATTERN
from sandbox_runner.egress import parse_destination

PATTERN = re.compile(EGRESS_PATTERN)


def accepted(entry: str) -> bool:
    try:
        parse_destination(entry)
    except ValueError:
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(st.from_regex(PATTERN, fullmatch=True))
def test_every_entry_the_schema_allows_is_accepted(entry: str) -> None:
    host = entry.rpartition(":")[0]
    if len(host) > 253:  # the one rule the pattern cannot carry (fuzz/hooks.py knows it)
        assert not accepted(entry)
    else:
        assert accepted(entry), entry


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="abcAB019-.:[]", max_size=24))
def test_what_the_server_accepts_fits_the_schema(entry: str) -> None:
    if accepted(entry):
        assert PATTERN.match(entry), entry


def test_known_entries() -> None:
    for entry in ("api.example.com:443", "[2001:db8::1]:443", "127.0.0.1:8080", "A-b.C:1"):
        assert PATTERN.match(entry) and accepted(entry)
    for entry in ("[05.]:073", "host-.x:1", "-a:1", "[c]:80", "a:0", "a..b:1", "a:65536"):
        assert not PATTERN.match(entry) and not accepted(entry)
