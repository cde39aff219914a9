"""Edges of the per-token rate limits that the mutation run of governance/ratelimit.py
left untested (/tmp/scratch_revmut): each test fails on the mutant named in its
docstring. Requests go through the real API; what was refused wrote nothing."""

from __future__ import annotations

import time

from governance import ratelimit
from governance.models import AuditEvent, Grant
from tests.test_ratelimit import grant_request


def wait_for_a_fresh_window(margin: float = 15.0) -> float:
    """Start well inside a window: a boundary during the test would reset the count."""
    left = ratelimit.WINDOW_SECONDS - time.time() % ratelimit.WINDOW_SECONDS
    if left < margin:
        time.sleep(left + 0.05)
    return time.time()


def test_a_full_in_memory_table_forgets_finished_windows_not_the_current_count(
    settings, make_agent, make_tool, agent_client
):
    """Mutant L14 (`w <= window`): past 10,000 counters the in-process limiter forgot
    the current window's counts too, so a token at its limit started from zero again
    after a burst of other tokens' requests."""
    settings.REDIS_URL = None
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "grant_request": 2}
    make_tool("repo")
    client = agent_client(make_agent("bot"))
    now = wait_for_a_fresh_window()
    ratelimit.check("grant_request", 10**9, now=now - ratelimit.WINDOW_SECONDS)  # finished
    assert grant_request(client, "repo:acme/a/*").status_code == 201
    assert grant_request(client, "repo:acme/b/*").status_code == 201
    for other in range(10_001):  # other tokens in this window: the table overflows
        ratelimit.check("grant_request", 10**9 + 1 + other, now=now)
    before = (Grant.objects.count(), AuditEvent.objects.count())

    refused = grant_request(client, "repo:acme/c/*")

    assert refused.status_code == 429, refused.content
    assert 1 <= int(refused["Retry-After"]) <= ratelimit.WINDOW_SECONDS
    assert refused.json()["error"]["code"] == "rate_limited"
    assert (Grant.objects.count(), AuditEvent.objects.count()) == before
    assert set(Grant.objects.values_list("scope", flat=True)) == {"repo:acme/a/*", "repo:acme/b/*"}


def test_a_limited_decision_is_told_the_seconds_left_in_its_window(
    settings, make_agent, make_tool, agent_client
):
    """Mutant V03 (`Throttled(wait=None)`): every 429 said "Retry-After: 1", so a client
    obeying it hammered the API for the rest of the window. It is the time left in
    the window, and the refused question wrote no decision."""
    settings.REDIS_URL = None
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "authorize": 1}
    make_tool("repo")
    client = agent_client(make_agent("bot"))
    question = {"tool": "repo", "action": "read", "scope": "repo:acme/x"}
    wait_for_a_fresh_window()
    first = client.post("/api/v1/authorize", question, format="json")
    assert (first.status_code, first.json()["reason"]) == (200, "no_grant")
    decisions = AuditEvent.objects.filter(event_type__startswith="access.").count()
    before = time.time()
    end = (before // ratelimit.WINDOW_SECONDS + 1) * ratelimit.WINDOW_SECONDS

    refused = client.post("/api/v1/authorize", question, format="json")

    after = time.time()
    assert refused.status_code == 429, refused.content
    retry_after = int(refused["Retry-After"])
    assert int(end - after) <= retry_after <= int(end - before) + 1
    assert retry_after > 1  # a fresh window has well over a second left
    assert refused.json()["error"] == {
        "code": "rate_limited",
        "message": f"Too many requests; retry in {retry_after} s.",
        "fields": {},
    }
    assert AuditEvent.objects.filter(event_type__startswith="access.").count() == decisions
