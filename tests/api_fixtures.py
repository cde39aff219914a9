"""Fixtures for API tests: real tokens issued through the service."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from rest_framework.test import APIClient

from governance import ratelimit, roles
from governance.audit import Actor
from governance.services import agents


@pytest.fixture(autouse=True)
def _fresh_rate_limits(settings: Any) -> None:
    settings.REDIS_URL = None
    ratelimit.reset_memory()


def _client(token: str | None) -> APIClient:
    client = APIClient()
    if token:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@pytest.fixture
def agent_client(alice: User) -> Callable[..., APIClient]:
    """A client holding a fresh token for the given agent."""

    def make(agent: Any) -> APIClient:
        _, plaintext = agents.token_issue(
            created_by=alice, agent=agent, actor=Actor.system("test"), at=timezone.now()
        )
        return _client(plaintext)

    return make


@pytest.fixture
def human_client(alice: User) -> Callable[..., APIClient]:
    """A client holding a personal token for a user, with the given roles."""

    def make(user: User, *role_names: str) -> APIClient:
        for name in role_names:
            user.groups.add(Group.objects.get_or_create(name=name)[0])
        _, plaintext = agents.token_issue(
            created_by=alice, user=user, actor=Actor.system("test"), at=timezone.now()
        )
        return _client(plaintext)

    return make


@pytest.fixture
def anonymous() -> APIClient:
    return _client(None)


@pytest.fixture
def carol(db: None) -> User:
    """Auditor."""
    return User.objects.create_user("carol", password="pw-carol-123")


@pytest.fixture
def dave(db: None) -> User:
    """Admin."""
    return User.objects.create_user("dave", password="pw-dave-123")


ROLE = {"admin": roles.ADMINS, "approver": roles.APPROVERS, "auditor": roles.AUDITORS}


@pytest.fixture
def auditor_session(carol: User) -> Any:
    """A web UI client signed in as carol, an auditor (the exports pages)."""
    from django.test import Client

    carol.groups.add(Group.objects.get_or_create(name=roles.AUDITORS)[0])
    client = Client()
    client.force_login(carol)
    return client
