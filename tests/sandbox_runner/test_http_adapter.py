"""The HTTP authorizer adapter and the sandbox endpoints it reports through.

The end-to-end test runs a real container (Docker) whose runner talks to the
app served by the live_server fixture on 127.0.0.1: the run record and every
audit event, one per egress attempt, are on the server. The others call the
endpoints with real tokens: another agent's run is a 404, malformed bodies are
400s that write nothing.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from governance.audit import Actor
from governance.codes import EventType
from governance.models import AuditEvent, SandboxRun
from governance.services import agents
from sandbox_runner.authorizers import HttpAuthorizer
from sandbox_runner.runner import EXIT_DENIED
from tests.sandbox_runner.conftest import events_of, leftovers, run_record
from tests.sandbox_runner.test_docker_probes import run
from tests.sandbox_runner.test_egress_proxy import SCRIPT
from tests.sandbox_runner.test_egress_proxy import servers as egress_servers
from tests.sandbox_runner.test_proxy import SMUGGLED, wait_for
from tests.sandbox_runner.test_proxy import listener as proxy_listener

servers = egress_servers  # the two local HTTP servers fixture, shared
listener = proxy_listener  # a local server that keeps what it was sent

RUNS = "/api/v1/sandbox/runs"


def _token(agent: Any, alice: Any) -> str:
    _, plaintext = agents.token_issue(
        created_by=alice, agent=agent, actor=Actor.system("test"), at=timezone.now()
    )
    return plaintext


@pytest.mark.django_db(transaction=True)
def test_a_docker_run_over_http_is_recorded_on_the_server_with_every_egress_attempt(
    live_server,
    docker_client,
    code_exec,
    spec_for,
    servers,
    alice,
):
    a, b = servers
    code_exec.grant(egress=[f"127.0.0.1:{a.port}"], limits={"memory_mb": 200})
    authorizer = HttpAuthorizer(live_server.url, _token(code_exec.agent, alice))
    spec = spec_for(SCRIPT.format(a=a.port, b=b.port), backend="docker", limits={"pids": 32})
    outcome, out, err = run(spec, authorizer)

    assert outcome.exit_code == 0, err
    assert out.splitlines()[:3] == ["A 200 server-a", "B 403", "GET 200 server-a"]
    assert a.hits == ["/tunnel", "/plain"] and b.hits == []
    # The server holds the run record, tied to the decision the runner received.
    record = run_record(spec.run_id)
    assert record.status == "finished" and record.exit_code == 0
    assert record.decision == "allow" and record.decision_id == outcome.auth.decision_id
    assert record.agent == "coder" and record.backend == "docker"
    assert record.script_sha256 == spec.script_sha256 and record.container_id
    assert record.image_digest.startswith("sha256:")
    assert record.limits == {
        "memory_mb": 200,
        "cpus": 1.0,
        "pids": 32,
        "wall_seconds": 60,
        "scratch_mb": 64,
    }
    assert record.stdout_excerpt.startswith("A 200 server-a")
    assert record.enforcement and record.deadline_at is not None
    # Three attempts were made through the proxy: three events, in order, on the server.
    egress = [e for e in events_of(spec.run_id) if e.startswith("sandbox.egress")]
    assert egress == ["sandbox.egress.allowed", "sandbox.egress.denied", "sandbox.egress.allowed"]
    destinations = [
        json.loads(e.data)["destination"]
        for e in AuditEvent.objects.order_by("seq")
        if e.event_type.startswith("sandbox.egress")
    ]
    assert destinations == [f"127.0.0.1:{p}" for p in (a.port, b.port, a.port)]
    assert [e for e in events_of(spec.run_id) if not e.startswith("sandbox.egress")] == [
        "sandbox.run.requested",
        "sandbox.run.started",
        "sandbox.run.finished",
    ]
    assert leftovers("docker", spec.run_id) == []


TUNNEL = """
import socket
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"CONNECT localhost:{port} HTTP/1.1\\r\\n\\r\\n")
print(s.recv(1024).split(b"\\r\\n")[0].decode())
s.sendall(b"\\r\\nGET /x HTTP/1.1\\r\\nHost: other-tenant.example\\r\\n\\r\\n")
print(s.recv(1024))
"""


@pytest.mark.django_db(transaction=True)
def test_plain_http_down_a_tunnel_to_a_named_host_is_a_not_tls_denial_on_the_server(
    live_server, docker_client, code_exec, spec_for, listener, alice
):
    """A blank line before the request line hid it from the proxy's HTTP check. A
    tunnel to a named host now opens only for a ClientHello naming it: the server
    receives nothing, and the denial is on record (the API takes `not_tls`)."""
    port, received = listener
    # localhost resolves (from /etc/hosts) to the test's own listener; the grant names
    # the loopback addresses too, so the name is not refused as internal.
    code_exec.grant(egress=[f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"])
    authorizer = HttpAuthorizer(live_server.url, _token(code_exec.agent, alice))
    spec = spec_for(TUNNEL.format(port=port), backend="docker")
    outcome, out, err = run(spec, authorizer)
    assert outcome.exit_code == 0, err
    assert out.splitlines() == ["HTTP/1.1 200 Connection established", "b''"]
    assert wait_for(received) == [b""]
    denials = [
        (e.event_type, e.reason, json.loads(e.data)["destination"])
        for e in AuditEvent.objects.order_by("seq")
        if e.event_type.startswith("sandbox.egress")
    ]
    assert denials == [
        ("sandbox.egress.allowed", "egress_allowed", f"localhost:{port}"),
        ("sandbox.egress.denied", "egress_not_tls", f"localhost:{port}"),
    ]
    assert run_record(spec.run_id).status == "finished"
    assert leftovers("docker", spec.run_id) == []


SMUGGLING = """
import socket
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall({payload!r})
print(s.recv(1024).split(b"\\r\\n")[0].decode())
"""


@pytest.mark.django_db(transaction=True)
def test_a_request_with_a_second_one_behind_bare_lfs_is_a_bad_request_denial_on_the_server(
    live_server, docker_client, code_exec, spec_for, servers, alice
):
    a, _ = servers
    code_exec.grant(egress=[f"127.0.0.1:{a.port}"])
    authorizer = HttpAuthorizer(live_server.url, _token(code_exec.agent, alice))
    payload = SMUGGLED.format(port=a.port).encode()
    spec = spec_for(SMUGGLING.format(payload=payload), backend="docker")
    outcome, out, err = run(spec, authorizer)
    assert outcome.exit_code == 0, err
    assert out == "HTTP/1.1 400 Bad Request\n"
    assert a.hits == []  # neither request reached the server
    (denied,) = [e for e in AuditEvent.objects.all() if e.event_type.startswith("sandbox.egress")]
    assert (denied.event_type, denied.reason) == ("sandbox.egress.denied", "egress_bad_request")
    assert json.loads(denied.data)["run_id"] == spec.run_id
    assert run_record(spec.run_id).status == "finished"
    assert leftovers("docker", spec.run_id) == []


NUL_HOST = """
import socket
print("the output the run's record must keep", flush=True)
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"CONNECT a\\x00b:1 HTTP/1.1\\r\\n\\r\\n")
print(s.recv(1024).split(b"\\r\\n")[0].decode())
"""


@pytest.mark.django_db(transaction=True)
def test_a_nul_in_a_connect_host_is_recorded_escaped_and_the_run_ends_on_record(
    live_server, docker_client, code_exec, spec_for, alice
):
    """The proxy reported the raw text; the server refused it (400), and the runner
    then never recorded how the run ended (its output's hash and exit status)."""
    code_exec.grant(egress=["127.0.0.1:9"])
    authorizer = HttpAuthorizer(live_server.url, _token(code_exec.agent, alice))
    spec = spec_for(NUL_HOST, backend="docker")
    outcome, out, err = run(spec, authorizer)
    assert outcome.exit_code == 0, err
    assert out.splitlines()[-1] == "HTTP/1.1 400 Bad Request"
    record = run_record(spec.run_id)
    assert record.status == "finished" and record.exit_code == 0 and record.error == ""
    assert record.stdout_sha256 == outcome.result.stdout.sha256
    assert events_of(spec.run_id) == [
        "sandbox.run.requested",
        "sandbox.run.started",
        "sandbox.egress.denied",
        "sandbox.run.finished",
    ]
    denied = AuditEvent.objects.get(event_type="sandbox.egress.denied")
    assert denied.reason == "egress_bad_request"
    assert json.loads(denied.data)["destination"] == "CONNECT a\\x00b:1 HTTP/1.1:0"
    assert leftovers("docker", spec.run_id) == []


@pytest.mark.django_db(transaction=True)
def test_a_request_above_the_grant_is_denied_over_http_and_nothing_starts(
    live_server, docker_client, code_exec, spec_for, alice
):
    code_exec.grant(limits={"memory_mb": 128})
    authorizer = HttpAuthorizer(live_server.url, _token(code_exec.agent, alice))
    before = {c.id for c in docker_client.containers.list(all=True)}
    spec = spec_for("print(1)", backend="docker", limits={"memory_mb": 512})
    outcome, _, _ = run(spec, authorizer)
    assert outcome.exit_code == EXIT_DENIED and outcome.auth.reason == "limit_exceeds_grant"
    assert {c.id for c in docker_client.containers.list(all=True)} == before
    record = run_record(spec.run_id)
    assert record.status == "denied" and record.reason == "limit_exceeds_grant"
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.denied"]


# --- The endpoints, with real tokens (no engine needed) ----------------------------------


def _ask(run_id: str, **kw: Any) -> dict[str, Any]:
    body = {"run_id": run_id, "task": "SBX-1", "backend": "bubblewrap",
            "image": "governance-sandbox:bookworm", "command": ["python3", "-c", "1"]}  # fmt: skip
    return {**body, **kw}


STREAM = {"excerpt": "", "sha256": hashlib.sha256(b"").hexdigest(), "bytes": 0, "truncated": False}


def _started(decision_id: str) -> dict[str, Any]:
    return {"decision_id": decision_id, "container_id": "c1", "image_digest": "sha256:" + "1" * 64,
            "deadline": timezone.now().timestamp() + 60,
            "enforcement": {"pids": "cgroup"}}  # fmt: skip


def _finished(decision_id: str) -> dict[str, Any]:
    return {"decision_id": decision_id, "exit_code": 0, "timed_out": False, "oom_killed": False,
            "stdout": STREAM, "stderr": STREAM}  # fmt: skip


def _egress(decision_id: str) -> dict[str, Any]:
    return {"decision_id": decision_id, "reason": "not_allowlisted",
            "host": "127.0.0.1", "port": 9, "address": "127.0.0.1"}  # fmt: skip


@pytest.fixture
def two_agents(code_exec, make_agent, make_grant, agent_client):
    """A (coder) has a live execute grant and a run it was allowed; B has its own grant."""
    code_exec.grant()
    bot_b = make_agent("other")
    make_grant(
        bot_b, code_exec.tool, actions=("execute",), scope="sandbox:*",
        starts_at=timezone.now() - timedelta(minutes=30), duration=timedelta(days=3),
    )  # fmt: skip
    a, b = agent_client(code_exec.agent), agent_client(bot_b)
    run_id = str(uuid.uuid4())
    answer = a.post(RUNS, _ask(run_id), format="json")
    assert answer.status_code == 201, answer.content
    assert answer.json()["decision"] == "allow"
    return a, b, run_id, answer.json()["decision_id"]


def _snapshot() -> tuple[Any, ...]:
    runs = tuple(SandboxRun.objects.order_by("id").values_list("status", "exit_code", "error"))
    return AuditEvent.objects.count(), runs


@pytest.mark.django_db
def test_the_endpoints_walk_a_run_through_its_life(two_agents):
    a, _, run_id, decision_id = two_agents
    assert events_of(run_id) == ["sandbox.run.requested"]
    assert a.post(f"{RUNS}/{run_id}/started", _started(decision_id), format="json").json() == {
        "run_id": run_id, "status": "running"}  # fmt: skip
    assert a.post(f"{RUNS}/{run_id}/egress", _egress(decision_id), format="json").status_code == 201
    done = a.post(f"{RUNS}/{run_id}/finished", _finished(decision_id), format="json")
    assert done.json()["status"] == "finished"
    assert events_of(run_id) == ["sandbox.run.requested", "sandbox.run.started",
                                 "sandbox.egress.denied", "sandbox.run.finished"]  # fmt: skip
    record = run_record(run_id)
    assert record.enforcement == {"pids": "cgroup"} and record.exit_code == 0
    # Once closed, nothing more: started again, egress after the end, finished twice.
    before = _snapshot()
    for what, body in (("started", _started), ("egress", _egress), ("finished", _finished)):
        again = a.post(f"{RUNS}/{run_id}/{what}", body(decision_id), format="json")
        assert again.status_code == 409 and again.json()["error"]["code"] == "run_state"
    assert a.post(RUNS, _ask(run_id), format="json").json()["error"]["code"] == "run_exists"
    assert _snapshot() == before


@pytest.mark.django_db
@pytest.mark.parametrize("what", ["started", "egress", "finished"])
def test_agent_b_cannot_report_on_agent_as_run(two_agents, what):
    a, b, run_id, decision_id = two_agents
    if what != "started":
        a.post(f"{RUNS}/{run_id}/started", _started(decision_id), format="json")
    before = _snapshot()
    body = {"started": _started, "egress": _egress, "finished": _finished}[what](decision_id)
    answer = b.post(f"{RUNS}/{run_id}/{what}", body, format="json")
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"
    # A itself, naming another decision id, is refused (its own run: a conflict).
    wrong = {**body, "decision_id": str(uuid.uuid4())}
    refused = a.post(f"{RUNS}/{run_id}/{what}", wrong, format="json")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "decision_mismatch"
    assert _snapshot() == before


@pytest.mark.django_db
def test_a_denied_run_cannot_be_started(code_exec, agent_client):
    a = agent_client(code_exec.agent)  # no grant at all
    run_id = str(uuid.uuid4())
    answer = a.post(RUNS, _ask(run_id), format="json").json()
    assert (answer["decision"], answer["limits"]) == ("deny", None)
    assert events_of(run_id) == ["sandbox.run.requested", "sandbox.run.denied"]
    before = _snapshot()
    started = a.post(f"{RUNS}/{run_id}/started", _started(answer["decision_id"]), format="json")
    assert started.status_code == 409
    assert _snapshot() == before


@pytest.mark.django_db
def test_a_run_whose_grant_was_revoked_after_the_allow_cannot_be_started(code_exec, agent_client):
    from governance.services import grants

    granted = code_exec.grant()
    a = agent_client(code_exec.agent)
    run_id = str(uuid.uuid4())
    answer = a.post(RUNS, _ask(run_id), format="json").json()
    assert answer["decision"] == "allow"
    grants.grant_revoke(
        grant_id=granted.pk, reason="incident", actor=Actor.system("t"), at=timezone.now()
    )
    started = a.post(f"{RUNS}/{run_id}/started", _started(answer["decision_id"]), format="json")
    assert started.status_code == 409 and started.json()["error"]["code"] == "grant_not_live"
    assert "grant_revoked" in started.json()["error"]["message"]
    assert run_record(run_id).status == "requested"
    assert events_of(run_id) == ["sandbox.run.requested", "sandbox.run.start_refused"]


@pytest.mark.django_db
def test_a_run_started_from_another_image_than_the_one_allowed_is_refused(code_exec, agent_client):
    """The decision bound the image id the runner resolved; a start report naming other
    bytes is refused (the runner then kills the sandbox before the code runs)."""
    code_exec.grant()
    a = agent_client(code_exec.agent)
    run_id, allowed = str(uuid.uuid4()), "sha256:" + "1" * 64
    answer = a.post(RUNS, _ask(run_id, image_id=allowed), format="json").json()
    assert answer["decision"] == "allow"
    event = AuditEvent.objects.get(uid=answer["decision_id"])
    assert json.loads(event.arguments)["image_id"] == allowed
    assert run_record(run_id).image_id == allowed
    refused = ["sandbox.run.requested"]
    for other in ("sha256:" + "2" * 64, ""):
        body = {**_started(answer["decision_id"]), "image_digest": other}
        started = a.post(f"{RUNS}/{run_id}/started", body, format="json")
        assert started.status_code == 409 and started.json()["error"]["code"] == "image_mismatch"
        assert allowed in started.json()["error"]["message"]
        assert run_record(run_id).status == "requested"
        refused.append("sandbox.run.start_refused")  # each refusal on record, none started
        assert events_of(run_id) == refused
    started = a.post(f"{RUNS}/{run_id}/started", _started(answer["decision_id"]), format="json")
    assert started.status_code == 200, started.content
    assert run_record(run_id).image_digest == allowed
    assert events_of(run_id) == [*refused, "sandbox.run.started"]


@pytest.mark.django_db
def test_a_finish_report_cannot_rewrite_which_image_ran_or_how_it_was_held(two_agents):
    """The start gate checked and recorded the image and the enforcement; a finish report
    naming others is kept as the runner's claim in the finished event, beside the record,
    which it does not change."""
    a, _, run_id, decision_id = two_agents
    started = _started(decision_id)
    assert a.post(f"{RUNS}/{run_id}/started", started, format="json").status_code == 200
    other, weaker = "sha256:" + "9" * 64, {"memory": "none"}
    body = {**_finished(decision_id), "image_digest": other, "enforcement": weaker}
    assert a.post(f"{RUNS}/{run_id}/finished", body, format="json").status_code == 200
    record = run_record(run_id)
    assert record.status == "finished"
    assert record.image_digest == started["image_digest"]
    assert record.enforcement == started["enforcement"]
    finished = json.loads(AuditEvent.objects.get(event_type=EventType.SANDBOX_RUN_FINISHED).data)
    assert finished["reported_image_digest"] == other
    assert finished["reported_enforcement"] == weaker
    begun = json.loads(AuditEvent.objects.get(event_type=EventType.SANDBOX_RUN_STARTED).data)
    assert begun["image_digest"] == started["image_digest"]


@pytest.mark.django_db
def test_a_finish_report_that_agrees_with_the_start_adds_nothing_and_a_run_never_started_keeps_it(
    two_agents,
):
    a, _, run_id, decision_id = two_agents
    started = _started(decision_id)
    assert a.post(f"{RUNS}/{run_id}/started", started, format="json").status_code == 200
    body = {**_finished(decision_id), "image_digest": started["image_digest"],
            "enforcement": started["enforcement"]}  # fmt: skip
    assert a.post(f"{RUNS}/{run_id}/finished", body, format="json").status_code == 200
    finished = json.loads(AuditEvent.objects.get(event_type=EventType.SANDBOX_RUN_FINISHED).data)
    assert not {"reported_image_digest", "reported_enforcement"} & finished.keys()
    # A run whose backend never started it: the runner's word is all there is, on record.
    second = str(uuid.uuid4())
    answer = a.post(RUNS, _ask(second), format="json").json()
    body = {**_finished(answer["decision_id"]), "image_digest": "sha256:" + "5" * 64}
    assert a.post(f"{RUNS}/{second}/finished", body, format="json").status_code == 200
    record = run_record(second)
    assert record.status == "failed" and record.image_digest == "sha256:" + "5" * 64
    closed = AuditEvent.objects.filter(event_type=EventType.SANDBOX_RUN_FINISHED).order_by("seq")
    assert json.loads(closed.last().data)["image_digest"] == "sha256:" + "5" * 64


@pytest.mark.django_db
@pytest.mark.parametrize("backend", ["docker", "gvisor"])
def test_an_image_run_without_an_image_id_is_refused_on_record_and_asks_nobody(
    code_exec, irreversible, agent_client, backend
):
    """A runner that sends no image id (an old one, or one whose engine did not resolve
    the name) would have the decision, and an approval, bound to a name only. Refused
    before the confirmation gate: no person is asked to approve it."""
    from governance.models import Approval

    code_exec.grant()
    irreversible("deploy-exec")
    a = agent_client(code_exec.agent)
    for tool in ("code-exec", "deploy-exec"):
        run_id = str(uuid.uuid4())
        body = _ask(run_id, backend=backend, tool=tool, image_problem="image 'x' is not here")
        answer = a.post(RUNS, body, format="json").json()
        assert (answer["decision"], answer["reason"]) == ("deny", "image_unresolved")
        assert (
            "did not resolve to an image id on the runner: image 'x' is not here"
            in (answer["message"])
        )
        event = AuditEvent.objects.get(uid=answer["decision_id"])
        assert (event.event_type, event.reason) == ("access.denied", "image_unresolved")
        assert (run_record(run_id).status, run_record(run_id).reason) == (
            "denied",
            "image_unresolved",
        )
        assert events_of(run_id) == ["sandbox.run.requested", "sandbox.run.denied"]
    assert not Approval.objects.exists()
    # With the id, the same asks are answered as usual.
    body = _ask(str(uuid.uuid4()), backend=backend, image_id="sha256:" + "3" * 64)
    assert a.post(RUNS, body, format="json").json()["decision"] == "allow"


@pytest.mark.django_db
def test_a_host_backend_run_is_the_image_host_whatever_image_it_names(
    code_exec, make_grant, agent_client
):
    """bubblewrap runs the host's /usr, not an image. Its runs were the image they
    named, so a grant scoped to one image (`sandbox:governance-sandbox:bookworm`) let an
    agent run every binary of the host by asking for bubblewrap under that name. Now a
    host backend's run is the image `host` (scope `sandbox:host`); naming another image
    for it is a 400."""
    from sandbox_runner.spec import RunSpec

    def grant(scope: str) -> Any:
        return make_grant(
            code_exec.agent, code_exec.tool, actions=("execute",), scope=scope,
            task=code_exec.task, starts_at=timezone.now() - timedelta(minutes=30),
            duration=timedelta(days=3),
        )  # fmt: skip

    grant("sandbox:governance-sandbox:bookworm")
    a = agent_client(code_exec.agent)
    run_id = str(uuid.uuid4())
    answer = a.post(RUNS, _ask(run_id), format="json").json()  # the default image
    assert (answer["decision"], answer["reason"]) == ("deny", "scope_mismatch")
    event = AuditEvent.objects.get(uid=answer["decision_id"])
    assert (event.event_type, event.scope) == ("access.denied", "sandbox:host")
    assert run_record(run_id).image == "host"
    before = AuditEvent.objects.count()
    refused = a.post(RUNS, _ask(str(uuid.uuid4()), image="locked-down:v1"), format="json")
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert error["code"] == "invalid_image" and "image" in error["fields"]
    assert AuditEvent.objects.count() == before
    with pytest.raises(ValueError, match="runs the host's /usr"):
        RunSpec(agent="coder", task=None, command=("true",), backend="bubblewrap", image="x:1")
    # A grant on the host is what a bubblewrap run needs.
    grant("sandbox:host")
    assert a.post(RUNS, _ask(str(uuid.uuid4())), format="json").json()["decision"] == "allow"
    # Image backends are unchanged: that grant covers the image it names.
    docker = _ask(str(uuid.uuid4()), backend="docker", image_id="sha256:" + "4" * 64)
    assert a.post(RUNS, docker, format="json").json()["decision"] == "allow"


RUN_ID = "6f1c3a2e-0d4b-4f0e-9a51-2b7c8d9e0f11"
BAD_ASKS = [
    [],
    "run",
    _ask(RUN_ID, agent="someone-else"),  # the agent is the token's, never the body's
    _ask("not-a-uuid"),
    _ask(False),  # DRF's UUIDField alone would read this as UUID(int=0)
    _ask(7),
    _ask(RUN_ID, backend="chroot"),
    _ask(RUN_ID, command=[]),
    _ask(RUN_ID, command="python3 -c 1"),
    _ask(RUN_ID, command=["a\x00b"]),
    _ask(RUN_ID, script_sha256="ABC"),
    _ask(RUN_ID, image_id="1" * 64),  # an image id is sha256: and 64 hex digits
    _ask(RUN_ID, image_id="sha256:" + "A" * 64),
    _ask(RUN_ID, image_id="sha256:" + "1" * 63),
    _ask(RUN_ID, image_id=None),
    _ask(RUN_ID, limits={"memory_mb": "128"}),
    _ask(RUN_ID, limits={"memory_mb": 0}),
    _ask(RUN_ID, limits={"cpus": True}),
    _ask(RUN_ID, limits={"swap": 1}),
    _ask(RUN_ID, egress="127.0.0.1:80"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("body", BAD_ASKS)
def test_a_malformed_run_request_is_400_and_writes_nothing(two_agents, body):
    a, *_ = two_agents
    before = _snapshot()
    answer = a.post(RUNS, body, format="json")
    assert answer.status_code == 400, answer.content
    assert answer.json()["error"]["code"] == "invalid_request"
    assert _snapshot() == before


BAD_REPORTS = [
    ("started", lambda d: {k: v for k, v in _started(d).items() if k != "deadline"}),
    ("started", lambda d: {**_started(d), "deadline": "soon"}),
    ("started", lambda d: {**_started(d), "status": "finished"}),
    ("started", lambda d: {**_started(d), "enforcement": {"pids": 3}}),
    ("started", lambda d: {**_started(d), "enforcement": {str(i): "cgroup" for i in range(17)}}),
    ("started", lambda d: {**_started(d), "decision_id": 7}),
    ("egress", lambda d: {**_egress(d), "allowed": True}),  # not a field: the reason says
    ("egress", lambda d: {**_egress(d), "port": 70000}),
    ("egress", lambda d: {**_egress(d), "reason": "whatever"}),
    ("egress", lambda d: {**_egress(d), "host": ""}),
    ("finished", lambda d: {**_finished(d), "exit_code": "0"}),
    ("finished", lambda d: {**_finished(d), "stdout": {**STREAM, "sha256": "x"}}),
    ("finished", lambda d: {**_finished(d), "stdout": {**STREAM, "extra": 1}}),
    ("finished", lambda d: {**_finished(d), "stderr": {**STREAM, "excerpt": "x" * 5000}}),
    ("finished", lambda d: {k: v for k, v in _finished(d).items() if k != "timed_out"}),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("what", "make"), BAD_REPORTS)
def test_a_malformed_report_is_400_and_writes_nothing(two_agents, what, make):
    a, _, run_id, decision_id = two_agents
    if what != "started":
        a.post(f"{RUNS}/{run_id}/started", _started(decision_id), format="json")
    before = _snapshot()
    answer = a.post(f"{RUNS}/{run_id}/{what}", make(decision_id), format="json")
    assert answer.status_code == 400, answer.content
    assert answer.json()["error"]["code"] == "invalid_request"
    assert _snapshot() == before


@pytest.mark.django_db
def test_the_live_endpoint_says_when_the_grant_can_no_longer_allow_the_run(two_agents):
    from governance.services.grants import grant_revoke

    a, b, run_id, decision_id = two_agents
    a.post(f"{RUNS}/{run_id}/started", _started(decision_id), format="json")
    before = _snapshot()
    assert a.get(f"{RUNS}/{run_id}/live").json() == {"run_id": run_id, "live": True, "reason": None}
    assert b.get(f"{RUNS}/{run_id}/live").status_code == 404  # not B's run
    assert a.get(f"{RUNS}/{uuid.uuid4()}/live").status_code == 404
    assert _snapshot() == before  # a question: nothing written

    grant_id = run_record(run_id).grant_id
    grant_revoke(
        grant_id=grant_id, actor=Actor.system("test"), reason="incident", at=timezone.now()
    )
    assert a.get(f"{RUNS}/{run_id}/live").json() == {
        "run_id": run_id, "live": False, "reason": "grant_revoked"}  # fmt: skip


def test_an_agent_that_spends_its_rate_limit_cannot_silence_the_kill_switch(two_agents, settings):
    """The runner and the agent share a token: with the agent's own calls spending the
    limit, the runner's "may it go on?" must still be answered, or a revoked grant
    would not reach the sandbox (no answer counts as live)."""
    from governance.services.grants import grant_revoke

    a, _b, run_id, decision_id = two_agents
    a.post(f"{RUNS}/{run_id}/started", _started(decision_id), format="json")
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "authorize": 1}
    ask = {"tool": "code-exec", "action": "execute", "scope": "sandbox:x"}
    while a.post("/api/v1/authorize", ask, format="json").status_code != 429:
        pass
    grant_revoke(
        grant_id=run_record(run_id).grant_id, actor=Actor.system("test"), reason="incident",
        at=timezone.now(),
    )  # fmt: skip
    answer = a.get(f"{RUNS}/{run_id}/live")
    assert answer.status_code == 200
    assert answer.json() == {"run_id": run_id, "live": False, "reason": "grant_revoked"}


@pytest.mark.django_db
def test_an_agent_that_spends_its_rate_limit_cannot_keep_its_run_off_the_record(
    two_agents, settings
):
    """The runner and the agent share a token. The reports of a run allowed before the
    agent spent its /authorize budget were counted in it, so the run's start, egress
    and end were refused 429 and never recorded. Started and finished are accepted
    once per run, uncounted; egress attempts have their own budget."""
    a, _b, run_id, decision_id = two_agents
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "authorize": 1, "sandbox_egress": 2}
    ask = {"tool": "code-exec", "action": "execute", "scope": "sandbox:x"}
    while a.post("/api/v1/authorize", ask, format="json").status_code != 429:
        pass
    assert a.post(RUNS, _ask(str(uuid.uuid4())), format="json").status_code == 429
    before = AuditEvent.objects.count()
    started = a.post(f"{RUNS}/{run_id}/started", _started(decision_id), format="json")
    assert started.status_code == 200, started.content
    egress = [a.post(f"{RUNS}/{run_id}/egress", _egress(decision_id), format="json")
              for _ in range(3)]  # fmt: skip
    assert [answer.status_code for answer in egress] == [201, 201, 429]
    assert egress[2].json()["error"]["code"] == "rate_limited" and egress[2]["Retry-After"]
    done = a.post(f"{RUNS}/{run_id}/finished", _finished(decision_id), format="json")
    assert done.status_code == 200 and done.json()["status"] == "finished"
    assert events_of(run_id) == ["sandbox.run.requested", "sandbox.run.started",
                                 "sandbox.egress.denied", "sandbox.egress.denied",
                                 "sandbox.run.finished"]  # fmt: skip
    assert AuditEvent.objects.count() == before + 4
    assert run_record(run_id).status == "finished"


def _remote_run_stopped_by(live_server, code_exec, spec_for, alice, kill) -> tuple[Any, Any, float]:
    """A bubblewrap run through HttpAuthorizer; `kill(run_id)` once it has started."""
    import io
    import time

    from sandbox_runner.runner import execute

    code_exec.grant()
    authorizer = HttpAuthorizer(live_server.url, _token(code_exec.agent, alice))
    spec = spec_for(
        "import time\nprint('up', flush=True)\ntime.sleep(50)\n",
        backend="bubblewrap",
        limits={"wall_seconds": 60},
    )
    started = time.monotonic()
    outcome = execute(
        spec,
        authorizer,
        stdout=io.BytesIO(),
        stderr=io.BytesIO(),
        on_started=lambda spec, handle: kill(spec.run_id),
    )
    return spec, outcome, time.monotonic() - started


@pytest.mark.django_db(transaction=True)
def test_a_remote_runner_stops_its_sandbox_when_the_grant_is_revoked(
    live_server, code_exec, spec_for, alice, bwrap_available
):
    """Over HTTP the runner asks GET .../live every LIVE_CHECK seconds: a revoked grant
    stops the run long before its deadline, and the end is on the server's record."""
    from governance.services.grants import grant_revoke
    from sandbox_runner.runner import LIVE_CHECK

    def revoke(run_id: str) -> None:
        grant_revoke(grant_id=run_record(run_id).grant_id, reason="incident",
                     actor=Actor.system("test"), at=timezone.now())  # fmt: skip

    spec, outcome, elapsed = _remote_run_stopped_by(live_server, code_exec, spec_for, alice, revoke)
    assert elapsed < LIVE_CHECK + 10, elapsed  # not the 60 s deadline
    assert outcome.exit_code == EXIT_DENIED  # denied while it ran, not the kill's 137
    record = run_record(spec.run_id)
    assert record.status == "finished" and not record.timed_out
    assert record.error == "stopped: its grant can no longer allow it (grant_revoked)"
    assert events_of(spec.run_id)[-1] == "sandbox.run.finished"
    finished = AuditEvent.objects.get(event_type="sandbox.run.finished")
    assert json.loads(finished.data)["error"] == record.error


@pytest.mark.django_db(transaction=True)
def test_a_remote_runner_stops_its_sandbox_when_the_agent_is_suspended(
    live_server, code_exec, spec_for, alice, bwrap_available
):
    """The kill switch over HTTP: the suspended agent's token is refused at once, so
    the runner's next liveness question stops the run. Its end cannot be reported with
    that token either: the record is left running until the reaper closes it."""
    from governance.models import Agent
    from governance.services.agents import agent_suspend
    from sandbox_runner.runner import LIVE_CHECK

    def suspend(run_id: str) -> None:
        agent = Agent.objects.get(name=code_exec.agent.name)
        agent_suspend(agent=agent, reason="kill switch", actor=Actor.system("test"),
                      at=timezone.now())  # fmt: skip

    spec, outcome, elapsed = _remote_run_stopped_by(
        live_server, code_exec, spec_for, alice, suspend
    )
    assert elapsed < LIVE_CHECK + 10, elapsed
    assert outcome.exit_code == EXIT_DENIED  # denied while it ran, not the kill's 137
    assert outcome.result is not None and "token_refused" in outcome.result.error
    assert run_record(spec.run_id).status == "running"  # the refused token could not close it
    assert events_of(spec.run_id)[-1] == "sandbox.run.started"  # nor record its end


@pytest.mark.django_db
def test_a_grant_narrowed_off_the_run_stops_it_from_starting_and_from_going_on(
    code_exec, agent_client
):
    """A narrowing is effective at once: the start gate and the kill switch asked only
    whether the grant was alive, so a run allowed under `sandbox:*` still started, and
    ran to its wall time, after the grant was narrowed to another image."""
    from governance.services.grants import grant_narrow

    granted = code_exec.grant()
    a = agent_client(code_exec.agent)
    running, waiting = str(uuid.uuid4()), str(uuid.uuid4())
    allowed = {
        run_id: a.post(RUNS, _ask(run_id), format="json").json()["decision_id"]
        for run_id in (running, waiting)
    }
    a.post(f"{RUNS}/{running}/started", _started(allowed[running]), format="json")
    grant_narrow(
        grant_id=granted.pk, reason="review", actor=Actor.system("t"), at=timezone.now(),
        scope="sandbox:some-other-image",
    )  # fmt: skip
    started = a.post(f"{RUNS}/{waiting}/started", _started(allowed[waiting]), format="json")
    assert started.status_code == 409 and started.json()["error"]["code"] == "grant_not_live"
    assert "scope_mismatch" in started.json()["error"]["message"]
    assert events_of(waiting) == ["sandbox.run.requested", "sandbox.run.start_refused"]
    assert a.get(f"{RUNS}/{running}/live").json() == {
        "run_id": running, "live": False, "reason": "scope_mismatch"}  # fmt: skip


@pytest.mark.django_db
def test_the_runs_task_closing_stops_a_run_under_a_grant_bound_to_no_task(
    code_exec, make_grant, agent_client
):
    from governance.services import tasks

    make_grant(
        code_exec.agent, code_exec.tool, actions=("execute",), scope="sandbox:*",
        starts_at=timezone.now() - timedelta(minutes=30), duration=timedelta(days=3),
    )  # fmt: skip
    a = agent_client(code_exec.agent)
    run_id = str(uuid.uuid4())
    answer = a.post(RUNS, _ask(run_id), format="json").json()
    assert answer["decision"] == "allow" and run_record(run_id).task == "SBX-1"
    a.post(f"{RUNS}/{run_id}/started", _started(answer["decision_id"]), format="json")
    assert a.get(f"{RUNS}/{run_id}/live").json()["live"] is True
    tasks.task_close(task=code_exec.task, actor=Actor.system("t"), at=timezone.now())
    assert a.get(f"{RUNS}/{run_id}/live").json() == {
        "run_id": run_id, "live": False, "reason": "task_closed"}  # fmt: skip


@pytest.mark.django_db
def test_an_allow_that_was_never_used_goes_stale(two_agents):
    """An allowed container run never started stayed `requested` for ever and could be
    started hours later with the limits and egress worked out at the allow."""
    from governance.services import sandbox

    a, _, run_id, decision_id = two_agents
    later = timezone.now() + sandbox.HELD_GRACE + timedelta(seconds=1)
    with pytest.raises(sandbox.Conflict) as refused:
        sandbox.run_started(
            run_id=run_id, container_id="c1", image_digest="", deadline=later.timestamp() + 60,
            enforcement={}, at=later,
        )  # fmt: skip
    assert refused.value.code == "allow_expired"
    SandboxRun.objects.filter(run_id=run_id).update(backend="docker")
    assert sandbox.close_stale_container_runs(at=later) == [(run_id, "runner_gone")]
    assert run_record(run_id).status == "reaped"
    assert events_of(run_id)[-1] == "sandbox.run.reaped"


@pytest.mark.parametrize(
    ("name", "value"),
    [("memory_mb", 0.5), ("pids", 0.5), ("scratch_mb", 0.5), ("cpus", 1e-12),
     ("memory_mb", 5), ("wall_seconds", float("nan"))],
)  # fmt: skip
def test_an_allow_whose_limits_would_become_no_limit_is_malformed(name, value):
    """0.5 MB or 0.5 pids passed `> 0` and were cut to 0 on the way down, which Docker
    reads as no limit at all."""
    from sandbox_runner.authorizers import _parse_run
    from sandbox_runner.spec import RunSpec

    spec = RunSpec(agent="coder", task="SBX-1", command=("true",))
    limits = {"memory_mb": 256, "cpus": 1.0, "pids": 64, "wall_seconds": 30, "scratch_mb": 16}
    body = {"run_id": spec.run_id, "decision": "allow", "decision_id": "d1",
            "limits": {**limits, name: value}, "egress": []}  # fmt: skip
    assert _parse_run(spec, body).outcome == "malformed"
    assert _parse_run(spec, {**body, "limits": limits}).outcome == "allow"


@pytest.mark.parametrize("asked", ["LOCALHOST:8080", "[0::1]:8080", "API.Example.com:443"])
def test_the_http_adapter_takes_back_the_egress_it_asked_for_in_any_spelling(asked):
    """The server answers in the proxy's spelling; the runner compares as it parses."""
    from sandbox_runner.authorizers import _parse_run
    from sandbox_runner.egress import parse_destination
    from sandbox_runner.spec import RunSpec

    spec = RunSpec(agent="coder", task="SBX-1", command=("true",), egress=(asked,))
    limits = {"memory_mb": 256, "cpus": 1, "pids": 64, "wall_seconds": 60, "scratch_mb": 64}
    body = {"run_id": spec.run_id, "decision": "allow", "decision_id": "d-1",
            "reason": "allowed", "limits": limits,
            "egress": [str(parse_destination(asked))]}  # fmt: skip
    assert _parse_run(spec, body).outcome == "allow"
    wider = {**body, "egress": [str(parse_destination(asked)), "evil.example:443"]}
    refused = _parse_run(spec, wider)
    assert refused.outcome == "malformed" and "beyond what was asked" in refused.message


@pytest.mark.django_db
def test_a_started_report_cannot_put_the_deadline_past_the_runs_wall_time(two_agents):
    a, _, run_id, decision_id = two_agents
    record = SandboxRun.objects.get(run_id=run_id)
    wall = record.limits["wall_seconds"]
    events, runs = _snapshot()
    body = {**_started(decision_id), "deadline": timezone.now().timestamp() + 30 * 86400}
    answer = a.post(f"{RUNS}/{run_id}/started", body, format="json")
    assert answer.status_code == 409, answer.content
    assert answer.json()["error"]["code"] == "deadline_exceeds_limits"
    assert _snapshot() == (events + 1, runs)  # the refusal is on record; the run unchanged
    assert events_of(run_id)[-1] == "sandbox.run.start_refused"
    record.refresh_from_db()
    assert (record.status, record.deadline_at) == ("requested", None)
    # Within the wall time it starts.
    ok = {**_started(decision_id), "deadline": timezone.now().timestamp() + wall}
    assert a.post(f"{RUNS}/{run_id}/started", ok, format="json").status_code == 200


@pytest.mark.django_db
def test_the_runners_error_text_is_masked_as_its_output_is(two_agents):
    a, _, run_id, decision_id = two_agents
    assert (
        a.post(f"{RUNS}/{run_id}/started", _started(decision_id), format="json").status_code == 200
    )
    body = {**_finished(decision_id), "error": "backend said: DB_PASSWORD=hunter2 jane@example.com"}
    assert a.post(f"{RUNS}/{run_id}/finished", body, format="json").status_code == 200
    record = SandboxRun.objects.get(run_id=run_id)
    assert "hunter2" not in record.error and "jane@" not in record.error
    assert record.error == "backend said: DB_PASSWORD=[secret] [email]"
    # And in the audit event, which is never purged: it held the runner's words as sent.
    event = AuditEvent.objects.filter(event_type=EventType.SANDBOX_RUN_FINISHED).get()
    assert "hunter2" not in event.data and "jane@" not in event.data
    assert json.loads(event.data)["error"] == record.error


@pytest.mark.django_db
def test_an_allowed_egress_report_outside_the_runs_grant_is_refused_not_logged(two_agents):
    """A runner could report `allowed` for any destination, and the log said policy let
    a connection through that the grant forbids."""
    a, _, run_id, decision_id = two_agents
    assert (
        a.post(f"{RUNS}/{run_id}/started", _started(decision_id), format="json").status_code == 200
    )
    before = _snapshot()
    forged = {**_egress(decision_id), "reason": "allowed", "host": "evil.example.net", "port": 443}
    answer = a.post(f"{RUNS}/{run_id}/egress", forged, format="json")
    assert answer.status_code == 409, answer.content
    assert answer.json()["error"]["code"] == "egress_not_in_grant"
    assert _snapshot() == before
    # A denial of the same destination is what the runner should say, and is logged.
    denied = {**forged, "reason": "not_allowlisted"}
    assert a.post(f"{RUNS}/{run_id}/egress", denied, format="json").status_code == 201
    assert events_of(run_id)[-1] == "sandbox.egress.denied"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("stdout", "said"),
    [
        ({"excerpt": "all tests passed\n", "bytes": 17,
          "sha256": hashlib.sha256(b"FAILED\n").hexdigest()}, "not its SHA-256"),
        ({"excerpt": "secret output", "bytes": 0,
          "sha256": hashlib.sha256(b"").hexdigest()}, "the stream had 0"),
    ],
)  # fmt: skip
def test_a_finish_report_whose_excerpt_contradicts_its_stream_is_refused(two_agents, stdout, said):
    """The output's hash and length were stored as sent: "all tests passed" with the hash
    of "FAILED", or output under a report of 0 bytes, and the run page showed both."""
    a, _, run_id, decision_id = two_agents
    assert (
        a.post(f"{RUNS}/{run_id}/started", _started(decision_id), format="json").status_code == 200
    )
    before = _snapshot()
    report = {**_finished(decision_id), "stdout": {**STREAM, **stdout}}
    answer = a.post(f"{RUNS}/{run_id}/finished", report, format="json")
    assert answer.status_code == 400, answer.content
    error = answer.json()["error"]
    assert error["code"] == "stream_mismatch" and said in error["message"]
    assert list(error["fields"]) == ["stdout.sha256"]
    assert _snapshot() == before and run_record(run_id).status == "running"
    # Cut output (an excerpt shorter than the stream) cannot be checked, and is taken.
    cut = {"excerpt": "all tests", "bytes": 17, "sha256": hashlib.sha256(b"x").hexdigest()}
    report = {**_finished(decision_id), "stdout": {**STREAM, **cut}}
    assert a.post(f"{RUNS}/{run_id}/finished", report, format="json").status_code == 200


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("closer", ["finished", "reaped"])
def test_an_egress_report_racing_the_runs_end_is_refused_not_logged_after_it(
    two_agents, monkeypatch, closer
):
    """The view saw the run running, then the service wrote the event without a look at
    the run again: a finish (or the kill switch's reap) committed in between was followed
    by an egress event on a closed run. The service reads the run under a lock."""
    import threading
    import time

    from django.db import connection

    from governance.services import sandbox as sandbox_service

    a, _, run_id, decision_id = two_agents
    assert (
        a.post(f"{RUNS}/{run_id}/started", _started(decision_id), format="json").status_code == 200
    )
    real, in_window = sandbox_service.egress_attempt, threading.Event()

    def after_the_views_look(**kw: Any) -> None:
        in_window.set()
        time.sleep(0.3)  # widens the window between the view's check and the write
        return real(**kw)

    monkeypatch.setattr(sandbox_service, "egress_attempt", after_the_views_look)
    answers: dict[str, int] = {}

    def egress() -> None:
        try:
            answer = a.post(f"{RUNS}/{run_id}/egress", _egress(decision_id), format="json")
            answers["egress"] = answer.status_code
        finally:
            connection.close()

    reporting = threading.Thread(target=egress)
    reporting.start()
    assert in_window.wait(10)
    if closer == "finished":
        done = a.post(f"{RUNS}/{run_id}/finished", _finished(decision_id), format="json")
        assert done.status_code == 200
    else:
        assert sandbox_service.run_reaped(
            run_id=run_id, why="agent_suspended", actor=Actor.system("sandbox_reaper"),
            at=timezone.now(),
        )  # fmt: skip
    reporting.join(20)
    assert answers == {"egress": 409}
    assert events_of(run_id)[-1] == f"sandbox.run.{closer}"


@pytest.mark.django_db
def test_the_egress_service_records_nothing_for_a_run_that_is_not_running(code_exec, agent_client):
    """What DatabaseAuthorizer.egress calls: it wrote an attempt for a denied run."""
    from governance.errors import Conflict
    from governance.services import sandbox as sandbox_service
    from sandbox_runner.egress import EgressDecision

    a = agent_client(code_exec.agent)  # no grant: the run is denied
    denied = str(uuid.uuid4())
    assert a.post(RUNS, _ask(denied), format="json").json()["decision"] == "deny"
    attempt = EgressDecision(allowed=False, reason="not_allowlisted", host="127.0.0.1", port=9)
    with pytest.raises(Conflict, match="denied"):
        sandbox_service.egress_attempt(run_id=denied, decision=attempt, at=timezone.now())
    assert events_of(denied) == ["sandbox.run.requested", "sandbox.run.denied"]


@pytest.mark.django_db(transaction=True)
def test_one_run_id_asked_by_two_agents_at_once_is_a_409_not_an_outage(postgres_only, two_agents):
    """On PostgreSQL the hot path's insert raises psycopg's UniqueViolation, not Django's
    IntegrityError: the loser got 503 "cannot reach its database" (a runner reads that
    as 'try again', an operator as an outage). It is 409 run_exists."""
    import threading

    from django.db import connection

    a, b, _, _ = two_agents
    for _ in range(5):
        run_id, go, answers = str(uuid.uuid4()), threading.Barrier(2), []

        def ask(client: Any, run_id: str = run_id, go: Any = go, answers: list = answers) -> None:
            try:
                go.wait()
                answers.append(client.post(RUNS, _ask(run_id), format="json").status_code)
            finally:
                connection.close()

        askers = [threading.Thread(target=ask, args=(c,)) for c in (a, b)]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join(30)
        assert sorted(answers) == [201, 409]
        assert events_of(run_id) == ["sandbox.run.requested"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("narrowing", "reason"),
    [
        ({"actions": ["read"]}, "no_grant"),  # execute dropped
        ({"scope": "sandbox:other/*"}, "scope_mismatch"),  # no longer covers the image
    ],
)
def test_narrowing_the_grant_under_a_running_sandbox_makes_its_live_check_fail(
    code_exec, make_tool, make_grant, agent_client, bob, narrowing, reason
):
    """The runner asks "can its grant still allow it?" while the sandbox runs (in process:
    DatabaseAuthorizer.dead_reason; remote: GET .../live). A grant narrowed so it no
    longer holds `execute`, or no longer covers the run's image, answers no at once: a
    narrowing takes effect at once, as a revoke does."""
    from governance.services.grants import grant_narrow
    from governance.services.sandbox import reap_reason
    from sandbox_runner.authorizers import DatabaseAuthorizer
    from sandbox_runner.spec import RunSpec

    lab = make_tool("code-lab", actions=("read", "execute"), kind="code_exec")
    grant = make_grant(
        code_exec.agent, lab, actions=("read", "execute"), scope="sandbox:*",
        task=code_exec.task, starts_at=timezone.now() - timedelta(minutes=30),
        duration=timedelta(days=3),
    )  # fmt: skip
    a = agent_client(code_exec.agent)
    run_id = str(uuid.uuid4())
    answer = a.post(RUNS, _ask(run_id, tool="code-lab"), format="json")
    assert answer.status_code == 201 and answer.json()["decision"] == "allow", answer.content
    assert run_record(run_id).grant_id == grant.pk
    started = a.post(f"{RUNS}/{run_id}/started", _started(answer.json()["decision_id"]),
                     format="json")  # fmt: skip
    assert started.json() == {"run_id": run_id, "status": "running"}
    spec = RunSpec(run_id=run_id, agent="coder", task="SBX-1", tool="code-lab",
                   command=("python3", "-c", "1"), backend="bubblewrap")  # fmt: skip
    live = {"run_id": run_id, "live": True, "reason": None}
    assert a.get(f"{RUNS}/{run_id}/live").json() == live
    assert DatabaseAuthorizer().dead_reason(spec) is None
    assert reap_reason(run_id=run_id, deadline=float("inf"), at=timezone.now()) is None

    before = {"actions": ["read", "execute"], "scope": "sandbox:*"}
    grant_narrow(
        grant_id=grant.pk, reason="least privilege", actor=Actor.user(bob), at=timezone.now(),
        narrowed_by=bob, **narrowing,
    )  # fmt: skip
    (narrowed,) = AuditEvent.objects.filter(event_type="grant.narrowed")
    assert (narrowed.grant_id, narrowed.actor) == (grant.pk, "user:bob")
    data = json.loads(narrowed.data)
    assert data["reason"] == "least privilege"
    assert {k: data["before"][k] for k in before} == before
    grant.refresh_from_db()
    assert grant.status == "active"  # narrowed, not revoked: the grant lives on
    assert grant.actions == narrowing.get("actions", ["read", "execute"])
    assert grant.scope == narrowing.get("scope", "sandbox:*")

    written = _snapshot()
    assert a.get(f"{RUNS}/{run_id}/live").json() == {**live, "live": False, "reason": reason}
    assert DatabaseAuthorizer().dead_reason(spec) == reason
    assert reap_reason(run_id=run_id, deadline=float("inf"), at=timezone.now()) == reason
    assert _snapshot() == written  # questions: nothing written
    assert events_of(run_id) == ["sandbox.run.requested", "sandbox.run.started"]


# --- Answers that are not decisions ------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_rate_limited_run_request_is_unreachable_and_says_when_to_retry(
    live_server, code_exec, spec_for, alice, settings, bwrap_available, capfd
):
    """A 429 is no decision: the token's rate limit is spent for now. It was read as a
    denial (77, "no grant"); it is 69 (try again later), with the server's Retry-After
    in the message, and the server records nothing of the run (it never got that far)."""
    from governance.client import GovernanceClient
    from sandbox_runner.runner import EXIT_UNREACHABLE

    code_exec.grant()
    token = _token(code_exec.agent, alice)
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "authorize": 1}
    # The agent's own call spends the token's one decision this minute.
    spent = GovernanceClient(live_server.url, token).authorize("code-exec", "execute", "x")
    assert spent.reason != "rate_limited"
    events = AuditEvent.objects.count()
    spec = spec_for("print('never')", backend="bubblewrap")
    outcome, out, _ = run(spec, HttpAuthorizer(live_server.url, token))
    assert outcome.exit_code == EXIT_UNREACHABLE and out == ""
    assert (outcome.auth.outcome, outcome.auth.reason) == ("unreachable", "rate_limited")
    assert "rate limited (HTTP 429): retry after" in outcome.auth.message
    assert "(Retry-After)" in outcome.auth.message
    assert "not started: unreachable (rate_limited)" in capfd.readouterr().err
    assert not SandboxRun.objects.filter(run_id=spec.run_id).exists()
    assert AuditEvent.objects.count() == events  # nothing was decided, nothing recorded
    assert leftovers("bubblewrap", spec.run_id) == []


@pytest.fixture
def canned():
    """answer(status, body, **headers): a local stand-in for governance whose every
    answer is that one. Unit level: the decision is not governance's here, so there is
    no run record or audit event to check (the real server's 429 is checked above)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answer: dict[str, Any] = {}

    class Canned(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.dumps(answer["body"]).encode() if answer["body"] is not None else b""
            self.send_response(answer["status"])
            self.send_header("Content-Type", "application/json")
            for name, value in answer["headers"].items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()

    def set_answer(status: int, body: Any = None, **headers: str) -> str:
        answer.update(status=status, body=body, headers=headers)
        return f"http://127.0.0.1:{server.server_address[1]}"

    try:
        yield set_answer
    finally:
        server.shutdown()
        server.server_close()


def _error(code: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": f"{code} said the server"}}


def _http_date(ahead: timedelta) -> str:
    return (timezone.now() + ahead).strftime("%a, %d %b %Y %H:%M:%S GMT")


IN_A_MINUTE = _http_date(timedelta(seconds=90))  # any date will do for the message


@pytest.mark.parametrize(
    ("status", "body", "headers", "exit_code", "said"),
    [
        (429, _error("rate_limited"), {"Retry-After": "7"}, 69, "retry after 7 s (Retry-After)"),
        (429, None, {"Retry-After": IN_A_MINUTE}, 69, "(Retry-After)"),
        (429, None, {}, 69, "rate limited (HTTP 429): no Retry-After given"),
        (500, None, {}, 69, "the service answered 500"),
        (503, _error("unavailable"), {"Retry-After": "3"}, 69, "the service answered 503"),
        (400, _error("invalid_request"), {}, 77, "invalid_request said the server"),
        (401, _error("not_authenticated"), {}, 77, "not_authenticated said the server"),
        (403, _error("permission_denied"), {}, 77, "permission_denied said the server"),
        (409, _error("run_exists"), {}, 77, "run_exists said the server"),
        (413, _error("too_large"), {}, 77, "too_large said the server"),
        (404, _error("not_found"), {}, 76, "HTTP 404: no sandbox API at http://127.0.0.1:"),
        (404, None, {}, 76, "(is it governance's URL?)"),
        (302, None, {"Location": "http://127.0.0.1:9/"}, 76, ""),
        (405, _error("method_not_allowed"), {}, 76, "method_not_allowed said the server"),
    ],
)
def test_each_answer_that_is_not_a_decision_has_its_documented_status(
    status, body, headers, exit_code, said, canned, spec_for, bwrap_available
):
    """The README's table, over HTTP: no decision (none, 5xx, 429: 69, try again
    later; a 429 says when), governance refusing the request or the token (400, 401,
    403, 409, 413: 77), or not governance's answer at all (404, a redirect, any other
    status: 76). Nothing starts in any case."""
    spec = spec_for("print('never')", backend="bubblewrap")
    outcome, out, _ = run(spec, HttpAuthorizer(canned(status, body, **headers), "agt_x"))
    assert outcome.exit_code == exit_code, outcome.auth
    assert said in outcome.auth.message and out == "" and outcome.result is None
    assert leftovers("bubblewrap", spec.run_id) == []


def test_retry_after_as_an_http_date_is_read_in_seconds():
    from email.message import Message

    from governance.client import _retry_after

    headers = Message()
    headers["Retry-After"] = _http_date(timedelta(seconds=90))
    assert 80 < _retry_after(headers) <= 90
    for value, seconds in (("7", 7), ("Wed, 21 Oct 2015 07:28:00 GMT", 0), ("soon", None)):
        del headers["Retry-After"]
        headers["Retry-After"] = value
        assert _retry_after(headers) == seconds
