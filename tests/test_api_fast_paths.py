"""/authorize reads its body and renders its decision without the serializer
machinery (governance.api.serializers.authorize_body and decision_out). They
must agree with AuthorizeIn and DecisionOut exactly: checked here on generated
bodies (hypothesis) and on every kind of decision."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from governance.api import serializers as s
from governance.codes import Decision as Verdict
from governance.codes import Reason

_TEXT = st.one_of(
    st.text(max_size=8),
    st.text(min_size=60, max_size=120),
    st.sampled_from(["", " ", "read", "repo", "a\x00b", "\ud800", "x" * 64, "x" * 65, "x" * 500,
                     "x" * 501, "repo:acme/api/*", " repo", "délete"]),
)  # fmt: skip
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=12,
)
_VALUE = st.one_of(
    _TEXT,
    st.sampled_from(["read", "create", "update", "delete", "execute", "READ", "exec"]),
    st.none(),
    st.integers(),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(_TEXT, _JSON, max_size=3),
)
_KEYS = ["tool", "action", "scope", "task", "arguments", "approval", "agent", "Tool"]


def _reference(data):
    body = s.AuthorizeIn(data=data)
    return body.validated_data if body.is_valid() else None


def _near(*lengths: int):
    """Text of exactly these lengths (limits and one past them), or short text."""
    sized = st.sampled_from(lengths).flatmap(lambda n: st.text(min_size=n, max_size=n))
    return st.one_of(st.text(max_size=3), sized)


@hsettings(max_examples=800, deadline=None)
@given(st.dictionaries(st.sampled_from(_KEYS), _VALUE, max_size=7))
def test_the_fast_reader_reads_any_body_as_AuthorizeIn_does(data):
    # None from both is "malformed": the view then lets AuthorizeIn word the error.
    assert s.authorize_body(data) == _reference(data)


@hsettings(max_examples=800, deadline=None)
@given(
    tool=_near(99, 100, 101),
    action=st.sampled_from(["read", "create", "update", "delete", "execute", "", "Read"]),
    scope=_near(499, 500, 501),
    extra=st.fixed_dictionaries(
        {},
        optional={
            "task": st.none() | _near(100, 101),
            "approval": st.none() | _near(64, 65),
            "arguments": st.none() | st.dictionaries(_TEXT, _JSON, max_size=3),
        },
    ),
)
def test_nearly_well_formed_bodies_are_read_as_AuthorizeIn_reads_them(tool, action, scope, extra):
    data = {"tool": tool, "action": action, "scope": scope, **extra}
    assert s.authorize_body(data) == _reference(data)


def test_anything_not_plainly_well_formed_is_left_to_AuthorizeIn():
    base = {"tool": "repo", "action": "read", "scope": "repo:acme/api/x"}
    assert s.authorize_body(base) == base
    for bad in (
        {**base, "agent": "someone-else"},
        {**base, "tool": ""},
        {**base, "tool": 7},
        {**base, "action": "READ"},
        {**base, "scope": "x" * 501},
        {**base, "task": ""},
        {**base, "arguments": []},
        {**base, "arguments": {"k": "a\x00b"}},
        {k: v for k, v in base.items() if k != "scope"},
        [base],
    ):
        assert s.authorize_body(bad) is None
        assert _reference(bad) is None


def _bodies():
    times = [
        None,
        datetime(2030, 1, 15, 12, 0, tzinfo=UTC),
        datetime(2030, 1, 15, 12, 0, 0, 123456, tzinfo=UTC),
        datetime(2030, 1, 15, 14, 0, tzinfo=timezone(timedelta(hours=2))),
    ]
    for verdict in Verdict:
        for reason in Reason:
            for expires in times:
                for ids in ((None, None, None), (str(uuid.uuid4()), 42, str(uuid.uuid4()))):
                    yield {
                        "decision": verdict,
                        "reason": reason,
                        "message": f"because {reason}",
                        "decision_id": ids[0],
                        "grant": ids[1],
                        "approval": ids[2],
                        "expires_at": expires,
                        "break_glass": ids[1] is not None,
                    }


def test_the_fast_renderer_writes_what_DecisionOut_writes():
    count = 0
    for body in _bodies():
        assert s.decision_out(body) == s.DecisionOut(body).data
        count += 1
    assert count == len(Verdict) * len(Reason) * 4 * 2
