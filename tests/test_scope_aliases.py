"""A resource has one spelling: a second one (a trailing dot, a `;` parameter) that a
server would read as the same path is refused, so no pattern, a deny policy's above
all, can be stepped around with it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group, User

from governance import roles
from governance.audit import Actor
from governance.models import AuditEvent
from governance.policy import pattern_is_valid, resource_is_canonical
from governance.services import access, confirmation
from tests.conftest import NOW


def _approver(user: User) -> User:
    user.groups.add(Group.objects.get_or_create(name=roles.APPROVERS)[0])
    return User.objects.get(pk=user.pk)


def _deny_and_approve(agent: Any, tool: Any, *, deny: tuple[User, str], approve: tuple[User, str]):
    """Deletes under `deny`'s scope denied by a policy, any other under `approve`'s
    approved by one (each (author, scope)): an alias that dodges the deny is allowed."""
    for (author, scope), verdict in ((deny, "deny"), (approve, "approve")):
        confirmation.policy_create(
            author=_approver(author), agent=agent, tool=tool, action="delete", scope=scope,
            verdict=verdict, reason="r", duration=timedelta(hours=1),
            actor=Actor.system("test"), at=NOW - timedelta(minutes=5),
        )  # fmt: skip


@pytest.mark.parametrize(
    "alias",
    [
        "repo:acme/prod;v=1/db",
        "repo:acme/prod;/db",
        "repo:acme/prod./db",
        "repo:acme/prod../db",
        "repo:acme/prod::$DATA/db",
        "repo:acme/prod:$I30:$INDEX_ALLOCATION/db",
    ],
)
def test_a_deny_policy_is_not_dodged_by_a_second_spelling(
    make_agent, make_tool, make_grant, bob, dave, alias
):
    bot = make_agent("bot")
    repo = make_tool("repo", actions=("read", "delete"))
    make_grant(bot, repo, ("delete",), "repo:acme/*")
    _deny_and_approve(bot, repo, deny=(bob, "repo:acme/prod/*"), approve=(dave, "repo:acme/*"))
    _assert_denied_not_dodged("repo", plain="repo:acme/prod/db", alias=alias)


def _assert_denied_not_dodged(tool: str, *, plain: str, alias: str) -> None:
    """`plain` is denied by the deny policy; `alias`, another spelling of it, is refused
    as no resource (scope_mismatch), in the answer and in its event."""
    asked = access.access_check(agent="bot", tool=tool, action="delete", scope=plain, at=NOW)
    assert (asked.decision, asked.reason) == ("deny", "approval_denied")
    aliased = access.access_check(agent="bot", tool=tool, action="delete", scope=alias, at=NOW)
    assert (aliased.decision, aliased.reason) == ("deny", "scope_mismatch")
    event = AuditEvent.objects.get(uid=aliased.decision_id)
    assert (event.decision, event.reason, event.scope) == ("deny", "scope_mismatch", alias)


@pytest.mark.parametrize("value", ["a:b.", "a:b;c", "a:x/..", "a:x/./y", "a:x/y;", "a:.../y"])
def test_second_spellings_are_neither_resources_nor_patterns(value):
    assert not resource_is_canonical(value)
    assert not pattern_is_valid(value)


@pytest.mark.parametrize(
    "value", ["a:.github/x", "a:v1.2/x", "a:x.y-z/w", "repo:acme/api", "sandbox:python:3.12"]
)
def test_dots_inside_a_segment_are_fine(value):
    assert resource_is_canonical(value) and pattern_is_valid(value)


@pytest.mark.parametrize(
    "alias", ["srv/prod/db:x", "srv/prod/db:$DATA", "srv/prod/../prod/db:x", "srv/x/../prod/db:x"]
)
def test_a_path_with_a_colon_is_no_kind_and_does_not_dodge_a_deny(
    make_agent, make_tool, make_grant, bob, dave, alias
):
    """The part before the first `:` was taken as the kind whatever it held: the file
    `srv/prod/db:x` (or the stream `srv/prod/db:$DATA`) was a resource of kind
    `srv/prod/db`, which the deny policy `srv/prod/*` (kind none) never matched, and
    the approve policy `*` allowed it; `..` before the colon passed as canonical."""
    bot = make_agent("bot")
    fs = make_tool("fs", actions=("read", "delete"))
    make_grant(bot, fs, ("delete",), "*")
    _deny_and_approve(bot, fs, deny=(bob, "srv/prod/*"), approve=(dave, "*"))
    _assert_denied_not_dodged("fs", plain="srv/prod/db", alias=alias)
    assert not resource_is_canonical(alias) and not pattern_is_valid(alias)


@pytest.mark.parametrize(
    "value", ["srv/../etc:passwd", "a/..:x", "a/./b:x", "a//b:x", ":x", "a b:x", "1a:x", "a.:x"]
)
def test_a_kind_is_a_name(value):
    assert not resource_is_canonical(value) and not pattern_is_valid(value)


@pytest.mark.parametrize("value", ["s3:bucket/x", "db.prod:t/1", "git+ssh:x", "code_exec:x"])
def test_kinds_that_are_names_are_fine(value):
    assert resource_is_canonical(value) and pattern_is_valid(value)
