"""An agent's own grant requests awaiting a person are capped (GRANT_REQUEST_PENDING_MAX).

Each request notifies every approver and waits in their inbox for GRANT_REQUEST_TTL; the
rate limit alone let one token keep 129,600 of them pending (30 a minute for 72 hours),
and every inbox page walked them one by one. Past the cap a request is refused, 409
`request_backlog`, with nothing written and nobody notified."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from governance.audit import Actor
from governance.models import AuditEvent, Grant, Notification
from governance.services import grants
from tests.conftest import NOW
from tests.test_lock_order import each_in_a_thread
from tests.test_ratelimit import grant_request


def ask(client: Any, scope: str) -> Any:
    return grant_request(client, scope)


@pytest.mark.django_db
def test_an_agents_requests_past_the_cap_are_refused_and_write_nothing(
    make_agent, make_tool, agent_client, human_client, bob, alice, settings
):
    settings.GRANT_REQUEST_PENDING_MAX = 3
    bot = make_agent("bot")
    make_tool("repo")
    client = agent_client(bot)
    made = [ask(client, f"repo:acme/r{i}/*") for i in range(3)]
    assert [r.status_code for r in made] == [201, 201, 201]
    before = (Grant.objects.count(), AuditEvent.objects.count(), Notification.objects.count())

    refused = ask(client, "repo:acme/r3/*")

    assert refused.status_code == 409, refused.content
    error = refused.json()["error"]
    assert error["code"] == "request_backlog" and "3 of this agent's" in error["message"]
    after = (Grant.objects.count(), AuditEvent.objects.count(), Notification.objects.count())
    assert after == before
    # A request a person files for the agent is not the agent's own: not counted.
    by_person = grants.grant_request(
        agent=bot, tool=bot.grants.first().tool, actions=["read"], scope="repo:acme/p/*",
        duration=timedelta(minutes=10), justification="for the agent", requested_by=alice,
        actor=Actor.user(alice), at=timezone.now(),
    )  # fmt: skip
    assert by_person.status == "pending"
    # One decided, one more may wait.
    first = made[0].json()["id"]
    approver = human_client(bob, "approvers")
    denied = approver.post(f"/api/v1/grant-requests/{first}/deny", {"reason": "no"}, format="json")
    assert denied.status_code == 200
    again = ask(client, "repo:acme/r3/*")
    assert again.status_code == 201, again.content
    (event,) = AuditEvent.objects.filter(event_type="grant.requested", grant_id=again.json()["id"])
    assert event.agent == "bot"


@pytest.mark.django_db(transaction=True)
def test_requests_made_at_once_are_counted_against_each_other(
    postgres_only, make_agent, make_tool, settings
):
    settings.GRANT_REQUEST_PENDING_MAX = 3
    bot, repo = make_agent("bot"), make_tool("repo")

    def request(i: int) -> Any:
        return lambda: grants.grant_request(
            agent=bot, tool=repo, actions=["read"], scope=f"repo:acme/c{i}/*",
            duration=timedelta(minutes=10), justification="at once", requested_by_agent=bot,
            actor=Actor.agent(bot), at=NOW,
        )  # fmt: skip

    errors = each_in_a_thread(*(request(i) for i in range(8)))

    assert Grant.objects.filter(requested_by_agent=bot, status="pending").count() == 3
    assert sorted(getattr(e, "code", repr(e)) for e in errors) == ["request_backlog"] * 5
    assert AuditEvent.objects.filter(event_type="grant.requested").count() == 3
