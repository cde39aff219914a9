"""Edges of re-certification and the hygiene jobs that the mutation run of
services/reviews.py and services/hygiene.py left untested (/tmp/scratch_revmut): each
test fails on the mutant named in its docstring. Everything goes through the real
services; each decision is checked in its answer, the rows and its audit event."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from governance.codes import EventType, NotificationEvent
from governance.errors import Conflict
from governance.models import AuditEvent, Grant, Notification, ReviewItem
from governance.services import reviews
from tests.conftest import MS, NOW
from tests.lifecycle_fixtures import decide, open_campaign


def events(event_type: str, **filters: object) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(event_type=event_type, **filters).order_by("seq"))


@pytest.fixture
def one_grant(make_agent, make_tool, make_grant, approvers, settings):
    """bot holds one grant (alice requested, bob approved); erin, frank, grace approve,
    heidi is an admin."""
    settings.GRANT_MAX_TTL = timedelta(days=60)
    return make_grant(make_agent("bot"), make_tool("repo"), duration=timedelta(days=20))


# --- review_item_decide ------------------------------------------------------------------


def test_a_late_decision_on_a_grant_expiring_at_the_due_date_closes_it_as_ended(
    one_grant, settings, django_capture_on_commit_callbacks
):
    """Mutant R05 (`expires_at < at`): at the due date, which is also the grant's expiry,
    the item was auto-kept under the keep rule and its reviewer told it was overdue, for
    a grant that had ended that very moment. It is closed as ended, by the system."""
    settings.REVIEW_DEFAULT_RULE = "keep"
    campaign = open_campaign(due_at=one_grant.expires_at)
    item = campaign.items.get()
    with django_capture_on_commit_callbacks(execute=True):
        with pytest.raises(Conflict) as caught:
            decide(item, "keep", at=one_grant.expires_at)
    assert caught.value.code == "past_due" and "'ended'" in caught.value.message
    item.refresh_from_db()
    assert (item.status, item.decided_by, item.decided_at) == ("ended", None, one_grant.expires_at)
    (rule,) = events(EventType.REVIEW_ITEM_DUE_RULE)
    assert (rule.grant_id, rule.actor, json.loads(rule.data)["rule"]) == (
        one_grant.pk, "system:review_due_rule", "ended",
    )  # fmt: skip
    assert events(EventType.REVIEW_ITEM_DECIDED) == []
    assert not Notification.objects.filter(event=NotificationEvent.REVIEW_OVERDUE).exists()


def other_admin(item, person):
    """An admin who is not the item's reviewer (heidi, or zed if heidi drew it)."""
    from django.contrib.auth import get_user_model

    heidi = get_user_model().objects.get(username="heidi")
    return heidi if item.reviewer != heidi else person("zed", "admins")


def test_an_admin_deciding_anothers_item_is_the_one_named(one_grant, person, system):
    """Mutants R38 (`decided_by = item.reviewer or reviewer`) and R39 (the event's
    decided_by): an admin who decides an item assigned to someone else is the person
    the item and its event name, and the revoke is theirs (R41: `revoked_by`)."""
    item = open_campaign().items.get()
    admin = other_admin(item, person)
    decided = decide(item, "revoke", reviewer=admin, comment="not needed any more")
    assert (decided.status, decided.decided_by, decided.decided_at) == ("revoked", admin, NOW)
    row = ReviewItem.objects.get(pk=item.pk)
    assert (row.decided_by, row.reviewer) == (admin, item.reviewer)
    grant = Grant.objects.get(pk=one_grant.pk)
    assert (grant.status, grant.revoked_by, grant.revoked_at) == ("revoked", admin, NOW)
    (event,) = events(EventType.REVIEW_ITEM_DECIDED)
    data = json.loads(event.data)
    assert (event.actor, data["decided_by"], data["decision"]) == (
        f"user:{admin.username}", admin.username, "revoke",
    )  # fmt: skip
    (revoked,) = events(EventType.GRANT_REVOKED)
    assert revoked.grant_id == one_grant.pk and revoked.seq < event.seq


def test_a_narrowing_reviewer_is_named_on_the_delegations_it_revokes(
    make_agent, make_tool, make_grant, approvers, settings, system
):
    """Mutant R40 (`narrowed_by=None`): the subagent's grant that no longer fits the
    narrowed parent was revoked by nobody; it is revoked by the reviewer."""
    from governance.services import grants as grant_services

    settings.GRANT_MAX_TTL = timedelta(days=60)
    bot = make_agent("bot")
    sub = make_agent("sub", parent=bot)
    parent = make_grant(bot, make_tool("repo"), actions=("read", "update"),
                        duration=timedelta(days=20), delegable=True)  # fmt: skip
    child = grant_services.grant_delegate(
        parent_grant_id=parent.pk, child=sub, actions=["update"], scope="repo:acme/api/*",
        expires_at=parent.expires_at, justification="sub-task", actor=system,
        at=NOW - timedelta(minutes=10),
    )  # fmt: skip
    item = open_campaign().items.get(grant=parent)
    decide(item, "narrow", actions=["read"], comment="reads only")
    parent.refresh_from_db()
    child.refresh_from_db()
    assert parent.actions == ["read"] and parent.status == "active"
    assert (child.status, child.revoked_by, child.revoked_at) == ("revoked", item.reviewer, NOW)
    assert ReviewItem.objects.get(pk=item.pk).decided_by == item.reviewer
    (revoked,) = events(EventType.GRANT_REVOKED)
    assert revoked.grant_id == child.pk and revoked.actor == f"user:{item.reviewer.username}"
    (decided,) = events(EventType.REVIEW_ITEM_DECIDED, grant_id=parent.pk)
    assert json.loads(decided.data)["decision"] == "narrow"


def test_whoever_held_a_token_for_the_agent_when_the_grant_was_made_may_not_review_it(
    one_grant, person, alice, system
):
    """Mutant R36 (stakeholders as of the grant's expiry, not its creation): ivan, an
    admin, held a token for bot when its grant was made and revoked it since; he could
    act as bot then, so he does not re-certify that grant."""
    from governance.services import agents as agent_services

    ivan = person("ivan", "admins")
    token, _ = agent_services.token_issue(
        created_by=ivan, agent=one_grant.agent, actor=system, at=one_grant.created_at - MS
    )
    agent_services.token_revoke(token=token, actor=system, at=NOW - timedelta(minutes=1))
    campaign = open_campaign()
    item = campaign.items.get()
    assert item.reviewer != ivan
    opened = json.loads(events(EventType.REVIEW_CAMPAIGN_OPENED)[0].data)
    assert opened["items"][0]["reviewer"] != "ivan"
    from governance.errors import Forbidden

    with pytest.raises(Forbidden) as caught:
        decide(item, "keep", reviewer=ivan, comment="fine by me")
    assert caught.value.code == "self_review"
    item.refresh_from_db()
    assert (item.status, item.decided_by) == ("pending", None)
    assert events(EventType.REVIEW_ITEM_DECIDED) == []


# --- opening a campaign ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "code"),
    [
        ({"reason": "   "}, "reason_required"),  # R16: a blank reason is no reason
        ({"due_at": NOW}, "invalid_due"),  # R17: due now is not in the future
    ],
)
def test_a_campaign_with_a_blank_reason_or_due_now_is_refused(one_grant, kw, code):
    from governance.errors import GovernanceError
    from governance.models import ReviewCampaign

    with pytest.raises(GovernanceError) as caught:
        open_campaign(**kw)
    assert caught.value.code == code and caught.value.message
    assert not ReviewCampaign.objects.exists() and not ReviewItem.objects.exists()
    assert events(EventType.REVIEW_CAMPAIGN_OPENED) == []


def test_asked_again_at_its_due_date_or_once_all_decided_a_new_campaign_opens(one_grant, approvers):
    """Mutants R23 (`due_at__lt`) and R24 (no `pending` filter): the double-click guard
    returns the same campaign only while it is open with an item pending. Asked again
    once every item is decided, or at its due date, a new campaign is opened (and its
    opening is on the record)."""
    erin = approvers[0]
    first = open_campaign(opened_by=erin)
    assert open_campaign(opened_by=erin).pk == first.pk
    decide(first.items.get(), "keep")
    second = open_campaign(opened_by=erin, at=NOW + timedelta(minutes=1))
    assert second.pk != first.pk and second.items.get().grant_id == one_grant.pk
    third = open_campaign(opened_by=erin, at=second.due_at)
    assert third.pk not in (first.pk, second.pk)
    opened = [json.loads(e.data)["campaign_id"] for e in events(EventType.REVIEW_CAMPAIGN_OPENED)]
    assert opened == [first.pk, second.pk, third.pk]


@pytest.mark.parametrize(
    ("month", "period"), [(1, 1), (3, 1), (4, 2), (6, 2), (9, 3), (10, 4), (12, 4)]
)
def test_the_scheduled_campaign_is_the_quarters_in_its_last_month_too(
    one_grant, system, month, period
):
    """Mutant R69 (`at.month // 3 + 1`): March, June, September and December were filed
    under the next quarter (a fifth in December) and opened a second campaign."""
    from datetime import UTC, datetime

    first_day = datetime(2026, (period - 1) * 3 + 1, 1, 9, tzinfo=UTC)
    at = datetime(2026, month, 28, 9, tzinfo=UTC)
    opened = reviews.review_campaign_open_scheduled(actor=system, at=at)
    assert (opened.key, opened.kind) == (f"scheduled:2026-P{period}", "scheduled")
    if first_day < at:
        assert reviews.review_campaign_open_scheduled(actor=system, at=first_day).pk == opened.pk
    (event,) = events(EventType.REVIEW_CAMPAIGN_OPENED)
    assert json.loads(event.data)["key"] == f"scheduled:2026-P{period}"


# --- the due-date job and reminders ------------------------------------------------------


def test_the_job_at_a_grants_very_expiry_closes_its_item_as_ended(one_grant, system):
    """Mutant R54 (`grant__expires_at__gte`): at the moment the grant expires, before its
    item's due date, the item is closed as ended by the job (nothing left to review)."""
    item = open_campaign(due_at=one_grant.expires_at + timedelta(days=1)).items.get()
    assert reviews.review_items_apply_due_rule(actor=system, at=one_grant.expires_at - MS) == 0
    assert reviews.review_items_apply_due_rule(actor=system, at=one_grant.expires_at) == 1
    item.refresh_from_db()
    assert (item.status, item.decided_at) == ("ended", one_grant.expires_at)
    (rule,) = events(EventType.REVIEW_ITEM_DUE_RULE)
    assert (rule.grant_id, json.loads(rule.data)["rule"]) == (one_grant.pk, "ended")
    assert Grant.objects.get(pk=one_grant.pk).status == "active"  # the expiry job's to record


def test_reminders_skip_a_grant_revoked_or_expiring_then_and_an_item_already_due(
    make_agent, make_tool, make_grant, approvers, settings, system,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    """Mutants R65 (`due_at__gte`), R67 (no grant status filter) and R68
    (`grant__expires_at__gte`): a reminder goes only about a live grant whose item is
    not yet due."""
    from governance.services import grants as grant_services

    settings.GRANT_MAX_TTL = timedelta(days=60)
    bot, repo = make_agent("bot"), make_tool("repo")
    live = make_grant(bot, repo, duration=timedelta(days=30))
    revoked = make_grant(bot, repo, scope="repo:acme/web/*", duration=timedelta(days=30))
    ending = make_grant(bot, repo, scope="repo:acme/ops/*", duration=timedelta(days=30))
    campaign = open_campaign()
    remind_at = campaign.due_at - timedelta(hours=1)
    Grant.objects.filter(pk=ending.pk).update(expires_at=remind_at)  # ends at that moment
    grant_services.grant_revoke(grant_id=revoked.pk, reason="done", actor=system, at=NOW + MS)
    with django_capture_on_commit_callbacks(execute=True):
        assert reviews.review_reminders_send(actor=system, at=remind_at) == 1
        # At the due date itself nothing is reminded: the rule applies now.
        ReviewItem.objects.update(reminded_at=None)
        assert reviews.review_reminders_send(actor=system, at=campaign.due_at) == 0
    reminders = Notification.objects.filter(event=NotificationEvent.REVIEW_DUE, data__reminder=True)
    assert [r.data["grant_id"] for r in reminders] == [live.pk]
    assert set(campaign.items.values_list("status", flat=True)) == {"pending"}


def test_a_reviewer_who_lost_the_role_is_not_reminded_the_admins_not_barred_are(
    one_grant, person, alice, system, django_capture_on_commit_callbacks
):
    """Mutants R61 (no `may_approve` check) and R62 (`u.pk in barred`): the reviewer
    was removed from the approvers since; the reminder goes to the admins who may
    decide the item instead, never to alice, an admin who requested the grant."""
    from django.contrib.auth.models import Group

    alice.email = "alice@example.test"
    alice.save()
    alice.groups.add(Group.objects.get_or_create(name="admins")[0])
    zed = person("zed", "admins")
    item = open_campaign().items.get()
    reviewer = item.reviewer
    assert reviewer not in (alice, None)
    reviewer.groups.clear()
    remind_at = item.due_at - timedelta(hours=1)
    with django_capture_on_commit_callbacks(execute=True):
        assert reviews.review_reminders_send(actor=system, at=remind_at) == 1
    rows = Notification.objects.filter(event=NotificationEvent.REVIEW_DUE, data__reminder=True)
    admins = {"heidi@example.test", "zed@example.test"} - {reviewer.email}
    assert {r.target for r in rows} == admins and zed.email in admins | {reviewer.email}
    assert {r.data["item_id"] for r in rows} == {item.pk}
    item.refresh_from_db()
    assert (item.status, item.reviewer, item.reminded_at) == ("pending", reviewer, remind_at)


# --- hygiene: the unused-grant flag ------------------------------------------------------


def use(grant, action, at):
    from governance.services.access import access_check

    decision = access_check(
        agent=grant.agent.name, tool=grant.tool.name, action=action, scope="repo:acme/api/x",
        at=at,
    )  # fmt: skip
    assert decision.allowed, decision
    assert AuditEvent.objects.get(uid=decision.decision_id).event_type == "access.allowed"


def flagged(grant):
    return [
        json.loads(e.data)["idle_actions"]
        for e in events("grant.unused_flagged", grant_id=grant.pk)
    ]


@pytest.fixture
def idle_world(make_agent, make_tool, make_grant, settings):
    """A day's idleness makes a right unused; grants from T0, three days before NOW."""
    settings.GRANT_MAX_TTL = timedelta(days=60)
    settings.UNUSED_GRANT_HOURS = 24
    return {"agent": make_agent("bot"), "tool": make_tool("repo"), "t0": NOW - timedelta(days=3)}


def test_another_action_going_idle_is_flagged_even_when_as_many_are_idle(
    idle_world, make_grant, system
):
    """Mutant H04 (`len(idle) != len(flagged)`): create was flagged idle; then create
    was used and update went idle instead: one idle action each time, but another one,
    so it is flagged again, naming update."""
    from governance.services import hygiene

    t0, h = idle_world["t0"], timedelta(hours=1)
    grant = make_grant(idle_world["agent"], idle_world["tool"], actions=("create", "update"),
                       starts_at=t0, duration=timedelta(days=20))  # fmt: skip
    use(grant, "update", t0 + 30 * h)
    assert hygiene.grants_flag_unused(actor=system, at=t0 + 36 * h) == 1
    use(grant, "create", t0 + 40 * h)
    assert hygiene.grants_flag_unused(actor=system, at=t0 + 48 * h) == 0  # update still fresh
    assert hygiene.grants_flag_unused(actor=system, at=t0 + 60 * h) == 1
    assert hygiene.grants_flag_unused(actor=system, at=t0 + 61 * h) == 0
    assert flagged(grant) == [["create"], ["update"]]
    row = Grant.objects.get(pk=grant.pk)
    assert (row.unused_flagged_at, row.unused_flagged_actions) == (t0 + 60 * h, ["update"])
    last = events("grant.unused_flagged", grant_id=grant.pk)[-1]
    assert json.loads(last.data)["proposal"] == "narrow_to_used" and last.actor == "system:test"


def test_reading_again_does_not_re_flag_an_idle_update(idle_world, make_grant, system):
    """Mutants H05 (uses of every action, not the idle ones), H06 and H07 (the grant's
    last use counted for a partly idle grant): a grant still read daily whose update is
    idle is flagged once for it, not on every scan after a read."""
    from governance.services import hygiene

    t0, h = idle_world["t0"], timedelta(hours=1)
    grant = make_grant(idle_world["agent"], idle_world["tool"], actions=("read", "update"),
                       starts_at=t0, duration=timedelta(days=20))  # fmt: skip
    use(grant, "read", t0 + 30 * h)
    assert hygiene.grants_flag_unused(actor=system, at=t0 + 36 * h) == 1
    use(grant, "read", t0 + 40 * h)
    assert hygiene.grants_flag_unused(actor=system, at=t0 + 48 * h) == 0
    assert flagged(grant) == [["update"]]
    row = Grant.objects.get(pk=grant.pk)
    assert (row.unused_flagged_at, row.last_used_at) == (t0 + 36 * h, t0 + 40 * h)
    # Used for update since the flag, then idle again for a day: a new spell, flagged.
    use(grant, "update", t0 + 50 * h)
    use(grant, "read", t0 + 70 * h)
    assert hygiene.grants_flag_unused(actor=system, at=t0 + 80 * h) == 1
    assert flagged(grant) == [["update"], ["update"]]


@pytest.mark.parametrize("reader", ["flag_job", "campaign"])
def test_a_use_made_since_the_last_fold_counts(idle_world, make_grant, system, reader):
    """Mutants H12 and R30 (no usage_fold before reading usage): a grant read an hour
    ago, with the minutely fold not yet run, is not idle: neither flagged by the job
    nor proposed for removal in a campaign opened now (each reads usage first)."""
    from governance.services import hygiene

    t0 = idle_world["t0"]
    grant = make_grant(idle_world["agent"], idle_world["tool"], starts_at=t0,
                       duration=timedelta(days=20))  # fmt: skip
    use(grant, "read", NOW - timedelta(hours=1))
    if reader == "flag_job":
        assert hygiene.grants_flag_unused(actor=system, at=NOW) == 0
        assert flagged(grant) == []
        assert Grant.objects.get(pk=grant.pk).unused_flagged_at is None
    else:
        item = open_campaign().items.get()
        assert (item.grant_id, item.proposal, item.idle_actions) == (grant.pk, "", [])
        (opened,) = events(EventType.REVIEW_CAMPAIGN_OPENED)
        assert json.loads(opened.data)["items"][0]["proposal"] == ""
    assert Grant.objects.get(pk=grant.pk).last_used_at == NOW - timedelta(hours=1)


def test_the_flag_job_without_any_use_since_the_fold_still_flags(idle_world, make_grant, system):
    """The counterpart: a grant unused for the whole day is flagged (and proposed)."""
    from governance.services import hygiene

    grant = make_grant(idle_world["agent"], idle_world["tool"], starts_at=idle_world["t0"],
                       duration=timedelta(days=20))  # fmt: skip
    assert hygiene.grants_flag_unused(actor=system, at=NOW) == 1
    assert flagged(grant) == [["read"]]
    assert open_campaign().items.get().proposal == "remove"


# --- hygiene: trend, expiring notices ----------------------------------------------------


def test_a_long_outage_is_backfilled_exactly_the_cap_of_days(make_agent, system):
    """Mutant H17 (one day less): after 100 days without a run, the 92 days before the
    one just ended are recorded late (each marked backfilled), no more, no fewer."""
    from governance.models import LiveGrantSnapshot
    from governance.services import hygiene

    start = NOW.replace(hour=0, minute=10)
    hygiene.trend_snapshot_record(actor=system, at=start)
    latest = hygiene.trend_snapshot_record(actor=system, at=start + timedelta(days=100))
    day = (start + timedelta(days=99)).date()
    assert latest.day == day
    days = sorted(LiveGrantSnapshot.objects.values_list("day", flat=True))
    assert len(days) == 1 + hygiene.TREND_BACKFILL_DAYS + 1
    assert days[1] == day - timedelta(days=hygiene.TREND_BACKFILL_DAYS)
    recorded = [json.loads(e.data) for e in events(EventType.TREND_RECORDED)]
    assert [r.get("backfilled", False) for r in recorded] == [False] + [True] * 92 + [False]
    assert recorded[1]["day"] == days[1].isoformat()


def test_no_expiry_notice_for_a_grant_ending_now_or_revoked(
    make_agent, make_tool, make_grant, alice, system, settings,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    """Mutants H22 (`expires_at__gte`) and H25 (no status filter): a grant that ends at
    that very moment, or was revoked, gets no "expires soon" notice; a live one does."""
    from governance.services import grants as grant_services
    from governance.services import hygiene

    alice.email = "alice@example.test"
    alice.save()
    settings.GRANT_EXPIRING_NOTICE = timedelta(hours=2)
    bot, repo = make_agent("bot"), make_tool("repo")
    live = make_grant(bot, repo, duration=timedelta(hours=3))
    ending = make_grant(bot, repo, scope="repo:acme/web/*", duration=timedelta(hours=3))
    revoked = make_grant(bot, repo, scope="repo:acme/ops/*", duration=timedelta(hours=3))
    at = live.expires_at - timedelta(hours=1)
    Grant.objects.filter(pk=ending.pk).update(expires_at=at)
    grant_services.grant_revoke(grant_id=revoked.pk, reason="done", actor=system, at=NOW)
    with django_capture_on_commit_callbacks(execute=True):
        assert hygiene.grants_notify_expiring(actor=system, at=at) == 1
    rows = Notification.objects.filter(event=NotificationEvent.GRANT_EXPIRING)
    assert [r.subject for r in rows] == [
        f"Grant #{live.pk} expires at {live.expires_at.isoformat()}"
    ]
    notified = dict(Grant.objects.values_list("pk", "expiring_notified_at"))
    assert notified == {live.pk: at, ending.pk: None, revoked.pk: None}
