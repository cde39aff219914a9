"""Re-certification: campaigns with one item per live grant, reviewers who neither asked
for nor approved the grant, keep / narrow / revoke with a comment effective at once, the
due-date rule, reminders. Every service and job is called twice."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core import mail
from django.core.management import CommandError, call_command
from django.utils import timezone

from governance import selectors
from governance.audit import Actor
from governance.codes import EventType, NotificationEvent
from governance.errors import Conflict, Forbidden, GovernanceError
from governance.models import AuditEvent, Grant, Notification, ReviewCampaign, ReviewItem
from governance.policy import authorize
from governance.services import grants as grant_services
from governance.services import reviews
from tests.conftest import MS, NOW


def events(event_type: str, **filters: object) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(event_type=event_type, **filters).order_by("seq"))


@pytest.fixture
def world(make_agent, make_tool, make_grant, approvers, bob, system):
    """bob approved every grant (alice requested them); bob is an approver too, so the
    rotation must skip him."""
    bob.groups.add(Group.objects.get_or_create(name="approvers")[0])
    bob.email = "bob@example.test"
    bob.save()
    parent_agent = make_agent("bot")
    child_agent = make_agent("sub", parent=parent_agent)
    tool = make_tool("repo")
    long = timedelta(days=5)
    g1 = make_grant(parent_agent, tool, actions=("read", "update"), duration=long, delegable=True)
    g2 = make_grant(parent_agent, tool, scope="repo:acme/web/*", duration=long)
    g3 = make_grant(make_agent("other"), tool, duration=long)
    child = grant_services.grant_delegate(
        parent_grant_id=g1.pk,
        child=child_agent,
        actions=["read", "update"],
        scope="repo:acme/api/*",
        expires_at=g1.expires_at,
        justification="sub-task",
        actor=system,
        at=NOW - timedelta(minutes=10),
    )
    return {"grants": [g1, g2, g3], "child": child, "approvers": approvers, "bob": bob}


def open_campaign(at=NOW, **kw):
    kw.setdefault("kind", "on_demand")
    kw.setdefault("reason", "quarter end")
    return reviews.review_campaign_open(actor=Actor.system("test"), at=at, **kw)


def test_a_campaign_has_one_item_per_live_grant_and_rotates_reviewers(
    world, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        campaign = open_campaign(key="q4")
        again = open_campaign(key="q4")
    assert again.pk == campaign.pk and ReviewCampaign.objects.count() == 1

    items = list(campaign.items.order_by("grant_id"))
    # Every live grant, the subagent's delegated one included; ended grants not at all.
    assert [i.grant_id for i in items] == [g.pk for g in world["grants"]] + [world["child"].pk]
    assert all(i.due_at == NOW + timedelta(days=14) for i in items)
    reviewers = [i.reviewer.username for i in items]
    # Never bob (approver) nor alice (requester), not even of the delegated grant (they
    # stand behind its parent); consecutive items go to different people.
    assert "bob" not in reviewers and "alice" not in reviewers
    assert len(set(reviewers)) == 4

    (opened,) = events(EventType.REVIEW_CAMPAIGN_OPENED)
    data = json.loads(opened.data)
    assert data["campaign_id"] == campaign.pk and len(data["items"]) == 4
    assert [i["grant"] for i in data["items"]] == [i.grant_id for i in items]
    # Each reviewer is told once, with their items.
    rows = Notification.objects.filter(event=NotificationEvent.REVIEW_DUE)
    assert sorted(r.target for r in rows) == sorted(f"{r}@example.test" for r in reviewers)
    assert len(mail.outbox) == 4


def test_an_item_nobody_may_review_reaches_the_admins_at_open_and_before_its_due_date(
    make_agent, make_tool, make_grant, alice, bob, system, settings,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    """alice (the only admin) requested the grant and owns its agent, bob (the only other
    approver) approved it: nobody may review it, so the item is left unassigned, for
    the admins. They were told neither when it opened nor before its due date, and under
    the keep rule the grant was then kept with nobody having looked."""
    alice.groups.add(Group.objects.get_or_create(name="admins")[0])
    bob.groups.add(Group.objects.get_or_create(name="approvers")[0])
    alice.email, bob.email = "alice@example.test", "bob@example.test"
    alice.save()
    bob.save()
    settings.GRANT_MAX_TTL = timedelta(days=30)  # the grant outlives the campaign's due date
    make_grant(make_agent("bot"), make_tool("repo"), duration=timedelta(days=30))
    with django_capture_on_commit_callbacks(execute=True):
        campaign = open_campaign()
    (item,) = campaign.items.all()
    assert item.reviewer is None
    told = Notification.objects.filter(event=NotificationEvent.REVIEW_DUE)
    assert [r.target for r in told] == ["alice@example.test"]
    opened = told.get()
    assert opened.data["items"] == [item.pk]
    before = item.due_at - settings.REVIEW_REMIND_BEFORE + timedelta(minutes=1)
    with django_capture_on_commit_callbacks(execute=True):
        assert reviews.review_reminders_send(actor=system, at=before) == 1
        assert reviews.review_reminders_send(actor=system, at=before) == 0  # once
    reminded = Notification.objects.filter(event=NotificationEvent.REVIEW_DUE).exclude(pk=opened.pk)
    assert [r.target for r in reminded] == ["alice@example.test"]
    assert reminded.get().data["reminder"] is True


def test_nobody_reviews_a_grant_they_requested_or_approved(world, person):
    campaign = open_campaign()
    item = campaign.items.first()
    for who in (world["bob"], item.grant.requested_by):
        who.groups.add(Group.objects.get_or_create(name="admins")[0])
        who = type(who).objects.get(pk=who.pk)  # fresh role cache
        with pytest.raises(Forbidden) as caught:
            decide(item, "keep", reviewer=who, comment="fine")
        assert caught.value.code == "self_review"
    stranger = person("sam", "approvers")
    with pytest.raises(Forbidden) as caught:
        decide(item, "keep", reviewer=stranger, comment="fine")
    assert caught.value.code == "not_assigned"
    assert ReviewItem.objects.get(pk=item.pk).status == "pending"
    assert events(EventType.REVIEW_ITEM_DECIDED) == []


@pytest.mark.parametrize("lost", ["deactivated", "role_removed"])
def test_an_assigned_reviewer_who_lost_their_authority_decides_nothing(world, lost):
    """The reviewer assigned when the campaign opened was deactivated, or the approver
    role was taken from them, since: a keep from them re-certified the grant on no
    one's authority. Refused `not_approver`, the item pending, nothing on record; the
    item stays for an admin (or the undecided-item rule at its due date)."""
    campaign = open_campaign()
    # An approver's item: the rotation starts at the campaign's id, which on PostgreSQL
    # depends on the campaigns earlier tests opened, and an admin keeps deciding as one.
    item = campaign.items.exclude(reviewer=None).exclude(reviewer__groups__name="admins").first()
    reviewer = item.reviewer
    if lost == "deactivated":
        reviewer.is_active = False
        reviewer.save()
    else:
        reviewer.groups.remove(Group.objects.get(name="approvers"))
    reviewer = type(reviewer).objects.get(pk=reviewer.pk)  # fresh role cache
    before = AuditEvent.objects.count()
    with pytest.raises(Forbidden) as caught:
        decide(item, "keep", reviewer=reviewer, comment="fine")
    assert caught.value.code == "not_approver"
    assert ReviewItem.objects.get(pk=item.pk).status == "pending"
    assert Grant.objects.get(pk=item.grant_id).status == "active"
    assert events(EventType.REVIEW_ITEM_DECIDED) == []
    assert AuditEvent.objects.count() == before


def test_nobody_re_certifies_their_own_agents_grant(world, person, make_agent, make_grant):
    """olga, an admin, owns the agent (and so does whoever is behind the agent above a
    subagent): she is never assigned its grants and may not decide them, though she
    neither requested nor approved them."""
    olga = person("olga", "admins")
    mine = make_agent("olga-bot", owner=olga)
    tool = world["grants"][0].tool
    make_grant(mine, tool, duration=timedelta(days=5))
    for _ in range(len(selectors.approver_users())):  # every rotation offset: never olga
        campaign = open_campaign(agent=mine)
        item = campaign.items.get()
        assert item.reviewer is not None and item.reviewer != olga
        opened = events(EventType.REVIEW_CAMPAIGN_OPENED)[-1]
        assert "olga" not in {i["reviewer"] for i in json.loads(opened.data)["items"]}
    with pytest.raises(Forbidden) as caught:
        decide(item, "keep", reviewer=olga, comment="fine")
    assert caught.value.code == "self_review"
    assert ReviewItem.objects.get(pk=item.pk).status == "pending"
    assert events(EventType.REVIEW_ITEM_DECIDED) == []


def test_a_delegated_grant_is_certified_on_its_own(world):
    """Keeping the parent does not keep what was handed down: the subagent's grant has
    its own item, which nobody behind the parent may decide, and revoking it ends only
    the subagent's access."""
    g1, child = world["grants"][0], world["child"]
    campaign = open_campaign()
    parent_item, child_item = campaign.items.get(grant=g1), campaign.items.get(grant=child)
    for who in (world["bob"], g1.requested_by):  # g1's approver and requester
        who.groups.add(Group.objects.get_or_create(name="admins")[0])
        who = type(who).objects.get(pk=who.pk)  # fresh role cache
        with pytest.raises(Forbidden) as caught:
            decide(child_item, "keep", reviewer=who, comment="mine anyway")
        assert caught.value.code == "self_review"
    assert events(EventType.REVIEW_ITEM_DECIDED) == []

    q = {"tool": "repo", "action": "update", "scope": "repo:acme/api/x", "at": NOW}
    assert authorize(agent="sub", **q).allowed and authorize(agent="bot", **q).allowed
    decide(parent_item, "keep")
    decide(child_item, "revoke", comment="the sub-task is done")
    assert authorize(agent="sub", **q).reason == "grant_revoked"
    assert authorize(agent="bot", **q).allowed
    assert Grant.objects.get(pk=g1.pk).status == "active"
    (revoked,) = events(EventType.GRANT_REVOKED)
    assert revoked.grant_id == child.pk and revoked.agent == "sub"
    decided = events(EventType.REVIEW_ITEM_DECIDED)
    assert [(e.grant_id, json.loads(e.data)["decision"]) for e in decided] == [
        (g1.pk, "keep"),
        (child.pk, "revoke"),
    ]


def test_a_live_break_glass_grant_is_in_the_campaign_and_its_opener_cannot_review_it(
    world, approvers
):
    from governance.services import breakglass

    erin = approvers[0]
    bg = breakglass.breakglass_open(
        opener=erin,
        agent=world["grants"][2].agent,
        tool=world["grants"][2].tool,
        actions=["read"],
        scope="repo:acme/ops/*",
        ticket="INC-7",
        reason="outage",
        actor=Actor.user(erin),
        at=NOW - timedelta(minutes=5),
    )
    item = open_campaign().items.get(grant=bg.grant)
    assert item.reviewer is not None and item.reviewer != erin
    erin.groups.add(Group.objects.get_or_create(name="admins")[0])
    erin = type(erin).objects.get(pk=erin.pk)
    with pytest.raises(Forbidden) as caught:
        decide(item, "keep", reviewer=erin, comment="I opened it, it is fine")
    assert caught.value.code == "self_review"
    assert events(EventType.REVIEW_ITEM_DECIDED) == []
    decide(item, "revoke", comment="incident over")
    assert Grant.objects.get(pk=bg.grant_id).status == "revoked"
    (decided,) = events(EventType.REVIEW_ITEM_DECIDED)
    assert decided.grant_id == bg.grant_id
    assert [e.grant_id for e in events(EventType.GRANT_REVOKED)] == [bg.grant_id]


def decide(item, decision, *, reviewer=None, **kw):
    """Decide an item as its assigned reviewer, or as `reviewer`."""
    reviewer = reviewer or item.reviewer
    return reviews.review_item_decide(
        item_id=item.pk,
        reviewer=reviewer,
        decision=decision,
        comment=kw.pop("comment", "checked with the team"),
        actor=Actor.user(reviewer),
        at=kw.pop("at", NOW),
        **kw,
    )


def test_keep_records_the_decision_once(world):
    item = open_campaign().items.first()
    decided = decide(item, "keep")
    with pytest.raises(Conflict) as caught:
        decide(item, "keep")
    assert caught.value.code == "already_decided"
    assert (decided.status, decided.decided_by, decided.comment) == (
        "kept",
        item.reviewer,
        "checked with the team",
    )
    (event,) = events(EventType.REVIEW_ITEM_DECIDED)
    assert event.grant_id == item.grant_id and json.loads(event.data)["decision"] == "keep"
    assert Grant.objects.get(pk=item.grant_id).status == "active"


def test_a_comment_is_required_for_every_decision(world):
    item = open_campaign().items.first()
    for decision in ("keep", "narrow", "revoke", "maybe"):
        with pytest.raises(GovernanceError):
            decide(item, decision, comment="  ", actions=["read"])
    assert ReviewItem.objects.get(pk=item.pk).status == "pending"


def test_revoke_takes_effect_at_once_with_the_delegations(world):
    g1, child = world["grants"][0], world["child"]
    item = open_campaign().items.get(grant=g1)
    q = {"agent": "bot", "tool": "repo", "action": "read", "scope": "repo:acme/api/x"}
    assert authorize(at=NOW, **q).allowed
    decide(item, "revoke", at=NOW)
    with pytest.raises(Conflict):
        decide(item, "revoke", at=NOW)
    assert not authorize(at=NOW, **q).allowed
    assert not authorize(at=NOW, **{**q, "agent": "sub"}).allowed
    assert Grant.objects.get(pk=child.pk).status == "revoked"
    assert len(events(EventType.GRANT_REVOKED)) == 2
    (decided,) = events(EventType.REVIEW_ITEM_DECIDED)
    assert json.loads(decided.data)["decision"] == "revoke"


def test_narrow_shrinks_at_once_and_revokes_delegations_that_no_longer_fit(world):
    g1, child = world["grants"][0], world["child"]
    item = open_campaign().items.get(grant=g1)
    earlier = g1.expires_at - timedelta(days=1)
    decide(item, "narrow", actions=["read"], scope="repo:acme/api/docs/*", expires_at=earlier)
    with pytest.raises(Conflict):
        decide(item, "narrow", actions=["read"])

    g1.refresh_from_db()
    assert (g1.actions, g1.scope, g1.expires_at) == (["read"], "repo:acme/api/docs/*", earlier)
    q = {"agent": "bot", "tool": "repo", "at": NOW}
    assert authorize(action="read", scope="repo:acme/api/docs/a", **q).allowed
    assert not authorize(action="read", scope="repo:acme/api/src/a", **q).allowed
    assert not authorize(action="update", scope="repo:acme/api/docs/a", **q).allowed
    # The delegation held update on all of api/*: now wider than its parent, so revoked.
    assert Grant.objects.get(pk=child.pk).status == "revoked"
    (narrowed,) = events(EventType.GRANT_NARROWED)
    assert json.loads(narrowed.data)["before"]["actions"] == ["read", "update"]
    assert ReviewItem.objects.get(pk=item.pk).status == "narrowed"


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"actions": ["read", "delete"]}, "wider_actions"),
        ({"scope": "repo:acme/*"}, "wider_scope"),
        ({"scope": "repo:other/*"}, "wider_scope"),
        ({"expires_at": NOW + timedelta(days=30)}, "longer_expiry"),
        ({"expires_at": NOW - MS}, "invalid_expiry"),
        ({"actions": []}, "wider_actions"),
    ],
)
def test_narrowing_never_widens(world, change, code):
    g1 = world["grants"][0]
    item = open_campaign().items.get(grant=g1)
    with pytest.raises(GovernanceError) as caught:
        decide(item, "narrow", **change)
    assert caught.value.code == code
    g1_after = Grant.objects.get(pk=g1.pk)
    assert (g1_after.actions, g1_after.scope) == (["read", "update"], "repo:acme/api/*")
    assert ReviewItem.objects.get(pk=item.pk).status == "pending"
    assert events(EventType.GRANT_NARROWED) == []


def test_narrowing_delegation_off_stops_it_and_revokes_what_was_handed_down(world):
    """A reviewer who finds a grant should not be handed on switches `delegable` off:
    its agent can delegate it no more, and the delegations it made (a subagent's
    access the reviewer just said it should not have been given) are revoked with it,
    each with its event, before the narrowed event and the item's."""
    g1, child = world["grants"][0], world["child"]
    item = open_campaign().items.get(grant=g1)
    q = {"tool": "repo", "action": "read", "scope": "repo:acme/api/x", "at": NOW}
    assert authorize(agent="sub", **q).allowed
    decide(item, "narrow", delegable=False)

    g1.refresh_from_db()
    assert (g1.status, g1.delegable, g1.actions, g1.scope) == (
        "active", False, ["read", "update"], "repo:acme/api/*",
    )  # fmt: skip
    child.refresh_from_db()
    assert (child.status, child.revoked_by) == ("revoked", item.reviewer)
    assert authorize(agent="bot", **q).allowed and not authorize(agent="sub", **q).allowed
    assert ReviewItem.objects.get(pk=item.pk).status == "narrowed"
    last_three = list(AuditEvent.objects.order_by("-seq")[:3])[::-1]
    assert [(e.event_type, e.grant_id) for e in last_three] == [
        (EventType.GRANT_REVOKED, child.pk),
        (EventType.GRANT_NARROWED, g1.pk),
        (EventType.REVIEW_ITEM_DECIDED, g1.pk),
    ]
    revoked, narrowed, _ = (json.loads(e.data) for e in last_three)
    assert revoked["reason"] == f"parent grant #{g1.pk} narrowed: it may no longer be delegated"
    assert (narrowed["before"]["delegable"], narrowed["delegable"]) == (True, False)
    with pytest.raises(Forbidden) as refused:
        grant_services.grant_delegate(
            parent_grant_id=g1.pk, child=child.agent, actions=["read"], scope="repo:acme/api/*",
            expires_at=g1.expires_at, justification="again", actor=Actor.system("t"), at=NOW,
        )  # fmt: skip
    assert refused.value.code == "not_delegable"


def test_a_narrowing_never_makes_a_grant_delegable(world):
    g2 = world["grants"][1]
    item = open_campaign().items.get(grant=g2)
    before = AuditEvent.objects.count()
    with pytest.raises(Forbidden) as caught:
        decide(item, "narrow", delegable=True)
    assert caught.value.code == "wider_delegation"
    assert Grant.objects.get(pk=g2.pk).delegable is False
    assert ReviewItem.objects.get(pk=item.pk).status == "pending"
    assert AuditEvent.objects.count() == before


def test_a_delegation_withdrawn_earlier_keeps_its_fitting_children_when_narrowed(world, system):
    """Only a switch made now ends the delegations: a grant whose delegation a person
    overruled before (delegable already false: _overruled) keeps, narrowed otherwise,
    the children that still fit, as it did then."""
    g1, wide = world["grants"][0], world["child"]
    fits = grant_services.grant_delegate(
        parent_grant_id=g1.pk, child=wide.agent, actions=["read"], scope="repo:acme/api/docs/*",
        expires_at=NOW + timedelta(hours=1), justification="docs", actor=system, at=NOW,
    )  # fmt: skip
    Grant.objects.filter(pk=g1.pk).update(delegable=False)
    grant_services.grant_narrow(
        grant_id=g1.pk, actions=["read"], delegable=False, reason="read only", actor=system, at=NOW
    )
    assert Grant.objects.get(pk=fits.pk).status == "active"
    assert Grant.objects.get(pk=wide.pk).status == "revoked"  # update: no longer fits
    (narrowed,) = events(EventType.GRANT_NARROWED)
    assert json.loads(narrowed.data)["before"]["delegable"] is False


@pytest.mark.parametrize("decision", ["keep", "revoke"])
@pytest.mark.parametrize(
    "narrowing",
    [{"scope": "repo:acme/api/docs/*"}, {"actions": ["read"]},
     {"expires_at": NOW + timedelta(hours=1)}, {"delegable": False}],
)  # fmt: skip
def test_keep_or_revoke_with_narrowing_is_refused_not_half_obeyed(world, decision, narrowing):
    """A reviewer who sends a narrower scope with "keep" meant something "keep" would
    not do: refused (invalid_decision), and nothing is decided or written."""
    g1 = world["grants"][0]
    item = open_campaign().items.get(grant=g1)
    before = AuditEvent.objects.count()
    with pytest.raises(GovernanceError) as caught:
        decide(item, decision, **narrowing)
    assert caught.value.code == "invalid_decision"
    g1_after = Grant.objects.get(pk=g1.pk)
    assert (g1_after.status, g1_after.actions, g1_after.scope) == (
        "active", ["read", "update"], "repo:acme/api/*",
    )  # fmt: skip
    assert ReviewItem.objects.get(pk=item.pk).status == "pending"
    assert AuditEvent.objects.count() == before


def test_undecided_items_are_revoked_at_the_due_date_by_default(
    world, system, django_capture_on_commit_callbacks
):
    campaign = open_campaign()
    kept = campaign.items.order_by("id").first()
    decide(kept, "keep")
    due = campaign.due_at
    # Grants must outlive the due date to be revoked by the rule: stretch them (test setup).
    Grant.objects.update(expires_at=due + timedelta(days=1))
    assert reviews.review_items_apply_due_rule(actor=system, at=due - MS) == 0
    with django_capture_on_commit_callbacks(execute=True):
        assert reviews.review_items_apply_due_rule(actor=system, at=due) == 3
        assert reviews.review_items_apply_due_rule(actor=system, at=due) == 0
    statuses = dict(campaign.items.values_list("grant_id", "status"))
    assert sorted(statuses.values()) == ["auto_revoked", "auto_revoked", "auto_revoked", "kept"]
    for grant_id, status in statuses.items():
        expected = "active" if status == "kept" else "revoked"
        assert Grant.objects.get(pk=grant_id).status == expected
    assert len(events(EventType.REVIEW_ITEM_DUE_RULE)) == 3
    assert Notification.objects.filter(event=NotificationEvent.REVIEW_OVERDUE).count() == 3

    assert reviews.review_campaigns_close(actor=system, at=due) == 1
    assert reviews.review_campaigns_close(actor=system, at=due) == 0
    campaign.refresh_from_db()
    assert campaign.status == "closed"
    (closed,) = events(EventType.REVIEW_CAMPAIGN_CLOSED)
    assert json.loads(closed.data)["items"] == {"auto_revoked": 3, "kept": 1}


@pytest.mark.parametrize("rule", ["revoke", "keep"])
def test_an_undecided_item_past_its_due_date_ends_the_grant_with_no_job_run(world, settings, rule):
    """Under the default rule, a grant whose review item nobody decided is revoked at
    the due date, as an expired grant is refused at its expiry: by the decision, not by
    the hourly job (which may be late, or down). Its delegations end with it. A kept
    item's grant goes on; under the rule `keep`, so does every grant."""
    from governance.policy import authorize
    from governance.services.access import access_check

    settings.REVIEW_DEFAULT_RULE = rule
    campaign = open_campaign()
    kept_item = campaign.items.get(grant=world["grants"][1])
    decide(kept_item, "keep")
    due = campaign.due_at
    Grant.objects.update(expires_at=due + timedelta(days=1))  # outlive the due date
    read = {"tool": "repo", "action": "read", "scope": "repo:acme/api/x"}
    assert authorize(agent="bot", at=due - MS, **read).allowed
    assert authorize(agent="sub", at=due - MS, **read).allowed

    ended = access_check(agent="bot", at=due, **read)
    child = access_check(agent="sub", at=due, **read)
    kept = access_check(agent="bot", at=due, **{**read, "scope": "repo:acme/web/x"})

    if rule == "revoke":
        assert (ended.decision, ended.reason) == ("deny", "grant_revoked")
        assert (child.decision, child.reason) == ("deny", "grant_revoked")
    else:
        assert ended.allowed and child.allowed
    assert kept.allowed
    for decision in (ended, child, kept):
        event = AuditEvent.objects.get(uid=decision.decision_id)
        assert (event.decision, event.reason) == (decision.decision, decision.reason)
    # Nothing was changed by those decisions: the job still does the bookkeeping.
    assert set(Grant.objects.values_list("status", flat=True)) == {"active"}
    assert campaign.items.filter(status="pending").count() == 3
    # What is in force says the same: the matrix file and the daily count.
    from governance import selectors

    in_force = set(selectors.grants_in_force(due).values_list("pk", flat=True))
    g1, g2, g3 = world["grants"]
    if rule == "revoke":
        assert in_force == {g2.pk}  # the kept one: the others fell due undecided
        # The job runs an hour late and revokes then; a question about the moment in
        # between (a what-if, the access report) still gets the answer given then.
        late = due + timedelta(hours=1)
        reviews.review_items_apply_due_rule(actor=Actor.system("test"), at=late)
        # The row says when access ended (the due date, as authorize() decided); the
        # event says when the job recorded it, and when it took effect.
        assert Grant.objects.get(pk=g1.pk).revoked_at == due
        revoked = AuditEvent.objects.get(event_type="grant.revoked", grant_id=g1.pk)
        assert revoked.created_at == late
        assert json.loads(revoked.data)["effective_at"] == due.isoformat()
        from governance.services.exports import access_period_rows

        period = access_period_rows(due + timedelta(minutes=10), due + timedelta(minutes=20))
        assert g1.pk not in {row["grant"] for row in period}
        between = authorize(agent="bot", at=due + timedelta(minutes=30), **read)
        assert (between.decision, between.reason) == ("deny", "grant_revoked")
        assert g1.pk not in selectors.grants_in_force(due + timedelta(minutes=30)).values_list(
            "pk", flat=True
        )
    else:
        assert {g1.pk, g2.pk, g3.pk} <= in_force


@pytest.mark.parametrize("rule", ["revoke", "keep"])
def test_the_period_report_says_a_grant_whose_review_fell_due_undecided_was_revoked(
    world, settings, rule, auditor_session
):
    """Before the hourly job has run, a grant whose item fell due undecided is still an
    active row with no revoked_at: the period report listed it as if usable. It now says
    `grant_revoked` (its delegation too), as authorize() does; under the rule `keep`,
    nothing is blocked."""
    settings.REVIEW_DEFAULT_RULE = rule
    campaign = open_campaign()
    decide(campaign.items.get(grant=world["grants"][1]), "keep")
    due = campaign.due_at
    Grant.objects.update(expires_at=due + timedelta(days=1))  # outlive the due date
    g1, g2, g3 = world["grants"]
    start, end = due + timedelta(minutes=10), due + timedelta(minutes=20)
    response = auditor_session.get(
        "/ui/exports/access",
        {"format": "json", "start": start.isoformat(), "end": end.isoformat()},
    )
    assert response.status_code == 200, response.content[:300]
    rows = {row["grant"]: row["blocked_by"] for row in json.loads(response.content)["rows"]}
    revoked = "grant_revoked" if rule == "revoke" else None
    assert rows == {g1.pk: revoked, g2.pk: None, g3.pk: revoked, world["child"].pk: revoked}
    read = {"tool": "repo", "action": "read", "at": start}
    for agent, scope, expected in (
        ("bot", "repo:acme/api/x", revoked),  # g1
        ("bot", "repo:acme/web/x", None),  # g2, kept
        ("other", "repo:acme/api/x", revoked),  # g3
        ("sub", "repo:acme/api/x", revoked),  # delegated from g1
    ):
        decision = authorize(agent=agent, scope=scope, **read)
        assert (None if decision.allowed else decision.reason) == expected
    # The job has not run: every row is still active, every other item still pending.
    assert set(Grant.objects.values_list("status", flat=True)) == {"active"}
    assert campaign.items.filter(status="pending").count() == 3
    event = AuditEvent.objects.order_by("-seq").first()
    assert (event.event_type, event.actor) == ("report.exported", "user:carol")
    data = json.loads(event.data)
    assert (data["report"], data["rows"]) == ("access_period", 4)


def test_the_due_date_rule_can_be_keep(world, system, settings):
    settings.REVIEW_DEFAULT_RULE = "keep"
    campaign = open_campaign()
    Grant.objects.update(expires_at=campaign.due_at + timedelta(days=1))
    assert reviews.review_items_apply_due_rule(actor=system, at=campaign.due_at) == 4
    assert set(campaign.items.values_list("status", flat=True)) == {"auto_kept"}
    assert set(Grant.objects.values_list("status", flat=True)) == {"active"}


def test_items_whose_grant_ended_are_closed_without_nagging(world, system):
    campaign = open_campaign()
    g2 = world["grants"][1]
    grant_services.grant_revoke(grant_id=g2.pk, reason="done", actor=system, at=NOW)
    assert reviews.review_items_apply_due_rule(actor=system, at=NOW + MS) == 1
    assert campaign.items.get(grant=g2).status == "ended"
    # Reminders skip it; the live ones are reminded once, within REVIEW_REMIND_BEFORE.
    remind_at = campaign.due_at - timedelta(hours=72)
    Grant.objects.filter(status="active").update(expires_at=campaign.due_at + timedelta(days=1))
    assert reviews.review_reminders_send(actor=system, at=remind_at - MS) == 0
    assert reviews.review_reminders_send(actor=system, at=remind_at) == 3
    assert reviews.review_reminders_send(actor=system, at=remind_at + timedelta(hours=1)) == 0
    reminders = Notification.objects.filter(event=NotificationEvent.REVIEW_DUE, data__reminder=True)
    assert {r.data["grant_id"] for r in reminders} == {
        world["grants"][0].pk,
        world["grants"][2].pk,
        world["child"].pk,
    }


def test_unused_grants_carry_a_proposal_and_show_in_the_selector(world, settings):
    """Per action: the subagent reads through its delegated read+update grant and never
    updates, so both it and the parent it came from (used through it) have an idle
    update: narrow to read. g2, never used: remove (read and all)."""
    from governance.services.access import access_check
    from governance.services.usage import usage_fold

    settings.UNUSED_GRANT_HOURS = 30 * 24
    g1, g2, g3 = world["grants"]
    later = NOW + timedelta(days=31)
    Grant.objects.update(expires_at=later + timedelta(days=10))
    for at in (later - timedelta(days=1), NOW + timedelta(days=1)):
        assert access_check(agent="sub", tool="repo", action="read", scope="repo:acme/api/x",
                            at=at).allowed  # fmt: skip
        assert access_check(agent="other", tool="repo", action="read", scope="repo:acme/api/x",
                            at=at).allowed  # fmt: skip
    usage_fold(at=later)
    found = {g.pk: (g.proposal, g.idle_actions) for g in selectors.unused_grants(later)}
    assert found == {
        g1.pk: ("narrow_to_read", ["update"]),
        g2.pk: ("remove", ["read"]),
        world["child"].pk: ("narrow_to_read", ["update"]),
    }
    campaign = reviews.review_campaign_open(
        kind="on_demand", reason="unused", actor=Actor.system("test"), at=later
    )
    proposals = {i.grant_id: (i.proposal, i.idle_actions) for i in campaign.items.all()}
    assert proposals == {**found, g3.pk: ("", [])}
    (opened,) = AuditEvent.objects.filter(event_type="review.campaign_opened")
    named = {
        i["grant"]: (i["proposal"], i["idle_actions"]) for i in json.loads(opened.data)["items"]
    }
    assert named == proposals


def test_the_scheduled_job_opens_one_campaign_per_quarter(world, system):
    first = reviews.review_campaign_open_scheduled(actor=system, at=NOW)
    again = reviews.review_campaign_open_scheduled(actor=system, at=NOW + timedelta(days=1))
    assert first.pk == again.pk and first.key == "scheduled:2026-P4" and first.kind == "scheduled"
    assert len(events(EventType.REVIEW_CAMPAIGN_OPENED)) == 1


def test_the_review_open_command(world, monkeypatch):
    monkeypatch.setattr(timezone, "now", lambda: NOW)  # the command reads the clock
    out = StringIO()
    call_command("review_open", "--reason", "after INC-9", "--agent", "bot", stdout=out)
    campaign = ReviewCampaign.objects.get()
    # bot's two grants and what bot handed down to its subagent: access it controls.
    g1, g2, _ = world["grants"]
    assert set(campaign.items.values_list("grant_id", flat=True)) == {
        g1.pk, g2.pk, world["child"].pk,
    }  # fmt: skip
    assert campaign.agent.name == "bot" and "3 item(s)" in out.getvalue()
    assert events(EventType.REVIEW_CAMPAIGN_OPENED)[0].actor == "system:command:review_open"


def test_the_same_campaign_opened_twice_by_a_person_is_one_campaign(world, system):
    """A double click on "Open campaign" opened two: every grant was under review twice,
    and a grant its reviewer kept in one was revoked at the due date for the other's
    silence. Asked again while it is open, it is the same campaign; another reason, agent
    or person, or one asked after the first has closed, is another."""
    approvers = world["approvers"]
    first = open_campaign(opened_by=approvers[0], reason="after INC-9")
    again = open_campaign(at=NOW + timedelta(seconds=1), opened_by=approvers[0],
                          reason="after INC-9")  # fmt: skip
    assert again.pk == first.pk
    assert len(events(EventType.REVIEW_CAMPAIGN_OPENED)) == 1
    assert open_campaign(opened_by=approvers[0], reason="quarter end").pk != first.pk
    assert open_campaign(opened_by=approvers[1], reason="after INC-9").pk != first.pk
    after_due = first.due_at + timedelta(seconds=1)
    Grant.objects.update(expires_at=after_due + timedelta(days=30))
    later = open_campaign(at=after_due, opened_by=approvers[0], reason="after INC-9")
    assert later.pk != first.pk


def test_a_keyed_one_agent_campaign_cannot_stand_in_for_the_quarters(world, system):
    """A key names one campaign. A one-agent campaign opened under the quarter's key used
    to be returned by the scheduled job, and nobody else's grants were reviewed."""
    bot = world["child"].agent.parent
    for key in ("scheduled:2026-P4", "incident:breakglass:1"):
        with pytest.raises(GovernanceError) as err:
            reviews.review_campaign_open(
                kind="on_demand", reason="just bot", key=key, agent=bot, actor=system, at=NOW
            )
        assert err.value.code == "reserved_key"
    assert not ReviewCampaign.objects.exists() and events(EventType.REVIEW_CAMPAIGN_OPENED) == []
    # A key of one's own still names one campaign: another agent cannot take it over.
    mine = reviews.review_campaign_open(
        kind="on_demand", reason="bot", key="audit-7", agent=bot, actor=system, at=NOW
    )
    with pytest.raises(Conflict) as err:
        reviews.review_campaign_open(
            kind="on_demand", reason="all", key="audit-7", actor=system, at=NOW
        )
    assert err.value.code == "campaign_key_taken"
    assert reviews.review_campaign_open_scheduled(actor=system, at=NOW).pk != mine.pk
    assert len(events(EventType.REVIEW_CAMPAIGN_OPENED)) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--due-days", "3000000"], "--due-days must be 1 to 365"),
        (["--due-days", "-1"], "--due-days must be 1 to 365"),
        (["--key", "k" * 101], "--key must be 1 to 100 characters"),
        # The system's keys, whatever the kind: the quarter's campaign then never opened.
        (["--kind", "scheduled", "--key", "scheduled:2031-P1"], "are the system's"),
        (["--kind", "incident", "--key", "incident:INC-1"], "are the system's"),
        # Who opens it is an active admin (ghost is deactivated, carol an auditor).
        (["--user", "ghost"], "--user: 'ghost' is not an active admin"),
        (["--user", "carol"], "--user: 'carol' is not an active admin"),
        (["--user", "nobody"], "--user: 'nobody' is not an active admin"),
    ],
)
def test_the_review_open_command_refuses_bad_bounds_with_a_line_not_a_traceback(
    world, args, message
):
    """3,000,000 days overflowed the date (OverflowError), a 101-character key the
    column (DataError): each a traceback. Now a CommandError, and nothing is opened."""
    User = get_user_model()  # noqa: N806
    User.objects.create_user("ghost", is_active=False).groups.add(
        Group.objects.get_or_create(name="admins")[0]
    )
    User.objects.create_user("carol").groups.add(Group.objects.get_or_create(name="auditors")[0])
    before = AuditEvent.objects.count()
    with pytest.raises(CommandError, match=message):
        call_command("review_open", "--reason", "r", *args, stdout=StringIO())
    assert not ReviewCampaign.objects.exists() and AuditEvent.objects.count() == before


def test_grant_narrow_twice_narrows_once(world, system):
    g1 = world["grants"][0]
    for _ in range(2):
        narrowed = grant_services.grant_narrow(
            grant_id=g1.pk,
            actions=["update", "read"][1:],
            reason="least privilege",
            actor=system,
            at=NOW,
        )
    assert narrowed.actions == ["read"]
    assert len(events(EventType.GRANT_NARROWED)) == 1
    # The same set in another order is no change either.
    grant_services.grant_narrow(
        grant_id=g1.pk, actions=["read"], scope="repo:acme/api/*", reason="x", actor=system, at=NOW
    )
    assert len(events(EventType.GRANT_NARROWED)) == 1
    with pytest.raises(GovernanceError) as caught:
        grant_services.grant_narrow(grant_id=g1.pk, reason=" ", actor=system, at=NOW)
    assert caught.value.code == "reason_required"


def test_selectors_for_the_ui(world, system):
    campaign = open_campaign()
    item = campaign.items.order_by("id").first()
    (listed,) = selectors.review_campaigns(open_only=True)
    assert (listed.pk, listed.total, listed.pending) == (campaign.pk, 4, 4)
    mine = selectors.review_items_for(item.reviewer, NOW)
    assert item.pk in [i.pk for i in mine] and not any(i.is_overdue for i in mine)
    assert all(i.is_overdue for i in selectors.review_items_for(item.reviewer, campaign.due_at))
    decide(item, "keep")
    assert selectors.review_campaigns(open_only=True).get().pending == 3
    assert list(selectors.second_looks_for(item.reviewer)) == []


@pytest.mark.parametrize("decision", ["keep", "narrow", "revoke"])
def test_at_the_due_date_a_decision_is_refused_and_the_rule_applies_at_once(
    world, decision, django_capture_on_commit_callbacks
):
    """A late "keep" (the job not run yet) used to be recorded and defeat the revoke
    rule. At or after the due date the rule applies, whoever asks and whenever the
    job runs: the reviewer gets 409 past_due saying so."""
    campaign = open_campaign()
    item = campaign.items.get(grant=world["grants"][0])
    Grant.objects.update(expires_at=campaign.due_at + timedelta(days=1))  # outlive the due date
    kw = {"actions": ["read"]} if decision == "narrow" else {}
    with django_capture_on_commit_callbacks(execute=True):
        with pytest.raises(Conflict) as caught:
            decide(item, decision, at=campaign.due_at, **kw)
    assert caught.value.code == "past_due" and "'revoke'" in caught.value.message
    item.refresh_from_db()
    assert (item.status, item.decided_by, item.decided_at) == (
        "auto_revoked",
        None,
        campaign.due_at,
    )
    assert Grant.objects.get(pk=item.grant_id).status == "revoked"
    assert events(EventType.REVIEW_ITEM_DECIDED) == []
    (rule,) = events(EventType.REVIEW_ITEM_DUE_RULE)
    assert rule.grant_id == item.grant_id and json.loads(rule.data)["rule"] == "revoke"
    assert events(EventType.GRANT_REVOKED, grant_id=item.grant_id)[0].seq < rule.seq
    # The job finds nothing more to do for it; a second late try is already_decided.
    assert reviews.review_items_apply_due_rule(actor=Actor.system("t"), at=campaign.due_at) == 3
    assert len(events(EventType.REVIEW_ITEM_DUE_RULE, grant_id=item.grant_id)) == 1
    with pytest.raises(Conflict) as again:
        decide(item, "keep", at=campaign.due_at)
    assert again.value.code == "already_decided"


def test_a_late_decision_under_the_keep_rule_is_auto_kept(world, settings):
    settings.REVIEW_DEFAULT_RULE = "keep"
    campaign = open_campaign()
    item = campaign.items.get(grant=world["grants"][1])
    Grant.objects.update(expires_at=campaign.due_at + timedelta(days=1))
    with pytest.raises(Conflict) as caught:
        decide(item, "revoke", at=campaign.due_at + MS)
    assert caught.value.code == "past_due" and "'keep'" in caught.value.message
    item.refresh_from_db()
    assert item.status == "auto_kept" and Grant.objects.get(pk=item.grant_id).status == "active"
    (rule,) = events(EventType.REVIEW_ITEM_DUE_RULE)
    assert json.loads(rule.data)["rule"] == "keep"
    # One millisecond before the due date a decision is an ordinary one.
    other = campaign.items.get(grant=world["grants"][2])
    assert decide(other, "keep", at=campaign.due_at - MS).status == "kept"


@pytest.mark.parametrize("decision", ["keep", "revoke"])
def test_deciding_an_item_whose_grant_ended_closes_it_as_ended(world, system, decision):
    """ "kept" used to be recorded for a grant revoked meanwhile."""
    campaign = open_campaign()
    g2 = world["grants"][1]
    item = campaign.items.get(grant=g2)
    grant_services.grant_revoke(grant_id=g2.pk, reason="incident", actor=system, at=NOW + MS)
    with pytest.raises(Conflict) as caught:
        decide(item, decision, at=NOW + 2 * MS)
    assert caught.value.code == "grant_not_live" and "closed as ended" in caught.value.message
    item.refresh_from_db()
    assert (item.status, item.decided_by) == ("ended", None)
    assert events(EventType.REVIEW_ITEM_DECIDED) == []
    (rule,) = events(EventType.REVIEW_ITEM_DUE_RULE)
    assert rule.grant_id == g2.pk and json.loads(rule.data)["rule"] == "ended"
    assert len(events(EventType.GRANT_REVOKED, grant_id=g2.pk)) == 1  # not revoked twice
    # Past its expiry (before the expiry job ran) is ended too.
    g3 = world["grants"][2]
    item3 = campaign.items.get(grant=g3)
    with pytest.raises(Conflict) as caught:
        decide(item3, decision, at=g3.expires_at)
    assert caught.value.code == "grant_not_live"
    assert ReviewItem.objects.get(pk=item3.pk).status == "ended"


@pytest.mark.parametrize("ending", ["revoked", "expired", "late_decision"])
def test_a_grant_ended_after_its_review_fell_due_stays_ended_from_the_due_date(
    world, system, ending
):
    """The item fell due undecided, so the grant ended at the due date; before the
    hourly job came, the grant ended on its own too (an admin revoked it, it expired,
    or a reviewer answered late), and the job closed the item `ended`, not
    `auto_revoked`. The moment in between used to read as allowed again: a what-if,
    the access report and the file said access that authorize() had refused then."""
    from governance.services.access import access_check

    campaign = open_campaign()
    item = campaign.items.get(grant=world["grants"][0])
    grant = item.grant
    due = campaign.due_at
    Grant.objects.update(expires_at=due + timedelta(days=1))
    read = {"tool": "repo", "action": "read", "scope": "repo:acme/api/x"}
    between = due + timedelta(minutes=20)
    then = access_check(agent="bot", at=between, **read)
    assert (then.decision, then.reason) == ("deny", "grant_revoked")
    event = AuditEvent.objects.get(uid=then.decision_id)
    assert (event.decision, event.reason) == ("deny", "grant_revoked")

    ended_at = due + timedelta(minutes=30)
    late = due + timedelta(minutes=50)
    if ending == "revoked":
        grant_services.grant_revoke(grant_id=grant.pk, reason="tidy", actor=system, at=ended_at)
        reviews.review_items_apply_due_rule(actor=system, at=late)
    elif ending == "expired":
        Grant.objects.filter(pk=grant.pk).update(expires_at=ended_at)
        reviews.review_items_apply_due_rule(actor=system, at=late)
    else:  # revoked, then the reviewer answers after the due date, before the job
        grant_services.grant_revoke(grant_id=grant.pk, reason="tidy", actor=system, at=ended_at)
        with pytest.raises(Conflict, match="was due at"):
            decide(item, "keep", at=late)
    item.refresh_from_db()
    assert item.status == "ended" and item.decided_at == late

    again = authorize(agent="bot", at=between, **read)
    assert (again.decision, again.reason) == ("deny", "grant_revoked")
    assert grant.pk not in selectors.grants_in_force(between).values_list("pk", flat=True)
    from governance.services.reports import access_rows

    rows = [r for r in access_rows(at=between) if r["grant"] == grant.pk]
    assert rows == [] or rows[0]["blocked_by"] is not None


# --- A late decision, another campaign's due date, a narrowing that changes nothing ----


def test_a_refused_late_decision_is_not_logged_as_the_reviewers_revoke(world):
    g1 = world["grants"][0]
    campaign = open_campaign(due_at=NOW + timedelta(days=1))
    item = campaign.items.get(grant=g1)
    who = item.reviewer
    with pytest.raises(Conflict) as refused:
        reviews.review_item_decide(
            item_id=item.pk, reviewer=who, decision="keep", comment="keep it",
            actor=Actor.user(who), at=NOW + timedelta(days=1, hours=3),
        )  # fmt: skip
    assert refused.value.code == "past_due"
    revoked = AuditEvent.objects.get(event_type=EventType.GRANT_REVOKED, grant_id=g1.pk)
    rule = AuditEvent.objects.get(event_type=EventType.REVIEW_ITEM_DUE_RULE, grant_id=g1.pk)
    assert (revoked.actor_type, rule.actor_type) == ("system", "system")
    assert Grant.objects.get(pk=g1.pk).revoked_at == NOW + timedelta(days=1)


def test_keep_is_refused_for_a_grant_another_campaign_already_ended(world):
    g1 = world["grants"][0]
    due = NOW + timedelta(days=1)
    open_campaign(reason="first", due_at=due)
    later = due + timedelta(minutes=10)
    read = {"agent": "bot", "tool": "repo", "action": "read", "scope": "repo:acme/api/x"}
    assert authorize(at=later, **read).reason == "grant_revoked"
    # A campaign opened now has no item for it (nor for the child handed down from it).
    second = open_campaign(reason="second", at=later)
    assert not second.items.filter(grant=g1).exists()
    assert not second.items.filter(grant=world["child"]).exists()
    # An item opened earlier, still pending, cannot keep it either: it closes as ended.
    third = open_campaign(
        reason="third", at=NOW + timedelta(hours=1), due_at=due + timedelta(days=3)
    )
    item = third.items.get(grant=g1)
    with pytest.raises(Conflict) as refused:
        reviews.review_item_decide(
            item_id=item.pk, reviewer=item.reviewer, decision="keep", comment="still needed",
            actor=Actor.user(item.reviewer), at=later + timedelta(minutes=1),
        )  # fmt: skip
    assert refused.value.code == "grant_not_live"
    item.refresh_from_db()
    assert item.status == "ended"
    assert not events(EventType.REVIEW_ITEM_DECIDED, grant_id=g1.pk)


def test_a_narrowing_that_changes_nothing_is_not_recorded_as_narrowed(world):
    g1 = world["grants"][0]
    item = open_campaign().items.get(grant=g1)
    with pytest.raises(GovernanceError) as refused:
        reviews.review_item_decide(
            item_id=item.pk, reviewer=item.reviewer, decision="narrow", comment="narrowed",
            actor=Actor.user(item.reviewer), at=NOW + timedelta(minutes=1),
            scope=g1.scope, actions=list(g1.actions),
        )  # fmt: skip
    assert refused.value.code == "invalid_decision"
    item.refresh_from_db()
    assert item.status == "pending"
    assert not events(EventType.REVIEW_ITEM_DECIDED) and not events(EventType.GRANT_NARROWED)


def test_keep_is_refused_for_a_suspended_agents_grant_another_campaign_ended(world, system):
    from governance.models import Agent
    from governance.services.agents import agent_suspend

    g1 = world["grants"][0]
    due = NOW + timedelta(days=1)
    open_campaign(reason="first", due_at=due)
    third = open_campaign(
        reason="third", at=NOW + timedelta(hours=1), due_at=due + timedelta(days=3)
    )
    item = third.items.get(grant=g1)
    agent_suspend(
        agent=Agent.objects.get(name="bot"), reason="incident", actor=system,
        at=NOW + timedelta(hours=2),
    )  # fmt: skip
    with pytest.raises(Conflict) as refused:
        reviews.review_item_decide(
            item_id=item.pk, reviewer=item.reviewer, decision="keep", comment="still needed",
            actor=Actor.user(item.reviewer), at=due + timedelta(minutes=10),
        )  # fmt: skip
    assert refused.value.code == "grant_not_live"


def test_a_suspended_agents_live_grant_is_still_reviewed(world, system):
    from governance.models import Agent
    from governance.services.agents import agent_suspend

    g1 = world["grants"][0]
    item = open_campaign().items.get(grant=g1)
    agent_suspend(
        agent=Agent.objects.get(name="bot"), reason="incident", actor=system,
        at=NOW + timedelta(minutes=1),
    )  # fmt: skip
    reviews.review_item_decide(
        item_id=item.pk, reviewer=item.reviewer, decision="revoke", comment="gone",
        actor=Actor.user(item.reviewer), at=NOW + timedelta(minutes=2),
    )  # fmt: skip
    item.refresh_from_db()
    assert item.status == "revoked"


def test_a_late_revoke_is_dated_from_the_earliest_due_date(world):
    g1 = world["grants"][0]
    due_b = NOW + timedelta(days=1)
    due_a = due_b + timedelta(minutes=30)
    Grant.objects.update(expires_at=NOW + timedelta(days=3))
    item_a = open_campaign(reason="A", due_at=due_a).items.get(grant=g1)
    open_campaign(reason="B", due_at=due_b)
    read = {"agent": "bot", "tool": "repo", "action": "read", "scope": "repo:acme/api/x"}
    assert authorize(at=due_b + timedelta(minutes=10), **read).reason == "grant_revoked"
    with pytest.raises(Conflict):
        reviews.review_item_decide(
            item_id=item_a.pk, reviewer=item_a.reviewer, decision="keep", comment="ok",
            actor=Actor.user(item_a.reviewer), at=due_a + timedelta(minutes=10),
        )  # fmt: skip
    reviews.review_items_apply_due_rule(actor=Actor.system("t"), at=due_a + timedelta(minutes=20))
    assert Grant.objects.get(pk=g1.pk).revoked_at == due_b
