"""`python -m sandbox_runner` as a caller sees it: arguments, exit statuses,
streamed output; and the HTTP adapter end to end against a live server."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from governance.audit import Actor
from governance.models import AuditEvent, SandboxRun
from governance.services.agents import token_issue
from sandbox_runner.authorizers import HttpAuthorizer
from sandbox_runner.cli import EXIT_USAGE, main, memory_mb
from sandbox_runner.runner import EXIT_DENIED, execute
from sandbox_runner.spec import SCRIPT_PATH, RunSpec


@pytest.mark.django_db
def test_run_with_a_script_and_limits_mirrors_the_exit_status(
    docker_client, code_exec, tmp_path, capfdbinary
):
    code_exec.grant()
    script = tmp_path / "s.py"
    script.write_text(
        "import os, sys\nprint(open(os.environ['SANDBOX_INPUT']).read())\nsys.exit(9)\n"
    )
    data = tmp_path / "in.txt"
    data.write_text("payload")
    argv = ["run", "--agent", "coder", "--task", "SBX-1", "--memory", "128m", "--pids", "16"]
    argv += ["--scratch", "8m"]
    code = main([*argv, "--timeout", "20", "--input", str(data), "--script", str(script)])
    assert code == 9
    assert capfdbinary.readouterr().out == b"payload\n"
    run = SandboxRun.objects.get()
    assert run.limits == {
        "memory_mb": 128,
        "cpus": 1.0,
        "pids": 16,
        "wall_seconds": 20,
        "scratch_mb": 8,
    }
    assert run.input_sha256 and run.command == ["python3", SCRIPT_PATH]


@pytest.mark.django_db
def test_run_with_a_command_after_the_double_dash(docker_client, code_exec, capfdbinary):
    code_exec.grant()
    code = main(["run", "--agent", "coder", "--task", "SBX-1", "--", "sh", "-c", "echo hi; exit 4"])
    assert code == 4
    assert capfdbinary.readouterr().out == b"hi\n"
    assert SandboxRun.objects.get().command == ["sh", "-c", "echo hi; exit 4"]


@pytest.mark.django_db
def test_a_denial_prints_the_reason_and_exits_with_its_own_status(docker_client, code_exec, capfd):
    # docker_client: the backend is checked before governance is asked (an allow is
    # never spent on a host that cannot run the sandbox).
    code = main(["run", "--agent", "coder", "--task", "SBX-1", "--", "true"])
    assert code == EXIT_DENIED
    assert "not started: deny (no_grant)" in capfd.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--agent", "a"],  # neither script nor command
        ["run", "--agent", "a", "--script", "/nonexistent/script.py"],
    ],
)
def test_usage_errors(argv, capfd):
    assert main(argv) == EXIT_USAGE
    assert "sandbox_runner:" in capfd.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "two"])
def test_cpus_must_be_a_finite_number(value, capfd):
    with pytest.raises(SystemExit) as caught:
        main(["run", "--agent", "a", "--cpus", value, "--", "true"])
    assert caught.value.code == EXIT_USAGE  # argparse's own would be 2
    assert "argument --cpus" in capfd.readouterr().err


def test_the_http_adapter_needs_a_token(monkeypatch, capfd):
    monkeypatch.delenv("GOVERNANCE_TOKEN", raising=False)
    assert main(["run", "--agent", "a", "--api", "http://127.0.0.1:9", "--", "true"]) == EXIT_USAGE


@pytest.mark.parametrize(("text", "mb"), [("256m", 256), ("1g", 1024), ("64", 64), ("2048k", 2)])
def test_memory_sizes(text, mb):
    assert memory_mb(text) == mb


@pytest.mark.django_db(transaction=True)
def test_the_http_adapter_runs_an_allowed_script_and_reports_the_outcome(
    live_server, docker_client, code_exec, alice
):
    code_exec.grant(limits={"memory_mb": 96})
    _, token = token_issue(
        created_by=alice, agent=code_exec.agent, actor=Actor.system("test"), at=datetime.now(UTC)
    )
    spec = RunSpec(
        agent="coder", task="SBX-1", command=("python3", SCRIPT_PATH), script=b"print('remote')"
    )
    outcome = execute(spec, HttpAuthorizer(live_server.url, token))
    assert outcome.exit_code == 0
    # The grant's ceiling, applied by the server, holds over HTTP too.
    assert outcome.auth.limits.memory_mb == 96
    record = SandboxRun.objects.get(run_id=spec.run_id)
    assert record.status == "finished" and record.limits["memory_mb"] == 96
    allowed = AuditEvent.objects.get(event_type="access.allowed")
    assert allowed.tool == "code-exec" and allowed.action == "execute"
    reported = AuditEvent.objects.get(event_type="access.outcome")
    data = json.loads(reported.data)
    assert data["outcome"] == "succeeded"
    assert data["result_digest"] == outcome.result.stdout.sha256


@pytest.mark.django_db(transaction=True)
def test_over_http_a_request_above_the_grant_is_denied(
    live_server, docker_client, code_exec, alice
):
    code_exec.grant(limits={"memory_mb": 96})
    _, token = token_issue(
        created_by=alice, agent=code_exec.agent, actor=Actor.system("test"), at=datetime.now(UTC)
    )
    before = {c.id for c in docker_client.containers.list(all=True)}
    spec = RunSpec(agent="coder", task="SBX-1", command=("true",), limits={"memory_mb": 128})
    outcome = execute(spec, HttpAuthorizer(live_server.url, token))
    assert outcome.exit_code == EXIT_DENIED
    assert outcome.auth.reason == "limit_exceeds_grant"
    assert {c.id for c in docker_client.containers.list(all=True)} == before
    record = SandboxRun.objects.get(run_id=spec.run_id)
    assert (record.status, record.reason) == ("denied", "limit_exceeds_grant")
    assert not AuditEvent.objects.filter(event_type="sandbox.run.started").exists()


@pytest.mark.django_db
def test_a_secret_on_the_command_line_is_masked_in_the_audit_log(docker_client, code_exec, capfd):
    argv = ["run", "--agent", "coder", "--task", "SBX-1", "--"]
    code = main([*argv, "curl", "-H", "Authorization: Bearer sekrit-token-123"])
    assert code == EXIT_DENIED
    requested = AuditEvent.objects.get(event_type="sandbox.run.requested")
    assert "sekrit-token-123" not in requested.data
    assert "[secret]" in json.loads(requested.data)["arguments"]["command"][2]


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--agent", "a", "--timeout", "abc", "--", "true"],
        ["run", "--agent", "a", "--pids", "x", "--", "true"],
        ["nothing"],
    ],
)
def test_a_bad_argument_is_a_usage_error_not_argparses_2(argv, capfd):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == EXIT_USAGE
    assert "sandbox_runner:" in capfd.readouterr().err


@pytest.mark.parametrize("api", ["ftp://x", "http://example.com"])
def test_a_governance_url_the_client_refuses_is_a_usage_error_not_a_traceback(
    api, monkeypatch, capfd
):
    """Plain http off this machine, or not http(s): refused before any traffic."""
    monkeypatch.setenv("GOVERNANCE_TOKEN", "t")
    assert main(["run", "--agent", "a", "--api", api, "--", "true"]) == EXIT_USAGE
    assert "sandbox_runner: --api:" in capfd.readouterr().err
