"""SANDBOX_BACKENDS: the deployment, not the caller, decides which sandboxes may run.

A run asking for a backend outside the list is denied (backend_not_allowed)
before anything starts, in-process and over HTTP, and recorded like any other
refusal; a run under an allowed backend (here gVisor alone) runs. Bad values
stop start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from governance.audit import Actor
from governance.models import AuditEvent
from governance.services.agents import token_issue
from sandbox_runner.authorizers import HttpAuthorizer
from sandbox_runner.runner import EXIT_DENIED, execute
from tests.sandbox_runner.conftest import events_of, leftovers, run_record
from tests.sandbox_runner.test_docker_probes import all_container_ids, run

pytestmark = pytest.mark.django_db

MARKER = "the code ran"


def _assert_refused(outcome, spec, backend: str, *, over_http: bool = False) -> None:
    assert outcome.exit_code == EXIT_DENIED
    assert (outcome.auth.outcome, outcome.auth.reason) == ("deny", "backend_not_allowed")
    message = (
        f"this deployment runs sandboxes only under gvisor (SANDBOX_BACKENDS); "
        f"the run asked for {backend}"
    )
    assert outcome.auth.message == message
    record = run_record(spec.run_id)
    assert (record.status, record.backend) == ("denied", backend)
    assert (record.decision, record.reason, record.message) == (
        "deny",
        "backend_not_allowed",
        message,
    )
    assert record.started_at is None and record.limits == {}
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.denied"]
    denied = AuditEvent.objects.get(event_type="sandbox.run.denied")
    assert (denied.decision, denied.reason) == ("deny", "backend_not_allowed")
    # The grant covered the question; the deployment's rule refused the run, before the
    # confirmation gate, and the decision's event says so.
    assert not AuditEvent.objects.filter(event_type="access.allowed").exists()
    decided = AuditEvent.objects.get(event_type="access.denied")
    assert (decided.decision, decided.reason) == ("deny", "backend_not_allowed")
    # The event names the grant that covered the question; an answer names one only
    # with an allow (as /authorize's), so a runner never reads a deny as leave to run.
    assert decided.grant_id is not None
    assert outcome.auth.grant_id == (None if over_http else decided.grant_id)
    assert leftovers(backend, spec.run_id) == []


@pytest.mark.parametrize("backend", ["docker", "bubblewrap"], indirect=True)
def test_a_backend_outside_sandbox_backends_is_denied_before_anything_starts(
    backend, docker_client, code_exec, spec_for, settings
):
    settings.SANDBOX_BACKENDS = ["gvisor"]
    code_exec.grant()
    before = all_container_ids(docker_client)
    spec = spec_for(f"print({MARKER!r})", backend=backend)
    outcome, out, _ = run(spec)
    _assert_refused(outcome, spec, backend)
    assert MARKER not in out
    assert all_container_ids(docker_client) == before


@pytest.mark.django_db(transaction=True)
def test_over_http_a_backend_outside_sandbox_backends_is_denied(
    live_server, docker_client, code_exec, alice, spec_for, settings
):
    settings.SANDBOX_BACKENDS = ["gvisor"]
    code_exec.grant()
    _, token = token_issue(
        created_by=alice, agent=code_exec.agent, actor=Actor.system("test"), at=datetime.now(UTC)
    )
    before = all_container_ids(docker_client)
    spec = spec_for(f"print({MARKER!r})", backend="docker")
    outcome = execute(spec, HttpAuthorizer(live_server.url, token))
    _assert_refused(outcome, spec, "docker", over_http=True)
    assert all_container_ids(docker_client) == before


@pytest.mark.parametrize("backend", ["gvisor"], indirect=True)
def test_under_a_gvisor_only_deployment_a_gvisor_run_runs(backend, code_exec, spec_for, settings):
    settings.SANDBOX_BACKENDS = ["gvisor"]
    code_exec.grant()
    spec = spec_for(f"print({MARKER!r})", backend=backend)
    outcome, out, _ = run(spec)
    assert outcome.exit_code == 0 and out == MARKER + "\n"
    record = run_record(spec.run_id)
    assert (record.status, record.backend, record.exit_code) == ("finished", "gvisor", 0)
    assert events_of(spec.run_id) == [
        "sandbox.run.requested",
        "sandbox.run.started",
        "sandbox.run.finished",
    ]
    assert AuditEvent.objects.filter(event_type="access.allowed").count() == 1


def _setup_with(value: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import django; django.setup(); "
        "from django.conf import settings; print(settings.SANDBOX_BACKENDS)"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "governance.settings", "SANDBOX_BACKENDS": value}
    return subprocess.run(  # noqa: S603 - our own interpreter
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("value", ["", "docker,", "docker,nope", "gvisor,gvisor", "Docker"])
def test_a_bad_sandbox_backends_value_stops_start_up(value):
    proc = _setup_with(value)
    assert proc.returncode != 0
    assert "ImproperlyConfigured" in proc.stderr and "SANDBOX_BACKENDS" in proc.stderr


def test_sandbox_backends_is_read_from_the_environment():
    proc = _setup_with(" gvisor , bubblewrap")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['gvisor', 'bubblewrap']"


def test_the_runner_cli_takes_its_default_backend_from_sandbox_backend(monkeypatch):
    from sandbox_runner.cli import _parser, chosen_backend

    argv = ["run", "--agent", "coder", "--", "true"]

    def backend(args: list[str]) -> str:
        return chosen_backend(_parser().parse_args(args).backend)

    monkeypatch.setenv("SANDBOX_BACKEND", "gvisor")
    assert backend(argv) == "gvisor"
    assert backend([*argv[:3], "--backend", "docker", *argv[3:]]) == "docker"
    monkeypatch.delenv("SANDBOX_BACKEND")
    assert backend(argv) == "docker"


def test_an_execute_grant_on_a_tool_that_is_not_code_execution_starts_no_sandbox(
    docker_client, code_exec, make_tool, make_grant, spec_for
):
    """`execute` on a pipeline trigger (kind api) is not a licence to run arbitrary code:
    the question is allowed by its grant, the run is refused, nothing starts."""
    trigger = make_tool("trigger-pipeline", actions=("execute",), kind="api")
    make_grant(
        code_exec.agent, trigger, actions=("execute",), scope="sandbox:*", task=code_exec.task,
        starts_at=timezone.now() - timedelta(minutes=30), duration=timedelta(days=3),
    )  # fmt: skip
    before = all_container_ids(docker_client)
    spec = spec_for(f"print({MARKER!r})", tool="trigger-pipeline")
    outcome, out, _ = run(spec)
    assert outcome.exit_code == EXIT_DENIED and MARKER not in out
    assert (outcome.auth.outcome, outcome.auth.reason) == ("deny", "not_code_exec_tool")
    record = run_record(spec.run_id)
    assert (record.status, record.reason) == ("denied", "not_code_exec_tool")
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.denied"]
    denied = AuditEvent.objects.get(event_type="sandbox.run.denied")
    assert (denied.decision, denied.reason) == ("deny", "not_code_exec_tool")
    assert all_container_ids(docker_client) == before
