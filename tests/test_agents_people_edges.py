"""Edges of agents, their tokens and people's accounts that the other files left open:
each test here fails on a one-token change of services.agents, services.people or
api.auth (named in its docstring) and checks the answer, the rows and the events."""

from __future__ import annotations

import json
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.contrib.auth.models import Group, User
from django.contrib.sessions.models import Session
from django.test import Client
from django.utils import timezone

from governance import roles
from governance.audit import Actor
from governance.errors import Conflict, GovernanceError
from governance.models import Agent, AgentToken, Approval
from governance.services import access, agents, approvals
from tests.api_fixtures import _client
from tests.conftest import MS, NOW, last_event
from tests.test_api_authorize import _unauth
from tests.test_services import _events_after, _top_seq

pytestmark = pytest.mark.django_db


# --- Agents -------------------------------------------------------------------------------


def test_a_subagent_is_refused_under_a_parent_suspended_since_it_was_read(
    make_agent, alice, system
):
    """The parent as the caller read it (active) is not what counts: its row is read
    again, locked. With the caller's stale copy, a subagent was created under an agent
    suspended meanwhile, a way around the kill switch (A02). Its event names its parent
    (A03)."""
    root = make_agent("root")
    read_earlier = make_agent("middle", parent=root)
    agents.agent_suspend(
        agent=Agent.objects.get(pk=read_earlier.pk), reason="incident", actor=system, at=NOW
    )
    assert read_earlier.status == "active"  # the caller's copy
    seq = _top_seq()
    with pytest.raises(Conflict) as refused:
        agents.agent_create(name="sneak", owner=alice, parent=read_earlier, actor=system, at=NOW)
    assert (refused.value.code, refused.value.status) == ("parent_suspended", 409)
    assert not Agent.objects.filter(name="sneak").exists()
    assert _top_seq() == seq

    leaf = agents.agent_create(name="leaf", owner=alice, parent=root, actor=system, at=NOW)
    assert (leaf.parent_id, leaf.status) == (root.pk, "active")
    assert _events_after(seq) == [
        ("agent.created", system.label, "leaf", {"owner": "alice", "parent": "root"})
    ]


def test_a_suspension_voids_an_approved_call_not_yet_made(make_agent, make_tool, make_grant,
                                                          bob, system):  # fmt: skip
    """An approval already approved but not yet used is voided with the pending ones:
    the agent must not fire a destructive call approved before the kill switch after
    its resume (A09 left it approved)."""
    bot = make_agent("bot")
    repo = make_tool("repo")
    make_grant(bot, repo, ("read", "delete"), "repo:acme/*")
    asked = access.access_check(
        agent="bot", tool="repo", action="delete", scope="repo:acme/x", at=NOW
    )
    approvals.approval_approve(
        approval_id=asked.approval_id, approver=bob, actor=Actor.user(bob), at=NOW
    )
    assert Approval.objects.get(pk=asked.approval_id).status == "approved"
    seq = _top_seq()

    agents.agent_suspend(agent=bot, reason="token leaked", actor=system, at=NOW + MS)

    assert Approval.objects.get(pk=asked.approval_id).status == "expired"
    assert _events_after(seq) == [
        ("agent.suspended", system.label, "bot",
         {"reason": "token leaked", "approvals_voided": 1, "requests_withdrawn": [],
          "approve_policies_ended": []}),
    ]  # fmt: skip


# --- Tokens: issue and revoke -------------------------------------------------------------


def test_a_token_may_live_exactly_the_maximum_and_not_a_day_more(make_agent, alice, system,
                                                                 settings):  # fmt: skip
    """The lifetime is 1 to AGENT_TOKEN_MAX_DAYS days, both ends included (A20 refused
    the maximum); the event says when it expires (A32)."""
    bot = make_agent("bot")
    most = settings.AGENT_TOKEN_MAX_DAYS
    seq = _top_seq()
    with pytest.raises(GovernanceError) as refused:
        agents.token_issue(created_by=alice, agent=bot, actor=system, at=NOW, days=most + 1)
    assert refused.value.code == "invalid_expiry"
    assert not AgentToken.objects.exists() and _top_seq() == seq

    token, plaintext = agents.token_issue(
        created_by=alice, agent=bot, actor=system, at=NOW, days=most
    )
    assert token.expires_at == NOW + timedelta(days=most)
    assert plaintext.startswith(f"agt_{token.prefix}_")
    assert _events_after(seq) == [
        ("agent_token.issued", system.label, "bot",
         {"prefix": token.prefix, "holder": "bot",
          "expires_at": (NOW + timedelta(days=most)).isoformat()}),
    ]  # fmt: skip


def test_a_personal_token_is_issued_in_its_holders_name(alice, bob, system):
    """A person's token: `usr_`, no agent, and its event names the person who holds it
    (A25 left the holder blank) and when it expires (A32)."""
    seq = _top_seq()
    token, plaintext = agents.token_issue(created_by=alice, user=bob, actor=system, at=NOW, days=2)
    assert (token.agent_id, token.user_id) == (None, bob.pk)
    assert plaintext.startswith(f"usr_{token.prefix}_")
    assert _events_after(seq) == [
        ("agent_token.issued", system.label, "",
         {"prefix": token.prefix, "holder": "bob",
          "expires_at": (NOW + timedelta(days=2)).isoformat()}),
    ]  # fmt: skip


def test_revoking_a_token_twice_keeps_the_first_revocation(make_agent, alice, system):
    """The second revoke changes nothing: the row keeps when it was revoked and no
    second event is written (A26 moved revoked_at and announced it again). The event
    names the token's agent (A27)."""
    bot = make_agent("bot")
    token, _ = agents.token_issue(created_by=alice, agent=bot, actor=system, at=NOW)
    seq = _top_seq()
    agents.token_revoke(token=token, actor=system, at=NOW + MS)
    again = agents.token_revoke(token=token, actor=system, at=NOW + 2 * MS)
    assert again.revoked_at == NOW + MS
    assert AgentToken.objects.get(pk=token.pk).revoked_at == NOW + MS
    assert _events_after(seq) == [
        ("agent_token.revoked", system.label, "bot", {"prefix": token.prefix}),
    ]


def test_a_resume_revokes_only_the_tokens_still_live_oldest_first(make_agent, alice, system):
    """At the resume, a token that expires exactly then is already dead (A28 revoked and
    announced it), one revoked before keeps its revocation (A29 moved it and announced
    it again), and the live ones are revoked oldest first (A30 reversed them)."""
    bot = make_agent("bot")
    resume_at = NOW + timedelta(hours=1)
    ends_then, _ = agents.token_issue(
        created_by=alice, agent=bot, actor=system, at=resume_at - timedelta(days=1), days=1
    )
    older, _ = agents.token_issue(created_by=alice, agent=bot, actor=system, at=NOW - MS)
    gone, _ = agents.token_issue(created_by=alice, agent=bot, actor=system, at=NOW - MS)
    agents.token_revoke(token=gone, actor=system, at=NOW - MS)
    newer, _ = agents.token_issue(created_by=alice, agent=bot, actor=system, at=NOW - MS)
    agents.agent_suspend(agent=bot, reason="incident", actor=system, at=NOW)
    seq = _top_seq()

    agents.agent_resume(agent=bot, reason="cleared", actor=system, at=resume_at)

    revoked = dict(AgentToken.objects.values_list("prefix", "revoked_at"))
    assert revoked == {
        ends_then.prefix: None,
        older.prefix: resume_at,
        gone.prefix: NOW - MS,
        newer.prefix: resume_at,
    }
    assert _events_after(seq) == [
        ("agent_token.revoked", system.label, "bot", {"prefix": older.prefix}),
        ("agent_token.revoked", system.label, "bot", {"prefix": newer.prefix}),
        ("agent.reactivated", system.label, "bot",
         {"reason": "cleared", "suspended_at": NOW.isoformat(),
          "tokens_revoked": [older.prefix, newer.prefix]}),
    ]  # fmt: skip


# --- Token authentication -----------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch):
    """The API's clock, set by the test: the bearer check reads timezone.now() itself."""
    from governance.api import auth

    moment = SimpleNamespace(now=lambda: NOW)
    monkeypatch.setattr(auth, "timezone", moment)
    return moment


def test_a_token_is_refused_at_the_exact_moment_it_expires(make_agent, alice, system, clock):
    """Expiry is enforced at the decision: one millisecond before `expires_at` the token
    works (and its use is recorded), at `expires_at` itself it is refused with the same
    401 as any bad token (M01 let it in at that moment)."""
    bot = make_agent("bot")
    token, plaintext = agents.token_issue(
        created_by=alice, agent=bot, actor=system, at=NOW - timedelta(days=1), days=1
    )
    assert token.expires_at == NOW
    api = _client(plaintext)
    seq = _top_seq()

    clock.now = lambda: NOW - MS
    assert api.get("/api/v1/me").status_code == 200
    assert AgentToken.objects.get(pk=token.pk).last_used_at == NOW - MS

    clock.now = lambda: NOW
    assert _unauth(api.get("/api/v1/me"))
    assert AgentToken.objects.get(pk=token.pk).last_used_at == NOW - MS
    assert _top_seq() == seq  # a read: no event either way


def test_a_tokens_last_use_is_refreshed_at_most_once_a_minute(make_agent, alice, system, clock):
    """last_used_at is bookkeeping, written when it is a minute old or more: not on every
    request (U06, U12 wrote it each time), and still when it is older (U07 never did
    once it was set)."""
    bot = make_agent("bot")
    token, plaintext = agents.token_issue(created_by=alice, agent=bot, actor=system, at=NOW)
    api = _client(plaintext)

    def used_at(moment):
        clock.now = lambda: moment
        assert api.get("/api/v1/me").status_code == 200
        return AgentToken.objects.get(pk=token.pk).last_used_at

    assert used_at(NOW) == NOW
    assert used_at(NOW + timedelta(seconds=30)) == NOW
    assert used_at(NOW + timedelta(seconds=60)) == NOW
    assert used_at(NOW + timedelta(seconds=60) + MS) == NOW + timedelta(seconds=60) + MS


# --- People -------------------------------------------------------------------------------


def _admin_signed_in_with_a_token(bob: User, system: Actor) -> tuple[AgentToken, str]:
    """bob made an admin, with a web session and a personal API token."""
    bob.groups.add(Group.objects.get_or_create(name=roles.ADMINS)[0])
    Client().force_login(bob)
    return agents.token_issue(created_by=bob, user=bob, actor=system, at=timezone.now())


def test_a_deactivation_saved_with_update_fields_ends_sessions_and_tokens(bob, system):
    """`save(update_fields=["is_active"])` writes the deactivation as a full save does:
    the person's sessions end and their live tokens are revoked, on record (P04 skipped
    both when update_fields named is_active)."""
    token, plaintext = _admin_signed_in_with_a_token(bob, system)
    seq = _top_seq()

    bob.is_active = False
    bob.save(update_fields=["is_active"])

    assert not Session.objects.exists()
    assert AgentToken.objects.get(pk=token.pk).revoked_at is not None
    events = _events_after(seq)
    assert [(kind, agent, data.get("prefix")) for kind, _, agent, data in events] == [
        ("agent_token.revoked", "", token.prefix),
        ("person.changed", "", None),
    ]
    changed = events[-1][3]
    assert changed["changed"] == {"is_active": {"before": True, "after": False}}
    assert (changed["tokens_revoked"], changed["sessions_ended"]) == ([token.prefix], 1)
    bob.is_active = True
    bob.save()
    assert _unauth(_client(plaintext).get("/api/v1/agents"))
    assert User.objects.get(pk=bob.pk).is_active
    assert json.loads(last_event().data)["changed"] == {
        "is_active": {"before": False, "after": True}
    }


def test_a_save_of_some_fields_is_on_record_with_only_the_fields_it_wrote(bob, system):
    """save(update_fields=[...]) writes those columns only: what else the instance holds
    (changed in memory, or a stale copy) stays as the row has it. The event said the
    account was switched off and made superuser when neither was written, a false
    record of who could do what."""
    token, plaintext = _admin_signed_in_with_a_token(bob, system)
    seq = _top_seq()

    bob.is_active, bob.is_superuser, bob.first_name = False, True, "Bob"
    bob.save(update_fields=["first_name"])
    row = User.objects.get(pk=bob.pk)
    assert (row.first_name, row.is_active, row.is_superuser) == ("Bob", True, False)
    assert _top_seq() == seq  # first_name is not tracked: nothing to record

    bob.email = "bob@example.test"
    bob.save(update_fields=["email", "is_superuser"])
    row = User.objects.get(pk=bob.pk)
    assert (row.email, row.is_active, row.is_superuser) == ("bob@example.test", True, True)
    assert [(kind, data["changed"]) for kind, _, _, data in _events_after(seq)] == [
        ("person.changed", {"is_superuser": {"before": False, "after": True}}),
    ]
    assert Session.objects.count() == 1
    assert AgentToken.objects.get(pk=token.pk).revoked_at is None
    assert _client(plaintext).get("/api/v1/agents").status_code == 200
