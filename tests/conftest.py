"""Small composable fixtures. Everything goes through the real services, so a
test's database holds exactly what production would, audit events included."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection, transaction

from governance import roles
from governance.audit import Actor
from governance.models import Agent, AuditEvent, Grant, Task, Tool
from governance.services import agents, grants, tasks, tools

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
MS = timedelta(milliseconds=1)


@pytest.fixture(autouse=True)
def _checkpoints_in_tmp(settings: Any, tmp_path: Any) -> None:
    settings.AUDIT_CHECKPOINT_DIR = tmp_path / "checkpoints"
    # Most tests verify a chain with no checkpoint job running; the tests of the rule
    # that one must exist and be recent turn it on (test_audit_chain.py).
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(0)
    # Test users' passwords need no key stretching; PBKDF2 was most of the suite's time.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@contextmanager
def accounts_changed_at(moment: datetime) -> Iterator[None]:
    """Account changes made inside are on record (their person.* events) as of `moment`:
    for a world set at NOW, a fixed past moment, whose reports read accounts as they
    were then (selectors.accounts_at). The events' clock only; the chain is as ever."""
    from governance.services import people

    saved = people.timezone
    people.timezone = SimpleNamespace(now=lambda: moment)  # type: ignore[assignment]
    try:
        yield
    finally:
        people.timezone = saved


@pytest.fixture
def postgres_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL (set DATABASE_URL): behaviour specific to PostgreSQL")


@pytest.fixture
def now() -> datetime:
    return NOW


@pytest.fixture
def system() -> Actor:
    return Actor.system("test")


@pytest.fixture
def alice(db: None) -> User:
    """Requester and agent owner."""
    return User.objects.create_user("alice", password="pw-alice-123")


@pytest.fixture
def bob(db: None) -> User:
    """Approver (the services refuse a decision by anyone else), since before NOW, as
    the reports of the world's moments read his account (selectors.accounts_at)."""
    user = User.objects.create_user("bob", password="pw-bob-123")
    with accounts_changed_at(NOW - timedelta(days=1)):
        user.groups.add(Group.objects.get_or_create(name=roles.APPROVERS)[0])
    return user


@pytest.fixture
def make_agent(alice: User, system: Actor) -> Callable[..., Agent]:
    def make(name: str = "bot", parent: Agent | None = None, owner: User | None = None) -> Agent:
        return agents.agent_create(
            name=name, owner=owner or alice, parent=parent, actor=system, at=NOW - timedelta(days=1)
        )

    return make


@pytest.fixture
def make_tool(system: Actor, db: None) -> Callable[..., Tool]:
    def make(
        name: str = "repo",
        actions: tuple[str, ...] = ("read", "create", "update", "delete", "execute"),
        irreversible: bool = False,
        kind: str = "api",
    ) -> Tool:
        return tools.tool_register(
            name=name,
            kind=kind,
            actions=list(actions),
            irreversible=irreversible,
            description=f"{name} tool",
            actor=system,
            at=NOW - timedelta(days=1),
        )

    return make


@pytest.fixture
def make_task(alice: User, system: Actor) -> Callable[..., Task]:
    def make(key: str = "TICKET-1", at: datetime | None = None, **kw: Any) -> Task:
        return tasks.task_open(
            key=key, owner=alice, actor=system, at=at or NOW - timedelta(hours=2), **kw
        )

    return make


@pytest.fixture
def make_grant(alice: User, bob: User, system: Actor) -> Callable[..., Grant]:
    def make(
        agent: Agent,
        tool: Tool,
        actions: tuple[str, ...] = ("read",),
        scope: str = "repo:acme/api/*",
        starts_at: datetime | None = None,
        duration: timedelta = timedelta(hours=1),
        **kw: Any,
    ) -> Grant:
        return grants.grant_issue(
            agent=agent,
            tool=tool,
            actions=list(actions),
            scope=scope,
            duration=duration,
            justification="test",
            requested_by=alice,
            approved_by=bob,
            actor=system,
            at=starts_at or NOW - timedelta(minutes=30),
            **kw,
        )

    return make


def last_event() -> AuditEvent:
    event = AuditEvent.objects.order_by("-seq").first()
    assert event is not None, "no audit event was written"
    return event


pytest_plugins = ["tests.api_fixtures", "tests.lifecycle_fixtures", "tests.sandbox_world"]


# --- Transactional tests ---------------------------------------------------------------
# After a transactional test (live_server, threads) Django empties every table: on SQLite
# with DELETE, which the append-only row triggers refuse (migration 0002), on PostgreSQL
# with TRUNCATE, which a statement trigger refuses while the log holds an event
# (migration 0012). Either way the flush would fail and the next test would start on a
# dirty database. So just before the flush the audit table is emptied with its guards
# lifted for that one statement and put back at once: the flush then finds an empty log,
# and the guards protect every test as usual.


def _is_transactional(request: pytest.FixtureRequest) -> bool:
    names = request.fixturenames
    if "transactional_db" in names or "live_server" in names:
        return True
    marker = request.node.get_closest_marker("django_db")
    return bool(
        marker is not None
        and (marker.kwargs.get("transaction") or (marker.args and marker.args[0]))
    )


@pytest.fixture(autouse=True)
def _audit_flushable(request: pytest.FixtureRequest) -> Any:
    if not _is_transactional(request):
        yield
        return
    # Set up after the database fixture, so this teardown runs before its flush.
    request.getfixturevalue("transactional_db")
    yield
    import importlib

    rows = importlib.import_module("governance.migrations.0002_audit_append_only")
    truncate = importlib.import_module("governance.migrations.0012_audit_no_truncate")
    if connection.vendor == "sqlite":
        down, empty, up = rows.SQLITE_DOWN, "DELETE FROM governance_auditevent", rows.SQLITE_UP
    else:
        down, up = truncate.POSTGRES_DOWN, truncate.POSTGRES_UP
        empty = "TRUNCATE governance_auditevent"
    with transaction.atomic(), connection.cursor() as cur:
        for statement in down:
            cur.execute(statement)
        cur.execute(empty)
        for statement in up:
            cur.execute(statement)


@pytest.fixture(scope="session")
def live_server(request: pytest.FixtureRequest) -> Any:
    """pytest-django's live server, but on 127.0.0.1 (not "localhost", which may mean ::1)
    unless --liveserver or DJANGO_LIVE_TEST_SERVER_ADDRESS says otherwise."""
    import os

    from pytest_django.live_server_helper import LiveServer

    addr = (
        request.config.getvalue("liveserver")
        or os.getenv("DJANGO_LIVE_TEST_SERVER_ADDRESS")
        or "127.0.0.1"
    )
    server = LiveServer(addr)
    yield server
    server.stop()


# --- Celery in tests (issue #5) ----------------------------------------------------------
# Notifications are handed to Celery after each commit. In-process tests run those tasks
# eagerly (here, now), so a test sees the e-mail in mail.outbox and the webhook's request
# on its local server; tests about the worker itself start a real one (tests/test_jobs.py).


@pytest.fixture(autouse=True)
def _celery_eager() -> Any:
    from governance.celery import app

    app.conf.task_always_eager = True
    yield


# --- Lock order: the chain lock is the last lock a transaction takes -----------------------
# Every state change appends its audit event holding the chain lock until COMMIT, and every
# decision waits for it. A statement that locks or changes existing rows after the event in
# the same transaction can wait for a row lock while holding the chain lock: every decision
# then waits too, and a transaction that holds that row and waits for the chain lock
# deadlocks with it. This guard records such statements (ORM and the hot path's raw ones)
# in every test and fails the test that ran one.

_LOCKING = re.compile(
    r"^\s*(UPDATE|DELETE)\b|\bFOR\s+(NO\s+KEY\s+UPDATE|UPDATE|KEY\s+SHARE|SHARE)\b"
    # A lock of our own taken with parameters (services.access's per-call lock), not the
    # chain lock itself, whose key is a literal.
    r"|\bpg_advisory_xact_lock\(%s",
    re.I,
)


@pytest.fixture(autouse=True)
def _events_last(monkeypatch: pytest.MonkeyPatch) -> Any:
    from governance import audit, db

    state: dict[str, Any] = {"block": None, "events": [], "late": []}

    def service_block() -> Any:
        """The outermost atomic block that is the code's own, not the test case's."""
        return next(
            (b for b in connection.atomic_blocks if not getattr(b, "_from_testcase", 0)), None
        )

    def note(sql: str) -> None:
        block = service_block()
        if block is None or block is not state["block"]:
            state["block"] = None
            return
        if _LOCKING.search(sql) and "governance_audit_append" not in sql:
            state["late"].append((tuple(state["events"]), " ".join(sql.split())[:90]))

    real_append = audit.append

    def append(**kwargs: Any) -> Any:
        written = real_append(**kwargs)
        if not written.hash:  # held by audit.deferred(): appended at the end of its block
            return written
        if state["block"] is not service_block():
            state["events"] = []
        state["events"] = [*state["events"], kwargs.get("event_type")]
        state["block"] = service_block()
        return written

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        note(sql)
        return execute(sql, params, many, context)

    for name in ("_exec_pg", "execute"):
        real = getattr(db, name)

        def spy(sql: str, params: Any = (), _real: Any = real) -> Any:
            note(sql)
            return _real(sql, params)

        monkeypatch.setattr(db, name, spy)
    monkeypatch.setattr(audit, "append", append)
    with connection.execute_wrapper(wrapper):
        yield
    assert not state["late"], f"rows locked or changed after the audit event: {state['late']}"


@contextmanager
def lookup_hangs(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[None]:
    """socket.getaddrinfo hangs for `name` (any other name is looked up as 127.0.0.1)
    until the block ends: a fake standing in for a resolver that does not answer, which
    a test may not reach (no traffic beyond 127.0.0.1)."""
    import socket
    import threading

    release = threading.Event()
    real = socket.getaddrinfo

    def hanging(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == name:
            release.wait(30)
        return real("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    try:
        yield
    finally:
        release.set()


@pytest.fixture
def back_to_head() -> Iterator[None]:
    """A test that migrates the database back leaves it at the latest migration again
    (the tests after it, transactional ones, run on whatever schema it left)."""
    yield
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
