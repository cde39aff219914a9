"""Per-token rate limits against the real Redis (db 15), and what an outage does.

Every test counts under its own key prefix and deletes only those keys, so
test runs that share the Redis never share counts.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.utils import timezone

from governance import ratelimit
from governance.models import Approval, AuditEvent, Grant

REDIS_URL = "redis://127.0.0.1:6379/15"
DOWN_URL = "redis://127.0.0.1:1/0"  # a closed local port: connection refused
MID_WINDOW = 1_800_000_000.0 + 30  # 30 s into a window: no boundary during a test
AUTHORIZE = "/api/v1/authorize"
READ = {"tool": "repo", "action": "read", "scope": "repo:acme/x"}


@pytest.fixture
def redis_db() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    yield client
    client.close()


@pytest.fixture
def limits(settings: Any, redis_db: redis.Redis) -> Iterator[dict[str, Any]]:
    """Count in Redis db 15 under a prefix of this test's own; delete its keys after."""
    prefix = f"rl-test-{uuid.uuid4().hex}"
    settings.REDIS_URL = REDIS_URL
    settings.RATE_LIMIT_KEY_PREFIX = prefix
    settings.RATE_LIMITS = {"authorize": 1000, "grant_request": 1000, "approval": 1000}
    yield {"prefix": prefix, "settings": settings}
    keys = list(redis_db.scan_iter(match=f"{prefix}:*"))
    if keys:
        redis_db.delete(*keys)


def counted(redis_db: redis.Redis, prefix: str, bucket: str) -> dict[str, int]:
    return {
        key.decode(): int(redis_db.get(key) or 0)
        for key in redis_db.scan_iter(match=f"{prefix}:{bucket}:*")
    }


@pytest.fixture
def world(make_agent, make_tool, make_grant, agent_client, human_client, bob) -> dict[str, Any]:
    bot = make_agent("bot")
    stranger = make_agent("stranger")
    repo = make_tool("repo")
    make_grant(
        bot,
        repo,
        ("read", "delete"),
        "repo:acme/*",
        starts_at=timezone.now() - timedelta(minutes=1),
    )
    return {
        "bot": agent_client(bot),
        "bot_again": agent_client(bot),  # a second token of the same agent
        "stranger": agent_client(stranger),
        "approver": human_client(bob, "approvers"),
    }


def assert_429(response: Any) -> int:
    assert response.status_code == 429, response.content
    retry_after = int(response["Retry-After"])
    assert 1 <= retry_after <= ratelimit.WINDOW_SECONDS
    assert response.json() == {
        "error": {
            "code": "rate_limited",
            "message": f"Too many requests; retry in {retry_after} s.",
            "fields": {},
        }
    }
    return retry_after


def grant_request(client: Any, scope: str = "repo:acme/docs/*") -> Any:
    body = {
        "tool": "repo",
        "actions": ["read"],
        "scope": scope,
        "duration_seconds": 600,
        "justification": "read the docs",
    }
    return client.post("/api/v1/grant-requests", body, format="json")


def pending_approval(world: dict[str, Any], scope: str) -> str:
    response = world["bot"].post(
        AUTHORIZE, {**READ, "action": "delete", "scope": scope}, format="json"
    )
    assert response.json()["decision"] == "approval_required"
    return response.json()["approval"]


# --- Limits per token ---------------------------------------------------------------------


def test_authorize_is_limited_per_token(world, limits, redis_db):
    limits["settings"].RATE_LIMITS = {**limits["settings"].RATE_LIMITS, "authorize": 3}
    for _ in range(3):
        assert world["bot"].post(AUTHORIZE, READ, format="json").json()["decision"] == "allow"
    decisions = AuditEvent.objects.filter(event_type__startswith="access.").count()

    assert_429(world["bot"].post(AUTHORIZE, READ, format="json"))

    assert AuditEvent.objects.filter(event_type__startswith="access.").count() == decisions
    # The count is the token's, not the agent's or everyone's.
    assert world["bot_again"].post(AUTHORIZE, READ, format="json").status_code == 200
    assert world["stranger"].post(AUTHORIZE, READ, format="json").json()["reason"] == "no_grant"
    assert sorted(counted(redis_db, limits["prefix"], "authorize").values()) == [1, 1, 4]


def test_grant_requests_are_limited_per_token(world, limits, redis_db):
    limits["settings"].RATE_LIMITS = {**limits["settings"].RATE_LIMITS, "grant_request": 2}
    assert grant_request(world["stranger"], "repo:acme/a/*").status_code == 201
    assert grant_request(world["stranger"], "repo:acme/b/*").status_code == 201

    assert_429(grant_request(world["stranger"], "repo:acme/c/*"))

    assert set(Grant.objects.filter(status="pending").values_list("scope", flat=True)) == {
        "repo:acme/a/*",
        "repo:acme/b/*",
    }
    assert grant_request(world["bot"], "repo:acme/c/*").status_code == 201
    assert list(counted(redis_db, limits["prefix"], "grant_request").values()).count(3) == 1


def test_delegations_count_with_the_tokens_grant_requests(
    limits, redis_db, make_agent, make_tool, make_grant, agent_client
):
    """Each delegation is a live grant: a loop must not mint thousands of them."""
    boss = make_agent("boss")
    make_agent("helper", parent=boss)
    grant = make_grant(
        boss, make_tool("repo"), ("read",), "repo:acme/*", delegable=True,
        starts_at=timezone.now() - timedelta(minutes=1), duration=timedelta(hours=2),
    )  # fmt: skip
    limits["settings"].RATE_LIMITS = {**limits["settings"].RATE_LIMITS, "grant_request": 2}
    client = agent_client(boss)

    def delegate(scope: str) -> Any:
        body = {
            "grant": grant.pk, "agent": "helper", "actions": ["read"], "scope": scope,
            "expires_at": (timezone.now() + timedelta(hours=1)).isoformat(),
            "justification": "sub-task",
        }  # fmt: skip
        return client.post("/api/v1/delegations", body, format="json")

    assert [delegate(f"repo:acme/r{i}/*").status_code for i in range(2)] == [201, 201]
    assert_429(delegate("repo:acme/r9/*"))
    assert Grant.objects.filter(delegated_from=grant).count() == 2
    assert AuditEvent.objects.filter(event_type="grant.delegated").count() == 2


def test_approval_decisions_are_limited_per_token(world, limits):
    limits["settings"].RATE_LIMITS = {**limits["settings"].RATE_LIMITS, "approval": 2}
    first, second = pending_approval(world, "repo:acme/1"), pending_approval(world, "repo:acme/2")
    requested = grant_request(world["stranger"]).json()["id"]
    approver = world["approver"]

    assert approver.post(f"/api/v1/approvals/{first}/approve", format="json").status_code == 200
    grant_url = f"/api/v1/grant-requests/{requested}/approve"
    assert approver.post(grant_url, format="json").status_code == 200
    assert_429(approver.post(f"/api/v1/approvals/{second}/deny", {"reason": "no"}, format="json"))

    assert Approval.objects.get(pk=second).status == "pending"
    assert not AuditEvent.objects.filter(event_type="approval.denied").exists()


def test_retry_after_is_the_time_left_in_the_window(limits):
    limits["settings"].RATE_LIMITS = {**limits["settings"].RATE_LIMITS, "approval": 1}
    window_start = MID_WINDOW - 30
    ratelimit.check("approval", 7, now=window_start + 44.2)
    with pytest.raises(ratelimit.RateLimited) as caught:
        ratelimit.check("approval", 7, now=window_start + 44.2)
    assert caught.value.retry_after == 16
    ratelimit.check("approval", 7, now=window_start + 60)  # a new window counts from zero


def test_the_in_memory_limiter_has_the_same_rules(settings):
    settings.REDIS_URL = None
    settings.RATE_LIMITS = {"authorize": 2, "grant_request": 2, "approval": 2}
    ratelimit.check("approval", 1, now=MID_WINDOW)
    ratelimit.check("approval", 1, now=MID_WINDOW)
    ratelimit.check("approval", 2, now=MID_WINDOW)
    with pytest.raises(ratelimit.RateLimited) as caught:
        ratelimit.check("approval", 1, now=MID_WINDOW)
    assert caught.value.retry_after == 30
    ratelimit.check("approval", 1, now=MID_WINDOW + 30)


# --- Atomic under concurrency -------------------------------------------------------------


def hammer(threads: int, per_thread: int, token_id: int) -> tuple[int, int]:
    """Call check() from many threads released at once; (allowed, limited)."""
    start = threading.Barrier(threads)
    results: list[str] = []
    results_lock = threading.Lock()

    def work() -> None:
        start.wait()
        for _ in range(per_thread):
            try:
                ratelimit.check("grant_request", token_id, now=MID_WINDOW)
                outcome = "ok"
            except ratelimit.RateLimited:
                outcome = "limited"
            except Exception as exc:  # anything else is a failure of the test
                outcome = repr(exc)
            with results_lock:
                results.append(outcome)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert len(results) == threads * per_thread
    assert set(results) <= {"ok", "limited"}, set(results)
    return results.count("ok"), results.count("limited")


@pytest.mark.parametrize("attempt", [1, 2])
def test_exactly_the_limit_gets_through_under_concurrency(limits, redis_db, attempt):
    limits["settings"].RATE_LIMITS = {**limits["settings"].RATE_LIMITS, "grant_request": 37}

    assert hammer(threads=8, per_thread=25, token_id=attempt) == (37, 200 - 37)

    (count,) = counted(redis_db, limits["prefix"], "grant_request").values()
    assert count == 200
    (key,) = counted(redis_db, limits["prefix"], "grant_request")
    assert 0 < redis_db.ttl(key) <= ratelimit.WINDOW_SECONDS


def test_exactly_the_limit_gets_through_in_memory_too(settings):
    settings.REDIS_URL = None
    settings.RATE_LIMITS = {"authorize": 1, "grant_request": 37, "approval": 1}
    assert hammer(threads=8, per_thread=25, token_id=1) == (37, 163)


# --- Redis unreachable --------------------------------------------------------------------


def test_a_redis_outage_refuses_grant_requests_and_writes_nothing(world, settings):
    settings.REDIS_URL = DOWN_URL
    before = (Grant.objects.count(), AuditEvent.objects.count())

    response = grant_request(world["stranger"])

    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "rate_limit_unavailable" and error["message"]
    assert (Grant.objects.count(), AuditEvent.objects.count()) == before


def test_a_redis_outage_refuses_approval_decisions_and_writes_nothing(world, settings):
    approval = pending_approval(world, "repo:acme/old.py")
    requested = grant_request(world["stranger"]).json()["id"]
    settings.REDIS_URL = DOWN_URL
    before = AuditEvent.objects.count()

    for url, body in [
        (f"/api/v1/approvals/{approval}/approve", {}),
        (f"/api/v1/approvals/{approval}/deny", {"reason": "no"}),
        (f"/api/v1/grant-requests/{requested}/approve", {}),
        (f"/api/v1/grant-requests/{requested}/deny", {"reason": "no"}),
    ]:
        response = world["approver"].post(url, body, format="json")
        assert response.status_code == 503, url
        assert response.json()["error"]["code"] == "rate_limit_unavailable"

    assert Approval.objects.get(pk=approval).status == "pending"
    assert Grant.objects.get(pk=requested).status == "pending"
    assert AuditEvent.objects.count() == before


QUESTIONS = [
    ("bot", READ),  # allow
    ("bot", {**READ, "scope": "repo:other/x"}),  # scope_mismatch
    ("bot", {**READ, "action": "update"}),  # no_grant
    ("bot", {**READ, "action": "delete"}),  # approval_required
    ("bot", {**READ, "tool": "nope"}),  # unknown_tool
    ("stranger", READ),  # no_grant
]


def ask_all(world: dict[str, Any]) -> list[tuple[int, str, str]]:
    answers = []
    for who, question in QUESTIONS:
        response = world[who].post(AUTHORIZE, question, format="json")
        answers.append(
            (response.status_code, response.json()["decision"], response.json()["reason"])
        )
    return answers


def test_a_redis_outage_changes_no_decision(world, settings, limits):
    with_redis = ask_all(world)
    assert [d for _, d, _ in with_redis].count("allow") == 1

    settings.REDIS_URL = DOWN_URL
    events = AuditEvent.objects.count()
    without_redis = ask_all(world)

    assert without_redis == with_redis
    # Each decision is still on the record.
    assert AuditEvent.objects.count() == events + len(QUESTIONS)


def test_a_silent_redis_is_given_up_on_quickly(world, settings, monkeypatch):
    """A Redis that accepts and never answers costs one timeout, not one per request."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    monkeypatch.setattr(ratelimit, "DOWN_BACKOFF_SECONDS", 60.0)
    settings.REDIS_URL = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    try:
        assert grant_request(world["stranger"]).status_code == 503
        assert world["bot"].post(AUTHORIZE, READ, format="json").json()["decision"] == "allow"
        assert grant_request(world["bot"]).status_code == 503
        assert world["stranger"].post(AUTHORIZE, READ, format="json").json()["decision"] == "deny"
    finally:
        stop.set()
        acceptor.join()
        for conn in accepted:
            conn.close()
        listener.close()
    assert len(accepted) == 1


def test_a_flushed_script_cache_is_reloaded_and_counted_once(limits, redis_db):
    """A restarted (or SCRIPT FLUSHed) Redis has forgotten the counting script."""
    ratelimit.check("authorize", 7, now=MID_WINDOW)
    redis_db.script_flush()
    ratelimit.check("authorize", 7, now=MID_WINDOW)
    assert list(counted(redis_db, limits["prefix"], "authorize").values()) == [2]


def test_a_connection_the_server_closed_is_replaced(limits, redis_db):
    """Redis closed the limiter's idle connection (restart, timeout, CLIENT KILL):
    the next request counts on a new one instead of failing."""
    ratelimit.check("authorize", 8, now=MID_WINDOW)
    killed = redis_db.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1
    ratelimit.check("authorize", 8, now=MID_WINDOW)
    assert list(counted(redis_db, limits["prefix"], "authorize").values()) == [2]
