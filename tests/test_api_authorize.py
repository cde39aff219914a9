"""POST /api/v1/authorize and the decision outcome: response, database, audit."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from governance import audit
from governance.audit import Actor
from governance.models import AgentToken, AuditEvent, DecisionOutcome, Grant
from governance.services import agents
from governance.services.usage import usage_fold
from tests.conftest import last_event

URL = "/api/v1/authorize"


@pytest.fixture
def setup(make_agent, make_tool, make_grant, agent_client):
    bot = make_agent("bot")
    other = make_agent("other")
    repo = make_tool("repo")
    now = timezone.now()
    grant = make_grant(
        bot, repo, ("read", "delete"), "repo:acme/*", starts_at=now - timedelta(minutes=1)
    )
    return {"bot": bot, "other": other, "grant": grant, "client": agent_client(bot),
            "other_client": agent_client(other)}  # fmt: skip


def body(**kw):
    base = {"tool": "repo", "action": "read", "scope": "repo:acme/x"}
    base.update(kw)
    return base


def test_an_allowed_call(setup):
    response = setup["client"].post(URL, body(), format="json")
    assert response.status_code == 200, response.content
    data = response.json()
    assert (data["decision"], data["reason"], data["grant"]) == (
        "allow",
        "allowed",
        setup["grant"].pk,
    )
    event = last_event()
    assert str(event.uid) == data["decision_id"]
    assert (event.event_type, event.agent, event.actor) == ("access.allowed", "bot", "agent:bot")
    usage_fold()
    assert Grant.objects.get(pk=setup["grant"].pk).use_count == 1


def test_a_denial_is_a_200_with_its_reason(setup):
    response = setup["other_client"].post(URL, body(), format="json")
    assert response.status_code == 200
    data = response.json()
    assert (data["decision"], data["reason"], data["grant"]) == ("deny", "no_grant", None)
    assert last_event().agent == "other" and last_event().decision == "deny"


def test_a_body_naming_another_agent_is_refused_not_obeyed(setup):
    before = AuditEvent.objects.count()
    response = setup["other_client"].post(URL, body(agent="bot"), format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and "agent" in error["fields"]
    # Nothing decided; the attempt on record under the agent that made it.
    assert AuditEvent.objects.count() == before + 1
    event = last_event()
    assert (event.event_type, event.agent, event.reason) == (
        "access.denied", "other", "invalid_request",
    )  # fmt: skip
    assert "agent" in json.loads(event.data)["problems"]


@pytest.mark.parametrize(
    "bad",
    [
        {"tool": "repo", "action": "obliterate", "scope": "x:y"},
        {"tool": "repo", "scope": "x:y"},
        {"tool": 7, "action": "read", "scope": "x:y"},
        {"tool": "repo", "action": "read", "scope": "x" * 501},
        {"tool": "repo", "action": "read", "scope": "x:y", "arguments": [1, 2]},
        ["not", "an", "object"],
    ],
)
def test_malformed_bodies_are_400_with_fields_and_on_record(setup, bad):
    """Refused, never decided (no grant is read, nothing but the record is written),
    and on record: an agent probing with tools or actions outside the schema left no
    trace, where one naming an unknown tool does."""
    before = AuditEvent.objects.count()
    response = setup["client"].post(URL, bad, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["message"] and error["fields"]
    assert AuditEvent.objects.count() == before + 1
    event = last_event()
    assert (event.event_type, event.agent, event.decision, event.reason) == (
        "access.denied", "bot", "deny", "invalid_request",
    )  # fmt: skip
    sent = bad if isinstance(bad, dict) else {}
    assert event.tool == (sent.get("tool") if isinstance(sent.get("tool"), str) else "")
    assert event.actor == "agent:bot" and event.grant_id is None
    assert set(json.loads(event.data)["problems"]) == set(error["fields"])


def test_a_malformed_body_is_recorded_bounded_whatever_its_keys(setup):
    """Keys the schema does not take are named in the 400's problems: the agent's own
    text. 20 of 100,000 characters each made a 2 MB event, in a log nothing deletes."""
    sent = {"tool": "repo", "action": "read", "scope": "repo:x"}
    for i in range(20):
        sent[f"k{i:02d}" + "A" * 100_000] = 1
    response = setup["client"].post(URL, json.dumps(sent), content_type="application/json")
    assert response.status_code == 400
    event = last_event()
    assert (event.event_type, event.reason) == ("access.denied", "invalid_request")
    assert len(event.data) < 10_000
    assert all(len(key) <= 100 for key in json.loads(event.data)["problems"])


def test_a_malformed_body_is_recorded_cut_and_escaped(setup):
    """What is recorded of a malformed body is what every event's columns hold: an
    overlong tool name cut, a NUL escaped, other text as sent (the pages reveal it)."""
    sent = {"tool": "t\x00" + "x" * 300, "action": "wipe\u202e", "scope": "x:y"}
    response = setup["client"].post(URL, json.dumps(sent), content_type="application/json")
    assert response.status_code == 400
    event = last_event()
    assert (event.event_type, event.reason) == ("access.denied", "invalid_request")
    assert "\x00" not in event.tool and event.tool.startswith("t\\x00x")
    assert event.action == "wipe\u202e" and len(event.tool) == 100
    assert audit.verify_chain(timezone.now()).ok


@pytest.mark.parametrize(
    ("path", "big"),
    [
        (URL, body(arguments={"blob": "x" * 3_000_000})),
        (
            "/api/v1/grant-requests",
            {"tool": "repo", "actions": ["read"], "scope": "repo:acme/y",
             "duration_seconds": 60, "justification": "x" * 3_000_000},
        ),
    ],
)  # fmt: skip
def test_a_body_over_the_upload_limit_is_413_and_writes_nothing(setup, path, big, caplog):
    """Over DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MB) Django raises RequestDataTooBig: it was
    an unhandled error (a traceback in the log, 503 "try again") for a request that can
    never succeed."""
    before = AuditEvent.objects.count()
    response = setup["client"].post(path, json.dumps(big), content_type="application/json")
    assert response.status_code == 413, response.content[:200]
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "bytes" in error["message"]
    assert AuditEvent.objects.count() == before and not Grant.objects.filter(scope="repo:acme/y")
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


@pytest.mark.parametrize(
    ("path", "field", "items"),
    [
        ("/api/v1/sandbox/runs", "command", 256),
        ("/api/v1/grant-requests", "fields", 100),
    ],
)
def test_a_list_over_its_length_is_refused_before_its_items_are_read(setup, path, field, items):
    """DRF validated every item before a list's max_length: 200,000 bad items (400 kB)
    came back as 15 MB of errors, one per item (a full 2.5 MB body: a minute of a
    worker and 90 MB). The length is checked first, and a 400 names at most 20 fields."""
    run = {**SANDBOX_RUN, "backend": "docker", "command": [0] * 200_000}
    request = {"tool": "repo", "actions": ["read"], "scope": "repo:acme/y",
               "duration_seconds": 60, "justification": "j", "fields": [0] * 200_000}  # fmt: skip
    sent = run if field == "command" else request
    before = AuditEvent.objects.count()
    response = setup["client"].post(path, json.dumps(sent), content_type="application/json")
    assert response.status_code == 400 and len(response.content) < 2_000, len(response.content)
    error = response.json()["error"]
    assert error["fields"] == {field: f"Ensure this field has no more than {items} elements."}
    assert AuditEvent.objects.count() == before


def test_a_400_names_at_most_twenty_fields(setup):
    sent = {
        **SANDBOX_RUN,
        "backend": "docker",
        "command": [0] * 256,
    }  # each item wrong, within the length
    response = setup["client"].post(
        "/api/v1/sandbox/runs", json.dumps(sent), content_type="application/json"
    )
    error = response.json()["error"]
    assert response.status_code == 400 and len(error["fields"]) == 20
    assert error["message"].endswith("; and 236 more")


def test_too_many_query_parameters_is_a_400_not_an_internal_error(setup, anonymous, caplog):
    """Over DATA_UPLOAD_MAX_NUMBER_FIELDS (1,000) Django raises TooManyFieldsSent while
    the format is negotiated: 503 internal_error and a traceback, before the token was
    read. It is a malformed request."""
    query = "&".join(["a"] * 1001)
    before = AuditEvent.objects.count()
    for response in (
        anonymous.get(f"/api/v1/me?{query}"),
        setup["client"].post(f"{URL}?{query}", body(), format="json"),
    ):
        assert response.status_code == 400, response.content
        assert response.json()["error"]["code"] == "invalid_request"
        assert "more than 1000" in response.json()["error"]["message"]
    assert AuditEvent.objects.count() == before
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_an_unknown_format_or_accept_is_answered_in_json_after_the_token_is_read(setup, anonymous):
    """DRF's negotiation ran before authentication: `?format=xml` was a 404 and
    `Accept: application/xml` a 406 to anyone, and a decision asked with `?format=xml`
    was never made. The API answers JSON."""
    assert anonymous.get("/api/v1/me?format=xml").status_code == 401
    assert anonymous.get("/api/v1/me", HTTP_ACCEPT="application/xml").status_code == 401
    response = setup["client"].post(f"{URL}?format=xml", body(), format="json")
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    assert (response.json()["decision"], str(last_event().uid)) == (
        "allow", response.json()["decision_id"],
    )  # fmt: skip


def test_a_chunked_body_is_refused_not_read_as_empty(setup, alice, human_client):
    """A WSGI server hands Django a chunked body with no Content-Length, which Django
    reads as no body: a token asked for 1 day was issued for the default 30, and an
    unknown key was not refused. 411, nothing made."""
    admin = human_client(alice)
    tokens = AgentToken.objects.count()
    response = admin.post(
        "/api/v1/agents/bot/tokens", {"expires_days": 1}, format="json",
        HTTP_TRANSFER_ENCODING="chunked",
    )  # fmt: skip
    assert response.status_code == 411, response.content
    assert response.json()["error"]["code"] == "length_required"
    assert AgentToken.objects.count() == tokens
    ui = admin.post("/ui/login/", {"username": "x"}, HTTP_TRANSFER_ENCODING="chunked")
    assert ui.status_code == 411


def test_a_host_not_allowed_is_a_json_400_under_the_api(anonymous, client):
    """DisallowedHost is answered before any view, by Django's HTML 400 page: under
    /api/ it is the API's error shape, like a 404 there."""
    response = anonymous.get("/api/v1/me", HTTP_HOST="evil.example")
    assert response.status_code == 400 and response["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == "invalid_request"
    page = client.get("/ui/login/", HTTP_HOST="evil.example")
    assert page.status_code == 400 and page["Content-Type"].startswith("text/html")


@pytest.mark.parametrize("action", ["read", "delete"])
def test_a_token_revoked_after_the_request_was_let_in_gets_no_allow(setup, monkeypatch, action):
    """The token was checked only when the request came in: one revoked while the request
    was on its way to its decision was still answered `allow` (and an approval asked for),
    recorded after `agent_token.revoked`. The decision refuses it, on record."""
    from governance.api import auth

    real = auth.BearerAuthentication.authenticate

    def let_in_then_revoked(self, request):
        principal, token = real(self, request)
        agents.token_revoke(token=token, actor=Actor.system("incident"), at=timezone.now())
        return principal, token

    monkeypatch.setattr(auth.BearerAuthentication, "authenticate", let_in_then_revoked)
    response = setup["client"].post(URL, body(action=action), format="json")
    assert response.status_code == 200, response.content
    data = response.json()
    assert (data["decision"], data["reason"], data["approval"]) == ("deny", "token_revoked", None)
    kinds = list(AuditEvent.objects.order_by("-seq").values_list("event_type", flat=True)[:2])
    assert kinds == ["access.denied", "agent_token.revoked"]
    assert (last_event().reason, str(last_event().uid)) == ("token_revoked", data["decision_id"])


@pytest.mark.django_db(transaction=True)
def test_a_revoke_committing_between_the_tokens_check_and_the_event_is_seen(
    postgres_only, setup, monkeypatch
):
    """The token is asked after the decision's read; a revoke that commits after that,
    before the event is appended, makes the append refuse (the state changed) and the
    question is asked again: the answer is the revoke's, never an allow after it."""
    import threading

    from django.db import connection

    from governance.services import access

    real, asked = access.token_refusal, []

    def revoke_right_after_the_first_check(token_id):
        check = real(token_id)

        def refuse(decision):
            answer = check(decision)
            if not asked:
                token = AgentToken.objects.get(pk=token_id)

                def revoke():
                    try:
                        agents.token_revoke(token=token, actor=Actor.system("x"), at=timezone.now())
                    finally:
                        connection.close()

                elsewhere = threading.Thread(target=revoke)  # its own connection: committed
                elsewhere.start()
                elsewhere.join(10)
            asked.append(answer)
            return answer

        return refuse

    monkeypatch.setattr(access, "token_refusal", revoke_right_after_the_first_check)
    data = setup["client"].post(URL, body(), format="json").json()
    assert asked[0] is None and asked[-1] is not None  # asked again after the revoke
    assert (data["decision"], data["reason"]) == ("deny", "token_revoked")
    kinds = list(AuditEvent.objects.order_by("-seq").values_list("event_type", flat=True)[:2])
    assert kinds == ["access.denied", "agent_token.revoked"]


def _revoked_once_let_in(monkeypatch):
    """Each request's token is checked at the door, then revoked (committed) before the
    view runs: a revoke landing while the request is on its way to its write."""
    from governance.api import auth

    real = auth.BearerAuthentication.authenticate

    def let_in_then_revoked(self, request):
        principal, token = real(self, request)
        agents.token_revoke(token=token, actor=Actor.system("incident"), at=timezone.now())
        return principal, token

    monkeypatch.setattr(auth.BearerAuthentication, "authenticate", let_in_then_revoked)


def _events_since(seq):
    return list(
        AuditEvent.objects.filter(seq__gt=seq)
        .order_by("seq")
        .values_list("event_type", "decision", "reason")
    )


def _seq():
    return AuditEvent.objects.order_by("-seq").values_list("seq", flat=True).first() or 0


def test_a_sandbox_run_asked_with_a_token_revoked_after_it_was_let_in_is_denied(
    make_agent, make_tool, make_grant, agent_client, monkeypatch
):
    """A sandbox run is a decision like /authorize's, but it never asked about the token:
    one revoked after the request was let in was still allowed, and the run recorded
    allowed after `agent_token.revoked`. Denied `token_revoked` now, as /authorize is."""
    from governance.models import SandboxRun

    bot = make_agent("bot")
    tool = make_tool("code-exec", actions=("execute",), kind="code_exec")
    grant = make_grant(
        bot, tool, ("execute",), "sandbox:*", starts_at=timezone.now() - timedelta(minutes=1)
    )
    client = agent_client(bot)
    _revoked_once_let_in(monkeypatch)
    before = _seq()
    ask = {**SANDBOX_RUN, "backend": "docker", "tool": "code-exec", "command": ["true"],
           "image_id": "sha256:" + "5" * 64}  # fmt: skip
    response = client.post("/api/v1/sandbox/runs", ask, format="json")
    assert response.status_code == 201, response.content
    data = response.json()
    assert (data["decision"], data["reason"]) == ("deny", "token_revoked")
    run = SandboxRun.objects.get(run_id=SANDBOX_RUN["run_id"])
    assert (run.status, run.decision, run.reason, run.grant_id) == (
        "denied", "deny", "token_revoked", grant.pk,
    )  # fmt: skip
    assert not run.limits and run.decision_id == data["decision_id"]
    assert _events_since(before) == [
        ("agent_token.revoked", "", ""),
        ("access.denied", "deny", "token_revoked"),
        ("sandbox.run.requested", "", ""),
        ("sandbox.run.denied", "deny", "token_revoked"),
    ]


def test_a_delegation_asked_with_a_token_revoked_after_it_was_let_in_is_a_401(
    make_agent, make_tool, make_grant, agent_client, monkeypatch
):
    """A delegation under a token revoked after the request was let in was made (201),
    `grant.delegated` recorded after `agent_token.revoked`. Now it is the 401 the token
    gets at the door: no grant, no event (a refusal is for a live token's request)."""
    boss = make_agent("boss")
    make_agent("helper", parent=boss)
    grant = make_grant(
        boss, make_tool("repo"), ("read",), "repo:acme/*", delegable=True,
        starts_at=timezone.now() - timedelta(minutes=1), duration=timedelta(hours=2),
    )  # fmt: skip
    client = agent_client(boss)
    _revoked_once_let_in(monkeypatch)
    before, grants = _seq(), Grant.objects.count()
    sent = {"grant": grant.pk, "agent": "helper", "actions": ["read"], "scope": "repo:acme/a/*",
            "expires_at": (timezone.now() + timedelta(hours=1)).isoformat(),
            "justification": "sub-task"}  # fmt: skip
    response = client.post("/api/v1/delegations", sent, format="json")
    assert response.status_code == 401, response.content
    assert response.json()["error"]["code"] == "unauthenticated"
    assert response["WWW-Authenticate"] == 'Bearer realm="api"'
    assert Grant.objects.count() == grants
    assert _events_since(before) == [("agent_token.revoked", "", "")]


@pytest.mark.parametrize("holder", ["agent", "person"])
def test_a_grant_request_with_a_token_revoked_after_it_was_let_in_is_a_401(
    make_agent, make_tool, agent_client, human_client, alice, monkeypatch, holder
):
    """The same for a grant request, whether an agent asks for itself or its owner asks
    with a personal token: no request is filed under a token after its revoke."""
    bot = make_agent("bot")
    make_tool("tickets")
    client = agent_client(bot) if holder == "agent" else human_client(alice)
    _revoked_once_let_in(monkeypatch)
    before, grants = _seq(), Grant.objects.count()
    sent = {"tool": "tickets", "actions": ["read"], "scope": "tickets:queue/*",
            "duration_seconds": 3600, "justification": "triage"}  # fmt: skip
    if holder == "person":
        sent["agent"] = "bot"
    response = client.post("/api/v1/grant-requests", sent, format="json")
    assert response.status_code == 401, response.content
    assert response.json()["error"]["code"] == "unauthenticated"
    assert Grant.objects.count() == grants
    assert _events_since(before) == [("agent_token.revoked", "", "")]


@pytest.mark.django_db(transaction=True)
def test_a_revoke_committing_while_a_delegation_is_made_waits_for_it(
    postgres_only, make_agent, make_tool, make_grant, agent_client, monkeypatch
):
    """The token is checked in the delegation's transaction and its row held to the
    commit: a revoke committing meanwhile (another connection) waits, and is recorded
    after `grant.delegated`, never before it."""
    import threading
    import time

    from django.db import connection

    from governance.services import access

    boss = make_agent("boss")
    make_agent("helper", parent=boss)
    grant = make_grant(
        boss, make_tool("repo"), ("read",), "repo:acme/*", delegable=True,
        starts_at=timezone.now() - timedelta(minutes=1), duration=timedelta(hours=2),
    )  # fmt: skip
    client = agent_client(boss)
    real, elsewhere = access.require_live_token, []

    def revoke_right_after_the_check(token_id):
        real(token_id)
        token = AgentToken.objects.get(pk=token_id)

        def revoke():
            try:
                agents.token_revoke(token=token, actor=Actor.system("x"), at=timezone.now())
            finally:
                connection.close()

        thread = threading.Thread(target=revoke)  # its own connection
        thread.start()
        elsewhere.append(thread)
        time.sleep(0.5)  # time enough for the revoke to commit, if nothing held it

    monkeypatch.setattr(access, "require_live_token", revoke_right_after_the_check)
    sent = {"grant": grant.pk, "agent": "helper", "actions": ["read"], "scope": "repo:acme/a/*",
            "expires_at": (timezone.now() + timedelta(hours=1)).isoformat(),
            "justification": "sub-task"}  # fmt: skip
    response = client.post("/api/v1/delegations", sent, format="json")
    elsewhere[0].join(10)
    assert not elsewhere[0].is_alive()
    assert response.status_code == 201, response.content
    kinds = list(AuditEvent.objects.order_by("-seq").values_list("event_type", flat=True)[:2])
    assert kinds == ["agent_token.revoked", "grant.delegated"]
    assert AgentToken.objects.get(agent=boss).revoked_at is not None


def test_tool_names_are_not_trimmed(setup):
    response = setup["client"].post(URL, body(tool=" repo"), format="json")
    assert response.json()["reason"] == "unknown_tool"


def test_a_destructive_call_returns_an_approval_to_poll(setup, human_client, bob):
    response = setup["client"].post(URL, body(action="delete"), format="json")
    data = response.json()
    assert (data["decision"], data["reason"]) == ("approval_required", "approval_required")
    # `grant` and `expires_at` say what a call was allowed under: not leave to act.
    # The audit event names the grant the gate was asked under.
    assert (data["grant"], data["expires_at"]) == (None, None)
    assert last_event().grant_id == setup["grant"].pk
    approval_url = f"/api/v1/approvals/{data['approval']}"
    polled = setup["client"].get(approval_url)
    assert polled.status_code == 200 and polled.json()["status"] == "pending"
    assert polled.json()["hidden_values"] == 0
    assert setup["other_client"].get(approval_url).status_code == 404
    # A payload under a key named like a credential is masked: the approver is told.
    hiding = body(action="delete", arguments={"auth_token": "--all --force", "n": 1})
    hidden = setup["client"].post(URL, hiding, format="json").json()
    seen = setup["client"].get(f"/api/v1/approvals/{hidden['approval']}").json()
    assert (seen["hidden_values"], seen["arguments_preview"]["auth_token"]) == (1, "[masked]")

    approver = human_client(bob, "approvers")
    decided = approver.post(approval_url + "/approve", {"reason": "ok"}, format="json")
    assert decided.status_code == 200 and decided.json()["status"] == "approved"
    assert last_event().event_type == "approval.approved"

    used = setup["client"].post(
        URL, body(action="delete", approval=data["approval"]), format="json"
    )
    assert used.json()["decision"] == "allow"
    assert used.json()["grant"] == setup["grant"].pk and used.json()["expires_at"]
    again = setup["client"].post(
        URL, body(action="delete", approval=data["approval"]), format="json"
    )
    assert again.json()["reason"] == "approval_invalid"
    assert (again.json()["grant"], again.json()["expires_at"]) == (None, None)
    assert (last_event().reason, last_event().grant_id) == ("approval_invalid", setup["grant"].pk)


def test_a_call_approval_under_a_closed_task_is_voided_and_not_approved(
    setup, make_task, human_client, bob, dave
):
    """A call made with a task under a grant bound to no task: closing the task left
    its approval pending, and approving it was a 200 for a call that could never be
    made. The close voids it (409 `not_pending` after); one whose task ran out before
    any job closed it is a 409 `task_closed`. Neither writes anything."""
    from governance.models import Approval, Task

    started = timezone.now() - timedelta(minutes=5)
    make_task("T-1", at=started)
    running_out = make_task("T-2", at=started, ends_at=timezone.now() + timedelta(hours=1))
    closed = setup["client"].post(URL, body(action="delete", task="T-1"), format="json").json()
    ended = setup["client"].post(URL, body(action="delete", task="T-2"), format="json").json()
    assert closed["decision"] == ended["decision"] == "approval_required"

    admin = human_client(dave, "admins")
    assert admin.post("/api/v1/tasks/T-1/close").status_code == 200
    assert Approval.objects.get(pk=closed["approval"]).status == "expired"
    event = last_event()
    assert (event.event_type, event.task, event.actor) == ("task.closed", "T-1", "user:dave")
    assert json.loads(event.data)["approvals_voided"] == 1

    # T-2 runs out; no job has closed it yet.
    Task.objects.filter(pk=running_out.pk).update(ends_at=timezone.now())
    approver = human_client(bob, "approvers")
    before = AuditEvent.objects.count()
    for approval, status, code in (
        (closed["approval"], 409, "not_pending"),
        (ended["approval"], 409, "task_closed"),
    ):
        answer = approver.post(
            f"/api/v1/approvals/{approval}/approve", {"reason": "ok"}, format="json"
        )
        assert answer.status_code == status, answer.content
        assert answer.json()["error"]["code"] == code and answer.json()["error"]["message"]
    assert Approval.objects.get(pk=ended["approval"]).status == "pending"
    assert AuditEvent.objects.count() == before


def test_a_database_failing_before_the_view_is_503_deny_too(setup, monkeypatch):
    """The token's lookup meeting a database outage answered the generic error shape:
    a client reading `decision` off the promised "503 + deny" got a KeyError. Other
    endpoints keep the error shape."""
    from django.db import OperationalError

    from governance.api import auth

    def down(prefix):
        raise OperationalError("the database is down")

    monkeypatch.setattr(auth, "_token_by_prefix", down)
    before = AuditEvent.objects.count()
    response = setup["client"].post(URL, body(), format="json")
    assert response.status_code == 503
    answer = response.json()
    assert (answer["decision"], answer["reason"]) == ("deny", "error")
    assert answer["decision_id"] is None and answer["grant"] is None and answer["message"]
    assert AuditEvent.objects.count() == before  # nothing could be recorded, nor was
    other = setup["client"].get("/api/v1/me")
    assert other.status_code == 503 and other.json()["error"]["code"] == "unavailable"


@pytest.mark.django_db(transaction=True)
def test_a_held_chain_lock_is_waited_on_only_so_long(setup, postgres_only):
    """A session holding the audit chain's lock (a stuck transaction, a long export)
    made every decision wait for it without end, then die with the web worker. The
    connection's lock_timeout (DATABASE_LOCK_TIMEOUT_SECONDS, here 1 s) ends the wait:
    503 deny, nothing written, and the next call after the lock is let go is decided."""
    import threading

    import psycopg
    from django.db import connection

    from governance import settings as app_settings

    url = app_settings.database_from_url("postgresql://u@127.0.0.1/x")
    assert url["OPTIONS"] == {"options": "-c lock_timeout=10s"}  # the default's wiring
    connection.close()
    options = connection.settings_dict["OPTIONS"]
    assert options == {"options": "-c lock_timeout=10s"}  # the test database's own
    connection.settings_dict["OPTIONS"] = {"options": "-c lock_timeout=1s"}
    held, release = threading.Event(), threading.Event()
    db = connection.settings_dict

    def hold() -> None:
        with psycopg.connect(
            dbname=db["NAME"], user=db["USER"], host=db["HOST"], port=db["PORT"]
        ) as other:
            other.execute("SELECT pg_advisory_lock(%s)", [audit.CHAIN_LOCK_KEY])
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        before = AuditEvent.objects.count()
        response = setup["client"].post(URL, body(), format="json")
        assert response.status_code == 503, response.content
        assert (response.json()["decision"], response.json()["reason"]) == ("deny", "error")
        assert AuditEvent.objects.count() == before
    finally:
        release.set()
        holder.join(30)
        connection.close()
        connection.settings_dict["OPTIONS"] = options
    after = setup["client"].post(URL, body(), format="json").json()
    assert after["decision"] == "allow" and last_event().uid.hex == after["decision_id"].replace(
        "-", ""
    )


def test_an_internal_failure_is_503_deny(setup):
    from tests.test_fail_closed import refusing

    with refusing("governance_auditevent", "INSERT"):
        response = setup["client"].post(URL, body(), format="json")
    assert response.status_code == 503
    assert response.json()["decision"] == "deny" and response.json()["reason"] == "error"


# --- Tokens -----------------------------------------------------------------------------


def _unauth(response):
    assert response.status_code == 401
    assert response.json() == {
        "error": {"code": "unauthenticated", "message": "A valid bearer token is required.",
                  "fields": {}}
    }  # fmt: skip
    return True


@pytest.mark.parametrize(
    "header",
    [None, "Bearer", "Bearer nonsense", "Basic abc", "Bearer agt_00000000_" + "x" * 43],
)
def test_missing_malformed_and_unknown_tokens_look_the_same(setup, anonymous, header):
    if header:
        anonymous.credentials(HTTP_AUTHORIZATION=header)
    assert _unauth(anonymous.post(URL, body(), format="json"))


def test_expired_revoked_and_suspended_tokens_look_the_same(setup, anonymous):
    token = AgentToken.objects.get(agent=setup["bot"])
    AgentToken.objects.filter(pk=token.pk).update(expires_at=timezone.now())
    assert _unauth(setup["client"].post(URL, body(), format="json"))
    AgentToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() + timedelta(days=1))
    assert setup["client"].post(URL, body(), format="json").status_code == 200
    agents.agent_suspend(agent=setup["bot"], reason="x", actor=Actor.system("t"), at=timezone.now())
    assert _unauth(setup["client"].post(URL, body(), format="json"))
    agents.token_revoke(
        token=setup["other"].tokens.get(), actor=Actor.system("t"), at=timezone.now()
    )
    assert _unauth(setup["other_client"].post(URL, body(), format="json"))


def test_a_token_records_its_last_use(setup):
    setup["client"].post(URL, body(), format="json")
    assert AgentToken.objects.get(agent=setup["bot"]).last_used_at is not None


def test_humans_cannot_authorize_tool_calls(setup, human_client, dave):
    response = human_client(dave, "admins").post(URL, body(), format="json")
    assert response.status_code == 403


# --- Outcomes ----------------------------------------------------------------------------


def test_the_agent_reports_an_outcome_once(setup):
    decision_id = setup["client"].post(URL, body(), format="json").json()["decision_id"]
    url = f"/api/v1/decisions/{decision_id}/outcome"
    report = {"outcome": "succeeded", "result_digest": "ab" * 32, "excerpt": "mail x@y.org ok"}
    response = setup["client"].post(url, report, format="json")
    assert response.status_code == 201, response.content
    event = last_event()
    assert event.event_type == "access.outcome" and decision_id in event.data
    assert "x@y.org" not in event.data
    assert DecisionOutcome.objects.get(decision_id=decision_id).outcome == "succeeded"
    again = setup["client"].post(url, report, format="json")
    assert again.status_code == 409 and again.json()["error"]["code"] == "already_reported"


@pytest.mark.parametrize(
    "digest", ["password=hunter2", "ABCDEF0123456789", "sha256:", "sha256 9f86d081884c", "9f86d08"]
)
def test_a_result_digest_that_is_not_a_digest_is_refused_and_nothing_is_written(setup, digest):
    """The digest goes into the append-only log as sent: only a digest is taken (a secret
    pasted there would stay in the log for good)."""
    decision_id = setup["client"].post(URL, body(), format="json").json()["decision_id"]
    url = f"/api/v1/decisions/{decision_id}/outcome"
    before = AuditEvent.objects.count()
    response = setup["client"].post(url, {"outcome": "succeeded", "result_digest": digest},
                                    format="json")  # fmt: skip
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and "result_digest" in error["fields"]
    assert "Not a digest" in error["fields"]["result_digest"]
    assert AuditEvent.objects.count() == before and not DecisionOutcome.objects.exists()


@pytest.mark.parametrize(
    "digest", ["sha256:9f86d081884c7d65", "ab" * 32, "blake2b-256:" + "0" * 64]
)
def test_a_result_digest_is_recorded_as_sent(setup, digest):
    decision_id = setup["client"].post(URL, body(), format="json").json()["decision_id"]
    url = f"/api/v1/decisions/{decision_id}/outcome"
    response = setup["client"].post(url, {"outcome": "succeeded", "result_digest": digest},
                                    format="json")  # fmt: skip
    assert response.status_code == 201, response.content
    assert json.loads(last_event().data)["result_digest"] == digest
    assert DecisionOutcome.objects.get(decision_id=decision_id).result_digest == digest


def test_only_the_agent_that_received_a_decision_reports_it(setup):
    decision_id = setup["client"].post(URL, body(), format="json").json()["decision_id"]
    url = f"/api/v1/decisions/{decision_id}/outcome"
    response = setup["other_client"].post(url, {"outcome": "failed"}, format="json")
    assert response.status_code == 404
    assert setup["client"].post("/api/v1/decisions/nope/outcome", {"outcome": "failed"},
                                format="json").status_code == 404  # fmt: skip
    assert not DecisionOutcome.objects.exists()


@pytest.mark.parametrize("number", ["1e400", "-1e500", "1e999"])
def test_a_number_too_big_for_a_double_is_refused_not_read_as_infinity(setup, number):
    """1e400 and 1e500 both parse to Infinity: one hash, so one approval, for two
    different calls. Such arguments are refused (deny, invalid_request), never allowed."""
    raw = '{"tool": "repo", "action": "delete", "scope": "repo:acme/x", "arguments": {"n": %s}}'
    response = setup["client"].generic("POST", URL, raw % number, content_type="application/json")
    assert response.status_code == 200, response.content
    data = response.json()
    assert (data["decision"], data["reason"]) == ("deny", "invalid_request")
    assert data["message"] == "arguments must be plain JSON values"
    assert str(last_event().uid) == data["decision_id"] and last_event().decision == "deny"
    from governance.models import Approval

    assert not Approval.objects.exists()


def test_a_key_given_twice_is_a_400_not_the_last_one_wins(setup):
    """A parser further down the line may read the first `fields`, ours would read the
    last: such a body is malformed, and nothing is decided."""
    before = last_event().seq
    raw = (
        '{"tool": "repo", "action": "read", "scope": "repo:acme/x",'
        ' "arguments": {"fields": ["ssn"], "fields": ["name"]}}'
    )
    response = setup["client"].generic("POST", URL, raw, content_type="application/json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "parse_error" and "given twice" in error["message"]
    assert last_event().seq == before  # no decision, no event


@pytest.mark.parametrize(
    ("charset", "encoded"),
    [
        # UTF-7 spells `..` as `+AC4ALg-`: a filter in front reading the bytes as UTF-8
        # sees no `..` in the scope, a reader honouring the charset sees one.
        ("utf-7", '{"tool": "repo", "action": "read", "scope": "repo:acme/+AC4ALg-/x"}'),
        ("utf-16", json.dumps({"tool": "repo", "action": "read", "scope": "repo:acme/x"})),
        ("latin-1", json.dumps({"tool": "repo", "action": "read", "scope": "repo:acme/x"})),
    ],
)
def test_a_json_body_in_another_charset_than_utf8_is_a_415(setup, charset, encoded):
    """JSON between systems is UTF-8 (RFC 8259): a body declared in another charset
    has a second reading, so it is refused before anything is decided."""
    before = last_event().seq
    response = setup["client"].generic(
        "POST", URL, encoded.encode(charset), content_type=f"application/json; charset={charset}"
    )
    assert response.status_code == 415, response.content
    error = response.json()["error"]
    assert error["code"] == "unsupported_charset" and charset in error["message"]
    assert last_event().seq == before  # no decision, no event


@pytest.mark.parametrize("charset", ["utf-8", "UTF8", "us-ascii"])
def test_a_json_body_declared_utf8_or_ascii_is_decided(setup, charset):
    raw = json.dumps(body()).encode()
    response = setup["client"].generic(
        "POST", URL, raw, content_type=f"application/json; charset={charset}"
    )
    assert response.status_code == 200 and response.json()["decision"] == "allow"
    assert str(last_event().uid) == response.json()["decision_id"]


SANDBOX_RUN = {"run_id": "0b5f2c1e-8f43-4c59-9e0f-3b7c2a1d9e10", "image": "x", "command": ["a"]}


@pytest.mark.parametrize(
    ("path", "sent"),
    [
        (URL, body(action="\ud800")),
        (URL, {**body(), "\ud800": 1}),
        (URL, body(arguments={"k": ["\udfff"]})),
        ("/api/v1/decisions/00000000-0000-0000-0000-000000000000/outcome", {"outcome": "\ud800"}),
        ("/api/v1/grant-requests", {"tool": "repo", "actions": ["\ud800"], "scope": "repo:acme/*",
                                    "duration_seconds": 60, "justification": "x"}),
        ("/api/v1/sandbox/runs", {**SANDBOX_RUN, "backend": "\ud800"}),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_a_400_not_a_500(setup, path, sent):
    """`\\ud800` alone is not text: the body is refused before anything is decided,
    where it used to fail while the error quoting it was written out (an HTML 500)."""
    raw = json.dumps(sent)  # ensure_ascii: the surrogate travels as the escape `\\ud800`
    before = last_event().seq
    response = setup["client"].generic("POST", path, raw, content_type="application/json")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "not_text" and "surrogate" in error["message"]
    assert last_event().seq == before  # no decision, no event
    assert not Grant.objects.filter(status=Grant.Status.PENDING).exists()


def test_an_escaped_surrogate_pair_is_text_and_decided(setup):
    """What a JSON encoder writes for an emoji (a pair of escapes) is one character."""
    raw = json.dumps(body(arguments={"m": "\U0001f600"}))
    assert "\\ud83d\\ude00" in raw
    response = setup["client"].generic("POST", URL, raw, content_type="application/json")
    assert response.status_code == 200 and response.json()["decision"] == "allow"
    assert "\U0001f600" in last_event().arguments


def test_an_error_never_quotes_what_cannot_be_written_out():
    """Whatever reaches the handler, its reply renders: a lone surrogate is shown as
    its escape, not left to fail the renderer."""
    from rest_framework.exceptions import ValidationError
    from rest_framework.renderers import JSONRenderer

    from governance.api.errors import exception_handler

    response = exception_handler(ValidationError({"\ud800": ['"\udfff" is not valid.']}), {})
    rendered = JSONRenderer().render(response.data).decode()
    assert response.status_code == 400 and "\\\\ud800" in rendered and "\\\\udfff" in rendered


def test_a_delegation_over_http_narrows_the_envelope_and_is_refused_when_wider(
    make_agent, make_tool, make_grant, agent_client
):
    """POST /delegations takes fields, egress, limits and delegable; anything wider than
    the parent grant is a 403 naming why, with nothing written."""
    bot = make_agent("bot")
    make_agent("bot-sub", parent=bot)
    make_tool("repo")
    from governance.models import Tool

    grant = make_grant(
        bot, Tool.objects.get(name="repo"), ("read",), "repo:acme/*", delegable=True,
        starts_at=timezone.now() - timedelta(minutes=5), egress=["api.example.com:443"],
        limits={"memory_mb": 512},
    )  # fmt: skip
    client = agent_client(bot)
    body = {"grant": grant.pk, "agent": "bot-sub", "actions": ["read"], "scope": "repo:acme/x/*",
            "expires_at": grant.expires_at.isoformat(), "justification": "sub-task"}  # fmt: skip
    before = (Grant.objects.count(), AuditEvent.objects.count())
    for extra, code in [
        ({"egress": ["api.example.com:443", "other.example.com:443"]}, "wider_egress"),
        ({"limits": {"memory_mb": 1024}}, "wider_limits"),
    ]:
        response = client.post("/api/v1/delegations", {**body, **extra}, format="json")
        assert response.status_code == 403, response.content
        assert response.json()["error"]["code"] == code
        refused = AuditEvent.objects.order_by("-seq").first()
        assert (refused.event_type, refused.agent, refused.reason) == (
            "grant.delegation_refused", "bot", code,
        )  # fmt: skip
    # No grant; the two refusals on record.
    assert (Grant.objects.count(), AuditEvent.objects.count()) == (before[0], before[1] + 2)
    response = client.post(
        "/api/v1/delegations",
        {**body, "egress": [], "limits": {"memory_mb": 64, "cpus": None}},
        format="json",
    )
    assert response.status_code == 201, response.content
    child = Grant.objects.get(pk=response.json()["id"])
    assert (child.egress, child.limits(), child.delegable) == ([], {"memory_mb": 64}, False)
    event = last_event()
    assert (event.event_type, event.grant_id) == ("grant.delegated", child.pk)
    assert json.loads(event.data)["egress"] == []
    # Asked again: the same grant, 200 (nothing was created: it said 201), no event.
    again = client.post(
        "/api/v1/delegations",
        {**body, "egress": [], "limits": {"memory_mb": 64, "cpus": None}},
        format="json",
    )
    assert (again.status_code, again.json()["id"]) == (200, child.pk)
    assert last_event().seq == event.seq


def test_a_delegation_names_fields_as_a_request_must(
    make_agent, make_tool, make_grant, agent_client
):
    """A parent with no field list covers any list, so a delegation could pick field
    names no request may carry (a comma, a bidi control): 400, nothing written."""
    bot = make_agent("bot")
    make_agent("bot-sub", parent=bot)
    grant = make_grant(bot, make_tool("repo"), ("read",), "repo:acme/*", delegable=True,
                       starts_at=timezone.now() - timedelta(minutes=5))  # fmt: skip
    body = {"grant": grant.pk, "agent": "bot-sub", "actions": ["read"], "scope": "repo:acme/x/*",
            "expires_at": grant.expires_at.isoformat(), "justification": "sub-task"}  # fmt: skip
    client = agent_client(bot)
    before = (Grant.objects.count(), AuditEvent.objects.count())
    for fields in (["email,name"], ["x\u202edaer"], ["a b"]):
        response = client.post("/api/v1/delegations", {**body, "fields": fields}, format="json")
        assert response.status_code == 400, response.content
        assert "fields" in response.json()["error"]["fields"]
    assert (Grant.objects.count(), AuditEvent.objects.count()) == before
    made = client.post("/api/v1/delegations", {**body, "fields": ["user.email"]}, format="json")
    assert made.status_code == 201, made.content
    assert Grant.objects.get(pk=made.json()["id"]).fields == ["user.email"]
    assert last_event().event_type == "grant.delegated"


def test_the_bearer_scheme_is_case_insensitive(agent_client, make_agent):
    """RFC 9110: `bearer` is `Bearer`; a standard client sending it was locked out."""
    client = agent_client(make_agent("casebot"))
    token = client._credentials["HTTP_AUTHORIZATION"].split(" ", 1)[1]
    for scheme in ("bearer", "BEARER"):
        client.credentials(HTTP_AUTHORIZATION=f"{scheme} {token}")
        assert client.get("/api/v1/me").status_code == 200
    client.credentials(HTTP_AUTHORIZATION=f"Basic {token}")
    assert client.get("/api/v1/me").status_code == 401
