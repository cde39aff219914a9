"""Group commit (governance.audit.GroupCommit, migration 0020), on PostgreSQL.

Decisions that change nothing else append their event standalone; the ones a
process's threads submit while an append is in flight go in one statement (one
chain lock, one COMMIT). To make the grouping certain rather than likely, each test
holds the chain lock from a connection of its own: the first appender leads and
waits in the database, the next ones queue behind it in the process, and when the
lock is let go they are appended together. Rows written by one statement share one
transaction id (`xmin`), so the tests can see which events went together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from governance import audit
from governance.audit import Actor
from governance.models import AuditEvent
from governance.policy import Reason, Verdict
from governance.services import access
from tests.conftest import NOW

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _postgres(postgres_only: None) -> None:
    return None


@contextmanager
def chain_lock_held() -> Iterator[None]:
    """The chain lock, held by a connection that is not Django's."""
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", [audit.CHAIN_LOCK_KEY])
        try:
            yield
        finally:
            other.execute("SELECT pg_advisory_unlock(%s)", [audit.CHAIN_LOCK_KEY])


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.002)


class Calls:
    """Each call in a thread of its own (its own Django connection), started one at a
    time so they queue in a known order; results and errors kept by name."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.results: dict[str, Any] = {}
        self.errors: dict[str, BaseException] = {}

    def start(self, name: str, call: Callable[[], Any], *, queued: int) -> None:
        def run() -> None:
            try:
                self.results[name] = call()
            except BaseException as exc:  # reported by the test, not lost in the thread
                self.errors[name] = exc
            finally:
                connection.close()

        thread = threading.Thread(target=run, name=name)
        self.threads.append(thread)
        thread.start()
        # The first call leads: it has taken its batch when nothing waits any more.
        # Every later one waits in the queue behind it.
        wait_until(
            lambda: audit._group._busy and len(audit._group._waiting) == queued,
            f"{name} queued ({queued} waiting)",
        )

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=60)
            assert not thread.is_alive(), f"{thread.name} hung"


def standalone(scope: str, *, event_type: str = "access.allowed", seen: int | None = None):
    return lambda: audit.append(
        event_type=event_type,
        actor=Actor.system("test"),
        at=NOW,
        scope=scope,
        standalone=True,
        seen_seq=seen,
    )


def xmin_of(seqs: list[int]) -> list[int]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT xmin::text::bigint FROM governance_auditevent WHERE seq = ANY(%s) ORDER BY seq",
            [seqs],
        )
        return [row[0] for row in cur.fetchall()]


def verified(count: int) -> None:
    verdict = audit.verify_chain()
    assert verdict.ok, verdict.render()
    assert verdict.count == count


def test_events_queued_behind_an_append_go_in_one_statement_in_arrival_order():
    calls = Calls()
    with chain_lock_held():
        calls.start("leader", standalone("s/leader"), queued=0)
        for n in range(5):
            calls.start(f"f{n}", standalone(f"s/f{n}"), queued=n + 1)
    calls.join()
    assert not calls.errors, calls.errors
    seqs = {name: written.seq for name, written in calls.results.items()}
    assert seqs == {"leader": 1, "f0": 2, "f1": 3, "f2": 4, "f3": 5, "f4": 6}
    events = list(AuditEvent.objects.order_by("seq").values_list("seq", "scope", "uid", "hash"))
    assert [scope for _, scope, _, _ in events] == ["s/leader"] + [f"s/f{n}" for n in range(5)]
    # Each caller got its own event back: the uid and the link the chain holds.
    for name, written in calls.results.items():
        assert (written.uid, written.hash) == next(
            (uid, link) for seq, _, uid, link in events if seq == written.seq
        ), name
    leader, *followers = xmin_of([1, 2, 3, 4, 5, 6])
    assert len(set(followers)) == 1, "the five queued events were not one statement"
    assert leader not in followers
    verified(6)


def test_an_event_whose_decision_read_stale_state_is_refused_alone_in_its_batch():
    with transaction.atomic():  # a state change: every decision that read before it is stale
        change = audit.append(event_type="grant.revoked", actor=Actor.system("test"), at=NOW)
    calls = Calls()
    with chain_lock_held():
        calls.start("leader", standalone("s/leader", seen=change.seq), queued=0)
        calls.start("stale", standalone("s/stale", seen=change.seq - 1), queued=1)
        calls.start("fresh", standalone("s/fresh", seen=change.seq), queued=2)
    calls.join()
    assert set(calls.errors) == {"stale"}
    assert isinstance(calls.errors["stale"], audit.StateChanged)
    assert calls.errors["stale"].seen_seq == change.seq - 1
    assert [calls.results["leader"].seq, calls.results["fresh"].seq] == [2, 3]
    assert list(AuditEvent.objects.order_by("seq").values_list("scope", flat=True)) == [
        "",
        "s/leader",
        "s/fresh",
    ]
    verified(3)


def test_a_batch_that_fails_is_written_event_by_event_so_only_the_bad_event_fails():
    too_long = "access." + "x" * 60  # the column holds 50: the database refuses it
    calls = Calls()
    with chain_lock_held():
        calls.start("leader", standalone("s/leader"), queued=0)
        calls.start("good1", standalone("s/good1"), queued=1)
        calls.start("bad", standalone("s/bad", event_type=too_long), queued=2)
        calls.start("good2", standalone("s/good2"), queued=3)
    calls.join()
    assert set(calls.errors) == {"bad"}
    assert isinstance(calls.errors["bad"], psycopg.errors.StringDataRightTruncation)
    scopes = list(AuditEvent.objects.order_by("seq").values_list("scope", flat=True))
    assert scopes[0] == "s/leader"
    assert sorted(scopes[1:]) == ["s/good1", "s/good2"]  # each its own thread's, alone
    seqs = [calls.results[name].seq for name in ("leader", "good1", "good2")]
    assert len(set(xmin_of(seqs))) == 3, "the failed batch's events were not written alone"
    verified(3)


def test_a_value_the_batch_cannot_carry_is_refused_alone_as_before():
    calls = Calls()
    with chain_lock_held():
        calls.start("leader", standalone("s/leader"), queued=0)
        # A NUL never reaches the batch: its own thread refuses it, as a single append
        # does. (Caller-supplied text has its NULs escaped; an event type is the code's.)
        calls.start("nul", standalone("s/nul", event_type="access.\x00"), queued=0)
        calls.start("good", standalone("s/good"), queued=1)
    calls.join()
    assert set(calls.errors) == {"nul"}
    assert isinstance(calls.errors["nul"], psycopg.DataError)
    assert list(AuditEvent.objects.order_by("seq").values_list("scope", flat=True)) == [
        "s/leader",
        "s/good",
    ]
    verified(2)


def test_grouped_decisions_answer_and_record_each_their_own_call(make_agent, make_tool, make_grant):
    """access_check() end to end: decisions from concurrent threads grouped into one
    statement, each answer matching its own event."""
    make_grant(make_agent("bot"), make_tool("repo"), ("read",), "repo:acme/*")
    before = AuditEvent.objects.count()

    def check(action: str, scope: str) -> Callable[[], Any]:
        return lambda: access.access_check(
            agent="bot", tool="repo", action=action, scope=scope, at=NOW
        )

    asked = {
        "leader": ("read", "repo:acme/0"),
        "allowed": ("read", "repo:acme/1"),
        "outside": ("read", "repo:other/1"),
        "no_grant": ("update", "repo:acme/2"),
        "allowed2": ("read", "repo:acme/3"),
    }
    calls = Calls()
    with chain_lock_held():
        for queued, (name, (action, scope)) in enumerate(asked.items()):
            calls.start(name, check(action, scope), queued=queued)
    calls.join()
    assert not calls.errors, calls.errors
    expected = {
        "leader": (Verdict.ALLOW, Reason.ALLOWED),
        "allowed": (Verdict.ALLOW, Reason.ALLOWED),
        "outside": (Verdict.DENY, Reason.SCOPE_MISMATCH),
        "no_grant": (Verdict.DENY, Reason.NO_GRANT),
        "allowed2": (Verdict.ALLOW, Reason.ALLOWED),
    }
    seqs = []
    for name, decision in calls.results.items():
        assert (decision.decision, decision.reason) == expected[name], name
        event = AuditEvent.objects.get(uid=decision.decision_id)
        action, scope = asked[name]
        assert (event.agent, event.tool, event.action, event.scope) == (
            "bot",
            "repo",
            action,
            scope,
        )
        assert (event.decision, event.reason) == expected[name], name
        assert event.event_type == ("access.allowed" if decision.allowed else "access.denied")
        assert event.grant_id == decision.grant_id
        seqs.append(event.seq)
    assert AuditEvent.objects.count() == before + len(asked)
    xmins = xmin_of(sorted(seqs))
    assert len(set(xmins[1:])) == 1, "the queued decisions were not one statement"
    verified(before + len(asked))


def test_with_group_commit_off_every_event_is_its_own_statement(settings):
    settings.AUDIT_GROUP_COMMIT = False
    done: list[int] = []

    def append(n: int) -> None:
        try:
            done.append(standalone(f"s/{n}")().seq)
        finally:
            connection.close()

    with chain_lock_held():
        threads = [threading.Thread(target=append, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(0.2)
        assert not audit._group._busy and not audit._group._waiting
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(done) == [1, 2, 3, 4]
    assert len(set(xmin_of(done))) == 4
    verified(4)
