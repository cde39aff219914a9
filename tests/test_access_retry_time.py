"""The time a decision is decided again at, on PostgreSQL, when a state change committed
while it waited for the audit chain lock: the change's time, never earlier than its own
`at`, and at most RETRY_AHEAD_MAX past it (access_check's retry loop).

A revoke is held uncommitted (holding the chain lock) on another thread; the decision
reads the grant as live, then waits for the chain lock; the revoke commits only once
PostgreSQL shows the decision waiting for that lock, so the order is fixed, not timed
(tests/test_lifecycle_races.py's _while_held commits after a fixed second instead)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from governance.audit import Actor
from governance.codes import EventType, Reason
from governance.models import AuditEvent
from governance.services import grants
from governance.services.access import RETRY_AHEAD_MAX, access_check

SCOPE = "repo:acme/api/x.py"

_WAITING_FOR_ADVISORY_LOCK = """
SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = current_database()
  AND l.pid <> pg_backend_pid()
"""


def _hold_until_waited_for(work, held, errors: list) -> None:
    """Run `work` in a transaction on this thread's own connection, say so, and commit
    once another session waits for an advisory lock (the chain lock `work` holds)."""
    try:
        with transaction.atomic():
            work()
            held.set()
            deadline = time.monotonic() + 20
            with connection.cursor() as cursor:
                while True:
                    cursor.execute(_WAITING_FOR_ADVISORY_LOCK)
                    if cursor.fetchone()[0]:
                        break
                    assert time.monotonic() < deadline, "nobody waited for the chain lock"
                    time.sleep(0.005)  # polling a condition, not a timed handover
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)
        held.set()
    finally:
        connection.close()


def _while_waited_for(work, then):
    """`then()` on this thread while another thread holds `work` uncommitted, committed
    only once `then()` waits for the chain lock; returns then()'s answer."""
    held, errors = threading.Event(), []
    other = threading.Thread(target=_hold_until_waited_for, args=(work, held, errors))
    other.start()
    assert held.wait(20)
    answer = then()
    other.join(20)
    assert not other.is_alive() and not errors, errors
    return answer


@pytest.fixture
def live(make_agent, make_tool, make_grant):
    """A bot with a live read grant on repo:acme/api/*, and the moment T it asks at."""
    at = timezone.now()
    bot, repo = make_agent("bot"), make_tool("repo")
    grant = make_grant(bot, repo, starts_at=at - timedelta(minutes=1), duration=timedelta(hours=1))
    return {"at": at, "bot": bot, "repo": repo, "grant": grant}


def _revoke(grant_id: int, at):
    def work() -> None:
        grants.grant_revoke(
            grant_id=grant_id, reason="compromised", actor=Actor.system("soc"), at=at
        )

    return work


def _decide(live):
    return lambda: access_check(
        agent=live["bot"], tool="repo", action="read", scope=SCOPE, at=live["at"]
    )


def _since(seq: int) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(seq__gt=seq).order_by("seq"))


def _last_seq() -> int:
    return AuditEvent.objects.order_by("-seq").values_list("seq", flat=True).first() or 0


@pytest.mark.django_db(transaction=True)
def test_a_revoke_committing_during_the_wait_denies_the_retried_decision_at_its_time(
    postgres_only, live
):
    """Decided again at its own T, the grant revoked "from T + 5 ms" was still live."""
    revoked_at = live["at"] + timedelta(milliseconds=5)
    before = _last_seq()

    decision = _while_waited_for(_revoke(live["grant"].pk, revoked_at), _decide(live))

    assert (decision.decision, decision.reason) == ("deny", Reason.GRANT_REVOKED)
    events = _since(before)
    assert [(e.event_type, e.reason, e.created_at) for e in events] == [
        (EventType.GRANT_REVOKED, "", revoked_at),
        (EventType.ACCESS_DENIED, Reason.GRANT_REVOKED, revoked_at),
    ]
    assert str(events[1].uid) == decision.decision_id


@pytest.mark.django_db(transaction=True)
def test_a_revoke_dated_far_ahead_is_followed_only_retry_ahead_max_past_the_decision(
    postgres_only, live
):
    """Decided at the revoke's own time, 2 minutes ahead, the call was denied."""
    revoked_at = live["at"] + 2 * RETRY_AHEAD_MAX
    before = _last_seq()

    decision = _while_waited_for(_revoke(live["grant"].pk, revoked_at), _decide(live))

    assert (decision.decision, decision.reason) == ("allow", Reason.ALLOWED)
    events = _since(before)
    assert [(e.event_type, e.reason, e.created_at) for e in events] == [
        (EventType.GRANT_REVOKED, "", revoked_at),
        (EventType.ACCESS_ALLOWED, Reason.ALLOWED, live["at"] + RETRY_AHEAD_MAX),
    ]
    assert str(events[1].uid) == decision.decision_id


@pytest.mark.django_db(transaction=True)
def test_a_change_dated_before_the_decision_never_moves_it_back_in_time(
    postgres_only, live, make_grant
):
    """A grant that starts at T - 1 s, and another grant's revoke dated T - 2 s
    committing during the wait: decided again at T - 2 s, the call was denied
    grant_not_started."""
    at = live["at"]
    starts = make_grant(live["bot"], live["repo"], ("update",), starts_at=at - timedelta(seconds=1))
    other = make_grant(
        live["bot"], live["repo"], ("delete",), "repo:acme/other/*", at - timedelta(minutes=1)
    )
    revoked_at = at - timedelta(seconds=2)
    before = _last_seq()

    decide = lambda: access_check(  # noqa: E731
        agent=live["bot"], tool="repo", action="update", scope=SCOPE, at=at
    )
    decision = _while_waited_for(_revoke(other.pk, revoked_at), decide)

    assert (decision.decision, decision.reason) == ("allow", Reason.ALLOWED)
    assert decision.grant_id == starts.pk
    events = _since(before)
    assert [(e.event_type, e.reason, e.created_at) for e in events] == [
        (EventType.GRANT_REVOKED, "", revoked_at),
        (EventType.ACCESS_ALLOWED, Reason.ALLOWED, at),
    ]
    assert str(events[1].uid) == decision.decision_id
