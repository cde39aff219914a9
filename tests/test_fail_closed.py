"""Any error inside a decision is a denial, never an allow.

Failures are real database failures (a trigger that refuses the write, a
table that is gone), not mocks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import connection, transaction

from governance import audit
from governance.models import Approval, AuditEvent, Grant
from governance.policy import authorize
from governance.services import access
from governance.services.usage import usage_fold
from tests.conftest import NOW, last_event


@pytest.fixture
def granted(make_agent, make_tool, make_grant) -> Grant:
    bot = make_agent("bot")
    repo = make_tool("repo")
    return make_grant(bot, repo, ("read", "delete"), "repo:acme/*")


def ask(action: str = "read") -> dict:
    return {"agent": "bot", "tool": "repo", "action": action, "scope": "repo:acme/x", "at": NOW}


@contextmanager
def refusing(table: str, operation: str) -> Iterator[None]:
    """Make the real database refuse `operation` on `table` for the block."""
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            cur.execute(
                "CREATE FUNCTION test_refuse() RETURNS trigger AS $$ BEGIN "
                "RAISE EXCEPTION 'refused by test'; END; $$ LANGUAGE plpgsql"
            )
            cur.execute(
                f"CREATE TRIGGER test_refuse BEFORE {operation} ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION test_refuse()"
            )
        else:
            cur.execute(
                f"CREATE TRIGGER test_refuse BEFORE {operation} ON {table} "
                "BEGIN SELECT RAISE(ABORT, 'refused by test'); END"
            )
    try:
        yield
    finally:
        with connection.cursor() as cur:
            if connection.vendor == "postgresql":
                cur.execute(f"DROP TRIGGER test_refuse ON {table}")
                cur.execute("DROP FUNCTION test_refuse()")
            else:
                cur.execute("DROP TRIGGER test_refuse")


def test_it_allows_when_everything_works(granted):
    result = access.access_check(**ask())
    assert result.allowed
    assert last_event().decision == "allow"


def test_it_denies_when_the_audit_event_cannot_be_written(granted):
    before = AuditEvent.objects.count()
    with refusing("governance_auditevent", "INSERT"):
        result = access.access_check(**ask())
    assert (result.decision, result.reason) == ("deny", "error")
    assert not result.allowed and result.decision_id is None
    assert AuditEvent.objects.count() == before, "nothing could be logged"
    usage_fold()
    granted.refresh_from_db()
    assert granted.use_count == 0, "no event, so no use counted"


def test_a_destructive_call_opens_no_approval_when_the_audit_write_fails(granted):
    with refusing("governance_auditevent", "INSERT"):
        result = access.access_check(**ask("delete"))
    assert (result.decision, result.reason) == ("deny", "error")
    assert not Approval.objects.exists()


def test_a_decision_never_updates_the_grant_row(granted):
    """The allowed event is the record of the use: a grant row that refuses every
    UPDATE does not stop a decision (no hot row per call); the fold counts it."""
    with refusing("governance_grant", "UPDATE"):
        result = access.access_check(**ask())
    assert result.allowed
    event = last_event()
    assert (event.event_type, event.grant_id) == ("access.allowed", granted.pk)
    assert str(event.uid) == result.decision_id
    assert usage_fold() == 1
    granted.refresh_from_db()
    assert (granted.use_count, granted.last_used_at) == (1, NOW)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["read", "delete"])
def test_outside_a_transaction_a_failed_event_is_still_a_denial(postgres_only, granted, action):
    """PostgreSQL's two-round-trip path (no transaction around the decision): the
    event that cannot be written is a deny with `error`, and a destructive call's
    pending approval is not left behind without its event."""
    assert not connection.in_atomic_block
    with refusing("governance_auditevent", "INSERT"):
        result = access.access_check(**ask(action))
    assert (result.decision, result.reason, result.decision_id) == ("deny", "error", None)
    assert not AuditEvent.objects.filter(event_type__startswith="access.").exists()
    assert not Approval.objects.exists()
    # And once the database accepts events again, the same call is recorded.
    result = access.access_check(**ask(action))
    assert result.decision == ("allow" if action == "read" else "approval_required")
    assert str(last_event().uid) == result.decision_id
    assert Approval.objects.count() == (action == "delete")


def test_it_denies_when_the_database_fails_mid_decision(granted):
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("ALTER TABLE governance_grant RENAME TO governance_grant_gone")
        result = access.access_check(**ask())
        assert (result.decision, result.reason) == ("deny", "error")
        event = last_event()
        assert (event.decision, event.reason) == ("deny", "error")
        transaction.set_rollback(True)


def test_authorize_alone_denies_on_a_database_error(granted):
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("ALTER TABLE governance_agent RENAME TO governance_agent_gone")
        before = AuditEvent.objects.count()
        result = authorize(**ask())
        transaction.set_rollback(True)
    assert (result.decision, result.reason) == ("deny", "error")
    assert not result.allowed
    assert AuditEvent.objects.count() == before


def test_garbage_arguments_are_a_clear_denial_not_a_crash(granted):
    result = access.access_check(**{**ask(), "arguments": {"x": object()}})
    assert (result.decision, result.reason) == ("deny", "invalid_request")
    assert last_event().reason == "invalid_request"


def test_nul_bytes_and_huge_values_are_stored_safely(granted):
    result = access.access_check(
        agent="bot\x00", tool="repo", action="read", scope="x" * 10_000, at=NOW
    )
    assert result.decision == "deny"
    event = last_event()
    assert "\x00" not in event.agent and len(event.scope) <= 500


@pytest.mark.parametrize(
    "field, value",
    [("tool", "rep\udcff"), ("task", "T-\udcff"), ("scope", "repo:acme/\udcff"),
     ("approval", "\udcff"), ("arguments", {"path": "/workspace/\udcff.txt", "\udcfe": 1})],
)  # fmt: skip
def test_text_that_is_not_utf8_is_a_denial_on_record(granted, field, value):
    """A lone surrogate (what Python makes of a non-UTF-8 byte in a file name) could not
    be encoded into the event, nor into its fallback: a deny `error` with no event at all.
    Now it is `invalid_request`, and the event keeps the text as its escape."""
    before = AuditEvent.objects.count()
    result = access.access_check(**{**ask(), field: value})
    assert (result.decision, result.reason) == ("deny", "invalid_request")
    assert AuditEvent.objects.count() == before + 1
    event = last_event()
    assert str(event.uid) == result.decision_id and event.reason == "invalid_request"
    stored = {"tool": event.tool, "task": event.task, "scope": event.scope}
    stored["arguments"] = json.loads(event.arguments)
    if field in stored:
        assert stored[field] == (
            {"\\udcfe": 1, "path": "/workspace/\\udcff.txt"} if field == "arguments"
            else value.replace("\udcff", "\\udcff")
        )  # fmt: skip
    assert audit.verify_chain().ok  # the chain reads back: nothing in it that cannot be encoded


def _terminate_this_backend() -> int:
    """End this test's PostgreSQL session from another connection, as a restart or
    failover would; returns the ended backend's pid."""
    import psycopg
    from django.conf import settings as django_settings

    pid = connection.connection.info.backend_pid
    conf = django_settings.DATABASES["default"]
    with psycopg.connect(
        host=conf["HOST"], port=conf["PORT"], user=conf["USER"], dbname=conf["NAME"],
        autocommit=True,
    ) as admin:  # fmt: skip
        # The second argument: return once the backend has ended (PostgreSQL 14+).
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])
    return pid


@pytest.mark.django_db(transaction=True)
def test_a_connection_the_server_dropped_is_replaced_on_the_next_request(postgres_only):
    """The hot path's raw cursor runs Django's per-request health check, so a
    connection the server dropped (restart, failover) is replaced instead of
    failing every decision until CONN_MAX_AGE runs out."""
    from governance import db

    assert db.execute("SELECT 1") == [(1,)]
    pid = _terminate_this_backend()
    connection.health_check_done = False  # what Django does when a request starts
    assert db.execute("SELECT 1") == [(1,)]
    assert connection.connection.info.backend_pid != pid


@pytest.mark.django_db(transaction=True)
def test_the_health_check_of_a_quiet_connection_sends_nothing(postgres_only, monkeypatch):
    """governance.pgbackend: an idle connection whose socket is quiet is usable
    without a round trip; one the server ended is not, and is replaced."""
    from django.db.backends.postgresql.base import DatabaseWrapper as DjangoWrapper

    from governance import db

    assert db.execute("SELECT 1") == [(1,)]
    sent: list[str] = []

    def select_one(self):  # Django's check: a SELECT 1 round trip
        sent.append("SELECT 1")
        return True

    monkeypatch.setattr(DjangoWrapper, "is_usable", select_one)
    assert connection.is_usable() is True and sent == []

    pid = _terminate_this_backend()
    monkeypatch.undo()  # the real SELECT 1 now, on a socket that is readable
    assert connection.is_usable() is False
    connection.health_check_done = False
    assert db.execute("SELECT 1") == [(1,)]
    assert connection.connection.info.backend_pid != pid
