"""Break-glass: a human opens it with a ticket, it is live at once and flagged in every
decision and event, skipped approvers hear of it, and its review must be closed by
someone else within 24 h or it is overdue. Every service is called twice."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import Group
from django.core import mail
from django.core.management import CommandError, call_command

from governance import roles, selectors
from governance.api.auth import AgentPrincipal
from governance.audit import Actor
from governance.codes import EventType, NotificationEvent, Reason
from governance.errors import Conflict, Forbidden, GovernanceError, RateLimited
from governance.models import AuditEvent, BreakGlass, Grant, Notification, ReviewCampaign
from governance.policy import authorize
from governance.services import breakglass as bgs
from governance.services.access import access_check
from governance.services.grants import grants_expire
from tests.conftest import MS, NOW
from tests.lifecycle_fixtures import breakglass_written as _written

SCOPE = "repo:acme/api/*"


def events(event_type: str, **filters: object) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(event_type=event_type, **filters).order_by("seq"))


@pytest.fixture
def setup(bg_world):
    """bg_world (tests.lifecycle_fixtures), which open_bg opens break-glass in."""
    return bg_world


def ask(at, action="update"):
    return {"agent": "bot", "tool": "repo", "action": action, "scope": "repo:acme/api/x", "at": at}


def test_opening_is_a_live_flagged_grant_at_once_and_opening_twice_is_one(
    setup, open_bg, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        bg = open_bg()
        again = open_bg()
    assert again.pk == bg.pk and BreakGlass.objects.count() == 1

    grant = bg.grant
    assert (grant.status, grant.break_glass, grant.approved_by) == ("active", True, None)
    assert (grant.starts_at, grant.expires_at) == (NOW, NOW + timedelta(hours=1))
    assert bg.review_due_at == NOW + timedelta(hours=24)
    assert bg.review_status == BreakGlass.Review.PENDING

    (opened,) = events(EventType.BREAKGLASS_OPENED)
    assert opened.break_glass and opened.grant_id == grant.pk and opened.actor == "user:erin"
    data = json.loads(opened.data)
    assert data["ticket"] == "INC-42" and data["notified"] == ["frank", "grace", "heidi"]

    # Every approver it skipped is told, the opener is not.
    rows = Notification.objects.filter(event=NotificationEvent.BREAKGLASS_OPENED)
    assert sorted(r.target for r in rows) == [
        "frank@example.test",
        "grace@example.test",
        "heidi@example.test",
    ]
    assert all("BREAK-GLASS" in m.subject for m in mail.outbox if "BREAK" in m.subject)

    # Decisions that touch it say so, in the answer and in the audit event.
    decision = authorize(**ask(NOW + MS))
    assert decision.allowed and decision.break_glass and decision.grant_id == grant.pk
    recorded = access_check(**ask(NOW + MS))
    assert recorded.allowed and recorded.break_glass
    assert events(EventType.ACCESS_ALLOWED)[-1].break_glass

    # An incident campaign was opened for the agent.
    (campaign,) = ReviewCampaign.objects.filter(kind="incident")
    assert campaign.key == f"incident:breakglass:{bg.pk}" and campaign.agent == setup["agent"]


def test_decisions_refuse_it_after_its_ttl_and_still_say_break_glass(open_bg, system):
    bg = open_bg(ttl=timedelta(minutes=10))
    end = NOW + timedelta(minutes=10)
    assert authorize(**ask(end - MS)).allowed
    refused = authorize(**ask(end))
    assert (refused.allowed, refused.reason, refused.break_glass) == (
        False,
        Reason.GRANT_EXPIRED,
        True,
    )
    denied = access_check(**ask(end))
    assert not denied.allowed and events(EventType.ACCESS_DENIED)[-1].break_glass
    # The expiry job's bookkeeping event is flagged too, and happens once.
    assert grants_expire(actor=system, at=end) == 1
    assert grants_expire(actor=system, at=end) == 0
    (expired,) = events(EventType.GRANT_EXPIRED, grant_id=bg.grant_id)
    assert expired.break_glass


def test_break_glass_ends_when_its_openers_account_is_deactivated(setup, open_bg):
    """Break-glass rides on its opener's own authority (no second person approved it).
    Deactivating the account (someone left, or it was taken over) left the elevation
    live until its TTL. It is live only while the opener's account is active: the
    decisions, the report and the live list say so at once, whether or not any job ran."""
    from django.utils import timezone

    from governance.services.reports import access_rows

    # On the wall clock: the deactivation's person.changed event carries it, and the
    # report of a moment reads accounts as they were then (before it: still listed).
    bg = open_bg(at=timezone.now())
    before = timezone.now()
    assert access_check(**ask(before)).allowed
    erin = setup["erin"]
    erin.is_active = False
    erin.save()
    after = timezone.now()
    for deciding in (authorize, access_check):
        refused = deciding(**ask(after))
        assert (refused.allowed, refused.reason, refused.break_glass) == (
            False, Reason.GRANT_REVOKED, True,
        )  # fmt: skip
    denied = events(EventType.ACCESS_DENIED)[-1]
    assert (denied.reason, denied.grant_id, denied.break_glass) == ("grant_revoked", None, True)
    assert bg.grant_id not in {r["grant"] for r in access_rows(after)}
    assert not selectors.live_grants(after).filter(pk=bg.grant_id).exists()
    assert bg.grant_id in {r["grant"] for r in access_rows(before)}
    # Decided at decision time, as expiry is: the row itself is not changed.
    assert Grant.objects.get(pk=bg.grant_id).status == "active"
    # Nor shown as live on every page, nor in the way of another person's break-glass
    # for the incident (a 409 breakglass_active until its TTL ran out).
    assert not selectors.breakglass_active(after).filter(pk=bg.pk).exists()
    frank, grace = setup["frank"], setup["grace"]
    bgs.breakglass_ratify(  # reviewed (a new break-glass waits for that), still open
        breakglass_id=bg.pk, reviewer=frank, comment="ok", actor=Actor.user(frank), at=after
    )
    again = open_bg(grace, at=after, ticket="INC-43")
    assert again.pk != bg.pk and again.opened_by == grace
    assert {b.pk for b in selectors.breakglass_active(after)} == {again.pk}
    assert access_check(**ask(after)).allowed
    erin.is_active = True
    erin.save()
    assert access_check(**ask(timezone.now())).allowed


def test_the_period_report_says_break_glass_allowed_nothing_while_its_opener_was_inactive(
    setup, open_bg, auditor_session
):
    """erin's break-glass was refused at every moment her account was deactivated
    (grant_revoked), yet the period export said it could allow something then: it asked
    the point-in-time rule, which leaves the opener to the report's list of grants live
    then. The opener's account is read as it was at each moment of the period, and its
    reactivation is a moment access comes back."""
    from tests.conftest import accounts_changed_at

    def period(start, end):
        query = {"format": "json", "start": start.isoformat(), "end": end.isoformat()}
        response = auditor_session.get("/ui/exports/access", query)
        assert response.status_code == 200, response.content[:300]
        event = events(EventType.REPORT_EXPORTED)[-1]
        assert (event.actor, json.loads(event.data)["report"]) == ("user:carol", "access_period")
        return {row["grant"]: row["blocked_by"] for row in json.loads(response.content)["rows"]}

    minutes = lambda n: NOW + timedelta(minutes=n)  # noqa: E731
    bg = open_bg(at=minutes(-30))  # for an hour
    assert access_check(**ask(minutes(-25))).allowed
    erin = setup["erin"]
    with accounts_changed_at(minutes(-20)):
        erin.is_active = False
        erin.save()
    refused = access_check(**ask(minutes(-15)))
    assert (refused.allowed, refused.reason) == (False, Reason.GRANT_REVOKED)
    assert events(EventType.ACCESS_DENIED)[-1].reason == "grant_revoked"
    assert period(minutes(-15), minutes(-5)) == {bg.grant_id: "grant_revoked"}
    assert period(minutes(-25), minutes(-15)) == {bg.grant_id: None}  # active at -25
    with accounts_changed_at(minutes(10)):
        erin.is_active = True
        erin.save()
    assert access_check(**ask(minutes(10))).allowed
    assert events(EventType.ACCESS_ALLOWED)[-1].break_glass
    assert period(minutes(-15), minutes(-5)) == {bg.grant_id: "grant_revoked"}  # as it was
    assert period(minutes(-15), minutes(15)) == {bg.grant_id: None}  # back from +10
    assert Grant.objects.get(pk=bg.grant_id).status == "active"  # the report ends nothing


def test_an_agent_never_opens_break_glass(setup, open_bg, alice):
    from governance.models import AgentToken

    principal = AgentPrincipal(agent=setup["agent"], token=AgentToken())
    with pytest.raises(Forbidden) as caught:
        open_bg(principal)
    assert caught.value.code == "human_only"
    assert Grant.objects.count() == 0 and events(EventType.BREAKGLASS_OPENED) == []


def test_only_approvers_admins_or_the_agents_owner_open_it(open_bg, person, alice):
    with pytest.raises(Forbidden) as caught:
        open_bg(person("mallory"))
    assert caught.value.code == "not_allowed"
    # alice owns the agent (conftest): she may, as the accountable human.
    assert open_bg(alice).opened_by == alice


def test_break_glass_is_never_opened_for_a_subagent(setup, open_bg, make_agent):
    """A subagent only ever holds a subset of its parent's grants; break-glass would
    hand it something its parent may not have. Open it for the parent."""
    child = make_agent("bot.child", parent=setup["agent"])
    before = AuditEvent.objects.count()
    with pytest.raises(Forbidden) as caught:
        open_bg(agent=child)
    assert caught.value.code == "subagent_needs_delegation"
    assert str(caught.value).startswith("bot.child is a subagent of bot:")
    assert not Grant.objects.exists() and AuditEvent.objects.count() == before


@pytest.mark.parametrize("ticket", ["", "   ", "inc-42", "INC42", "INC-42; drop", "see slack"])
def test_a_ticket_in_the_configured_format_is_required(open_bg, ticket):
    with pytest.raises(GovernanceError) as caught:
        open_bg(ticket=ticket)
    assert caught.value.code == "invalid_ticket" and "ticket" in caught.value.fields
    assert BreakGlass.objects.count() == 0 and events(EventType.BREAKGLASS_OPENED) == []


def test_the_ticket_format_is_configurable(open_bg, settings):
    settings.BREAKGLASS_TICKET_PATTERN = r"#[0-9]{4,}"
    assert open_bg(ticket="#12345").ticket == "#12345"
    with pytest.raises(GovernanceError):
        open_bg(ticket="INC-42")


def test_longer_than_the_hard_maximum_is_refused_not_clamped(open_bg, settings):
    settings.BREAKGLASS_MAX_TTL = timedelta(hours=2)
    with pytest.raises(GovernanceError) as caught:
        open_bg(ttl=timedelta(hours=2, seconds=1))
    assert caught.value.code == "breakglass_ttl_too_long"
    assert "at most 120 minutes" in caught.value.message
    assert Grant.objects.count() == 0 and events(EventType.BREAKGLASS_OPENED) == []
    with pytest.raises(GovernanceError) as caught:
        open_bg(ttl=timedelta(0))
    assert caught.value.code == "invalid_ttl"
    assert open_bg(ttl=timedelta(hours=2)).expires_at == NOW + timedelta(hours=2)


def test_break_glass_never_outlives_the_longest_grant(open_bg, settings):
    """GRANT_MAX_TTL_HOURS=1 with the break-glass defaults (60 and 240 minutes): a 4 h
    break-glass opened, a grant longer than "no grant lives longer", whose ratification
    (a request for the same window) was refused `invalid_grant`. The lifetime is held
    to the shorter of the two maxima, refused past it, never shortened."""
    settings.GRANT_MAX_TTL = timedelta(hours=1)
    for ttl in (timedelta(hours=4), timedelta(hours=1, seconds=1)):
        with pytest.raises(GovernanceError) as caught:
            open_bg(ttl=ttl)
        assert caught.value.code == "breakglass_ttl_too_long" and caught.value.status == 400
        assert "at most 60 minutes" in caught.value.message
        assert "GRANT_MAX_TTL_HOURS" in caught.value.message
        assert caught.value.fields == {"ttl": "at most 60 minutes"}
    assert Grant.objects.count() == 0 and BreakGlass.objects.count() == 0
    assert events(EventType.BREAKGLASS_OPENED) == []
    # The longest grant there is, and the default (60 minutes), are opened as ever.
    bg = open_bg(ttl=timedelta(hours=1))
    assert bg.grant.expires_at - bg.grant.starts_at == timedelta(hours=1)
    (opened,) = events(EventType.BREAKGLASS_OPENED)
    assert json.loads(opened.data)["expires_at"] == (NOW + timedelta(hours=1)).isoformat()


def test_a_break_glass_longer_than_the_grant_maximum_now_is_still_ratified(
    open_bg, setup, settings
):
    """Opened for 4 h, then GRANT_MAX_TTL lowered to 1 h: its ratification asked for a
    4 h grant, refused `invalid_grant`, and the UI and API pass no duration, so it could
    never be ratified. The request is for the longest grant now allowed."""
    bg = open_bg(ttl=timedelta(hours=4))
    settings.GRANT_MAX_TTL = timedelta(hours=1)
    frank = setup["frank"]
    at = NOW + timedelta(hours=5)
    bg = bgs.breakglass_ratify(
        breakglass_id=bg.pk, reviewer=frank, comment="needed", actor=Actor.user(frank), at=at
    )
    bg.refresh_from_db()
    assert (bg.review_status, bg.reviewed_by) == ("ratified", frank)
    request = bg.ratified_request
    assert (request.status, request.requested_duration) == ("pending", timedelta(hours=1))
    (requested,) = events(EventType.GRANT_REQUESTED, grant_id=request.pk)
    (ratified,) = events(EventType.BREAKGLASS_RATIFIED)
    assert json.loads(ratified.data)["ratified_request"] == request.pk
    assert requested.seq < ratified.seq


def test_more_than_the_hourly_limit_per_person_is_refused(open_bg, setup, make_tool, settings):
    settings.BREAKGLASS_MAX_PER_HOUR = 2
    # One break-glass per agent and tool at a time: each of these is for another tool.
    tools = [make_tool(f"repo{i}") for i in range(4)]
    open_bg(ticket="INC-1", tool=tools[0])
    open_bg(ticket="INC-2", at=NOW + timedelta(minutes=1), tool=tools[1])
    with pytest.raises(RateLimited) as caught:
        open_bg(ticket="INC-3", at=NOW + timedelta(minutes=2), tool=tools[2])
    assert caught.value.code == "breakglass_rate_limited" and caught.value.status == 429
    # Free again when the first open leaves the hour: 58 minutes from now.
    assert caught.value.retry_after == 58 * 60
    assert BreakGlass.objects.count() == 2
    # Someone else is not limited by erin's count, and erin is again after the hour.
    open_bg(setup["frank"], ticket="INC-3", at=NOW + timedelta(minutes=2), tool=tools[2])
    open_bg(ticket="INC-4", at=NOW + timedelta(hours=1), tool=tools[3])
    assert BreakGlass.objects.count() == 4
    assert len(events(EventType.BREAKGLASS_OPENED)) == 4


def test_retry_after_counts_down_to_when_enough_opens_leave_the_hour(open_bg, make_tool, settings):
    settings.BREAKGLASS_MAX_PER_HOUR = 3
    tools = [make_tool(f"repo{i}") for i in range(4)]
    for i in range(3):
        open_bg(ticket=f"INC-{i}", at=NOW + timedelta(minutes=10 * i), tool=tools[i])
    settings.BREAKGLASS_MAX_PER_HOUR = 2  # lowered: two must leave, not just the oldest
    with pytest.raises(RateLimited) as caught:
        open_bg(ticket="INC-9", at=NOW + timedelta(minutes=25, seconds=0.5), tool=tools[3])
    assert caught.value.retry_after == 45 * 60  # NOW + 10 min + 1 h, rounded up
    assert BreakGlass.objects.count() == 3


def test_closing_early_ends_the_grant_once(open_bg, setup):
    bg = open_bg()
    erin = setup["erin"]
    for _ in range(2):
        bg = bgs.breakglass_close(
            breakglass_id=bg.pk,
            closed_by=erin,
            comment="fixed",
            actor=Actor.user(erin),
            at=NOW + timedelta(minutes=5),
        )
    assert bg.closed_at == NOW + timedelta(minutes=5) and bg.grant.status == "revoked"
    (revoked,) = events(EventType.GRANT_REVOKED, grant_id=bg.grant_id)
    assert revoked.break_glass and "closed early" in json.loads(revoked.data)["reason"]
    assert not authorize(**ask(NOW + timedelta(minutes=5))).allowed
    assert list(selectors.breakglass_active(NOW + timedelta(minutes=5))) == []


def test_ratifying_turns_it_into_a_normal_request_decided_once(
    open_bg, setup, django_capture_on_commit_callbacks
):
    bg = open_bg()
    frank = setup["frank"]
    at = NOW + timedelta(hours=2)
    with django_capture_on_commit_callbacks(execute=True):
        bg = bgs.breakglass_ratify(
            breakglass_id=bg.pk,
            reviewer=frank,
            comment="needed again next week",
            actor=Actor.user(frank),
            at=at,
        )
    with pytest.raises(Conflict) as caught:
        bgs.breakglass_ratify(
            breakglass_id=bg.pk, reviewer=frank, comment="again", actor=Actor.user(frank), at=at
        )
    assert caught.value.code == "already_reviewed"

    bg.refresh_from_db()
    assert (bg.review_status, bg.reviewed_by, bg.reviewed_at) == ("ratified", frank, at)
    request = bg.ratified_request
    assert (request.status, request.break_glass, request.requested_by) == ("pending", False, frank)
    assert (request.actions, request.scope) == (["read", "update"], SCOPE)
    (ratified,) = events(EventType.BREAKGLASS_RATIFIED)
    assert ratified.break_glass and json.loads(ratified.data)["ratified_request"] == request.pk
    (requested,) = events(EventType.GRANT_REQUESTED, grant_id=request.pk)
    # The new request goes to the approvers like any other (not to frank, its requester).
    pending = Notification.objects.filter(event=NotificationEvent.REQUEST_PENDING)
    assert "frank@example.test" not in {n.target for n in pending} and pending.count() == 3


def test_the_opener_cannot_approve_the_request_its_ratification_files(open_bg, setup):
    """erin elevated the access; frank ratified it into a request; erin approving that
    request would make her own emergency access a normal grant. grace may."""
    from governance.services.grants import grant_approve

    erin, frank, grace = setup["erin"], setup["frank"], setup["grace"]
    bg = bgs.breakglass_ratify(
        breakglass_id=open_bg().pk, reviewer=frank, comment="ok", actor=Actor.user(frank), at=NOW
    )
    request = bg.ratified_request
    with pytest.raises(Forbidden) as caught:
        grant_approve(grant_id=request.pk, approver=erin, actor=Actor.user(erin), at=NOW)
    assert caught.value.code == "self_approval"
    assert Grant.objects.get(pk=request.pk).status == "pending"
    assert events(EventType.GRANT_ISSUED, grant_id=request.pk) == []
    granted = grant_approve(grant_id=request.pk, approver=grace, actor=Actor.user(grace), at=NOW)
    assert (granted.status, granted.approved_by) == ("active", grace)
    (issued,) = events(EventType.GRANT_ISSUED, grant_id=request.pk)
    assert issued.actor == "user:grace"


def test_an_auditor_never_opens_break_glass_even_for_an_agent_they_own(
    open_bg, setup, person, make_agent
):
    """Auditors are read-only, whichever door they come through (service, API, UI)."""
    olga = person("olga", roles.AUDITORS)
    setup["agent"] = make_agent("olga-bot", owner=olga)
    with pytest.raises(Forbidden) as caught:
        open_bg(olga)
    assert caught.value.code == "auditor_read_only"
    assert Grant.objects.count() == 0 and events(EventType.BREAKGLASS_OPENED) == []
    # An auditor who is also an approver is not read-only.
    olga.groups.add(Group.objects.get_or_create(name=roles.APPROVERS)[0])
    del olga._role_names  # roles caches a user's groups on the object
    assert open_bg(olga).opened_by == olga
    assert len(events(EventType.BREAKGLASS_OPENED)) == 1


def test_nobody_reviews_their_own_break_glass(open_bg, setup, person):
    bg = open_bg()
    erin = setup["erin"]
    with pytest.raises(Forbidden) as caught:
        bgs.breakglass_confirm_closed(
            breakglass_id=bg.pk, reviewer=erin, comment="fine", actor=Actor.user(erin), at=NOW
        )
    assert caught.value.code == "self_review"
    plain = person("pat")
    with pytest.raises(Forbidden):
        bgs.breakglass_ratify(
            breakglass_id=bg.pk, reviewer=plain, comment="ok", actor=Actor.user(plain), at=NOW
        )
    with pytest.raises(GovernanceError) as caught:
        bgs.breakglass_ratify(
            breakglass_id=bg.pk,
            reviewer=setup["frank"],
            comment=" ",
            actor=Actor.user(setup["frank"]),
            at=NOW,
        )
    assert caught.value.code == "comment_required"
    assert BreakGlass.objects.get(pk=bg.pk).review_status == "pending"


@pytest.mark.parametrize("review", ["ratify", "confirm_closed"])
@pytest.mark.parametrize("stake", ["owner", "token"])
def test_nobody_with_a_stake_in_the_agent_reviews_its_break_glass(
    open_bg, setup, make_agent, review, stake
):
    """frank did not open it, but owns the agent (or issued himself a token for it since
    the access was opened): he could have used it, so he may not sign it off. Refused
    with `self_review`; the review stays pending and no event is written."""
    from governance.services import agents

    frank = setup["frank"]
    if stake == "owner":
        setup["agent"] = make_agent("frank-bot", owner=frank)
    bg = open_bg()
    if stake == "token":
        token, _ = agents.token_issue(
            created_by=frank, agent=bg.grant.agent, actor=Actor.user(frank), at=NOW + MS
        )
        agents.token_revoke(token=token, actor=Actor.user(frank), at=NOW + 2 * MS)
    before = AuditEvent.objects.count()
    with pytest.raises(Forbidden) as caught:
        getattr(bgs, f"breakglass_{review}")(
            breakglass_id=bg.pk, reviewer=frank, comment="fine", actor=Actor.user(frank), at=NOW
        )
    assert caught.value.code == "self_review"
    assert BreakGlass.objects.get(pk=bg.pk).review_status == "pending"
    assert AuditEvent.objects.count() == before
    # grace, with no stake, may.
    grace = setup["grace"]
    getattr(bgs, f"breakglass_{review}")(
        breakglass_id=bg.pk, reviewer=grace, comment="fine", actor=Actor.user(grace), at=NOW
    )
    assert BreakGlass.objects.get(pk=bg.pk).reviewed_by == grace


def test_confirming_closed_revokes_a_still_live_grant_once(open_bg, setup):
    bg = open_bg()
    grace = setup["grace"]
    at = NOW + timedelta(minutes=30)
    bg = bgs.breakglass_confirm_closed(
        breakglass_id=bg.pk,
        reviewer=grace,
        comment="incident over",
        actor=Actor.user(grace),
        at=at,
    )
    with pytest.raises(Conflict):
        bgs.breakglass_confirm_closed(
            breakglass_id=bg.pk, reviewer=grace, comment="again", actor=Actor.user(grace), at=at
        )
    bg.refresh_from_db()
    assert (bg.review_status, bg.closed_at, bg.grant.status) == ("confirmed_closed", at, "revoked")
    (confirmed,) = events(EventType.BREAKGLASS_CONFIRMED_CLOSED)
    assert confirmed.break_glass and json.loads(confirmed.data)["comment"] == "incident over"
    (revoked,) = events(EventType.GRANT_REVOKED, grant_id=bg.grant_id)
    assert revoked.break_glass
    assert not authorize(**ask(at)).allowed


def test_an_unreviewed_break_glass_is_overdue_after_24h_and_announced_once(
    open_bg, setup, system, django_capture_on_commit_callbacks
):
    bg = open_bg()
    due = NOW + timedelta(hours=24)
    (shown,) = selectors.breakglass_reviews_pending(due - MS)
    assert not shown.is_overdue
    # Overdue from the due time itself, before any job has run.
    (shown,) = selectors.breakglass_reviews_pending(due)
    assert shown.is_overdue

    assert bgs.breakglass_reviews_mark_overdue(actor=system, at=due - MS) == 0
    with django_capture_on_commit_callbacks(execute=True):
        assert bgs.breakglass_reviews_mark_overdue(actor=system, at=due) == 1
        assert bgs.breakglass_reviews_mark_overdue(actor=system, at=due + timedelta(hours=1)) == 0
    (overdue,) = events(EventType.BREAKGLASS_REVIEW_OVERDUE)
    assert overdue.break_glass and overdue.grant_id == bg.grant_id
    rows = Notification.objects.filter(event=NotificationEvent.REVIEW_OVERDUE)
    assert rows.count() == 4 and all(r.status == "sent" for r in rows)
    assert BreakGlass.objects.get(pk=bg.pk).overdue_at == due
    # A late review still closes it, and says it was late.
    frank = setup["frank"]
    bgs.breakglass_confirm_closed(
        breakglass_id=bg.pk,
        reviewer=frank,
        comment="late",
        actor=Actor.user(frank),
        at=due + timedelta(hours=2),
    )
    assert json.loads(events(EventType.BREAKGLASS_CONFIRMED_CLOSED)[0].data)["overdue"] is True
    assert selectors.breakglass_reviews_pending(due + timedelta(hours=3)) == []


def test_a_break_glass_still_live_when_its_review_is_overdue_is_revoked(
    open_bg, system, django_capture_on_commit_callbacks
):
    """Settings keep break-glass shorter than its review window; a row changed behind
    the service's back (stretched here, as test setup) still ends when the review is
    overdue: flagged and expired, never live unreviewed."""
    bg = open_bg()
    due = NOW + timedelta(hours=24)
    Grant.objects.filter(pk=bg.grant_id).update(expires_at=due + timedelta(hours=5))
    q = {"agent": "bot", "tool": "repo", "action": "read", "scope": "repo:acme/api/x"}
    assert authorize(at=due, **q).allowed
    with django_capture_on_commit_callbacks(execute=True):
        assert bgs.breakglass_reviews_mark_overdue(actor=system, at=due) == 1
    assert authorize(at=due + MS, **q).reason == "grant_revoked"
    (revoked,) = events(EventType.GRANT_REVOKED, grant_id=bg.grant_id)
    assert revoked.break_glass and "review overdue" in json.loads(revoked.data)["reason"]
    assert [e.event_type for e in events(EventType.BREAKGLASS_REVIEW_OVERDUE)] == [
        EventType.BREAKGLASS_REVIEW_OVERDUE
    ]


def test_the_breakglass_open_command(setup):
    out = StringIO()
    call_command(
        "breakglass_open",
        "--user",
        "erin",
        "--agent",
        "bot",
        "--tool",
        "repo",
        "--actions",
        "read",
        "--scope",
        SCOPE,
        "--ticket",
        "INC-7",
        "--reason",
        "outage",
        "--ttl-minutes",
        "30",
        stdout=out,
    )
    bg = BreakGlass.objects.get()
    assert bg.ticket == "INC-7" and bg.expires_at - bg.opened_at == timedelta(minutes=30)
    assert f"break-glass #{bg.pk}" in out.getvalue()
    (opened,) = events(EventType.BREAKGLASS_OPENED)
    assert opened.actor == "user:erin"
    with pytest.raises(CommandError, match="at most"):
        call_command(
            "breakglass_open",
            "--user",
            "erin",
            "--agent",
            "bot",
            "--tool",
            "repo",
            "--actions",
            "read",
            "--scope",
            SCOPE,
            "--ticket",
            "INC-8",
            "--reason",
            "x",
            "--ttl-minutes",
            "999",
        )


@pytest.mark.parametrize("ttl", ["99999999999999", "0", "-5"])
def test_the_breakglass_open_command_refuses_an_absurd_lifetime_with_a_line(setup, ttl):
    """99999999999999 minutes overflowed the lifetime (OverflowError, a traceback)."""
    before = AuditEvent.objects.count()
    argv = ["--user", "erin", "--agent", "bot", "--tool", "repo", "--actions", "read",
            "--scope", SCOPE, "--ticket", "INC-7", "--reason", "outage"]  # fmt: skip
    with pytest.raises(CommandError, match="--ttl-minutes must be 1 to 10080"):
        call_command("breakglass_open", *argv, f"--ttl-minutes={ttl}", stdout=StringIO())
    assert not BreakGlass.objects.exists() and AuditEvent.objects.count() == before


# --- One at a time, and reviewed before the next -------------------------------------------


def test_one_live_break_glass_per_agent_and_tool_whoever_opens_it(open_bg, setup, make_tool):
    """A second person could open an overlapping one, stretching the elevation."""
    bg = open_bg()
    before = AuditEvent.objects.count()
    for opener, ticket, scope in [
        (setup["frank"], "INC-43", "repo:acme/web/*"),  # someone else
        (setup["erin"], "INC-44", SCOPE),  # the same person, another ticket
    ]:
        with pytest.raises(Conflict) as caught:
            open_bg(opener, ticket=ticket, scope=scope, at=NOW + timedelta(minutes=50))
        assert caught.value.code == "breakglass_active" and caught.value.status == 409
        assert "INC-42" in caught.value.message
        assert bg.expires_at.isoformat() in caught.value.message
        assert caught.value.fields["ticket"] == "INC-42"
    assert BreakGlass.objects.count() == 1 and Grant.objects.count() == 1
    assert AuditEvent.objects.count() == before
    assert not authorize(**ask(bg.expires_at)).allowed  # nothing stretched past its end
    # Another tool for the same agent is another matter (under its own limit).
    other = open_bg(setup["frank"], ticket="INC-45", tool=make_tool("deploy"))
    assert other.pk != bg.pk
    assert len(events(EventType.BREAKGLASS_OPENED)) == 2


def test_no_new_break_glass_while_an_earlier_one_awaits_its_review(open_bg, setup, settings):
    """The same opener re-opened the instant one expired: 24 h of elevation on one
    ticket with six reviews pending. Now a second person reviews before the next."""
    cap = settings.BREAKGLASS_MAX_TTL
    bg = open_bg(ttl=cap)
    for opener in (setup["erin"], setup["frank"]):
        with pytest.raises(Conflict) as caught:
            open_bg(opener, ttl=cap, at=bg.expires_at)
        assert caught.value.code == "breakglass_unreviewed"
        assert "INC-42" in caught.value.message and "review" in caught.value.message
    assert not authorize(**ask(bg.expires_at)).allowed
    assert BreakGlass.objects.count() == 1 and len(events(EventType.BREAKGLASS_OPENED)) == 1
    frank = setup["frank"]
    bgs.breakglass_confirm_closed(
        breakglass_id=bg.pk, reviewer=frank, comment="over", actor=Actor.user(frank),
        at=bg.expires_at + MS,
    )  # fmt: skip
    again = open_bg(ttl=cap, at=bg.expires_at + 2 * MS)
    assert again.pk != bg.pk and authorize(**ask(bg.expires_at + 3 * MS)).allowed
    assert len(events(EventType.BREAKGLASS_OPENED)) == 2


def test_only_the_exact_repeat_returns_the_live_one(open_bg, setup, make_task, system):
    bg = open_bg(actions=["read"])
    assert open_bg(actions=["read"], at=NOW + MS).pk == bg.pk
    # Wider actions, or another task, are not the same request: never the narrower row.
    for change in ({"actions": ["read", "update"]}, {"actions": ["read"], "task": make_task()}):
        with pytest.raises(Conflict) as caught:
            open_bg(at=NOW + MS, **change)
        assert caught.value.code == "breakglass_active"
    assert Grant.objects.get().actions == ["read"]
    # Its grant revoked elsewhere: a repeat is not handed the dead row with a 201.
    from governance.services.grants import grant_revoke

    grant_revoke(grant_id=bg.grant_id, reason="not needed", actor=system, at=NOW + 2 * MS)
    with pytest.raises(Conflict) as caught:
        open_bg(actions=["read"], at=NOW + 3 * MS)
    assert caught.value.code == "breakglass_unreviewed"
    assert BreakGlass.objects.count() == 1 and len(events(EventType.BREAKGLASS_OPENED)) == 1


def test_a_second_person_repeating_a_live_break_glass_is_refused_and_writes_nothing(
    open_bg, setup, django_capture_on_commit_callbacks
):
    """Another person asking for exactly the live one (same agent, tool, actions, scope,
    task and ticket) is not handed it as their own: they did not open it, and would
    be told they had. Refused, nothing written, nobody notified."""
    with django_capture_on_commit_callbacks(execute=True):
        bg = open_bg()
    before = _written()
    with pytest.raises(Conflict) as caught, django_capture_on_commit_callbacks(execute=True):
        open_bg(setup["frank"], at=NOW + MS)
    assert (caught.value.code, caught.value.status) == ("breakglass_active", 409)
    assert caught.value.fields == {"ticket": "INC-42", "expires_at": bg.expires_at.isoformat()}
    assert _written() == before
    (opened,) = events(EventType.BREAKGLASS_OPENED)
    assert (opened.actor, opened.grant_id) == ("user:erin", bg.grant_id)
    assert BreakGlass.objects.get().opened_by == setup["erin"]


def test_the_same_person_repeating_a_live_break_glass_gets_the_same_one(
    open_bg, setup, django_capture_on_commit_callbacks
):
    """A retry or a double click by its opener is the same emergency: the live one is
    returned as it is (not stretched by a longer lifetime asked the second time), with
    no second event, grant, notification or incident campaign."""
    with django_capture_on_commit_callbacks(execute=True):
        bg = open_bg(ttl=timedelta(minutes=30))
    before = _written()
    with django_capture_on_commit_callbacks(execute=True):
        again = open_bg(at=NOW + timedelta(minutes=10), ttl=timedelta(hours=1))
    assert again.pk == bg.pk and again.grant_id == bg.grant_id
    assert (again.expires_at, again.grant.expires_at) == (NOW + timedelta(minutes=30),) * 2
    assert _written() == before
    assert [e.actor for e in events(EventType.BREAKGLASS_OPENED)] == ["user:erin"]


def test_closing_one_whose_grant_ended_elsewhere_marks_it_closed_once(open_bg, setup, system):
    from governance.services.grants import grant_revoke

    bg = open_bg()
    grant_revoke(grant_id=bg.grant_id, reason="not needed", actor=system, at=NOW + MS)
    frank = setup["frank"]
    for _ in range(2):
        closed = bgs.breakglass_close(
            breakglass_id=bg.pk, closed_by=frank, comment="tidy", actor=Actor.user(frank),
            at=NOW + 2 * MS,
        )  # fmt: skip
    assert (closed.closed_at, closed.closed_by) == (NOW + 2 * MS, frank)
    (event,) = events(EventType.BREAKGLASS_CLOSED)
    assert event.break_glass and event.grant_id == bg.grant_id and event.actor == "user:frank"
    assert json.loads(event.data)["grant_status"] == "revoked"
    assert len(events(EventType.GRANT_REVOKED, grant_id=bg.grant_id)) == 1


def test_the_opener_may_close_their_own_early_and_nobody_else_without_a_role(
    open_bg, alice, person
):
    """The agent's owner may open break-glass but could not close it early."""
    bg = open_bg(alice)  # alice owns the agent and holds no role
    mallory = person("mallory")
    with pytest.raises(Forbidden) as caught:
        bgs.breakglass_close(
            breakglass_id=bg.pk, closed_by=mallory, comment="x", actor=Actor.user(mallory),
            at=NOW + MS,
        )  # fmt: skip
    assert caught.value.code == "not_allowed"
    assert BreakGlass.objects.get(pk=bg.pk).closed_at is None
    assert events(EventType.GRANT_REVOKED) == []
    closed = bgs.breakglass_close(
        breakglass_id=bg.pk, closed_by=alice, comment="fixed", actor=Actor.user(alice),
        at=NOW + MS,
    )  # fmt: skip
    assert (closed.closed_at, closed.closed_by, closed.grant.status) == (NOW + MS, alice, "revoked")
    (revoked,) = events(EventType.GRANT_REVOKED, grant_id=bg.grant_id)
    assert revoked.actor == "user:alice" and revoked.break_glass
    assert not authorize(**ask(NOW + MS)).allowed


def test_an_opener_who_is_now_an_auditor_alone_cannot_close_it(open_bg, setup):
    """Auditors are read-only, even for a break-glass they opened before they became one:
    an approver or admin ends it."""
    erin, frank = setup["erin"], setup["frank"]
    bg = open_bg(erin)
    erin.groups.clear()
    erin.groups.add(Group.objects.get_or_create(name=roles.AUDITORS)[0])
    erin = type(erin).objects.get(pk=erin.pk)  # as the next request loads her (roles cached)
    before = AuditEvent.objects.count()
    with pytest.raises(Forbidden) as caught:
        bgs.breakglass_close(
            breakglass_id=bg.pk, closed_by=erin, comment="x", actor=Actor.user(erin), at=NOW + MS
        )
    assert caught.value.code == "auditor_read_only"
    assert BreakGlass.objects.get(pk=bg.pk).closed_at is None
    assert Grant.objects.get(pk=bg.grant_id).status == Grant.Status.ACTIVE
    assert AuditEvent.objects.count() == before
    assert authorize(**ask(NOW + MS)).allowed
    closed = bgs.breakglass_close(
        breakglass_id=bg.pk, closed_by=frank, comment="over", actor=Actor.user(frank), at=NOW + MS
    )
    assert (closed.closed_by, closed.grant.status) == (frank, "revoked")
    (revoked,) = events(EventType.GRANT_REVOKED, grant_id=bg.grant_id)
    assert revoked.actor == "user:frank"


def test_break_glass_cannot_reach_a_suspended_agent(setup, open_bg, system):
    """Every call of a suspended agent is refused, so a break-glass grant for it was
    only noise: the banner, every approver notified, an incident campaign."""
    from governance.services import agents

    agents.agent_suspend(agent=setup["agent"], reason="compromised", actor=system, at=NOW - MS)
    before = (Grant.objects.count(), AuditEvent.objects.count(), len(mail.outbox))
    with pytest.raises(Conflict) as err:
        open_bg()
    assert err.value.code == "agent_suspended"
    assert (Grant.objects.count(), AuditEvent.objects.count(), len(mail.outbox)) == before
    assert list(selectors.breakglass_active(NOW)) == []


def test_break_glass_cannot_reach_a_quarantined_tool(setup, open_bg, system):
    """Every call to a quarantined tool is refused: the break-glass said "open" and
    allowed nothing, yet counted against the opener's hourly limit and blocked another
    for the agent and tool."""
    from governance.services import tools

    tools.tool_update_definition(
        tool=setup["tool"], description="now also drops tables", actor=system, at=NOW - MS
    )
    before = (Grant.objects.count(), AuditEvent.objects.count(), len(mail.outbox))
    with pytest.raises(Conflict) as err:
        open_bg()
    assert err.value.code == "tool_quarantined"
    assert (Grant.objects.count(), AuditEvent.objects.count(), len(mail.outbox)) == before
    assert list(selectors.breakglass_active(NOW)) == []


@pytest.mark.parametrize("how", ["close", "confirm_closed"])
def test_closing_break_glass_after_its_ttl_leaves_it_expired_not_cut_short(
    setup, open_bg, system, how
):
    """Past its TTL the grant had expired, whether or not the job had marked it:
    closing it then used to record a revoke 'closed early' after its expiry."""
    bg = open_bg(ttl=timedelta(minutes=10))
    later = NOW + timedelta(minutes=30)
    frank = setup["frank"]
    if how == "close":
        bgs.breakglass_close(
            breakglass_id=bg.pk, closed_by=setup["erin"], comment="done",
            actor=Actor.user(setup["erin"]), at=later,
        )  # fmt: skip
    else:
        bgs.breakglass_confirm_closed(
            breakglass_id=bg.pk, reviewer=frank, comment="over", actor=Actor.user(frank), at=later
        )
    assert events(EventType.GRANT_REVOKED, grant_id=bg.grant_id) == []
    grants_expire(actor=system, at=later)
    grant = Grant.objects.get(pk=bg.grant_id)
    assert (grant.status, grant.revoked_at) == ("expired", None)
    assert len(events(EventType.GRANT_EXPIRED, grant_id=bg.grant_id)) == 1
    if how == "close":
        (closed,) = events(EventType.BREAKGLASS_CLOSED)
        assert json.loads(closed.data)["grant_status"] == "expired"


def test_every_event_about_a_call_under_break_glass_is_flagged(setup, open_bg):
    """The approval a destructive call under break-glass needed was recorded unflagged:
    filtering the log on the flag missed who confirmed calls during the incident."""
    from governance.services.approvals import approval_approve
    from governance.services.outcomes import outcome_report

    bg = open_bg(actions=["read", "delete"])
    first = access_check(**ask(NOW + timedelta(minutes=1), "delete"))
    assert first.decision == "approval_required"
    frank = setup["frank"]
    approval_approve(
        approval_id=first.approval_id, approver=frank, actor=Actor.user(frank),
        at=NOW + timedelta(minutes=2),
    )  # fmt: skip
    used = access_check(approval=first.approval_id, **ask(NOW + timedelta(minutes=3), "delete"))
    assert used.allowed and AuditEvent.objects.get(uid=used.decision_id).break_glass
    # And what the call did (the outcome was logged unflagged too).
    outcome_report(
        agent=setup["agent"], decision_id=used.decision_id, outcome="succeeded",
        at=NOW + timedelta(minutes=4),
    )  # fmt: skip
    about = AuditEvent.objects.filter(grant_id=bg.grant_id)
    assert {"access.approval_required", "approval.approved", "access.outcome"} <= set(
        about.values_list("event_type", flat=True)
    )
    assert [e.event_type for e in about if not e.break_glass] == []


def test_an_incident_campaign_reviews_what_the_agent_handed_down(
    setup, open_bg, make_agent, make_grant, system
):
    """The incident campaign covered the agent's own grants only: what it had delegated
    to its subagents, access it controls, went unreviewed."""
    from governance.services.grants import grant_delegate

    sub = make_agent("sub", parent=setup["agent"])
    parent = make_grant(
        setup["agent"], setup["tool"], actions=("read", "update"), duration=timedelta(days=2),
        delegable=True,
    )  # fmt: skip
    child = grant_delegate(
        parent_grant_id=parent.pk, child=sub, actions=["update"], scope=SCOPE,
        expires_at=parent.expires_at, justification="sub", actor=system,
        at=NOW - timedelta(minutes=5),
    )  # fmt: skip
    bg = open_bg(scope="repo:acme/ops/*")
    campaign = ReviewCampaign.objects.get(key=f"incident:breakglass:{bg.pk}")
    covered = set(campaign.items.values_list("grant_id", flat=True))
    assert {parent.pk, bg.grant_id, child.pk} <= covered
    opened = json.loads(events(EventType.REVIEW_CAMPAIGN_OPENED)[-1].data)
    assert child.pk in {item["grant"] for item in opened["items"]}


# --- Whoever declared the emergency does not re-certify what continues it ---------------


def _ratified_and_approved(setup):
    """erin opens break-glass, frank ratifies it, grace approves the request it files."""
    erin, frank, grace = setup["erin"], setup["frank"], setup["grace"]
    bg = bgs.breakglass_open(
        opener=erin, agent=setup["agent"], tool=setup["tool"], actions=["read", "update"],
        scope=SCOPE, ticket="INC-42", reason="outage", actor=Actor.user(erin), at=NOW,
    )  # fmt: skip
    bg = bgs.breakglass_ratify(
        breakglass_id=bg.pk, reviewer=frank, comment="needed for a week",
        actor=Actor.user(frank), at=NOW + timedelta(hours=2),
    )  # fmt: skip
    from governance.services import grants as grant_services

    with pytest.raises(Forbidden) as refused:
        grant_services.grant_approve(
            grant_id=bg.ratified_request_id, approver=erin, actor=Actor.user(erin),
            at=NOW + timedelta(hours=3),
        )  # fmt: skip
    assert refused.value.code == "self_approval"
    grant_services.grant_approve(
        grant_id=bg.ratified_request_id, approver=grace, actor=Actor.user(grace),
        at=NOW + timedelta(hours=3),
    )  # fmt: skip
    return bg


def test_the_opener_does_not_recertify_the_grant_that_continues_their_break_glass(setup):
    from governance.services import reviews

    erin = setup["erin"]
    bg = _ratified_and_approved(setup)
    campaign = reviews.review_campaign_open(
        kind="on_demand", reason="after incident", actor=Actor.system("t"),
        at=NOW + timedelta(hours=3, minutes=10),
    )  # fmt: skip
    item = campaign.items.get(grant_id=bg.ratified_request_id)
    assert item.reviewer_id != erin.pk
    erin.groups.add(Group.objects.get_or_create(name="admins")[0])
    erin = type(erin).objects.get(pk=erin.pk)
    before = AuditEvent.objects.count()
    with pytest.raises(Forbidden) as refused:
        reviews.review_item_decide(
            item_id=item.pk, reviewer=erin, decision="keep", comment="still needed",
            actor=Actor.user(erin), at=NOW + timedelta(hours=3, minutes=20),
        )  # fmt: skip
    assert refused.value.code == "self_review"
    item.refresh_from_db()
    assert item.status == "pending" and AuditEvent.objects.count() == before


def test_the_opener_is_not_given_the_second_look_at_its_ratification(setup):
    from governance.models import SecondLook
    from governance.services import second_look

    bg = _ratified_and_approved(setup)
    sampled = second_look.second_looks_sample(
        actor=Actor.system("t"), at=NOW + timedelta(hours=4), fraction=1.0
    )
    assert sampled == 1
    look = SecondLook.objects.get()
    assert look.grant_id == bg.ratified_request_id
    assert look.reviewer_id not in (setup["erin"].pk, setup["grace"].pk)


def test_the_banner_ends_with_the_grant_a_review_narrowed(setup, open_bg):
    """A review may narrow a break-glass grant's expiry; the banner follows the grant,
    not the break-glass row's own expiry (the job syncs that later)."""
    bg = open_bg()
    Grant.objects.filter(pk=bg.grant_id).update(expires_at=NOW + timedelta(minutes=10))
    assert [b.pk for b in selectors.breakglass_active(NOW + timedelta(minutes=9))] == [bg.pk]
    assert list(selectors.breakglass_active(NOW + timedelta(minutes=10))) == []


def test_a_break_glass_grant_narrowed_by_its_review_can_still_be_ratified(open_bg, setup):
    """The incident review narrowed the grant to a whole minute while it had opened at
    a moment with microseconds: ratifying asked for the window's length as a duration,
    which was then not whole seconds, and every ratification failed (400 invalid_grant)
    with no way to give a duration. The request asks for the whole seconds within it."""
    from governance.services.grants import grant_narrow

    frank, grace = setup["frank"], setup["grace"]
    bg = open_bg(at=NOW + timedelta(microseconds=123456))
    end = (bg.grant.expires_at - timedelta(minutes=10)).replace(second=0, microsecond=0)
    grant_narrow(
        grant_id=bg.grant.pk, reason="review: shorter", expires_at=end,
        narrowed_by=grace, actor=Actor.user(grace), at=NOW + timedelta(minutes=1),
    )  # fmt: skip
    bg.grant.refresh_from_db()
    window = bg.grant.expires_at - bg.grant.starts_at
    assert window.microseconds  # the case in question

    bg = bgs.breakglass_ratify(
        breakglass_id=bg.pk, reviewer=frank, comment="keep it", actor=Actor.user(frank), at=end
    )
    request = bg.ratified_request
    assert request.status == "pending"
    assert request.requested_duration == timedelta(seconds=int(window.total_seconds()))
    (requested,) = events(EventType.GRANT_REQUESTED, grant_id=request.pk)
    assert events(EventType.BREAKGLASS_RATIFIED)
