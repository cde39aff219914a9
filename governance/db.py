"""The hot path's statements: named prepared statements through libpq on PostgreSQL.

A decision runs a handful of fixed statements (the decision's read, the audit
append, a token lookup). Django's psycopg 3 backend binds parameters
client-side and plans every statement again, and psycopg's cursor machinery
costs about as much as the round trip itself. So on PostgreSQL `query()` and
`change()` run each statement as a named prepared statement directly through
libpq (PQprepare once per connection, then PQexecPrepared with binary
results decoded here), on Django's own connection: same session, same
transaction, same atomic block. On SQLite they go through Django's cursor and
decode to the same Python values.

Column kinds (one letter per column): i = integer, b = boolean, s = text,
f = double precision, t = timestamp as integer microseconds since the Unix
epoch (to_us()), so the decision compares times as integers and never parses
them. Parameters go in PostgreSQL's text input format; a JSON parameter (the
ORM's Jsonb wrapper) as its JSON text.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.utils.dateparse import parse_datetime
from psycopg.errors import error_from_result
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg.types.json import Json, Jsonb

_OK = (ExecStatus.TUPLES_OK, ExecStatus.COMMAND_OK)
_IDLE = TransactionStatus.IDLE
_MISSING_STATEMENT = b"26000"  # invalid_sql_statement_name
_NAMES = itertools.count()  # statement names, unique in the process


def _pg() -> psycopg.Connection[Any]:
    """Django's open psycopg connection (replaced first if the server dropped it)."""
    wrapper = connections[DEFAULT_DB_ALIAS]
    # What Django's own cursor() does first: once per request, replace a
    # connection the server dropped (restart, failover) instead of failing
    # every decision on it until CONN_MAX_AGE runs out.
    wrapper.close_if_health_check_failed()
    if wrapper.connection is None:
        wrapper.ensure_connection()
    return wrapper.connection


def _rows(cur: psycopg.Cursor[Any]) -> list[tuple[Any, ...]]:
    result = cur.pgresult
    return cur.fetchall() if result is not None and result.status == ExecStatus.TUPLES_OK else []


def execute(sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Run one statement with %s placeholders through Django's connection; return
    its rows (or []). For statements off the hot path (nothing prepared)."""
    if connection.vendor == "postgresql":
        with psycopg.Cursor(_pg()) as cur:
            cur.execute(sql, params)
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
    with psycopg.Cursor(_pg()) as cur:
        cur.execute(script, prepare=False)
        while cur.nextset():
            pass
        return _rows(cur)


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


# --- Times as integers -------------------------------------------------------------

UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_PG_EPOCH_US = 946_684_800 * 1_000_000  # 2000-01-01, PostgreSQL's timestamp origin


def to_us(value: datetime) -> int:
    """An aware datetime as integer microseconds since the Unix epoch (exact)."""
    delta = value - UNIX_EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(value: int) -> datetime:
    return UNIX_EPOCH + timedelta(microseconds=value)


# --- The hot path: query() and change() ------------------------------------------------


def kind_of(field: Any) -> str:
    """The db.query() kind that reads a model field's column (JSON columns read as
    text: on PostgreSQL the statement casts them with ::text)."""
    from django.db import models

    if isinstance(field, models.DateTimeField):
        return "t"
    if isinstance(field, models.BooleanField):
        return "b"
    if isinstance(field, models.IntegerField | models.ForeignKey | models.AutoField):
        return "i"
    if isinstance(field, models.FloatField):
        return "f"
    return "s"


def _int(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)


_PG_DECODE: dict[str, Callable[[bytes], Any]] = {
    "i": _int,
    "b": lambda raw: raw == b"\x01",
    "s": lambda raw: raw.decode(),
    "f": lambda raw: struct.unpack(">d", raw)[0],  # binary float8
    "t": lambda raw: _int(raw) + _PG_EPOCH_US,  # binary timestamptz: microseconds since 2000
}


def _sqlite_time(value: Any) -> int:
    parsed = read_dt(value)
    assert parsed is not None
    return to_us(parsed)


_SQLITE_DECODE: dict[str, Callable[[Any], Any]] = {
    "i": int,
    "b": bool,
    "s": str,
    "f": float,
    "t": _sqlite_time,
}
_PLACEHOLDER = re.compile(r"%s")


def _pg_param(value: Any) -> bytes | None:
    """A parameter in PostgreSQL's text input format."""
    if type(value) is str:  # most parameters: the common case first
        text = value
    elif value is None:
        return None
    elif isinstance(value, bytes):
        return b"\\x" + value.hex().encode()  # bytea
    elif isinstance(value, bool):
        return b"true" if value else b"false"
    elif isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("naive datetime passed to the database")
        text = value.isoformat()
    elif isinstance(value, Json | Jsonb):  # what JSONField.get_db_prep_save() returns
        text = (value.dumps or json.dumps)(value.obj)
    else:
        text = str(value)
    if "\x00" in text:  # libpq would cut the value at the NUL: refuse, as psycopg does
        raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
    return text.encode()


def _prepared_mode(wrapper: Any) -> bool:
    """Server-side prepared statements, unless the settings say the connection
    goes through a pooler that cannot keep them (OPTIONS prepare_threshold None)."""
    options = wrapper.settings_dict.get("OPTIONS", {})
    return not ("prepare_threshold" in options and options["prepare_threshold"] is None)


def _exec_pg(sql: str, params: Sequence[Any]) -> Any:
    conn = _pg()
    pgconn = conn.pgconn
    args = [_pg_param(v) for v in params]
    registry: dict[str, bytes] = conn.__dict__.setdefault("_governance_prepared", {})
    with conn.lock:
        if not conn.autocommit and pgconn.transaction_status == _IDLE:
            # Django opened a transaction that psycopg has not begun yet (it
            # sends BEGIN before its next statement): begin it, as psycopg would.
            _check(pgconn.exec_(conn._get_tx_start_command()), conn)
        in_transaction = pgconn.transaction_status != _IDLE
        if not _prepared_mode(connections[DEFAULT_DB_ALIAS]):
            result = pgconn.exec_params(_numbered(sql, len(args)), args, None, None, 1)
        else:
            result = _exec_named(pgconn, registry, sql, args)
            if (
                result.status not in _OK
                and result.error_field(psycopg.pq.DiagnosticField.SQLSTATE) == _MISSING_STATEMENT
            ):
                # Something deallocated every prepared statement (DEALLOCATE ALL,
                # DISCARD ALL): prepare again. Outside a transaction nothing was
                # lost, so run it again; inside one the transaction is already
                # aborted, and the error stands.
                registry.clear()
                if not in_transaction:
                    result = _exec_named(pgconn, registry, sql, args)
    _check(result, conn)
    return result


def _numbered(sql: str, count: int) -> bytes:
    counter = iter(range(1, count + 1))
    return _PLACEHOLDER.sub(lambda _m: f"${next(counter)}", sql).encode()


def _exec_named(pgconn: Any, registry: dict[str, bytes], sql: str, args: list[Any]) -> Any:
    name = registry.get(sql)
    if name is None:
        name = f"_gov_{next(_NAMES)}".encode()
        prepared = pgconn.prepare(name, _numbered(sql, len(args)))
        if prepared.status not in _OK:
            return prepared
        registry[sql] = name
    return pgconn.exec_prepared(name, args, None, 1)


def _check(result: Any, conn: psycopg.Connection[Any]) -> None:
    if result.status not in _OK:
        raise error_from_result(result, encoding=conn.info.encoding)


def query(sql: str, params: Sequence[Any], kinds: str) -> list[tuple[Any, ...]]:
    """Run one statement (%s placeholders) and return its rows, column k decoded
    as kinds[k]. It may write: inside an atomic block it is part of the block's
    transaction, outside one it commits on its own (autocommit)."""
    if connection.vendor != "postgresql":
        with connection.cursor() as cur:
            cur.execute(sql, [_sqlite_param(v) for v in params])
            rows = cur.fetchall() if cur.description else []
        decode = [_SQLITE_DECODE[k] for k in kinds]
        return [
            tuple(None if v is None else f(v) for f, v in zip(decode, row, strict=True))
            for row in rows
        ]
    result = _exec_pg(sql, params)
    if result.nfields != len(kinds):
        raise ValueError(f"{result.nfields} columns, {len(kinds)} kinds")
    decode = [_PG_DECODE[k] for k in kinds]
    get = result.get_value
    out = []
    for r in range(result.ntuples):
        row = []
        for c, f in enumerate(decode):
            raw = get(r, c)
            row.append(None if raw is None else f(raw))
        out.append(tuple(row))
    return out


def change(sql: str, params: Sequence[Any]) -> int:
    """Run one data-changing statement; return how many rows it touched."""
    if connection.vendor != "postgresql":
        with connection.cursor() as cur:
            cur.execute(sql, [_sqlite_param(v) for v in params])
            return cur.rowcount
    return int(_exec_pg(sql, params).command_tuples or 0)


def _sqlite_param(value: Any) -> Any:
    if isinstance(value, datetime):
        return param_dt(value)
    if isinstance(value, uuid.UUID):
        return value.hex
    return value
