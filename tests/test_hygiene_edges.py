"""Edges of the unused-grant rule, usage folding and re-certification that the mutation
run of services/hygiene.py, services/usage.py and services/reviews.py
(/tmp/scratch_hygiene) left untested: each test fails on the mutant named in its
docstring. Everything goes through the real services; each outcome is checked in its
answer, the rows and its audit events."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from governance.codes import EventType
from governance.models import AuditEvent, Grant, GrantActionUse, ReviewItem
from governance.policy import authorize
from governance.services import access, hygiene, reviews
from governance.services.usage import usage_fold
from tests.conftest import NOW
from tests.lifecycle_fixtures import decide, open_campaign

H = timedelta(hours=1)


def events(event_type: str, **filters: object) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(event_type=event_type, **filters).order_by("seq"))


def use(grant: Grant, action: str, at) -> None:
    decision = access.access_check(
        agent=grant.agent.name, tool=grant.tool.name, action=action, scope="repo:acme/api/x",
        at=at,
    )  # fmt: skip
    assert decision.allowed, decision
    assert AuditEvent.objects.get(uid=decision.decision_id).event_type == "access.allowed"


@pytest.fixture
def idle_world(make_agent, make_tool, settings, approvers):
    """A day's idleness makes a right unused; grants from T0, three days before NOW;
    erin, frank, grace approve and heidi is an admin (bob approved every grant)."""
    settings.GRANT_MAX_TTL = timedelta(days=60)
    settings.UNUSED_GRANT_HOURS = 24
    return {"agent": make_agent("bot"), "tool": make_tool("repo"), "t0": NOW - timedelta(days=3)}


def long_grant(idle_world, make_grant, actions):
    return make_grant(idle_world["agent"], idle_world["tool"], actions=actions,
                      starts_at=idle_world["t0"], duration=timedelta(days=20))  # fmt: skip


# --- usage: folding per action -----------------------------------------------------------


def test_a_late_folded_use_never_moves_an_actions_last_use_backwards(
    idle_world, make_grant, system
):
    """Mutant U11 (an action's last use set to the fold's, not the later of the two): a
    decision about an earlier instant folded after a recent update moved the update's
    last use back two days, and the update used an hour ago was proposed for removal."""
    grant = long_grant(idle_world, make_grant, ("read", "update"))
    use(grant, "read", NOW - H)
    use(grant, "update", NOW - H)
    assert usage_fold() == 2
    use(grant, "update", NOW - 48 * H)  # a decision about an earlier instant, folded late
    assert usage_fold() == 1
    rows = GrantActionUse.objects.filter(grant=grant).order_by("action")
    assert [(r.action, r.use_count, r.last_used_at) for r in rows] == [
        ("read", 1, NOW - H),
        ("update", 2, NOW - H),
    ]
    row = Grant.objects.get(pk=grant.pk)
    assert (row.use_count, row.last_used_at) == (3, NOW - H)
    assert hygiene.grants_flag_unused(actor=system, at=NOW) == 0
    assert events(EventType.GRANT_UNUSED_FLAGGED) == []
    assert Grant.objects.get(pk=grant.pk).unused_flagged_at is None


# --- reviews: the decision's record ------------------------------------------------------


def test_removing_an_unused_grant_ends_its_access_and_its_event_says_what_was_proposed(
    idle_world, make_grant
):
    """Mutants R23 (the event's comment replaced by the decision) and R24 (the event's
    proposal dropped): a grant unused for a day is proposed for removal, its reviewer
    revokes it with a comment, access ends at once, and the decision's event carries
    the comment, the proposal and the idle actions the reviewer acted on."""
    grant = long_grant(idle_world, make_grant, ("read", "update"))
    q = {"agent": "bot", "tool": "repo", "action": "update", "scope": "repo:acme/api/x"}
    assert authorize(at=NOW, **q).allowed
    item = open_campaign().items.get()
    assert (item.grant_id, item.proposal, item.idle_actions) == (
        grant.pk, "remove", ["read", "update"],
    )  # fmt: skip
    decided = decide(item, "revoke", comment="nobody uses it")
    assert (decided.status, decided.decided_by, decided.comment) == (
        "revoked", item.reviewer, "nobody uses it",
    )  # fmt: skip
    row = Grant.objects.get(pk=grant.pk)
    assert (row.status, row.revoked_at, row.revoked_by) == ("revoked", NOW, item.reviewer)
    assert authorize(at=NOW, **q).reason == "grant_revoked"
    (revoked,) = events(EventType.GRANT_REVOKED)
    (event,) = events(EventType.REVIEW_ITEM_DECIDED)
    assert revoked.grant_id == event.grant_id == grant.pk and revoked.seq < event.seq
    data = json.loads(event.data)
    assert (data["decision"], data["comment"], data["decided_by"]) == (
        "revoke", "nobody uses it", item.reviewer.username,
    )  # fmt: skip
    assert (data["proposal"], data["idle_actions"], data["item_id"]) == (
        "remove", ["read", "update"], item.pk,
    )  # fmt: skip
    assert ReviewItem.objects.get(pk=item.pk).status == "revoked"


# --- the unused rule's boundary ----------------------------------------------------------


def test_an_update_last_used_exactly_the_threshold_ago_is_idle(idle_world, make_grant, system):
    """Mutant S04 (an action used at the cutoff counted fresh by the query): an update
    last used exactly UNUSED_GRANT_HOURS ago is idle, as a grant last used then is,
    while the grant is read daily: one millisecond before that it is not yet idle, at
    that moment it is flagged for narrowing to read, once."""
    from tests.conftest import MS

    grant = long_grant(idle_world, make_grant, ("read", "update"))
    use(grant, "update", NOW - 24 * H)
    use(grant, "read", NOW - H)
    assert hygiene.grants_flag_unused(actor=system, at=NOW - MS) == 0
    assert events(EventType.GRANT_UNUSED_FLAGGED) == []
    assert hygiene.grants_flag_unused(actor=system, at=NOW) == 1
    assert hygiene.grants_flag_unused(actor=system, at=NOW) == 0
    row = Grant.objects.get(pk=grant.pk)
    assert (row.unused_flagged_at, row.unused_flagged_actions) == (NOW, ["update"])
    (event,) = events(EventType.GRANT_UNUSED_FLAGGED)
    data = json.loads(event.data)
    assert (event.grant_id, event.actor) == (grant.pk, "system:test")
    assert (data["proposal"], data["idle_actions"], data["keep_actions"]) == (
        "narrow_to_read", ["update"], ["read"],
    )  # fmt: skip
    assert data["last_used"] == {"update": (NOW - 24 * H).isoformat()}
    item = open_campaign(at=NOW).items.get()
    assert (item.proposal, item.idle_actions) == ("narrow_to_read", ["update"])


def test_a_grant_used_recently_with_no_use_per_action_on_record_is_left_alone(
    idle_world, make_grant, system
):
    """Mutant S07 (`recent and below`): a grant whose usage was folded before uses were
    kept per action (its row says read an hour ago, no action's use is on record) is
    not known to be idle; it was proposed for removal, every right and all."""
    grant = long_grant(idle_world, make_grant, ("read", "update"))
    Grant.objects.filter(pk=grant.pk).update(use_count=7, last_used_at=NOW - H)
    assert not GrantActionUse.objects.filter(grant=grant).exists()
    assert hygiene.grants_flag_unused(actor=system, at=NOW) == 0
    assert events(EventType.GRANT_UNUSED_FLAGGED) == []
    assert Grant.objects.get(pk=grant.pk).unused_flagged_at is None
    item = open_campaign(at=NOW).items.get()
    assert (item.grant_id, item.proposal, item.idle_actions) == (grant.pk, "", [])
    (opened,) = events(EventType.REVIEW_CAMPAIGN_OPENED)
    assert json.loads(opened.data)["items"][0]["proposal"] == ""
    # A day after that use, with still nothing on record per action, it is idle.
    later = NOW + 24 * H
    assert hygiene.grants_flag_unused(actor=system, at=later) == 1
    (event,) = events(EventType.GRANT_UNUSED_FLAGGED)
    assert json.loads(event.data)["idle_actions"] == ["read", "update"]


def test_a_grant_used_while_the_scan_reads_is_not_flagged_and_the_scan_goes_on(
    idle_world, make_grant, system, monkeypatch
):
    """A real bug: the scan reads the uses since the cutoff, then each candidate's last
    uses in a second query. A fold committing between the two (the minutely beat, while
    a scan of many grants runs) made a candidate busy; it was returned anyway, with
    none of its idle attributes, and the flag job failed on it (PartlyFailed; before
    flagging anyone when it had been flagged before). The grant used meanwhile is not
    idle; the other idle grant is flagged, and the job ends normally."""
    from governance import selectors

    busy = long_grant(idle_world, make_grant, ("read", "update"))
    idle = make_grant(idle_world["agent"], idle_world["tool"], scope="repo:acme/web/*",
                      starts_at=idle_world["t0"], duration=timedelta(days=20))  # fmt: skip
    use(busy, "read", NOW - H)
    real = selectors._action_uses

    def used_meanwhile(pks):
        # The agent updates through the busy grant and a fold commits, between the scan's
        # read of the uses since the cutoff and this read of the candidates' last uses.
        use(busy, "update", NOW - H)
        assert usage_fold() == 1
        return real(pks)

    monkeypatch.setattr(selectors, "_action_uses", used_meanwhile)
    assert hygiene.grants_flag_unused(actor=system, at=NOW) == 1
    (event,) = events(EventType.GRANT_UNUSED_FLAGGED)
    data = json.loads(event.data)
    assert (event.grant_id, data["proposal"], data["idle_actions"]) == (idle.pk, "remove", ["read"])
    flags = dict(Grant.objects.values_list("pk", "unused_flagged_at"))
    assert flags == {busy.pk: None, idle.pk: NOW}


# --- reviews: who hears about an item ----------------------------------------------------


def test_a_reviewer_who_took_a_stake_since_the_campaign_opened_is_not_the_one_reminded(
    idle_world, make_grant, person, system, django_capture_on_commit_callbacks
):
    """A real bug: the assigned reviewer, an admin (made one since, if need be), issued
    herself a token for the agent after the campaign opened; she may no longer decide
    its grant (self_review), yet the reminder and the overdue notice went to her alone,
    and the other admins, who could decide it, were never told before the due-date rule
    revoked it. They go to those admins instead."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    from governance.codes import NotificationEvent
    from governance.errors import Forbidden
    from governance.models import Notification
    from governance.services import agents as agent_services

    grant = long_grant(idle_world, make_grant, ("read",))
    zed = person("zed", "admins")
    item = open_campaign().items.get()
    reviewer = item.reviewer
    assert reviewer is not None
    reviewer.groups.add(Group.objects.get_or_create(name="admins")[0])
    admins = {get_user_model().objects.get(username="heidi").email, zed.email} - {reviewer.email}
    agent_services.token_issue(created_by=reviewer, agent=grant.agent, actor=system, at=NOW + H)
    with pytest.raises(Forbidden) as caught:
        decide(item, "keep", at=NOW + 2 * H)
    assert caught.value.code == "self_review"
    remind_at = item.due_at - H
    with django_capture_on_commit_callbacks(execute=True):
        assert reviews.review_reminders_send(actor=system, at=remind_at) == 1
        assert reviews.review_items_apply_due_rule(actor=system, at=item.due_at) == 1
    reminders = Notification.objects.filter(event=NotificationEvent.REVIEW_DUE, data__reminder=True)
    assert {r.target for r in reminders} == admins
    overdue = Notification.objects.filter(event=NotificationEvent.REVIEW_OVERDUE)
    assert {r.target for r in overdue} == admins
    item.refresh_from_db()
    assert (item.status, item.decided_by, item.reminded_at) == ("auto_revoked", None, remind_at)
    assert Grant.objects.get(pk=grant.pk).status == "revoked"
    (rule,) = events(EventType.REVIEW_ITEM_DUE_RULE)
    assert (rule.grant_id, json.loads(rule.data)["reviewer"]) == (grant.pk, reviewer.username)
    assert events(EventType.REVIEW_ITEM_DECIDED) == []
