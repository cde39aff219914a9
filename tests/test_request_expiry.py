"""Grant requests nobody decides within GRANT_REQUEST_TTL are closed by the expiry job:
denied with a clear reason, one event per request, however often the job runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta

import pytest
from django.conf import settings

from governance.audit import Actor
from governance.codes import EventType
from governance.errors import Conflict
from governance.models import AuditEvent, Grant
from governance.services import grants
from governance.services.grants import REQUEST_EXPIRED_REASON, grant_requests_expire
from tests.conftest import MS, NOW


def events(event_type: str, **filters: object) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(event_type=event_type, **filters).order_by("seq"))


@pytest.fixture
def request_at(make_agent, make_tool, alice, system):
    """A pending request made at `created_at` (the service's clock, which it keeps)."""
    agent, tool = make_agent(), make_tool()

    def make(created_at: datetime, scope: str = "repo:acme/api/*") -> Grant:
        grant = grants.grant_request(
            agent=agent,
            tool=tool,
            actions=["read"],
            scope=scope,
            duration=timedelta(hours=1),
            justification="need it",
            requested_by=alice,
            actor=system,
            at=created_at,
        )
        assert Grant.objects.get(pk=grant.pk).created_at == created_at
        return grant

    return make


def test_the_default_request_ttl_is_three_days():
    assert settings.GRANT_REQUEST_TTL == timedelta(hours=72)


def test_a_request_expires_exactly_at_its_ttl_and_only_once(request_at, system):
    grant = request_at(NOW)
    due = NOW + settings.GRANT_REQUEST_TTL

    assert grant_requests_expire(actor=system, at=due - MS) == 0
    assert Grant.objects.get(pk=grant.pk).status == Grant.Status.PENDING
    assert events(EventType.GRANT_REQUEST_EXPIRED) == []

    assert grant_requests_expire(actor=system, at=due) == 1
    assert grant_requests_expire(actor=system, at=due + MS) == 0
    assert grant_requests_expire(actor=system, at=due + timedelta(days=9)) == 0

    grant.refresh_from_db()
    assert grant.status == Grant.Status.DENIED
    assert grant.decision_reason == REQUEST_EXPIRED_REASON
    assert grant.decided_at == due
    assert (grant.starts_at, grant.expires_at, grant.approved_by_id) == (None, None, None)
    (event,) = events(EventType.GRANT_REQUEST_EXPIRED, grant_id=grant.pk)
    assert event.actor == "system:test"
    data = json.loads(event.data)
    assert (data["status"], data["reason"]) == ("denied", REQUEST_EXPIRED_REASON)


def test_a_request_one_millisecond_younger_than_the_ttl_stays_pending(request_at, system):
    due = NOW + settings.GRANT_REQUEST_TTL
    young = request_at(NOW + MS)
    old = request_at(NOW - MS, scope="repo:acme/web/*")

    assert grant_requests_expire(actor=system, at=due) == 1
    assert Grant.objects.get(pk=young.pk).status == Grant.Status.PENDING
    assert Grant.objects.get(pk=old.pk).status == Grant.Status.DENIED
    assert [e.grant_id for e in events(EventType.GRANT_REQUEST_EXPIRED)] == [old.pk]


def test_the_ttl_comes_from_the_setting(request_at, system, settings):
    settings.GRANT_REQUEST_TTL = timedelta(hours=1)
    grant = request_at(NOW)
    assert grant_requests_expire(actor=system, at=NOW + timedelta(hours=1) - MS) == 0
    assert grant_requests_expire(actor=system, at=NOW + timedelta(hours=1)) == 1
    assert Grant.objects.get(pk=grant.pk).status == Grant.Status.DENIED


def test_approved_and_denied_requests_are_left_alone(request_at, bob, system):
    approved = request_at(NOW)
    denied = request_at(NOW, scope="repo:acme/web/*")
    grants.grant_approve(grant_id=approved.pk, approver=bob, actor=Actor.user(bob), at=NOW)
    grants.grant_deny(grant_id=denied.pk, approver=bob, reason="no", actor=Actor.user(bob), at=NOW)

    assert grant_requests_expire(actor=system, at=NOW + timedelta(days=30)) == 0
    approved.refresh_from_db()
    denied.refresh_from_db()
    assert approved.status == Grant.Status.ACTIVE
    assert (denied.status, denied.decision_reason) == (Grant.Status.DENIED, "no")
    assert events(EventType.GRANT_REQUEST_EXPIRED) == []


def test_an_expired_request_can_no_longer_be_approved_or_denied(request_at, bob, system):
    grant = request_at(NOW)
    later = NOW + settings.GRANT_REQUEST_TTL
    grant_requests_expire(actor=system, at=later)
    before = AuditEvent.objects.count()

    with pytest.raises(Conflict) as approving:
        grants.grant_approve(grant_id=grant.pk, approver=bob, actor=Actor.user(bob), at=later)
    assert approving.value.code == "request_expired"  # as before the job ran
    with pytest.raises(Conflict):
        grants.grant_deny(
            grant_id=grant.pk, approver=bob, reason="no", actor=Actor.user(bob), at=later
        )

    grant.refresh_from_db()
    assert (grant.status, grant.starts_at) == (Grant.Status.DENIED, None)
    assert AuditEvent.objects.count() == before


def test_an_expired_request_frees_its_slot_for_a_new_one(request_at, system):
    # One pending request per thing: closing the stale one lets the agent ask again.
    request_at(NOW)
    grant_requests_expire(actor=system, at=NOW + settings.GRANT_REQUEST_TTL)
    again = request_at(NOW + settings.GRANT_REQUEST_TTL)
    assert again.status == Grant.Status.PENDING


@pytest.mark.parametrize("value", ["0", "-1", "three days", "1.5", ""])
def test_a_bad_request_ttl_stops_start_up(value):
    env = {**os.environ, "GRANT_REQUEST_TTL_HOURS": value}
    proc = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env={**env, "DJANGO_SETTINGS_MODULE": "governance.settings"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "ImproperlyConfigured" in proc.stderr and "GRANT_REQUEST_TTL_HOURS" in proc.stderr


def test_a_request_past_its_ttl_is_refused_even_if_the_job_never_ran(request_at, bob, system):
    """Decided by time, not by the job: a two-week-old request was still approvable."""
    grant = request_at(NOW)
    late = NOW + settings.GRANT_REQUEST_TTL
    before = AuditEvent.objects.count()
    with pytest.raises(Conflict) as approving:
        grants.grant_approve(grant_id=grant.pk, approver=bob, actor=Actor.user(bob), at=late)
    assert approving.value.code == "request_expired" and approving.value.status == 409
    assert "expired undecided" in approving.value.message
    with pytest.raises(Conflict) as denying:
        grants.grant_deny(
            grant_id=grant.pk, approver=bob, reason="no", actor=Actor.user(bob), at=late
        )
    assert denying.value.code == "request_expired"
    grant.refresh_from_db()
    assert (grant.status, grant.starts_at, grant.approved_by) == (Grant.Status.PENDING, None, None)
    assert AuditEvent.objects.count() == before  # nothing recorded, nothing issued
    # One millisecond younger it is still an ordinary decision, with its event.
    young = request_at(NOW + MS, scope="repo:acme/web/*")
    issued = grants.grant_approve(grant_id=young.pk, approver=bob, actor=Actor.user(bob), at=late)
    assert issued.status == Grant.Status.ACTIVE
    (event,) = events(EventType.GRANT_ISSUED, grant_id=young.pk)
    assert event.actor == "user:bob"
    # The job then closes the stale one as usual, once.
    assert grant_requests_expire(actor=system, at=late) == 1
    assert len(events(EventType.GRANT_REQUEST_EXPIRED, grant_id=grant.pk)) == 1


def test_an_expired_request_gets_the_same_answer_after_the_job_ran(request_at, bob, system):
    """Once the job had closed it, approving or denying said `not_pending`, "already
    denied", as if a person had denied it; the README promises `request_expired`
    whether or not the job has run. A person's denial still reads as one."""
    grant = request_at(NOW)
    late = NOW + settings.GRANT_REQUEST_TTL + MS
    assert grant_requests_expire(actor=system, at=late) == 1
    before = AuditEvent.objects.count()
    for decide in (
        lambda: grants.grant_approve(
            grant_id=grant.pk, approver=bob, actor=Actor.user(bob), at=late
        ),
        lambda: grants.grant_deny(
            grant_id=grant.pk, approver=bob, reason="no", actor=Actor.user(bob), at=late
        ),
    ):
        with pytest.raises(Conflict) as refused:
            decide()
        assert (
            refused.value.code == "request_expired" and "expired undecided" in refused.value.message
        )
    assert AuditEvent.objects.count() == before
    denied = request_at(NOW, scope="repo:acme/web/*")
    grants.grant_deny(grant_id=denied.pk, approver=bob, reason="no", actor=Actor.user(bob), at=NOW)
    with pytest.raises(Conflict) as again:
        grants.grant_approve(grant_id=denied.pk, approver=bob, actor=Actor.user(bob), at=late)
    assert again.value.code == "not_pending"


def test_every_grant_is_made_at_the_services_clock_not_the_wall_clock(
    make_agent, make_tool, make_grant, approvers, system
):
    """Grant.created_at was auto_now_add: a request, a delegation and a break-glass grant
    were stamped with the wall clock, so the expiry job and the stakeholder checks,
    which use the service's `at`, misjudged any request not made "now" (a ratification
    filed at T expired by T + TTL was not closed)."""
    from governance.services import breakglass as bgs

    erin, frank = approvers[0], approvers[1]
    agent, tool = make_agent(), make_tool()
    sub = make_agent("sub", parent=agent)
    opened = bgs.breakglass_open(
        opener=erin, agent=agent, tool=tool, actions=["read"], scope="repo:acme/api/*",
        ticket="INC-1", reason="outage", actor=Actor.user(erin), at=NOW,
    )  # fmt: skip
    at = NOW + timedelta(hours=2)
    ratified = bgs.breakglass_ratify(
        breakglass_id=opened.pk, reviewer=frank, comment="ok", actor=Actor.user(frank), at=at
    )
    parent = make_grant(agent, tool, ("read",), "repo:acme/*", delegable=True)
    handed = grants.grant_delegate(
        parent_grant_id=parent.pk, child=sub, actions=["read"], scope="repo:acme/api/*",
        expires_at=parent.expires_at, justification="sub", actor=system, at=NOW + MS,
    )  # fmt: skip
    request = ratified.ratified_request
    made = Grant.objects.in_bulk([opened.grant_id, request.pk, handed.pk])
    assert [made[pk].created_at for pk in (opened.grant_id, request.pk, handed.pk)] == [
        NOW,
        at,
        NOW + MS,
    ]
    due = at + settings.GRANT_REQUEST_TTL
    assert grant_requests_expire(actor=system, at=due - MS) == 0
    assert grant_requests_expire(actor=system, at=due) == 1
    assert Grant.objects.get(pk=request.pk).status == "denied"
    closed = events(EventType.GRANT_REQUEST_EXPIRED, grant_id=request.pk)
    assert len(closed) == 1 and json.loads(closed[0].data)["created_at"] == at.isoformat()
