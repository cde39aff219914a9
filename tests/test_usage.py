"""Grant usage is folded in from the audit log (services.usage), never updated per call."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection

from governance.models import AuditEvent, Grant, UsageFold
from governance.services import access
from governance.services.usage import usage_fold
from tests.conftest import NOW


@pytest.fixture
def two_grants(make_agent, make_tool, make_grant) -> tuple[Grant, Grant]:
    bot = make_agent("bot")
    repo = make_tool("repo")
    wiki = make_tool("wiki")
    return (
        make_grant(bot, repo, ("read",), "repo:acme/*"),
        make_grant(bot, wiki, ("read",), "wiki:*"),
    )


def call(tool: str, scope: str, at=NOW, action: str = "read"):
    return access.access_check(agent="bot", tool=tool, action=action, scope=scope, at=at)


def test_each_allowed_event_counts_once_per_grant_and_denials_not_at_all(two_grants):
    repo_grant, wiki_grant = two_grants
    for minute in range(3):
        assert call("repo", "repo:acme/x", at=NOW + timedelta(minutes=minute)).allowed
    assert call("wiki", "wiki:home", at=NOW + timedelta(minutes=1)).allowed
    denied = call("repo", "repo:other/x")  # scope mismatch: no grant used
    assert denied.reason == "scope_mismatch"
    assert call("repo", "repo:acme/x", action="update").reason == "no_grant"

    assert usage_fold() == 4
    repo_grant.refresh_from_db()
    wiki_grant.refresh_from_db()
    assert (repo_grant.use_count, repo_grant.last_used_at) == (3, NOW + timedelta(minutes=2))
    assert (wiki_grant.use_count, wiki_grant.last_used_at) == (1, NOW + timedelta(minutes=1))
    assert UsageFold.objects.get().seq == AuditEvent.objects.order_by("-seq").first().seq

    assert usage_fold() == 0, "a second fold finds nothing new"
    repo_grant.refresh_from_db()
    assert repo_grant.use_count == 3


def test_a_late_event_never_moves_last_used_backwards(two_grants):
    repo_grant, _ = two_grants
    assert call("repo", "repo:acme/x", at=NOW + timedelta(minutes=10)).allowed
    usage_fold()
    assert call("repo", "repo:acme/x", at=NOW).allowed  # a decision about an earlier instant
    assert usage_fold() == 1
    repo_grant.refresh_from_db()
    assert (repo_grant.use_count, repo_grant.last_used_at) == (2, NOW + timedelta(minutes=10))


@pytest.mark.django_db(transaction=True)
def test_two_workers_folding_at_once_count_each_use_once(postgres_only, two_grants):
    repo_grant, _ = two_grants
    for minute in range(20):
        assert call("repo", "repo:acme/x", at=NOW + timedelta(minutes=minute)).allowed
    counted: list[int] = []
    barrier = threading.Barrier(4)

    def fold() -> None:
        try:
            barrier.wait()
            counted.append(usage_fold())
        finally:
            connection.close()

    threads = [threading.Thread(target=fold) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(counted) == [0, 0, 0, 20]
    repo_grant.refresh_from_db()
    assert repo_grant.use_count == 20


def test_a_grants_own_page_counts_uses_not_folded_yet(two_grants, client, alice):
    from governance.services.usage import grant_usage

    repo_grant, _ = two_grants
    assert grant_usage(repo_grant) == (0, None)
    for minute in (1, 2):
        assert call("repo", "repo:acme/x", at=NOW + timedelta(minutes=minute)).allowed
    assert grant_usage(repo_grant) == (2, NOW + timedelta(minutes=2))
    usage_fold()
    repo_grant.refresh_from_db()
    assert grant_usage(repo_grant) == (2, NOW + timedelta(minutes=2))
    assert call("repo", "repo:acme/x", at=NOW + timedelta(minutes=3)).allowed
    assert grant_usage(repo_grant) == (3, NOW + timedelta(minutes=3))
    assert repo_grant.use_count == 2, "the row itself changes only when folded"
