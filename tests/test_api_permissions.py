"""Who may call what: every endpoint under /api/v1 x every kind of caller.

One table, in the manner of pretix's src/tests/api/test_permissions.py. Each
row is an endpoint called on agent A's objects; each column is a caller:

    A         agent bot-a, which owns every object in the world
    B         agent bot-b, another agent: A's objects are invisible to it (404)
    admin     dave, admin role
    approver  bob, approver role
    auditor   carol, auditor role (reads everything, changes nothing)
    user      erin, a person with a token and no role
    anon      no token

Each case runs on a fresh world, so a write by one caller never changes what
the next one sees. test_the_table_covers_every_endpoint fails when an endpoint
is added without a row.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.urls import resolve
from django.utils import timezone
from rest_framework.test import APIClient

from governance import roles
from governance.api import urls as api_urls
from governance.audit import Actor
from governance.models import (
    Agent,
    AgentToken,
    Approval,
    AuditEvent,
    DecisionOutcome,
    Grant,
    ReviewItem,
    Tool,
)
from governance.services import (
    access,
    agents,
    breakglass,
    confirmation,
    grants,
    sandbox,
    tools,
)
from sandbox_runner.spec import RunSpec
from tests.conftest import last_event

API = "/api/v1/"
CALLERS = ("A", "B", "admin", "approver", "auditor", "user", "anon")

ASK = {"tool": "repo", "action": "read", "scope": "repo:acme/x"}
# bot-b: the world's break-glass (alice's) is live for bot-a on repo, one at a time.
BREAKGLASS = {"agent": "bot-b", "tool": "repo", "actions": ["read"], "scope": "repo:bg/*",
              "ticket": "INC-2", "reason": "outage"}  # fmt: skip
REQUEST = {"agent": "bot-a", "tool": "repo", "actions": ["read"], "scope": "repo:new/*",
           "duration_seconds": 600, "justification": "needed"}  # fmt: skip


def reviewed_hash(world: dict[str, Any]) -> dict[str, Any]:
    """The body of a tool approval: the definition the approver reviewed."""
    return {"definition_hash": Tool.objects.get(name="repo").definition_hash}


def delegation(world: dict[str, Any]) -> dict[str, Any]:
    expires = timezone.now() + timedelta(minutes=10)
    return {"grant": world["grant"], "agent": "bot-a-sub", "actions": ["read"],
            "scope": "repo:acme/api/*", "expires_at": expires.isoformat(),
            "justification": "sub-task"}  # fmt: skip


POLICY = {"agent": "bot-a", "tool": "repo", "action": "delete", "scope": "repo:acme/tmp/*",
          "verdict": "approve", "reason": "scratch cleanup", "duration_seconds": 600}  # fmt: skip
SANDBOX_ASK = {"run_id": "6f1c3a2e-0d4b-4f0e-9a51-2b7c8d9e0f11", "backend": "docker",
               "image": "governance-sandbox:bookworm", "command": ["true"]}  # fmt: skip
STREAM = {"excerpt": "", "sha256": hashlib.sha256(b"").hexdigest(), "bytes": 0, "truncated": False}


IMAGE_ID = "sha256:" + "5" * 64  # what a runner resolved its image to


def sandbox_started(world: dict[str, Any]) -> dict[str, Any]:
    return {"decision_id": world["run_decision"], "container_id": "c", "image_digest": IMAGE_ID,
            "deadline": timezone.now().timestamp() + 60}  # fmt: skip


def sandbox_egress(world: dict[str, Any]) -> dict[str, Any]:
    # A refused attempt: an "allowed" one must name a destination the run's grant names.
    return {"decision_id": world["running_decision"], "reason": "not_allowlisted",
            "host": "127.0.0.1", "port": 80}  # fmt: skip


def sandbox_finished(world: dict[str, Any]) -> dict[str, Any]:
    return {"decision_id": world["running_decision"], "exit_code": 0, "timed_out": False,
            "oom_killed": False, "stdout": STREAM, "stderr": STREAM}  # fmt: skip


# Placeholders in braces are filled from the world: {decision}, {approval},
# {request} (A's pending grant request), {grant} (A's live grant), {token} (a
# spare token of A's, by prefix). 2xx, 401, 403, 404 are the whole story except
# where a note says otherwise.
# fmt: off
TABLE: list[tuple[str, str, Any, str]] = [
    # method  path                                body           A    B    admin appr aud  user anon
    ("POST",  "authorize",                        ASK,           "200 200 403 403 403 403 401"),
    ("POST",  "decisions/{decision}/outcome",     {"outcome": "succeeded"},
                                                                 "201 404 403 403 403 403 401"),
    ("GET",   "approvals/{approval}",             None,          "200 404 200 200 200 404 401"),
    ("POST",  "approvals/{approval}/approve",     {},            "403 403 200 200 403 403 401"),
    ("POST",  "approvals/{approval}/deny",        {"reason": "no"},
                                                                 "403 403 200 200 403 403 401"),
    ("GET",   "grant-requests",                   None,          "200 200 200 200 200 200 401"),
    # B naming bot-a is refused as agent_mismatch (400). People file requests
    # for agents they own; admins for any; auditors are read-only.
    # user: another person's agent is an unknown name to someone with no role (400).
    ("POST",  "grant-requests",                   REQUEST,       "201 400 201 403 403 400 401"),
    ("GET",   "grant-requests/{request}",         None,          "200 404 200 200 200 404 401"),
    ("POST",  "grant-requests/{request}/approve", {},            "403 403 200 200 403 403 401"),
    ("POST",  "grant-requests/{request}/deny",    {"reason": "no"},
                                                                 "403 403 200 200 403 403 401"),
    ("POST",  "delegations",                      delegation,    "201 404 403 403 403 403 401"),
    ("GET",   "me",                               None,          "200 200 403 403 403 403 401"),
    # Admin and automation: admins change, auditors read, nobody else.
    ("GET",   "agents",                           None,          "403 403 200 403 200 403 401"),
    ("POST",  "agents",                           {"name": "new-bot", "owner": "alice"},
                                                                 "403 403 201 403 403 403 401"),
    ("GET",   "agents/bot-a",                     None,          "403 403 200 403 200 403 401"),
    ("POST",  "agents/bot-a/suspend",             {"reason": "x"},
                                                                 "403 403 200 403 403 403 401"),
    # Resume: bot-off, suspended in the world (bot-a must stay active for the other rows).
    ("POST",  "agents/bot-off/resume",            {"reason": "x"},
                                                                 "403 403 200 403 403 403 401"),
    ("GET",   "agents/bot-a/tokens",              None,          "403 403 200 403 200 403 401"),
    ("POST",  "agents/bot-a/tokens",              {},            "403 403 201 403 403 403 401"),
    ("POST",  "tokens/{token}/revoke",            None,          "403 403 200 403 403 403 401"),
    ("GET",   "tools",                            None,          "403 403 200 403 200 403 401"),
    ("POST",  "tools",                            {"name": "new-tool", "kind": "api",
                                                   "actions": ["read"]},
                                                                 "403 403 201 403 403 403 401"),
    ("GET",   "tools/repo",                       None,          "403 403 200 403 200 403 401"),
    ("PATCH", "tools/repo",                       {"description": "changed"},
                                                                 "403 403 200 403 403 403 401"),
    ("POST",  "tools/repo/approve",               reviewed_hash, "403 403 200 403 403 403 401"),
    ("GET",   "tasks",                            None,          "403 403 200 403 200 403 401"),
    ("POST",  "tasks",                            {"key": "T-2"},"403 403 201 403 403 403 401"),
    ("GET",   "tasks/T-1",                        None,          "403 403 200 403 200 403 401"),
    ("POST",  "tasks/T-1/close",                  None,          "403 403 200 403 403 403 401"),
    ("GET",   "grants",                           None,          "403 403 200 403 200 403 401"),
    ("GET",   "grants/{grant}",                   None,          "403 403 200 403 200 403 401"),
    ("POST",  "grants/{grant}/revoke",            {"reason": "x"},
                                                                 "403 403 200 403 403 403 401"),
    ("GET",   "reports/access",                   None,          "403 403 200 403 200 403 401"),
    # Confirmation policies: approvers (admins too) write, auditors read.
    ("GET",   "confirmation-policies",            None,          "403 403 200 200 200 403 401"),
    ("POST",  "confirmation-policies",            POLICY,        "403 403 201 201 403 403 401"),
    ("POST",  "confirmation-policies/{policy}/revoke", {"reason": "x"},
                                                                 "403 403 200 200 403 403 401"),
    # The OpenAPI schema and its viewer are public.
    # Break-glass (opened by alice, the agent's owner, in the world) and reviews.
    ("POST",  "breakglass",                       BREAKGLASS,    "403 403 201 201 403 400 401"),
    # Closing early: approvers, admins and the opener (alice: tests/test_api_lifecycle.py);
    # a person who may not read break-glass records is told of none (404, not 403).
    ("POST",  "breakglass/{breakglass}/close",    {"comment": "x"},
                                                                 "403 403 200 200 403 404 401"),
    ("POST",  "breakglass/{breakglass}/ratify",   {"comment": "x"},
                                                                 "403 403 200 200 403 403 401"),
    ("POST",  "breakglass/{breakglass}/confirm-closed", {"comment": "x"},
                                                                 "403 403 200 200 403 403 401"),
    # bob (approver) approved A's grant, so only the admin may re-certify it.
    ("POST",  "reviews/items/{item}/decide",      {"decision": "keep", "comment": "x"},
                                                                 "403 403 200 403 403 403 401"),
    # The sandbox runner's HTTP adapter: agents only; {run} is A's allowed run, {running}
    # A's started one. B asking to run gets its own (denied) run recorded: 201.
    ("POST",  "sandbox/runs",                     SANDBOX_ASK,   "201 201 403 403 403 403 401"),
    ("POST",  "sandbox/runs/{run}/started",       sandbox_started,
                                                                 "200 404 403 403 403 403 401"),
    ("POST",  "sandbox/runs/{running}/egress",    sandbox_egress,
                                                                 "201 404 403 403 403 403 401"),
    ("POST",  "sandbox/runs/{running}/finished",  sandbox_finished,
                                                                 "200 404 403 403 403 403 401"),
    ("GET",   "sandbox/runs/{running}/live",      None,          "200 404 403 403 403 403 401"),
    ("GET",   "schema/",                          None,          "200 200 200 200 200 200 200"),
    ("GET",   "docs/",                            None,          "200 200 200 200 200 200 200"),
]
# fmt: on

CASES = [
    pytest.param(method, path, body, caller, int(status), id=f"{method} {path} as {caller}")
    for method, path, body, row in TABLE
    for caller, status in zip(CALLERS, row.split(), strict=True)
]


@pytest.fixture
def world(make_agent, make_tool, make_task, make_grant, alice, dave) -> dict[str, Any]:
    """A's objects: a live delegable grant, a decision, a pending approval, a
    pending grant request, a spare token. B has a live grant of its own. bot-off is
    suspended (something to resume)."""
    system, now = Actor.system("test"), timezone.now()
    bot_a, bot_b = make_agent("bot-a"), make_agent("bot-b")
    make_agent("bot-a-sub", parent=bot_a)
    make_agent("bot-b-sub", parent=bot_b)
    off = make_agent("bot-off")
    agents.agent_suspend(agent=off, reason="incident", actor=system, at=now)
    repo = make_tool("repo")
    make_task("T-1")
    started = now - timedelta(minutes=1)
    grant = make_grant(bot_a, repo, ("read", "delete"), "repo:acme/*", starts_at=started,
                       delegable=True)  # fmt: skip
    make_grant(bot_b, repo, ("read",), "repo:b/*", starts_at=started, delegable=True)
    decision = access.access_check(agent="bot-a", at=now, **ASK)
    gated = access.access_check(
        agent="bot-a", tool="repo", action="delete", scope="repo:acme/x", at=now
    )
    request = grants.grant_request(
        agent=bot_a, tool=repo, actions=["read"], scope="repo:other/*",
        duration=timedelta(hours=1), justification="more", requested_by_agent=bot_a,
        actor=Actor.agent(bot_a), at=now,
    )  # fmt: skip
    spare, _ = agents.token_issue(created_by=alice, agent=bot_a, actor=system, at=now)
    assert decision.allowed and gated.approval_id
    # Opening break-glass also opens an incident campaign with an item for A's grant.
    opened = breakglass.breakglass_open(
        opener=alice, agent=bot_a, tool=repo, actions=["read"], scope="repo:acme/bg/*",
        ticket="INC-1", reason="outage", actor=Actor.user(alice), at=now,
    )  # fmt: skip
    item = ReviewItem.objects.get(grant=grant)
    # Two sandbox runs of A's (issue #4): one allowed, one started.
    code_exec = make_tool("code-exec", actions=("execute",), kind="code_exec")
    make_grant(bot_a, code_exec, ("execute",), "sandbox:*", starts_at=started)
    spec = {"agent": "bot-a", "task": None, "command": ("true",), "image_id": IMAGE_ID}
    runs = [sandbox.run_request(spec=RunSpec(**spec), at=now) for _ in range(2)]
    assert all(run.allowed for run in runs)
    # A live confirmation policy for A's deletes under repo:acme/old/*, written by dave.
    dave.groups.add(Group.objects.get_or_create(name=roles.ADMINS)[0])
    policy = confirmation.policy_create(
        author=dave, agent=bot_a, tool=repo, action="delete", scope="repo:acme/old/*",
        verdict="deny", reason="keep old", duration=timedelta(hours=1),
        actor=Actor.user(dave), at=now,
    )  # fmt: skip
    sandbox.run_started(run_id=runs[1].run_id, container_id="c", image_digest=IMAGE_ID,
                        deadline=now.timestamp() + 60, enforcement={}, at=now)  # fmt: skip
    return {"run": runs[0].run_id, "run_decision": runs[0].decision_id,
            "running": runs[1].run_id, "running_decision": runs[1].decision_id,
            "decision": decision.decision_id, "approval": gated.approval_id,
            "request": request.pk, "grant": grant.pk, "token": spare.prefix,
            "bot_a": bot_a, "bot_b": bot_b, "breakglass": opened.pk,
            "item": item.pk, "policy": policy.pk}  # fmt: skip


@pytest.fixture
def client_for(world, agent_client, human_client, anonymous, bob, carol, dave):
    def make(caller: str) -> Any:
        if caller in ("A", "B"):
            return agent_client(world["bot_a" if caller == "A" else "bot_b"])
        people = {
            "admin": (dave, roles.ADMINS),
            "approver": (bob, roles.APPROVERS),
            "auditor": (carol, roles.AUDITORS),
            "user": (User.objects.create_user("erin", password="pw-erin-123"), None),
        }
        if caller in people:
            user, role = people[caller]
            return human_client(user, *([role] if role else []))
        return anonymous

    return make


def _call(client: Any, method: str, path: str, body: Any, world: dict[str, Any]) -> Any:
    url = API + path.format(**world)
    if callable(body):
        body = body(world)
    return getattr(client, method.lower())(url, body, format="json")


@pytest.mark.parametrize(("method", "path", "body", "caller", "status"), CASES)
def test_permission_table(client_for, world, method, path, body, caller, status):
    response = _call(client_for(caller), method, path, body, world)
    assert response.status_code == status, (response.status_code, response.content[:300])
    if status >= 400:
        assert response.json()["error"]["code"], response.content


def test_the_table_covers_every_endpoint_and_method():
    """A new endpoint, or a new method on one, needs a row before this passes."""
    served = set()
    for pattern in api_urls.urlpatterns:
        view = pattern.callback.view_class  # type: ignore[attr-defined]
        for method in ("get", "post", "put", "patch", "delete"):
            if hasattr(view, method):
                served.add((method.upper(), "api/v1/" + str(pattern.pattern)))
    fake = {"decision": "d", "approval": "a", "request": 1, "grant": 1, "token": "t"}
    fake.update(breakglass=1, item=1, run=SANDBOX_ASK["run_id"], running=SANDBOX_ASK["run_id"])
    fake.update(policy=1)
    tabled = {(m, resolve(API + p.format(**fake)).route) for m, p, _, _ in TABLE}
    assert served == tabled


# --- A token revoked while its request is on its way -------------------------------------
# The token is checked at the door; a revoke can commit after that, before the request's
# write. Every row of the table, as the first caller it lets through (2xx), with that
# caller's token revoked right after the door let it in.

# Decisions answer a revoked token with a recorded deny `token_revoked`, as for any other
# refusal (tests/test_api_authorize.py); everything else is the door's 401.
DECISIONS = ("authorize", "sandbox/runs")
# A read that records itself (`report.exported`): a write too.
RECORDED_READS = ("reports/access",)
LET_IN = [
    pytest.param(method, path, body, caller, id=f"{method} {path} as {caller}")
    for method, path, body, row in TABLE
    if path not in ("schema/", "docs/")  # public: no token is read there
    for caller in [next(c for c, st in zip(CALLERS, row.split(), strict=True) if st[0] == "2")]
]


def _something_to_change(path: str, body: Any) -> Any:
    """The row's write made to change something: the world's tool is approved as it is
    (approving it again is a no-op), and its sandbox run is asked without an image id
    (denied `image_unresolved` before any question of the token)."""
    if path == "tools/repo/approve":
        tools.tool_update_definition(
            tool=Tool.objects.get(name="repo"), description="changed", input_schema=tools.KEEP,
            updated_by=User.objects.get(username="alice"), actor=Actor.system("test"),
            at=timezone.now(),
        )  # fmt: skip
    if path == "sandbox/runs":
        return {**body, "image_id": IMAGE_ID}
    return body


def _rows() -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table the application keeps (and its people's), in order."""
    from django.apps import apps

    models = [*apps.get_app_config("governance").get_models(), User, Group, User.groups.through]
    return {m._meta.label: list(m.objects.order_by("pk").values_list()) for m in models}


@pytest.fixture
def revoked_once_let_in(monkeypatch):
    """Each request's token is revoked (committed) right after the door let it in; the
    database as it then stands is kept in the returned dict as `before`."""
    from governance.api import auth

    real, seen = auth.BearerAuthentication.authenticate, {}

    def let_in_then_revoked(self, request):
        principal, token = real(self, request)
        agents.token_revoke(token=token, actor=Actor.system("incident"), at=timezone.now())
        seen["before"], seen["seq"] = _rows(), last_event().seq
        return principal, token

    monkeypatch.setattr(auth.BearerAuthentication, "authenticate", let_in_then_revoked)
    return seen


@pytest.mark.parametrize(("method", "path", "body", "caller"), LET_IN)
def test_nothing_is_written_under_a_token_revoked_after_the_request_was_let_in(
    client_for, world, revoked_once_let_in, method, path, body, caller
):
    """Approvals, grant decisions, outcomes, the runner's reports and every admin write
    were made under a token revoked while the request was on its way, recorded after
    `agent_token.revoked`. Now each is the 401 of the door: no row changed, no event."""
    client, body = client_for(caller), _something_to_change(path, body)
    response = _call(client, method, path, body, world)
    seen = revoked_once_let_in
    assert seen, "the request was not let in"
    if path in DECISIONS:
        assert response.status_code in (200, 201), response.content[:300]
        data = response.json()
        assert (data["decision"], data["reason"]) == ("deny", "token_revoked")
        decided = AuditEvent.objects.get(uid=data["decision_id"])
        assert (decided.event_type, decided.reason) == ("access.denied", "token_revoked")
        return
    if method == "GET" and path not in RECORDED_READS:
        assert response.status_code == 200, response.content[:300]  # a read changes nothing
    else:
        assert response.status_code == 401, (response.status_code, response.content[:300])
        assert response.json()["error"]["code"] == "unauthenticated"
        assert response["WWW-Authenticate"] == 'Bearer realm="api"'
    assert last_event().seq == seen["seq"]
    assert _rows() == seen["before"]


WRITES = [case for case in LET_IN if case.values[0] != "GET" and case.values[1] not in DECISIONS]


@pytest.mark.parametrize(("method", "path", "body", "caller"), WRITES)
def test_a_write_under_a_live_token_is_made_under_its_holders_name(
    client_for, world, method, path, body, caller
):
    """The same writes with the token left alone go through, each on record as its
    caller's (the token is asked at each of its events and holds)."""
    client, body = client_for(caller), _something_to_change(path, body)
    before = last_event().seq
    response = _call(client, method, path, body, world)
    assert 200 <= response.status_code < 300, (response.status_code, response.content[:300])
    actors = set(AuditEvent.objects.filter(seq__gt=before).values_list("actor", flat=True))
    assert NAME[caller] in actors, actors


NAME = {"A": "agent:bot-a", "admin": "user:dave", "approver": "user:bob"}


# Each API GET a caller may use, as that caller (the first one the table lets in).
READS = [
    pytest.param(
        path, next(c for c, st in zip(CALLERS, row.split(), strict=True) if st == "200"), id=path
    )  # fmt: skip
    for method, path, _body, row in TABLE
    if method == "GET" and path not in ("schema/", "docs/")
]


@pytest.mark.parametrize(("path", "caller"), READS)
def test_a_parameter_an_endpoint_does_not_take_is_refused_not_ignored(
    client_for, world, path, caller
):
    """A misspelled or unsupported filter (`grant-requests?status=pending`) must not
    be answered with everything, as if it had filtered: 400, naming the parameter."""
    client = client_for(caller)
    url = API + path.format(**world)
    assert client.get(url).status_code == 200
    before = AuditEvent.objects.count()
    response = client.get(url, {"sttaus": "pending"})
    assert response.status_code == 400, (response.status_code, response.content[:300])
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and list(error["fields"]) == ["sttaus"]
    assert AuditEvent.objects.count() == before


# --- Object level: another agent's objects do not exist for B -----------------------------


@pytest.fixture
def bot_b(client_for):
    return client_for("B")


def test_b_cannot_report_the_outcome_of_as_decision(bot_b, world):
    url = f"{API}decisions/{world['decision']}/outcome"
    assert bot_b.post(url, {"outcome": "failed"}, format="json").status_code == 404
    assert not DecisionOutcome.objects.exists()


def test_b_cannot_see_as_approval_nor_use_it(bot_b, world, make_grant, bob, client_for):
    """A's approval, approved, named by B for the very call it approves: B holds a grant
    for that call too, so only the approval stands between. It looks exactly like an
    approval that does not exist (no oracle), stays A's and unused, and A still can."""
    import uuid

    from governance.services import approvals

    repo = Tool.objects.get(name="repo")
    b_grant = make_grant(world["bot_b"], repo, ("delete",), "repo:acme/*",
                         starts_at=timezone.now() - timedelta(minutes=1))  # fmt: skip
    bob.groups.add(Group.objects.get_or_create(name=roles.APPROVERS)[0])
    approvals.approval_approve(approval_id=world["approval"], approver=bob,
                               actor=Actor.user(bob), at=timezone.now())  # fmt: skip
    made_up = str(uuid.uuid4())
    before = (AuditEvent.objects.count(), Approval.objects.count())

    seen = bot_b.get(f"{API}approvals/{world['approval']}")
    missing = bot_b.get(f"{API}approvals/{made_up}")
    assert (seen.status_code, seen.json()) == (404, missing.json())
    assert seen.json()["error"]["code"] == "not_found"
    assert (AuditEvent.objects.count(), Approval.objects.count()) == before

    ask = {"tool": "repo", "action": "delete", "scope": "repo:acme/x"}
    used = bot_b.post(f"{API}authorize", {**ask, "approval": world["approval"]}, format="json")
    assert used.status_code == 200
    body = used.json()
    assert (body["decision"], body["reason"]) == ("deny", "approval_invalid")
    assert (body["grant"], body["approval"]) == (None, None)  # a grant only with an allow
    event = last_event()
    assert AuditEvent.objects.count() == before[0] + 1
    assert str(event.uid) == body["decision_id"]
    assert (event.event_type, event.agent, event.reason) == (
        "access.denied", "bot-b", "approval_invalid")  # fmt: skip
    assert (event.grant_id, event.approval_id) == (b_grant.pk, "")
    # The same answer as for an approval that does not exist.
    other = bot_b.post(f"{API}authorize", {**ask, "approval": made_up}, format="json").json()
    assert {k: other[k] for k in ("decision", "reason", "message", "grant", "approval")} == {
        k: body[k] for k in ("decision", "reason", "message", "grant", "approval")
    }
    # Nothing of A's moved: still approved and unused, and A's own call uses it.
    approval = Approval.objects.get(pk=world["approval"])
    assert (approval.status, approval.consumed_at) == ("approved", None)
    assert Approval.objects.count() == before[1]
    mine = client_for("A").post(f"{API}authorize", {**ask, "approval": world["approval"]},
                                format="json").json()  # fmt: skip
    assert (mine["decision"], mine["approval"]) == ("allow", world["approval"])
    assert Approval.objects.get(pk=world["approval"]).status == "consumed"


def test_b_does_not_see_as_requests(bot_b, world):
    assert bot_b.get(f"{API}grant-requests").json() == []
    assert bot_b.get(f"{API}grant-requests/{world['request']}").status_code == 404


def test_b_cannot_request_a_grant_in_as_name(bot_b, world):
    before = Grant.objects.count()
    response = bot_b.post(f"{API}grant-requests", REQUEST, format="json")
    assert response.json()["error"]["code"] == "agent_mismatch"
    assert Grant.objects.count() == before


@pytest.mark.parametrize("owns", [True, False])
def test_an_auditor_files_no_request_whoever_owns_the_agent(world, human_client, carol, owns):
    """Auditors are read-only: owning an agent does not let carol ask for its grants
    (the service refuses, so the UI and commands agree), and for an agent she does not
    own the refusal says so too, not `not_agent_owner` (as if owning it would do)."""
    if owns:
        Agent.objects.filter(name="bot-b").update(owner=carol)  # test setup: carol owns it
    auditor = human_client(carol, roles.AUDITORS)
    before = (Grant.objects.count(), AuditEvent.objects.count())
    response = auditor.post(f"{API}grant-requests", REQUEST | {"agent": "bot-b"}, format="json")
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "auditor_read_only" and "read-only" in error["message"]
    assert (Grant.objects.count(), AuditEvent.objects.count()) == before


def test_an_admin_who_issues_himself_an_agents_token_approves_nothing_it_asks(
    world, human_client, dave, bob
):
    """dave (admin) issues a token for alice's bot-a, asks as the agent for a grant
    and makes a destructive call as it: while that token is live he is a stakeholder
    and approves neither; bob, with no stake, may."""
    admin = human_client(dave, roles.ADMINS)
    minted = admin.post(f"{API}agents/bot-a/tokens", {}, format="json")
    assert minted.status_code == 201
    as_agent = APIClient()
    as_agent.credentials(HTTP_AUTHORIZATION=f"Bearer {minted.json()['token']}")
    asked = as_agent.post(
        f"{API}grant-requests",
        {"tool": "repo", "actions": ["read", "delete"], "scope": "repo:mine/*",
         "duration_seconds": 3600, "justification": "x"},
        format="json",
    )  # fmt: skip
    assert asked.status_code == 201
    gid = asked.json()["id"]
    refused = admin.post(f"{API}grant-requests/{gid}/approve", {}, format="json")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "self_approval"
    assert Grant.objects.get(pk=gid).status == "pending"
    assert not AuditEvent.objects.filter(event_type="grant.issued", grant_id=gid).exists()

    gated = as_agent.post(
        f"{API}authorize", {"tool": "repo", "action": "delete", "scope": "repo:acme/y"},
        format="json",
    ).json()  # fmt: skip
    assert gated["decision"] == "approval_required"
    refused = admin.post(f"{API}approvals/{gated['approval']}/approve", {}, format="json")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "self_approval"
    assert Approval.objects.get(pk=gated["approval"]).status == "pending"
    assert last_event().event_type == "access.approval_required"
    approver = human_client(bob, roles.APPROVERS)
    ok = approver.post(f"{API}approvals/{gated['approval']}/approve", {}, format="json")
    assert ok.status_code == 200
    assert (last_event().event_type, last_event().actor) == ("approval.approved", "user:bob")


@pytest.mark.parametrize("child", ["bot-b-sub", "bot-a-sub"])
def test_b_cannot_hand_down_as_grant_to_any_subagent(bot_b, world, child):
    before = Grant.objects.count()
    body = delegation(world) | {"agent": child}
    assert bot_b.post(f"{API}delegations", body, format="json").status_code == 404
    assert Grant.objects.count() == before


def test_b_sees_only_its_own_grants(bot_b, world):
    me = bot_b.get(f"{API}me").json()
    assert me["agent"] == "bot-b"
    assert {g["agent"] for g in me["grants"]} == {"bot-b"}


@pytest.mark.parametrize("caller", ["A", "B"])
def test_no_agent_reaches_the_admin_api_even_about_itself(client_for, world, caller):
    """403 before any lookup: an agent cannot suspend, re-token or read itself here."""
    client = client_for(caller)
    name = "bot-a" if caller == "A" else "bot-b"
    for method, url in [("get", f"agents/{name}"), ("post", f"agents/{name}/tokens"),
                        ("get", f"grants/{world['grant']}")]:  # fmt: skip
        assert getattr(client, method)(API + url, {}, format="json").status_code == 403
    assert AgentToken.objects.filter(agent__name=name).count() == (2 if caller == "A" else 1)
    assert Agent.objects.get(name=name).status == "active"


@pytest.mark.parametrize("path", ["/api/v1/grant-requests", "/api/v1/breakglass"])
def test_a_person_with_no_role_cannot_tell_which_agent_names_exist(make_agent, human_client, path):
    """Another person's agent answers exactly as a name nobody has."""
    make_agent("bot-a")  # alice's
    erin = User.objects.create_user("erin", password="pw-erin-123")
    client = human_client(erin)
    body = {"tool": "repo", "actions": ["read"], "scope": "repo:x/*"}
    if path.endswith("breakglass"):
        body |= {"ticket": "INC-1", "reason": "x"}
    else:
        body |= {"duration_seconds": 600, "justification": "x"}
    before = AuditEvent.objects.count()
    theirs = client.post(path, body | {"agent": "bot-a"}, format="json")
    missing = client.post(path, body | {"agent": "no-such-bot"}, format="json")
    assert (theirs.status_code, theirs.json()["error"]["code"]) == (400, "unknown_agent")
    assert theirs.json()["error"] == {
        **missing.json()["error"],
        "message": missing.json()["error"]["message"].replace("no-such-bot", "bot-a"),
    }
    assert AuditEvent.objects.count() == before
