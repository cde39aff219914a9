"""Adversarial probes against a real Docker engine, and bubblewrap where they
apply. Each probe checks the
outcome AND the run record and its audit events. The code under test is
hostile on purpose. Network rule: traffic only to 127.0.0.1 or to namespaces
the test itself made (a container with --network none has only its own
loopback, so nothing it tries can leave it)."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.utils import timezone

from governance.models import AuditEvent
from sandbox_runner.authorizers import DatabaseAuthorizer, HttpAuthorizer
from sandbox_runner.backends.base import LABEL_ROLE
from sandbox_runner.runner import (
    EXIT_APPROVAL,
    EXIT_BACKEND,
    EXIT_DENIED,
    EXIT_MALFORMED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    execute,
)
from sandbox_runner.spec import DEFAULT_IMAGE
from tests.sandbox_runner.conftest import containers_of, events_of, leftovers, run_record

pytestmark = pytest.mark.django_db


def run(spec, authorizer=None, **kw):
    out, err = io.BytesIO(), io.BytesIO()
    outcome = execute(spec, authorizer or DatabaseAuthorizer(), stdout=out, stderr=err, **kw)
    return outcome, out.getvalue().decode(), err.getvalue().decode()


def all_container_ids(client) -> set[str]:
    return {c.id for c in client.containers.list(all=True)}


def test_a_trivial_script_runs_and_is_recorded(backend, code_exec, spec_for):
    code_exec.grant()
    spec = spec_for(
        "import sys; print('hello'); print('oops', file=sys.stderr); raise SystemExit(3)",
        backend=backend,
    )
    outcome, out, err = run(spec)
    assert outcome.exit_code == 3
    assert out == "hello\n" and "oops" in err
    record = run_record(spec.run_id)
    assert record.status == "finished" and record.exit_code == 3 and not record.timed_out
    assert record.stdout_excerpt == "hello\n" and record.stderr_excerpt == "oops\n"
    assert record.image_digest.startswith("host:" if backend == "bubblewrap" else "sha256:")
    assert record.backend == backend
    assert record.script_sha256 == spec.script_sha256
    assert record.limits == {
        "memory_mb": 256,
        "cpus": 1.0,
        "pids": 64,
        "wall_seconds": 60,
        "scratch_mb": 64,
    }
    pids = {
        "docker": "docker",
        "gvisor": "docker (gVisor kernel threads)",
        "bubblewrap": "cgroup",
    }
    assert record.enforcement["pids"] == pids[backend]
    assert events_of(spec.run_id) == [
        "sandbox.run.requested",
        "sandbox.run.started",
        "sandbox.run.finished",
    ]
    assert leftovers(backend, spec.run_id) == []


class StartRecordWatcher(DatabaseAuthorizer):
    """Notes the container's state when its start is being recorded; optionally the
    database then fails (slowly, so a started container would have printed)."""

    def __init__(self, client, fail: bool) -> None:
        super().__init__()
        self.client, self.fail, self.state, self.states = client, fail, None, {}

    def started(self, spec, auth, result, deadline):
        self.state = self.client.containers.get(result.container_id).status
        # Every container of the run (the sandbox and, with egress, its network
        # holder), by role: none may be running yet.
        self.states = {
            c.labels[LABEL_ROLE]: c.status for c in containers_of(self.client, spec.run_id)
        }
        if self.fail:
            time.sleep(0.5)
            raise RuntimeError("the database went away")
        super().started(spec, auth, result, deadline)


@pytest.mark.parametrize("backend", ["docker", "gvisor"], indirect=True)
def test_the_start_is_on_record_before_the_container_starts(
    backend, docker_client, code_exec, spec_for
):
    code_exec.grant()
    spec = spec_for("print('ran', flush=True)", backend=backend)
    watcher = StartRecordWatcher(docker_client, fail=False)
    outcome, out, _ = run(spec, watcher)
    assert watcher.state == "created"  # not running yet while its start was recorded
    assert outcome.exit_code == 0 and out == "ran\n"
    assert events_of(spec.run_id) == [
        "sandbox.run.requested",
        "sandbox.run.started",
        "sandbox.run.finished",
    ]


def test_with_egress_nothing_of_the_image_runs_before_the_start_is_on_record(
    docker_client, code_exec, spec_for
):
    """The network holder runs `sleep` from the run's image: it is created with the
    sandbox but started only once the start is on record, like the sandbox."""
    code_exec.grant(egress=["127.0.0.1:9"])
    spec = spec_for("print('ran', flush=True)")
    watcher = StartRecordWatcher(docker_client, fail=False)
    outcome, out, _ = run(spec, watcher)
    assert watcher.states == {"sandbox": "created", "holder": "created"}
    assert outcome.exit_code == 0 and out == "ran\n"
    assert events_of(spec.run_id) == [
        "sandbox.run.requested",
        "sandbox.run.started",
        "sandbox.run.finished",
    ]
    assert leftovers("docker", spec.run_id) == []


@pytest.mark.parametrize("egress", [False, True])
@pytest.mark.parametrize("backend", ["docker", "gvisor"], indirect=True)
def test_a_start_that_cannot_be_recorded_never_starts_the_container(
    backend, docker_client, code_exec, spec_for, egress
):
    if egress and backend == "gvisor":
        pytest.skip("egress is refused under gVisor (test_egress_proxy covers it)")
    code_exec.grant(**({"egress": ["127.0.0.1:9"]} if egress else {}))
    spec = spec_for("print('ran', flush=True)", backend=backend)
    watcher = StartRecordWatcher(docker_client, fail=True)
    outcome, out, _ = run(spec, watcher)
    assert watcher.state == "created"
    assert set(watcher.states.values()) == {"created"}
    assert len(watcher.states) == (2 if egress else 1)
    assert outcome.exit_code == EXIT_BACKEND
    assert out == "" and outcome.result.stdout.total == 0  # the code never ran
    record = run_record(spec.run_id)
    assert record.status == "failed" and record.exit_code is None
    assert "the database went away" in record.error
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.finished"]
    assert leftovers(backend, spec.run_id) == []


def test_output_past_the_cap_is_truncated_but_hashed_whole(docker_client, code_exec, spec_for):
    import hashlib

    code_exec.grant()
    spec = spec_for("import sys; sys.stdout.write('x' * (2 * 1024 * 1024))")
    outcome, out, _ = run(spec)
    assert outcome.exit_code == 0 and len(out) == 2 * 1024 * 1024  # streamed in full
    record = run_record(spec.run_id)
    assert record.stdout_bytes == 2 * 1024 * 1024
    assert record.stdout_sha256 == hashlib.sha256(b"x" * (2 * 1024 * 1024)).hexdigest()
    assert len(outcome.result.stdout.head) == 1024 * 1024


# --- Refusals: no container is ever created --------------------------------------------


def test_no_grant_starts_no_container(docker_client, code_exec, spec_for):
    before = all_container_ids(docker_client)
    spec = spec_for("print('never')")
    outcome, out, _ = run(spec)
    assert outcome.exit_code == EXIT_DENIED and out == ""
    assert run_record(spec.run_id).reason == "no_grant"
    assert run_record(spec.run_id).status == "denied"
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.denied"]
    assert all_container_ids(docker_client) == before


def test_an_expired_grant_starts_no_container(docker_client, code_exec, spec_for):
    real_now = datetime.now(UTC)
    code_exec.grant(starts_at=real_now - timedelta(hours=2), duration=timedelta(hours=1))
    before = all_container_ids(docker_client)
    spec = spec_for("print('never')")
    outcome, _, _ = run(spec)
    assert outcome.exit_code == EXIT_DENIED
    assert run_record(spec.run_id).reason == "grant_expired"
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.denied"]
    assert all_container_ids(docker_client) == before


def test_approval_pending_starts_no_container(
    docker_client, make_agent, make_tool, make_grant, make_task, spec_for
):
    agent = make_agent("coder")
    tool = make_tool("code-exec", actions=("execute",), irreversible=True, kind="code_exec")
    make_grant(
        agent,
        tool,
        actions=("execute",),
        scope="sandbox:*",
        task=make_task("SBX-1"),
        starts_at=timezone.now() - timedelta(minutes=30),
        duration=timedelta(days=3),
    )
    before = all_container_ids(docker_client)
    spec = spec_for("print('never')")
    outcome, _, _ = run(spec)
    assert outcome.exit_code == EXIT_APPROVAL
    assert outcome.auth.approval_id
    record = run_record(spec.run_id)
    assert (record.decision, record.status) == ("approval_required", "denied")
    assert "access.approval_required" in set(
        AuditEvent.objects.values_list("event_type", flat=True)
    )
    assert all_container_ids(docker_client) == before


@pytest.mark.parametrize(
    ("limits", "egress", "message"),
    [
        ({"memory_mb": 512}, None, "memory_mb 512 is above the grant's 128"),
        ({"pids": 1000}, None, "pids 1000 is above the grant's 64"),
        ({"wall_seconds": 61}, None, "wall_seconds 61 is above the grant's 60"),
        ({"scratch_mb": 65}, None, "scratch_mb 65 is above the grant's 64"),
        ({}, ("127.0.0.1:9",), "egress to 127.0.0.1:9 is not in the grant"),
        # Below what can be enforced: Docker would read 0 nano-CPUs / 0 pids as unlimited.
        ({"cpus": 1e-10}, None, "cpus must be a number of at least 0.01 (got 1e-10)"),
        ({"pids": 0.5}, None, "pids must be a whole number of at least 1 (got 0.5)"),
        ({"memory_mb": 2}, None, "memory_mb must be a whole number of at least 6 (got 2)"),
        ({"cpus": -1}, None, "cpus must be a number of at least 0.01 (got -1)"),
    ],
)
def test_a_request_above_the_grant_is_denied_not_lowered(
    docker_client, code_exec, spec_for, limits, egress, message
):
    code_exec.grant(limits={"memory_mb": 128})
    before = all_container_ids(docker_client)
    spec = spec_for("print('never')", limits=limits, egress=egress)
    outcome, _, _ = run(spec)
    assert outcome.exit_code == EXIT_DENIED
    record = run_record(spec.run_id)
    assert (record.reason, record.message) == ("limit_exceeds_grant", message)
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.denied"]
    assert all_container_ids(docker_client) == before


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("cpus", float("nan"), "cpus nan is not a number"),
        ("cpus", float("inf"), "cpus inf is above the grant's 1.0"),
        ("cpus", float("-inf"), "cpus must be a number of at least 0.01 (got -inf)"),
        # A whole-number limit: -inf overflowed int(), an internal error, not this denial.
        ("memory_mb", float("-inf"), "memory_mb must be a whole number of at least 6 (got -inf)"),
    ],
)
def test_a_limit_that_is_not_a_finite_number_is_denied_on_record(
    code_exec, spec_for, name, value, message
):
    """NaN passed every comparison, and no non-finite number can be stored as JSON: the
    run record rolled back and the attempt went unrecorded. Now a denial on record."""
    code_exec.grant()
    spec = spec_for("print('never')", limits={name: value})
    auth = DatabaseAuthorizer().authorize(spec)
    assert (auth.outcome, auth.reason, auth.message) == ("deny", "limit_exceeds_grant", message)
    record = run_record(spec.run_id)
    assert (record.status, record.message) == ("denied", message)
    assert record.requested_limits[name] == str(value)
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.denied"]


def test_a_request_below_the_grant_is_honoured(docker_client, code_exec, spec_for):
    code_exec.grant(limits={"memory_mb": 128, "pids": 32, "wall_seconds": 20, "cpus": 1.0})
    spec = spec_for(
        "print(open('/sys/fs/cgroup/memory/memory.limit_in_bytes').read())",
        limits={"memory_mb": 64, "wall_seconds": 10},
    )
    outcome, out, _ = run(spec)
    assert outcome.exit_code == 0
    assert int(out) == 64 * 1024 * 1024
    assert run_record(spec.run_id).limits == {
        "memory_mb": 64,
        "cpus": 1.0,
        "pids": 32,
        "wall_seconds": 10,
        "scratch_mb": 64,
    }


def _ask_canned(docker_client, spec_for, status: int, content_type: str, body: bytes):
    """Run with an authorizer whose every answer is this one; no container is made."""

    class Canned(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        before = all_container_ids(docker_client)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        outcome, _, _ = run(spec_for("print('never')"), HttpAuthorizer(url, "agt_x"))
        assert all_container_ids(docker_client) == before
        return outcome
    finally:
        server.shutdown()


def test_garbage_from_the_authorizer_starts_no_container(docker_client, spec_for):
    garbage = b'{"decision": "allow", "reason": 7}'
    outcome = _ask_canned(docker_client, spec_for, 200, "application/json", garbage)
    assert (outcome.exit_code, outcome.auth.outcome) == (EXIT_MALFORMED, "malformed")


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_a_failing_service_is_unreachable_and_starts_no_container(docker_client, spec_for, status):
    """A 5xx (the app or a proxy in front of it) is 69, try again later; it was 76,
    "a malformed answer", for all but 503."""
    outcome = _ask_canned(docker_client, spec_for, status, "text/html", b"<html>Bad Gateway</html>")
    assert (outcome.exit_code, outcome.auth.outcome) == (EXIT_UNREACHABLE, "unreachable")
    assert str(status) in outcome.auth.message


def test_an_unreachable_authorizer_starts_no_container(docker_client, spec_for):
    with socket.socket() as sock:  # a port that was free a moment ago: nobody listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    before = all_container_ids(docker_client)
    outcome, _, _ = run(spec_for("print('never')"), HttpAuthorizer(f"http://127.0.0.1:{port}", "t"))
    assert outcome.exit_code == EXIT_UNREACHABLE
    assert all_container_ids(docker_client) == before


# --- Confinement -------------------------------------------------------------------------

WRITES = """
import os, subprocess
for path in ("/etc/pwned", "/usr/pwned", "/pwned", "/sandbox/pwned"):
    try:
        open(path, "w").write("x")
        print(path, "WRITTEN")
    except OSError as exc:
        print(path, exc.errno)
open("/workspace/ok", "w").write("fine")
print("/workspace ok")
with open("/tmp/run.sh", "w") as f:
    f.write("#!/bin/sh\\necho EXECUTED\\n")
os.chmod("/tmp/run.sh", 0o755)
try:
    subprocess.run(["/tmp/run.sh"], check=False)
    print("/tmp EXEC-ALLOWED")
except PermissionError:
    print("/tmp noexec")
raise SystemExit(5)
"""


def test_writes_outside_scratch_fail_and_tmp_is_not_executable(backend, code_exec, spec_for):
    code_exec.grant()
    spec = spec_for(WRITES, backend=backend)
    outcome, out, _ = run(spec)
    assert outcome.exit_code == 5
    lines = out.splitlines()
    # 30 = EROFS: the root file system is read-only (gVisor's kernel answers 13, EACCES)
    errno = "13" if backend == "gvisor" else "30"
    assert lines[:4] == [
        f"{p} {errno}" for p in ("/etc/pwned", "/usr/pwned", "/pwned", "/sandbox/pwned")
    ]
    assert lines[4:] == ["/workspace ok", "/tmp noexec"]
    record = run_record(spec.run_id)
    assert (record.status, record.exit_code) == ("finished", 5)


FILL = """
import errno, os
mounts = [line.split() for line in open("/proc/mounts")]
print("fs", *[m[2] for m in mounts if m[1] == "/workspace"], flush=True)
written = 0
try:
    with open("/workspace/fill", "wb") as f:
        while written < 32 << 20:  # bounded, so that no cap fails the test, not the disk
            f.write(b"x" * 65536)
            f.flush()
            written += 65536
    print("no cap", written // (1 << 20), flush=True)
except OSError as exc:
    print("stopped", errno.errorcode[exc.errno], written // (1 << 20), flush=True)
os.remove("/workspace/fill")
open("/workspace/after", "w").write("room again")
print("after", open("/workspace/after").read())
"""


def test_the_scratch_directory_is_capped_and_never_on_the_host_disk(backend, code_exec, spec_for):
    """A run that writes without end gets ENOSPC at its scratch_mb, not the host's
    disk: /workspace is a tmpfs of that size (one mount, nothing bound from the host),
    and the run can go on once it frees space."""
    code_exec.grant(limits={"scratch_mb": 8, "memory_mb": 128})
    spec = spec_for(FILL, backend=backend, limits={"scratch_mb": 4})
    outcome, out, _ = run(spec)
    assert outcome.exit_code == 0, out
    lines = out.splitlines()
    assert lines[0] == "fs tmpfs", out
    words = lines[1].split()
    assert words[:2] == ["stopped", "ENOSPC"] and 3 <= int(words[2]) <= 4, out
    assert lines[-1] == "after room again"
    record = run_record(spec.run_id)
    assert record.status == "finished" and record.limits["scratch_mb"] == 4
    scratch = {"docker": "docker tmpfs", "gvisor": "docker tmpfs", "bubblewrap": "bwrap tmpfs"}
    assert record.enforcement["scratch"] == scratch[backend]
    assert events_of(spec.run_id)[-1] == "sandbox.run.finished"


FORK = """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        n += 1
except OSError as exc:
    print("stopped after", n, type(exc).__name__, flush=True)
"""


def test_a_fork_bomb_is_stopped_by_the_pids_limit(backend, code_exec, spec_for):
    if backend == "gvisor":
        pytest.skip("gVisor: the pids limit counts the sentry's host threads, not guest forks")
    code_exec.grant()
    spec = spec_for(FORK, limits={"pids": 16, "wall_seconds": 20}, backend=backend)
    outcome, out, _ = run(spec)
    assert outcome.exit_code == 0
    words = out.split()
    assert words[:2] == ["stopped", "after"] and int(words[2]) < 16
    assert words[3] == "BlockingIOError"  # EAGAIN from fork(): the cgroup's pids.max
    # The host and this process are unaffected.
    assert subprocess.run(["true"], check=False).returncode == 0
    record = run_record(spec.run_id)
    assert record.status == "finished" and record.limits["pids"] == 16
    assert record.enforcement["pids"] == ("cgroup" if backend == "bubblewrap" else "docker")


def test_a_memory_balloon_is_oom_killed_and_recorded(backend, code_exec, spec_for):
    if backend == "gvisor":
        # Seen both ways here: killed (137) with the engine's OOMKilled flag set, and not.
        pytest.skip("gVisor: the engine does not reliably report OOMKilled under runsc")
    code_exec.grant()
    spec = spec_for(
        "b = []\nwhile True: b.append(bytearray(8 * 1024 * 1024))",
        limits={"memory_mb": 64, "wall_seconds": 30},
        backend=backend,
    )
    outcome, _, _ = run(spec)
    assert outcome.exit_code == 137
    record = run_record(spec.run_id)
    assert record.oom_killed and record.exit_code == 137 and not record.timed_out
    finished = AuditEvent.objects.filter(event_type="sandbox.run.finished").last()
    assert json.loads(finished.data)["oom_killed"] is True
    assert leftovers(backend, spec.run_id) == []


def test_sleep_past_the_timeout_is_killed_within_two_seconds(backend, code_exec, spec_for):
    code_exec.grant()
    spec = spec_for("import time; time.sleep(30)", limits={"wall_seconds": 2}, backend=backend)
    outcome, _, _ = run(spec)
    assert outcome.exit_code == EXIT_TIMEOUT
    record = run_record(spec.run_id)
    assert record.timed_out and record.status == "finished"
    assert (record.finished_at - record.deadline_at).total_seconds() < 2
    assert leftovers(backend, spec.run_id) == []


def test_a_kill_the_engine_fails_at_the_deadline_is_sent_again(
    docker_client, code_exec, spec_for, monkeypatch
):
    """One engine error on the SIGKILL at the deadline (a busy engine, the client's
    timeout) let the code run on to its own end: 25 s under a 2 s wall limit. The error
    is staged (the engine cannot be made busy on demand); the container is real."""
    import docker.errors
    from docker.models.containers import Container

    real_kill, kills = Container.kill, []

    def kill_failing_once(self, *args, **kwargs):
        kills.append(self.id)
        if len(kills) == 1:
            raise docker.errors.APIError("engine busy (staged)")
        return real_kill(self, *args, **kwargs)

    monkeypatch.setattr(Container, "kill", kill_failing_once)
    code_exec.grant()
    spec = spec_for("import time; time.sleep(25)", limits={"wall_seconds": 2})
    outcome, _, _ = run(spec)
    assert outcome.exit_code == EXIT_TIMEOUT and len(kills) >= 2
    record = run_record(spec.run_id)
    assert record.timed_out and record.status == "finished"
    assert (record.finished_at - record.deadline_at).total_seconds() < 2
    assert leftovers("docker", spec.run_id) == []


PRIVILEGES = """
import os, subprocess
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
print("uid", os.getuid(), os.getgid())
print("CapEff", status["CapEff"].strip())
print("CapPrm", status["CapPrm"].strip())
print("NoNewPrivs", status["NoNewPrivs"].strip())
print("Seccomp", status["Seccomp"].strip())
def attempt(*argv):
    done = subprocess.run(argv, capture_output=True, text=True)
    return "refused" if done.returncode != 0 else "SUCCEEDED"
print("mount", attempt("mount", "-t", "tmpfs", "none", "/workspace"))
print("unshare-user", attempt("unshare", "--user", "--map-root-user", "true"))
print("unshare-mount", attempt("unshare", "--mount", "true"))
print("docker.sock", any(os.path.exists(p) for p in ("/var/run/docker.sock", "/run/docker.sock")))
"""


def test_privileges_are_gone(backend, code_exec, spec_for):
    if backend == "gvisor":
        # Seen here with Debian's runsc (2022-12-19): its /proc/self/status has no
        # NoNewPrivs line and shows Seccomp 0 (both apply to gVisor's kernel on the host
        # side: the inspect probe checks no-new-privileges), user namespaces exist inside
        # that kernel, and with HOME on the /workspace mount this probe's run ends with
        # the whole gVisor sandbox exiting 2 before the script's own exit.
        pytest.skip("gVisor: /proc/self/status and namespaces are gVisor's own (see comment)")
    code_exec.grant()
    spec = spec_for(PRIVILEGES, backend=backend)
    outcome, out, _ = run(spec)
    assert outcome.exit_code == 0, out
    seen = dict(line.split(" ", 1) for line in out.splitlines())
    assert seen["uid"] == "1000 1000"
    assert seen["CapEff"] == seen["CapPrm"] == "0000000000000000"
    assert seen["NoNewPrivs"] == "1"
    # Filter mode: the engine's default profile; under bubblewrap the runner's own filter.
    assert seen["Seccomp"] == "2"
    assert seen["mount"] == "refused"
    assert seen["unshare-user"] == seen["unshare-mount"] == "refused"
    assert seen["docker.sock"] == "False"
    assert run_record(spec.run_id).exit_code == 0


# Calls the bubblewrap filter blocks (x86-64 numbers), made directly so no other check
# (capabilities, --disable-userns) can be what refuses them.
SYSCALLS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, nr, args in (("keyctl", 250, (0, 0, 0, 0)), ("ptrace", 101, (16, os.getppid(), 0, 0)),
                       ("unshare", 272, (0x00020000,)), ("bpf", 321, (0, 0, 0)),
                       ("getpid", 39, ())):
    ctypes.set_errno(0)
    result = libc.syscall(nr, *args)
    print(name, result if result >= 0 else -ctypes.get_errno())
"""


def test_the_bubblewrap_seccomp_filter_refuses_kernel_surface_calls(
    bwrap_available, code_exec, spec_for
):
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the probe uses x86-64 system call numbers")
    code_exec.grant()
    # The host's own python3 (ctypes is not in the Docker image's python3-minimal).
    spec = spec_for(SYSCALLS, backend="bubblewrap")
    outcome, out, err = run(spec)
    assert outcome.exit_code == 0, err
    seen = dict(line.split(" ", 1) for line in out.splitlines())
    eperm = str(-1)  # -EPERM
    assert seen["keyctl"] == seen["ptrace"] == seen["unshare"] == seen["bpf"] == eperm
    assert int(seen["getpid"]) > 0  # everything else is allowed
    assert run_record(spec.run_id).enforcement["seccomp"] == "filter"


# --- Network ----------------------------------------------------------------------------


def test_without_egress_nothing_is_reachable(backend, code_exec, spec_for):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    script = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3)
    print("connect OK")
except OSError as exc:
    print("connect", type(exc).__name__)
try:
    socket.getaddrinfo("sandbox-probe.invalid", 80)
    print("dns OK")
except OSError as exc:
    print("dns", type(exc).__name__)
print("interfaces", sorted(name for _, name in socket.if_nameindex()))
"""
    try:
        code_exec.grant()
        spec = spec_for(script, backend=backend)
        outcome, out, _ = run(spec)
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached the test's server
    finally:
        server.close()
    assert outcome.exit_code == 0
    assert out.splitlines() == [
        "connect ConnectionRefusedError",
        "dns gaierror",
        "interfaces ['lo']",
    ]
    assert run_record(spec.run_id).egress == []
    assert not AuditEvent.objects.filter(event_type__startswith="sandbox.egress").exists()


@pytest.mark.parametrize("backend", ["docker", "gvisor"], indirect=True)
def test_inspect_of_a_running_sandbox_shows_every_hardening_flag(
    backend, docker_client, code_exec, spec_for
):
    # gVisor's own kernel runs as host threads inside the limit: 20 leaves it none to start.
    pids = 64 if backend == "gvisor" else 20
    code_exec.grant(limits={"memory_mb": 96, "cpus": 0.5, "pids": pids})
    seen = {}

    def inspect(spec, handle):
        seen.update(docker_client.api.inspect_container(handle.container_id))

    spec = spec_for("import time; time.sleep(1)", backend=backend)
    outcome, _, _ = run(spec, on_started=inspect)
    assert outcome.exit_code == 0
    host, config = seen["HostConfig"], seen["Config"]
    assert seen["State"]["Running"] is True
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert host["SecurityOpt"] == ["no-new-privileges"]  # and no seccomp=unconfined
    assert host["Privileged"] is False
    assert host["Runtime"] == {"docker": "runc", "gvisor": "runsc"}[backend]
    assert host["PidsLimit"] == pids
    assert host["Memory"] == host["MemorySwap"] == 96 * 1024 * 1024
    assert host["NanoCpus"] == 500_000_000
    assert host["NetworkMode"] == "none"
    assert (host["IpcMode"], host["CgroupnsMode"]) == ("private", "private")
    assert config["User"] == "1000:1000"
    assert "noexec" in host["Tmpfs"]["/tmp"]
    # /workspace is a tmpfs of the run's scratch_mb, not a host directory: the only
    # host path in the container is the script, read-only.
    assert host["Tmpfs"]["/workspace"] == "rw,nosuid,nodev,size=64m,uid=1000,gid=1000,mode=0700"
    mounts = {m["Destination"]: (m["RW"], m["Source"]) for m in seen["Mounts"]}
    assert set(mounts) == {"/sandbox/script"} and mounts["/sandbox/script"][0] is False
    assert config["Labels"]["governance.sandbox.run"] == spec.run_id
    assert float(config["Labels"]["governance.sandbox.deadline"]) > 0
    assert config["Labels"]["governance.sandbox.agent"] == "coder"
    assert run_record(spec.run_id).container_id == seen["Id"]


FLOOD_STDOUT = """
import sys, time
line = b"x" * 65535 + b"\\n"
for _ in range(64):  # 4 MiB, four times what the runner keeps
    sys.stdout.buffer.write(line)
sys.stdout.flush()
time.sleep(1)
"""


@pytest.mark.parametrize("backend", ["docker", "gvisor"], indirect=True)
def test_output_is_kept_by_the_runner_only_never_in_an_engine_log_on_the_host(
    backend, docker_client, code_exec, spec_for
):
    """The engine's default json-file log kept every byte a run wrote on the host's
    disk, without limit (the runner keeps 1 MiB). The sandbox and its network holder
    have no engine log; the runner still reads the whole stream."""
    # Egress (Docker only: refused under gVisor) gives the run its network holder too.
    code_exec.grant(egress=["127.0.0.1:9"] if backend == "docker" else [])
    seen = []

    def inspect(spec, handle):
        for item in (handle.container, handle.holder):
            if item is not None:
                seen.append(docker_client.api.inspect_container(item.id))

    spec = spec_for(FLOOD_STDOUT, backend=backend)
    outcome, out, _ = run(spec, on_started=inspect)
    assert outcome.exit_code == 0
    assert len(seen) == (2 if backend == "docker" else 1)
    for container in seen:
        assert container["HostConfig"]["LogConfig"]["Type"] == "none"
        assert container["LogPath"] == ""  # no file on the host
    assert len(out) == 64 * 65536  # the runner's own stream had every byte
    record = run_record(spec.run_id)
    assert record.stdout_bytes == 64 * 65536
    assert events_of(spec.run_id)[-1] == "sandbox.run.finished"
    assert leftovers(backend, spec.run_id) == []


@pytest.fixture
def image_with_a_volume(docker_client):
    """governance-sandbox:bookworm plus a VOLUME, built here (no pull: the base is
    local) and removed afterwards."""
    tag = f"governance-sandbox-volume-test:{uuid.uuid4().hex[:12]}"
    dockerfile = f"FROM {DEFAULT_IMAGE}\nVOLUME /data\n".encode()
    docker_client.images.build(fileobj=io.BytesIO(dockerfile), tag=tag, pull=False, rm=True)
    yield tag
    docker_client.images.remove(tag, force=True)


@pytest.mark.parametrize("backend", ["docker", "gvisor"], indirect=True)
def test_an_image_that_declares_a_volume_is_refused_before_any_container(
    backend, docker_client, code_exec, spec_for, image_with_a_volume
):
    """The engine gives each VOLUME an anonymous volume: a writable host directory
    outside the read-only root and the scratch cap. Refused, and the run says why."""
    code_exec.grant(egress=["127.0.0.1:9"] if backend == "docker" else [])  # holder too
    containers, volumes = all_container_ids(docker_client), _volume_names(docker_client)
    spec = spec_for("print('ran')", backend=backend, image=image_with_a_volume)
    outcome, out, _ = run(spec)
    assert outcome.exit_code == EXIT_BACKEND and out == ""
    assert (outcome.auth.outcome, outcome.auth.reason) == ("deny", "image_unresolved")
    record = run_record(spec.run_id)
    assert (record.status, record.reason, record.image_id) == ("denied", "image_unresolved", "")
    assert f"image {image_with_a_volume!r} declares VOLUME /data: refused" in record.message
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.denied"]
    event = AuditEvent.objects.get(uid=outcome.auth.decision_id)
    assert (event.event_type, event.reason) == ("access.denied", "image_unresolved")
    assert all_container_ids(docker_client) == containers
    assert _volume_names(docker_client) == volumes


def _volume_names(client) -> set[str]:
    return {v.name for v in client.volumes.list()}


def test_a_missing_image_fails_clearly_and_is_recorded(
    docker_client, make_agent, make_tool, make_task, make_grant, spec_for
):
    agent = make_agent("coder")
    tool = make_tool("code-exec", actions=("execute",), kind="code_exec")
    make_grant(
        agent,
        tool,
        actions=("execute",),
        scope="sandbox:*",
        task=make_task("SBX-1"),
        starts_at=timezone.now() - timedelta(minutes=30),
        duration=timedelta(days=3),
    )
    before = all_container_ids(docker_client)
    spec = spec_for(None, "true", image="governance-sandbox:does-not-exist")
    outcome, _, _ = run(spec)
    assert outcome.exit_code == EXIT_BACKEND
    assert (outcome.auth.outcome, outcome.auth.reason) == ("deny", "image_unresolved")
    record = run_record(spec.run_id)
    assert (record.status, record.reason) == ("denied", "image_unresolved")
    assert "'governance-sandbox:does-not-exist' is not on this engine" in record.message
    assert "build it with scripts/build_sandbox_image.sh" in record.message
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.denied"]
    event = AuditEvent.objects.get(uid=outcome.auth.decision_id)
    assert (event.event_type, event.reason) == ("access.denied", "image_unresolved")
    assert all_container_ids(docker_client) == before
