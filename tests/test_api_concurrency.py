"""Races over real HTTP on PostgreSQL: many agents' requests at the same instant.

The live server answers each request in its own thread with its own database
connection, so these are real concurrent transactions, not a simulation.
SQLite serialises every writer, so there is no race there to test.
"""

from __future__ import annotations

import io
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone

from governance.audit import Actor
from governance.client import Decision, GovernanceClient
from governance.models import Approval, AuditEvent, Grant, Notification
from governance.services import agents, approvals
from governance.services.usage import usage_fold

PARALLEL = 10
DECISION_EVENTS = ("access.allowed", "access.denied", "access.approval_required")


@pytest.fixture
def setup(postgres_only, live_server, make_agent, make_tool, make_grant, alice) -> dict[str, Any]:
    bot = make_agent("bot")
    repo = make_tool("repo")
    grant = make_grant(
        bot,
        repo,
        ("read", "delete"),
        "repo:acme/*",
        starts_at=timezone.now() - timedelta(minutes=1),
    )
    _, token = agents.token_issue(
        created_by=alice, agent=bot, actor=Actor.system("test"), at=timezone.now()
    )
    return {"grant": grant, "url": live_server.url, "token": token}


def all_at_once(url: str, token: str, **question: Any) -> list[Decision]:
    """PARALLEL clients ask the same question, released together by a barrier."""
    start = threading.Barrier(PARALLEL)
    answers: list[Decision] = []
    lock = threading.Lock()

    def ask() -> None:
        client = GovernanceClient(url, token, timeout=30)
        start.wait()
        decision = client.authorize(**question)
        with lock:
            answers.append(decision)

    threads = [threading.Thread(target=ask) for _ in range(PARALLEL)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(answers) == PARALLEL
    return answers


def last_seq() -> int:
    event = AuditEvent.objects.order_by("-seq").first()
    return event.seq if event else 0


@pytest.mark.parametrize("round_", [1, 2])
def test_one_approval_used_by_ten_parallel_calls_allows_exactly_one(setup, bob, round_):
    question = {"tool": "repo", "action": "delete", "scope": f"repo:acme/old-{round_}.py"}
    client = GovernanceClient(setup["url"], setup["token"])
    asked = client.authorize(**question)
    assert asked.decision == "approval_required" and asked.approval
    approvals.approval_approve(
        approval_id=asked.approval, approver=bob, actor=Actor.user(bob), at=timezone.now()
    )
    mark = last_seq()

    answers = all_at_once(setup["url"], setup["token"], approval=asked.approval, **question)

    verdicts = sorted((a.decision, a.reason, a.status) for a in answers)
    assert verdicts == [("allow", "allowed", 200)] + [("deny", "approval_invalid", 200)] * 9
    events = list(AuditEvent.objects.filter(seq__gt=mark).order_by("seq"))
    assert len(events) == PARALLEL
    assert all(e.event_type in DECISION_EVENTS for e in events)
    assert sorted(e.event_type for e in events) == ["access.allowed"] + ["access.denied"] * 9
    assert {str(e.uid) for e in events} == {a.decision_id for a in answers}
    assert {e.approval_id for e in events} == {asked.approval}
    approval = Approval.objects.get(pk=asked.approval)
    assert approval.status == "consumed" and approval.consumed_at is not None
    assert usage_fold() == 1  # the one allowed event is the one use
    assert Grant.objects.get(pk=setup["grant"].pk).use_count == 1

    out = io.StringIO()
    call_command("audit_verify", stdout=out)
    assert out.getvalue().startswith(f"ok: {last_seq()} events")


def test_ten_parallel_allows_are_each_counted_and_chained(setup):
    mark = last_seq()

    answers = all_at_once(
        setup["url"], setup["token"], tool="repo", action="read", scope="repo:acme/x"
    )

    assert [a.decision for a in answers] == ["allow"] * PARALLEL
    assert len({a.decision_id for a in answers}) == PARALLEL
    assert AuditEvent.objects.filter(seq__gt=mark, event_type="access.allowed").count() == PARALLEL
    usage_fold()
    assert Grant.objects.get(pk=setup["grant"].pk).use_count == PARALLEL
    out = io.StringIO()
    call_command("audit_verify", stdout=out)
    assert out.getvalue().startswith("ok: ")


def test_ten_parallel_first_asks_of_one_destructive_call_open_one_request(setup, bob):
    """Identical destructive calls at the same instant share one pending approval:
    one request for the approvers, one notification, every answer naming it."""
    from django.contrib.auth.models import Group

    bob.email = "bob@example.test"  # an approver to notify, so a second request shows
    bob.save()
    bob.groups.add(Group.objects.get_or_create(name="approvers")[0])
    mark = last_seq()

    answers = all_at_once(
        setup["url"], setup["token"], tool="repo", action="delete", scope="repo:acme/gone.py"
    )

    assert [a.decision for a in answers] == ["approval_required"] * PARALLEL
    assert len({a.approval for a in answers}) == 1
    (approval,) = Approval.objects.filter(scope="repo:acme/gone.py")
    assert approval.status == "pending" and str(approval.pk) == answers[0].approval
    events = list(AuditEvent.objects.filter(seq__gt=mark, event_type__in=DECISION_EVENTS))
    assert len(events) == PARALLEL
    assert {(e.event_type, e.approval_id) for e in events} == {
        ("access.approval_required", str(approval.pk))
    }
    sent = Notification.objects.filter(event="approval_needed")
    assert [(n.target, n.data["approval_id"]) for n in sent] == [
        ("bob@example.test", str(approval.pk))
    ]


def test_ten_parallel_destructive_calls_never_open_more_than_the_backlog_allows(setup, settings):
    """Ten calls with different arguments at the same instant, room for three: exactly
    three requests are opened and seven calls are denied `approval_backlog`, each
    answer on record (the count is taken under a per-agent lock)."""
    settings.APPROVAL_PENDING_MAX = 3
    mark = last_seq()
    start = threading.Barrier(PARALLEL)
    answers: list[Decision] = []
    lock = threading.Lock()

    def ask(n: int) -> None:
        client = GovernanceClient(setup["url"], setup["token"], timeout=30)
        start.wait()
        decision = client.authorize(
            tool="repo", action="delete", scope="repo:acme/gone.py", arguments={"nonce": n}
        )
        with lock:
            answers.append(decision)

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(PARALLEL)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    verdicts = sorted((a.decision, a.reason) for a in answers)
    assert (
        verdicts
        == [("approval_required", "approval_required")] * 3 + [("deny", "approval_backlog")] * 7
    )
    assert Approval.objects.filter(status="pending").count() == 3
    events = list(AuditEvent.objects.filter(seq__gt=mark, event_type__in=DECISION_EVENTS))
    assert sorted(e.reason for e in events) == ["approval_backlog"] * 7 + ["approval_required"] * 3
    assert {str(e.uid) for e in events} == {a.decision_id for a in answers}
