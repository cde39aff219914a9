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


# --- Every argument is checked before governance is asked -----------------------------


@pytest.fixture
def governance_stub(monkeypatch):
    """A local server standing in for governance, counting what it is asked (a 503 to
    anything: a run that got this far would exit 69, never 64)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asked: list[str] = []

    class Stub(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            asked.append(self.path)
            self.send_response(503)
            self.end_headers()

        do_GET = do_POST  # noqa: N815

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    serve = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    serve.start()
    monkeypatch.setenv("GOVERNANCE_TOKEN", "agt_stub")
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def _exit_of(argv, capfd):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit through _Parser.error
        code = exc.code
    return code, capfd.readouterr().err


BAD_ARGUMENTS = [
    *(("--timeout", v) for v in ("-1", "0", "nan", "inf", "1.5", "1e3", "abc", "+5", "1_0")),
    *(("--timeout", v) for v in ("604801", "99999999999999999999", "\u0665")),
    *(("--pids", v) for v in ("-1", "0", "nan", "0.5", "4194305", "99999999999999999999")),
    *(("--cpus", v) for v in ("-1", "0", "nan", "inf", "1e400", "0.001", "1e-300", "1025", "x")),
    *(("--memory", v) for v in ("-1", "0", "5m", "1k", "nan", "1t", "99999999999999999999g")),
    ("--memory", "263680k"),  # 257.5 MiB: not rounded down to 257
    ("--input", "/dev/zero"),  # never ends: read up to the bound, then refused
    ("--script", "/dev/zero"),
    *(("--scratch", v) for v in ("0", "0k", "1023k", "1025g", "abc")),
    *(("--egress", v) for v in ("x", "host:", ":80", "host:0", "host:65536", "host:abc")),
    *(("--egress", v) for v in ("[::1]", "[1.2.3.4]:80", "a:80:90", "h h:80", "a..b:80")),
    *(("--egress", v) for v in ("\u00fcber.example:80", "a" * 300 + ":80")),
    ("--agent", ""),
    ("--agent", "a" * 101),
    ("--task", ""),
    ("--task", "a\tb"),
    ("--tool", ""),
    ("--tool", "t" * 101),
    ("--image", ""),
    ("--approval", ""),
    ("--approval", "x" * 65),
    ("--backend", "nope"),
    ("--input", "/nonexistent/input"),
    ("--api", ""),
    ("--api", "http://127.0.0.1:99999"),
    ("--api", "http://127.0.0.1:abc"),
    ("--api", "http://[::1"),
    ("--api", "http://"),
    ("--api", "http://user:pw@127.0.0.1:1"),
    ("--api", "http://127.0.0.1:1 x"),
]


@pytest.mark.parametrize(("option", "value"), BAD_ARGUMENTS)
def test_a_bad_value_is_a_one_line_usage_error_and_governance_is_not_asked(
    option, value, governance_stub, capfd
):
    """Negative, zero, NaN, infinite, non-numeric or huge limits, a malformed host:port,
    an empty or overlong name, an unusable URL: each was asked of governance (a denial on
    record, 77; or 69 from a URL that could never work), or ended in a traceback. Now
    each is 64 with one line naming the argument, and nothing is sent."""
    url, asked = governance_stub
    argv = ["run", "--agent", "coder", "--backend", "bubblewrap", "--api", url]
    code, err = _exit_of([*argv, option, value, "--", "true"], capfd)
    assert code == EXIT_USAGE, err
    assert err.startswith("sandbox_runner: ") and err.count("\n") == 1, err
    assert option in err and "Traceback" not in err
    assert asked == []


@pytest.mark.parametrize("value", ["", "bubblewarp", " bubblewrap", "Docker"])
def test_a_bad_sandbox_backend_variable_is_a_usage_error(
    value, governance_stub, monkeypatch, capfd
):
    """SANDBOX_BACKEND set but empty ran docker; a misspelt one got past argparse (which
    checks no default) and ended as 71 "no backend is called ...". Now it is what the
    same value given as --backend is: 64, one line naming it, nothing asked."""
    url, asked = governance_stub
    monkeypatch.setenv("SANDBOX_BACKEND", value)
    code, err = _exit_of(["run", "--agent", "coder", "--api", url, "--", "true"], capfd)
    assert code == EXIT_USAGE, err
    assert err.startswith("sandbox_runner: SANDBOX_BACKEND=") and err.count("\n") == 1, err
    assert asked == []


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ([], "the command has 257 words; at most 256"),
        (["x" * 4097], "a word of the command is longer than 4096 characters"),
        ([f"--egress=h{i}.example:443" for i in range(65)], "--egress names 65 destinations"),
    ],
)
def test_more_than_governance_takes_is_a_usage_error(extra, said, governance_stub, capfd):
    url, asked = governance_stub
    argv = ["run", "--agent", "coder", "--backend", "bubblewrap", "--api", url, *extra]
    command = ["true"] * (257 if not extra else 1)
    code, err = _exit_of([*argv, "--", *command], capfd)
    assert code == EXIT_USAGE and said in err and err.count("\n") == 1, err
    assert asked == []


@pytest.mark.django_db
@pytest.mark.parametrize("word", ["/workspace/\udcff.txt", "a\x00b"])
def test_a_command_word_that_is_not_utf8_text_is_a_usage_error(
    word, governance_stub, code_exec, capfd
):
    """A file name's non-UTF-8 byte reaches main() as a lone surrogate: in-process its run
    could be neither decided nor recorded (77, `UnicodeEncodeError`, and no event). It is
    a mistake in the command line like any other: 64, one line, nothing asked."""
    url, asked = governance_stub
    code_exec.grant()
    for where in (["--api", url], ["--task", "SBX-1"]):
        argv = ["run", "--agent", "coder", "--backend", "bubblewrap", *where]
        code, err = _exit_of([*argv, "--", "cat", word], capfd)
        assert code == EXIT_USAGE and err.count("\n") == 1, err
        assert "a command word must be UTF-8 text without NUL bytes" in err
    assert asked == []
    assert not SandboxRun.objects.exists()
    assert not AuditEvent.objects.filter(event_type__startswith="access.").exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("option", "value"),
    [("--timeout", "0"), ("--timeout", "-1"), ("--pids", "-1"), ("--cpus", "0"),
     ("--memory", "5m"), ("--egress", "host:0"), ("--agent", ""), ("--task", "")],
)  # fmt: skip
def test_in_process_a_bad_value_writes_nothing(option, value, code_exec, capfd):
    """In-process these were governance's to refuse: a denial (77) and its audit events
    for a mistake in the command line. Now nothing is decided or recorded."""
    code_exec.grant()
    argv = ["run", "--agent", "coder", "--task", "SBX-1", "--backend", "bubblewrap"]
    code, err = _exit_of([*argv, option, value, "--", "true"], capfd)
    assert code == EXIT_USAGE and option in err, err
    assert not SandboxRun.objects.exists()
    assert not AuditEvent.objects.filter(event_type__startswith="access.").exists()
    assert not AuditEvent.objects.filter(event_type__startswith="sandbox.").exists()


def test_good_values_still_reach_governance(governance_stub, capfd):
    """The checks refuse no value a grant could allow: the bounds themselves pass, and
    the stub's 503 is 69 (asked, no answer)."""
    from sandbox_runner.runner import EXIT_UNREACHABLE

    url, asked = governance_stub
    argv = ["run", "--agent", "coder", "--backend", "bubblewrap", "--api", url + "/api/v1/"]
    argv += ["--timeout", "604800", "--pids", "1", "--cpus", "0.01", "--memory", "6m"]
    argv += ["--scratch", "1024g", "--egress", "example.org:443", "[::1]:8080", "--tool", "t"]
    argv += ["--approval", "a" * 64, "--task", "T" * 100, "--", "true"]
    code, err = _exit_of(argv, capfd)
    assert code == EXIT_UNREACHABLE, err
    assert asked == ["/api/v1/sandbox/runs"]


def test_the_limits_bounds_are_governances():
    """One source: the CLI refuses exactly what no grant could hold."""
    from governance.codes import LIMIT_BOUNDS
    from sandbox_runner.spec import LIMIT_MAX, LIMIT_MIN

    assert LIMIT_BOUNDS == {name: (LIMIT_MIN[name], LIMIT_MAX[name]) for name in LIMIT_MIN}
