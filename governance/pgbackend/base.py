"""Django's PostgreSQL backend, with a health check that costs no round trip.

With CONN_HEALTH_CHECKS, Django checks a persistent connection at the first use
in each request by sending SELECT 1: a full round trip (and, on this stack,
more client CPU than the decision's own query) on every API call. A server
that ended the session (restart, failover, pg_terminate_backend) sends its
FATAL message and closes the socket, and either one makes the socket readable
while the connection sits idle between requests. So the check first polls the
socket without waiting: quiet means nothing has happened to the session and
the connection is usable, as SELECT 1 would have found; readable means
something arrived unasked, and Django's own check (SELECT 1) decides.
"""

from __future__ import annotations

import select

import psycopg
from django.db.backends.postgresql import base


class DatabaseWrapper(base.DatabaseWrapper):
    def is_usable(self) -> bool:
        conn = self.connection
        if conn is None or conn.closed:
            return False
        try:
            poller = select.poll()  # poll, not select(): no limit on the descriptor number
            poller.register(conn.pgconn.socket, select.POLLIN)
            readable = poller.poll(0)
        except (OSError, ValueError, psycopg.Error):  # no socket any more
            return False
        if readable:
            return bool(super().is_usable())
        return True
