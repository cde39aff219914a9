"""The break-glass and review endpoints: who may call them (an agent's token never opens
break-glass), clear 4xx errors with codes, no partial writes, and the audit events."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.utils import timezone

from governance import roles
from governance.audit import Actor
from governance.codes import EventType
from governance.models import AuditEvent, BreakGlass, Grant, ReviewItem
from governance.services import grants, reviews

BODY = {
    "agent": "bot",
    "tool": "repo",
    "actions": ["read"],
    "scope": "repo:acme/api/*",
    "ticket": "INC-1",
    "reason": "outage",
}


@pytest.fixture
def world(make_agent, make_tool, settings):
    settings.BREAKGLASS_OPENS_CAMPAIGN = False
    return make_agent("bot"), make_tool("repo")


def test_an_agents_token_never_opens_break_glass(world, agent_client):
    agent, _ = world
    response = agent_client(agent).post("/api/v1/breakglass", BODY, format="json")
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "permission_denied" and "never by an agent" in error["message"]
    assert BreakGlass.objects.count() == 0 and Grant.objects.count() == 0
    assert not AuditEvent.objects.filter(event_type=EventType.BREAKGLASS_OPENED).exists()


@pytest.mark.parametrize(
    ("who", "roles", "expected", "code"),
    [
        ("approver", ("approvers",), 201, None),
        ("admin", ("admins",), 201, None),
        ("owner", (), 201, None),  # alice owns the agent
        # Someone else's agent is a name nobody has, to a person with no role.
        ("stranger", (), 400, "unknown_agent"),
        ("auditor", ("auditors",), 403, "auditor_read_only"),
        # Auditors are read-only even for an agent they own.
        ("owner", ("auditors",), 403, "auditor_read_only"),
    ],
)
def test_who_may_open_break_glass(world, human_client, person, alice, who, roles, expected, code):
    user = alice if who == "owner" else person(who)
    response = human_client(user, *roles).post("/api/v1/breakglass", BODY, format="json")
    assert response.status_code == expected, response.json()
    if code:
        assert response.json()["error"]["code"] == code
        assert BreakGlass.objects.count() == 0
        return
    body = response.json()
    assert body["grant"]["status"] == "active" and body["opened_by"] == user.username
    (event,) = AuditEvent.objects.filter(event_type=EventType.BREAKGLASS_OPENED)
    assert event.break_glass and event.actor == f"user:{user.username}"


@pytest.mark.parametrize(
    ("change", "status", "code"),
    [
        ({"ticket": "whatever"}, 400, "invalid_ticket"),
        ({"ttl_minutes": 241}, 400, "breakglass_ttl_too_long"),
        ({"ttl_minutes": "60"}, 400, "invalid_request"),
        ({"agent": "nobody"}, 400, "unknown_agent"),
        ({"scope": "repo:acme/../x"}, 400, "invalid_grant"),
        ({"reason": "   "}, 400, "invalid_request"),
        ({"extra": 1}, 400, "invalid_request"),
    ],
)
def test_bad_break_glass_input_is_a_clear_4xx_and_writes_nothing(
    world, human_client, person, change, status, code
):
    client = human_client(person("erin"), "approvers")
    response = client.post("/api/v1/breakglass", {**BODY, **change}, format="json")
    assert response.status_code == status, response.json()
    assert response.json()["error"]["code"] == code
    assert BreakGlass.objects.count() == 0 and Grant.objects.count() == 0


def test_break_glass_over_the_api_never_outlives_the_longest_grant(
    world, human_client, person, settings
):
    """GRANT_MAX_TTL_HOURS=1 under the break-glass defaults: a 4 h break-glass was a 201,
    and its ratification (no duration over the API) could never be filed. Now past
    the longest grant it is a 400 that writes nothing, and one opened before the
    maximum was lowered is ratified into a request for that maximum."""
    erin = human_client(person("erin"), "approvers")
    frank = human_client(person("frank"), "approvers")
    long_ago = erin.post("/api/v1/breakglass", {**BODY, "ttl_minutes": 240}, format="json")
    assert long_ago.status_code == 201, long_ago.json()
    settings.GRANT_MAX_TTL = timedelta(hours=1)
    before = (BreakGlass.objects.count(), Grant.objects.count(), AuditEvent.objects.count())
    refused = erin.post(
        "/api/v1/breakglass",
        {**BODY, "ticket": "INC-2", "ttl_minutes": 240},
        format="json",
    )
    assert refused.status_code == 400, refused.json()
    error = refused.json()["error"]
    assert error["code"] == "breakglass_ttl_too_long" and "GRANT_MAX_TTL_HOURS" in error["message"]
    assert (BreakGlass.objects.count(), Grant.objects.count(), AuditEvent.objects.count()) == before

    bg_id = long_ago.json()["id"]
    done = frank.post(f"/api/v1/breakglass/{bg_id}/ratify", {"comment": "needed"}, format="json")
    assert done.status_code == 200, done.json()
    assert done.json()["review_status"] == "ratified"
    request = Grant.objects.get(pk=done.json()["ratified_request"])
    assert (request.status, request.requested_duration) == ("pending", timedelta(hours=1))
    assert AuditEvent.objects.filter(
        event_type=EventType.GRANT_REQUESTED, grant_id=request.pk
    ).exists()
    (ratified,) = AuditEvent.objects.filter(event_type=EventType.BREAKGLASS_RATIFIED)
    assert ratified.actor == "user:frank"


def test_the_hourly_limit_is_a_429(world, make_tool, human_client, person, settings):
    settings.BREAKGLASS_MAX_PER_HOUR = 1
    make_tool("deploy")  # one live break-glass per agent and tool: the second is elsewhere
    client = human_client(person("erin"), "approvers")
    assert client.post("/api/v1/breakglass", BODY, format="json").status_code == 201
    second = client.post(
        "/api/v1/breakglass", {**BODY, "tool": "deploy", "ticket": "INC-2"}, format="json"
    )
    assert second.status_code == 429
    assert second.json()["error"]["code"] == "breakglass_rate_limited"
    assert 3500 <= int(second.headers["Retry-After"]) <= 3600


def test_a_live_break_glass_repeated_over_the_api(world, human_client, person):
    """Its opener's exact repeat is the live one again (201, the same id, nothing new);
    another person's exact repeat is a 409 breakglass_active that writes nothing."""
    erin, frank = (
        human_client(person("erin"), "approvers"),
        human_client(person("frank"), "approvers"),
    )
    opened = erin.post("/api/v1/breakglass", BODY, format="json")
    assert opened.status_code == 201
    before = (BreakGlass.objects.count(), Grant.objects.count(), AuditEvent.objects.count())
    refused = frank.post("/api/v1/breakglass", BODY, format="json")
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "breakglass_active" and "INC-1" in error["message"]
    again = erin.post("/api/v1/breakglass", BODY, format="json")
    assert again.status_code == 201
    assert again.json()["id"] == opened.json()["id"] and again.json()["opened_by"] == "erin"
    assert (BreakGlass.objects.count(), Grant.objects.count(), AuditEvent.objects.count()) == before
    (event,) = AuditEvent.objects.filter(event_type=EventType.BREAKGLASS_OPENED)
    assert event.actor == "user:erin"


def test_break_glass_review_over_the_api(world, human_client, person, agent_client):
    erin, frank = person("erin"), person("frank")
    opened = human_client(erin, "approvers").post("/api/v1/breakglass", BODY, format="json")
    bg_id = opened.json()["id"]
    url = f"/api/v1/breakglass/{bg_id}/ratify"
    own = human_client(erin).post(url, {"comment": "mine"}, format="json")
    assert (own.status_code, own.json()["error"]["code"]) == (403, "self_review")
    assert agent_client(world[0]).post(url, {"comment": "x"}, format="json").status_code == 403
    frank_client = human_client(frank, "approvers")
    done = frank_client.post(url, {"comment": "needed"}, format="json")
    assert done.status_code == 200 and done.json()["review_status"] == "ratified"
    assert done.json()["ratified_request"] is not None
    again = frank_client.post(
        f"/api/v1/breakglass/{bg_id}/confirm-closed", {"comment": "x"}, format="json"
    )
    assert (again.status_code, again.json()["error"]["code"]) == (409, "already_reviewed")
    assert AuditEvent.objects.filter(event_type=EventType.BREAKGLASS_RATIFIED).count() == 1
    missing = frank_client.post("/api/v1/breakglass/999999/close", {"comment": "x"}, format="json")
    assert missing.status_code == 404


def test_a_review_item_is_decided_over_the_api(world, make_grant, human_client, person):
    agent, tool = world
    grant = make_grant(agent, tool, actions=("read", "update"), starts_at=timezone.now())
    erin = person("erin", "approvers")
    campaign = reviews.review_campaign_open(
        kind="on_demand", reason="api", actor=Actor.system("test"), at=timezone.now()
    )
    item = campaign.items.get()
    assert item.reviewer == erin
    client = human_client(erin)
    url = f"/api/v1/reviews/items/{item.pk}/decide"
    wider = client.post(
        url, {"decision": "narrow", "comment": "x", "scope": "repo:*"}, format="json"
    )
    assert wider.status_code in (400, 403) and "error" in wider.json()
    before = AuditEvent.objects.count()
    ignored = {"decision": "keep", "comment": "fine", "scope": "repo:acme/docs/*"}
    refused = client.post(url, ignored, format="json")
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_decision")
    assert ReviewItem.objects.get(pk=item.pk).status == "pending"
    assert AuditEvent.objects.count() == before
    response = client.post(
        url,
        {"decision": "narrow", "comment": "read is enough", "actions": ["read"]},
        format="json",
    )
    assert response.status_code == 200, response.json()
    assert response.json()["status"] == "narrowed"
    assert Grant.objects.get(pk=grant.pk).actions == ["read"]
    assert ReviewItem.objects.get(pk=item.pk).decided_by == erin
    assert AuditEvent.objects.filter(event_type=EventType.GRANT_NARROWED).count() == 1
    again = client.post(url, {"decision": "keep", "comment": "x"}, format="json")
    assert (again.status_code, again.json()["error"]["code"]) == (409, "already_decided")
    assert grant.expires_at - timezone.now() < timedelta(hours=2)


def test_a_review_switches_delegation_off_over_the_api_and_never_on(
    world, make_agent, make_grant, human_client, person
):
    """`delegable: false` in a narrow stops the agent handing the grant on and revokes
    what it handed down; `true` on a grant that is not delegable is 403, nothing written."""
    agent, tool = world
    sub = make_agent("sub", parent=agent)
    now = timezone.now()
    grant = make_grant(agent, tool, scope="repo:acme/*", starts_at=now, delegable=True)
    plain = make_grant(agent, tool, scope="repo:other/*", starts_at=now)
    child = grants.grant_delegate(
        parent_grant_id=grant.pk, child=sub, actions=["read"], scope="repo:acme/api/*",
        expires_at=grant.expires_at, justification="sub-task", actor=Actor.system("t"), at=now,
    )  # fmt: skip
    erin = person("erin", "approvers")
    campaign = reviews.review_campaign_open(
        kind="on_demand", reason="api", actor=Actor.system("test"), at=timezone.now()
    )
    client = human_client(erin)
    url = "/api/v1/reviews/items/{}/decide"
    on = campaign.items.get(grant=plain)
    before = AuditEvent.objects.count()
    for body, status, code in (
        ({"delegable": True}, 403, "wider_delegation"),
        ({"delegable": "no"}, 400, "invalid_request"),
    ):
        wider = client.post(
            url.format(on.pk), {"decision": "narrow", "comment": "x", **body}, format="json"
        )
        assert (wider.status_code, wider.json()["error"]["code"]) == (status, code)
    assert Grant.objects.get(pk=plain.pk).delegable is False
    assert ReviewItem.objects.get(pk=on.pk).status == "pending"
    assert AuditEvent.objects.count() == before

    item = campaign.items.get(grant=grant)
    response = client.post(
        url.format(item.pk),
        {"decision": "narrow", "comment": "no subagents", "delegable": False},
        format="json",
    )
    assert response.status_code == 200, response.json()
    assert (response.json()["status"], response.json()["grant"]["delegable"]) == (
        "narrowed", False,
    )  # fmt: skip
    assert Grant.objects.get(pk=grant.pk).delegable is False
    assert (Grant.objects.get(pk=child.pk).status, ReviewItem.objects.get(pk=item.pk).status) == (
        "revoked", "narrowed",
    )  # fmt: skip
    events = list(AuditEvent.objects.filter(seq__gt=0).order_by("-seq")[:3])[::-1]
    assert [(e.event_type, e.grant_id, e.actor) for e in events] == [
        (EventType.GRANT_REVOKED, child.pk, "user:erin"),
        (EventType.GRANT_NARROWED, grant.pk, "user:erin"),
        (EventType.REVIEW_ITEM_DECIDED, grant.pk, "user:erin"),
    ]


def test_the_owner_who_opened_break_glass_closes_it_early(world, human_client, alice, person):
    """alice may open (the agent's owner) but got 403 closing it: close needed IsApprover.
    A person with no role who did not open it is told of no such break-glass, exactly as
    for an id that does not exist (a 403 confirmed that this one does)."""
    client = human_client(alice)
    opened = client.post("/api/v1/breakglass", BODY, format="json")
    assert opened.status_code == 201, opened.json()
    pk = opened.json()["id"]
    mallory = human_client(person("mallory"))
    before = AuditEvent.objects.count()
    stranger = mallory.post(f"/api/v1/breakglass/{pk}/close", {"comment": "x"}, format="json")
    missing = mallory.post(f"/api/v1/breakglass/{pk + 1000}/close", {"comment": "x"}, format="json")
    assert stranger.status_code == missing.status_code == 404
    assert stranger.json() == missing.json()
    assert stranger.json()["error"]["code"] == "not_found"
    assert BreakGlass.objects.get(pk=pk).closed_at is None
    assert AuditEvent.objects.count() == before
    closed = client.post(f"/api/v1/breakglass/{pk}/close", {"comment": "fixed"}, format="json")
    assert closed.status_code == 200, closed.json()
    bg = BreakGlass.objects.get(pk=pk)
    assert bg.closed_by == alice and bg.grant.status == "revoked"
    revoked = AuditEvent.objects.get(event_type=EventType.GRANT_REVOKED, grant_id=bg.grant_id)
    assert revoked.actor.endswith("alice") and revoked.break_glass
    # Reviewing stays with approvers.
    ratify = client.post(f"/api/v1/breakglass/{pk}/ratify", {"comment": "ok"}, format="json")
    assert ratify.status_code == 403


def test_an_opener_made_an_auditor_since_cannot_close_break_glass(world, human_client, alice):
    """Auditors are read-only, even for a break-glass they opened as the agent's owner."""
    client = human_client(alice)
    opened = client.post("/api/v1/breakglass", BODY, format="json")
    assert opened.status_code == 201, opened.json()
    pk = opened.json()["id"]
    alice.groups.add(Group.objects.get_or_create(name=roles.AUDITORS)[0])
    before = AuditEvent.objects.count()
    closed = client.post(f"/api/v1/breakglass/{pk}/close", {"comment": "x"}, format="json")
    assert closed.status_code == 403, closed.json()
    assert closed.json()["error"]["code"] == "auditor_read_only"
    bg = BreakGlass.objects.get(pk=pk)
    assert bg.closed_at is None and bg.grant.status == Grant.Status.ACTIVE
    assert AuditEvent.objects.count() == before


def test_break_glass_conflicts_and_the_hourly_limit_answer_with_codes(
    world, make_tool, human_client, approvers, settings
):
    settings.BREAKGLASS_MAX_PER_HOUR = 1
    client = human_client(approvers[0])
    assert client.post("/api/v1/breakglass", BODY, format="json").status_code == 201
    busy = human_client(approvers[1]).post(
        "/api/v1/breakglass", {**BODY, "ticket": "INC-2"}, format="json"
    )
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "breakglass_active"
    assert "INC-1" in busy.json()["error"]["message"]
    make_tool("deploy")
    limited = client.post(
        "/api/v1/breakglass", {**BODY, "tool": "deploy", "ticket": "INC-3"}, format="json"
    )
    assert limited.status_code == 429
    assert limited.json()["error"]["code"] == "breakglass_rate_limited"
    assert 3500 <= int(limited.headers["Retry-After"]) <= 3600
    assert BreakGlass.objects.count() == 1
    assert AuditEvent.objects.filter(event_type=EventType.BREAKGLASS_OPENED).count() == 1
