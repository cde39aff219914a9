"""governance.db's hot path: named prepared statements through libpq (PostgreSQL).

Real server behaviour, no mocks: statements deallocated under it, a pooler
setting that forbids prepared statements, transactions begun for it, and the
same values on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from django.db import connection, connections, transaction

from governance import db
from governance.models import AuditEvent
from governance.services import access
from tests.conftest import NOW, last_event


@pytest.fixture
def granted(make_agent, make_tool, make_grant):
    return make_grant(make_agent("bot"), make_tool("repo"), ("read",), "repo:acme/*")


def ask() -> dict:
    return {"agent": "bot", "tool": "repo", "action": "read", "scope": "repo:acme/x", "at": NOW}


def our_statements() -> int:
    return db.execute("SELECT count(*) FROM pg_prepared_statements WHERE name LIKE '\\_gov\\_%%'")[
        0
    ][0]


def test_values_decode_alike_on_both_backends(granted):
    at = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    rows = db.query(
        "SELECT g.id, g.scope, g.id > 0, g.expires_at FROM governance_grant g WHERE g.id = %s",
        [granted.pk],
        "isbt",
    )
    assert rows == [(granted.pk, "repo:acme/*", True, db.to_us(granted.expires_at))]
    assert db.from_us(db.to_us(at)) == at
    assert db.to_us(datetime(1970, 1, 1, tzinfo=UTC) - timedelta(microseconds=1)) == -1


def test_floats_and_json_parameters_round_trip_alike_on_both_backends(granted):
    from governance.models import Grant

    field = Grant._meta.get_field("egress")
    egress = ["api.example:443", "ünïcode:1"]
    param = field.get_db_prep_save(egress, connection)  # Jsonb on PostgreSQL, text on SQLite
    cast = "::text" if connection.vendor == "postgresql" else ""
    db.query(
        "UPDATE governance_grant SET limit_cpus = %s, egress = %s WHERE id = %s",
        [0.25, param, granted.pk],
        "",
    )
    rows = db.query(
        f"SELECT limit_cpus, egress{cast} FROM governance_grant WHERE id = %s", [granted.pk], "fs"
    )
    assert rows[0][0] == 0.25 and json.loads(rows[0][1]) == egress
    granted.refresh_from_db()
    assert (granted.limit_cpus, granted.egress) == (0.25, egress)


@pytest.mark.django_db(transaction=True)
def test_deallocated_statements_are_prepared_again_outside_a_transaction(postgres_only, granted):
    assert access.access_check(**ask()).allowed
    assert our_statements() >= 2
    db.execute("DEALLOCATE ALL")  # what psycopg does after a ROLLBACK when it prepared
    assert our_statements() == 0
    result = access.access_check(**ask())
    assert result.allowed and str(last_event().uid) == result.decision_id
    assert our_statements() >= 2


def test_deallocated_statements_inside_a_transaction_deny_then_recover(postgres_only, granted):
    assert access.access_check(**ask()).allowed
    with transaction.atomic():
        sid = transaction.savepoint()
        db.execute("DEALLOCATE ALL")
        failed = access.access_check(**ask())
        # The transaction is aborted by the failed statement: a denial, not an allow.
        assert (failed.decision, failed.reason) == ("deny", "error")
        transaction.savepoint_rollback(sid)
    result = access.access_check(**ask())
    assert result.allowed and str(last_event().uid) == result.decision_id


@pytest.mark.django_db(transaction=True)
def test_behind_a_pooler_nothing_is_prepared(postgres_only, granted):
    options = connections["default"].settings_dict.setdefault("OPTIONS", {})
    options["prepare_threshold"] = None
    try:
        connection.close()
        before = AuditEvent.objects.count()
        result = access.access_check(**ask())
        assert result.allowed and str(last_event().uid) == result.decision_id
        assert AuditEvent.objects.count() == before + 1
        assert our_statements() == 0
    finally:
        del options["prepare_threshold"]
        connection.close()


def test_a_nul_in_a_parameter_is_refused_not_cut_short(granted):
    """libpq would end a text parameter at the NUL: `repo\\x00evil` must not be `repo`.
    The decision refuses such text before any statement; the statement layer too."""
    result = access.access_check(**{**ask(), "tool": "repo\x00evil"})
    assert (result.decision, result.reason) == ("deny", "invalid_request")
    assert last_event().decision == "deny"
    with pytest.raises(psycopg.DataError, match="NUL"):
        db._pg_param("repo\x00evil")
