"""The hot-path cursor: server-side prepared statements on PostgreSQL.

Django's psycopg 3 backend binds parameters client-side, so every decision
would re-plan its query. The decision and the audit append run a handful of
fixed statements, so on PostgreSQL they go through a plain psycopg cursor on
Django's own connection (same transaction, same atomic block) with
prepare=True. On SQLite they go through Django's cursor.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.utils.dateparse import parse_datetime
from psycopg.pq import ExecStatus

_TUPLES_OK = ExecStatus.TUPLES_OK


# Only statements run here with prepare=True are prepared: a threshold this
# high never auto-prepares Django's own queries.
_EXPLICIT_ONLY = 1 << 62


def _pg() -> psycopg.Connection[Any]:
    """Django's open psycopg connection, with server-side preparation enabled.

    Django opens it with prepare_threshold=None, which makes psycopg ignore
    prepare=True, so every decision would be parsed and planned again. Unless
    the settings choose a threshold (OPTIONS["prepare_threshold"], e.g. None
    behind a pooler that cannot hold prepared statements), only the
    statements that ask for it are prepared.
    """
    wrapper = connections[DEFAULT_DB_ALIAS]
    # What Django's own cursor() does first: once per request, replace a
    # connection the server dropped (restart, failover) instead of failing
    # every decision on it until CONN_MAX_AGE runs out.
    wrapper.close_if_health_check_failed()
    conn = wrapper.connection
    if conn is None:
        wrapper.ensure_connection()
        conn = wrapper.connection
    if conn.prepare_threshold is None and "prepare_threshold" not in wrapper.settings_dict.get(
        "OPTIONS", {}
    ):
        conn.prepare_threshold = _EXPLICIT_ONLY
    return conn


def _rows(cur: psycopg.Cursor[Any]) -> list[tuple[Any, ...]]:
    result = cur.pgresult
    return cur.fetchall() if result is not None and result.status == _TUPLES_OK else []


def _cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    """One reusable cursor per connection (it lives and dies with it)."""
    cur = conn.__dict__.get("_governance_cursor")
    if cur is None or cur.closed:
        cur = conn.__dict__["_governance_cursor"] = psycopg.Cursor(conn)
    return cur


def execute(sql: str, params: Sequence[Any] = (), *, binary: bool = False) -> list[tuple[Any, ...]]:
    """Run one statement with %s placeholders; return its rows (or []).

    binary=True asks PostgreSQL for binary results: the same Python values,
    decoded in C (aware datetimes, uuids), except that json/jsonb columns
    arrive parsed instead of as text. Ignored on SQLite.
    """
    if connection.vendor == "postgresql":
        cur = _cursor(_pg())
        cur.execute(sql, params, prepare=True, binary=binary)
        return _rows(cur)
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall() if cur.description else []


def execute_script(script: str) -> list[tuple[Any, ...]]:
    """PostgreSQL only: a constant, parameterless multi-statement script in one
    round trip; returns the last statement's rows.

    Simple query protocol, nothing prepared. The statements still run one
    after the other, each with a fresh snapshot (READ COMMITTED), so a
    statement sees what committed while an earlier one waited for a lock. The
    first error stops the script and is raised.
    """
    cur = _cursor(_pg())
    cur.execute(script, prepare=False)
    while cur.nextset():
        pass
    return _rows(cur)


def execute_rowcount(sql: str, params: Sequence[Any] = ()) -> int:
    """Run one data-changing statement and return how many rows it touched."""
    if connection.vendor == "postgresql":
        cur = _cursor(_pg())
        cur.execute(sql, params, prepare=True)
        return cur.rowcount
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.rowcount


def param_dt(value: datetime | None) -> Any:
    """A datetime as the backend stores it (SQLite: naive UTC text)."""
    if value is None:
        return None
    return connection.ops.adapt_datetimefield_value(value)


def param_uuid(value: uuid.UUID | str) -> Any:
    """A UUID as the backend stores it (SQLite: 32 hex chars, as Django does)."""
    parsed = value if isinstance(value, uuid.UUID) else uuid.UUID(value)
    return parsed if connection.vendor == "postgresql" else parsed.hex


def read_dt(value: Any) -> datetime | None:
    """A datetime column read through a raw cursor, as an aware UTC datetime."""
    if value is None:
        return None
    if isinstance(value, str):
        parsed = parse_datetime(value)
        if parsed is None:
            raise ValueError(f"unreadable datetime {value!r}")
        value = parsed
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)
