"""DATABASE_URL: parsed strictly at start-up, including a Unix socket directory
(the way libpq spells it), so a service next to its PostgreSQL skips the TCP stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured

from governance.settings import database_from_url

ROOT = Path(__file__).resolve().parent.parent
SOCKET_DIR = "/var/run/postgresql"


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("postgresql://postgres@127.0.0.1:5432/db", "127.0.0.1", "5432"),
        ("postgres://u@db.internal/db", "db.internal", "5432"),
        ("postgresql://u:p@[::1]:5433/db", "::1", "5433"),
        ("postgresql://postgres@%2Fvar%2Frun%2Fpostgresql/db", "/var/run/postgresql", "5432"),
        ("postgresql://postgres@%2Frun%2Fpg:5433/db", "/run/pg", "5433"),
        ("postgresql://postgres@/db?host=/var/run/postgresql", "/var/run/postgresql", "5432"),
        ("postgresql://postgres@/db", "", "5432"),  # libpq's default socket
    ],
)
def test_a_host_or_a_socket_directory_is_read_as_libpq_reads_it(url, host, port):
    entry = database_from_url(url)
    assert (entry["HOST"], entry["PORT"], entry["NAME"]) == (host, port, "db")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("postgresql://u@h/db?sslmode=require", "unsupported parameter(s) sslmode"),
        ("postgresql://u@h/db?host=/run/pg", "no host part"),
        ("postgresql://u@/db?host=run/pg", "absolute socket directory"),
        ("postgresql://u@/db?host=/a&host=/b", "one absolute socket directory"),
        ("postgresql://u@/db?host", "malformed query"),
        ("postgresql://u@h:99999/db", "invalid port"),
        ("postgresql://u@h/", "no database name"),
        ("mysql://u@h/db", "not supported"),
    ],
)
def test_a_bad_database_url_is_an_error_naming_the_problem(url, words):
    with pytest.raises(ImproperlyConfigured) as caught:
        database_from_url(url)
    assert words in str(caught.value)


def test_a_bad_database_url_stops_the_service_at_start_up():
    env = {**os.environ, "DATABASE_URL": "postgresql://u@h/db?sslmode=require"}
    proc = subprocess.run(  # noqa: S603 - our own interpreter and manage.py
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "ImproperlyConfigured" in proc.stderr and "sslmode" in proc.stderr


@pytest.mark.skipif(
    not Path(SOCKET_DIR, ".s.PGSQL.5432").exists(),
    reason=f"no PostgreSQL socket in {SOCKET_DIR} on this machine",
)
def test_the_socket_url_reaches_the_server():
    entry = database_from_url("postgresql://postgres@%2Fvar%2Frun%2Fpostgresql/postgres")
    with psycopg.connect(
        host=entry["HOST"], port=entry["PORT"], user=entry["USER"], dbname=entry["NAME"]
    ) as conn:
        # An empty inet_server_addr() is how the server says "not over TCP".
        assert conn.execute("SELECT inet_server_addr()").fetchone() == (None,)
        assert conn.info.host == SOCKET_DIR
