"""governance.client against a real server over real HTTP on 127.0.0.1.

The happy paths talk to the app itself (pytest-django's live_server); the
failure paths talk to sockets made here: one that accepts and never answers,
a closed port, and a stub that answers whatever a test tells it to. Every
failure must come out as a denial, and the guarded function must not run.
"""

from __future__ import annotations

import collections
import enum
import gc
import hashlib
import http.server
import inspect
import json
import math
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from governance import audit
from governance.audit import Actor
from governance.client import (
    AccessDenied,
    ApprovalRequired,
    Decision,
    GovernanceClient,
    GovernanceClientError,
)
from governance.models import Approval, AuditEvent, DecisionOutcome, Grant
from governance.services import agents, approvals
from governance.services.usage import usage_fold


def token_for(agent: Any, creator: Any) -> str:
    _, plaintext = agents.token_issue(
        created_by=creator, agent=agent, actor=Actor.system("test"), at=timezone.now()
    )
    return plaintext


@pytest.fixture
def world(live_server, make_agent, make_tool, make_grant, alice) -> dict[str, Any]:
    bot = make_agent("bot")
    stranger = make_agent("stranger")
    repo = make_tool("repo")
    grant = make_grant(
        bot,
        repo,
        ("read", "delete"),
        "repo:acme/*",
        starts_at=timezone.now() - timedelta(minutes=1),
    )
    return {
        "grant": grant,
        "client": GovernanceClient(live_server.url, token_for(bot, alice)),
        "stranger": GovernanceClient(live_server.url, token_for(stranger, alice)),
        "url": live_server.url,
    }


def events(event_type: str) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(event_type=event_type).order_by("seq"))


# --- Against the real server --------------------------------------------------------------


def test_an_allowed_call_runs_once_and_its_outcome_is_reported(world):
    calls = []

    @world["client"].guarded(tool="repo", action="read", scope=lambda path: f"repo:acme/{path}")
    def read_file(path: str) -> dict[str, str]:
        calls.append(path)
        return {"path": path, "text": "hello"}

    result = read_file("api/x.py")

    assert result == {"path": "api/x.py", "text": "hello"} and calls == ["api/x.py"]
    (allowed,) = events("access.allowed")
    assert (allowed.agent, allowed.scope, allowed.decision) == (
        "bot",
        "repo:acme/api/x.py",
        "allow",
    )
    assert json.loads(allowed.arguments) == {"path": "api/x.py"}
    (outcome,) = events("access.outcome")
    data = json.loads(outcome.data)
    assert data["decision_id"] == str(allowed.uid) and data["outcome"] == "succeeded"
    assert data["result_digest"] == hashlib.sha256(repr(result).encode()).hexdigest()
    assert DecisionOutcome.objects.get(decision_id=allowed.uid).outcome == "succeeded"
    usage_fold()
    assert Grant.objects.get(pk=world["grant"].pk).use_count == 1


@dataclass
class Rows:
    table: str
    ids: list[int] = field(repr=False)  # a long list kept out of logs (and out of its repr)


@pytest.mark.parametrize(
    ("value", "sent"),
    [
        (math.inf, "inf"),
        (float("nan"), "nan"),
        ("name-\udcff.txt", "name-\\udcff.txt"),  # a file name from a non-UTF-8 disk
        ({1: "a", (2, 3): "b"}, {"1": "a", "(2, 3)": "b"}),
        (Rows("orders", [1]), "Rows(table='orders')"),
    ],
)
def test_an_allowed_call_with_an_argument_json_cannot_carry_runs(world, value, sent):
    """inf, nan and a lone surrogate went out as JSON the server refuses (Infinity,
    NaN, \\udcff): an allowed call was denied as malformed. They go as their repr or
    escaped, as the client says it sends what JSON cannot carry, so a tool taking any
    object still runs when allowed. Those forms also stand for other calls ("inf" the
    text, {"1": "a"}, another Rows), so they go wrapped under "$inexact", a form exact
    arguments never take, and no approval binds them (the tests below)."""
    calls = []

    @world["client"].guarded(tool="repo", action="read", scope="repo:acme/x")
    def read(arg: Any) -> str:
        calls.append(arg)
        return "ok"

    assert read(value) == "ok" and len(calls) == 1
    (allowed,) = events("access.allowed")
    assert json.loads(allowed.arguments) == {"$inexact": {"arg": sent}}


# Pairs of calls that went out as the same JSON, so that an approval for the first
# ran the second (found in review): each first one has no exact JSON form.
SENT_ALIKE = [
    pytest.param("report-\udcff.csv", "report-\\udcff.csv", id="surrogate-file-name"),
    pytest.param(math.inf, "inf", id="float-inf-vs-text"),
    pytest.param({1: "x"}, {"1": "x"}, id="int-key-vs-str-key"),
    pytest.param(Rows("orders", [1]), Rows("orders", list(range(100_000))), id="object-repr"),
]


def destructive(client: GovernanceClient) -> tuple[Any, list[Any]]:
    ran: list[Any] = []

    @client.guarded(tool="repo", action="delete", scope="repo:acme/tmp")
    def delete(target: Any) -> str:
        ran.append(target)
        return "deleted"

    return delete, ran


@pytest.mark.parametrize(("asked", "other"), SENT_ALIKE)
def test_an_approval_asked_for_inexact_arguments_runs_no_call(world, bob, asked, other):
    """`delete(asked)` came back approval_required; once approved,
    `delete.with_approval(id, other)` passed the server's binding (the same JSON),
    consumed the approval and ran delete(other), logged as the approved call. Now the
    asked call is a denial naming its approval (nobody should approve what cannot
    run), and that approval, even approved, runs neither call."""
    delete, ran = destructive(world["client"])
    with pytest.raises(AccessDenied) as caught:
        delete(asked)
    approval_id = caught.value.decision.approval
    assert approval_id
    approvals.approval_approve(
        approval_id=approval_id, approver=bob, actor=Actor.user(bob), at=timezone.now()
    )

    refused: list[str] = []
    for call in (other, asked):
        try:
            delete.with_approval(approval_id, call)
        except AccessDenied as exc:
            refused.append(exc.reason)
    assert ran == [], f"an approval asked for {asked!r:.40} ran {ran!r:.60}"
    assert Approval.objects.get(pk=approval_id).status == "approved"  # not consumed
    assert not events("access.allowed") and not events("access.outcome")
    # An exact `other` was asked, and refused by the server as a different call; an
    # inexact one (another Rows), and `asked` again, were refused here, unsent.
    inexact_other = isinstance(other, Rows)
    assert refused == [
        "invalid_request" if inexact_other else "approval_invalid",
        "invalid_request",
    ]
    denied = [e.reason for e in events("access.denied")]
    assert denied == ([] if inexact_other else ["approval_invalid"])
    # The asked call itself: a denial naming its approval, not ApprovalRequired.
    assert not isinstance(caught.value, ApprovalRequired)
    assert caught.value.reason == "invalid_request"
    assert "no approval can be used for these arguments" in caught.value.message
    assert approval_id in caught.value.message
    (asked_event,) = events("access.approval_required")
    assert str(asked_event.approval_id) == approval_id
    assert list(json.loads(asked_event.arguments)) == ["$inexact"]
    assert audit.verify_chain().ok


@pytest.mark.parametrize(("inexact", "exact"), SENT_ALIKE[:3])
def test_an_approval_for_exact_arguments_never_runs_inexact_ones_sent_alike(
    world, bob, inexact, exact
):
    """The other way round: approved for the text "inf" (or "report-\\udcff.csv", or
    {"1": "x"}), the approval ran delete(math.inf) (the file with the undecodable
    name, {1: "x"}). with_approval refuses arguments with no exact JSON form, unsent."""
    delete, ran = destructive(world["client"])
    with pytest.raises(ApprovalRequired) as caught:
        delete(exact)
    approval_id = caught.value.approval_id
    approvals.approval_approve(
        approval_id=approval_id, approver=bob, actor=Actor.user(bob), at=timezone.now()
    )

    with pytest.raises(AccessDenied) as refused:
        delete.with_approval(approval_id, inexact)
    assert refused.value.reason == "invalid_request" and refused.value.decision_id is None
    assert "no approval can be used for these arguments" in refused.value.message
    assert ran == [] and Approval.objects.get(pk=approval_id).status == "approved"
    assert len(events("access.approval_required")) == 1  # nothing else was asked
    assert not events("access.denied") and not events("access.allowed")

    assert delete.with_approval(approval_id, exact) == "deleted" and ran == [exact]
    assert Approval.objects.get(pk=approval_id).status == "consumed"
    (allowed,) = events("access.allowed")
    assert json.loads(allowed.arguments) == {"target": exact}


def test_a_function_that_raises_is_reported_failed_and_the_error_propagates(world):
    @world["client"].guarded(tool="repo", action="read", scope="repo:acme/x")
    def broken() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        broken()
    (allowed,) = events("access.allowed")
    assert DecisionOutcome.objects.get(decision_id=allowed.uid).outcome == "failed"
    assert json.loads(events("access.outcome")[0].data)["outcome"] == "failed"


def test_a_denied_call_does_not_run(world):
    calls = []

    @world["stranger"].guarded(tool="repo", action="read", scope="repo:acme/x")
    def read() -> None:
        calls.append(1)

    with pytest.raises(AccessDenied) as caught:
        read()
    assert not isinstance(caught.value, ApprovalRequired)
    assert calls == []
    assert (caught.value.reason, caught.value.decision.decision) == ("no_grant", "deny")
    (denied,) = events("access.denied")
    assert str(denied.uid) == caught.value.decision_id and denied.agent == "stranger"
    assert not events("access.outcome") and not DecisionOutcome.objects.exists()


def test_a_destructive_call_needs_an_approval_that_works_exactly_once(world, bob):
    calls = []

    @world["client"].guarded(tool="repo", action="delete", scope=lambda p: f"repo:acme/{p}")
    def delete(p: str) -> str:
        calls.append(p)
        return "deleted"

    with pytest.raises(ApprovalRequired) as caught:
        delete("old.py")
    approval_id = caught.value.approval_id
    assert calls == [] and caught.value.reason == "approval_required"
    assert world["client"].approval(approval_id)["status"] == "pending"
    with pytest.raises(GovernanceClientError) as not_yours:
        world["stranger"].approval(approval_id)
    assert (not_yours.value.status, not_yours.value.code) == (404, "not_found")

    approvals.approval_approve(
        approval_id=approval_id, approver=bob, actor=Actor.user(bob), at=timezone.now()
    )
    assert world["client"].approval(approval_id)["status"] == "approved"
    with pytest.raises(AccessDenied) as other_call:  # bound to the arguments' hash
        delete.with_approval(approval_id, "other.py")
    assert other_call.value.reason == "approval_invalid" and calls == []

    assert delete.with_approval(approval_id, "old.py") == "deleted" and calls == ["old.py"]
    assert Approval.objects.get(pk=approval_id).status == "consumed"
    with pytest.raises(AccessDenied) as again:
        delete.with_approval(approval_id, "old.py")
    assert again.value.reason == "approval_invalid" and calls == ["old.py"]


def test_a_bad_token_is_a_denial_not_an_error(world):
    client = GovernanceClient(world["url"], "agt_00000000_" + "x" * 43)
    decision = client.authorize("repo", "read", "repo:acme/x")
    assert (decision.decision, decision.reason, decision.status) == (
        "deny",
        "unauthenticated",
        401,
    )
    assert not AuditEvent.objects.filter(event_type__startswith="access.").exists()


def test_a_rate_limited_call_is_a_denial(world, settings):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "authorize": 1}
    assert world["client"].authorize("repo", "read", "repo:acme/x").allowed
    decision = world["client"].authorize("repo", "read", "repo:acme/x")
    assert (decision.decision, decision.reason, decision.status) == ("deny", "rate_limited", 429)


def test_the_servers_own_503_is_a_denial(world):
    from tests.test_fail_closed import refusing

    calls = []

    @world["client"].guarded(tool="repo", action="read", scope="repo:acme/x")
    def read() -> None:
        calls.append(1)

    with refusing("governance_auditevent", "INSERT"), pytest.raises(AccessDenied) as caught:
        read()
    assert calls == [] and caught.value.reason == "error"
    assert caught.value.decision.status == 503


def test_a_grant_request_goes_through_and_its_errors_come_back_typed(world):
    grant = world["stranger"].request_grant(
        "repo", ["read"], "repo:acme/docs/*", 3600, "needs to read the docs"
    )
    assert (grant["status"], grant["agent"], grant["requested_by_agent"]) == (
        "pending",
        "stranger",
        "stranger",
    )
    assert world["stranger"].grant_request(grant["id"])["id"] == grant["id"]
    assert events("grant.requested")[-1].agent == "stranger"
    with pytest.raises(GovernanceClientError) as caught:
        world["stranger"].request_grant("nope", ["read"], "repo:acme/x", 60, "x")
    assert (caught.value.status, caught.value.code) == (400, "unknown_tool")


def test_the_audit_chain_holds_after_all_that(world):
    world["client"].authorize("repo", "read", "repo:acme/x")
    world["stranger"].authorize("repo", "read", "repo:acme/x")
    assert audit.verify_chain().ok


# --- Against sockets that misbehave ------------------------------------------------------


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on: connecting is refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


class Stub:
    """An HTTP server on 127.0.0.1 that answers every request as told."""

    def __init__(self) -> None:
        self.status, self.body, self.headers = 200, b"{}", {"Content-Type": "application/json"}
        self.requests: list[dict[str, Any]] = []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                stub.requests.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "auth": self.headers.get("Authorization"),
                        "body": self.rfile.read(length) if length else b"",
                    }
                )
                self.send_response(stub.status)
                for key, value in stub.headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(stub.body)))
                self.end_headers()
                self.wfile.write(stub.body)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        # shutdown() waits for serve_forever to return, forever if its thread has
        # already died (a teardown that once hung a whole run): only a live one is asked.
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    def answer(self, status: int, body: Any, **headers: str) -> None:
        self.status = status
        self.body = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.headers = {"Content-Type": "application/json", **headers}


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub()
    yield server
    server.stop()


def guarded_probe(client: GovernanceClient) -> tuple[Any, list[int]]:
    calls: list[int] = []

    @client.guarded(tool="repo", action="read", scope="repo:acme/x")
    def probe() -> str:
        calls.append(1)
        return "ran"

    return probe, calls


def assert_denied(client: GovernanceClient, reason: str) -> AccessDenied:
    probe, calls = guarded_probe(client)
    with pytest.raises(AccessDenied) as caught:
        probe()
    assert calls == [], "the guarded function ran although access was not granted"
    assert caught.value.reason == reason and caught.value.decision.decision == "deny"
    assert not caught.value.decision.allowed
    return caught.value


def test_a_server_that_never_answers_is_a_denial_after_the_timeout(silent_port):
    client = GovernanceClient(f"http://127.0.0.1:{silent_port}", "t", timeout=0.5)
    started = time.monotonic()
    denied = assert_denied(client, "unreachable")
    assert 0.4 < time.monotonic() - started < 5
    assert "timed out" in denied.message


def test_a_refused_connection_is_a_denial(closed_port):
    client = GovernanceClient(f"http://127.0.0.1:{closed_port}", "t", timeout=2)
    denied = assert_denied(client, "unreachable")
    assert denied.decision.status is None


ALLOW = {
    "decision": "allow",
    "reason": "allowed",
    "message": "ok",
    "decision_id": "8f1c6a2e-0000-4000-8000-000000000000",
    "grant": 1,
    "approval": None,
    "expires_at": None,
    "break_glass": False,
}


@pytest.mark.parametrize(
    ("status", "body", "reason"),
    [
        pytest.param(503, ALLOW, "error", id="503-even-saying-allow"),
        pytest.param(503, {**ALLOW, "decision": "deny", "reason": "error"}, "error", id="503"),
        pytest.param(500, b"<h1>Server Error</h1>", "error", id="500-html"),
        pytest.param(502, b"", "error", id="502-empty"),
        pytest.param(200, b"allow", "error", id="200-not-json"),
        pytest.param(200, b"", "error", id="200-empty"),
        pytest.param(200, ["allow"], "error", id="200-a-list"),
        pytest.param(200, {"decision": "allow"}, "error", id="200-allow-without-fields"),
        pytest.param(
            200,
            {k: ALLOW[k] for k in ("decision", "reason", "message", "decision_id")},
            "error",
            id="200-allow-missing-fields-the-schema-requires",
        ),
        pytest.param(200, {**ALLOW, "decision": "ALLOW"}, "error", id="200-unknown-verdict"),
        pytest.param(200, {**ALLOW, "decision_id": None}, "error", id="200-allow-no-id"),
        pytest.param(200, {**ALLOW, "grant": "1"}, "error", id="200-wrongly-typed"),
        pytest.param(201, ALLOW, "error", id="201-allow"),
        pytest.param(
            200, {**ALLOW, "decision": "approval_required"}, "error", id="approval-without-id"
        ),
        pytest.param(
            401,
            {"error": {"code": "unauthenticated", "message": "A valid bearer token is required."}},
            "unauthenticated",
            id="401",
        ),
        pytest.param(
            429, {"error": {"code": "rate_limited", "message": "slow"}}, "rate_limited", id="429"
        ),  # fmt: skip
        pytest.param(403, b"Forbidden", "error", id="403-not-json"),
        # JSON json.loads would guess its way into from the bytes: not the service's.
        pytest.param(200, b"\xef\xbb\xbf" + json.dumps(ALLOW).encode(), "error", id="utf8-bom"),
        pytest.param(200, json.dumps(ALLOW).encode("utf-16"), "error", id="utf-16"),
    ],
)
def test_anything_but_a_clean_200_allow_is_a_denial(stub, status, body, reason):
    stub.answer(status, body)
    assert_denied(GovernanceClient(stub.url, "t"), reason)
    assert len(stub.requests) == 1  # asked once, never reported an outcome


# A date the parser overflows on (OverflowError, which escaped the client).
UNREADABLE_RETRY_AFTER = "Mon, 01 Jan 2020 99999999999999999999:00:00 GMT"


def test_a_rate_limited_decision_says_when_to_retry_and_a_bad_header_is_no_exception(stub):
    limited = {"error": {"code": "rate_limited", "message": "slow down"}}
    client = GovernanceClient(stub.url, "t")
    stub.answer(429, limited, **{"Retry-After": "17"})
    decision = client.authorize("repo", "read", "repo:acme/x")
    assert (decision.decision, decision.reason, decision.retry_after) == (
        "deny",
        "rate_limited",
        17,
    )
    for status, body in ((429, limited), (200, ALLOW)):
        stub.answer(status, body, **{"Retry-After": UNREADABLE_RETRY_AFTER})
        decision = client.authorize("repo", "read", "repo:acme/x")  # never raises
        assert decision.retry_after is None
        assert decision.decision == ("deny" if status == 429 else "allow")
    stub.answer(429, limited, **{"Retry-After": UNREADABLE_RETRY_AFTER})
    denied = assert_denied(client, "rate_limited")  # AccessDenied, not OverflowError
    assert denied.decision.status == 429
    with pytest.raises(GovernanceClientError) as caught:
        client.request_grant("repo", ["read"], "repo:x", 60, "why")
    assert (caught.value.code, caught.value.retry_after) == ("rate_limited", None)


def test_an_allow_that_does_not_say_it_is_json_is_a_denial(stub):
    stub.answer(200, ALLOW, **{"Content-Type": "text/html"})
    assert_denied(GovernanceClient(stub.url, "t"), "error")


def test_a_redirect_is_not_followed_and_is_a_denial(stub):
    stub.answer(302, b"", Location="/elsewhere")
    assert_denied(GovernanceClient(stub.url, "t"), "error")
    assert [r["path"] for r in stub.requests] == ["/api/v1/authorize"]


def test_the_stub_allow_body_really_allows(stub):
    """The control for the table above: the same body with a 200 runs the function."""
    stub.answer(200, ALLOW)
    probe, calls = guarded_probe(GovernanceClient(stub.url + "/api/v1/", "tok"))
    assert probe() == "ran" and calls == [1]
    asked, reported = stub.requests
    assert (asked["method"], asked["path"], asked["auth"]) == (
        "POST",
        "/api/v1/authorize",
        "Bearer tok",
    )
    assert json.loads(asked["body"]) == {
        "tool": "repo",
        "action": "read",
        "scope": "repo:acme/x",
        "arguments": {},
    }
    assert reported["path"] == f"/api/v1/decisions/{ALLOW['decision_id']}/outcome"


def test_an_outcome_that_cannot_be_reported_does_not_undo_the_call(stub):
    stub.answer(200, ALLOW)
    client = GovernanceClient(stub.url, "t")
    calls = []

    @client.guarded(tool="repo", action="read", scope="repo:acme/x")
    def probe() -> str:
        calls.append(1)
        stub.answer(503, b"down")  # the outcome report fails
        return "ran"

    assert probe() == "ran" and calls == [1] and len(stub.requests) == 2


def test_non_decision_calls_raise_typed_errors(stub, closed_port):
    stub.answer(429, {"error": {"code": "rate_limited", "message": "x"}}, **{"Retry-After": "7"})
    with pytest.raises(GovernanceClientError) as caught:
        GovernanceClient(stub.url, "t").request_grant("repo", ["read"], "repo:x", 60, "why")
    assert (caught.value.code, caught.value.status, caught.value.retry_after) == (
        "rate_limited",
        429,
        7,
    )
    with pytest.raises(GovernanceClientError) as down:
        GovernanceClient(f"http://127.0.0.1:{closed_port}", "t").approval("a")
    assert down.value.code == "unreachable"


def test_only_http_urls_are_accepted_and_plain_http_only_to_this_machine():
    for url in ("file:///etc/passwd", "http://governance.example", "http://10.0.0.5:8000"):
        with pytest.raises(ValueError):
            GovernanceClient(url, "t")
    for url in ("https://governance.example", "http://127.0.0.1:8000", "http://[::1]:8000/"):
        assert GovernanceClient(url, "t").base_url == url.rstrip("/")


def test_plain_http_to_this_machine_never_goes_through_an_environment_proxy(world, monkeypatch):
    """An HTTP_PROXY in the environment would see the token of a plain-http call: the
    client goes straight to the server (a proxy that answered would be a forged answer)."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # closed: a proxied call fails
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    client = GovernanceClient(world["url"], world["client"]._token)
    decision = client.authorize(tool="repo", action="read", scope="repo:acme/x")
    assert decision.allowed
    (allowed,) = events("access.allowed")
    assert allowed.uid.hex == decision.decision_id.replace("-", "")


def test_a_decision_is_allowed_only_when_it_says_allow():
    assert Decision("allow", "allowed", "").allowed
    for verdict in ("deny", "approval_required", "Allow", ""):
        assert not Decision(verdict, "x", "").allowed


# --- One deadline for the whole call ------------------------------------------------------


@pytest.fixture
def dripping_server() -> Iterator[int]:
    """A port on 127.0.0.1 whose server answers allow in 8-byte pieces 0.15 s apart,
    headers and body alike: each piece comes well within a 0.5 s socket timeout."""
    body = json.dumps(ALLOW).encode()
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                try:
                    request = b""
                    while b"\r\n\r\n" not in request:
                        request += conn.recv(65536)
                    for start in range(0, len(answer), 8):
                        time.sleep(0.15)
                        conn.sendall(answer[start : start + 8])
                except OSError:  # the client gave up
                    pass

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def test_an_allow_dripped_out_past_the_timeout_is_a_denial(dripping_server):
    """A socket timeout bounds one read; the client's bounds the whole call. Before,
    the ~30 pieces each arrived in time and the call ended in allow after ~4.5 s."""
    client = GovernanceClient(f"http://127.0.0.1:{dripping_server}", "t", timeout=0.5)
    started = time.monotonic()
    denied = assert_denied(client, "unreachable")
    assert time.monotonic() - started < 1.5
    assert "timed out" in denied.message and denied.decision.status is None


# --- Nothing escapes: a denial before the call, a log line after it -----------------------


DEEP_JSON = b"[" * 200_000 + b"]" * 200_000  # json.loads raises RecursionError, not ValueError


def test_an_answer_nested_too_deep_to_parse_is_a_denial(stub):
    stub.answer(200, DEEP_JSON)
    decision = GovernanceClient(stub.url, "t").authorize("repo", "read", "repo:acme/x")
    assert (decision.decision, decision.reason, decision.status) == ("deny", "error", 200)
    assert_denied(GovernanceClient(stub.url, "t"), "error")


def test_arguments_nested_too_deep_to_send_are_a_denial_and_nothing_is_sent(stub):
    stub.answer(200, ALLOW)
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    client = GovernanceClient(stub.url, "t")
    decision = client.authorize("repo", "read", "repo:acme/x", arguments={"x": deep})
    assert (decision.decision, decision.reason) == ("deny", "invalid_request")
    assert "RecursionError" in decision.message
    calls = []

    @client.guarded(tool="repo", action="read", scope="repo:acme/x")
    def probe(x: Any) -> None:
        calls.append(1)

    with pytest.raises(AccessDenied) as caught:
        probe(deep)
    assert caught.value.reason == "invalid_request" and calls == [] and stub.requests == []


class Level(enum.IntEnum):
    HIGH = 1


class Mode(enum.StrEnum):
    FAST = "fast"


@pytest.mark.parametrize(
    ("value", "sent"),
    [
        (Level.HIGH, 1),  # json.dumps writes the int
        (Mode.FAST, "fast"),
        (collections.namedtuple("Pair", "a b")(1, 2), [1, 2]),
        (collections.OrderedDict(a=1), {"a": 1}),
        ({"k": [{2: "x"}]}, {"k": [{"2": "x"}]}),  # deep inside
        ([1, float("-inf")], [1, "-inf"]),
        ({"a", "b"} - {"b"}, "{'a'}"),
    ],
)
def test_arguments_another_value_sends_alike_go_wrapped_and_never_with_an_approval(
    stub, value, sent
):
    stub.answer(200, ALLOW)
    client = GovernanceClient(stub.url, "t")
    assert client.authorize("repo", "read", "repo:acme/x", arguments={"arg": value}).allowed
    (asked,) = _asked(stub)
    assert asked["arguments"] == {"$inexact": {"arg": sent}}
    decision = client.authorize(
        "repo", "delete", "repo:acme/x", arguments={"arg": value}, approval="a-1"
    )
    assert (decision.decision, decision.reason) == ("deny", "invalid_request")
    assert "'arg' holds" in decision.message and len(stub.requests) == 1  # unsent


def test_exact_arguments_go_as_they_are_and_one_named_like_the_wrapper_is_wrapped(stub):
    stub.answer(200, ALLOW)
    client = GovernanceClient(stub.url, "t")
    exact = {"a": [1, 2.5, -0.0, True, None, "t\u00e9"], "b": (1, "x"), "c": {"d": {}}}
    assert client.authorize("repo", "read", "repo:acme/x", arguments=exact).allowed
    assert client.authorize("repo", "read", "repo:acme/x", arguments=exact, approval="a").allowed
    for asked in _asked(stub):
        assert asked["arguments"] == {**exact, "b": [1, "x"]}
    assert math.copysign(1, _asked(stub)[0]["arguments"]["a"][2]) == -1  # -0.0, not 0
    # Exact, but the wrapper's own form: wrapped again, so it cannot pass for the
    # wrapped form of {"arg": math.inf}.
    named = {"$inexact": {"arg": "inf"}}
    assert client.authorize("repo", "read", "repo:acme/x", arguments=named).allowed
    assert _asked(stub)[-1]["arguments"] == {"$inexact": named}
    refused = client.authorize("repo", "read", "repo:acme/x", arguments=named, approval="a")
    assert (refused.reason, len(stub.requests)) == ("invalid_request", 3)


def test_an_approval_required_answer_for_inexact_arguments_is_a_denial(stub):
    stub.answer(200, {**ALLOW, "decision": "approval_required", "approval": "ap-1"})
    client = GovernanceClient(stub.url, "t")
    delete, ran = destructive(client)
    with pytest.raises(ApprovalRequired):
        delete("plain.txt")
    with pytest.raises(AccessDenied) as caught:
        delete(math.nan)
    assert not isinstance(caught.value, ApprovalRequired) and ran == []
    decision = caught.value.decision
    assert (decision.decision, decision.reason, decision.approval) == (
        "deny",
        "invalid_request",
        "ap-1",
    )
    assert "Approval ap-1 was asked for, but no approval can be used" in decision.message
    assert "'target' holds the float nan" in decision.message


def test_an_outcome_answer_nested_too_deep_does_not_fail_the_call_that_ran(stub, caplog):
    """Raising after the side effect would invite a retry, and the tool would run twice."""
    stub.answer(200, ALLOW)
    client = GovernanceClient(stub.url, "t")
    calls = []

    @client.guarded(tool="repo", action="delete", scope="repo:acme/x")
    def pay() -> str:
        calls.append(1)
        stub.answer(201, DEEP_JSON)
        return "paid"

    assert pay() == "paid" and calls == [1] and len(stub.requests) == 2
    assert "could not report the outcome" in caplog.text


def test_a_result_whose_repr_raises_is_still_returned_and_reported(stub):
    stub.answer(200, ALLOW)
    client = GovernanceClient(stub.url, "t")

    class Unprintable:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    result = Unprintable()

    @client.guarded(tool="repo", action="read", scope="repo:acme/x")
    def probe() -> Unprintable:
        return result

    assert probe() is result
    asked, reported = stub.requests
    assert reported["path"] == f"/api/v1/decisions/{ALLOW['decision_id']}/outcome"
    assert json.loads(reported["body"]) == {"outcome": "succeeded"}  # no digest to give


# --- async and generator tools -------------------------------------------------------------


def outcomes(stub: Stub) -> list[str]:
    return [
        json.loads(r["body"])["outcome"] for r in stub.requests if r["path"].endswith("/outcome")
    ]


def test_an_async_tool_runs_inside_the_check_and_its_real_outcome_is_reported(stub):
    import asyncio

    stub.answer(200, ALLOW)
    client = GovernanceClient(stub.url, "t")
    seen: list[int] = []

    @client.guarded(tool="repo", action="delete", scope=lambda p: f"repo:acme/{p}")
    async def delete(p: str) -> str:
        seen.append(len(stub.requests))  # asked, not yet reported
        await asyncio.sleep(0)
        if p == "bad":
            raise RuntimeError("failed for real")
        return "deleted"

    assert asyncio.run(delete("old.py")) == "deleted" and seen == [1]
    assert outcomes(stub) == ["succeeded"]
    with pytest.raises(RuntimeError):
        asyncio.run(delete("bad"))
    assert outcomes(stub) == ["succeeded", "failed"]  # before: "succeeded" for both
    assert json.loads(stub.requests[0]["body"])["arguments"] == {"p": "old.py"}

    stub.answer(200, {**ALLOW, "decision": "deny", "reason": "no_grant"})
    with pytest.raises(AccessDenied):
        asyncio.run(delete.with_approval("a-1", "x"))
    assert seen == [1, 3]  # the denied call never ran


def test_an_async_tool_asks_without_blocking_the_event_loop(silent_port):
    import asyncio

    client = GovernanceClient(f"http://127.0.0.1:{silent_port}", "t", timeout=0.5)

    @client.guarded(tool="repo", action="read", scope="repo:acme/x")
    async def probe() -> None:
        raise AssertionError("must not run")

    async def main() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        tick = asyncio.create_task(ticker())
        with pytest.raises(AccessDenied) as caught:
            await probe()
        tick.cancel()
        assert caught.value.reason == "unreachable"
        return ticks

    assert asyncio.run(main()) >= 5


def test_a_generator_tool_is_refused_when_decorated(stub):
    """Calling one only makes a generator: its body would run later, unchecked."""
    client = GovernanceClient(stub.url, "t")
    guard = client.guarded(tool="repo", action="delete", scope="repo:acme/x")

    def lines() -> Iterator[str]:
        yield "x"

    async def async_lines() -> Any:
        yield "x"

    for fn in (lines, async_lines):
        with pytest.raises(TypeError, match="generator"):
            guard(fn)
    assert stub.requests == []


def _asked(stub: Stub) -> list[dict[str, Any]]:
    return [json.loads(r["body"]) for r in stub.requests if r["path"].endswith("/authorize")]


def test_a_token_read_from_a_file_keeps_working_and_a_bad_one_is_never_quoted(stub):
    """`open("token").read()` keeps the newline: http.client refused the header with an
    error quoting it, and the client put that error (the whole token) in the denial,
    in its exceptions and in its log. The newline is stripped now; a token that is
    still not printable ASCII is refused when the client is made, without quoting it."""
    secret = "agt_deadbeef_" + "S3cr3t" * 5
    stub.answer(200, ALLOW)
    client = GovernanceClient(stub.url, secret + "\n")
    assert client.authorize("repo", "read", "repo:acme/x").allowed
    assert stub.requests[-1]["auth"] == f"Bearer {secret}"
    for bad in (secret[:10] + "\n" + secret[10:], secret + " x", "", "tök"):
        with pytest.raises(ValueError) as caught:
            GovernanceClient(stub.url, bad)
        assert "S3cr3t" not in str(caught.value)


@pytest.mark.parametrize(
    "timeout", [None, 0, -1, float("inf"), float("nan"), True, "5", 1e10, 3600.5]
)
def test_a_timeout_that_cannot_bound_a_call_is_refused_when_the_client_is_made(stub, timeout):
    """timeout=None (urllib's "no timeout") was taken, and every authorize() then raised
    TypeError instead of answering with a denial; 1e10 was taken, and every call then
    came back "unreachable" (the socket's deadline overflowed)."""
    with pytest.raises(ValueError, match="timeout"):
        GovernanceClient(stub.url, "t", timeout=timeout)


def _passthrough(fn: Any) -> Any:
    """An ordinary decorator (logging, retry, tracing) under @guarded."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def test_an_async_tool_that_does_not_look_like_one_is_reported_after_it_ran(stub):
    """An `async def` under another decorator, or an object with `async def __call__`,
    took the sync path: "succeeded" was reported (for the coroutine object) before the
    body ran, whatever the body then did."""
    import asyncio

    stub.answer(200, ALLOW)
    client = GovernanceClient(stub.url, "t")
    guard = client.guarded(tool="repo", action="delete", scope="repo:acme/x")
    ran: list[str] = []

    @guard
    @_passthrough
    async def wrapped(p: str) -> str:
        ran.append(p)
        raise RuntimeError("the delete failed")

    class Callable_:
        async def __call__(self, p: str) -> str:
            ran.append(p)
            return "deleted"

    pending = wrapped("a.py")
    assert outcomes(stub) == [] and ran == []  # asked, nothing ran, nothing reported
    with pytest.raises(RuntimeError):
        asyncio.run(pending)
    assert ran == ["a.py"] and outcomes(stub) == ["failed"]

    pending = guard(Callable_())("b.py")
    assert outcomes(stub) == ["failed"] and ran == ["a.py"]
    assert asyncio.run(pending) == "deleted"
    assert ran == ["a.py", "b.py"] and outcomes(stub) == ["failed", "succeeded"]


def test_with_approval_on_a_guarded_method_passes_the_instance(stub):
    """`repo.delete.with_approval(id, p)` did not pass `repo` (an attribute of a plain
    function is not bound), so the retry after ApprovalRequired could not be described."""
    import asyncio

    stub.answer(200, ALLOW)
    client = GovernanceClient(stub.url, "t")
    guard = client.guarded(tool="repo", action="delete", scope=lambda self, p: f"repo:acme/{p}")

    class Repo:
        def __init__(self, name: str) -> None:
            self.name = name

        @guard
        def delete(self, p: str) -> str:
            return f"{self.name} deleted {p}"

        @guard
        async def adelete(self, p: str) -> str:
            return f"{self.name} deleted {p} later"

    repo = Repo("r1")
    assert repo.delete("x") == "r1 deleted x"
    assert repo.delete.with_approval("a-1", "y") == "r1 deleted y"
    assert asyncio.run(repo.adelete.with_approval("a-2", "z")) == "r1 deleted z later"
    assert Repo.delete(repo, "w") == "r1 deleted w"  # read from the class: unbound
    asked = _asked(stub)
    assert [(a["scope"], a.get("approval"), a["arguments"]) for a in asked] == [
        ("repo:acme/x", None, {"p": "x"}),
        ("repo:acme/y", "a-1", {"p": "y"}),
        ("repo:acme/z", "a-2", {"p": "z"}),
        ("repo:acme/w", None, {"p": "w"}),
    ]
    assert Repo.delete.__name__ == "delete" and outcomes(stub) == ["succeeded"] * 4
    # Still a bound method in every way a framework looks at one.
    assert inspect.ismethod(repo.delete) and repo.delete.__self__ is repo
    assert list(inspect.signature(repo.delete).parameters) == ["p"]
    assert repo.delete == repo.delete and repo.delete != Repo("r2").delete
    assert inspect.iscoroutinefunction(repo.adelete)
    assert pickle.loads(pickle.dumps(_PICKLED.run)).__self__.name == "pickled"


_LOCAL = GovernanceClient("http://127.0.0.1:9", "t")


class _Pickled:
    def __init__(self) -> None:
        self.name = "pickled"

    @_LOCAL.guarded(tool="repo", action="read", scope="repo:acme/x")
    def run(self) -> None: ...


_PICKLED = _Pickled()


def test_a_task_a_sync_tool_starts_is_returned_as_it_is(stub):
    """Only a coroutine (nothing ran yet) is deferred; a Task the tool started stays a
    Task the caller can cancel or watch."""
    import asyncio

    stub.answer(200, ALLOW)
    client = GovernanceClient(stub.url, "t")

    async def main() -> Any:
        async def work() -> str:
            return "done"

        @client.guarded(tool="repo", action="read", scope="repo:acme/x")
        def start() -> Any:
            return asyncio.ensure_future(work())

        task = start()  # asks in the loop: a test; real callers ask from a thread
        assert isinstance(task, asyncio.Task)
        return await task

    assert asyncio.run(main()) == "done" and outcomes(stub) == ["succeeded"]


def test_a_generator_tool_under_another_decorator_is_refused_when_decorated(stub):
    """A generator function under a decorator made with functools.wraps is seen
    through: refused before anything is asked or run, as a bare one is."""
    guard = GovernanceClient(stub.url, "t").guarded(tool="repo", action="read", scope="x")

    @_passthrough
    def lines(p: str) -> Iterator[str]:
        yield p

    @_passthrough
    async def async_lines(p: str) -> Any:
        yield p

    for fn in (lines, async_lines):
        with pytest.raises(TypeError, match="generator"):
            guard(fn)
    assert stub.requests == []


def _opaque(fn: Any) -> Any:
    """A decorator that does not say what it wraps (no functools.wraps)."""
    return lambda *args, **kwargs: fn(*args, **kwargs)


def _reported(world_events: list[AuditEvent]) -> list[tuple[str, str]]:
    return [
        (json.loads(e.data)["decision_id"], json.loads(e.data)["outcome"]) for e in world_events
    ]


def test_a_returned_generator_is_reported_when_it_ends_not_before(world):
    """A generator no decorator owns up to, or a function that did work and returned a
    lazy rest: part of the call runs as it is iterated, so its outcome is reported when
    the iteration ends (succeeded, failed), or "aborted" when it is closed or dropped
    first. It used to be refused after the work was done: reported "aborted" with a
    TypeError inviting a retry that would do it twice."""
    guard = world["client"].guarded(tool="repo", action="read", scope="repo:acme/x")
    fetched: list[str] = []

    @guard
    def fetch_all(paths: list[str]) -> Iterator[str]:
        fetched.extend(paths)  # the work, done now
        return (p for p in paths)  # and a lazy view of it

    @guard
    @_opaque
    def lines(fail: bool) -> Iterator[str]:
        yield "x"
        if fail:
            raise RuntimeError("the read failed half-way")
        yield "y"

    assert list(fetch_all(["a", "b"])) == ["a", "b"] and fetched == ["a", "b"]
    assert len(events("access.outcome")) == 1
    gen = lines(False)
    assert len(events("access.outcome")) == 1  # not run yet: not reported yet
    assert list(gen) == ["x", "y"]
    with pytest.raises(RuntimeError, match="half-way"):
        list(lines(True))
    started = lines(False)
    assert next(started) == "x"
    started.close()
    lines(False)  # dropped before its first step (CPython frees it at once)
    gc.collect()
    allowed = events("access.allowed")
    assert _reported(events("access.outcome")) == [
        (str(e.uid), outcome)
        for e, outcome in zip(
            allowed, ["succeeded", "succeeded", "failed", "aborted", "aborted"], strict=True
        )
    ]
    assert [o.outcome for o in DecisionOutcome.objects.order_by("id")] == [
        "succeeded",
        "succeeded",
        "failed",
        "aborted",
        "aborted",
    ]


def test_a_returned_async_generator_is_reported_when_it_ends(world):
    import asyncio

    guard = world["client"].guarded(tool="repo", action="read", scope="repo:acme/x")

    @guard
    @_opaque
    async def lines(fail: bool) -> Any:
        yield "x"
        if fail:
            raise RuntimeError("the read failed half-way")

    async def main() -> list[str]:
        got = [item async for item in await asyncio.to_thread(lines, False)]
        with pytest.raises(RuntimeError, match="half-way"):
            async for _ in await asyncio.to_thread(lines, True):
                pass
        return got

    assert asyncio.run(main()) == ["x"]
    allowed = events("access.allowed")
    assert _reported(events("access.outcome")) == [
        (str(allowed[0].uid), "succeeded"),
        (str(allowed[1].uid), "failed"),
    ]


# --- What the reviewers found (each failed before its fix) ---------------------------------


@pytest.mark.parametrize(
    "url",
    [
        # urlsplit reads host ::1 (loopback: plain http allowed); http.client looked up
        # the name "[::1]evil.example" and sent the token in the clear to its address.
        "http://[::1]evil.example:8080",
        "http://[::1]evil.example",
        "http://127.0.0.1:8000/gov?x=1",  # the API's paths would follow the query
        "http://127.0.0.1:8000/gov#part",  # ...or be cut off with the fragment
        "http://127.0.0.1:8000/gov;p",
    ],
)
def test_a_base_url_the_client_could_not_use_as_written_is_refused(url):
    with pytest.raises(ValueError, match="base_url"):
        GovernanceClient(url, "tok")


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1]:8000",
        "http://LOCALHOST:8000/gov/",
        "https://Gov.Example/api/v1",
        "http://[::1]",
    ],
)
def test_a_base_url_with_a_plain_host_is_still_accepted(url):
    assert GovernanceClient(url, "tok").base_url == url.rstrip("/").removesuffix("/api/v1")


def test_a_host_lookup_that_hangs_is_a_denial_within_the_timeout(stub, monkeypatch):
    """The timeout bounds the whole call, the name's lookup too: a resolver that does
    not answer held a 1 s call for 10 s. A fake getaddrinfo stands in for the silent
    DNS server (the tests may not reach any resolver but 127.0.0.1's)."""
    from tests.conftest import lookup_hangs

    stub.answer(200, ALLOW)
    port = stub.server.server_address[1]
    with lookup_hangs(monkeypatch, "localhost"):
        started = time.monotonic()
        denied = assert_denied(GovernanceClient(f"http://localhost:{port}", "t", 1), "unreachable")
        took = time.monotonic() - started
    assert took < 3 and "looked up" in denied.decision.message
    assert stub.requests == []
    # The same name, answered at once, is asked and allowed.
    probe, calls = guarded_probe(GovernanceClient(f"http://localhost:{port}", "t", 1))
    assert probe() == "ran" and calls == [1] and len(stub.requests) == 2


def test_an_async_generator_dropped_on_the_event_loop_is_reported_off_it(world, monkeypatch):
    """Dropped after its first item, its "aborted" report was made by the finalizer on
    the loop's own thread: a blocking HTTP call that froze the loop for up to the
    client's timeout."""
    import asyncio

    client = world["client"]
    reporters: list[tuple[str, bool]] = []
    report = client._report_quietly

    def recording(*args: Any, **kwargs: Any) -> None:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        reporters.append((threading.current_thread().name, on_loop))
        report(*args, **kwargs)

    monkeypatch.setattr(client, "_report_quietly", recording)

    @client.guarded(tool="repo", action="read", scope="repo:acme/x")
    @_opaque
    async def rows() -> Any:
        for i in range(10):
            yield i

    async def main() -> int:
        gen = await asyncio.to_thread(rows)
        first = await gen.__anext__()
        del gen  # stop early: CPython frees it at once, on the loop's thread
        await asyncio.sleep(0.2)
        return first

    assert asyncio.run(main()) == 0
    for thread in threading.enumerate():
        if thread.name == "report-outcome":
            thread.join(10)
    assert reporters and all(not on_loop for _, on_loop in reporters), reporters
    (allowed,) = events("access.allowed")
    assert _reported(events("access.outcome")) == [(str(allowed.uid), "aborted")]


def test_a_large_result_is_digested_from_its_bytes_not_a_repr_of_them(world):
    import tracemalloc

    guard = world["client"].guarded(tool="repo", action="read", scope="repo:acme/x")
    blob = b"\x00" * (16 << 20)
    text = "é" * (4 << 20)

    @guard
    def read_blob() -> bytes:
        return blob

    @guard
    def read_text() -> str:
        return text

    tracemalloc.start()
    try:
        assert read_blob() is blob
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # the repr alone was 64 MiB, its encoding as much again
    assert read_text() is text
    digests = [json.loads(e.data)["result_digest"] for e in events("access.outcome")]
    assert digests == [
        hashlib.sha256(blob).hexdigest(),
        hashlib.sha256(text.encode()).hexdigest(),
    ]
