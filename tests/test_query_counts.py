"""Pages and endpoints that list an agent's live grants cost the same number of queries
however many there are. A parent agent can make 30 delegations a minute to its subagent
(one live grant each, for the parent grant's life): each was listed with a query for its
requesting agent, and the UI walked each one's delegation chain a query per link."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from governance import roles

pytestmark = pytest.mark.django_db

PAGES = [
    ("agent", "/api/v1/me"),
    ("admin", "/api/v1/agents/sub"),
    ("ui", "/ui/agents/sub/"),
    ("ui", "/ui/matrix/cell/?agent=sub&tool=repo"),
]


@pytest.fixture
def readers(agent_client, human_client) -> dict[str, Any]:
    dave = User.objects.create_user("dave", password="pw-dave-123")
    ui = Client()
    ui.force_login(dave)
    return {"admin": human_client(dave, roles.ADMINS), "ui": ui}


def test_listing_a_subagents_delegated_grants_costs_the_same_for_3_or_25(
    make_agent, make_tool, make_grant, agent_client, readers
):
    bot, repo = make_agent("bot"), make_tool("repo")
    sub = make_agent("sub", parent=bot)
    now = timezone.now()
    parent = make_grant(
        bot, repo, ("read",), "repo:acme/*", starts_at=now - timedelta(minutes=1),
        duration=timedelta(hours=2), delegable=True,
    )  # fmt: skip
    by_parent = agent_client(bot)
    clients = {"agent": agent_client(sub), **readers}

    def delegate(first: int, last: int) -> None:
        for i in range(first, last):
            body = {
                "grant": parent.pk, "agent": "sub", "actions": ["read"],
                "scope": f"repo:acme/{i}", "expires_at": (now + timedelta(hours=1)).isoformat(),
                "justification": "split work",
            }  # fmt: skip
            assert by_parent.post("/api/v1/delegations", body, format="json").status_code == 201

    def count() -> dict[str, int]:
        seen = {}
        for who, path in PAGES:
            clients[who].get(path)  # warm: sessions, rate-limit keys
            with CaptureQueriesContext(connection) as captured:
                response = clients[who].get(path)
            assert response.status_code == 200, (path, response.content[:200])
            seen[path] = len(captured.captured_queries)
        return seen

    delegate(0, 3)
    few = count()
    delegate(3, 25)
    assert count() == few


def test_the_tool_and_agent_pages_read_the_newest_events_through_an_index(make_agent, make_tool):
    """A tool's page lists its latest events that are not decisions, an agent's its
    latest decisions: with an index only on agent, and none on tool, each walked the
    whole log (a tool's few changes among millions of decisions). PostgreSQL, told not
    to scan the table or sort, must find an index that serves each (the planner would
    pick a scan for a test's few rows). SQLite cannot use a partial index for a query
    with bound parameters: there, the tool page still scans."""
    from governance.models import AuditEvent
    from governance.services.outcomes import DECISION_EVENTS

    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL (set DATABASE_URL): its plans are asserted")
    make_agent("bot")
    make_tool("repo")
    plans = {
        "audit_tool_seq_not_decisions": AuditEvent.objects.filter(tool="repo")
        .exclude(event_type__in=DECISION_EVENTS)
        .order_by("-seq")[:20],
        "audit_agent_seq": AuditEvent.objects.filter(
            agent="bot", event_type__in=DECISION_EVENTS
        ).order_by("-seq")[:25],
    }
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_sort = off")
        for index, query in plans.items():
            sql, params = query.query.sql_with_params()
            cursor.execute(f"EXPLAIN {sql}", params)
            plan = " ".join(str(row[0]) for row in cursor.fetchall())
            assert index in plan and "Sort" not in plan, (index, plan)
