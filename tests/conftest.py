"""Small composable fixtures. Everything goes through the real services, so a
test's database holds exactly what production would, audit events included."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection

from governance.audit import Actor
from governance.models import Agent, AuditEvent, Grant, Task, Tool
from governance.services import agents, grants, tasks, tools

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
MS = timedelta(milliseconds=1)


@pytest.fixture(autouse=True)
def _checkpoints_in_tmp(settings: Any, tmp_path: Any) -> None:
    settings.AUDIT_CHECKPOINT_DIR = tmp_path / "checkpoints"


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
    """Approver."""
    return User.objects.create_user("bob", password="pw-bob-123")


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


pytest_plugins = ["tests.api_fixtures"]
