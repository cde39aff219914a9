"""The jobs that shrink the matrix: unused flags, daily trend, expiring-soon notices,
token expiry bookkeeping and second-look sampling. Each runs twice: one effect."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import Group
from django.utils import timezone

from governance import selectors, tasks
from governance.audit import Actor
from governance.codes import EventType, NotificationEvent
from governance.errors import Conflict, Forbidden, GovernanceError
from governance.models import (
    AgentToken,
    AuditEvent,
    Grant,
    LiveGrantSnapshot,
    Notification,
    ReviewCampaign,
    SecondLook,
)
from governance.services import agents as agent_services
from governance.services import approvals as approval_services
from governance.services import hygiene, second_look
from governance.services.access import access_check
from governance.services.hygiene import grants_flag_unused
from tests.conftest import MS, NOW


def events(event_type: str, **filters: object) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(event_type=event_type, **filters).order_by("seq"))


# --- unused grants -----------------------------------------------------------------------


def test_unused_grants_are_flagged_once_per_idle_spell(
    make_agent, make_tool, make_grant, system, settings
):
    settings.UNUSED_GRANT_HOURS = 30 * 24
    agent, tool = make_agent(), make_tool()
    long = timedelta(days=7)
    rw = make_grant(agent, tool, actions=("read", "update"), duration=long)
    ro = make_grant(agent, tool, scope="repo:acme/web/*", duration=long)
    used = make_grant(agent, tool, scope="repo:acme/ops/*", duration=long)
    later = NOW + timedelta(days=31)
    Grant.objects.update(expires_at=later + timedelta(days=1))
    assert access_check(
        agent=agent.name, tool="repo", action="read", scope="repo:acme/ops/x",
        at=later - timedelta(days=2),
    ).allowed  # fmt: skip

    assert hygiene.grants_flag_unused(actor=system, at=later - timedelta(days=2)) == 0
    assert hygiene.grants_flag_unused(actor=system, at=later) == 2
    assert hygiene.grants_flag_unused(actor=system, at=later + timedelta(hours=1)) == 0
    flagged = {e.grant_id: json.loads(e.data) for e in events("grant.unused_flagged")}
    # Nothing either held was used: both proposed for removal, read and all.
    assert {pk: data["proposal"] for pk, data in flagged.items()} == {
        rw.pk: "remove",
        ro.pk: "remove",
    }
    assert flagged[rw.pk]["idle_actions"] == ["read", "update"]
    assert flagged[rw.pk]["last_used"] == {"read": None, "update": None}
    assert Grant.objects.get(pk=rw.pk).unused_flagged_at == later

    # Read again: its update is still idle, and it is flagged for that (once).
    Grant.objects.update(expires_at=later + timedelta(days=40))
    assert access_check(
        agent=agent.name, tool="repo", action="read", scope="repo:acme/api/x",
        at=later + timedelta(days=1),
    ).allowed  # fmt: skip
    before = {e.seq for e in events("grant.unused_flagged")}
    assert hygiene.grants_flag_unused(actor=system, at=later + timedelta(days=2)) == 1
    assert hygiene.grants_flag_unused(actor=system, at=later + timedelta(days=3)) == 0
    (narrow,) = [e for e in events("grant.unused_flagged") if e.seq not in before]
    data = json.loads(narrow.data)
    assert (narrow.grant_id, data["proposal"], data["idle_actions"]) == (
        rw.pk,
        "narrow_to_read",
        ["update"],
    )
    assert data["keep_actions"] == ["read"]
    before = {e.seq for e in events("grant.unused_flagged")}
    # Then idle as a whole for the period: rw again (removal now), and `used`, now idle
    # too; ro stays flagged once.
    assert hygiene.grants_flag_unused(actor=system, at=later + timedelta(days=31, hours=1)) == 2
    fresh = {e.grant_id for e in events("grant.unused_flagged") if e.seq not in before}
    assert fresh == {rw.pk, used.pk}
    # The dashboard selector shows the same proposals.
    shown = {g.pk: g.proposal for g in selectors.unused_grants(later + timedelta(days=31, hours=1))}
    assert shown[rw.pk] == "remove" and shown[ro.pk] == "remove"


def test_an_irreversible_tool_grant_is_proposed_like_any_other(make_agent, make_tool, make_grant):
    """Wholly idle: removal; its execute idle while it reads: narrowing to read."""
    assert selectors.unused_proposal(["read", "execute"], ["read", "execute"]) == "remove"
    assert selectors.unused_proposal(["read", "execute"], ["execute"]) == "narrow_to_read"
    assert selectors.unused_proposal(["read", "update", "delete"], ["delete"]) == "narrow_to_used"
    assert selectors.unused_proposal(["update", "delete"], ["delete"]) == "narrow_to_used"


# --- trend -----------------------------------------------------------------------------


def test_the_daily_snapshot_counts_live_grants_once_and_a_rise_is_highlighted(
    make_agent, make_tool, make_grant, system
):
    """The job runs just after midnight and records the day that has just ended, counted
    at its end (the moment the dashboard's chart reads for that day)."""
    bot, other, tool = make_agent("bot"), make_agent("other"), make_tool()
    make_grant(bot, tool, duration=timedelta(days=3))
    day1 = hygiene.trend_snapshot_record(actor=system, at=NOW + timedelta(days=1))
    assert day1.day == NOW.date()
    again = hygiene.trend_snapshot_record(actor=system, at=NOW + timedelta(days=1, hours=1))
    assert again.pk == day1.pk
    assert (day1.total, day1.per_agent) == (1, {"bot": 1})
    assert selectors.grant_trend()["rise"] is False

    tomorrow = NOW + timedelta(days=1)
    make_grant(other, tool, starts_at=tomorrow, duration=timedelta(days=3))
    make_grant(bot, tool, scope="repo:acme/web/*", starts_at=tomorrow, duration=timedelta(days=3))
    day2 = hygiene.trend_snapshot_record(actor=system, at=NOW + timedelta(days=2))
    assert day2.day == tomorrow.date()
    assert (day2.total, day2.per_agent) == (3, {"bot": 2, "other": 1})
    trend = selectors.grant_trend()
    assert trend["rise"] is True and trend["rising_agents"] == ["bot", "other"]
    assert [p["total"] for p in trend["series"]] == [1, 3]
    assert len(events(EventType.TREND_RECORDED)) == 2 and LiveGrantSnapshot.objects.count() == 2

    Grant.objects.update(expires_at=NOW + timedelta(days=2))
    day3 = hygiene.trend_snapshot_record(actor=system, at=NOW + timedelta(days=3))
    assert day3.total == 0 and selectors.grant_trend()["rise"] is False


def test_the_chart_shows_a_recorded_day_as_that_day_not_the_day_before(
    make_agent, make_tool, make_grant, system
):
    """The snapshot of 00:10 on D+1 counted D's end but was filed under D+1: every
    recorded day showed the day before's number (a rise on D appeared on D+1)."""
    from governance.web import queries

    day = datetime(2026, 11, 20, tzinfo=UTC)
    agent, tool = make_agent(), make_tool()
    hygiene.trend_snapshot_record(actor=system, at=day + timedelta(minutes=10))  # 00:10 on D
    make_grant(agent, tool, starts_at=day + timedelta(hours=3), duration=timedelta(days=5))
    hygiene.trend_snapshot_record(actor=system, at=day + timedelta(days=1, minutes=10))
    labels, series = queries.live_grants_per_day(day + timedelta(days=2, hours=12), days=4)
    total = dict(zip(labels, dict(series)["total"], strict=True))
    assert total["11-19"] == 0 and total["11-20"] == 1, total  # live from 03:00 on D
    recorded = json.loads(events(EventType.TREND_RECORDED)[-1].data)
    assert (recorded["day"], recorded["total"]) == ("2026-11-20", 1)
    assert recorded["counted_at"] == "2026-11-20T23:59:59.999999+00:00"


def test_a_day_the_job_missed_is_recorded_by_its_next_run_not_left_a_hole(
    make_agent, make_tool, make_grant, system
):
    """Beat down on the night of 12-01: the daily count had no 11-30, for good, and a
    rise that day would never show. The next run records it, counted at its own end."""
    agent, tool = make_agent("bot"), make_tool()
    day = datetime(2026, 11, 30, tzinfo=UTC)
    hygiene.trend_snapshot_record(actor=system, at=day + timedelta(minutes=10))  # 11-29
    make_grant(agent, tool, starts_at=day + timedelta(hours=3), duration=timedelta(hours=30))
    latest = hygiene.trend_snapshot_record(actor=system, at=day + timedelta(days=2, minutes=10))
    assert latest.day.isoformat() == "2026-12-01"
    snaps = {s.day.isoformat(): s.total for s in LiveGrantSnapshot.objects.all()}
    assert snaps == {"2026-11-29": 0, "2026-11-30": 1, "2026-12-01": 0}
    recorded = [json.loads(e.data) for e in events(EventType.TREND_RECORDED)]
    assert [(r["day"], r["total"], r.get("backfilled", False)) for r in recorded] == [
        ("2026-11-29", 0, False),
        ("2026-11-30", 1, True),
        ("2026-12-01", 0, False),
    ]
    # Run again the same night: nothing more.
    hygiene.trend_snapshot_record(actor=system, at=day + timedelta(days=2, hours=1))
    assert len(events(EventType.TREND_RECORDED)) == 3


# --- expiring soon -----------------------------------------------------------------------


def test_a_grant_whose_task_is_over_is_not_flagged_unused(
    make_agent, make_tool, make_grant, make_task, system, settings
):
    """Its task ended (the job has not revoked it yet): it allows nothing, so it is not
    unused access to remove. Flagging it told its people to act on access already
    gone; the grant beside it, with no task, is flagged."""
    settings.UNUSED_GRANT_HOURS = 24
    agent, tool = make_agent(), make_tool()
    later = NOW + timedelta(days=2)
    task = make_task("OPS-9", ends_at=later - timedelta(hours=1))
    bound = make_grant(agent, tool, task=task, duration=timedelta(days=7))
    free = make_grant(agent, tool, scope="repo:acme/web/*", duration=timedelta(days=7))
    assert {g.pk for g in selectors.unused_grants(later - timedelta(hours=2))} == {
        bound.pk,
        free.pk,
    }
    assert hygiene.grants_flag_unused(actor=system, at=later) == 1
    assert [e.grant_id for e in events("grant.unused_flagged")] == [free.pk]
    assert Grant.objects.get(pk=bound.pk).unused_flagged_at is None
    assert [g.pk for g in selectors.unused_grants(later)] == [free.pk]


def test_an_unused_grant_is_announced_once_per_flag_to_requester_and_owner(
    make_agent, make_tool, make_grant, alice, bob, system, settings,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    """The flag told nobody: the people who can give the grant back before a reviewer
    takes it away (its requester, the agent's owner) hear of it, once per flag."""
    from django.contrib.auth.models import User
    from django.core import mail

    settings.UNUSED_GRANT_HOURS = 24
    alice.email = "alice@example.test"
    alice.save()
    owner = User.objects.create_user("olga", email="olga@example.test")
    agent, tool = make_agent("idler", owner=owner), make_tool()
    grant = make_grant(agent, tool, actions=("read", "update"), duration=timedelta(days=5))
    later = NOW + timedelta(days=2)
    with django_capture_on_commit_callbacks(execute=True):
        assert hygiene.grants_flag_unused(actor=system, at=later) == 1
        assert hygiene.grants_flag_unused(actor=system, at=later + timedelta(hours=1)) == 0
    rows = Notification.objects.filter(event=NotificationEvent.GRANT_UNUSED).order_by("target")
    assert [r.target for r in rows] == ["alice@example.test", "olga@example.test"]
    assert rows[0].subject == f"Grant #{grant.pk} unused: proposed for removal"
    assert (
        rows[0].data["idle_actions"] == ["read", "update"] and rows[0].data["proposal"] == "remove"
    )
    assert sorted(m.to[0] for m in mail.outbox) == ["alice@example.test", "olga@example.test"]
    (flag,) = events("grant.unused_flagged", grant_id=grant.pk)
    assert json.loads(flag.data)["proposal"] == "remove"

    # Read since, its update still idle: flagged again, proposed for narrowing to read.
    assert access_check(
        agent="idler", tool="repo", action="read", scope="repo:acme/api/x", at=later + MS
    ).allowed
    with django_capture_on_commit_callbacks(execute=True):
        assert hygiene.grants_flag_unused(actor=system, at=later + timedelta(days=1)) == 1
    newest = Notification.objects.filter(event=NotificationEvent.GRANT_UNUSED).latest("pk")
    assert newest.subject == f"Grant #{grant.pk} unused: proposed for narrowing to read"
    assert "(update)" in newest.body
    assert Notification.objects.filter(event=NotificationEvent.GRANT_UNUSED).count() == 4


def test_a_grant_expiring_soon_is_announced_once_to_requester_and_owner(
    make_agent,
    make_tool,
    make_grant,
    alice,
    bob,
    system,
    settings,
    django_capture_on_commit_callbacks,
):
    from django.core import mail

    alice.email, bob.email = "alice@example.test", "bob@example.test"
    alice.save()
    bob.save()
    settings.GRANT_EXPIRING_NOTICE = timedelta(hours=1)
    grant = make_grant(make_agent(), make_tool(), duration=timedelta(hours=3))
    notice_at = grant.expires_at - timedelta(hours=1)
    with django_capture_on_commit_callbacks(execute=True):
        assert hygiene.grants_notify_expiring(actor=system, at=notice_at - MS) == 0
        assert hygiene.grants_notify_expiring(actor=system, at=notice_at) == 1
        assert hygiene.grants_notify_expiring(actor=system, at=notice_at + timedelta(1 / 24)) == 0
    (row,) = Notification.objects.filter(event=NotificationEvent.GRANT_EXPIRING)
    assert row.target == "alice@example.test"  # requester and owner are both alice here
    assert [m.to for m in mail.outbox] == [["alice@example.test"]]
    assert Grant.objects.get(pk=grant.pk).expiring_notified_at == notice_at


# --- tokens ------------------------------------------------------------------------------


def test_tokens_past_expiry_are_announced_once(make_agent, alice, system):
    token, _ = agent_services.token_issue(
        created_by=alice, agent=make_agent(), days=1, actor=system, at=NOW
    )
    end = NOW + timedelta(days=1)
    assert hygiene.tokens_expire(actor=system, at=end - MS) == 0
    assert hygiene.tokens_expire(actor=system, at=end) == 1
    assert hygiene.tokens_expire(actor=system, at=end) == 0
    (event,) = events(EventType.TOKEN_EXPIRED)
    assert json.loads(event.data)["prefix"] == token.prefix and event.agent == "bot"
    assert AgentToken.objects.get(pk=token.pk).expiry_announced_at == end


# --- second look -------------------------------------------------------------------------


def look_decide(look, who, verdict, comment):
    return second_look.second_look_decide(
        second_look_id=look.pk,
        reviewer=who,
        verdict=verdict,
        comment=comment,
        actor=Actor.user(who),
        at=NOW,
    )


@pytest.fixture
def approved_yesterday(make_agent, make_tool, make_grant, approvers, bob, system):
    bob.groups.add(Group.objects.get_or_create(name="approvers")[0])
    agent, tool = make_agent(), make_tool()
    grants = [
        make_grant(agent, tool, scope=f"repo:acme/r{i}/*", starts_at=NOW - timedelta(hours=3))
        for i in range(20)
    ]
    make_grant(agent, tool, actions=("delete",), scope="repo:acme/d/*", starts_at=NOW)
    decision = access_check(
        agent=agent, tool="repo", action="delete", scope="repo:acme/d/x", at=NOW + MS
    )
    erin = approvers[0]
    approval_services.approval_approve(
        approval_id=decision.approval_id, approver=erin, actor=Actor.user(erin), at=NOW + 2 * MS
    )
    return grants, decision.approval_id


def test_sampling_picks_a_stable_fraction_and_a_different_approver(approved_yesterday, system):
    grants, approval_id = approved_yesterday
    at = NOW + timedelta(hours=1)
    assert second_look.second_looks_sample(actor=system, at=at, fraction=0.0) == 0
    everything = second_look.second_looks_sample(actor=system, at=at, fraction=1.0)
    assert everything == 22  # 21 grants (bob approved) and one destructive approval (erin)
    assert second_look.second_looks_sample(actor=system, at=at, fraction=1.0) == 0
    for look in SecondLook.objects.select_related("grant", "approval"):
        assert look.reviewer is not None
        assert look.reviewer_id != look.original_approver_id
        assert look.reviewer.username not in ("alice", "bob" if look.kind == "grant" else "erin")
    (appr,) = SecondLook.objects.filter(kind="approval")
    assert str(appr.approval_id) == approval_id and appr.original_approver.username == "erin"
    assert len(events(EventType.SECOND_LOOK_SAMPLED)) == 22


def test_a_partial_sample_is_the_same_set_every_run(approved_yesterday, system):
    at = NOW + timedelta(hours=1)
    first = second_look.second_looks_sample(actor=system, at=at, fraction=0.3)
    picked = set(SecondLook.objects.values_list("grant_id", "approval_id"))
    SecondLook.objects.all().delete()
    again = second_look.second_looks_sample(actor=system, at=at, fraction=0.3)
    assert (
        first == again and set(SecondLook.objects.values_list("grant_id", "approval_id")) == picked
    )
    assert 0 < first < 22


def test_a_late_run_samples_the_gap_since_the_last_one(
    make_agent, make_tool, alice, bob, approvers, system
):
    """A fixed 24 h window never saw an approval made 30 s after one run when the next
    ran 40 s late; nor anything in a gap of days. The watermark covers it."""
    from governance.models import SecondLookMark
    from governance.services import grants as grant_services

    bob.groups.add(Group.objects.get_or_create(name="approvers")[0])
    agent, tool = make_agent(), make_tool()

    def approved(at, scope):
        request = grant_services.grant_request(
            agent=agent, tool=tool, actions=["read"], scope=scope, duration=timedelta(hours=1),
            justification="j", requested_by=alice, actor=system, at=at,
        )  # fmt: skip
        return grant_services.grant_approve(grant_id=request.pk, approver=bob, actor=system, at=at)

    assert second_look.second_looks_sample(actor=system, at=NOW, fraction=1.0) == 0
    assert SecondLookMark.objects.get().sampled_through == NOW
    first = approved(NOW + timedelta(seconds=30), "repo:acme/a/*")
    # The next daily run is 40 s late.
    late = NOW + timedelta(days=1, seconds=40)
    assert second_look.second_looks_sample(actor=system, at=late, fraction=1.0) == 1
    (sampled,) = events(EventType.SECOND_LOOK_SAMPLED)
    assert sampled.grant_id == first.pk
    # Then no run for three days: an approval just after `late` is still sampled.
    second = approved(late + timedelta(minutes=1), "repo:acme/b/*")
    gap = late + timedelta(days=3)
    assert second_look.second_looks_sample(actor=system, at=gap, fraction=1.0) == 1
    assert events(EventType.SECOND_LOOK_SAMPLED)[-1].grant_id == second.pk
    assert second_look.second_looks_sample(actor=system, at=gap, fraction=1.0) == 0
    assert SecondLookMark.objects.get().sampled_through == gap
    assert SecondLook.objects.count() == 2


def test_a_second_look_is_decided_once_by_another_approver(
    approved_yesterday, system, django_capture_on_commit_callbacks
):
    second_look.second_looks_sample(actor=system, at=NOW + timedelta(hours=1), fraction=1.0)
    look = SecondLook.objects.filter(kind="grant").first()
    from django.contrib.auth.models import User

    bob = User.objects.get(username="bob")
    with pytest.raises(Forbidden) as caught:
        look_decide(look, bob, "confirm", "mine")
    assert caught.value.code == "self_review"
    with pytest.raises(GovernanceError):
        look_decide(look, look.reviewer, "flag", "")
    with django_capture_on_commit_callbacks(execute=True):
        decided = look_decide(look, look.reviewer, "flag", "scope too wide")
    with pytest.raises(Conflict):
        look_decide(look, look.reviewer, "confirm", "x")
    assert (decided.status, decided.decided_by) == ("flagged", look.reviewer)
    (event,) = events(EventType.SECOND_LOOK_DECIDED)
    assert json.loads(event.data)["verdict"] == "flag" and event.grant_id == look.grant_id
    (row,) = Notification.objects.filter(event=NotificationEvent.SECOND_LOOK_FLAGGED)
    assert row.target == "heidi@example.test"  # the admin


def test_a_second_looks_reviewer_deactivated_since_it_was_drawn_decides_nothing(
    approved_yesterday, system
):
    """The reviewer drawn at sampling was deactivated since: the role check alone let
    their confirm close the look (and the decision was theirs on record). Refused,
    the look pending, nothing written; reactivated, they decide it."""
    second_look.second_looks_sample(actor=system, at=NOW + timedelta(hours=1), fraction=1.0)
    look = SecondLook.objects.filter(kind="grant").select_related("reviewer").first()
    reviewer = look.reviewer
    reviewer.is_active = False
    reviewer.save()
    before = AuditEvent.objects.count()
    with pytest.raises(Forbidden) as caught:
        look_decide(look, reviewer, "confirm", "looks fine")
    assert caught.value.code == "not_allowed"
    assert SecondLook.objects.get(pk=look.pk).status == "pending"
    assert AuditEvent.objects.count() == before
    reviewer.is_active = True
    reviewer.save()
    assert look_decide(look, reviewer, "confirm", "looks fine").decided_by == reviewer
    assert events(EventType.SECOND_LOOK_DECIDED)[-1].grant_id == look.grant_id


def test_whoever_held_a_token_for_the_agent_takes_none_of_its_second_looks(
    approved_yesterday, system
):
    """olga, an admin, issued herself a token for the agent before its grants and
    calls were approved: she could act as it, so she re-checks none of them."""
    from django.contrib.auth.models import User

    from governance.models import Agent

    olga = User.objects.create_user("olga", email="olga@example.test")
    olga.groups.add(Group.objects.get_or_create(name="admins")[0])
    # On the wall clock, as token rows are (issued a day ago, live for 30 days from then),
    # so the test does not age: the grants' creation times are wall-clock too.
    issued = min(NOW, timezone.now()) - timedelta(1)
    token, _ = agent_services.token_issue(
        created_by=olga, agent=Agent.objects.get(), actor=Actor.user(olga), at=issued
    )
    AgentToken.objects.filter(pk=token.pk).update(
        created_at=issued, expires_at=timezone.now() + timedelta(days=30)
    )
    second_look.second_looks_sample(actor=system, at=NOW + timedelta(hours=1), fraction=1.0)
    looks = list(SecondLook.objects.select_related("reviewer"))
    assert len(looks) == 22 and all(look.reviewer.username != "olga" for look in looks)
    sampled = events(EventType.SECOND_LOOK_SAMPLED)
    assert "olga" not in {json.loads(e.data)["reviewer"] for e in sampled}
    for kind in ("grant", "approval"):
        look = SecondLook.objects.filter(kind=kind).first()
        with pytest.raises(Forbidden) as caught:
            look_decide(look, olga, "confirm", "looks fine")
        assert caught.value.code == "self_review"
    assert events(EventType.SECOND_LOOK_DECIDED) == []


def test_nobody_with_a_stake_in_the_agent_takes_its_second_look(approved_yesterday, system):
    """The agent's owner (olga: an admin who neither requested nor approved anything) is
    never drawn as the reviewer and may not decide a look on her agent's calls or
    grants; an approver other than the drawn one may not either (an admin may)."""
    from django.contrib.auth.models import User

    from governance.models import Agent

    olga = User.objects.create_user("olga", email="olga@example.test")
    olga.groups.add(Group.objects.get_or_create(name="admins")[0])
    Agent.objects.update(owner=olga)  # test setup: the agent changes hands
    second_look.second_looks_sample(actor=system, at=NOW + timedelta(hours=1), fraction=1.0)
    looks = list(SecondLook.objects.select_related("reviewer"))
    assert len(looks) == 22 and all(look.reviewer.username != "olga" for look in looks)

    for kind in ("grant", "approval"):
        look = SecondLook.objects.filter(kind=kind).first()
        with pytest.raises(Forbidden) as caught:
            look_decide(look, olga, "confirm", "looks fine")
        assert caught.value.code == "self_review"
    look = SecondLook.objects.filter(kind="approval").get()
    other = next(
        u
        for u in User.objects.filter(groups__name="approvers").order_by("username")
        if u.pk not in (look.reviewer_id, look.original_approver_id)
    )
    with pytest.raises(Forbidden) as caught:
        look_decide(look, other, "confirm", "looks fine")
    assert caught.value.code == "not_assigned"
    assert events(EventType.SECOND_LOOK_DECIDED) == []
    heidi = User.objects.get(username="heidi")  # an admin with no stake
    assert look_decide(look, heidi, "confirm", "looks fine").decided_by == heidi
    (event,) = events(EventType.SECOND_LOOK_DECIDED)
    assert json.loads(event.data)["decided_by"] == "heidi"


# --- the thin tasks --------------------------------------------------------------------


def test_each_lifecycle_task_calls_its_service_and_returns_a_summary(db, approvers):
    assert tasks.breakglass_overdue() == {"overdue": 0}
    summary = tasks.review_campaign_scheduled()
    assert summary["key"].startswith("scheduled:")
    assert tasks.review_campaign_scheduled() == summary
    assert tasks.review_due() == {"items": 0, "campaigns_closed": 1}  # the empty campaign
    assert tasks.review_reminders() == {"reminded": 0}
    assert tasks.unused_scan() == {"flagged": 0}
    assert tasks.trend_snapshot()["total"] == 0
    assert tasks.second_look_sample() == {"sampled": 0}
    assert tasks.expiring_notices() == {"notified": 0}
    assert tasks.notifications_sweep() == {"queued": 0}


def test_with_the_shipped_defaults_an_unused_grant_is_flagged(
    make_agent, make_tool, make_grant, system
):
    """UNUSED_GRANT_DAYS=30 against the 7-day maximum: no grant ever lived long enough."""
    from django.conf import settings as live

    assert live.UNUSED_GRANT_HOURS < live.GRANT_MAX_TTL.total_seconds() / 3600
    grant = make_grant(make_agent(), make_tool(), duration=live.GRANT_MAX_TTL, starts_at=NOW)
    at = NOW + timedelta(hours=live.UNUSED_GRANT_HOURS)
    assert grants_flag_unused(actor=system, at=at) == 1
    (event,) = AuditEvent.objects.filter(event_type="grant.unused_flagged")
    assert event.grant_id == grant.pk
    assert json.loads(event.data)["hours"] == live.UNUSED_GRANT_HOURS


def test_a_parent_grant_busy_through_its_delegation_is_not_idle(
    make_agent, make_tool, make_grant, system, settings
):
    """Only the grant named on an allowed call is credited: a parent grant its subagent
    used all day was proposed for removal, which would have ended the subagent's too."""
    from governance.services.access import access_check
    from governance.services.grants import grant_delegate

    settings.UNUSED_GRANT_HOURS = 24
    parent_agent = make_agent("bot")
    sub = make_agent("sub", parent=parent_agent)
    tool = make_tool()
    parent = make_grant(
        parent_agent, tool, duration=timedelta(days=5), delegable=True,
        starts_at=NOW - timedelta(days=3),
    )  # fmt: skip
    idle = make_grant(parent_agent, tool, scope="repo:acme/web/*", duration=timedelta(days=5),
                      starts_at=NOW - timedelta(days=3))  # fmt: skip
    grant_delegate(
        parent_grant_id=parent.pk, child=sub, actions=["read"], scope="repo:acme/api/*",
        expires_at=parent.expires_at, justification="sub", actor=system,
        at=NOW - timedelta(days=3),
    )  # fmt: skip
    used = access_check(
        agent="sub",
        tool="repo",
        action="read",
        scope="repo:acme/api/x",
        at=NOW - timedelta(hours=2),
    )
    assert used.allowed and AuditEvent.objects.get(uid=used.decision_id).decision == "allow"
    grants_flag_unused(actor=system, at=NOW)
    flagged = set(
        AuditEvent.objects.filter(event_type="grant.unused_flagged").values_list(
            "grant_id", flat=True
        )
    )
    assert parent.pk not in flagged and idle.pk in flagged


def read(agent: str, scope: str, at: datetime, action: str = "read") -> None:
    assert access_check(agent=agent, tool="repo", action=action, scope=scope, at=at).allowed


def test_cheap_reads_do_not_keep_an_unused_delete_right_alive(
    make_agent, make_tool, make_grant, system, settings
):
    """A grant holding read and delete, read once a day and never used to delete: its
    delete is idle, flagged once (narrow to read, naming delete), and not again while
    the reads go on. Usage was counted per grant row, so it was never flagged; and an
    identical grant idle as a whole was proposed narrow_to_read, keeping its unused read."""
    settings.UNUSED_GRANT_HOURS = 24
    agent, tool = make_agent(), make_tool()
    g = make_grant(agent, tool, actions=("read", "delete"), duration=timedelta(days=7),
                   starts_at=NOW)  # fmt: skip
    idle = make_grant(agent, tool, actions=("read", "delete"), scope="repo:acme/web/*",
                      duration=timedelta(days=7), starts_at=NOW)  # fmt: skip
    flags = []
    for day in range(6):
        at = NOW + timedelta(days=day, hours=1)
        read("bot", "repo:acme/api/x", at)
        flags.append(grants_flag_unused(actor=system, at=at + timedelta(hours=1)))
    assert flags == [0, 2, 0, 0, 0, 0]  # day 1: both grants; then nothing new
    at = NOW + timedelta(days=5, hours=3)
    shown = {x.pk: (x.proposal, x.idle_actions, x.keep_actions) for x in
             selectors.unused_grants(at)}  # fmt: skip
    assert shown == {
        g.pk: ("narrow_to_read", ["delete"], ["read"]),
        idle.pk: ("remove", ["read", "delete"], []),
    }
    flagged = {e.grant_id: e for e in events("grant.unused_flagged")}
    assert set(flagged) == {g.pk, idle.pk}
    data = json.loads(flagged[g.pk].data)
    assert (flagged[g.pk].actor, flagged[g.pk].action) == ("system:test", "read,delete")
    assert data == {
        "actions": ["read", "delete"],
        "proposal": "narrow_to_read",
        "idle_actions": ["delete"],
        "keep_actions": ["read"],
        "last_used": {"delete": None},
        "idle_since": NOW.isoformat(),
        "hours": 24,
    }
    assert json.loads(flagged[idle.pk].data)["proposal"] == "remove"
    row = Grant.objects.get(pk=g.pk)
    assert (row.unused_flagged_at, row.unused_flagged_actions) == (
        NOW + timedelta(days=1, hours=2),
        ["delete"],
    )
    assert row.use_count == 6


def test_narrowing_is_proposed_to_exactly_the_actions_used(
    make_agent, make_tool, make_grant, system, settings, bob
):
    """Read and update used, delete not: narrow to read+update. A gated delete is not a
    use, the approved one is. Read alone idle is never proposed (g2). Each change of the
    idle actions is a new flag; the same ones idle on, none."""
    settings.UNUSED_GRANT_HOURS = 24
    agent, tool = make_agent(), make_tool()
    g = make_grant(agent, tool, actions=("read", "update", "delete"), starts_at=NOW,
                   duration=timedelta(days=7))  # fmt: skip
    g2 = make_grant(agent, tool, actions=("read", "update"), scope="repo:acme/web/*",
                    starts_at=NOW, duration=timedelta(days=7))  # fmt: skip
    read("bot", "repo:acme/api/x", NOW + timedelta(hours=20))
    read("bot", "repo:acme/api/x", NOW + timedelta(hours=21), action="update")
    read("bot", "repo:acme/web/x", NOW + timedelta(hours=20), action="update")

    def flagged_since(seq: int) -> list[tuple[int, str, list[str], list[str]]]:
        found = [(e.grant_id, json.loads(e.data)) for e in events("grant.unused_flagged",
                                                                  seq__gt=seq)]  # fmt: skip
        return [(pk, d["proposal"], d["idle_actions"], d["keep_actions"]) for pk, d in found]

    mark = AuditEvent.objects.order_by("-seq").first().seq
    assert grants_flag_unused(actor=system, at=NOW + timedelta(hours=25)) == 1
    assert flagged_since(mark) == [(g.pk, "narrow_to_used", ["delete"], ["read", "update"])]
    # A delete needs a person's approval: the gated call is not a use, the approved one is.
    approval = access_check(
        agent="bot", tool="repo", action="delete", scope="repo:acme/api/x",
        at=NOW + timedelta(hours=26),
    )  # fmt: skip
    assert approval.decision == "approval_required"
    assert grants_flag_unused(actor=system, at=NOW + timedelta(hours=27)) == 0
    approval_services.approval_approve(
        approval_id=approval.approval_id, approver=bob, actor=system,
        at=NOW + timedelta(hours=26, minutes=5),
    )  # fmt: skip
    deleted = access_check(
        agent="bot", tool="repo", action="delete", scope="repo:acme/api/x",
        at=NOW + timedelta(hours=26, minutes=10), approval=str(approval.approval_id),
    )  # fmt: skip
    assert deleted.allowed
    read("bot", "repo:acme/web/x", NOW + timedelta(hours=44), action="update")
    # Read and update went idle (last used at 20h and 21h), delete is used: keep delete.
    mark = AuditEvent.objects.order_by("-seq").first().seq
    assert grants_flag_unused(actor=system, at=NOW + timedelta(hours=46)) == 1
    assert grants_flag_unused(actor=system, at=NOW + timedelta(hours=47)) == 0
    assert flagged_since(mark) == [(g.pk, "narrow_to_used", ["read", "update"], ["delete"])]
    # Idle as a whole for the period: removal, flagged anew.
    mark = AuditEvent.objects.order_by("-seq").first().seq
    assert grants_flag_unused(actor=system, at=NOW + timedelta(hours=51)) == 1
    assert flagged_since(mark) == [(g.pk, "remove", ["read", "update", "delete"], [])]
    data = json.loads(events("grant.unused_flagged")[-1].data)
    used_at = (NOW + timedelta(hours=26, minutes=10)).isoformat()
    assert data["idle_since"] == used_at and data["last_used"]["delete"] == used_at
    assert g2.pk not in {g.pk for g in selectors.unused_grants(NOW + timedelta(hours=51))}


def test_a_parent_grant_is_used_per_action_through_its_delegations(
    make_agent, make_tool, make_grant, system, settings
):
    """The subagent reads through the read+delete grant handed down to it: the parent's
    read is used (its subagent's), its delete is not, at any depth and a page at a time
    as in the full scan."""
    from governance.services.grants import grant_delegate

    settings.UNUSED_GRANT_HOURS = 24
    top = make_agent("bot")
    mid = make_agent("mid", parent=top)
    leaf = make_agent("leaf", parent=mid)
    tool = make_tool()
    parent = make_grant(top, tool, actions=("read", "delete"), duration=timedelta(days=5),
                        starts_at=NOW - timedelta(days=3), delegable=True)  # fmt: skip

    def hand(grant: Grant, child, delegable: bool) -> Grant:
        return grant_delegate(
            parent_grant_id=grant.pk, child=child, actions=["read", "delete"],
            scope=grant.scope, expires_at=grant.expires_at, justification="sub",
            actor=system, at=NOW - timedelta(days=3), delegable=delegable,
        )  # fmt: skip

    middle = hand(parent, mid, True)
    below = hand(middle, leaf, False)
    read("leaf", "repo:acme/api/x", NOW - timedelta(hours=2))
    expected = {
        parent.pk: ("narrow_to_read", ["delete"]),
        middle.pk: ("narrow_to_read", ["delete"]),
        below.pk: ("narrow_to_read", ["delete"]),
    }
    hygiene.usage_fold(at=NOW)
    found = {g.pk: (g.proposal, g.idle_actions) for g in selectors.unused_grants(NOW)}
    assert found == expected
    for k in (1, 2, 3):
        page = selectors.unused_grants(NOW, limit=k)
        assert {g.pk: (g.proposal, g.idle_actions) for g in page} == dict(list(found.items())[:k])
    assert grants_flag_unused(actor=system, at=NOW) == 3


def test_an_unused_threshold_of_zero_turns_the_scan_off(
    make_agent, make_tool, make_grant, system, settings
):
    settings.UNUSED_GRANT_HOURS = 0
    make_grant(make_agent(), make_tool(), duration=timedelta(days=2), starts_at=NOW)
    assert selectors.unused_grants(NOW + timedelta(days=1)) == []
    assert grants_flag_unused(actor=system, at=NOW + timedelta(days=1)) == 0
    assert not AuditEvent.objects.filter(event_type="grant.unused_flagged").exists()


def test_review_due_closes_finished_campaigns_even_when_an_item_fails(db, approvers, monkeypatch):
    from governance.services import reviews
    from governance.services.claims import PartlyFailed

    campaign = tasks.review_campaign_scheduled()["campaign"]

    def broken(**kw):
        raise RuntimeError("a damaged item")

    monkeypatch.setattr(reviews, "review_items_apply_due_rule", broken)
    with pytest.raises(PartlyFailed) as failed:
        tasks.review_due()
    assert "items failed" in str(failed.value)
    assert ReviewCampaign.objects.get(pk=campaign).closed_at is not None
