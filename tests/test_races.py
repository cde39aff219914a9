"""Two decisions on the same grant request at the same instant, on PostgreSQL.

Each thread has its own database connection, so these are real concurrent
transactions; a Barrier releases both together, and many rounds give the
scheduler a chance to interleave them every way it can. SQLite serialises
every writer, so there is no race there to test.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.utils import timezone

from governance import roles
from governance.audit import Actor
from governance.codes import EventType
from governance.errors import Conflict
from governance.models import AuditEvent, Grant
from governance.policy import authorize
from governance.services import grants

ROUNDS = 30


def together(*calls: Callable[[], Any]) -> list[BaseException | None]:
    """Run each call in its own thread (own connection), released at once.

    Returns, per call, the exception it raised or None.
    """
    start = threading.Barrier(len(calls))
    outcomes: list[BaseException | None] = [None] * len(calls)

    def run(index: int, call: Callable[[], Any]) -> None:
        try:
            start.wait(timeout=30)
            call()
        except BaseException as exc:  # noqa: BLE001 - reported to the test, not swallowed
            outcomes[index] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a decision hung (deadlock?)"
    return outcomes


def approve(grant_id: int, user: User) -> None:
    grants.grant_approve(
        grant_id=grant_id, approver=user, actor=Actor.user(user), at=timezone.now()
    )


def revoke(grant_id: int, user: User) -> None:
    grants.grant_revoke(
        grant_id=grant_id,
        reason="changed my mind",
        actor=Actor.user(user),
        at=timezone.now(),
        revoked_by=user,
    )


@pytest.fixture
def fresh_request(make_agent, make_tool, alice, system) -> Callable[[int], Grant]:
    agent, tool = make_agent("bot"), make_tool("repo")

    def make(round_no: int) -> Grant:
        return grants.grant_request(
            agent=agent,
            tool=tool,
            actions=["read"],
            scope=f"repo:acme/r{round_no}/*",
            duration=timedelta(hours=1),
            justification="race",
            requested_by=alice,
            actor=system,
            at=timezone.now(),
        )

    return make


@pytest.mark.django_db(transaction=True)
def test_approve_and_revoke_at_once_never_leave_a_live_grant(
    postgres_only, fresh_request, alice, bob
):
    seen: set[tuple[str, str]] = set()
    for round_no in range(ROUNDS):
        grant = fresh_request(round_no)

        approve_error, revoked = together(
            partial(approve, grant.pk, bob), partial(revoke, grant.pk, alice)
        )
        after = timezone.now()

        # Revoke never refuses (it ends whatever is pending or live); only the
        # approval can lose, and only with a clear Conflict.
        assert revoked is None, repr(revoked)
        assert approve_error is None or (
            isinstance(approve_error, Conflict) and approve_error.code == "not_pending"
        ), repr(approve_error)

        grant.refresh_from_db()
        assert grant.status in (Grant.Status.REVOKED, Grant.Status.DENIED), (round_no, grant)
        if approve_error is None:
            # Approved first, then revoked: a window that was ended.
            assert grant.status == Grant.Status.REVOKED and grant.revoked_at is not None
        else:
            # Revoked while pending: never started.
            assert grant.status == Grant.Status.DENIED and grant.starts_at is None
        decision = authorize(
            agent="bot", tool="repo", action="read", scope=f"repo:acme/r{round_no}/x", at=after
        )
        assert not decision.allowed, (round_no, decision)

        issued = AuditEvent.objects.filter(grant_id=grant.pk, event_type=EventType.GRANT_ISSUED)
        # One ending event, saying what the row says: revoked if it had started, else denied.
        ending = EventType.GRANT_REVOKED if approve_error is None else EventType.GRANT_DENIED
        ended = AuditEvent.objects.filter(
            grant_id=grant.pk, event_type__in=[EventType.GRANT_REVOKED, EventType.GRANT_DENIED]
        )
        assert (issued.count(), [e.event_type for e in ended]) == (
            1 if approve_error is None else 0,
            [ending],
        )
        seen.add(("approve won" if approve_error is None else "approve lost", grant.status))
    # Not asserted (it depends on the scheduler), but useful when reading a failure.
    print(f"outcomes over {ROUNDS} rounds: {sorted(seen)}")


@pytest.mark.django_db(transaction=True)
def test_two_approvers_at_once_decide_a_request_exactly_once(
    postgres_only, fresh_request, bob, person
):
    carol = person("carol", roles.APPROVERS)
    for round_no in range(ROUNDS):
        grant = fresh_request(round_no)

        outcomes = together(partial(approve, grant.pk, bob), partial(approve, grant.pk, carol))

        winners = [o for o in outcomes if o is None]
        losers = [o for o in outcomes if o is not None]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        (loser,) = losers
        assert isinstance(loser, Conflict) and loser.code == "not_pending", repr(loser)

        grant.refresh_from_db()
        assert grant.status == Grant.Status.ACTIVE
        winner = (bob, carol)[outcomes.index(None)]
        assert grant.approved_by_id == winner.pk
        (issued,) = AuditEvent.objects.filter(grant_id=grant.pk, event_type=EventType.GRANT_ISSUED)
        assert issued.actor == f"user:{winner.get_username()}"


@pytest.mark.django_db(transaction=True)
def test_a_suspension_committing_while_a_request_is_approved_issues_no_grant(
    postgres_only, fresh_request, bob, system
):
    """The approval read the agent's status without a lock: a suspension that committed
    while it ran was followed by grant.issued, and the grant allowed once the agent was
    resumed. The approval holds the agent's row, so it waits for the suspension."""
    import time

    from django.db import transaction

    from governance.models import Agent
    from governance.services import agents

    grant = fresh_request(0)
    suspending, failures = threading.Event(), []

    def suspend_and_hold() -> None:
        try:
            with transaction.atomic():
                agent = Agent.objects.get(name="bot")
                agents.agent_suspend(
                    agent=agent, reason="incident", actor=system, at=timezone.now()
                )
                suspending.set()
                time.sleep(1.0)  # the approval starts while this is uncommitted
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
            suspending.set()
        finally:
            connection.close()

    holder = threading.Thread(target=suspend_and_hold)
    holder.start()
    assert suspending.wait(10)
    with pytest.raises(Conflict) as refused:
        approve(grant.pk, bob)
    holder.join(10)
    assert not failures and refused.value.code == "agent_suspended"
    grant.refresh_from_db()
    assert grant.status == Grant.Status.PENDING
    assert not AuditEvent.objects.filter(grant_id=grant.pk, event_type=EventType.GRANT_ISSUED)
