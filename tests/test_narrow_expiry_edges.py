"""grant_narrow (with _descendants_of and _narrowed_envelope), the expiry jobs
(grants_expire, grant_requests_expire, approvals_expire) and the task services
(task_open, task_close, tasks_end) at the edges a mutation run found untested: each
test here passes on the services and fails on a one-token change of them that the
other tests let through (the run: /tmp/scratch_narrow; each test's docstring names its
mutants). Everything goes through the real services; each test checks the answer, the
rows and the audit events."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from governance.audit import Actor
from governance.codes import EventType
from governance.errors import Conflict, GovernanceError
from governance.models import Approval, AuditEvent, Grant, Task
from governance.services import access, approvals, grants, tasks
from tests import test_grants_edges, test_services
from tests.conftest import MS, NOW
from tests.test_grants_edges import data
from tests.test_lifecycle_races import _while_held
from tests.test_services import delegate, request

family = test_services.family  # the fixture: parent -> child, grandchild, stranger
bot, repo = test_grants_edges.bot, test_grants_edges.repo  # the fixtures


def top_seq() -> int:
    return AuditEvent.objects.order_by("-seq").values_list("seq", flat=True).first() or 0


def events_after(seq: int) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(seq__gt=seq).order_by("seq"))


# --- grant_narrow ---------------------------------------------------------------------


def test_a_grant_whose_task_has_ended_is_not_narrowed_before_the_job_closes_the_task(
    bot, repo, make_task, make_grant, system
):
    """N02 (`status != active and dead`): a grant still `active` on its row but dead at
    `at` (its task ran out, the job has not closed it yet) was narrowed, and a
    `grant.narrowed` event said a dead grant had been changed."""
    task = make_task("OPS-9", ends_at=NOW)
    grant = make_grant(bot, repo, ("read", "update"), task=task)  # to NOW + 30 min
    seq = top_seq()
    with pytest.raises(Conflict) as refused:
        grants.grant_narrow(
            grant_id=grant.pk, actions=["read"], reason="least privilege", actor=system,
            at=NOW + timedelta(minutes=1),
        )  # fmt: skip
    assert refused.value.code == "grant_not_live"
    row = Grant.objects.get(pk=grant.pk)
    assert (row.status, row.actions) == (Grant.Status.ACTIVE, ["read", "update"])
    assert events_after(seq) == []


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"actions": ["read", "read"]}, "invalid_grant"),
        ({"expires_at": NOW + timedelta(minutes=30) + MS}, "longer_expiry"),
        ({"expires_at": NOW + timedelta(seconds=1)}, "invalid_expiry"),
    ],
)
def test_a_narrowing_at_an_edge_is_refused_and_writes_nothing(
    bot, repo, make_grant, system, change, code
):
    """N04 (`!=` of the repeat check weakened): a repeated action was taken as one; N06
    (`>` loosened by a second): an expiry later than the grant's own was accepted;
    N08 (`<=` made `<`): an expiry at the very moment of the narrowing was accepted,
    ending the grant as a `grant.narrowed`, not as the revoke it is."""
    grant = make_grant(bot, repo, ("read", "update"))  # NOW - 30 min .. NOW + 30 min
    assert grant.expires_at == NOW + timedelta(minutes=30)
    seq = top_seq()
    with pytest.raises(GovernanceError) as refused:
        grants.grant_narrow(
            grant_id=grant.pk, reason="least privilege", actor=system,
            at=NOW + timedelta(seconds=1), **change,
        )  # fmt: skip
    assert refused.value.code == code
    row = Grant.objects.get(pk=grant.pk)
    assert (row.status, row.actions, row.expires_at) == (
        Grant.Status.ACTIVE, ["read", "update"], NOW + timedelta(minutes=30),
    )  # fmt: skip
    assert events_after(seq) == []


def test_narrowing_to_the_same_actions_in_another_order_changes_nothing(
    bot, repo, make_grant, system
):
    """N24 (the grant's own order not restored): ["update", "read"] of a read+update
    grant was stored in the new order and recorded as a narrowing that narrowed
    nothing."""
    grant = make_grant(bot, repo, ("read", "update"))
    seq = top_seq()
    same = grants.grant_narrow(
        grant_id=grant.pk, actions=["update", "read"], reason="same", actor=system, at=NOW
    )
    assert same.actions == ["read", "update"]
    assert Grant.objects.get(pk=grant.pk).actions == ["read", "update"]
    assert events_after(seq) == []


def test_narrowing_voids_an_approved_call_it_no_longer_covers(bot, repo, make_grant, bob, system):
    """N11 (only pending approvals voided): a delete a person had approved under a grant
    then narrowed to read stayed `approved`, a confirmation for a call the grant no
    longer allows, still counted and listed as open."""
    grant = make_grant(bot, repo, ("read", "delete"), "repo:acme/*")
    asked = access.access_check(
        agent="bot", tool="repo", action="delete", scope="repo:acme/x", at=NOW
    )
    assert asked.decision == "approval_required"
    approvals.approval_approve(
        approval_id=asked.approval_id, approver=bob, actor=Actor.user(bob), at=NOW + MS
    )
    seq = top_seq()
    grants.grant_narrow(
        grant_id=grant.pk, actions=["read"], reason="read only", actor=system,
        at=NOW + timedelta(seconds=1),
    )  # fmt: skip
    assert Approval.objects.get(pk=asked.approval_id).status == Approval.Status.EXPIRED
    assert Grant.objects.get(pk=grant.pk).actions == ["read"]
    (narrowed,) = events_after(seq)
    assert narrowed.event_type == EventType.GRANT_NARROWED
    assert data(narrowed)["approvals_voided"] == 1
    assert data(narrowed)["before"]["actions"] == ["read", "delete"]


def test_a_grant_whose_delegation_was_withdrawn_keeps_the_delegations_that_still_fit(
    family, bob, system
):
    """N10 (`grant.delegable and` dropped): narrowing a grant that a person's overrule
    had already made non-delegable revoked every delegation from it, those inside the
    narrowed grant too, as if delegation had been switched off now."""
    parent, child, _, _ = family
    kept = delegate(parent, child)  # read, repo:acme/api/*
    other = delegate(parent, child, scope="repo:acme/web/*")
    grants.grant_revoke(
        grant_id=other.pk, reason="not this", actor=Actor.user(bob), at=NOW, revoked_by=bob
    )
    parent.refresh_from_db()
    assert parent.delegable is False
    seq = top_seq()
    grants.grant_narrow(
        grant_id=parent.pk, actions=["read"], reason="read only", actor=system, at=NOW + MS
    )
    assert Grant.objects.get(pk=kept.pk).status == Grant.Status.ACTIVE
    assert Grant.objects.get(pk=parent.pk).actions == ["read"]
    assert [(e.event_type, e.grant_id) for e in events_after(seq)] == [
        (EventType.GRANT_NARROWED, parent.pk)
    ]
    ask = {"agent": "child", "tool": "repo", "action": "read", "scope": "repo:acme/api/x"}
    assert access.access_check(at=NOW + 2 * MS, **ask).allowed


def test_narrowing_keeps_the_delegations_inside_it_and_revokes_the_rest_in_the_persons_name(
    family, bob
):
    """N15 (pattern_within's arguments swapped), N16 (`<=` made `<`), N17 (a child's
    expiry not compared with the narrowed parent's), N20 (the cascade's revoked_by
    dropped): a delegation inside the narrowed grant was revoked, one outliving it was
    kept, or the revoke named nobody where a person had narrowed the parent."""
    parent, child, _, _ = family  # read+update, repo:acme/*, to NOW + 30 min
    new_end = NOW + timedelta(minutes=20)
    inside = delegate(parent, child, scope="repo:acme/api/x", expires_at=NOW + timedelta(minutes=5))
    same_end = delegate(parent, child, scope="repo:acme/api/*", expires_at=new_end)
    outlives = delegate(parent, child, scope="repo:acme/api/y")  # to NOW + 30 min
    seq = top_seq()
    grants.grant_narrow(
        grant_id=parent.pk, scope="repo:acme/api/*", expires_at=new_end, reason="review",
        actor=Actor.user(bob), at=NOW + MS, narrowed_by=bob,
    )  # fmt: skip
    rows = {g.pk: g for g in Grant.objects.filter(pk__in=[inside.pk, same_end.pk, outlives.pk])}
    assert rows[inside.pk].status == rows[same_end.pk].status == Grant.Status.ACTIVE
    ended = rows[outlives.pk]
    assert (ended.status, ended.revoked_at, ended.revoked_by) == (
        Grant.Status.REVOKED, NOW + MS, bob,
    )  # fmt: skip
    written = events_after(seq)
    assert [(e.event_type, e.grant_id) for e in written] == [
        (EventType.GRANT_REVOKED, outlives.pk),
        (EventType.GRANT_NARROWED, parent.pk),
    ]
    assert data(written[0])["reason"] == f"parent grant #{parent.pk} narrowed"
    assert data(written[1])["before"] == {
        "actions": ["read", "update"], "scope": "repo:acme/*",
        "expires_at": (NOW + timedelta(minutes=30)).isoformat(), "delegable": True,
    }  # fmt: skip
    for scope, allowed in [("repo:acme/api/x", True), ("repo:acme/api/y", True)]:
        ask = {"agent": "child", "tool": "repo", "action": "read", "scope": scope}
        assert access.access_check(at=NOW + 2 * MS, **ask).allowed is allowed


# --- The expiry jobs racing a person (PostgreSQL: real concurrent transactions) ----------


@pytest.mark.django_db(transaction=True)
def test_the_expiry_job_leaves_a_grant_revoked_while_it_ran_as_revoked(
    postgres_only, bot, repo, make_grant, bob, system
):
    """E02 (the claim's `status=active` dropped): the job read the grant as active, then
    waited for a person's revoke to commit, and overwrote `revoked` with `expired` and
    announced an expiry of a grant that had been revoked."""
    grant = make_grant(bot, repo)
    end = grant.expires_at

    def revoke() -> None:
        grants.grant_revoke(
            grant_id=grant.pk, reason="incident", actor=Actor.user(bob), at=end - MS,
            revoked_by=bob,
        )  # fmt: skip

    marked = _while_held(revoke, lambda: grants.grants_expire(actor=system, at=end))
    assert marked == 0
    row = Grant.objects.get(pk=grant.pk)
    assert (row.status, row.revoked_at, row.revoked_by) == (Grant.Status.REVOKED, end - MS, bob)
    kinds = [e.event_type for e in AuditEvent.objects.filter(grant_id=grant.pk).order_by("seq")]
    assert EventType.GRANT_EXPIRED not in kinds and kinds[-1] == EventType.GRANT_REVOKED


@pytest.mark.django_db(transaction=True)
def test_the_request_expiry_job_leaves_a_request_approved_while_it_ran_as_approved(
    postgres_only, bot, repo, alice, bob, system, settings
):
    """E05 (the claim's `status=pending` dropped): the job read the request as pending,
    waited for an approval to commit, and turned the live grant into `denied` with an
    event saying nobody decided it."""
    pending = request(bot, repo, alice)  # created at NOW
    due = NOW + settings.GRANT_REQUEST_TTL

    def approve() -> None:
        grants.grant_approve(grant_id=pending.pk, approver=bob, actor=Actor.user(bob), at=due - MS)

    closed = _while_held(approve, lambda: grants.grant_requests_expire(actor=system, at=due))
    assert closed == 0
    row = Grant.objects.get(pk=pending.pk)
    assert (row.status, row.approved_by, row.starts_at) == (Grant.Status.ACTIVE, bob, due - MS)
    kinds = [e.event_type for e in AuditEvent.objects.filter(grant_id=row.pk).order_by("seq")]
    assert EventType.GRANT_REQUEST_EXPIRED not in kinds and kinds[-1] == EventType.GRANT_ISSUED


@pytest.mark.django_db(transaction=True)
def test_the_approval_expiry_job_leaves_an_approval_consumed_while_it_ran_as_consumed(
    postgres_only, bot, repo, make_grant, bob, system
):
    """A04 (the claim's `status=` dropped): the job read the approval as approved,
    waited for the call that consumed it to commit, and recorded the used approval as
    `expired`: the log then says the call ran on an approval that had expired unused."""
    make_grant(bot, repo, ("delete",), duration=timedelta(hours=2))
    ask = {"agent": "bot", "tool": "repo", "action": "delete", "scope": "repo:acme/api/x"}
    asked = access.access_check(at=NOW, **ask)
    assert asked.decision == "approval_required"
    approval = approvals.approval_approve(
        approval_id=asked.approval_id, approver=bob, actor=Actor.user(bob), at=NOW + MS
    )
    end = approval.expires_at
    answers: list[Any] = []

    def consume() -> None:
        answers.append(access.access_check(at=end - MS, approval=str(approval.pk), **ask))

    expired = _while_held(consume, lambda: approvals.approvals_expire(actor=system, at=end))
    assert expired == 0 and answers[0].allowed
    assert Approval.objects.get(pk=approval.pk).status == Approval.Status.CONSUMED
    assert not AuditEvent.objects.filter(event_type=EventType.APPROVAL_EXPIRED).exists()


# --- Tasks ----------------------------------------------------------------------------


def test_a_task_that_would_end_the_moment_it_opens_is_refused_and_one_that_ends_later_is_on_record(
    alice, system
):
    """T01 (`<=` made `<`): a task ending the instant it opened was opened, closed to
    every call from its first moment; T02 (the event's task dropped): `task.opened`
    named no task."""
    seq = top_seq()
    with pytest.raises(GovernanceError) as refused:
        tasks.task_open(key="OPS-0", owner=alice, actor=system, at=NOW, ends_at=NOW)
    assert refused.value.code == "invalid_window"
    assert not Task.objects.exists() and events_after(seq) == []
    task = tasks.task_open(key="OPS-1", owner=alice, actor=system, at=NOW, ends_at=NOW + MS)
    row = Task.objects.get()
    assert (row.pk, row.status, row.starts_at, row.ends_at) == (task.pk, "open", NOW, NOW + MS)
    (opened,) = events_after(seq)
    assert (opened.event_type, opened.task, opened.actor) == (
        EventType.TASK_OPENED, "OPS-1", "system:test",
    )  # fmt: skip


def test_closing_a_task_twice_closes_it_once(bot, repo, make_task, make_grant, bob, system):
    """T03 (the claim's answer ignored), T07 (the claim's `status=open` dropped): a
    second close moved closed_at and wrote a second `task.closed`."""
    task = make_task("OPS-2")
    bound = make_grant(bot, repo, task=task)
    tasks.task_close(task=task, actor=Actor.user(bob), at=NOW, closed_by=bob)
    seq = top_seq()
    again = tasks.task_close(
        task=task, actor=Actor.user(bob), at=NOW + timedelta(minutes=1), closed_by=bob
    )
    assert (again.status, again.closed_at) == ("closed", NOW)
    row = Grant.objects.get(pk=bound.pk)
    assert (row.status, row.revoked_at, row.revoked_by) == (Grant.Status.REVOKED, NOW, bob)
    assert events_after(seq) == []


def test_the_job_closes_a_task_at_the_very_moment_it_ends(bot, repo, make_task, make_grant, system):
    """T04 (`ends_at__lte` made `__lt`): a task was left open at its end; T13 (`<` made
    `<=`): the close recorded at the task's end said it took effect earlier
    (`effective_at`), as for a late job."""
    end = NOW + timedelta(minutes=10)
    task = make_task("OPS-3", ends_at=end)
    bound = make_grant(bot, repo, task=task)  # to NOW + 30 min
    seq = top_seq()
    assert tasks.tasks_end(actor=system, at=end) == 1
    task.refresh_from_db()
    assert (task.status, task.closed_at) == ("closed", end)
    row = Grant.objects.get(pk=bound.pk)
    assert (row.status, row.revoked_at) == (Grant.Status.REVOKED, end)
    revoked, closed = events_after(seq)
    assert (revoked.event_type, revoked.grant_id) == (EventType.GRANT_REVOKED, bound.pk)
    assert "effective_at" not in data(revoked)
    assert (closed.event_type, closed.task, data(closed)) == (
        EventType.TASK_CLOSED, "OPS-3", {"why": "ended"},
    )  # fmt: skip


def _ask_delete(task: str, at: Any) -> Approval:
    asked = access.access_check(
        agent="bot", tool="repo", action="delete", scope="repo:acme/api/x", task=task, at=at
    )
    assert asked.decision == "approval_required", asked
    return Approval.objects.get(pk=asked.approval_id)


def test_a_close_voids_an_approved_call_made_under_the_task_on_a_grant_it_leaves_alive(
    bot, repo, make_task, make_grant, bob, system
):
    """T11 (only pending approvals voided): a call a person had approved under the task,
    on a grant bound to no task, could still be waved through after the task closed
    (the approval stayed `approved`); T14 (`if voided` made `> 1`): the one voided call
    was left out of `task.closed`."""
    task = make_task("OPS-4")
    unbound = make_grant(bot, repo, ("delete",))
    asked = _ask_delete("OPS-4", NOW)
    assert (asked.grant_id, asked.task_id) == (unbound.pk, task.pk)
    approvals.approval_approve(
        approval_id=asked.pk, approver=bob, actor=Actor.user(bob), at=NOW + MS
    )
    seq = top_seq()
    tasks.task_close(task=task, actor=Actor.user(bob), at=NOW + timedelta(seconds=5), closed_by=bob)
    assert Approval.objects.get(pk=asked.pk).status == Approval.Status.EXPIRED
    assert Grant.objects.get(pk=unbound.pk).status == Grant.Status.ACTIVE
    (closed,) = events_after(seq)
    assert (closed.event_type, closed.task, data(closed)) == (
        EventType.TASK_CLOSED, "OPS-4", {"why": "closed", "approvals_voided": 1},
    )  # fmt: skip


def test_the_calls_of_a_grant_a_close_revokes_are_voided_and_counted_by_that_revoke(
    bot, repo, make_task, make_grant, bob, system
):
    """T12 (`.exclude(grant__in=revoked_below)` dropped): the close voided the open calls
    of the grants it was about to revoke and counted them on `task.closed`, so each
    `grant.revoked` said it voided none; T15 (the close's person dropped): the revoke
    named nobody."""
    task = make_task("OPS-6")
    bound = make_grant(bot, repo, ("delete",), task=task)
    asked = _ask_delete("OPS-6", NOW)
    assert asked.grant_id == bound.pk
    seq = top_seq()
    tasks.task_close(task=task, actor=Actor.user(bob), at=NOW + timedelta(seconds=5), closed_by=bob)
    assert Approval.objects.get(pk=asked.pk).status == Approval.Status.EXPIRED
    row = Grant.objects.get(pk=bound.pk)
    assert (row.status, row.revoked_at, row.revoked_by, row.decision_reason) == (
        Grant.Status.REVOKED, NOW + timedelta(seconds=5), bob, "task OPS-6 closed",
    )  # fmt: skip
    revoked, closed = events_after(seq)
    assert (revoked.event_type, revoked.grant_id) == (EventType.GRANT_REVOKED, bound.pk)
    assert data(revoked)["approvals_voided"] == 1
    assert (closed.event_type, data(closed)) == (EventType.TASK_CLOSED, {"why": "closed"})


@pytest.mark.parametrize(
    ("grant_end", "revoked"),
    [(timedelta(minutes=30), True), (timedelta(minutes=10), False)],
)
def test_a_late_job_counts_each_voided_call_on_the_record_that_ended_its_grant(
    bot, repo, make_task, make_grant, system, grant_end, revoked
):
    """The job closes, an hour late, a task that ended at NOW + 10 min. A grant bound to
    it that outlived the task's end is revoked from that end and its open calls are
    counted on its `grant.revoked`: T16 (ended_at taken as the job's run) counted them
    on `task.closed` instead. A grant that ran out exactly at the task's end is left for
    grants_expire, and the close voids its calls itself: T10 (`__gt` made `__gte`)
    left them open, voided by nobody."""
    end = NOW + timedelta(minutes=10)
    task = make_task("OPS-7", ends_at=end)
    bound = make_grant(
        bot, repo, ("delete",), task=task, duration=grant_end + timedelta(minutes=30)
    )
    assert bound.expires_at == NOW + grant_end
    asked = _ask_delete("OPS-7", NOW)
    seq = top_seq()
    assert tasks.tasks_end(actor=system, at=NOW + timedelta(hours=1)) == 1
    assert Approval.objects.get(pk=asked.pk).status == Approval.Status.EXPIRED
    row = Grant.objects.get(pk=bound.pk)
    written = events_after(seq)
    closed = written[-1]
    assert (closed.event_type, data(closed)["effective_at"]) == (
        EventType.TASK_CLOSED, end.isoformat(),
    )  # fmt: skip
    if revoked:
        assert (row.status, row.revoked_at) == (Grant.Status.REVOKED, end)
        assert [e.event_type for e in written] == [EventType.GRANT_REVOKED, EventType.TASK_CLOSED]
        assert data(written[0])["approvals_voided"] == 1
        assert "approvals_voided" not in data(closed)
    else:
        assert (row.status, row.revoked_at) == (Grant.Status.ACTIVE, None)
        assert [e.event_type for e in written] == [EventType.TASK_CLOSED]
        assert data(closed)["approvals_voided"] == 1


def test_a_close_refuses_the_requests_still_pending_under_the_task(
    bot, repo, make_task, alice, bob
):
    """T08 (only active grants ended): a request filed under the task stayed pending
    after the task closed, for a person to approve into a grant nobody could use."""
    task = make_task("OPS-8")
    pending = request(bot, repo, alice, task=task, at=NOW - timedelta(minutes=1))
    seq = top_seq()
    tasks.task_close(task=task, actor=Actor.user(bob), at=NOW, closed_by=bob)
    row = Grant.objects.get(pk=pending.pk)
    assert (row.status, row.decided_at, row.decision_reason) == (
        Grant.Status.DENIED, NOW, "task OPS-8 closed",
    )  # fmt: skip
    denied, closed = events_after(seq)
    assert (denied.event_type, denied.grant_id) == (EventType.GRANT_DENIED, pending.pk)
    assert data(denied)["reason"] == "task OPS-8 closed"
    assert (closed.event_type, data(closed)) == (EventType.TASK_CLOSED, {"why": "closed"})


# --- approvals_expire -----------------------------------------------------------------


def test_an_expired_approval_is_announced_with_its_own_expiry(bot, repo, make_grant, system):
    """A06 (the event's expires_at dropped): `approval.expired`, recorded whenever the
    job runs, did not say when the approval had stopped being usable."""
    make_grant(bot, repo, ("delete",))
    asked = access.access_check(
        agent="bot", tool="repo", action="delete", scope="repo:acme/api/x", at=NOW
    )
    approval = Approval.objects.get(pk=asked.approval_id)
    seq = top_seq()
    late = approval.expires_at + timedelta(hours=1)
    assert approvals.approvals_expire(actor=system, at=late) == 1
    assert Approval.objects.get(pk=approval.pk).status == Approval.Status.EXPIRED
    (expired,) = events_after(seq)
    assert (expired.event_type, expired.approval_id, expired.created_at) == (
        EventType.APPROVAL_EXPIRED, str(approval.pk), late,
    )  # fmt: skip
    assert data(expired)["expires_at"] == approval.expires_at.isoformat()
    assert data(expired)["previous_status"] == "pending"
