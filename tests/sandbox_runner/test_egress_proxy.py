"""Egress through the per-run proxy, against a real engine and under bubblewrap. The only servers
are the test's own on 127.0.0.1; the grant names 127.0.0.1:PORT exactly (an
internal address is allowed only when the grant names it)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from governance.models import AuditEvent
from sandbox_runner.authorizers import DatabaseAuthorizer
from sandbox_runner.runner import EXIT_BACKEND, EXIT_ERROR
from tests.sandbox_runner.conftest import events_of, leftovers, run_record
from tests.sandbox_runner.test_docker_probes import run

pytestmark = pytest.mark.django_db


class _Server:
    def __init__(self, name: str) -> None:
        hits = self.hits = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                hits.append(self.path)
                body = name.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    a, b = _Server("server-a"), _Server("server-b")
    yield a, b
    a.close()
    b.close()


def _granted(backend, code_exec, spec_for, destination: str) -> bool:
    """Grant egress to `destination`; under gVisor, check instead that a run with egress
    is refused, not weakened (runsc runs with its own network off), and say so (False)."""
    code_exec.grant(egress=[destination])
    if backend != "gvisor":
        return True
    spec = spec_for("print(1)", backend=backend)
    outcome, _, _ = run(spec)
    assert outcome.exit_code == EXIT_BACKEND
    record = run_record(spec.run_id)
    assert record.status == "failed" and "egress is not supported under runsc" in record.error
    assert leftovers("gvisor", spec.run_id) == []
    return False


# python3-minimal has no http or urllib.request: plain sockets speak to the proxy.
SCRIPT = """
import socket
A, B = {a}, {b}

def read_all(s):
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data

def get(host, port, path):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
    line = f"GET http://{{host}}:{{port}}{{path}} HTTP/1.0\\r\\nHost: {{host}}"
    s.sendall((line + "\\r\\n\\r\\n").encode())
    head, _, body = read_all(s).partition(b"\\r\\n\\r\\n")
    return head.split(b" ")[1].decode() + " " + body.decode().strip()

def connect(port):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
    line = f"CONNECT 127.0.0.1:{{port}} HTTP/1.1\\r\\nHost: 127.0.0.1:{{port}}"
    s.sendall((line + "\\r\\n\\r\\n").encode())
    status = s.recv(1024).split(b"\\r\\n")[0].decode().split(" ", 2)[1]
    if status != "200":
        return status
    s.sendall(b"GET /tunnel HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return status + " " + data.split(b"\\r\\n\\r\\n", 1)[1].decode()

print("A", connect(A))
print("B", connect(B))
print("GET", get("127.0.0.1", A, "/plain"))
try:
    socket.create_connection(("127.0.0.1", A), timeout=3)
    print("direct OK")
except OSError as exc:
    print("direct", type(exc).__name__)
try:
    socket.getaddrinfo("sandbox-probe.invalid", 80)
    print("dns OK")
except OSError as exc:
    print("dns", type(exc).__name__)
"""


def test_only_the_granted_destination_is_reachable_and_every_attempt_is_logged(
    backend, code_exec, spec_for, servers
):
    a, b = servers
    if not _granted(backend, code_exec, spec_for, f"127.0.0.1:{a.port}"):
        return
    spec = spec_for(SCRIPT.format(a=a.port, b=b.port), backend=backend)
    holders = []

    def inspect_holder(spec, handle):
        if getattr(handle, "holder", None) is not None:
            handle.holder.reload()
            holders.append(handle.holder.attrs["Config"])

    outcome, out, err = run(spec, on_started=inspect_holder)
    assert outcome.exit_code == 0, err
    if backend == "docker":
        # Only `sleep infinity` runs there: never the image's own entrypoint.
        (config,) = holders
        assert (config["Entrypoint"], config["Cmd"]) == (["sleep", "infinity"], None)
    assert out.splitlines() == [
        "A 200 server-a",
        "B 403",
        "GET 200 server-a",
        "direct ConnectionRefusedError",  # only the proxy is there: 127.0.0.1 is the sandbox's own
        "dns gaierror",
    ]
    assert a.hits == ["/tunnel", "/plain"] and b.hits == []
    # Every attempt made (three through the proxy) is one audit event, in order.
    attempts = [
        e for e in AuditEvent.objects.order_by("seq") if e.event_type.startswith("sandbox.egress")
    ]
    seen = [(e.event_type, json.loads(e.data)["destination"], e.reason) for e in attempts]
    assert seen == [
        ("sandbox.egress.allowed", f"127.0.0.1:{a.port}", "egress_allowed"),
        ("sandbox.egress.denied", f"127.0.0.1:{b.port}", "egress_not_allowlisted"),
        ("sandbox.egress.allowed", f"127.0.0.1:{a.port}", "egress_allowed"),
    ]
    for event in attempts:
        data = json.loads(event.data)
        assert data["run_id"] == spec.run_id and event.agent == "coder"
    assert json.loads(attempts[0].data)["address"] == "127.0.0.1"
    record = run_record(spec.run_id)
    assert record.egress == [f"127.0.0.1:{a.port}"] and record.status == "finished"
    assert events_of(spec.run_id)[-1] == "sandbox.run.finished"
    assert leftovers(backend, spec.run_id) == []  # sandbox (and Docker's holder) gone


def test_a_name_that_resolves_to_loopback_is_refused_unless_the_address_is_named(
    backend, code_exec, spec_for, servers
):
    a, _ = servers
    # `localhost` resolves (from /etc/hosts, no DNS) to 127.0.0.1: internal, and the
    # grant names the name, not the address, so the proxy refuses it.
    if not _granted(backend, code_exec, spec_for, f"localhost:{a.port}"):
        return
    script = SCRIPT.format(a=a.port, b=0).split("print(")[0] + (
        f"print(get('localhost', {a.port}, '/'))"
    )
    spec = spec_for(script, backend=backend)
    outcome, out, _ = run(spec)
    assert (outcome.exit_code, out.strip()) == (0, "403 egress refused: internal_address")
    assert a.hits == []
    denied = AuditEvent.objects.get(event_type="sandbox.egress.denied")
    assert denied.reason == "egress_internal_address"
    assert json.loads(denied.data)["address"] in ("127.0.0.1", "::1")


class EgressNotRecorded(DatabaseAuthorizer):
    """The database refuses the run's egress events (and only those)."""

    def egress(self, spec, decision):
        raise RuntimeError("the audit log refused the egress event")


def test_an_attempt_that_cannot_be_recorded_never_connects_and_fails_the_run(
    backend, code_exec, spec_for, servers
):
    """Recorded first, then connected: an allowed destination whose attempt could not
    be put on record is refused (503) before the proxy connects anywhere, and the run
    fails instead of carrying on unrecorded. Its record still ends, saying why."""
    a, _ = servers
    if not _granted(backend, code_exec, spec_for, f"127.0.0.1:{a.port}"):
        return
    script = SCRIPT.split("print(", 1)[0] + 'print("GET", get("127.0.0.1", A, "/plain"))\n'
    spec = spec_for(script.format(a=a.port, b=a.port), backend=backend)
    outcome, out, _ = run(spec, EgressNotRecorded())
    assert a.hits == []  # nothing reached the server
    assert outcome.exit_code == EXIT_ERROR  # an attempt of the run is not on record
    assert out in ("", "GET 503 egress refused: the attempt could not be recorded\n")
    assert not [e for e in AuditEvent.objects.all() if e.event_type.startswith("sandbox.egress")]
    assert events_of(spec.run_id) == [
        "sandbox.run.requested",
        "sandbox.run.started",
        "sandbox.run.finished",
    ]
    record = run_record(spec.run_id)
    assert "an egress attempt was not recorded" in record.error
    assert "the audit log refused the egress event" in record.error
    assert leftovers(backend, spec.run_id) == []


FLOOD = """
import socket
while True:  # junk attempts through the proxy, as fast as it answers, until stopped
    s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
    s.sendall(b"x\\r\\n\\r\\n")
    s.recv(1024)
    s.close()
"""


def test_a_flood_of_egress_attempts_stops_the_run_with_each_recorded_one_logged(
    backend, code_exec, spec_for, servers, monkeypatch, capfd
):
    """Attempts are recorded in bounded batches (the deadline check still runs), and
    past MAX_EGRESS_ATTEMPTS the run is stopped: a flood cannot outlast its deadline or
    grow the audit log without bound. Such a run is denied (EXIT_DENIED, 77), not the
    137 of the SIGKILL that stopped it."""
    from sandbox_runner import runner

    a, _ = servers
    if not _granted(backend, code_exec, spec_for, f"127.0.0.1:{a.port}"):
        return
    monkeypatch.setattr(runner, "MAX_EGRESS_ATTEMPTS", 25)
    spec = spec_for(FLOOD, backend=backend, limits={"wall_seconds": 30})
    outcome, _, err = run(spec)
    record = run_record(spec.run_id)
    assert "over 25 egress attempts: stopped" in record.error, err
    assert not record.timed_out  # stopped by the cap, long before its deadline
    assert outcome.exit_code == runner.EXIT_DENIED
    assert "denied while it ran: over 25 egress attempts: stopped" in capfd.readouterr().err
    finished = AuditEvent.objects.get(event_type="sandbox.run.finished")
    assert "over 25 egress attempts: stopped" in json.loads(finished.data)["error"]
    logged = AuditEvent.objects.filter(event_type="sandbox.egress.denied")
    assert logged.count() == 25
    assert {json.loads(e.data)["run_id"] for e in logged} == {spec.run_id}
    assert events_of(spec.run_id)[-1] == "sandbox.run.finished"
    assert leftovers(backend, spec.run_id) == []
