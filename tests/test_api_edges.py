"""Edges of the agent-facing API and its rate limits that the mutation run of
governance/api/views.py and governance/ratelimit.py (/tmp/scratch_api) left untested:
each test fails on the mutant named in its docstring."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from governance import ratelimit
from governance.models import Approval, AuditEvent, DecisionOutcome, Grant
from tests.test_ratelimit import DOWN_URL, MID_WINDOW


def test_a_redis_outage_refuses_delegations_and_writes_nothing(
    settings, make_agent, make_tool, make_grant, agent_client
):
    """Mutant V04 (`fail_closed=False` on /delegations): with the limiter down a
    delegation went through uncounted, so a loop could mint live grants without limit
    while Redis was away. A delegation is a grant: it fails closed like a request."""
    boss = make_agent("boss")
    make_agent("helper", parent=boss)
    parent = make_grant(
        boss, make_tool("repo"), ("read",), "repo:acme/*", delegable=True,
        starts_at=timezone.now() - timedelta(minutes=1), duration=timedelta(hours=2),
    )  # fmt: skip
    client = agent_client(boss)
    settings.REDIS_URL = DOWN_URL
    before = (Grant.objects.count(), AuditEvent.objects.count())
    body = {
        "grant": parent.pk, "agent": "helper", "actions": ["read"],
        "scope": "repo:acme/docs/*", "justification": "sub-task",
        "expires_at": (timezone.now() + timedelta(hours=1)).isoformat(),
    }  # fmt: skip

    response = client.post("/api/v1/delegations", body, format="json")

    assert response.status_code == 503, response.content
    error = response.json()["error"]
    assert error["code"] == "rate_limit_unavailable" and error["message"]
    assert (Grant.objects.count(), AuditEvent.objects.count()) == before
    assert not Grant.objects.filter(delegated_from=parent).exists()


def test_a_full_in_memory_table_forgets_the_finished_windows(settings):
    """Mutant R11 (a count stored under `window + 1`): the in-process limiter kept
    every count of the window just finished past its clean-up, so the table it bounds
    at 10,000 counters grew by a whole window's tokens more than it should."""
    settings.REDIS_URL = None
    ratelimit.reset_memory()
    finished = MID_WINDOW - ratelimit.WINDOW_SECONDS
    for token in range(5_000):
        ratelimit.check("authorize", token, now=finished)
    for token in range(5_001):  # the current window: the table passes 10,000 counters
        ratelimit.check("authorize", token, now=MID_WINDOW)

    window = int(MID_WINDOW // ratelimit.WINDOW_SECONDS)
    assert len(ratelimit._memory) == 5_001
    assert {w for _, w in ratelimit._memory.values()} == {window}
    ratelimit.reset_memory()


def test_an_approval_id_that_is_not_a_uuid_is_a_404_for_every_caller(
    make_agent, agent_client, human_client, bob
):
    """Mutant V18 (the ValidationError of a malformed UUID not caught by name): an
    approval id that is not a UUID was a 500 with a traceback, for the agent polling
    it and for the approver deciding it. It names nothing: 404, as a missing one."""
    agent = agent_client(make_agent("bot"))
    approver = human_client(bob, "approvers")
    before = AuditEvent.objects.count()
    missing = agent.get("/api/v1/approvals/00000000-0000-4000-8000-000000000000").json()
    assert missing["error"]["code"] == "not_found"

    for client, method, url, body in [
        (agent, "get", "/api/v1/approvals/not-a-uuid", None),
        (approver, "get", "/api/v1/approvals/not-a-uuid", None),
        (approver, "post", "/api/v1/approvals/not-a-uuid/approve", {}),
        (approver, "post", "/api/v1/approvals/not-a-uuid/deny", {"reason": "no"}),
    ]:
        response = getattr(client, method)(url, body, format="json")
        assert (response.status_code, response.json()) == (404, missing), url

    assert AuditEvent.objects.count() == before
    assert not Approval.objects.exists()


def test_a_parent_does_not_see_the_grants_it_delegated_as_its_requests(
    make_agent, make_tool, make_grant, agent_client
):
    """Mutant V20 (an agent's requests filtered by requester alone): the grant a
    parent delegated is its subagent's, not a request of its own; /grant-requests
    listed it and answered it by id to the parent. It is the subagent's object:
    invisible to the parent there (404, as a missing one), and no request of the
    subagent's either (the subagent did not ask for it)."""
    boss = make_agent("boss")
    helper = make_agent("helper", parent=boss)
    parent = make_grant(
        boss, make_tool("repo"), ("read",), "repo:acme/*", delegable=True,
        starts_at=timezone.now() - timedelta(minutes=1), duration=timedelta(hours=2),
    )  # fmt: skip
    client = agent_client(boss)
    body = {
        "grant": parent.pk, "agent": "helper", "actions": ["read"],
        "scope": "repo:acme/docs/*", "justification": "sub-task",
        "expires_at": (timezone.now() + timedelta(hours=1)).isoformat(),
    }  # fmt: skip
    made = client.post("/api/v1/delegations", body, format="json")
    assert made.status_code == 201, made.content
    child = Grant.objects.get(delegated_from=parent)
    assert (child.agent_id, child.requested_by_agent_id) == (helper.pk, boss.pk)
    event = AuditEvent.objects.get(event_type="grant.delegated")
    assert (event.agent, event.grant_id) == ("helper", child.pk)
    helper_client = agent_client(helper)
    before = AuditEvent.objects.count()

    assert client.get("/api/v1/grant-requests").json() == []
    hidden = client.get(f"/api/v1/grant-requests/{child.pk}")
    assert (hidden.status_code, hidden.json()["error"]["code"]) == (404, "not_found")
    assert helper_client.get("/api/v1/grant-requests").json() == []

    assert AuditEvent.objects.count() == before
    assert Grant.objects.get(pk=child.pk).status == child.status


def test_handing_down_to_an_agent_not_ones_subagent_looks_like_no_such_agent(
    make_agent, make_tool, make_grant, agent_client
):
    """Mutant V31 (the subagent looked up by name alone): naming another agent's
    subagent, or any agent but one's own subagents, reached the service and came back
    403 "helper-b is not a subagent of boss", telling an agent which names exist.
    Someone else's agent answers exactly as a name nobody has, and nothing is written."""
    boss, other = make_agent("boss"), make_agent("other")
    make_agent("helper-b", parent=other)
    parent = make_grant(
        boss, make_tool("repo"), ("read",), "repo:acme/*", delegable=True,
        starts_at=timezone.now() - timedelta(minutes=1), duration=timedelta(hours=2),
    )  # fmt: skip
    client = agent_client(boss)
    body = {
        "grant": parent.pk, "actions": ["read"], "scope": "repo:acme/docs/*",
        "justification": "sub-task",
        "expires_at": (timezone.now() + timedelta(hours=1)).isoformat(),
    }  # fmt: skip
    before = (Grant.objects.count(), AuditEvent.objects.count())

    missing = client.post("/api/v1/delegations", body | {"agent": "no-such-bot"}, format="json")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    for name in ("helper-b", "other", "boss"):
        response = client.post("/api/v1/delegations", body | {"agent": name}, format="json")
        assert (response.status_code, response.json()) == (404, missing.json()), name

    assert (Grant.objects.count(), AuditEvent.objects.count()) == before
    assert not Grant.objects.filter(delegated_from=parent).exists()


def test_an_agent_lists_its_requests_newest_first(make_agent, make_tool, agent_client):
    """Mutant V23 (`order_by("id")`): the list is cut at 500, so oldest first hid
    an agent's newest requests, the ones it polls for, once it had made 500."""
    make_tool("repo")
    client = agent_client(make_agent("bot"))
    made = []
    for name in ("a", "b", "c"):
        body = {
            "tool": "repo", "actions": ["read"], "scope": f"repo:acme/{name}/*",
            "duration_seconds": 600, "justification": "read it",
        }  # fmt: skip
        response = client.post("/api/v1/grant-requests", body, format="json")
        assert response.status_code == 201, response.content
        made.append(response.json()["id"])
    assert AuditEvent.objects.filter(event_type="grant.requested").count() == 3

    listed = client.get("/api/v1/grant-requests").json()

    assert [g["id"] for g in listed] == sorted(made, reverse=True)
    assert [g["scope"] for g in listed] == ["repo:acme/c/*", "repo:acme/b/*", "repo:acme/a/*"]
    assert set(Grant.objects.values_list("status", flat=True)) == {"pending"}


def test_me_names_the_agent_its_owner_and_parent_and_only_its_own_live_grants(
    make_agent, make_tool, make_grant, agent_client, alice
):
    """Mutants V34 (`parent` read as the agent's own name) and V40 (`owner` as the
    agent's name): /me told a subagent that it was its own parent and that an agent
    owned it. It names the parent agent and the owning person; the parent's grant is
    not the subagent's; reading it writes nothing."""
    boss = make_agent("boss")
    helper = make_agent("helper", parent=boss)
    started = timezone.now() - timedelta(minutes=1)
    parent = make_grant(boss, make_tool("repo"), ("read",), "repo:acme/*", starts_at=started,
                        delegable=True, duration=timedelta(hours=2))  # fmt: skip
    boss_client, helper_client = agent_client(boss), agent_client(helper)
    body = {
        "grant": parent.pk, "agent": "helper", "actions": ["read"],
        "scope": "repo:acme/docs/*", "justification": "sub-task",
        "expires_at": (timezone.now() + timedelta(hours=1)).isoformat(),
    }  # fmt: skip
    own = boss_client.post("/api/v1/delegations", body, format="json").json()
    before = AuditEvent.objects.count()

    sub = helper_client.get("/api/v1/me")
    top = boss_client.get("/api/v1/me").json()

    assert sub.status_code == 200
    me = sub.json()
    assert (me["agent"], me["owner"], me["parent"], me["status"]) == (
        "helper", alice.username, "boss", "active")  # fmt: skip
    assert [(g["id"], g["agent"]) for g in me["grants"]] == [(own["id"], "helper")]
    assert (top["agent"], top["owner"], top["parent"]) == ("boss", alice.username, None)
    assert [g["id"] for g in top["grants"]] == [parent.pk]
    assert AuditEvent.objects.count() == before


def test_denying_an_approval_needs_a_reason(make_agent, make_tool, make_grant, agent_client,
                                            human_client, bob):  # fmt: skip
    """Mutant V37 (the approve body's schema for both): an approval was denied with no
    reason at all. A denial says why: 400 naming `reason`, the approval still pending,
    no approval.denied event; approving needs none."""
    bot = make_agent("bot")
    make_grant(bot, make_tool("repo"), ("delete",), "repo:acme/*",
               starts_at=timezone.now() - timedelta(minutes=1))  # fmt: skip
    asked = (
        agent_client(bot)
        .post(
            "/api/v1/authorize",
            {"tool": "repo", "action": "delete", "scope": "repo:acme/x"},
            format="json",
        )
        .json()
    )
    assert asked["decision"] == "approval_required"
    approver = human_client(bob, "approvers")
    url = f"/api/v1/approvals/{asked['approval']}"

    refused = approver.post(f"{url}/deny", {}, format="json")

    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert error["code"] == "invalid_request" and set(error["fields"]) == {"reason"}
    assert Approval.objects.get(pk=asked["approval"]).status == "pending"
    assert not AuditEvent.objects.filter(event_type="approval.denied").exists()
    assert approver.post(f"{url}/approve", {}, format="json").status_code == 200
    assert Approval.objects.get(pk=asked["approval"]).status == "approved"
    assert AuditEvent.objects.filter(event_type="approval.approved").count() == 1


def test_an_outcome_answer_names_the_outcome_event_not_the_decision(
    make_agent, make_tool, make_grant, agent_client
):
    """Mutant V48 (`event_id` echoing the decision's id): the answer pointed at the
    decision's event, so an agent keeping it as the receipt of its report kept the
    wrong one. It is the access.outcome event just written, which names the decision."""
    bot = make_agent("bot")
    make_grant(bot, make_tool("repo"), ("read",), "repo:acme/*",
               starts_at=timezone.now() - timedelta(minutes=1))  # fmt: skip
    client = agent_client(bot)
    asked = client.post(
        "/api/v1/authorize", {"tool": "repo", "action": "read", "scope": "repo:acme/x"},
        format="json",
    ).json()  # fmt: skip
    assert asked["decision"] == "allow"

    response = client.post(
        f"/api/v1/decisions/{asked['decision_id']}/outcome", {"outcome": "failed"}, format="json"
    )

    assert response.status_code == 201, response.content
    body = response.json()
    event = AuditEvent.objects.get(event_type="access.outcome")
    assert body == {"decision_id": asked["decision_id"], "outcome": "failed",
                    "event_id": str(event.uid)}  # fmt: skip
    assert body["event_id"] != asked["decision_id"]
    assert asked["decision_id"] in event.data
    assert DecisionOutcome.objects.get(decision_id=asked["decision_id"]).outcome == "failed"
