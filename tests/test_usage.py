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


# --- Per action: read, create, update, delete and execute are separate grants ------------


@pytest.fixture
def read_update(make_agent, make_tool, make_grant) -> Grant:
    return make_grant(make_agent("bot"), make_tool("repo"), ("read", "update"), "repo:acme/*")


def test_the_fold_keeps_each_actions_uses_apart(read_update):
    """The grant's totals as before, and per action how often and when last: an update
    right never used has no row however often the grant reads."""
    from governance.models import GrantActionUse

    for minute in range(3):
        assert call("repo", "repo:acme/x", at=NOW + timedelta(minutes=minute)).allowed
    assert usage_fold() == 3
    assert call("repo", "repo:acme/x", at=NOW + timedelta(minutes=9), action="update").allowed
    assert call("repo", "repo:acme/x", at=NOW + timedelta(minutes=5)).allowed
    assert call("repo", "repo:acme/x", at=NOW - timedelta(minutes=5)).allowed  # earlier instant
    assert usage_fold() == 3
    read_update.refresh_from_db()
    assert (read_update.use_count, read_update.last_used_at) == (6, NOW + timedelta(minutes=9))
    rows = GrantActionUse.objects.filter(grant=read_update).order_by("action")
    assert [(r.action, r.use_count, r.last_used_at) for r in rows] == [
        ("read", 5, NOW + timedelta(minutes=5)),
        ("update", 1, NOW + timedelta(minutes=9)),
    ]
    assert usage_fold() == 0


def test_the_grant_page_shows_each_actions_usage_folded_or_not(read_update):
    from governance.services.usage import grant_action_usage

    assert grant_action_usage(read_update) == [("read", 0, None), ("update", 0, None)]
    assert call("repo", "repo:acme/x", at=NOW + timedelta(minutes=1)).allowed
    usage_fold()
    assert call("repo", "repo:acme/x", at=NOW + timedelta(minutes=2)).allowed
    assert grant_action_usage(read_update) == [
        ("read", 2, NOW + timedelta(minutes=2)),
        ("update", 0, None),
    ]


@pytest.mark.django_db(transaction=True)
def test_migration_0028_fills_each_actions_uses_from_the_folded_log(read_update, back_to_head):
    """Usage from before the per-action rows: read back from the events the fold had
    counted (those after its watermark are the next fold's), so a grant used before the
    migration does not look never used for every action. A grant flagged before it was
    flagged as a whole: its flag names all its actions."""
    from django.db.migrations.executor import MigrationExecutor

    from governance.models import GrantActionUse

    for minute, action in ((1, "read"), (2, "update"), (3, "read")):
        assert call(
            "repo", "repo:acme/x", at=NOW + timedelta(minutes=minute), action=action
        ).allowed
    usage_fold()
    assert call("repo", "repo:acme/x", at=NOW + timedelta(minutes=9)).allowed  # not folded
    Grant.objects.filter(pk=read_update.pk).update(unused_flagged_at=NOW)

    def uses() -> list[tuple[str, int, object]]:
        rows = GrantActionUse.objects.filter(grant=read_update).order_by("action")
        return [(r.action, r.use_count, r.last_used_at) for r in rows]

    folded = [("read", 2, NOW + timedelta(minutes=3)), ("update", 1, NOW + timedelta(minutes=2))]
    assert uses() == folded
    MigrationExecutor(connection).migrate([("governance", "0027_token_created_at_is_its_issue")])
    MigrationExecutor(connection).migrate([("governance", "0028_usage_per_action")])
    # (back_to_head applies any later migration after the test)
    assert uses() == folded
    assert Grant.objects.get(pk=read_update.pk).unused_flagged_actions == ["read", "update"]
    assert usage_fold() == 1
    assert uses()[0] == ("read", 3, NOW + timedelta(minutes=9))
