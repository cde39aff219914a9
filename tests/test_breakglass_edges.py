"""Break-glass edges found by mutation testing: a repeat is the exact request or a
conflict, a close says why, the overdue job acts only on a review still open when it
claims it, and an outcome is reported only against a decision, masked."""

from __future__ import annotations

import json

import pytest

from governance.audit import Actor
from governance.codes import EventType, NotificationEvent
from governance.errors import Conflict, GovernanceError, NotFound
from governance.models import (
    AuditEvent,
    BreakGlass,
    DecisionOutcome,
    Grant,
    Notification,
)
from governance.policy import authorize
from governance.services import breakglass as bgs
from governance.services.access import access_check
from governance.services.outcomes import outcome_report
from tests.conftest import MS, NOW
from tests.lifecycle_fixtures import breakglass_written as _written


def events(event_type: str, **filters: object) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(event_type=event_type, **filters).order_by("seq"))


def ask(at, action="update"):
    return {"agent": "bot", "tool": "repo", "action": action, "scope": "repo:acme/api/x", "at": at}


def test_a_repeat_asking_for_fewer_actions_is_refused_not_handed_the_wider_one(
    open_bg, django_capture_on_commit_callbacks
):
    """The opener asking again for less (read only) is not the same request: handing
    back the live read+update row would tell them they hold what they did not ask for
    this time. Refused as a second break-glass; nothing written."""
    with django_capture_on_commit_callbacks(execute=True):
        bg = open_bg(actions=["read", "update"])
    before = _written()
    with pytest.raises(Conflict) as caught, django_capture_on_commit_callbacks(execute=True):
        open_bg(actions=["read"], at=NOW + MS)
    assert (caught.value.code, caught.value.status) == ("breakglass_active", 409)
    assert caught.value.fields["ticket"] == "INC-42"
    assert _written() == before
    assert Grant.objects.get().actions == ["read", "update"]
    (opened,) = events(EventType.BREAKGLASS_OPENED)
    assert opened.grant_id == bg.grant_id
    # The same actions in another order are the exact repeat.
    assert open_bg(actions=["update", "read"], at=NOW + 2 * MS).pk == bg.pk
    assert _written() == before


@pytest.mark.parametrize("comment", ["", "   ", "\n\t"])
def test_closing_break_glass_needs_a_comment_that_says_something(bg_world, open_bg, comment):
    bg = open_bg()
    frank = bg_world["frank"]
    before = AuditEvent.objects.count()
    with pytest.raises(GovernanceError) as caught:
        bgs.breakglass_close(
            breakglass_id=bg.pk, closed_by=frank, comment=comment, actor=Actor.user(frank),
            at=NOW + MS,
        )  # fmt: skip
    assert (caught.value.code, caught.value.status) == ("comment_required", 400)
    row = BreakGlass.objects.get(pk=bg.pk)
    assert (row.closed_at, row.closed_by, row.grant.status) == (None, None, "active")
    assert AuditEvent.objects.count() == before
    assert events(EventType.GRANT_REVOKED) == [] and events(EventType.BREAKGLASS_CLOSED) == []
    assert authorize(**ask(NOW + MS)).allowed


def test_the_overdue_job_leaves_alone_a_review_decided_after_it_listed_the_row(
    bg_world, open_bg, system, monkeypatch, django_capture_on_commit_callbacks
):
    """The job lists the overdue reviews, then claims each. A reviewer confirming one
    closed in between has closed the review: the claim must not still win and announce
    it overdue to every approver (or stamp it overdue) after it was decided."""
    bg = open_bg()
    due = bg.review_due_at
    frank = bg_world["frank"]
    real = bgs.claim_each

    def reviewed_in_between(rows, claim, announce):
        listed = list(rows)  # what the job read before the reviewer's commit
        bgs.breakglass_confirm_closed(
            breakglass_id=bg.pk, reviewer=frank, comment="over, ticket closed",
            actor=Actor.user(frank), at=due,
        )  # fmt: skip
        return real(listed, claim, announce)

    monkeypatch.setattr(bgs, "claim_each", reviewed_in_between)
    with django_capture_on_commit_callbacks(execute=True):
        assert bgs.breakglass_reviews_mark_overdue(actor=system, at=due) == 0
    row = BreakGlass.objects.get(pk=bg.pk)
    assert (row.review_status, row.reviewed_by, row.overdue_at) == (
        BreakGlass.Review.CONFIRMED_CLOSED,
        frank,
        None,
    )
    assert events(EventType.BREAKGLASS_REVIEW_OVERDUE) == []
    (confirmed,) = events(EventType.BREAKGLASS_CONFIRMED_CLOSED)
    assert confirmed.actor == "user:frank" and json.loads(confirmed.data)["overdue"] is True
    assert not Notification.objects.filter(event=NotificationEvent.REVIEW_OVERDUE).exists()


def test_an_outcome_is_reported_only_against_a_decision(bg_world, open_bg):
    """The agent's own non-decision events (here: the outcome event it just wrote) are
    not decisions: reporting against one is 404, as a missing decision is."""
    open_bg()
    agent = bg_world["agent"]
    used = access_check(**ask(NOW + MS))
    assert used.allowed
    written = outcome_report(
        agent=agent, decision_id=used.decision_id, outcome="succeeded", at=NOW + 2 * MS
    )
    (reported,) = events(EventType.ACCESS_OUTCOME)
    assert reported.actor == "agent:bot" and reported.break_glass
    before = AuditEvent.objects.count()
    with pytest.raises(NotFound) as caught:
        outcome_report(
            agent=agent, decision_id=str(reported.uid), outcome="failed", at=NOW + 3 * MS
        )
    assert (caught.value.code, caught.value.status) == ("not_found", 404)
    assert AuditEvent.objects.count() == before
    (row,) = DecisionOutcome.objects.all()
    assert (str(row.decision_id), row.outcome) == (str(used.decision_id), "succeeded")
    assert written.uid == reported.uid


def test_an_outcome_digest_is_masked_whoever_calls_the_service(bg_world, open_bg):
    """The API takes only a digest; the service masks it all the same (the log keeps
    whatever it is given for good): a secret passed by another caller never lands."""
    open_bg()
    agent = bg_world["agent"]
    used = access_check(**ask(NOW + MS))
    outcome_report(
        agent=agent, decision_id=used.decision_id, outcome="succeeded", at=NOW + 2 * MS,
        result_digest="password=hunter2",
    )  # fmt: skip
    (reported,) = events(EventType.ACCESS_OUTCOME)
    assert "hunter2" not in reported.data
    assert "hunter2" not in DecisionOutcome.objects.get().result_digest
    assert json.loads(reported.data)["decision_id"] == str(used.decision_id)


def test_an_outcome_under_a_token_revoked_since_the_door_is_refused_and_writes_nothing(
    bg_world, open_bg, alice, system
):
    """The API reports under the request's token (api.views.actor_for): a token revoked
    after the request was let in gets the door's 401, with no outcome on record."""
    from governance.errors import Unauthenticated
    from governance.models import AgentToken
    from governance.services import agents

    open_bg()
    agent = bg_world["agent"]
    used = access_check(**ask(NOW + MS))
    token, _ = agents.token_issue(created_by=alice, agent=agent, actor=system, at=NOW + MS)
    agents.token_revoke(token=token, actor=system, at=NOW + 2 * MS)
    assert AgentToken.objects.get(pk=token.pk).revoked_at == NOW + 2 * MS
    before = AuditEvent.objects.count()
    with pytest.raises(Unauthenticated) as caught:
        outcome_report(
            agent=agent, decision_id=str(used.decision_id), outcome="succeeded",
            at=NOW + 3 * MS, actor=Actor.agent(agent, token_id=token.pk),
        )  # fmt: skip
    assert caught.value.status == 401
    assert AuditEvent.objects.count() == before and not DecisionOutcome.objects.exists()
    assert events(EventType.ACCESS_OUTCOME) == []


def test_a_ticket_longer_than_its_column_is_refused_with_a_line_not_a_traceback(bg_world):
    """The default format (`[A-Z][A-Z0-9]+-[0-9]+`) has no length: the API and the form
    stop at 100 characters, the command did not, and the service let it through. On
    PostgreSQL the 100-character column raised DataError (a traceback); on SQLite the
    row kept 104 characters the API then shows. The service refuses it, nothing written."""
    from io import StringIO

    from django.core.management import CommandError, call_command

    before = AuditEvent.objects.count()
    argv = ["--user", "erin", "--agent", "bot", "--tool", "repo", "--actions", "read",
            "--scope", "repo:acme/api/*", "--reason", "outage"]  # fmt: skip
    with pytest.raises(CommandError, match="invalid_ticket"):
        call_command("breakglass_open", *argv, "--ticket", "INC-" + "1" * 100, stdout=StringIO())
    assert not BreakGlass.objects.exists() and not Grant.objects.exists()
    assert AuditEvent.objects.count() == before
    # Exactly 100 characters is a ticket.
    out = StringIO()
    call_command("breakglass_open", *argv, "--ticket", "INC-" + "1" * 96, stdout=out)
    (bg,) = BreakGlass.objects.all()
    assert bg.ticket == "INC-" + "1" * 96 and f"break-glass #{bg.pk}" in out.getvalue()
    (opened,) = events(EventType.BREAKGLASS_OPENED)
    assert json.loads(opened.data)["ticket"] == bg.ticket and opened.actor == "user:erin"


@pytest.mark.parametrize("decide", ["ratify", "confirm"])
def test_a_deactivated_approver_reviews_no_break_glass(
    open_bg, bg_world, decide, django_capture_on_commit_callbacks
):
    """The review is decided by someone who may approve now: frank, an approver
    deactivated since, is refused, the review stays pending and nothing is written."""
    bg = open_bg()
    frank = bg_world["frank"]
    frank.is_active = False
    frank.save(update_fields=["is_active"])
    call = bgs.breakglass_ratify if decide == "ratify" else bgs.breakglass_confirm_closed
    before = _written()
    with pytest.raises(GovernanceError) as caught, django_capture_on_commit_callbacks(execute=True):
        call(breakglass_id=bg.pk, reviewer=frank, comment="ok", actor=Actor.user(frank), at=NOW)
    assert (caught.value.code, caught.value.status) == ("not_allowed", 403)
    assert _written() == before
    bg.refresh_from_db()
    assert (bg.review_status, bg.reviewed_by, bg.ratified_request) == ("pending", None, None)
    # Active again, the same call decides it, on record.
    frank.is_active = True
    frank.save(update_fields=["is_active"])
    call(breakglass_id=bg.pk, reviewer=frank, comment="ok", actor=Actor.user(frank), at=NOW)
    bg.refresh_from_db()
    assert bg.reviewed_by == frank
    kind = (
        EventType.BREAKGLASS_RATIFIED
        if decide == "ratify"
        else EventType.BREAKGLASS_CONFIRMED_CLOSED
    )
    assert events(kind)


def test_a_deactivated_owner_or_approver_opens_no_break_glass(open_bg, alice):
    """alice owns the agent (and may open break-glass for it); deactivated, she may
    not, and nothing is written."""
    alice.is_active = False
    alice.save(update_fields=["is_active"])
    before = _written()
    with pytest.raises(GovernanceError) as caught:
        open_bg(opener=alice)
    assert (caught.value.code, caught.value.status) == ("not_allowed", 403)
    assert _written() == before
