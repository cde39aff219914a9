"""The grant services (governance/services/grants.py) at the edges a mutation run found
untested: each test here passes on the services and fails on a one-token change of
them that the other tests let through (the run: /tmp/scratch_grantsmut; each test's
docstring names its mutants). Everything goes through the real services; each test
checks the answer, the rows and the audit event."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group, User

from governance import roles
from governance.audit import Actor
from governance.errors import Conflict, Forbidden, GovernanceError
from governance.models import Agent, AuditEvent, Grant, Tool
from governance.services import access, grants
from tests.conftest import MS, NOW, last_event
from tests.test_services import delegate, request


@pytest.fixture
def bot(make_agent: Any) -> Agent:
    return make_agent("bot")


@pytest.fixture
def repo(make_tool: Any) -> Tool:
    return make_tool("repo")


def data(event: AuditEvent) -> dict[str, Any]:
    return json.loads(event.data)


# --- Requests -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "at_most", "too_many"),
    [
        ("fields", [f"f{i}" for i in range(100)], [f"f{i}" for i in range(101)]),
        (
            "egress",
            [f"h{i}.example.com:443" for i in range(100)],
            [f"h{i}.example.com:443" for i in range(101)],
        ),
        ("justification", "j" * 2000, "j" * 2001),
    ],
)
def test_a_request_at_a_bound_is_filed_and_one_past_it_is_refused_whole(
    bot, repo, alice, field, at_most, too_many
):
    """Mutants s4, s8, s9 (each bound moved up by one). The API's schema has the same
    bounds, but a matrix file reaches the service directly: the service holds them."""
    before = AuditEvent.objects.count()
    with pytest.raises(GovernanceError) as err:
        request(bot, repo, alice, **{field: too_many})
    assert err.value.code == "invalid_grant" and field in err.value.fields
    assert not Grant.objects.exists() and AuditEvent.objects.count() == before
    grant = request(bot, repo, alice, **{field: at_most})
    event = last_event()
    assert (event.event_type, event.grant_id) == ("grant.requested", grant.pk)
    recorded = data(event)[field]
    assert recorded == (list(at_most) if field != "justification" else at_most)


def test_a_blank_justification_is_no_justification(bot, repo, alice):
    """Mutant r1 (`not justification` for `not justification.strip()`): spaces say
    nothing about why the grant is needed."""
    before = AuditEvent.objects.count()
    with pytest.raises(GovernanceError) as err:
        request(bot, repo, alice, justification=" \t\n ")
    assert err.value.code == "justification_required"
    assert not Grant.objects.exists() and AuditEvent.objects.count() == before


def test_an_auditor_files_no_request_through_the_service(bot, repo, alice, bob):
    """Mutant r3 (the service's refuse_read_only dropped): the API refuses an auditor
    at its door, but the service is every door's (a matrix file, a command)."""
    carol = User.objects.create_user("carol", password="pw-carol-123")
    carol.groups.add(Group.objects.get_or_create(name=roles.AUDITORS)[0])
    before = AuditEvent.objects.count()
    with pytest.raises(Forbidden) as err:
        request(bot, repo, carol)
    assert err.value.code == "auditor_read_only"
    assert not Grant.objects.exists() and AuditEvent.objects.count() == before
    # The same request from someone who is not read-only is filed, pending.
    grant = request(bot, repo, bob)
    assert grant.status == Grant.Status.PENDING and grant.requested_by == bob
    assert (last_event().event_type, last_event().grant_id) == ("grant.requested", grant.pk)


def test_a_person_denying_with_the_jobs_words_is_still_a_persons_denial(bot, repo, alice, bob):
    """Mutant p4 (the `approved_by_id is None` clause of closed_by_job dropped): a request
    a person denied is "already denied", whatever words the person chose, never passed
    off as one that lapsed undecided."""
    grant = request(bot, repo, alice)
    grants.grant_deny(
        grant_id=grant.pk,
        approver=bob,
        reason=grants.REQUEST_EXPIRED_REASON,
        actor=Actor.user(bob),
        at=NOW,
    )
    denied = last_event()
    assert (denied.event_type, denied.grant_id) == ("grant.denied", grant.pk)
    assert data(denied)["reason"] == grants.REQUEST_EXPIRED_REASON
    before = AuditEvent.objects.count()
    with pytest.raises(Conflict) as err:
        grants.grant_approve(grant_id=grant.pk, approver=bob, actor=Actor.user(bob), at=NOW + MS)
    assert err.value.code == "not_pending" and "already denied" in err.value.message
    grant.refresh_from_db()
    assert (grant.status, grant.approved_by, grant.starts_at) == ("denied", bob, None)
    assert AuditEvent.objects.count() == before


def test_a_request_the_job_closed_stays_closed_to_an_approver_whose_clock_is_behind(
    bot, repo, alice, bob, system
):
    """Mutant p3 (`closed_by_job or` dropped): a request the expiry job denied is refused
    by its row, not only by the time the approver's process reads: a web process whose
    clock is a millisecond behind the worker's could otherwise make the denied request
    a live grant."""
    grant = request(bot, repo, alice)
    job_at = NOW + grants.settings.GRANT_REQUEST_TTL
    assert grants.grant_requests_expire(actor=system, at=job_at) == 1
    assert (last_event().event_type, last_event().grant_id) == ("grant.request_expired", grant.pk)
    before = AuditEvent.objects.count()
    with pytest.raises(Conflict) as err:
        grants.grant_approve(grant_id=grant.pk, approver=bob, actor=Actor.user(bob), at=job_at - MS)
    assert err.value.code == "request_expired"
    grant.refresh_from_db()
    assert (grant.status, grant.approved_by, grant.starts_at) == ("denied", None, None)
    assert AuditEvent.objects.count() == before
    assert not access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/x", at=job_at - MS
    ).allowed


@pytest.mark.parametrize(
    ("narrowing", "field"),
    [
        ({"actions": ["read", "delete"]}, "actions"),
        ({"actions": ["read", "read"]}, "actions"),
        ({"scope": "repo:*"}, "scope"),
        ({"scope": "git:acme/*"}, "scope"),
        ({"duration": timedelta(hours=2, seconds=1)}, "duration"),
        ({"duration": timedelta(0)}, "duration"),
        ({"delegable": True}, "delegable"),
    ],
)
def test_an_approval_through_the_service_never_widens_the_request(
    bot, repo, alice, bob, narrowing, field
):
    """Mutants n1-n6 (each of _narrowing's refusals dropped or loosened; the web form's
    table in test_ui_views.py catches some, the service is every door's): refused whole
    (400 invalid_narrowing), the request still pending, no event."""
    grant = request(bot, repo, alice, actions=["read", "update"])
    before = AuditEvent.objects.count()
    with pytest.raises(GovernanceError) as err:
        grants.grant_approve(
            grant_id=grant.pk, approver=bob, actor=Actor.user(bob), at=NOW, **narrowing
        )
    assert err.value.code == "invalid_narrowing" and list(err.value.fields) == [field]
    grant.refresh_from_db()
    assert (grant.status, grant.starts_at, grant.scope) == ("pending", None, "repo:acme/*")
    assert AuditEvent.objects.count() == before


def test_an_approval_that_narrows_is_recorded_with_what_was_asked(bot, repo, alice, bob):
    """The narrowings that are allowed, and the approver's reason (mutants a7, a10)."""
    grant = request(bot, repo, alice, actions=["read", "update"], delegable=True)
    approved = grants.grant_approve(
        grant_id=grant.pk, approver=bob, actor=Actor.user(bob), at=NOW,
        actions=["read"], scope="repo:acme/api/*", duration=timedelta(hours=1),
        delegable=False, reason="least privilege",
    )  # fmt: skip
    approved.refresh_from_db()
    assert (approved.status, approved.actions, approved.scope, approved.delegable) == (
        "active", ["read"], "repo:acme/api/*", False,
    )  # fmt: skip
    assert (approved.starts_at, approved.expires_at) == (NOW, NOW + timedelta(hours=1))
    assert approved.decision_reason == "least privilege"
    event = last_event()
    assert (event.event_type, event.grant_id, event.action) == ("grant.issued", grant.pk, "read")
    recorded = data(event)
    assert recorded["reason"] == "least privilege" and recorded["status"] == "active"
    assert recorded["narrowed"] == {
        "actions": ["read"], "scope": "repo:acme/api/*", "duration_seconds": 3600,
        "delegable": False,
    }  # fmt: skip
    assert recorded["requested"] == {
        "actions": ["read", "update"], "scope": "repo:acme/*", "duration_seconds": 7200,
        "delegable": True,
    }  # fmt: skip
    # An approval with no reason records none.
    other = request(bot, repo, alice, scope="repo:other/*")
    grants.grant_approve(grant_id=other.pk, approver=bob, actor=Actor.user(bob), at=NOW)
    assert "reason" not in data(last_event()) and "narrowed" not in data(last_event())


def test_an_issued_grant_needs_a_different_approver_before_anything_is_written(
    bot, repo, bob, system
):
    """Mutant a11 (grant_issue's own `approved_by == requested_by` clause dropped; the
    approval's self_approval check still refuses, with the request's words): a matrix
    import naming one person twice is told what a live grant needs, nothing written."""
    before = AuditEvent.objects.count()
    with pytest.raises(Forbidden) as err:
        grants.grant_issue(
            agent=bot, tool=repo, actions=["read"], scope="repo:acme/*",
            duration=timedelta(hours=1), justification="import", requested_by=bob,
            approved_by=bob, actor=system, at=NOW,
        )  # fmt: skip
    assert err.value.code == "self_approval" and "different approver" in err.value.message
    assert not Grant.objects.exists() and AuditEvent.objects.count() == before


# --- Delegation -----------------------------------------------------------------------


@pytest.fixture
def family(make_agent: Any, repo: Tool, make_grant: Any, make_task: Any) -> Any:
    """parent (a delegable grant on a task) -> child -> grandchild."""
    parent_agent = make_agent("parent")
    child = make_agent("child", parent=parent_agent)
    grandchild = make_agent("grandchild", parent=child)
    parent = make_grant(
        parent_agent, repo, ("read", "update"), "repo:acme/*", delegable=True,
        task=make_task("TICKET-7"),
    )  # fmt: skip
    return parent, child, grandchild


def test_an_empty_action_list_is_a_refused_delegation_on_record(family):
    """Mutant g10 (`or not actions` dropped): nothing to hand down is the agent asking
    outside what it holds (403 wider_actions, its refusal on record), not a 400 that
    leaves no trace."""
    parent, child, _ = family
    before = Grant.objects.count()
    with pytest.raises(Forbidden) as err:
        delegate(parent, child, actions=[])
    assert err.value.code == "wider_actions" and Grant.objects.count() == before
    refused = last_event()
    assert (refused.event_type, refused.decision, refused.reason, refused.grant_id) == (
        "grant.delegation_refused", "deny", "wider_actions", parent.pk,
    )  # fmt: skip
    assert data(refused)["subagent"] == "child" and data(refused)["actions"] == []


def test_a_refused_delegation_names_what_was_asked_in_the_action_column(family):
    """The refusal's action column was empty: a scan of the log's action column for
    `delete` (as for a grant's events) missed an agent asking to hand one down."""
    parent, child, _ = family
    with pytest.raises(Forbidden) as err:
        delegate(parent, child, actions=["read", "delete"])
    assert err.value.code == "wider_actions"
    refused = last_event()
    assert (refused.event_type, refused.action, data(refused)["actions"]) == (
        "grant.delegation_refused", "read,delete", ["read", "delete"],
    )  # fmt: skip
    assert not Grant.objects.filter(agent=child).exists()


def test_a_delegation_ends_after_now_and_no_later_than_its_parent(family):
    """Mutant g16 (`expires_at < at`): a delegation that ends the moment it is made is
    refused (400 invalid_expiry, nothing written); one that ends one millisecond later,
    or exactly with its parent, is made."""
    parent, child, _ = family
    before = (Grant.objects.count(), AuditEvent.objects.count())
    with pytest.raises(GovernanceError) as err:
        delegate(parent, child, expires_at=NOW)
    assert err.value.code == "invalid_expiry"
    assert (Grant.objects.count(), AuditEvent.objects.count()) == before
    brief = delegate(parent, child, expires_at=NOW + MS)
    assert (brief.starts_at, brief.expires_at, brief.status) == (NOW, NOW + MS, "active")
    event = last_event()
    assert (event.event_type, event.grant_id) == ("grant.delegated", brief.pk)
    assert data(event)["expires_at"] == (NOW + MS).isoformat()
    whole = delegate(parent, child, scope="repo:acme/web/*")
    assert whole.expires_at == parent.expires_at and whole.pk != brief.pk


def test_a_delegation_records_its_chain_its_depth_and_its_task(family, settings):
    """Mutants g18 (the event's depth off by one), g25 (the task not carried down),
    g17 (delegated_from not set): each level names the grant it came from, how deep
    it is, and the parent's task, in the row and in its event."""
    parent, child, grandchild = family
    settings.DELEGATION_MAX_DEPTH = 2
    first = delegate(parent, child, delegable=True)
    first_event = last_event()
    second = delegate(first, grandchild, scope="repo:acme/api/core/*", actor=Actor.agent(child))
    second_event = last_event()
    for grant, event, source, depth in (
        (first, first_event, parent, 1),
        (second, second_event, first, 2),
    ):
        grant.refresh_from_db()
        assert (grant.delegated_from_id, grant.task_id) == (source.pk, parent.task_id)
        assert (event.event_type, event.grant_id, event.task) == (
            "grant.delegated", grant.pk, "TICKET-7",
        )  # fmt: skip
        assert (data(event)["delegated_from"], data(event)["depth"]) == (source.pk, depth)
    assert [g.pk for g in second.chain()] == [second.pk, first.pk, parent.pk]


def test_asking_again_never_returns_a_delegation_that_has_ended(family, system):
    """Mutant g19 (the `status=active` filter of the twin lookup dropped): a delegation
    the expiry job already closed (a worker whose clock runs ahead) is no answer to the
    same request: a new, live one is made, with its own event."""
    parent, child, _ = family
    first = delegate(parent, child, expires_at=NOW + timedelta(minutes=10))
    assert grants.grants_expire(actor=system, at=NOW + timedelta(minutes=10)) == 1
    assert (last_event().event_type, last_event().grant_id) == ("grant.expired", first.pk)
    again = delegate(parent, child, expires_at=NOW + timedelta(minutes=10), at=NOW + MS)
    assert again.pk != first.pk and again.status == "active"
    first.refresh_from_db()
    assert first.status == "expired"
    event = last_event()
    assert (event.event_type, event.grant_id, event.agent) == ("grant.delegated", again.pk, "child")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"delegable": True}, {"delegable": False}),
        ({}, {"expires_at": NOW + timedelta(minutes=5)}),
        ({}, {"limits": {"memory_mb": 64}}),
    ],
)
def test_asking_again_with_a_narrower_envelope_is_a_new_delegation(family, settings, first, second):
    """Mutants g20-g23 (a field of the twin lookup dropped): a delegation that differs
    only in being handed down again, in its expiry or in a limit is not "the same":
    the narrower one is made as asked, with its own event, never answered with the
    wider twin."""
    parent, child, _ = family
    settings.DELEGATION_MAX_DEPTH = 2
    wide = delegate(parent, child, **first)
    narrow = delegate(parent, child, **second)
    assert narrow.pk != wide.pk
    narrow.refresh_from_db()
    assert narrow.delegable is second.get("delegable", False)
    assert narrow.expires_at == second.get("expires_at", parent.expires_at)
    assert narrow.limits() == second.get("limits", {})
    event = last_event()
    assert (event.event_type, event.grant_id) == ("grant.delegated", narrow.pk)
    assert (data(event)["delegable"], data(event)["limits"]) == (
        narrow.delegable, second.get("limits", {}),
    )  # fmt: skip
    assert AuditEvent.objects.filter(event_type="grant.delegated").count() == 2


def test_a_delegation_names_fields_under_a_parent_with_none_and_keeps_its_egress_spelling(
    family, make_grant, repo
):
    """Mutants e3 (a parent with no field list refusing any) and e7 (the delegation's
    egress kept as the subagent spelled it): a parent with no field list covers any
    list, and an egress entry is stored as the parent's grant spells it (compared as
    the proxy reads it), in the row and in the event."""
    parent, child, _ = family
    with_egress = make_grant(
        parent.agent, repo, ("read",), "repo:other/*", delegable=True,
        egress=["API.Example.com:443"],
    )  # fmt: skip
    fields = delegate(parent, child, fields=["title"])
    assert fields.fields == ["title"] and parent.fields == []
    assert data(last_event())["fields"] == ["title"]
    handed = delegate(with_egress, child, scope="repo:other/x", egress=["api.example.com:0443"])
    handed.refresh_from_db()
    assert handed.egress == ["API.Example.com:443"]
    event = last_event()
    assert (event.event_type, event.grant_id) == ("grant.delegated", handed.pk)
    assert data(event)["egress"] == ["API.Example.com:443"]


# --- Revoke ---------------------------------------------------------------------------


def test_a_person_overruling_a_grandchild_withdraws_delegation_all_the_way_up(
    family, bob, settings
):
    """Mutant o5 (the ancestor walk cut to one level): a person revoking the grandchild's
    grant withdraws delegation from the child's grant and from the root, each with its
    event, so neither can hand the same back."""
    parent, child, grandchild = family
    settings.DELEGATION_MAX_DEPTH = 2
    first = delegate(parent, child, delegable=True)
    second = delegate(first, grandchild, scope="repo:acme/api/core/*", actor=Actor.agent(child))
    ended = grants.grant_revoke(
        grant_id=second.pk, reason="review", actor=Actor.user(bob), at=NOW, revoked_by=bob
    )
    assert [g.pk for g in ended] == [second.pk]
    for grant in (parent, first):
        grant.refresh_from_db()
        assert grant.delegable is False and grant.status == "active"
    withdrawn = AuditEvent.objects.filter(event_type="grant.delegation_withdrawn")
    assert sorted(withdrawn.values_list("grant_id", flat=True)) == [parent.pk, first.pk]
    assert {data(e)["overruled"] for e in withdrawn} == {second.pk}
    with pytest.raises(Forbidden) as err:
        delegate(first, grandchild, scope="repo:acme/api/core/*", actor=Actor.agent(child))
    assert err.value.code == "not_delegable"


def test_a_revoke_at_the_moment_a_delegation_ran_out_overrules_nothing(family, bob):
    """Mutant o2 (`expires_at__gte`): a delegation that ended at the very moment a person
    revokes it had already expired: nothing is revoked and its parent stays delegable,
    with no event."""
    parent, child, _ = family
    handed = delegate(parent, child, expires_at=NOW + timedelta(minutes=5))
    before = AuditEvent.objects.count()
    ended = grants.grant_revoke(
        grant_id=handed.pk, reason="late", actor=Actor.user(bob),
        at=NOW + timedelta(minutes=5), revoked_by=bob,
    )  # fmt: skip
    assert ended == []
    parent.refresh_from_db()
    handed.refresh_from_db()
    assert parent.delegable is True and (handed.status, handed.revoked_at) == ("active", None)
    assert AuditEvent.objects.count() == before


def test_a_back_dated_revoke_overrules_a_delegation_live_at_its_effective_moment(family, bob):
    """Mutant o6 (_overruled asked at the recording time, not the effective one): a
    delegation live when the revoke took effect, though run out by when it was
    recorded, is overruled: revoked as of then, its parent no longer delegable."""
    parent, child, _ = family
    handed = delegate(parent, child, expires_at=NOW + timedelta(minutes=5))
    ended = grants.grant_revoke(
        grant_id=handed.pk, reason="review due", actor=Actor.user(bob),
        at=NOW + timedelta(minutes=10), revoked_by=bob, effective_at=NOW + timedelta(minutes=1),
    )  # fmt: skip
    assert [g.pk for g in ended] == [handed.pk]
    handed.refresh_from_db()
    parent.refresh_from_db()
    assert (handed.status, handed.revoked_at) == ("revoked", NOW + timedelta(minutes=1))
    assert parent.delegable is False
    revoked = AuditEvent.objects.get(event_type="grant.revoked", grant_id=handed.pk)
    assert data(revoked)["effective_at"] == (NOW + timedelta(minutes=1)).isoformat()
    withdrawn = last_event()
    assert (withdrawn.event_type, withdrawn.grant_id) == ("grant.delegation_withdrawn", parent.pk)


def test_revoking_a_parent_and_its_child_together_ends_each_once(family, system):
    """Mutant v11 (the `seen` check dropped): a child named beside its parent is ended
    once, through the parent, with one event naming the cascade."""
    parent, child, _ = family
    handed = delegate(parent, child)
    ended = grants.grants_revoke(
        grant_ids=[handed.pk, parent.pk], reason="incident", actor=system, at=NOW
    )
    assert sorted(g.pk for g in ended) == sorted([parent.pk, handed.pk])
    events = AuditEvent.objects.filter(event_type="grant.revoked")
    assert sorted(events.values_list("grant_id", flat=True)) == sorted([parent.pk, handed.pk])
    assert data(events.get(grant_id=handed.pk))["cascade_from"] == parent.pk
    assert "cascade_from" not in data(events.get(grant_id=parent.pk))
    assert "effective_at" not in data(events.get(grant_id=parent.pk))


def test_an_owner_revoking_a_pending_request_is_not_named_its_decider(bot, repo, alice, bob):
    """Mutant v12 (the revoker named as approver of a refused request): the agent's
    owner withdrawing a request somebody else filed is no decider; the request is
    denied, with a grant.denied event."""
    grant = request(bot, repo, bob)
    ended = grants.grant_revoke(
        grant_id=grant.pk, reason="not needed", actor=Actor.user(alice), at=NOW, revoked_by=alice
    )
    assert [g.pk for g in ended] == [grant.pk]
    grant.refresh_from_db()
    assert (grant.status, grant.approved_by, grant.revoked_by, grant.decided_at) == (
        "denied", None, alice, NOW,
    )  # fmt: skip
    event = last_event()
    assert (event.event_type, event.grant_id, data(event)["reason"]) == (
        "grant.denied", grant.pk, "not needed",
    )  # fmt: skip


def test_revoking_an_ended_delegation_again_overrules_nothing(family, bob, system):
    """Mutant o3 (_overruled's `status=active` dropped): a delegation already revoked
    (by no person) and revoked again by a person changes nothing: its parent stays
    delegable and no event is written."""
    parent, child, _ = family
    handed = delegate(parent, child)
    grants.grant_revoke(grant_id=handed.pk, reason="task done", actor=system, at=NOW)
    before = AuditEvent.objects.count()
    again = grants.grant_revoke(
        grant_id=handed.pk, reason="again", actor=Actor.user(bob), at=NOW + MS, revoked_by=bob
    )
    assert again == []
    parent.refresh_from_db()
    handed.refresh_from_db()
    assert parent.delegable is True
    assert (handed.status, handed.revoked_at, handed.revoked_by) == ("revoked", NOW, None)
    assert AuditEvent.objects.count() == before


def test_a_revoke_back_dated_before_a_grant_started_ends_it_at_its_start(bot, repo, make_grant):
    """Mutant v6 (revoked_at = the effective moment, even before the grant started):
    a grant never ends before it began; the event says when it ended."""
    grant = make_grant(bot, repo)  # starts NOW - 30 min
    ended = grants.grant_revoke(
        grant_id=grant.pk, reason="review due", actor=Actor.system("reviews"), at=NOW,
        effective_at=NOW - timedelta(hours=1),
    )  # fmt: skip
    assert [g.pk for g in ended] == [grant.pk]
    grant.refresh_from_db()
    assert (grant.status, grant.revoked_at) == ("revoked", grant.starts_at)
    event = last_event()
    assert (event.event_type, event.grant_id) == ("grant.revoked", grant.pk)
    assert data(event)["effective_at"] == grant.starts_at.isoformat()


def test_a_revoke_needs_a_grant_that_exists_and_a_reason_that_says_something(
    bot, repo, make_grant, system
):
    """Mutants v7 (an unknown grant id revoked in silence) and v8 (a blank reason taken):
    both refused, nothing changed, no event."""
    grant = make_grant(bot, repo)
    before = AuditEvent.objects.count()
    with pytest.raises(Grant.DoesNotExist):
        grants.grants_revoke(grant_ids=[grant.pk, grant.pk + 999], reason="x", actor=system, at=NOW)
    with pytest.raises(GovernanceError) as err:
        grants.grant_revoke(grant_id=grant.pk, reason="  \n", actor=system, at=NOW)
    assert err.value.code == "reason_required"
    grant.refresh_from_db()
    assert (grant.status, grant.revoked_at) == ("active", None)
    assert AuditEvent.objects.count() == before
