"""Adversarial probes against a real Docker engine. Each probe checks the
outcome AND the run record and its audit events. The code under test is
hostile on purpose; nothing here talks to any address but 127.0.0.1 or
namespaces the test itself made."""

from __future__ import annotations

import io

import pytest

from sandbox_runner.authorizers import DatabaseAuthorizer
from sandbox_runner.runner import EXIT_DENIED, EXIT_TIMEOUT, execute
from tests.sandbox_runner.conftest import containers_of, events_of, run_record

pytestmark = pytest.mark.django_db


def run(spec):
    out, err = io.BytesIO(), io.BytesIO()
    outcome = execute(spec, DatabaseAuthorizer(), stdout=out, stderr=err)
    return outcome, out.getvalue().decode(), err.getvalue().decode()


def test_a_trivial_script_runs_and_is_recorded(docker_client, code_exec, spec_for):
    code_exec.grant()
    spec = spec_for("print('hello'); raise SystemExit(3)")
    outcome, out, _ = run(spec)
    assert outcome.exit_code == 3
    assert out == "hello\n"
    record = run_record(spec.run_id)
    assert record.status == "finished" and record.exit_code == 3
    assert record.stdout_excerpt == "hello\n" and record.image_digest.startswith("sha256:")
    assert events_of(spec.run_id) == [
        "sandbox.run.requested",
        "sandbox.run.started",
        "sandbox.run.finished",
    ]
    assert containers_of(docker_client, spec.run_id) == []


def test_no_grant_starts_no_container(docker_client, code_exec, spec_for):
    spec = spec_for("print('never')")
    outcome, out, _ = run(spec)
    assert outcome.exit_code == EXIT_DENIED and out == ""
    assert run_record(spec.run_id).reason == "no_grant"
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.denied"]
    assert containers_of(docker_client, spec.run_id) == []


def test_sleep_past_the_timeout_is_killed(docker_client, code_exec, spec_for):
    code_exec.grant()
    spec = spec_for("import time; time.sleep(30)", limits={"wall_seconds": 2})
    outcome, _, _ = run(spec)
    assert outcome.exit_code == EXIT_TIMEOUT
    record = run_record(spec.run_id)
    assert record.timed_out
    assert (record.finished_at - record.deadline_at).total_seconds() < 2
    assert containers_of(docker_client, spec.run_id) == []
